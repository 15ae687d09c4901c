"""Tests for skafa.integrations.ag2, against the real ag2 package (no LLM is called)."""

import asyncio
import json
import subprocess
import sys
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
from sklearn.model_selection import GroupKFold

ag2_eval = pytest.importorskip("ag2.eval", reason="the ag2 extra is not installed "
                               "(pip install 'skafa[ag2]')")

from ag2 import Agent  # noqa: E402
from ag2 import events as ev  # noqa: E402
from ag2.eval import (  # noqa: E402
    DirectoryTraceSource,
    Feedback,
    InMemoryTraceSource,
    Suite,
    Trace,
    TraceRef,
    evaluate_traces,
)
from ag2.eval.sources import SpanData  # noqa: E402
from ag2.eval.sources.trace_source import save_trace  # noqa: E402
from ag2.extensions import mi4afa  # noqa: E402

from skafa import (  # noqa: E402
    Conversation,
    ConversationError,
    FailureAttributor,
    GroupedArgmaxLogisticClassifier,
    SiteSelector,
    Turn,
    TurnActivationTransformer,
)
from skafa.integrations.ag2 import (  # noqa: E402
    conversation_from_trace,
    failure_attribution_scorer,
    from_mi4afa,
    subagent_names,
    to_mi4afa,
)
from skafa.llm import register_model, unregister_model  # noqa: E402
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer  # noqa: E402

MODEL = "ag2-tiny"


@pytest.fixture(scope="module")
def attributor():
    register_model(MODEL, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    fa = FailureAttributor(
        TurnActivationTransformer(MODEL, sites=["resid_pre.1", "resid_final"]),
        SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0), cv=GroupKFold(3)))
    fa.fit(make_conversations(24, seed=3))
    yield fa
    unregister_model(MODEL)


def _trace(events, exception=None):
    return Trace(events=events, exception=exception, duration_ms=3)


def _mixed_events():
    """One run of every kind of event, with the turns it should give."""
    search = ev.ToolCallEvent("search", arguments='{"q": "boiling point"}')
    delegate = ev.ToolCallEvent("task_researcher", arguments='{"objective": "check"}')
    events = [
        ev.ModelRequest([ev.TextInput("What is the boiling point?")]),  # 0 skipped
        ev.ModelResponse(ev.ModelMessage("I will search.")),              # 1 assistant
        ev.UsageEvent(ev.Usage(prompt_tokens=5), kind="model_call"),      # 2 skipped
        ev.ModelResponse(None),                                           # 3 no text: skipped
        search,                                                           # 4 call
        ev.ToolResultEvent.from_call(search, "90 C"),                     # 5 tool result
        delegate,                                                         # 6 call
        ev.ToolResultEvent.from_call(delegate, "It is 100 C."),           # 7 sub-agent
        ev.ToolErrorEvent.from_call(search, TimeoutError("slow")),        # 8 tool error
        ev.TaskStarted(task_id="t1", agent_name="writer", objective="write"),  # 9 skipped
        ev.TaskCompleted(task_id="t1", agent_name="writer", objective="write",
                         result="Draft: 90 C", task_stream=uuid.uuid4()),     # 10 writer
        ev.TaskFailed(task_id="t2", agent_name="checker", objective="check",
                      error=RuntimeError("no source")),                  # 11 checker
        ev.HumanMessage("Looks fine."),                                   # 12 human
        ev.ModelResponse(ev.ModelMessage("The answer is 90 C.")),         # 13 assistant
    ]
    expected = [
        (1, "assistant", "I will search.", "assistant"),
        (4, "tool:search", 'call search({"q": "boiling point"})', "tool_call"),
        (5, "tool:search", "90 C", "tool"),
        (6, "tool:task_researcher", 'call task_researcher({"objective": "check"})',
         "tool_call"),
        (7, "researcher", "It is 100 C.", "tool"),
        (8, "tool:search", "error in search: slow", "tool_error"),
        (10, "writer", "Draft: 90 C", "task"),
        (11, "checker", "failed: no source", "task"),
        (12, "human", "Looks fine.", "user"),
        (13, "assistant", "The answer is 90 C.", "assistant"),
    ]
    return events, expected


