"""Rule step 2 of the pre-registered comparison (docs/benchmarks.md, section 3).

Reads the result files of ``benchmark_who_and_when.py --preregistered`` and picks the
recommended default: the configuration chosen most often by rule step 1 over all outer
fits of the *complete* Algorithm-Generated cells (ties: the pre-registered order).
A cell is complete when its result states no deviation from section 3 that can change
rule step 1's choices (``choice_deviations``: configurations not run, other sites, folds
or records; a reused or missing judge / mi4afa row changes no choice; older files
without that field count every deviation); incomplete cells are listed and left out, as section 3 says ("the rule is applied to the completed
cells, and the docs say which"). With no complete cell there is no winner yet.

With ``--reader-rule``: rule step 2 of the 1.5B rematch (section 7) on one reader's
Algorithm-Generated cell: its most chosen configuration becomes that reader's
recommendation only if the headline beats position-only with a paired 95% CI above 0
(:func:`skafa.model_selection.reader_rule`).

Usage::

    python examples/apply_prereg_rule.py docs/results/prereg_*_Algorithm-Generated.json
    python examples/apply_prereg_rule.py --reader-rule docs/results/prereg_qwen2.5-coder-1.5b_Algorithm-Generated.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from skafa.model_selection import read_result, reader_rule, tally_rule


def apply_rule(paths):
    """Return ``{"winner", "tally", "complete", "left_out"}`` for the given result files
    (:func:`skafa.model_selection.tally_rule`, rule step 2, over their contents)."""
    try:
        return tally_rule([(path, json.loads(Path(path).read_text())) for path in paths])
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def apply_reader_rule(path):
    """Section 7's rule step 2 on one result file (:func:`skafa.model_selection.reader_rule`)."""
    try:
        return reader_rule(read_result(path))
    except ValueError as exc:
        raise SystemExit(f"{path}: {exc}") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="prereg_<tag>_<subset>.json files")
    p.add_argument("--reader-rule", action="store_true", help="section 7's rule step 2 "
                   "on one reader's Algorithm-Generated cell")
    args = p.parse_args(argv)
    if args.reader_rule:
        if len(args.results) != 1:
            p.error("--reader-rule reads one result file")
        out = apply_reader_rule(args.results[0])
        d = out["paired"]
        for name, count in sorted(out["tally"].items(), key=lambda kv: -kv[1]):
            print(f"  {count:3d}  {name}")
        print(f"headline minus position-only: {100 * d['estimate']:+.1f} points "
              f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]")
        print(f"recommended for this reader (rule step 2, section 7): {out['winner']}"
              if out["winner"] else
              f"no recommendation for this reader: the CI is not above 0 (most chosen: "
              f"{out['most_chosen']})")
        return out
    out = apply_rule(args.results)
    for cell, why in out["left_out"]:
        print(f"left out: {cell}: {why}")
    if out["winner"] is None:
        print("no complete Algorithm-Generated cell: rule step 2 cannot pick a default yet.")
        return out
    print(f"complete cells: {', '.join(out['complete'])}")
    for name, count in sorted(out["tally"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:3d}  {name}")
    print(f"recommended default (rule step 2): {out['winner']}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
