"""Dense SDPA against banded sliding-window attention (skafa.llm._attention), interleaved.

For each prompt length, one decoder pass with transformers' ``"sdpa"`` (the
sliding-window layers as dense attention under a mask) and one inside
:func:`skafa.llm.banded_sliding_window_attention`, alternating, on the same
random token ids. Prints and writes the seconds of each, their ratio, and how far
the final hidden states differ (max absolute difference over max absolute value).

Run::

    python examples/benchmark_sliding_attention.py --model /path/gemma-3-270m-q4_k_m.gguf \
        --lengths 2048 8192 32768 --threads 1 --out docs/results/sliding_attention.json
    python examples/benchmark_sliding_attention.py --smoke      # tiny random Gemma-3
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model name, folder or .gguf path (a sliding-window model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--repeats", type=int, default=1, help="interleaved pairs per length")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the rows to this JSON file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random Gemma-3 (window 64), short lengths: checks the script")
    return p.parse_args(argv)


def _pass(decoder, ids):
    import torch

    t = time.perf_counter()
    with torch.inference_mode():
        out = decoder(input_ids=ids, use_cache=False).last_hidden_state
    return time.perf_counter() - t, out


def main(argv=None):
    import numpy as np
    import torch

    from skafa.llm import banded_sliding_window_attention, decoder_layout, has_sliding_window

    args = parse_args(argv)
    torch.set_num_threads(int(args.threads))
    if args.smoke:
        from skafa.testing import make_tiny_gemma3

        model, name = make_tiny_gemma3(n_layers=3, max_position_embeddings=1024), "tiny Gemma-3"
        model.config._attn_implementation = "sdpa"
        lengths = [128, 512]
    else:
        if not args.model:
            sys.exit("--model is required (or --smoke)")
        from skafa.llm import load_model

        model, _ = load_model(args.model)
        name, lengths = str(args.model), args.lengths
    if not has_sliding_window(model):
        sys.exit(f"{name} has no sliding-window layers: nothing to compare.")
    decoder = decoder_layout(model).decoder
    vocab = int(model.config.get_text_config().vocab_size)
    rng = np.random.default_rng(args.seed)
    rows = []
    for n in lengths:
        ids = torch.from_numpy(rng.integers(0, vocab, size=(1, int(n))))
        dense_s, banded_s, diff = [], [], 0.0
        for _ in range(max(1, args.repeats)):
            s, dense = _pass(decoder, ids)
            dense_s.append(s)
            with banded_sliding_window_attention(decoder) as used:
                s, banded = _pass(decoder, ids)
            assert used, "the banded implementation was not engaged"
            banded_s.append(s)
            scale = float(dense.abs().max())
            diff = max(diff, float((banded - dense).abs().max()) / scale)
        row = {"n_tokens": int(n), "dense_s": float(f"{min(dense_s):.4g}"),
               "banded_s": float(f"{min(banded_s):.4g}"),
               "speedup": round(min(dense_s) / min(banded_s), 2),
               "max_rel_diff": float(f"{diff:.3g}")}
        rows.append(row)
        print(f"{n:>6} tokens: dense {row['dense_s']:8.2f} s, banded {row['banded_s']:8.2f} s, "
              f"{row['speedup']:.2f}x faster, max |diff| / max |h| = {row['max_rel_diff']:.2g}",
              flush=True)
        if args.out:
            _write(args, name, rows)
    return rows


def _write(args, name, rows):
    import torch

    info = {"model": name, "threads": args.threads, "repeats": args.repeats,
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "python": platform.python_version(), "torch": torch.__version__},
            "command": "python examples/benchmark_sliding_attention.py " + " ".join(sys.argv[1:]),
            "rows": rows}
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