# ---------------------------------------------------------------- conversion
def test_event_mapping_turn_by_turn():
    events, expected = _mixed_events()
    trace = _trace(events)
    conv, indices = conversation_from_trace(
        trace, question="Boiling point of water?", ground_truth="100 C",
        subagents={"task_researcher": "researcher"}, task_id="T", record_id="run-1")
    assert isinstance(conv, Conversation) and len(conv) == len(expected)
    assert indices == tuple(e[0] for e in expected)
    for t, (index, speaker, content, role) in enumerate(expected):
        turn = conv.turns[t]
        assert (turn.speaker, turn.content, turn.role) == (speaker, content, role), t
        assert trace.events[indices[t]] is events[index]
    assert conv.task == "Boiling point of water?" and conv.expected_answer == "100 C"
    assert conv.task_id == "T" and conv.record_id == "run-1" and conv.mistake_step is None


def test_tool_calls_by_agent_and_custom_agent_name():
    events, expected = _mixed_events()
    conv, _ = conversation_from_trace(_trace(events), question="q", agent_name="boss",
                                      tool_calls="agent")
    speakers = list(conv.speakers)
    assert speakers[0] == speakers[1] == speakers[3] == speakers[-1] == "boss"
    # without the subagents mapping, a delegation result is the tool's
    assert speakers[4] == "tool:task_researcher"


def test_mistake_event_becomes_mistake_step():
    events, _ = _mixed_events()
    conv, indices = conversation_from_trace(_trace(events), question="q", mistake_event=7,
                                            mistake_agent="researcher")
    assert indices[conv.mistake_step] == 7 and conv.mistake_agent == "researcher"
    with pytest.raises(ConversationError, match=r"mistake_event=2 is not an event that became"):
        conversation_from_trace(_trace(events), question="q", mistake_event=2)


def test_empty_and_turnless_traces_are_refused():
    with pytest.raises(ConversationError, match=r"trace 'r1': the trace has no events"):
        conversation_from_trace(_trace([]), question="q", record_id="r1")
    usage_only = [ev.UsageEvent(ev.Usage(prompt_tokens=1), kind="model_call"),
                  ev.ModelResponse(None)]
    with pytest.raises(ConversationError, match=r"none of its 2 events is a turn "
                                                r"\(seen: ModelResponse, UsageEvent\)"):
        conversation_from_trace(_trace(usage_only), question="q")
    with pytest.raises(TypeError, match="expected an ag2.eval.Trace"):
        conversation_from_trace([1, 2], question="q")
    with pytest.raises(ValueError, match="tool_calls"):
        conversation_from_trace(_trace(usage_only), question="q", tool_calls="nobody")


def test_trace_without_model_response_is_converted():
    call = ev.ToolCallEvent("run_code", arguments="{}")
    crash = RuntimeError("boom")
    conv, indices = conversation_from_trace(
        _trace([call, ev.ToolErrorEvent.from_call(call, crash)], exception=crash),
        question="q")
    assert conv.speakers == ("tool:run_code", "tool:run_code") and indices == (0, 1)
    assert conv.metadata["trace_exception"] == "RuntimeError: boom"


class _StrangeEvent(ev.BaseEvent):
    note: str = "?"


def test_unknown_event_types():
    events = [ev.ModelResponse(ev.ModelMessage("hi")), _StrangeEvent(),
              ev.UnknownEvent(type_name="x.Y")]
    with pytest.raises(ConversationError, match=r"event 1 has type _StrangeEvent.*on_unknown"):
        conversation_from_trace(_trace(events), question="q")
    with pytest.warns(UserWarning, match=r"_StrangeEvent at \[1\]; UnknownEvent at \[2\]"):
        conv, indices = conversation_from_trace(_trace(events), question="q",
                                                on_unknown="skip")
    assert indices == (0,) and conv.speakers == ("assistant",)


