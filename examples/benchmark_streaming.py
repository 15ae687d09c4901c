"""Cost of auditing a live run: KV-cached streaming vs re-reading every prefix.

For a few Who&When records, in ONE interleaved loop, turn by turn: append the turn to an
:class:`skafa.online.AuditSession` (a forward pass over the new turn's tokens, keys and
values of everything before cached), then re-read the whole prefix ``0..k`` from
scratch the way a stateless auditor would (one forward pass over the prefix prompt),
both reading the same site with the same hooks. Interleaving puts both under the same
machine load. Reports seconds per appended turn for both, their ratio, the tokens each
ran, and the largest difference between the two vectors (they must agree).

The auditor's weights do not change the cost, so the session uses a stand-in auditor
fitted on random vectors of the model's width at the measured site.

Usage (from the repository root)::

    python examples/benchmark_streaming.py --model smollm2 --n-records 3
    python examples/benchmark_streaming.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import KFold

import skafa
from skafa import PromptTemplate, TurnActivationTransformer, TurnFeatures
from skafa.llm import extract_activations
from skafa.online import OnlineAuditor, conversation_prefix

REPO = Path(__file__).resolve().parents[1]


def stand_in_auditor(site, hidden, seed=0):
    rng = np.random.default_rng(seed)
    n, T = 12, 4
    X = TurnFeatures(rng.normal(size=(n * T, 1, hidden)), np.arange(0, n * T + 1, T),
                     sites=[site])
    return OnlineAuditor(Cs=[1.0], cv=KFold(3), max_false_alarm_rate=0.5).fit(
        X, rng.integers(1, T, size=n))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--n-records", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4000,
                   help="use the first records whose whole prompt has at most this many tokens")
    p.add_argument("--max-turn-chars", type=int, default=3000,
                   help="per-turn head_tail cap, as in benchmark_online.py")
    p.add_argument("--site", default="resid_final",
                   help="site read by both paths (resid_final runs every layer)")
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "streaming_cost.json"))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)

    template = PromptTemplate.online(shorten="head_tail", max_turn_chars=args.max_turn_chars)
    if args.smoke:
        from skafa.llm import register_model
        from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

        register_model("tiny-llama-streaming", make_tiny_llama(n_layers=2),
                       make_tiny_tokenizer(), overwrite=True)
        args.model = "tiny-llama-streaming"
        pool = make_conversations(2, min_turns=4, max_turns=5, seed=0)
        command = "python examples/benchmark_streaming.py --smoke"
    else:
        pool = skafa.load_who_and_when(args.data, subset=args.subset).conversations
        command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]) \
            if argv is None else "python examples/benchmark_streaming.py " + " ".join(argv)
    ext = TurnActivationTransformer(args.model, sites=[args.site], prompt=template,
                                    memory_cache=False).fit(pool[:1])
    ext._ensure_loaded()
    model, tok = ext._model, ext._tokenizer
    convs = [c for c in pool if template.encode(c, tok).n_tokens <= args.max_tokens]
    convs = convs[: args.n_records]
    auditor = stand_in_auditor(args.site, ext.hidden_size_)

    rows, head_s = [], []
    for conv in convs:
        t = time.perf_counter()
        session = auditor.session(ext, conv.task, task_id=conv.task_id)
        head_s.append(time.perf_counter() - t)
        for k, turn in enumerate(conv.turns):
            before = session.n_tokens
            t = time.perf_counter()
            session.append(turn)
            stream = time.perf_counter() - t
            t = time.perf_counter()
            enc = template.encode(conversation_prefix(conv, k + 1), tok)
            ref = extract_activations(model, [enc.input_ids], [enc.turn_positions[k:k + 1]],
                                      [args.site])[0][0, 0]
            reread = time.perf_counter() - t
            diff = float(np.max(np.abs(session.features().values[k, 0] - ref)))
            rows.append({"record_id": conv.record_id, "turn": k, "stream_s": stream,
                         "reread_s": reread, "stream_tokens": session.n_tokens - before,
                         "reread_tokens": int(enc.n_tokens), "max_abs_diff": diff})
        session.close()
    s = np.array([r["stream_s"] for r in rows])
    rr = np.array([r["reread_s"] for r in rows])
    result = {
        "command": command, "model": args.model, "site": args.site,
        "records": [c.record_id for c in convs], "n_turns": len(rows),
        "prompt": f"PromptTemplate.online(shorten='head_tail', max_turn_chars="
                  f"{args.max_turn_chars})",
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, torch "
                   f"{__import__('torch').__version__}, shared with other jobs",
        "date": time.strftime("%Y-%m-%d"),
        "stream_s_per_turn": float(s.mean()), "reread_s_per_turn": float(rr.mean()),
        "ratio": float(rr.sum() / s.sum()),
        "session_start_s_per_run": float(np.mean(head_s)),
        "ratio_including_session_start": float(rr.sum() / (s.sum() + sum(head_s))),
        "tokens_streamed": int(sum(r["stream_tokens"] for r in rows)),
        "tokens_reread": int(sum(r["reread_tokens"] for r in rows)),
        "max_abs_diff": float(max(r["max_abs_diff"] for r in rows)),
        "rows": rows,
    }
    print(f"{len(convs)} runs, {len(rows)} appended turns, site {args.site}: streaming "
          f"{1000 * result['stream_s_per_turn']:.0f} ms/turn ({result['tokens_streamed']} "
          f"tokens in all), re-reading the prefix {1000 * result['reread_s_per_turn']:.0f} "
          f"ms/turn ({result['tokens_reread']} tokens); ratio {result['ratio']:.1f}x "
          f"({result['ratio_including_session_start']:.1f}x counting the session start, "
          f"{1000 * result['session_start_s_per_run']:.0f} ms per run); largest vector "
          f"difference {result['max_abs_diff']:.1e}")
    if not args.smoke or argv is not None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
