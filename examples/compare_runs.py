"""Paired comparison of two benchmark runs on the same records.

``benchmark_who_and_when.py`` writes per-conversation predictions into its result
JSON. This script scores the methods two such runs share (e.g. ``--read last`` vs
``--read mean``) on the same conversations and reports, per method, the paired
difference in step accuracy with a 95% bootstrap CI that resamples whole tasks
(each conversation's score averaged over the repeats first, as in the benchmark).

Usage::

    python examples/compare_runs.py A.json B.json [--methods probe "probe + position"]

Labels and task ids come from the JSON; result files written before they were stored
there are matched to ``--data`` (the Who&When folder) by record id.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from skafa.model_selection import read_result

REPO = Path(__file__).resolve().parents[1]


def _labels(run, data):
    if "y_true" in run and "task_ids" in run:
        return np.asarray(run["y_true"]), np.asarray(run["task_ids"], dtype=object)
    import skafa

    convs = {c.record_id: c for c in
             skafa.load_who_and_when(data, subset=run["subset"]).conversations}
    missing = [r for r in run["record_ids"] if r not in convs]
    if missing:
        raise ValueError(f"{len(missing)} record ids of the run are not in {data} "
                         f"(first: {missing[0]!r}).")
    picked = [convs[r] for r in run["record_ids"]]
    return (np.array([c.mistake_step for c in picked]),
            np.array([c.task_id for c in picked], dtype=object))


def compare(a, b, *, methods=None, data=None, n_resamples=2000, seed=0):
    """Per shared method: accuracy in A, in B, and the paired difference A - B."""
    from skafa.metrics import bootstrap_ci_from_scores

    for run, name in ((a, "A"), (b, "B")):
        if "predictions" not in run:
            raise ValueError(f"run {name} has no per-conversation predictions; re-run "
                             "benchmark_who_and_when.py to write them.")
    if a.get("record_ids") != b.get("record_ids"):
        raise ValueError("the two runs are not on the same records in the same order.")
    y, groups = _labels(a, data)
    shared = [m for m in a["predictions"] if m in b["predictions"]]
    if methods:
        unknown = [m for m in methods if m not in shared]
        if unknown:
            raise ValueError(f"methods not in both runs: {unknown}; shared: {shared}.")
        shared = list(methods)
    rows = {}
    for m in shared:
        sa = (np.asarray(a["predictions"][m]) == y).mean(axis=0)
        sb = (np.asarray(b["predictions"][m]) == y).mean(axis=0)
        r = bootstrap_ci_from_scores(sa - sb, n_resamples=n_resamples, random_state=seed,
                                     groups=groups)
        rows[m] = {"a": float(sa.mean()), "b": float(sb.mean()),
                   "diff": float(r.estimate), "low": float(r.low), "high": float(r.high)}
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="result JSON of run A")
    p.add_argument("b", help="result JSON of run B")
    p.add_argument("--methods", nargs="+", default=None)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--n-resamples", type=int, default=2000)
    args = p.parse_args(argv)
    a, b = (read_result(f) for f in (args.a, args.b))
    rows = compare(a, b, methods=args.methods, data=args.data, n_resamples=args.n_resamples)
    print(f"A = {a.get('tag')} (read={a.get('read', 'last')}), "
          f"B = {b.get('tag')} (read={b.get('read', 'last')}); n = {len(a['record_ids'])}\n")
    print("| method | A step acc % | B step acc % | A - B, points [95% CI] |")
    print("|---|---|---|---|")
    for m, r in rows.items():
        print(f"| {m} | {100 * r['a']:.1f} | {100 * r['b']:.1f} | {100 * r['diff']:+.1f} "
              f"[{100 * r['low']:+.1f}, {100 * r['high']:+.1f}] |")
    return rows


if __name__ == "__main__":
    main()
