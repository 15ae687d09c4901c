"""Locator heads and grafting on Who&When: the pre-registered comparison (docs/benchmarks.md §8).

The rows (locator-head probe, top locator head, grafted judge, prompted judge, the
recommended probe, position-only, TF-IDF, most frequent), the inner-fold choices and
the questions are fixed in docs/benchmarks.md §8; the logic lives in
:mod:`skafa.benchmarks` (``run_locator_benchmark``).

Usage (from the repository root)::

    python examples/benchmark_locators.py --model smollm2 --subset Algorithm-Generated
    python examples/benchmark_locators.py --smoke          # tiny random model, seconds
    python examples/benchmark_locators.py --model smollm2 --cache-dir CACHE --extract-only
    python examples/benchmark_locators.py --model smollm2 --cache-dir CACHE --resume
    python examples/benchmark_locators.py --model smollm2 --recheck-grafts 20

Results: ``--out`` (default ``docs/results``) gets ``locators_<tag>_<subset>.json`` and
``.md``. With ``--resume`` every finished outer fit of every row is kept at once in
``<out>/locators_<tag>_<subset>.partial-<row>.json`` (and the grafted judge's head
statistics and graft scores, conversation by conversation, in
``...partial-grafted_judge-scores.json``, and the per-head heatmap's summary in
``...partial-locator_heads.json``): run the same command again after
an interruption and only the missing fits are computed (the whole-set passes only for
rows that still need them). ``--extract-only`` fills ``--cache-dir`` with the
head-attention features and the recommended configuration's activations and stops.
``--recommended-from STORE`` reads the recommended row's outer fits from §3's fit store
of the same cell (checked) instead of running its feature pass.
``--keep-kv`` (with ``--resume`` and ``--cache-dir``) keeps the grafted judge's prompt
KV caches in the cache folder until their grafts are done, beyond the run.
``--recheck-grafts N`` computes N graft scorings of the committed store again and
compares them with it, bit for bit (a check that resumed stores are exact).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from skafa import load_who_and_when
from skafa.benchmarks import LOCATOR_ROWS, LocatorBenchmarkSettings, run_locator_benchmark

REPO = Path(__file__).resolve().parents[1]
log = functools.partial(print, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated",
                   choices=("Algorithm-Generated", "Hand-Crafted"))
    p.add_argument("--model", default="smollm2", help="short name, .gguf file or folder")
    p.add_argument("--tag", default=None, help="name in result files (default: the model's short name or file name)")
    p.add_argument("--cache-dir", default=None, help="activation cache (resumable)")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rows", default=",".join(LOCATOR_ROWS),
                   help="rows to run (leaving one out is a deviation, named in the result)")
    p.add_argument("--n-resamples", type=int, default=2000)
    p.add_argument("--resume", action="store_true",
                   help="keep each finished (row, outer fit) in "
                        "<out>/locators_<tag>_<subset>.partial-<row>.json and reuse it")
    p.add_argument("--extract-only", action="store_true",
                   help="fill --cache-dir with the whole-set feature passes and stop "
                        "(no fits, no result files)")
    p.add_argument("--recheck-grafts", type=int, default=0, metavar="N",
                   help="compute N stored graft scorings of the cell's store again with "
                        "this code, compare them bit for bit with the store, and stop")
    p.add_argument("--keep-kv", action="store_true",
                   help="with --resume and --cache-dir: keep the grafted judge's prompt KV "
                        "caches in the cache folder until their grafts are done, so a run "
                        "interrupted after its head statistics reads no prompt again")
    p.add_argument("--recommended-from", default=None, metavar="STORE",
                   help="read the recommended row's outer fits from §3's fit store of the "
                        "same cell (prereg_<tag>_<subset>.partial-echo.json), checked, "
                        "instead of running its feature pass")
    p.add_argument("--judge-scores-from", default=None, metavar="STORE",
                   help="read the prompted judge's per-conversation scores, where it holds "
                        "them, from another run's judge score store of the same judge "
                        "(e.g. §3's prereg_<tag>_<subset>.partial-judge.json), checked")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model on 20 synthetic records: checks the wiring only")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    settings = LocatorBenchmarkSettings(
        model=args.model, tag=args.tag, subset=args.subset, cache_dir=args.cache_dir,
        out=args.out, max_prompt_tokens=args.max_prompt_tokens, dtype=args.dtype,
        rows=[r.strip() for r in args.rows.split(",") if r.strip()],
        n_resamples=args.n_resamples, resume=args.resume, extract_only=args.extract_only,
        recheck_grafts=args.recheck_grafts, keep_kv=args.keep_kv,
        recommended_from=args.recommended_from,
        judge_scores_from=args.judge_scores_from,
        command=" ".join(["python"] + sys.argv))
    if args.smoke:
        from skafa.llm import register_model
        from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

        register_model("locators-smoke", make_tiny_llama(n_layers=7), make_tiny_tokenizer(),
                       overwrite=True)
        settings.model, settings.smoke, settings.n_resamples = "locators-smoke", True, 200
        settings.folds, settings.inner_folds, settings.repeats = 2, 2, 1
        convs = make_conversations(20, seed=0)
    else:
        convs = load_who_and_when(args.data, subset=args.subset).conversations
    return run_locator_benchmark(settings, convs, log=log)


if __name__ == "__main__":
    main()
