"""Blame distribution over ag2 traces with a skafa probe, through ``ag2.eval``.

What it does, end to end:

1. loads Who&When Algorithm-Generated records and splits them by task id into a
   training set and a set to score;
2. writes every record as an ``ag2`` trace: the group chat becomes a
   ``chat_manager`` agent that hands each turn to the agent who spoke it, one
   delegation tool span per turn (tool name = the Who&When speaker, tool result
   = the turn's text), saved with ``ag2.eval``'s ``save_trace``;
3. fits a :class:`skafa.FailureAttributor` (embedded SmolLM2) on the training
   records read back through the *same* trace route, so that training and
   scoring prompts look alike (the annotated step becomes the turn of the
   annotated turn's tool result);
4. scores the other records with ``evaluate_traces`` over a
   ``DirectoryTraceSource`` and skafa's ``failure_attribution_scorer``, and
   prints the blame distribution (``RunResult.value_counts``) next to the
   annotated one, plus one line per scored record.

The speaker mapping, in the terms of :mod:`skafa.integrations.ag2`: the tool
calls are the manager's turns (``tool_calls="agent"``: "call Excel_Expert({})"),
the results are the Who&When speakers' turns (``subagents`` maps every tool to
the agent of the same name).

SmolLM2 extraction costs about 25 s per record on a 2-core CPU, so the defaults
are small (12 training records, 6 scored, about 8 minutes). Run::

    python examples/ag2_blame.py                      # 12 train, 6 scored
    python examples/ag2_blame.py --train 40 --score 20 --cache-dir ~/.cache/skafa
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from sklearn.model_selection import GroupKFold, GroupShuffleSplit

from skafa import (
    FailureAttributor,
    GroupedArgmaxLogisticClassifier,
    PromptTemplate,
    SiteSelector,
    TurnActivationTransformer,
    load_who_and_when,
)

try:
    from ag2.eval import DirectoryTraceSource, Suite, evaluate_traces
    from ag2.eval.sources import SpanData, spans_to_trace
    from ag2.eval.sources.trace_source import save_trace
except ImportError:  # pragma: no cover
    sys.exit("This example needs ag2: pip install 'skafa[ag2]'")

from skafa.integrations.ag2 import conversation_from_trace, failure_attribution_scorer
from skafa.llm import parse_site_spec

REPO = Path(__file__).resolve().parents[1]
MANAGER = "chat_manager"
KEY = "skafa_blame"


def default_data_path() -> str:
    env = os.environ.get("SKAFA_WHO_AND_WHEN")
    return env if env else str(REPO.parent / "shared" / "data" / "who_and_when")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Score Who&When records written as ag2 traces with a skafa probe "
                    "and print the blame distribution.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=default_data_path(), help="Who&When folder")
    p.add_argument("--train", type=int, default=12, help="training records")
    p.add_argument("--score", type=int, default=6, help="records to score")
    p.add_argument("--model", default="smollm2", help="model name or path")
    p.add_argument("--sites", default="resid_pre.9,resid_pre.18,resid_pre.27,resid_final",
                   help="comma-separated sites compared by the site search")
    p.add_argument("--max-prompt-tokens", type=int, default=8192,
                   help="longer prompts are shortened, middle of the longest turns first")
    p.add_argument("--cache-dir", default="", help="activation cache ('' for memory only)")
    p.add_argument("--out", default="", help="folder for traces and the run JSON "
                                             "(default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def record_spans(conv, record_key):
    """One Who&When conversation as AG2 spans: a root agent span, one tool span per turn."""
    t0 = 1_700_000_000_000_000_000
    spans = [SpanData(MANAGER, f"{record_key}-root", None, t0, t0 + 10_000 * (len(conv) + 1),
                      {"ag2.span.type": "agent", "gen_ai.agent.name": MANAGER})]
    for i, turn in enumerate(conv.turns):
        start = t0 + 10_000 * (i + 1)
        spans.append(SpanData(
            f"execute_tool {turn.speaker}", f"{record_key}-{i}", f"{record_key}-root",
            start, start + 5_000,
            {"ag2.span.type": "tool", "gen_ai.tool.name": turn.speaker,
             "gen_ai.tool.call.id": f"{record_key}-call-{i}", "gen_ai.tool.call.arguments": "{}",
             "gen_ai.tool.call.result": turn.content}))
    return spans


def history_turn(event_index):
    """Who&When turn behind a trace event: each turn is a (call, result) pair of events."""
    return event_index // 2


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    data = load_who_and_when(args.data, subset="Algorithm-Generated")
    convs = list(data.conversations)
    groups = np.asarray([c.task_id for c in convs], dtype=object)
    n = args.train + args.score
    split = GroupShuffleSplit(n_splits=1, test_size=args.score / n, random_state=args.seed)
    train_idx, score_idx = next(split.split(convs[:n], groups=groups[:n]))
    train = [convs[i] for i in train_idx]
    scored = [convs[i] for i in score_idx]
    assert not {c.task_id for c in train} & {c.task_id for c in scored}

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="skafa-ag2-"))
    trace_dir = out / "traces"
    speakers = sorted({t.speaker for c in convs[:n] for t in c.turns})
    subagents = {s: s for s in speakers}

    # ---- training conversations, through the same trace route as the scored ones
    train_convs = []
    for conv in train:
        trace = spans_to_trace(record_spans(conv, "train"))
        converted, _ = conversation_from_trace(
            trace, question=conv.task, ground_truth=conv.expected_answer,
            agent_name=MANAGER, subagents=subagents, tool_calls="agent",
            mistake_event=2 * conv.mistake_step + 1, mistake_agent=conv.mistake_agent,
            task_id=conv.task_id, record_id=conv.record_id)
        train_convs.append(converted)

    # ---- traces to score, on disk
    items = []
    for conv in scored:
        key = conv.record_id.replace("/", "_")
        save_trace(trace_dir, key, record_spans(conv, key), task_id=key,
                   metadata={"record_id": conv.record_id})
        items.append({"task_id": key, "inputs": {"input": conv.task},
                      "reference_outputs": {"answer": conv.expected_answer}})
    suite = Suite.from_list(items, name="who-and-when")
    print(f"records: {len(train)} for training, {len(scored)} written as ag2 traces to "
          f"{trace_dir} ({sum(len(c) for c in scored)} Who&When turns, two trace events "
          "each)")

    # ---- fit
    t = time.perf_counter()
    fa = FailureAttributor(
        TurnActivationTransformer(
            args.model, sites=parse_site_spec(args.sites),
            prompt=PromptTemplate(shorten="middle_first",
                                  max_prompt_tokens=args.max_prompt_tokens),
            cache_dir=args.cache_dir or None, verbose=1),
        SiteSelector(GroupedArgmaxLogisticClassifier(random_state=args.seed),
                     cv=GroupKFold(3)))
    fa.fit(train_convs)
    print(f"fitted on {len(train_convs)} records in {time.perf_counter() - t:.0f} s: site "
          f"{fa.best_site_} (inner CV step accuracy {fa.best_score_:.2f})")

    # ---- score through ag2.eval
    t = time.perf_counter()
    scorer = failure_attribution_scorer(fa, key=KEY, agent_name=MANAGER, subagents=subagents,
                                        tool_calls="agent", ground_truth_field="answer")
    run = asyncio.run(evaluate_traces(DirectoryTraceSource(trace_dir), scorers=[scorer],
                                      store_dir=out / "runs", suite=suite, concurrency=1))
    print(f"scored {len(run.tasks)} traces with evaluate_traces in "
          f"{time.perf_counter() - t:.0f} s; run JSON: {out / 'runs' / (run.run_id + '.json')}")

    # ---- blame distribution next to the annotated one
    blamed = run.value_counts(KEY)
    annotated = Counter(c.mistake_agent for c in scored)
    width = max(len(a) for a in set(blamed) | set(annotated) | {"agent"})
    print(f"\n{'agent':<{width}}  blamed  annotated")
    for agent in sorted(set(blamed) | set(annotated), key=lambda a: (-annotated[a], a)):
        print(f"{agent:<{width}}  {blamed.get(agent, 0):>6}  {annotated.get(agent, 0):>9}")

    by_key = {c.record_id.replace("/", "_"): c for c in scored}
    step_hits = agent_hits = 0
    print("\nrecord                   annotated (turn, agent)          blamed (event -> turn, "
          "agent)")
    for result in sorted(run.tasks, key=lambda r: r.task.task_id):
        conv = by_key[result.task.task_id]
        (fb,) = result.feedback
        if fb.value is None:
            print(f"{conv.record_id:<24} {conv.mistake_step:>3}, {conv.mistake_agent:<28} "
                  f"no blame: {fb.comment}")
            continue
        event = fb.detail["decisive_step"]
        turn = history_turn(event)
        step_hits += turn == conv.mistake_step
        agent_hits += fb.value == conv.mistake_agent
        print(f"{conv.record_id:<24} {conv.mistake_step:>3}, {conv.mistake_agent:<28} "
              f"event {event:>2} -> {turn:>2}, {fb.value}")
    print(f"\nturn found {step_hits}/{len(scored)}, agent found {agent_hits}/{len(scored)} "
          f"(tiny sample: no accuracy claim). Total {time.perf_counter() - t_start:.0f} s.")
    (out / "blame.json").write_text(json.dumps({"blamed": blamed, "annotated": annotated},
                                               indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
