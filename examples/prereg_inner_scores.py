"""Inner-CV scores of a pre-registered result: how noisy and how optimistic the choice is.

Reads a ``benchmark_who_and_when.py --preregistered`` result file and prints, from the
``inner_score`` each configuration had in each outer fit (rule step 1's input):
the mean inner score per configuration, how far the chosen configuration led the
runner-up, and how much the inner scores overstate the outer accuracy.

Usage::

    python examples/prereg_inner_scores.py docs/results/prereg_smollm2_Algorithm-Generated.json
"""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np

from skafa.model_selection import read_result


def inner_scores(result):
    """``{"mean_inner", "lead", "optimism"}`` of one result (see the module docstring)."""
    order = result["order"]
    by_config, by_fit = defaultdict(list), defaultdict(list)
    for c in result["choices"]:
        if c["method"] in order and c.get("inner_score") is not None:
            by_config[c["method"]].append(c["inner_score"])
            by_fit[(c["repeat"], c["fold"])].append(c["inner_score"])
    mean_inner = {k: float(np.mean(v)) for k, v in by_config.items()}
    leads = [s[0] - s[1] for s in (sorted(v, reverse=True) for v in by_fit.values())
             if len(s) > 1]
    outer = {k: result["summary"][k]["step_accuracy"]["estimate"] for k in mean_inner}
    return {"mean_inner": mean_inner, "lead": float(np.mean(leads)),
            "optimism": float(np.mean([mean_inner[k] - outer[k] for k in mean_inner]))}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(__doc__)
    out = inner_scores(read_result(argv[0]))
    for name, score in out["mean_inner"].items():
        print(f"{100 * score:5.1f}  {name}")
    print(f"chosen minus runner-up, mean over outer fits: {100 * out['lead']:+.1f} points")
    print(f"mean inner minus outer accuracy, over configurations: "
          f"{100 * out['optimism']:+.1f} points")
    return out


if __name__ == "__main__":
    main()
