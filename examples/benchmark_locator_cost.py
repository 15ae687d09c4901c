"""Costs of §8's rows against one bare forward pass (docs/benchmarks.md §8, question 4).

On the first ``--n`` records of a Who&When subset (file order), interleaved record by
record in rotating order over ``--repeats`` repeats, in one process with the same
threads: (a) a bare decoder forward over the §8 ``read="last"`` prompt; (b) the
head-attention features (``TurnActivationTransformer(read="last", sites="head_attn")``,
no cache); (c) the prompted judge's ``predict``; (d) the grafted judge's ``predict``
(fitted once up front); and once, (e) ``grafted_split_predictions`` over the two halves
with and without ``kv_dir``. The logic lives in :mod:`skafa.benchmarks`
(``run_locator_cost_benchmark``); this script is its command line.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python examples/benchmark_locator_cost.py --model smollm2 \
        --subset Algorithm-Generated --n 6 --repeats 2 --threads 1
    python examples/benchmark_locator_cost.py --smoke --output /tmp/cost.md   # seconds

Writes the markdown report to ``--output`` (default
``docs/results/locator_cost_<tag>_<subset>.md``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from skafa import load_who_and_when
from skafa.benchmarks import LocatorCostSettings, model_tag, run_locator_cost_benchmark

REPO = Path(__file__).resolve().parents[1]
log = functools.partial(print, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated",
                   choices=("Algorithm-Generated", "Hand-Crafted"))
    p.add_argument("--model", default="smollm2", help="short name, .gguf file or folder")
    p.add_argument("--tag", default=None, help="name in the output file (default: the model's short name or file name)")
    p.add_argument("--n", type=int, default=6, help="records (the first, in file order)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's default); on a machine shared "
                        "with other jobs, 1 thread avoids OpenMP oversubscription")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--split-grid", default="1",
                   help="(e): numbers of locator and of writer heads, comma-separated "
                        "(§8's grid: 1,2,4; one number: no inner folds)")
    p.add_argument("--split-cv", type=int, default=2, help="(e): inner folds")
    p.add_argument("--output", default=None,
                   help="markdown file (default docs/results/locator_cost_<tag>_<subset>.md)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model on synthetic records: checks the wiring only")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = LocatorCostSettings(
        model=args.model, tag=args.tag, subset=args.subset, n=args.n, repeats=args.repeats,
        max_prompt_tokens=args.max_prompt_tokens, dtype=args.dtype,
        split_grid=tuple(int(v) for v in args.split_grid.split(",") if v.strip()),
        split_cv=args.split_cv,
        command=" ".join(["python", "examples/benchmark_locator_cost.py"]
                         + (sys.argv[1:] if argv is None else list(argv))))
    if args.smoke:
        from skafa.llm import register_model
        from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

        register_model("locator-cost-smoke", make_tiny_llama(n_layers=3),
                       make_tiny_tokenizer(), overwrite=True)
        settings.model, settings.smoke = "locator-cost-smoke", True
        convs = make_conversations(max(args.n, 1), seed=0)
    else:
        folder = Path(args.data) / args.subset
        if not folder.is_dir():
            sys.exit(f"Who&When data not found at {folder}; pass --data.")
        convs = load_who_and_when(args.data, subset=args.subset).conversations
    tag = "smoke" if args.smoke else (args.tag or model_tag(args.model))
    output = Path(args.output or REPO / "docs" / "results"
                  / f"locator_cost_{tag}_{args.subset}.md")
    result = run_locator_cost_benchmark(settings, convs, log=log)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(result["markdown"])
    log(result["markdown"])
    log(f"written to {output}")
    return result


if __name__ == "__main__":
    main()
