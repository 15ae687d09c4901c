"""What ``read="mean"`` costs next to ``read="last"``, measured in one run.

Runs SmolLM2-135M-Instruct (float32, CPU) on the first ``--n`` Who&When
Algorithm-Generated records that fit its context and times, interleaved record by
record and repeated, :func:`skafa.llm.extract_activations` over all 61 sites

- at each turn's last token (``read="last"``), and
- averaged over each turn's line (``read="mean"``: ``starts=`` given),

plus a bare decoder forward pass as the unit. Prints a markdown table; with
``--output`` also writes it to a file.

Usage::

    python examples/benchmark_read_mean.py [--n 5] [--repeats 3] [--threads 1]
        [--output docs/results/read-mean-cost.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "who_and_when"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get("SKAFA_WHO_AND_WHEN", str(DEFAULT_DATA)))
    p.add_argument("--n", type=int, default=5, help="number of records")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--output", default=None, help="also write the table here")
    args = p.parse_args(argv)

    import torch

    import skafa
    from skafa.llm import PromptTemplate, all_sites, extract_activations, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2")
    ctx = model.config.max_position_embeddings
    convs = skafa.load_who_and_when(args.data, subset="Algorithm-Generated").conversations
    encs = []
    for conv in convs:
        enc = PromptTemplate().encode(conv, tok)
        if enc.n_tokens <= ctx:
            encs.append(enc)
        if len(encs) == args.n:
            break
    sites = all_sites(model.config.num_hidden_layers)
    decoder = model.model

    def bare(e):
        with torch.inference_mode():
            decoder(input_ids=torch.as_tensor(e.input_ids)[None], use_cache=False)

    def last(e):
        extract_activations(model, [e.input_ids], [e.turn_positions], sites)

    def mean(e):
        extract_activations(model, [e.input_ids], [e.turn_positions], sites,
                            starts=[e.turn_start_positions])

    methods = {"bare forward": bare, 'read="last"': last, 'read="mean"': mean}
    names = list(methods)
    bare(encs[0]), last(encs[0]), mean(encs[0])  # warm-up
    times = {m: [[] for _ in encs] for m in names}
    for rep in range(args.repeats):
        for i, e in enumerate(encs):
            k = (rep + i) % len(names)
            for m in names[k:] + names[:k]:
                s = time.perf_counter()
                methods[m](e)
                times[m][i].append(time.perf_counter() - s)
    med = {m: [statistics.median(x) for x in times[m]] for m in names}
    total = {m: sum(v) for m, v in med.items()}
    tokens = sum(e.n_tokens for e in encs)
    cmd = "python examples/benchmark_read_mean.py " + " ".join(argv if argv is not None
                                                               else sys.argv[1:])
    lines = [
        "### Cost of `read=\"mean\"`",
        "",
        f"Command: `{cmd.strip()}`  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); {time.strftime('%Y-%m-%d')}.  ",
        f"{len(encs)} records, {tokens:,} tokens, all {len(sites)} sites, median of "
        f"{args.repeats} interleaved repeats per record.",
        "",
        "| method | total s | tokens/s | / bare forward |",
        "|---|---|---|---|",
    ]
    for m in names:
        lines.append(f"| {m} | {total[m]:.2f} | {tokens / total[m]:.0f} | "
                     f"{total[m] / total['bare forward']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return {m: total[m] for m in names}


if __name__ == "__main__":
    main()
