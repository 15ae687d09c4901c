"""Benchmark skafa's activation extraction against a bare forward pass.

Runs SmolLM2-135M-Instruct (float32, CPU) on Who&When Algorithm-Generated records
and measures, in one run, interleaving the methods record by record and repeating:

(a) a bare decoder forward pass on the same token ids, no hooks
    (``model.model(input_ids)``: embeddings, layers, final norm; no LM head);
(b) :class:`skafa.llm.TurnActivationTransformer` reading all 61 sites,
    without cache (includes rendering and tokenizing the prompt);
(c) the ``output_hidden_states=True`` approach of the design skafa grew from:
    the full causal LM forward (LM head included) keeping every layer's hidden
    states at every token, then gathering the turn positions (31 residual sites;
    ``mlp_in`` sites are not available that way);
(d) peak resident memory above the loaded model's own, per method, in fresh
    subprocesses (:func:`skafa.benchmarks.measure_peak_memory`);
(e) early stopping: all sites up to ``mlp_in.14`` with and without stopping the
    forward pass after the deepest needed layer;
(f) re-transforming the same records from the memory and the disk cache.

Results are written as a markdown table (default ``docs/extraction-benchmark.md``).

Two more modes:

``--peers``
    skafa next to the other ways of reading the same sites, on the same token ids
    and positions, interleaved record by record in one process (same threads):
    a bare decoder forward, skafa's ``extract_activations``, **nnsight**
    (``NNsight(model.model).trace``, ``.input`` / ``.output`` ``.save()``),
    **TransformerLens** (``TransformerBridge.boot_transformers(hf_model=...)``,
    ``run_with_cache(names_filter=...)``) and **mi4afa** (ag2's
    ``ag2.extensions.mi4afa.ActivationExtractor.extract_encoded``). Every peer's
    activations are compared with skafa's; peak extra memory is measured per
    method in a fresh process (CPU: resident set; CUDA: allocator peak).
    Needs ``pip install "torch==2.13.0" "skafa[bench]"``; a missing peer is skipped
    and named.
``--device-run``
    The GPU path: ``TurnActivationTransformer(device=..., dtype=..., batch_size=...)``
    against a bare forward in the same dtype on the same padded batches:
    tokens/s, batch sizes, peak memory, and the largest relative error of every
    site against float32 on the first records. With ``--device cpu`` and a
    half-precision ``--dtype``, a bare float32 forward on the same batches is timed in
    the same repeats (whether half precision pays on this CPU).

Usage::

    python examples/benchmark_extraction.py [--data ../shared/data/who_and_when]
        [--n 20] [--repeats 3] [--output docs/extraction-benchmark.md]
    OMP_NUM_THREADS=2 python examples/benchmark_extraction.py --peers --n 4 --repeats 2 \
        --threads 2 --output peers.md
    python examples/benchmark_extraction.py --device-run --device cuda --dtype bfloat16 \
        --model /path/qwen2.5-coder-0.5b-instruct.gguf --batch-size auto --n 40 \
        --output gpu.md

This is a script, not a test: expect tens of minutes on a 2-core machine. The logic
lives in :mod:`skafa.benchmarks` (``run_extraction_benchmark``, ``run_peers_benchmark``,
``run_device_benchmark``); this script is its command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

from skafa.benchmarks import (
    ExtractionBenchmarkSettings,
    run_device_benchmark,
    run_extraction_benchmark,
    run_peers_benchmark,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "who_and_when"
log = functools.partial(print, flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--n", type=int, default=20, help="number of records")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="skip records with longer prompts (default: context length)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's default); on a machine shared "
                             "with other jobs, 1 thread avoids OpenMP oversubscription")
    parser.add_argument("--output", default=str(REPO / "docs" / "extraction-benchmark.md"))
    parser.add_argument("--peers", action="store_true",
                        help="skafa vs bare forward, nnsight, TransformerLens, mi4afa")
    parser.add_argument("--device-run", action="store_true",
                        help="batched GPU path (--device, --dtype, --batch-size) vs bare forward")
    parser.add_argument("--model", default="smollm2",
                        help="model name or path (skafa.llm.load_model)")
    parser.add_argument("--device", default="cpu", help="--peers/--device-run: torch device")
    parser.add_argument("--dtype", default="float32", help="--peers/--device-run: dtype")
    parser.add_argument("--batch-size", default="auto",
                        help="--device-run: an int or 'auto' (default)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    fields = {f.name for f in dataclasses.fields(ExtractionBenchmarkSettings)}
    settings = ExtractionBenchmarkSettings(**{k: v for k, v in vars(args).items()
                                              if k in fields})
    settings.command = "python examples/benchmark_extraction.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    run = (run_peers_benchmark if args.peers else run_device_benchmark if args.device_run
           else run_extraction_benchmark)
    folder = Path(args.data) / "Algorithm-Generated"
    if not folder.is_dir():
        sys.exit(f"Who&When data not found at {folder}; pass --data.")
    result = run(settings, log=log)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(result["markdown"])
    print(result["markdown"])
    return result


if __name__ == "__main__":
    main()
