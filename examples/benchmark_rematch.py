"""The 1.5B rematch's fixed candidates C28 and C29 (docs/benchmarks.md §7).

C28 stacks the recommended configuration of several readers (each at its own prompt
budget of §3); C29 fits the recommended configuration of one reader on the union of
the Algorithm-Generated and Hand-Crafted training parts of each outer fit. Both are
scored on §3's outer folds and, where the headline's result files
``<prereg-dir>/prereg_<tag>_<subset>.json`` exist (``benchmark_who_and_when.py
--preregistered``), compared with its rows (paired) and judged by rule step 3. The
logic lives in :mod:`skafa.benchmarks` (``run_rematch_candidates``).

Usage (from the repository root)::

    SKAFA_MODELS_DIR=DIR python examples/benchmark_rematch.py --cache-dir CACHE --resume
    python examples/benchmark_rematch.py --smoke          # tiny random models, seconds

Results: ``--out`` (default ``docs/results``) gets ``rematch_<tag>.json`` and ``.md``.
With ``--resume`` every finished outer fit is kept at once in
``<out>/rematch_<tag>_<subset>.partial-<candidate>.json``: run the same command again
after an interruption and only the missing fits are computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

from skafa import load_who_and_when
from skafa.benchmarks import (
    REMATCH_CANDIDATES,
    REMATCH_SUBSETS,
    RematchSettings,
    run_rematch_candidates,
)
from skafa.model_selection import ResultStoreError

REPO = Path(__file__).resolve().parents[1]
log = functools.partial(print, flush=True)
_DEFAULTS = RematchSettings()


def _names(text):
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--reader", default=_DEFAULTS.reader,
                   help="C29's reader and the headline's (its tag names the files)")
    p.add_argument("--ensemble-readers", default=",".join(_DEFAULTS.ensemble_readers),
                   help="C28's readers, comma-separated")
    p.add_argument("--candidates", default=",".join(REMATCH_CANDIDATES),
                   help=f"comma-separated, of {list(REMATCH_CANDIDATES)}")
    p.add_argument("--subsets", default=",".join(REMATCH_SUBSETS))
    p.add_argument("--tag", default=None, help="name in file names (default: the reader's)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/skafa"),
                   help="activation cache (each reader's subset is extracted once)")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--prereg-dir", default=None,
                   help="where the headline's prereg_<tag>_<subset>.json are (default --out)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--n-jobs", type=int, default=1)
    p.add_argument("--n-resamples", type=int, default=2000)
    p.add_argument("--resume", action="store_true",
                   help="keep each finished (candidate, subset, outer fit) in "
                        "<out>/rematch_<tag>_<subset>.partial-<candidate>.json and reuse it")
    p.add_argument("--smoke", action="store_true",
                   help="two tiny random models on synthetic records: checks the wiring only")
    return p.parse_args(argv)


def _smoke(settings):
    """Two tiny registered readers and two synthetic subsets with disjoint task ids."""
    from skafa.llm import register_model
    from skafa.testing import (
        make_conversations,
        make_tiny_llama,
        make_tiny_qwen2,
        make_tiny_tokenizer,
    )

    register_model("rematch-smoke-llama", make_tiny_llama(n_layers=7), make_tiny_tokenizer(),
                   overwrite=True)
    register_model("rematch-smoke-qwen", make_tiny_qwen2(n_layers=7), make_tiny_tokenizer(),
                   overwrite=True)
    ag, hc = REMATCH_SUBSETS
    convs = {ag: make_conversations(20, seed=0),
             hc: [dataclasses.replace(c, task_id=f"hc-{c.task_id}",
                                      record_id=f"hc/{c.record_id}")
                  for c in make_conversations(16, seed=1)]}
    settings = dataclasses.replace(
        settings, reader="rematch-smoke-qwen", smoke=True, subsets=[ag, hc],
        ensemble_readers=["rematch-smoke-llama", "rematch-smoke-qwen"],
        max_prompt_tokens={ag: 512, hc: 384}, folds=2, inner_folds=2, repeats=1,
        n_resamples=200)
    return settings, convs


def main(argv=None):
    args = parse_args(argv)
    settings = RematchSettings(
        reader=args.reader, ensemble_readers=_names(args.ensemble_readers),
        subsets=_names(args.subsets), candidates=_names(args.candidates), tag=args.tag,
        cache_dir=args.cache_dir, out=args.out, prereg_dir=args.prereg_dir,
        dtype=args.dtype, n_jobs=args.n_jobs, n_resamples=args.n_resamples,
        resume=args.resume,
        command=" ".join(["python", "examples/benchmark_rematch.py",
                          *(sys.argv[1:] if argv is None else argv)]))
    if args.smoke:
        settings, convs = _smoke(settings)
    else:
        convs = {s: load_who_and_when(args.data, subset=s).conversations
                 for s in settings.subsets}
    try:
        return run_rematch_candidates(settings, convs, log=log)
    except ResultStoreError as exc:  # a stored or headline file that does not fit this run
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
