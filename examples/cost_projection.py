"""What extracting a bigger data set would cost: the cost model, measured rates, projections.

For each model: the decoder's size (weights inside the layers, layers, attention
width), the prompt lengths of the shared Who&When records under the model's own
tokenizer (Algorithm-Generated and Hand-Crafted, capped at ``--max-prompt-tokens``
as the benchmark shortens them), the FLOPs of one forward pass per record
(:func:`skafa.llm.forward_flops`), and a rate measured on this machine
(:func:`skafa.llm.measure_throughput` on a random ``--calibration-tokens`` sequence,
``--threads`` torch threads). From these: the time to extract data sets of
2,276 runs (AFTraj-2K) and 12,326 runs (Who&When-Pro) *if their runs are as long as
Who&When's* on one CPU core, on N CPU workers (N times the one-core rate: workers
share nothing but the cache) and on one GPU at an **assumed** effective rate
(``--gpu-tflops``; no GPU was measured by this script).

Usage::

    OMP_NUM_THREADS=1 python examples/cost_projection.py --threads 1 \\
        --model smollm2 --model /work/models/qwen2.5-coder-0.5b-instruct.gguf
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATASETS = {"AFTraj-2K": 2276, "Who&When-Pro": 12326}


def meta_model(spec):
    """The model's architecture with weights on the meta device (no memory, no load)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from skafa.llm import resolve_model_spec

    ms = resolve_model_spec(spec)
    kw = {"gguf_file": ms.gguf_file} if ms.gguf_file else {}
    config = AutoConfig.from_pretrained(ms.source, **kw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), ms, kw


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    p.add_argument("--gpu-tflops", type=float, default=100.0,
                   help="ASSUMED effective bf16 rate of one GPU for the projection")
    p.add_argument("--no-measure", action="store_true", help="skip the timed passes")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    import skafa
    from skafa.llm import (
        PromptTemplate,
        forward_flops,
        layer_parameters,
        load_model,
        measure_throughput,
    )

    torch.set_num_threads(args.threads)
    started = datetime.datetime.now()
    load0 = os.getloadavg()
    convs = []
    for subset in ("Algorithm-Generated", "Hand-Crafted"):
        convs += list(skafa.load_who_and_when(args.data, subset=subset).conversations)
    rows = []
    for spec in args.model or ["smollm2"]:
        model, ms, kw = meta_model(spec)
        tok = AutoTokenizer.from_pretrained(ms.source, **kw)
        cfg = model.config
        budget = min(args.max_prompt_tokens, cfg.max_position_embeddings)
        prompt = PromptTemplate()
        n = np.array([min(prompt.encode(c, tok).n_tokens, budget) for c in convs])
        flops = forward_flops(model, n)
        row = {"model": str(spec), "n_layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
               "P_layers": layer_parameters(model), "budget": budget,
               "n_records": len(n), "tokens_mean": float(n.mean()),
               "tokens_median": float(np.median(n)), "flops_mean": float(flops.mean()),
               "quadratic_share": float(1 - (2 * n * layer_parameters(model)).sum()
                                        / flops.sum())}
        if not args.no_measure:
            real, _ = load_model(spec)
            rate = measure_throughput(real, n_tokens=args.calibration_tokens, repeats=2)
            row.update(rate)
            del real
        rows.append(row)
        print(json.dumps(row), flush=True)
    load1 = os.getloadavg()

    lines = [
        f"- Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python "
        f"examples/cost_projection.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"{started:%Y-%m-%d %H:%M}",
        f"- Machine: {platform.platform()}, os.cpu_count()={os.cpu_count()}, torch "
        f"{torch.__version__}, {args.threads} thread(s); load average {load0[0]:.1f} at start, "
        f"{load1[0]:.1f} at end (shared machine: the measured rates are pessimistic)",
        f"- Records: {rows[0]['n_records']} Who&When runs (Algorithm-Generated + Hand-Crafted), "
        f"prompts capped at the budget as the benchmark shortens them",
        "",
        "| model | layers x width | weights in layers | prompt tokens (mean / median) | "
        "GFLOP per run (mean) | share of the n² term | measured rate (1 CPU core) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = (f"{r['tokens_per_s']:.0f} tokens/s, {r['flops_per_s'] / 1e9:.1f} GFLOP/s "
                f"at {r['n_tokens']} tokens" if "tokens_per_s" in r else "not measured")
        lines.append(f"| {r['model']} | {r['n_layers']} x {r['hidden']} | "
                     f"{r['P_layers'] / 1e6:.0f} M | {r['tokens_mean']:.0f} / "
                     f"{r['tokens_median']:.0f} | {r['flops_mean'] / 1e9:.0f} | "
                     f"{100 * r['quadratic_share']:.0f}% | {rate} |")
    lines += ["", "Projected extraction time (hours) if the runs are as long as Who&When's:", "",
              "| model | data set (runs) | 1 CPU core (measured rate) | "
              + " | ".join(f"{w} CPU workers" for w in args.workers)
              + f" | 1 GPU at an assumed {args.gpu_tflops:.0f} TFLOP/s (projection) |",
              "|---|---|---:|" + "---:|" * len(args.workers) + "---:|"]
    for r in rows:
        for name, size in DATASETS.items():
            total = r["flops_mean"] * size
            cpu = total / r["flops_per_s"] / 3600 if "flops_per_s" in r else float("nan")
            gpu = total / (args.gpu_tflops * 1e12) / 3600
            lines.append(f"| {r['model']} | {name} ({size:,}) | {cpu:.1f} | "
                         + " | ".join(f"{cpu / w:.2f}" for w in args.workers)
                         + f" | {gpu:.3f} |")
    text = "\n".join(lines) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
