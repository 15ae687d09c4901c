"""Time one bare forward pass in float32 and in bfloat16, interleaved, on random tokens.

The figure behind the bfloat16 amendment of docs/benchmarks.md section 3 (Qwen
Hand-Crafted): ``python examples/benchmark_dtype_forward.py --model
DIR/qwen2.5-coder-0.5b-instruct.gguf --tokens 4096 --repeats 2 --threads 1``.

A model given by path is loaded twice, once per dtype. A registered model keeps the dtype
it was registered in, so pass the float32 one as ``--model`` and a bfloat16 copy as
``--bfloat16-model``.
"""
import argparse
import time

import torch

from skafa.llm import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bfloat16-model", default=None,
                   help="the bfloat16 model, when it is not --model cast (registered models)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {"float32": load_model(args.model, dtype="float32")[0],
              "bfloat16": load_model(args.bfloat16_model or args.model, dtype="bfloat16")[0]}
    vocab = min(int(m.config.vocab_size) for m in models.values())
    ids = torch.randint(min(100, vocab - 1), min(20000, vocab), (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    rows = []
    for _ in range(args.repeats):
        for dtype, model in models.items():
            t = time.perf_counter()
            with torch.inference_mode():
                model.model(input_ids=ids)
            rows.append((dtype, time.perf_counter() - t))
            print(f"{args.tokens} tokens, {dtype}: {rows[-1][1]:.1f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
