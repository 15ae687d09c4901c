"""Your own framework: transfer between Who&When's two frameworks, learning curves,
adaptation and the shift warning (docs/your-own-framework.md, pre-registered there).

Reads the activations the main job cached (the same extractor: the recommended
configuration's read, every site, prompts shortened visibly), so run the main job on
both subsets first::

    python examples/quickstart.py --subset all --cache-dir /work/cache/skafa
    python examples/benchmark_transfer.py --cache-dir /work/cache/skafa --out docs/results

Writes ``transfer_<model>.json`` (every number of the page), ``transfer_<model>.md``
(its tables) and ``transfer_<model>.png`` (the learning curves) under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
log = functools.partial(print, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cache-dir", required=True, help="the main job's activation cache")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--n-draws", type=int, default=20)
    p.add_argument("--n-resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-jobs", type=int, default=1)
    p.add_argument("--no-curves", action="store_true", help="transfer rows only")
    p.add_argument("--out", default=None, help="folder for the result files")
    return p.parse_args(argv)


def _features(args):
    from skafa import configurations
    from skafa.benchmarks import MainJobSettings, main_job_extractor, prepare_main_job

    job = prepare_main_job(MainJobSettings(data=args.data, subset="all", model=args.model,
                                           cache_dir=args.cache_dir, dtype=args.dtype),
                           log=log)
    extractor = main_job_extractor(job)
    left = extractor.estimate_cost(job.conversations, calibrate=False)
    if left["n_to_extract"]:
        log(f"note: {left['n_to_extract']} conversations are not cached yet; extracting them")
    X = extractor.transform(job.conversations).select_sites(job.sites)
    assert configurations.RECOMMENDED == job.configuration
    return job.conversations, X


def _table(rows, paired=None):
    lines = ["| method | step accuracy [95% CI] | n |", "|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {100 * r['mean']:.1f}% [{100 * r['low']:.1f}, "
                     f"{100 * r['high']:.1f}] | {r['n']} |")
    if paired:
        lines += ["", "| probe (A0) − | difference, points [95% CI] |", "|---|---|"]
        for name, r in paired.items():
            lines.append(f"| {name} | {100 * r['mean']:+.1f} [{100 * r['low']:+.1f}, "
                         f"{100 * r['high']:+.1f}] |")
    return "\n".join(lines)


def _curve_table(curves):
    lines = ["| method | k (mean labelled) | step accuracy [95% CI] | spread over draws "
             "(10th–90th pct) |", "|---|---|---|---|"]
    for method, c in curves.items():
        for r in c["rows"]:
            if not np.isfinite(r["mean"]):
                continue
            lines.append(f"| {method} | {r['size']} ({r['n_labelled']:.1f}) | "
                         f"{100 * r['mean']:.1f}% [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"
                         f" | {100 * r['spread_low']:.1f}–{100 * r['spread_high']:.1f}% |")
    return "\n".join(lines)


def _margin_vs_random(result, n_resamples, seed):
    """Pooled at k = 10: margin order minus random draws, per run, pooled over cells."""
    from skafa.metrics import bootstrap_ci_from_scores

    diffs, groups = [], []
    for key, d in result["directions"].items():
        curves = d.get("curves", {})
        if "pooled" not in curves:
            return None
        sizes = [r["size"] for r in curves["pooled"]["rows"]]
        if 10 not in sizes:
            return None
        margin = curves["pooled, margin order"]["_result"]
        if 10 not in margin.train_sizes:
            return None
        rand = curves["pooled"]["_result"].hits[sizes.index(10)].mean(axis=0)
        marg = margin.hits[margin.train_sizes.index(10)].mean(axis=0)
        diffs.append(marg - rand)
        groups += [f"{key}|{g}" for g in curves["pooled"]["_result"].groups]
    r = bootstrap_ci_from_scores(np.concatenate(diffs), n_resamples=n_resamples,
                                 random_state=seed, groups=np.asarray(groups))
    return {"mean": r.estimate, "low": r.low, "high": r.high, "n": r.n,
            "beats_random": bool(r.low > 0)}


def main(argv=None):
    args = parse_args(argv)
    from skafa.benchmarks import run_transfer_study

    t0 = time.perf_counter()
    convs, X = _features(args)
    frameworks = np.asarray([str(c.record_id).split("/")[0] for c in convs])
    result = run_transfer_study(convs, X, frameworks, model=args.model,
                                n_draws=args.n_draws, n_jobs=args.n_jobs,
                                n_resamples=args.n_resamples, seed=args.seed,
                                curves=not args.no_curves, log=log)
    result["margin_vs_random_k10"] = _margin_vs_random(result, args.n_resamples, args.seed)
    result["command"] = "python examples/benchmark_transfer.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    result["seconds"] = time.perf_counter() - t0
    return write_outputs(result, args.out, args.model, n_resamples=args.n_resamples)


def write_outputs(result, out, model, *, n_resamples=2000):
    """Print the tables; with ``out``, write the JSON, the markdown and the curves' plot."""
    md = [f"# Transfer between Who&When's frameworks — {model}", "",
          f"Command: `{result.get('command', '')}`", ""]
    for key, d in result["directions"].items():
        md += [f"## {key}", "", f"Sites chosen on the source: {'+'.join(d['best_sites'])}, "
               f"{d['best_params']}", "", _table(d["rows"], d["paired"]), "",
               f"Shift warning: {100 * d['shift']['held-out source runs']:.1f}% of "
               f"{d['shift']['n_source']} held-out source runs, "
               f"{100 * d['shift']['target runs']:.1f}% of {d['shift']['n_target']} "
               "target runs.", ""]
        if "curves" in d:
            md += [_curve_table(d["curves"]), ""]
    rule = result["adaptation_rule"]
    md += ["## Adaptation rule (pooled over the cells)", "",
           *(f"- {n} − A0: {100 * r['mean']:+.1f} [{100 * r['low']:+.1f}, "
             f"{100 * r['high']:+.1f}] points (n = {r['n']})"
             for n, r in rule["differences"].items()),
           f"- winner: {rule['winner'] or 'none (adaptation is not the default)'}", ""]
    if result.get("margin_vs_random_k10"):
        m = result["margin_vs_random_k10"]
        md += [f"Margin order − random draws, pooled, k = 10: {100 * m['mean']:+.1f} "
               f"[{100 * m['low']:+.1f}, {100 * m['high']:+.1f}] points (n = {m['n']}): "
               + ("beats random." if m["beats_random"] else "does not beat random."), ""]
    text = "\n".join(md)
    log(text)
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        tag = model.replace("/", "_")
        curves = {k: d.pop("curves", None) for k, d in result["directions"].items()}
        if any(curves.values()):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6))
            for ax, (key, cs) in zip(np.atleast_1d(axes), curves.items()):
                for method, c in cs.items():
                    c["_result"].plot(ax=ax, label=method, n_resamples=n_resamples)
                ax.set_title(f"target: {key.split(' -> ')[1]} (source {key.split(' -> ')[0]})")
            fig.tight_layout()
            fig.savefig(out / f"transfer_{tag}.png", dpi=120)
            plt.close(fig)
            for key, cs in curves.items():
                for c in cs.values():
                    c.pop("_result")
                result["directions"][key]["curves"] = cs
        (out / f"transfer_{tag}.json").write_text(json.dumps(result, indent=1, default=float))
        (out / f"transfer_{tag}.md").write_text(text + "\n")
        log(f"wrote {out}/transfer_{tag}.json, .md" + (", .png" if any(curves.values()) else ""))
    return result


if __name__ == "__main__":
    main()
