"""How close the printed ETA of an extraction is to the time it then took.

Renders the prompts of a Who&When subset as one extraction would (``--read``,
``--max-prompt-tokens``, ``shorten="middle_first"``), counts their FLOPs
(:func:`skafa.llm.forward_flops`) and prints two projections of the extraction's
time on this machine: one 512-token rate for every FLOP (skafa before 2026-12-06)
and :func:`skafa.llm.calibrate_seconds` (the attention term priced apart from a
second, longer timed pass; what ``TurnActivationTransformer.estimate_cost`` and
the main job's plan print now). With ``--measured-s`` (the seconds the real
extraction took, e.g. from its log) it prints each projection's ratio to it.
Run it with the threads the extraction had (``OMP_NUM_THREADS``) and nothing else
on the cores; ``--workers`` divides by the extraction's worker processes.

Usage (the two checks of docs/benchmarks.md §6)::

    OMP_NUM_THREADS=2 python examples/benchmark_eta.py --model smollm2 --read echo \\
        --dtype bfloat16 --measured-s 1263.8
    OMP_NUM_THREADS=1 SKAFA_MODELS_DIR=DIR python examples/benchmark_eta.py \\
        --model qwen2.5-coder-1.5b --read last --dtype bfloat16 --workers 2 --measured-s 2842
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", default=os.environ.get("SKAFA_WHO_AND_WHEN",
                                                    "../shared/data/who_and_when"))
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--read", default="echo", choices=["last", "mean", "recap", "echo"])
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes of the extraction (the projection divides by it)")
    p.add_argument("--measured-s", type=float, default=None,
                   help="seconds the extraction took, to compare with")
    args = p.parse_args(argv)

    from skafa import PromptTemplate, load_who_and_when
    from skafa.llm import TurnActivationTransformer, cpu_description

    convs = load_who_and_when(args.data, subset=args.subset).conversations
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=args.max_prompt_tokens)
    with tempfile.TemporaryDirectory() as empty:  # an empty cache: every prompt is priced
        t = TurnActivationTransformer(args.model, read=args.read, prompt=template,
                                      dtype=args.dtype, cache_dir=empty).fit(convs)
        est = t.estimate_cost(convs)
    one_rate = est["flops_to_extract"] / est["flops_per_s"] / args.workers
    two = est["eta_s"] / args.workers
    print(f"machine: {cpu_description()}; torch threads {os.environ.get('OMP_NUM_THREADS')}")
    print(est["summary"])
    for name, s in (("one 512-token rate", one_rate), ("two lengths (skafa)", two)):
        ratio = (f", {s / args.measured_s:.2f} x the measured {args.measured_s:.0f} s"
                 if args.measured_s else "")
        print(f"{name}: {s / 60:.1f} min over {args.workers} worker(s){ratio}")


if __name__ == "__main__":
    main()
