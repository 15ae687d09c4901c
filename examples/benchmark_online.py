"""Online auditing on Who&When: first alarms with a calibrated false-alarm rate.

Protocols (a) every failed run prefix by prefix and (b) failed runs plus their safe
prefixes, nested CV on the shared outer folds, methods and metrics: see
:mod:`skafa.benchmarks` (``run_online_benchmark``), where the logic lives.

Usage (from the repository root)::

    python examples/benchmark_online.py --model smollm2 --subset Algorithm-Generated
    python examples/benchmark_online.py --model /path/qwen2.5-coder-0.5b-instruct.gguf \\
        --tag qwen2.5-coder-0.5b --subset Algorithm-Generated
    python examples/benchmark_online.py --smoke         # tiny random model, seconds

Results: ``--out`` (default ``docs/results``) gets ``online_<tag>_<subset>.json`` (written
after every outer fold, so a killed run keeps what it finished), ``.md`` and
``_scores.png`` (per-turn alarm scores of a few runs, decisive step marked).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

import skafa
from skafa.benchmarks import (
    TURN_CHAR_GRID,
    OnlineBenchmarkSettings,
    rescore_online,
    run_online_benchmark,
)
from skafa.model_selection import ResultStoreError, read_json

REPO = Path(__file__).resolve().parents[1]
log = functools.partial(print, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tag", default=None)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/skafa"))
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--max-prompt-tokens", type=int, default=8192,
                   help="prompt budget (capped at the model's context)")
    p.add_argument("--max-turn-chars", default="auto",
                   help="per-turn cap (head_tail shortening; each turn on its own, so "
                        "prefixes stay prefixes): an int, 'none', or 'auto' (the largest "
                        f"of {TURN_CHAR_GRID[1:]} with which every prompt fits)")
    p.add_argument("--far", type=float, default=0.05,
                   help="max_false_alarm_rate of the auditor (target FAR on safe prefixes)")
    p.add_argument("--targets", nargs="+", default=["cumulative", "hazard"],
                   choices=["cumulative", "hazard"])
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--inner-folds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--Cs", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    p.add_argument("--sites", default="stride:3",
                   help="'all', 'stride:K' (every K-th resid_pre + resid_final) or a list")
    p.add_argument("--n-jobs", type=int, default=1)
    p.add_argument("--n-resamples", type=int, default=2000)
    p.add_argument("--dtype", default="auto",
                   help="auto: bfloat16 on CUDA and CPUs with bf16 units, else float32")
    p.add_argument("--extract-only", action="store_true",
                   help="fill the activation cache and stop")
    p.add_argument("--resume", action="store_true",
                   help="reuse the outer fits of <out>/online_<tag>_<subset>.partial.json "
                        "(same settings) and run only the missing ones")
    p.add_argument("--smoke", action="store_true", help="tiny random model, synthetic runs")
    p.add_argument("--rescore", metavar="JSON", default=None,
                   help="recompute the tables (CIs and paired differences) of a finished "
                        "result file from its stored predictions; no model, no fit")
    args = p.parse_args(argv)
    try:
        if args.rescore:
            return rescore(Path(args.rescore), n_resamples=args.n_resamples, data=args.data)
        return run(args, argv)
    except (ResultStoreError, ValueError) as exc:  # stored results or prompts that do not fit
        raise SystemExit(str(exc)) from None


def run(args, argv):
    fields = {f.name for f in dataclasses.fields(OnlineBenchmarkSettings)}
    settings = OnlineBenchmarkSettings(**{k: v for k, v in vars(args).items() if k in fields})
    if args.smoke:
        from skafa.llm import register_model
        from skafa.testing import make_tiny_llama, make_tiny_tokenizer

        register_model("tiny-llama-online", make_tiny_llama(n_layers=2), make_tiny_tokenizer(),
                       overwrite=True)
        convs, subset = smoke_conversations(), "synthetic"
        settings = dataclasses.replace(
            settings, model="tiny-llama-online", tag=args.tag or "smoke", folds=2,
            inner_folds=2, repeats=1, Cs=[0.1], n_resamples=200, max_prompt_tokens=512,
            far=0.2, sites="all", command="python examples/benchmark_online.py --smoke")
    else:
        data = skafa.load_who_and_when(args.data, subset=args.subset)
        convs = data.conversations[: args.limit] if args.limit else data.conversations
        subset = args.subset
        settings.command = ("python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
                            if argv is None else
                            "python examples/benchmark_online.py " + " ".join(argv))
    return run_online_benchmark(settings, convs, subset_label=subset, log=log)


def smoke_conversations():
    """The synthetic runs of ``--smoke``."""
    from skafa.testing import make_conversations

    return make_conversations(40, min_turns=3, max_turns=6, seed=0)


def rescore(path, *, n_resamples, data):
    """Recompute the tables of ``path`` from its predictions (records from ``--data``)."""
    subset = read_json(path).get("subset")
    convs = (smoke_conversations() if subset == "synthetic"
             else skafa.load_who_and_when(data, subset=subset).conversations)
    return rescore_online(path, convs, n_resamples=n_resamples, log=log)


if __name__ == "__main__":
    main()
