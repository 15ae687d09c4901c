"""Roofline ratio: extraction's achieved FLOP/s against this CPU's sustained GEMM rate.

Per compute dtype (float32; bfloat16 only where :func:`skafa.llm.cpu_has_bf16` says the
CPU has bfloat16 units), in this order, so that the machine's state is sampled around
the extraction:

1. **GEMM** — ``torch.nn.functional.linear`` (what ``nn.Linear`` calls) at the model's
   shapes for ``--gemm-tokens`` rows: the q, k, v and o projections
   (``hidden x n_heads*head_dim``, ``hidden x n_kv_heads*head_dim``) and the MLP's gate,
   up (``hidden x intermediate``) and down (``intermediate x hidden``) products, each
   warmed up, then called ``--repeats`` times back to back; the sustained rate is the
   FLOP-weighted one, ``sum(2 m n k) / sum(seconds)`` over one layer's products.
2. **Extraction** — ``TurnActivationTransformer(model, sites="stride:3", read="echo",
   prompt=PromptTemplate(shorten="middle_first", max_prompt_tokens=N), dtype=dtype,
   memory_cache=False).fit(convs).transform(convs)`` on the first ``--n-records``
   Who&When records of ``--subset`` (no cache; the model is loaded beforehand, so loading
   is not timed); its FLOPs are skafa's cost model
   (``estimate_cost(convs, calibrate=False)["flops_to_extract"]``, i.e.
   :func:`skafa.llm.forward_flops` of every prompt: the weights' ``2 n P`` term plus the
   causal attention term), and its achieved rate is FLOPs / seconds.
3. **GEMM** again.

The ratio is extraction / the mean of the two GEMM figures. The kernel column is what
the GEMMs actually ran on, seen from a child process with ``MKL_VERBOSE=1`` and
``ONEDNN_VERBOSE=1`` (e.g. ``MKL SGEMM`` for float32, oneDNN's
``brg_matmul:avx512_core_bf16`` for bfloat16), and which path skafa gives a bfloat16
model (PyTorch's native kernel, or float32's kernel through
:func:`skafa.llm.bf16_matmul_via_float32` on CPUs without bfloat16 units).

Usage (docs/benchmarks/extraction-speed.md, "Roofline ratio on this CPU")::

    OMP_NUM_THREADS=2 python examples/benchmark_roofline.py --model smollm2 --n-records 4

``--smoke`` runs the same on a tiny random Llama and two synthetic conversations (for the
tests; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

SMOKE_MODEL = "skafa-roofline-tiny"
COLUMNS = ("dtype", "kernel", "GEMM GFLOP/s (sustained, before)",
           "GEMM GFLOP/s (sustained, after)", "extraction GFLOP/s", "extraction / GEMM")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model name, .gguf file or folder")
    p.add_argument("--data", default=os.environ.get("SKAFA_WHO_AND_WHEN",
                                                    "../shared/data/who_and_when"))
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--n-records", type=int, default=4, help="first records of the subset")
    p.add_argument("--max-prompt-tokens", type=int, default=2048,
                   help="PromptTemplate(shorten='middle_first', max_prompt_tokens=N)")
    p.add_argument("--sites", default="stride:3")
    p.add_argument("--read", default="echo", choices=["last", "mean", "recap", "echo"])
    p.add_argument("--gemm-tokens", type=int, default=2048,
                   help="rows (sequence length) of the timed products")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per GEMM shape")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per GEMM shape")
    p.add_argument("--dtypes", nargs="+", default=None, choices=["float32", "bfloat16"],
                   help="default: float32, and bfloat16 where the CPU has bfloat16 units")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random model and 2 synthetic conversations (tests)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- shapes
def gemm_shapes(config, n_tokens):
    """``[(name, m, k, n)]``: one decoder layer's weight products for ``n_tokens`` rows."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    q = heads * head_dim
    inter = int(config.intermediate_size)
    m = int(n_tokens)
    return [("q_proj", m, hidden, q), ("k_proj", m, hidden, kv), ("v_proj", m, hidden, kv),
            ("o_proj", m, q, hidden), ("gate_proj", m, hidden, inter),
            ("up_proj", m, hidden, inter), ("down_proj", m, inter, hidden)]


