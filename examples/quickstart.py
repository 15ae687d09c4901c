"""Quickstart: white-box failure attribution on Who&When with SmolLM2.

What it does, end to end:

1. loads the Who&When records (one :class:`skafa.Conversation` each);
2. renders every conversation as one prompt. Records longer than the model's
   context are shortened *visibly* (``PromptTemplate(shorten="middle_first")``:
   the longest turns lose their middles first, a marker says how many characters
   went); the script prints how many conversations were shortened and how many
   characters were removed;
3. reads the model's hidden states at every turn (the read of the recommended
   configuration, :data:`skafa.configurations.RECOMMENDED`), at every site, once
   (one forward pass per conversation; cached on disk);
4. cross-validates the recommended configuration (its probe, with C and the site
   chosen jointly by an inner grouped CV) with an outer
   ``GroupKFold(5)`` over task ids, so every conversation gets one held-out
   prediction, and prints step / agent / within-1 accuracy with 95% bootstrap
   confidence intervals next to position-only and TF-IDF probes on the same folds
   (paired differences) and two rules of thumb;
5. fits :class:`skafa.FailureAttributor` on a training split and explains its
   attribution of one held-out conversation.

Before extracting it prints what it will extract and an ETA (a cost model
calibrated by one timed pass, :meth:`TurnActivationTransformer.estimate_cost`),
then a progress bar per chunk of conversations. Every finished conversation is in
the disk cache at once, so an interrupted run (Ctrl-C) resumes where it stopped
when the same command is run again.

It is an *anytime* job: the conversations are extracted in a seeded random order
(``--seed``), and after the first 16 (``--anytime-first``) and then every 10 more
(``--anytime-every``) it prints an interim estimate, labelled as such ("on 26 of
100 conversations extracted so far"): step 4's cross-validation on the
conversations extracted so far (the same folds by task id, fewer when there are
too few tasks, said), step accuracy with 95% task-bootstrap CIs for the probe,
position-only and TF-IDF, and the paired difference probe - position-only. An
interim estimate is skipped when the interim estimates would take more than 20%
of the run so far (``--anytime-budget``). The running estimate goes to
``anytime.json`` and ``anytime.png`` in ``<cache-dir>/main-job`` (or
``--anytime-out``). Ctrl-C prints the last interim estimate and how to resume.
The final figure does not depend on the order or on the interim estimates: it is
the cross-validation of all conversations in input order, as before; the last line
sets the ETA printed before the run beside the extraction time measured.

The steps live in :mod:`skafa.benchmarks` (:func:`~skafa.benchmarks.prepare_main_job`,
:func:`~skafa.benchmarks.run_main_job`); this script is their command line.

Run it with ``examples/run_main_job.sh`` (sets up the environment) or directly::

    python examples/quickstart.py --limit 20          # smoke run
    python examples/quickstart.py --cache-dir /tmp/skafa-cache
    python examples/quickstart.py --anytime-first 0   # no interim estimates
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from skafa.benchmarks import MainJobSettings, prepare_main_job, run_main_job

REPO = Path(__file__).resolve().parents[1]
log = functools.partial(print, flush=True)


def default_data_path() -> str:
    env = os.environ.get("SKAFA_WHO_AND_WHEN")
    return env if env else str(REPO.parent / "shared" / "data" / "who_and_when")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Cross-validate skafa's activation probe on Who&When and attribute "
                    "one held-out failure.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", default=default_data_path(),
                   help="Who&When folder (env SKAFA_WHO_AND_WHEN overrides the default)")
    p.add_argument("--subset", default="Algorithm-Generated",
                   help="Algorithm-Generated, Hand-Crafted or 'all'")
    p.add_argument("--model", default="smollm2", help="model name or path (skafa.llm.load_model)")
    p.add_argument("--cache-dir", default=str(Path("~/.cache/skafa").expanduser()),
                   help="on-disk activation cache ('' for memory only)")
    p.add_argument("--sites", default="stride:3",
                   help="sites the probe's site search compares: 'stride:K' (every K-th "
                        "resid_pre layer, from 0, plus resid_final), 'all', or a "
                        "comma-separated list such as resid_pre.9,resid_final (the "
                        "recommended configuration searches stride:3)")
    p.add_argument("--limit", type=int, default=None,
                   help="use only the first N records (smoke runs)")
    p.add_argument("--batch-size", type=lambda v: v if v == "auto" else int(v), default=1,
                   help="conversations per forward pass, or 'auto' (from free device memory)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto",
                   help="compute dtype; auto: bfloat16 on a GPU or a CPU with bf16 units")
    p.add_argument("--n-resamples", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="seed of splits and bootstrap")
    p.add_argument("--n-jobs", type=int, default=-1,
                   help="processes for the probe's site search and the baselines' C "
                        "search (-1: all cores); the results do not depend on it")
    p.add_argument("--plan-only", action="store_true",
                   help="print the plan (prompt tokens, FLOPs, ETA from one calibration "
                        "pass) and stop before extracting")
    p.add_argument("--anytime-first", type=int, default=16,
                   help="the first interim estimate (cross-validated on the conversations "
                        "extracted so far) after this many conversations (0: none)")
    p.add_argument("--anytime-every", type=int, default=10,
                   help="then one every this many more conversations")
    p.add_argument("--anytime-budget", type=float, default=0.2,
                   help="skip an interim estimate when the interim estimates would take "
                        "more than this share of the run so far (1: never skip)")
    p.add_argument("--anytime-out", default=None,
                   help="folder of the running estimate anytime.json and anytime.png "
                        "(default: <cache-dir>/main-job; not written without either)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    settings = MainJobSettings(**vars(args))
    try:  # sites the model does not have, prompts that cannot be made to fit
        job = prepare_main_job(settings, log=log)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        return run_main_job(job, log=log)
    except KeyboardInterrupt:
        # said by run_main_job: what is cached, the last interim estimate, how to resume
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
    sys.exit(0)
