"""Cost of PromptedJudge's logprob scoring relative to one plain forward pass.

The judge scores every candidate step with one forward pass over the prompt (KV cache)
plus one packed pass over all candidates' answer tokens. This script times, on the
same prompt: (a) one plain forward pass of the causal LM, (b) the judge's scoring,
(c) the naive alternative of one full forward pass per candidate. Minimum of repeats.

    python examples/benchmark_judge.py                 # SmolLM2, 3 Algorithm-Generated records
    python examples/benchmark_judge.py --records 38 19 12
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from skafa.baselines._judge import answer_token_plan, number_continuation_mask, score_candidates
from skafa.conversation import Conversation
from skafa.llm import PromptTemplate, load_model

REPO = Path(__file__).resolve().parents[1]


def best_of(f, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--records", nargs="+", default=["38", "19", "12"])
    p.add_argument("--answer-prefix", default="Step: ")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    lm, tok = load_model(args.model)
    mask = number_continuation_mask(tok, lm.get_output_embeddings().weight.shape[0])
    print(f"# {args.model}; {os.cpu_count()} CPU cores, {platform.machine()}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, attention "
          f"{lm.config._attn_implementation}")
    print("| record | prompt tokens | steps | plain forward (s) | judge (s) | judge / plain "
          "| one forward per candidate / plain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rec in args.records:
        path = Path(args.data) / "Algorithm-Generated" / f"{rec}.json"
        conv = Conversation.from_who_and_when(json.loads(path.read_text()), record_id=rec)
        ids = PromptTemplate().encode(conv, tok).input_ids
        shared, conts = answer_token_plan(tok, args.answer_prefix, len(conv))
        full = np.concatenate([ids, shared])
        x = torch.tensor([full.tolist()])

        def plain():
            with torch.inference_mode():
                lm(input_ids=x, use_cache=False, logits_to_keep=1)

        def judge():
            score_candidates(lm, [full], [conts], mask, pad_id=0)

        def naive():
            for c in conts:
                with torch.inference_mode():
                    lm(input_ids=torch.tensor([full.tolist() + list(c)]), use_cache=False,
                       logits_to_keep=len(c) + 1)

        plain()
        tp, tj = best_of(plain, args.repeats), best_of(judge, args.repeats)
        tn = best_of(naive, max(1, args.repeats // 2))
        print(f"| {rec} | {len(full)} | {len(conv)} | {tp:.3f} | {tj:.3f} | {tj / tp:.2f} "
              f"| {tn / tp:.2f} |", flush=True)


if __name__ == "__main__":
    main()