def test_transient_events_are_skipped():
    events = [ev.ModelMessageChunk("partial"), ev.ModelReasoning("thinking"),
              ev.ModelResponse(ev.ModelMessage("done"))]
    conv, indices = conversation_from_trace(_trace(events), question="q")
    assert indices == (2,) and conv.turns[0].content == "done"


def test_subagent_names_from_real_agents():
    from ag2.tools.final import Toolkit, tool
    from ag2.tools.subagents.background import background_agent_tool

    researcher, writer, sleeper = Agent("researcher", "r"), Agent("writer", "w"), Agent("z", "z")

    @tool
    def search(q: str) -> str:
        """Search."""
        return q

    boss = Agent("boss", "lead", tools=[
        researcher.as_tool(description="research"),
        Toolkit(writer.as_tool(description="write", name="draft")),
        background_agent_tool(sleeper, description="later"),
        search,
    ])
    assert subagent_names(boss) == {"task_researcher": "researcher", "draft": "writer"}
    with pytest.raises(TypeError, match="ag2 Agent"):
        subagent_names(object())


# -------------------------------------------------------------------- scorer
def _suite_and_source(n=6, seed=11):
    """Traces whose turns are the synthetic conversations' turns, with a Suite."""
    convs = make_conversations(n, seed=seed)
    pairs, items, expected = [], [], {}
    for i, conv in enumerate(convs):
        events = []
        for turn in conv.turns:
            if turn.speaker == "coder":
                call = ev.ToolCallEvent("python", arguments=json.dumps({"code": turn.content}))
                events += [call, ev.ToolResultEvent.from_call(call, turn.content)]
            elif turn.speaker == "critic":
                events.append(ev.TaskCompleted(task_id=f"c{i}", agent_name="critic",
                                               objective="review", result=turn.content,
                                               task_stream=uuid.uuid4()))
            else:
                events.append(ev.ModelResponse(ev.ModelMessage(turn.content)))
            events.append(ev.UsageEvent(ev.Usage(prompt_tokens=1), kind="model_call"))
        task_id = f"task-{i}"
        pairs.append((TraceRef(trace_id=f"trace-{i}", task_id=task_id), _trace(events)))
        items.append({"task_id": task_id, "inputs": {"input": conv.task},
                      "reference_outputs": {"answer": conv.expected_answer}})
        expected[task_id] = (conv, events)
    return pairs, Suite.from_list(items, name="synthetic"), expected


def test_evaluate_traces_gives_a_blame_distribution(attributor, tmp_path):
    pairs, suite, expected = _suite_and_source()
    scorer = failure_attribution_scorer(attributor, agent_name="planner")
    assert scorer.key == "skafa_blame"
    run = asyncio.run(evaluate_traces(InMemoryTraceSource(pairs), scorers=[scorer],
                                      store_dir=tmp_path, suite=suite))
    counts = run.value_counts("skafa_blame")
    assert sum(counts.values()) == len(pairs)
    blamed = []
    for task_result in run.tasks:
        (fb,) = task_result.feedback
        conv_src, events = expected[task_result.task.task_id]
        # the same conversion and attribution, by hand
        conv, indices = conversation_from_trace(
            task_result.trace, question=conv_src.task, ground_truth=conv_src.expected_answer,
            agent_name="planner")
        assert conv.task == conv_src.task and conv.expected_answer == conv_src.expected_answer
        att = attributor.attribute(conv)
        detail = fb.detail
        assert fb.key == "skafa_blame" and fb.score is None
        assert fb.value == att.agent == detail["responsible_agent"]
        assert detail["failed"] is True and detail["error_mode"] == "other"
        assert detail["decisive_step"] == indices[att.step]
        # the decisive event is the one behind the blamed turn, and its speaker
        event = events[detail["decisive_step"]]
        assert event is task_result.trace.events[detail["decisive_step"]]
        if fb.value == "critic":
            assert isinstance(event, ev.TaskCompleted)
        elif fb.value == "tool:python":
            assert isinstance(event, (ev.ToolCallEvent, ev.ToolResultEvent))
        else:
            assert fb.value == "planner" and isinstance(event, ev.ModelResponse)
        assert f"blames turn {att.step} (trace event {indices[att.step]}" in detail["reasoning"]
        assert fb.comment == detail["reasoning"]
        blamed.append(fb.value)
    assert counts == {a: blamed.count(a) for a in set(blamed)}
    # the run JSON was written and keeps the feedback
    saved = json.loads((tmp_path / f"{run.run_id}.json").read_text())
    assert "skafa_blame" in json.dumps(saved)


