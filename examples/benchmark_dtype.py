"""float32 against bfloat16 on one model: seconds per 1,000 tokens, peak memory, error per site.

On a CPU without bfloat16 units skafa multiplies a bfloat16 model through float32's kernel
(:func:`skafa.llm.bf16_matmul_via_float32`); there a third worker, ``bfloat16-native``, keeps
PyTorch's own bfloat16 kernel (``SKAFA_CPU_BF16=1``), so the report shows what that path
saves, and how far its numbers are from the native kernel's.

One worker process per dtype loads the model (each dtype gets its own peak resident memory,
VmHWM); the parent then alternates forward passes between them (float32, bfloat16, float32,
...). The prompt is the first ``--tokens`` tokens of this Python's ``argparse.py`` (English
and code). Each pass reads ``--sites`` at every token (:class:`skafa.llm.SiteReader`); the
relative L2 error ``||a - b|| / ||a||`` of bfloat16 against float32 is summarised per site
(median and maximum over tokens). Peak memory: the high-water mark of loading (GGUF weights
are dequantised to float32, then cast) and, reset after loading where
``/proc/self/clear_refs`` allows it, that of the forward passes.

Example (docs/results/dtype_qwen2.5-coder-1.5b.md)::

    SKAFA_MODELS_DIR=DIR python examples/benchmark_dtype.py --model qwen2.5-coder-1.5b \\
        --tokens 768 --repeats 2 --threads 1 --out docs/results/dtype_qwen2.5-coder-1.5b.md
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DTYPES = ("float32", "bfloat16")
#: The bfloat16 worker that keeps PyTorch's bfloat16 kernel (only where skafa would not).
NATIVE = "bfloat16-native"


def _status(field):  # a /proc/self/status field in bytes (None off Linux)
    path = Path("/proc/self/status")
    lines = path.read_text().splitlines() if path.exists() else []
    found = [int(ln.split()[1]) * 1024 for ln in lines if ln.startswith(field + ":")]
    return found[0] if found else None


def worker(args):
    """Load the model in ``args.worker``; answer ``run`` and ``quit`` lines on stdin."""
    import torch

    if args.worker == NATIVE:  # before skafa reads it: "this CPU has bfloat16 units"
        os.environ["SKAFA_CPU_BF16"] = "1"
    from skafa.llm import (
        SiteReader,
        decoder_layout,
        load_model,
        parse_site_spec,
        uses_bf16_matmul_via_float32,
    )

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.worker.split("-")[0])
    load_s = time.perf_counter() - t
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    ids = tok(text)["input_ids"][:args.tokens]
    layout = decoder_layout(model)
    sites = list(parse_site_spec(args.sites, layout.n_layers))
    reader = SiteReader(layout, sites)
    input_ids = torch.as_tensor([ids], dtype=torch.long)
    rows, acts = torch.arange(len(ids)), None
    try:  # restart VmHWM from the current RSS, so that the forward peak is its own
        reset = Path("/proc/self/clear_refs").write_text("5") > 0
    except OSError:
        reset = False
    print(json.dumps({"load_s": load_s, "load_hwm": _status("VmHWM"), "n_tokens": len(ids),
            "sites": sites, "hwm_reset": reset,
            "via_float32": uses_bf16_matmul_via_float32(model)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t = time.perf_counter()
        acts = reader.run(input_ids, rows).float().numpy().copy()
        print(json.dumps({"seconds": time.perf_counter() - t}), flush=True)
    np.save(Path(args.save) / f"{args.worker}.npy", acts)
    print(json.dumps({"forward_hwm": _status("VmHWM")}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="short name, .gguf file or folder")
    p.add_argument("--tokens", type=int, default=768)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sites", default="stride:7", help="'all', 'stride:K' or a list")
    p.add_argument("--out", default=None, help="also write the report (markdown) here")
    p.add_argument("--worker", choices=(*DTYPES, NATIVE), help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_dtypes import relative_errors  # one relative error, in one place

    from skafa.llm import cpu_description, cpu_has_bf16

    # where skafa would take float32's kernel for bfloat16, the native kernel too
    variants = DTYPES if cpu_has_bf16() else (*DTYPES, NATIVE)
    tmp = tempfile.mkdtemp(prefix="skafa-dtype-")
    base = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--tokens",
            str(args.tokens), "--threads", str(args.threads), "--sites", args.sites,
            "--save", tmp]
    procs, info, times = {}, {}, {d: [] for d in variants}
    for d in variants:  # one load at a time: the peaks of two loads never add up
        procs[d] = subprocess.Popen([*base, "--worker", d], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        info[d] = json.loads(procs[d].stdout.readline())

    def ask(d, line):
        print(line, file=procs[d].stdin, flush=True)
        return json.loads(procs[d].stdout.readline())

    for r in range(args.repeats):
        for d in variants:
            times[d].append(ask(d, "run")["seconds"])
            print(f"repeat {r + 1}, {d}: {times[d][-1]:.1f} s", file=sys.stderr, flush=True)
    for d in variants:
        info[d].update(ask(d, "quit"))
        procs[d].wait()
    acts = {d: np.load(Path(tmp) / f"{d}.npy") for d in variants}
    shutil.rmtree(tmp)
    err = relative_errors(acts["float32"], acts["bfloat16"])  # (n_tokens, n_sites)
    n, sites, gib = info["float32"]["n_tokens"], info["float32"]["sites"], 1024**3
    lines = [
        f"# float32 vs bfloat16: {args.model}", "",
        f"- command: `python examples/benchmark_dtype.py {' '.join(argv or sys.argv[1:])}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {cpu_description()}",
        f"- prompt: {n} tokens, {args.threads} thread(s), {args.repeats} interleaved repeats",
        "", "| dtype | products | load s | forward s (each repeat) | s per 1,000 tokens (best) "
        "| peak RSS load GiB | peak RSS forward GiB |", "|---|---|---|---|---|---|---|"]
    for d in variants:
        fwd = info[d]["forward_hwm"] if info[d]["hwm_reset"] else None
        kernel = ("float32 kernel" if info[d]["via_float32"]
                  else "native" if d != "float32" else "float32")
        lines.append(
            f"| {d} | {kernel} | {info[d]['load_s']:.0f} "
            f"| {', '.join(f'{s:.1f}' for s in times[d])} "
            f"| {1000 * min(times[d]) / n:.1f} | {info[d]['load_hwm'] / gib:.2f} | "
            + ("n/a" if fwd is None else f"{fwd / gib:.2f}") + " |")
    ratio = min(times["bfloat16"]) / min(times["float32"])
    lines += ["", f"bfloat16 / float32 time (best of each): {ratio:.2f}x"]
    native_err = None
    if NATIVE in variants:
        native_err = relative_errors(acts[NATIVE], acts["bfloat16"])
        lines += [f"bfloat16-native / float32 time (best of each): "
                  f"{min(times[NATIVE]) / min(times['float32']):.2f}x; bfloat16 through "
                  "float32's kernel against the native kernel, relative error per site: "
                  + ", ".join(f"{s} median {100 * np.median(native_err[:, j]):.3f}% max "
                              f"{100 * native_err[:, j].max():.3f}%"
                              for j, s in enumerate(sites))]
    lines += ["",
              "| site | median relative error | max relative error |", "|---|---|---|"]
    lines += [f"| {s} | {100 * np.median(err[:, j]):.2f}% | {100 * err[:, j].max():.2f}% |"
              for j, s in enumerate(sites)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report, encoding="utf-8")
    return {"times": times, "errors": err, "sites": sites, "info": info,
            "native_errors": native_err}


if __name__ == "__main__":
    main()
