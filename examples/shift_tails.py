"""Which threshold of the shift detector flags what, on Who&When's two frameworks.

A post-hoc look (docs/your-own-framework.md, "The shift warning"): for each subset as
the training framework, fit ``ShiftDetector`` on its runs at the sites the transfer study
chose there, then count the runs flagged by the upper and by the lower threshold, on the
training runs themselves (in-sample) and on the other subset. Reads the main job's cache::

    python examples/quickstart.py --subset all --cache-dir /work/cache/skafa
    python examples/shift_tails.py --cache-dir /work/cache/skafa
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--result", default=str(REPO / "docs" / "results" / "transfer_smollm2.json"),
                   help="the transfer study's result file (its chosen sites)")
    args = p.parse_args(argv)
    from skafa.benchmarks import MainJobSettings, main_job_extractor, prepare_main_job
    from skafa.domain import ShiftDetector

    job = prepare_main_job(MainJobSettings(data=args.data, subset="all", model="smollm2",
                                           cache_dir=args.cache_dir))
    X = main_job_extractor(job, verbose=0).transform(job.conversations).select_sites(job.sites)
    fw = np.array([str(c.record_id).split("/")[0] for c in job.conversations])
    result = json.loads(Path(args.result).read_text())
    for key, d in result["directions"].items():
        src = key.split(" -> ")[0]
        s, t = np.flatnonzero(fw == src), np.flatnonzero(fw != src)
        det = ShiftDetector(sites=d["best_sites"]).fit(
            X[s], groups=[job.conversations[i].task_id for i in s])
        own, other = det.score_samples(X[s]), det.score_samples(X[t])
        print(f"trained on {src}: thresholds {det.lower_threshold_:.2f} / "
              f"{det.threshold_:.2f}; training runs in-sample flagged "
              f"{np.mean((own > det.threshold_) | (own < det.lower_threshold_)):.1%} "
              f"(lower {np.mean(own < det.lower_threshold_):.1%}); other framework: upper "
              f"{np.mean(other > det.threshold_):.1%}, lower "
              f"{np.mean(other < det.lower_threshold_):.1%}, median score "
              f"{np.median(other):.1f}")


if __name__ == "__main__":
    main()