def test_scorer_failure_is_recorded_not_raised(attributor, tmp_path):
    pairs, _, _ = _suite_and_source(n=2)
    pairs.append((TraceRef(trace_id="empty", task_id="empty"), _trace([])))
    run = asyncio.run(evaluate_traces(InMemoryTraceSource(pairs),
                                      scorers=[failure_attribution_scorer(attributor)],
                                      store_dir=tmp_path))
    by_task = {r.task.task_id: r.feedback for r in run.tasks}
    (fb,) = by_task["empty"]
    assert fb.score is None and fb.value is None
    assert "ConversationError" in fb.comment and "the trace has no events" in fb.comment
    assert sum(run.value_counts("skafa_blame").values()) == 2


@dataclass
class _NaNAttribution:
    step: int = 0
    agent: str = "assistant"
    turn_scores: np.ndarray = None
    site: str = "resid_final"
    top_k: tuple = ()
    n_turns: int = 2


class _NaNAttributor:
    def attribute(self, conversation, top_k=3):
        return _NaNAttribution(turn_scores=np.array([0.5, np.nan]))


def test_non_finite_scores_give_an_error_feedback_not_a_blame(tmp_path):
    pairs, _, _ = _suite_and_source(n=1)
    run = asyncio.run(evaluate_traces(InMemoryTraceSource(pairs),
                                      scorers=[failure_attribution_scorer(_NaNAttributor(),
                                                                          key="k")],
                                      store_dir=tmp_path))
    (fb,) = run.tasks[0].feedback
    assert isinstance(fb, Feedback) and fb.score is None and fb.value is None
    assert "non-finite scores to turns [1]" in fb.comment
    assert run.value_counts("k") == {}


def test_scorer_arguments_are_checked(attributor):
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        failure_attribution_scorer(FailureAttributor(MODEL))
    with pytest.raises(TypeError, match="attribute method"):
        failure_attribution_scorer(object())
    with pytest.raises(ValueError, match="top_k"):
        failure_attribution_scorer(attributor, top_k=0)


def test_scorer_reads_traces_from_a_directory(attributor, tmp_path):
    """Traces written with save_trace (AG2 spans) and read by DirectoryTraceSource."""
    spans, t0 = [], 1_000
    spans.append(SpanData("agent", "root", None, t0, t0 + 100,
                          {"ag2.span.type": "agent", "gen_ai.agent.name": "boss"}))
    spans.append(SpanData("chat", "s1", "root", t0 + 1, t0 + 2,
                          {"ag2.span.type": "llm", "gen_ai.output.messages":
                           json.dumps([{"role": "assistant", "content": "Ask researcher."}])}))
    spans.append(SpanData("tool", "s2", "root", t0 + 3, t0 + 4,
                          {"ag2.span.type": "tool", "gen_ai.tool.name": "task_researcher",
                           "gen_ai.tool.call.id": "c1",
                           "gen_ai.tool.call.arguments": '{"objective": "sum"}',
                           "gen_ai.tool.call.result": "I computed 2 + 2 = 5."}))
    spans.append(SpanData("chat", "s3", "root", t0 + 5, t0 + 6,
                          {"ag2.span.type": "llm", "gen_ai.output.messages":
                           json.dumps([{"role": "assistant", "content": "Answer: 5"}])}))
    save_trace(tmp_path / "traces", "run-0", spans, task_id="t0")
    scorer = failure_attribution_scorer(attributor, agent_name="boss",
                                        subagents={"task_researcher": "researcher"})
    run = asyncio.run(evaluate_traces(DirectoryTraceSource(tmp_path / "traces"),
                                      scorers=[scorer], store_dir=tmp_path / "runs"))
    (fb,) = run.tasks[0].feedback
    trace = run.tasks[0].trace
    conv, indices = conversation_from_trace(trace, question="", agent_name="boss",
                                            subagents={"task_researcher": "researcher"})
    assert conv.speakers == ("boss", "tool:task_researcher", "researcher", "boss")
    assert fb.value in conv.speakers
    assert conv.speakers[indices.index(fb.detail["decisive_step"])] == fb.value


