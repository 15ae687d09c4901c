"""How many prompt tokens each ``read=`` costs, measured with a tokenizer only.

``read="last"`` and ``read="mean"`` read the same prompt; ``read="recap"`` adds, after
the instruction, one recap line per turn; ``read="echo"`` adds, after the instruction,
the whole transcript a second time. This script renders every conversation for each read
exactly as extraction does (no shortening) and prints the token counts. It loads
the tokenizer only and runs no forward pass, so it takes seconds.

Run::

    python examples/read_token_overhead.py                       # SmolLM2, Algorithm-Generated
    python examples/read_token_overhead.py --model /path/to/model.gguf --subset Hand-Crafted
    python examples/read_token_overhead.py --budget 8192         # + what shortening removes
    python examples/read_token_overhead.py --smoke               # tiny tokenizer, synthetic data
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
READS = ("last", "recap", "echo")


def load_tokenizer(model):
    """The fast tokenizer of ``model`` (a name, folder, hub id or .gguf path), without weights."""
    from transformers import AutoTokenizer

    from skafa.llm import resolve_model_spec

    spec = resolve_model_spec(model)
    if spec.kind == "registered":
        from skafa.llm import load_model

        return load_model(model)[1]
    kw = {} if spec.gguf_file is None else {"gguf_file": spec.gguf_file}
    return AutoTokenizer.from_pretrained(spec.source, **kw)


def measure(convs, tokenizer, template=None):
    """Token counts per read: ``{read: ndarray of n_tokens}`` and the turn counts."""
    from skafa.llm import plan

    counts = {r: plan(convs, tokenizer, template, max_tokens=10 ** 9, read=r).n_tokens
              for r in READS}
    return counts, np.array([len(c) for c in convs])


def shortening(convs, tokenizer, budget):
    """Per read, what ``PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)`` removes."""
    from skafa.llm import PromptTemplate, plan

    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    total = sum(len(t.content) for c in convs for t in c.turns)
    rows = [(f"| read | conversations shortened (of {len(convs)}) | turn characters removed "
             f"(of {total:,}) | prompts that cannot fit |"), "|---|---|---|---|"]
    out = {}
    for r in READS:
        p = plan(convs, tokenizer, template, max_tokens=budget, read=r)
        n_short = sum(row["chars_removed"] > 0 for row in p)
        out[r] = p
        rows.append(f"| `{r}` | {n_short} | {p.total_chars_removed:,} "
                    f"({100 * p.total_chars_removed / max(total, 1):.1f}%) | {len(p.too_long)} |")
    return out, "\n".join(rows)


def report(counts, n_turns):
    """Markdown table of the token counts and the overhead of each read over ``last``."""
    last = counts["last"]
    rows = [("| read | total tokens | mean per prompt | median | max | extra vs last "
             "| extra tokens per turn |"), "|---|---|---|---|---|---|---|"]
    for r in READS:
        c = counts[r]
        extra = c - last
        rows.append(f"| `{r}` | {int(c.sum()):,} | {c.mean():.0f} | {np.median(c):.0f} | "
                    f"{int(c.max()):,} | +{100 * extra.sum() / last.sum():.1f}% "
                    f"(x{c.sum() / last.sum():.2f}) | {extra.sum() / n_turns.sum():.1f} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model whose tokenizer to use")
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--budget", type=int, default=None,
                   help="also report what shorten='middle_first' removes at this token budget")
    p.add_argument("--smoke", action="store_true", help="tiny tokenizer, synthetic data")
    args = p.parse_args(argv)
    if args.smoke:
        from skafa.testing import make_conversations, make_tiny_tokenizer

        convs, tokenizer, label = make_conversations(20, seed=0), make_tiny_tokenizer(), "smoke"
    else:
        import skafa

        convs = skafa.load_who_and_when(args.data, subset=args.subset).conversations
        tokenizer, label = load_tokenizer(args.model), f"{args.model}, {args.subset}"
    counts, n_turns = measure(convs, tokenizer)
    print(f"{len(convs)} conversations, {int(n_turns.sum())} turns ({label}); "
          "PromptTemplate() defaults, no shortening\n")
    print(report(counts, n_turns))
    if args.budget:
        print(f"\nShortening to max_prompt_tokens={args.budget} (middle_first):\n")
        print(shortening(convs, tokenizer, args.budget)[1])
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
