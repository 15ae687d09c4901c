"""Who&When benchmark: probes next to honest baselines, nested CV, bootstrap CIs.

Every method is evaluated on the SAME outer folds: ``GroupKFold(5)`` by task id,
repeated over ``--repeats`` shuffles of the fold assignment. Every choice a method
makes (site, C, ...) is made on inner ``GroupKFold`` folds of the outer training
part only. Reported per method: step accuracy, agent accuracy (three matching
rules), within-1 accuracy, mean absolute step shift, n, 95% cluster-bootstrap CIs
(resampling task ids), and the paired difference of each probe against the best
baseline.

Usage (from the repository root)::

    python examples/benchmark_who_and_when.py --model smollm2 --subset Algorithm-Generated
    python examples/benchmark_who_and_when.py --model /path/qwen2.5-coder-0.5b-instruct.gguf \\
        --tag qwen-coder-0.5b --subset Algorithm-Generated
    python examples/benchmark_who_and_when.py --smoke        # tiny random model, seconds
    python examples/benchmark_who_and_when.py --smoke --scheduler local:2   # fits on Dask

With ``--scheduler`` (a Dask scheduler address, or ``local:N`` for a
``distributed.LocalCluster`` of N single-threaded worker processes) every fit of
the nested CV (``SiteSelector``, ``GridSearchCV``) and the extraction run through
joblib's Dask backend; the numbers are the same as a serial run's.

Results go to ``--out`` (default ``docs/results``): ``<tag>_<subset>.json``,
``<tag>_<subset>.md`` (tables) and ``<tag>_<subset>_sites.png`` (per-site curve).
Activations go through skafa's disk cache (``--cache-dir``), so a re-run does no
forward pass; the PromptedJudge's scores are cached next to them.

The logic lives in :mod:`skafa.benchmarks` (this cell's runs) over
:mod:`skafa.model_selection` (outer/inner CV, bootstrap tables, result stores, the
pre-registered rule); this script is its command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

import skafa
from skafa.benchmarks import BenchmarkSettings, dask_backend, run_benchmark
from skafa.configurations import PREREGISTERED_READS
from skafa.model_selection import ResultStoreError

REPO = Path(__file__).resolve().parents[1]
log = functools.partial(print, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a .gguf path, folder or hub id")
    p.add_argument("--tag", default=None, help="label used in file names and tables")
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--limit", type=int, default=None, help="first N records only")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/skafa"))
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--max-prompt-tokens", type=int, default=8192,
                   help="prompt budget; longer prompts are shortened (middle of the longest "
                        "turns first) and counted. Capped at the model's context.")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--inner-folds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--Cs", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    p.add_argument("--sites", default=None,
                   help="sites the probes search: 'all' (2L+1), 'stride:K' (every K-th "
                        "resid_pre layer + resid_final) or a comma-separated list; default "
                        "'all', and 'stride:3' with --preregistered (section 3)")
    p.add_argument("--read", choices=["last", "mean", "recap", "echo"], default="last",
                   help="turn vector: last token of the turn, mean over the turn's line, "
                        "the turn's recap line after the transcript, or the turn in a "
                        "second copy of the transcript")
    p.add_argument("--n-jobs", type=int, default=None,
                   help="joblib n_jobs of the fits and the extraction (default 1; -1 with "
                        "--scheduler)")
    p.add_argument("--scheduler", default=None,
                   help="run fits and extraction on Dask: a scheduler address "
                        "(tcp://host:8786) or local:N for a LocalCluster of N processes")
    p.add_argument("--n-resamples", type=int, default=2000)
    p.add_argument("--dtype", default="auto",
                   choices=("auto", "float32", "bfloat16", "float16", "float64"),
                   help="the model's dtype for every row that reads it (default auto: "
                        "bfloat16 on CUDA and CPUs with bf16 units, else float32; a dtype "
                        "other than float32 is reported as a deviation of section 3)")
    p.add_argument("--no-judge", action="store_true", help="skip the PromptedJudge baseline")
    p.add_argument("--preregistered", action="store_true",
                   help="run the pre-registered comparison of docs/benchmarks.md section 3 "
                        "(27 configurations, baselines, mi4afa, the auto rule)")
    p.add_argument("--reads", nargs="+", default=list(PREREGISTERED_READS),
                   help="with --preregistered: reads to include (default: all three)")
    p.add_argument("--no-stack", action="store_true", help="with --preregistered: skip "
                   "configuration 9 (stacking)")
    p.add_argument("--no-mi4afa", action="store_true", help="with --preregistered: skip the "
                   "reference implementation (ag2.extensions.mi4afa)")
    p.add_argument("--peer-n", type=int, default=5, help="with --preregistered: records on "
                   "which skafa's and mi4afa's extraction time and memory are measured, "
                   "interleaved and uncached (0: skip)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random model + synthetic conversations (seconds; for CI)")
    p.add_argument("--judge-from", metavar="JSON", default=None,
                   help="with --preregistered: reuse the PromptedJudge predictions of an "
                        "earlier result file (same model, records and prompt fingerprint; "
                        "checked) instead of running the judge again")
    p.add_argument("--extract-only", action="store_true",
                   help="with --preregistered: fill the activation caches (the reads, "
                        "the judge, mi4afa) and stop")
    p.add_argument("--resume", action="store_true",
                   help="with --preregistered: keep each finished (read, outer fit) in "
                        "<out>/prereg_<tag>_<subset>.partial-<read>.json and reuse it")
    args = p.parse_args(argv)
    if args.sites is None:
        # the tiny --smoke model has too few layers for stride:3 and top-3 sites
        args.sites = "stride:3" if args.preregistered and not args.smoke else "all"
    if args.n_jobs is None:
        args.n_jobs = -1 if args.scheduler else 1
    fields = {f.name for f in dataclasses.fields(BenchmarkSettings)}
    settings = BenchmarkSettings(**{k: v for k, v in vars(args).items() if k in fields})
    if args.smoke:
        from skafa.llm import register_model
        from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

        register_model("tiny-llama-benchmark", make_tiny_llama(n_layers=2),
                       make_tiny_tokenizer(), overwrite=True)
        convs = make_conversations(40, min_turns=3, max_turns=6, seed=0)
        settings = dataclasses.replace(
            settings, model="tiny-llama-benchmark", tag=args.tag or "smoke", folds=2,
            inner_folds=2, repeats=1, Cs=[0.1], n_resamples=200, max_prompt_tokens=512,
            peer_n=min(args.peer_n, 2), command="python examples/benchmark_who_and_when.py --smoke")
        subset_label = "synthetic"
    else:
        data = skafa.load_who_and_when(args.data, subset=args.subset)
        convs = data.conversations[: args.limit] if args.limit else data.conversations
        subset_label = args.subset
        settings.command = ("python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
                            if argv is None else
                            "python examples/benchmark_who_and_when.py " + " ".join(argv))
    try:
        with dask_backend(args.scheduler, log=log):
            return run_benchmark(settings, convs, subset_label=subset_label, log=log)
    except ResultStoreError as exc:  # a stored result that does not fit this run
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