def time_gemms(shapes, dtype, *, repeats, warmup, seed=0):
    """Sustained rate of ``F.linear`` at ``shapes``: FLOP-weighted over the shapes."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    per_shape, total_flops, total_s = {}, 0.0, 0.0
    with torch.inference_mode():
        for name, m, k, n in shapes:
            x = torch.randn(m, k, generator=gen).to(dt)
            w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dt)
            for _ in range(max(0, warmup)):
                F.linear(x, w)
            start = time.perf_counter()
            for _ in range(max(1, repeats)):
                F.linear(x, w)
            s = time.perf_counter() - start
            flops = 2.0 * m * n * k * max(1, repeats)
            per_shape[name] = flops / s / 1e9
            total_flops += flops
            total_s += s
    return {"gflops": total_flops / total_s / 1e9, "seconds": total_s, "per_shape": per_shape}


# --------------------------------------------------------------------------- kernels
_PROBE = """
import json, sys, torch, torch.nn.functional as F
shapes, dtypes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for d in dtypes:
    print("@@dtype " + d, flush=True)
    for _, m, k, n in shapes:
        F.linear(torch.randn(m, k).to(getattr(torch, d)), torch.randn(n, k).to(getattr(torch, d)))
    print("@@end", flush=True)
"""


def observed_kernels(shapes, dtypes):
    """``{dtype: "kernel(s)"}`` from MKL's and oneDNN's verbose output in a child process."""
    env = dict(os.environ, MKL_VERBOSE="1", ONEDNN_VERBOSE="1", DNNL_VERBOSE="1")
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(shapes),
                              json.dumps(list(dtypes))], env=env, capture_output=True,
                             text=True, timeout=300).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    found, current = {d: [] for d in dtypes}, None
    for line in out.splitlines():
        if line.startswith("@@dtype "):
            current = line.split(" ", 1)[1]
        elif line.startswith("@@end"):
            current = None
        elif current is None:
            continue
        elif line.startswith("MKL_VERBOSE") and "(" in line.split()[1]:
            name = "MKL " + line.split()[1].split("(")[0]
            if name not in found[current]:
                found[current].append(name)
        elif ",primitive,exec," in line:
            fields = line.split(",")
            i = fields.index("exec")
            name = f"oneDNN {fields[i + 2]} {fields[i + 3]}"
            if name not in found[current]:
                found[current].append(name)
    return {d: ", ".join(v) or _inferred_kernel(d) for d, v in found.items()}


def _inferred_kernel(dtype):
    import torch

    if dtype == "float32":
        return ("MKL sgemm (inferred)" if torch.backends.mkl.is_available()
                else "ATen/BLAS (inferred)")
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN bf16 (inferred)"
    return "ATen bf16 (inferred)"


def machine():
    """``lscpu``'s model name and the CPU's bfloat16/AMX flags."""
    name = None
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                   timeout=30).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    from skafa.llm import cpu_description

    flags = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    bf16 = sorted(f for f in flags if "bf16" in f or f.startswith("amx"))
    return (f"{name or cpu_description()}, {os.cpu_count()} logical CPU(s); bfloat16 flags: "
            f"{', '.join(bf16) or 'none'}")


# --------------------------------------------------------------------------- data
def _smoke_model(dtype):
    """A tiny random Llama registered in ``dtype`` (a registered model is used as it is)."""
    import torch

    from skafa.llm import register_model, registered_models
    from skafa.testing import make_tiny_llama, make_tiny_tokenizer

    name = f"{SMOKE_MODEL}-{dtype}"
    if name not in registered_models():
        model = make_tiny_llama(n_layers=2, hidden=64, intermediate=128)
        register_model(name, model.to(getattr(torch, dtype)), make_tiny_tokenizer())
    return name


def _conversations(args):
    if args.smoke:
        from skafa.testing import make_conversations

        return make_conversations(2, seed=0)
    from skafa import load_who_and_when

    return list(load_who_and_when(args.data, subset=args.subset).conversations)[:args.n_records]


def _warm(model):
    """One short decoder pass: one-off lazy initialisation stays out of the timings."""
    import numpy as np
    import torch

    from skafa.llm import decoder_layout

    layout = decoder_layout(model)
    vocab = int(layout.embedding.weight.shape[0])
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, size=(1, 64)))
    with torch.inference_mode():
        layout.decoder(input_ids=ids, use_cache=False)


def extract(model_name, convs, dtype, template, args):
    """Seconds and cost-model FLOPs of one uncached fit + transform."""
    from skafa.llm import TurnActivationTransformer

    def make():
        return TurnActivationTransformer(model_name, sites=args.sites, read=args.read,
                                         prompt=template, dtype=dtype, memory_cache=False)

    est = make().fit(convs).estimate_cost(convs, calibrate=False)
    start = time.perf_counter()
    make().fit(convs).transform(convs)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "flops": est["flops_to_extract"],
            "n_tokens": est["n_tokens_to_extract"], "gflops": est["flops_to_extract"] / seconds
            / 1e9}


# --------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    import torch

    from skafa import PromptTemplate
    from skafa.llm import (
        cpu_has_bf16,
        decoder_layout,
        forward_flops,
        load_model,
        uses_bf16_matmul_via_float32,
    )

    threads = torch.get_num_threads()
    dtypes = args.dtypes or (["float32", "bfloat16"] if cpu_has_bf16() else ["float32"])
    names = {d: _smoke_model(d) if args.smoke else args.model for d in dtypes}
    budget = min(args.max_prompt_tokens, 512) if args.smoke else args.max_prompt_tokens
    gemm_tokens = min(args.gemm_tokens, 64) if args.smoke else args.gemm_tokens
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    convs = _conversations(args)

    models = {}
    for d in dtypes:  # loaded once per process (load_model caches), before any timing
        t = time.perf_counter()
        models[d] = load_model(names[d], dtype=d)[0]
        print(f"{d}: model ready in {time.perf_counter() - t:.1f} s", file=sys.stderr,
              flush=True)
    config = decoder_layout(models[dtypes[0]]).decoder.config
    shapes = gemm_shapes(config, gemm_tokens)
    kernels = observed_kernels(shapes, dtypes)

    rows = []
    for d in dtypes:
        if d == "bfloat16":
            path = ("skafa: float32 kernel via bf16_matmul_via_float32"
                    if uses_bf16_matmul_via_float32(models[d]) else "skafa: native bf16")
            kernel = f"{kernels[d]} ({path})"
        else:
            kernel = kernels[d]
        _warm(models[d])
        before = time_gemms(shapes, d, repeats=args.repeats, warmup=args.warmup)
        print(f"{d}: GEMM {before['gflops']:.1f} GFLOP/s", file=sys.stderr, flush=True)
        ext = extract(names[d], convs, d, template, args)
        print(f"{d}: extraction {ext['seconds']:.1f} s, {ext['gflops']:.1f} GFLOP/s",
              file=sys.stderr, flush=True)
        after = time_gemms(shapes, d, repeats=args.repeats, warmup=args.warmup)
        print(f"{d}: GEMM {after['gflops']:.1f} GFLOP/s", file=sys.stderr, flush=True)
        gemm = (before["gflops"] + after["gflops"]) / 2
        rows.append({"dtype": d, "kernel": kernel, "gemm_before": before["gflops"],
                     "gemm_after": after["gflops"], "extraction": ext["gflops"],
                     "ratio": ext["gflops"] / gemm, "seconds": ext["seconds"],
                     "flops": ext["flops"], "n_tokens": ext["n_tokens"],
                     "per_shape_before": before["per_shape"],
                     "per_shape_after": after["per_shape"]})

    weights, attention = forward_flops(models[dtypes[0]], gemm_tokens, split=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    command = ("python examples/benchmark_roofline.py " + " ".join(argv)).strip()
    omp = os.environ.get("OMP_NUM_THREADS")
    lines = [
        f"- command: `{'OMP_NUM_THREADS=' + omp + ' ' if omp else ''}{command}`",
        f"- machine: {machine()}",
        f"- date: {now:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, "
        f"{threads} torch thread(s)",
        f"- model: {names[dtypes[0]]} ({len(decoder_layout(models[dtypes[0]]).layers)} layers, "
        f"hidden {config.hidden_size}, intermediate {config.intermediate_size}); GEMMs at "
        f"{gemm_tokens} rows, {args.warmup} warm-up + {args.repeats} timed calls per shape",
        f"- extraction: {len(convs)} conversation(s), {rows[0]['n_tokens']:,} prompt tokens "
        f"(read={args.read}, sites={args.sites}, max_prompt_tokens={budget}), "
        f"{rows[0]['flops'] / 1e12:.3f} TFLOP by skafa's cost model",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['kernel']} | {r['gemm_before']:.1f} | "
                     f"{r['gemm_after']:.1f} | {r['extraction']:.1f} | {r['ratio']:.2f} |")
    lines += ["", "Extraction seconds: " + "; ".join(
        f"{r['dtype']} {r['seconds']:.1f} s" for r in rows)
        + f". At {gemm_tokens} tokens the attention term is "
        f"{100 * attention / (weights + attention):.0f}% of a pass's FLOPs "
        "(it does not run at the GEMM rate).", "",
        "| GEMM GFLOP/s per shape (before / after) | "
        + " | ".join(f"{n} ({m}x{k}x{nn})" for n, m, k, nn in shapes) + " |",
        "|---|" + "---:|" * len(shapes)]
    for r in rows:
        lines.append(f"| {r['dtype']} | " + " | ".join(
            f"{r['per_shape_before'][n]:.0f} / {r['per_shape_after'][n]:.0f}"
            for n, *_ in shapes) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    return {"rows": rows, "columns": COLUMNS, "report": report, "threads": threads}


if __name__ == "__main__":
    main()
