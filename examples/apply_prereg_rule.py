"""Rule step 2 of the pre-registered comparison (docs/benchmarks.md, section 3).

Reads the result files of ``benchmark_who_and_when.py --preregistered`` and picks the
recommended default: the configuration chosen most often by rule step 1 over all outer
fits of the *complete* Algorithm-Generated cells (ties: the pre-registered order).
A cell is complete when its result states no deviation from section 3 that can change
rule step 1's choices (``choice_deviations``: configurations not run, other sites, folds
or records; a reused or missing judge / mi4afa row changes no choice; older files
without that field count every deviation); incomplete cells are listed and left out, as section 3 says ("the rule is applied to the completed
cells, and the docs say which"). With no complete cell there is no winner yet.

Usage::

    python examples/apply_prereg_rule.py docs/results/prereg_*_Algorithm-Generated.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from skafa.model_selection import tally_rule


def apply_rule(paths):
    """Return ``{"winner", "tally", "complete", "left_out"}`` for the given result files
    (:func:`skafa.model_selection.tally_rule`, rule step 2, over their contents)."""
    try:
        return tally_rule([(path, json.loads(Path(path).read_text())) for path in paths])
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="prereg_<tag>_<subset>.json files")
    args = p.parse_args(argv)
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