# -------------------------------------------------------------------- mi4afa
def test_mi4afa_round_trip():
    conv = Conversation([Turn("planner", "plan", "assistant"), Turn("coder", "x = 1", "user")],
                        task="Do it.", expected_answer="1", task_id="T", mistake_step=1,
                        mistake_agent="coder", record_id="r")
    m = to_mi4afa(conv)
    assert isinstance(m, mi4afa.Conversation)
    assert (m.question, m.ground_truth, m.mistake_step, m.mistake_agent) == (
        "Do it.", "1", 1, "coder")
    assert [(t.name, t.content) for t in m.history] == [("planner", "plan"), ("coder", "x = 1")]
    back = from_mi4afa(m, task_id="T", record_id="r")
    assert back.speakers == conv.speakers and back.task == conv.task
    assert (back.mistake_step, back.mistake_agent, back.task_id) == (1, "coder", "T")
    assert [t.role for t in back.turns] == [None, None]  # mi4afa keeps no roles


def test_from_mi4afa_hand_crafted_speakers_warn(who_and_when_dir):
    path = sorted((who_and_when_dir / "Hand-Crafted").glob("*.json"))[0]
    record = json.loads(path.read_text())
    m = mi4afa.Conversation.from_who_and_when(record)
    with pytest.warns(UserWarning, match=r"named 'Unknown Agent'.*load_who_and_when"):
        conv = from_mi4afa(m)
    assert set(conv.speakers) == {"Unknown Agent"}
    ours = Conversation.from_who_and_when(record)
    assert "Unknown Agent" not in ours.speakers and len(ours) == len(conv)
    assert [t.content for t in ours.turns] == [t.content for t in conv.turns]


def test_from_mi4afa_refuses_nameless_turns():
    m = mi4afa.Conversation(question="q", ground_truth="a",
                            history=(mi4afa.Turn(name="", content="x"),))
    with pytest.raises(ConversationError, match="turn 0 has no speaker"):
        from_mi4afa(m)


def test_import_skafa_does_not_import_ag2():
    code = ("import sys, skafa; skafa.FailureAttributor; skafa.Conversation; "
            "import skafa.integrations; "
            "assert not any(m == 'ag2' or m.startswith('ag2.') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.startswith('ag2'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_example_ag2_blame_trace_layout():
    """examples/ag2_blame.py: each Who&When turn is a (call, result) pair of trace events."""
    import importlib.util
    from pathlib import Path

    from ag2.eval.sources import spans_to_trace

    path = Path(__file__).resolve().parents[2] / "examples" / "ag2_blame.py"
    spec = importlib.util.spec_from_file_location("ag2_blame", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_args(["--train", "3"]).train == 3
    conv = make_conversations(1, seed=0, min_turns=4, max_turns=4)[0]
    trace = spans_to_trace(module.record_spans(conv, "r"))
    assert len(trace.events) == 2 * len(conv)
    subagents = {s: s for s in conv.speakers}
    out, indices = conversation_from_trace(
        trace, question=conv.task, agent_name=module.MANAGER, subagents=subagents,
        tool_calls="agent", mistake_event=2 * conv.mistake_step + 1)
    assert out.speakers[1::2] == conv.speakers and set(out.speakers[::2]) == {module.MANAGER}
    assert [t.content for t in out.turns[1::2]] == [t.content for t in conv.turns]
    assert out.mistake_step == 2 * conv.mistake_step + 1
    assert [module.history_turn(i) for i in indices] == [t // 2 for t in range(2 * len(conv))]
