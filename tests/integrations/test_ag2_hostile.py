"""Malformed ag2 events: every refusal names the trace, the event index and the field.

Issue "Hostile and odd input, round four", item 6. Run against the real ag2
package (no LLM is called).
"""

import asyncio
import re
import uuid

import pytest

pytest.importorskip("ag2.eval", reason="the ag2 extra is not installed (pip install 'skafa[ag2]')")

from ag2 import events as ev  # noqa: E402
from ag2.eval import InMemoryTraceSource, Trace, TraceRef, evaluate_traces  # noqa: E402

from skafa import ConversationError  # noqa: E402
from skafa.integrations.ag2 import (  # noqa: E402
    conversation_from_trace,
    failure_attribution_scorer,
)


def _trace(events):
    return Trace(events=events, exception=None, duration_ms=1)


def _hello():
    return ev.ModelResponse(ev.ModelMessage("Hello."))


def _task_event(kind, agent_name):
    common = {"task_id": "t1", "agent_name": agent_name, "objective": "o"}
    if kind is ev.TaskCompleted:
        return ev.TaskCompleted(result="done", task_stream=uuid.uuid4(), **common)
    if kind is ev.TaskFailed:
        return ev.TaskFailed(error=RuntimeError("x"), **common)
    return kind(**common)


# ------------------------------------------------------ who speaks: agent names
@pytest.mark.parametrize("kind", [ev.TaskCompleted, ev.TaskFailed, ev.TaskCancelled,
                                  ev.TaskExpired])
@pytest.mark.parametrize("name", ["", "   ", None])
def test_task_event_without_agent_name_is_named(kind, name):
    trace = _trace([_hello(), _hello(), _task_event(kind, name)])
    pattern = re.escape(f"trace 'run-7': event 2 ({kind.__name__}): agent_name is {name!r}")
    with pytest.raises(ConversationError, match=pattern):
        conversation_from_trace(trace, question="q", record_id="run-7")


def test_unnamed_trace_is_still_located_by_event():
    trace = _trace([_hello(), _task_event(ev.TaskCompleted, "")])
    with pytest.raises(ConversationError, match=r"^trace: event 1 \(TaskCompleted\): "
                                                r"agent_name is ''"):
        conversation_from_trace(trace, question="q")


# ------------------------------------------------------------ content fields
def test_human_message_without_content_is_named():
    trace = _trace([_hello(), ev.HumanMessage(None)])
    with pytest.raises(ConversationError,
                       match=r"trace 'r1': event 1 \(HumanMessage\): content is None"):
        conversation_from_trace(trace, question="q", record_id="r1")
    # An empty reply is text: a turn with empty content.
    conv, idx = conversation_from_trace(_trace([_hello(), ev.HumanMessage("")]),
                                        question="q")
    assert idx == (0, 1) and conv.turns[1].content == "" and conv.speakers[1] == "human"


def test_human_input_request_without_prompt_is_named():
    trace = _trace([_hello(), ev.HumanInputRequest(None)])
    with pytest.raises(ConversationError,
                       match=r"trace 'r1': event 1 \(HumanInputRequest\): content is None"):
        conversation_from_trace(trace, question="q", record_id="r1")


def test_model_response_with_only_tool_calls_is_not_an_error():
    """content=None with tool calls is a tool-call-only message (ag2 / OpenAI)."""
    call = ev.ToolCallEvent("search", arguments='{"q": "x"}')
    events = [
        ev.ModelResponse(ev.ModelMessage(None), tool_calls=ev.ToolCallsEvent([call])),
        ev.ModelResponse(tool_calls=ev.ToolCallsEvent([call])),  # no message at all
        ev.ToolCallsEvent([call]),
        call,
        ev.ToolResultEvent.from_call(call, "found"),
        ev.ModelResponse(ev.ModelMessage("It is found.")),
    ]
    conv, idx = conversation_from_trace(_trace(events), question="q", record_id="r")
    assert idx == (3, 4, 5)
    assert conv.speakers == ("tool:search", "tool:search", "assistant")
    assert conv.turns[0].content == 'call search({"q": "x"})'


def test_model_response_with_neither_text_nor_tool_calls_gives_no_turn():
    """An empty answer (no text, no call) is skipped, as in the other adapters."""
    events = [_hello(), ev.ModelResponse(ev.ModelMessage(None)), ev.ModelResponse(None),
              ev.ModelResponse(ev.ModelMessage("   "))]
    conv, idx = conversation_from_trace(_trace(events), question="q")
    assert idx == (0,)


@pytest.mark.parametrize("content", [5, ["a", "b"], {"text": "hi"}, b"bytes"])
def test_model_response_with_non_text_content_is_named(content):
    trace = _trace([_hello(), ev.ModelResponse(ev.ModelMessage(content))])
    with pytest.raises(ConversationError,
                       match=r"trace 'r1': event 1 \(ModelResponse\): message.content is "
                             rf"{type(content).__name__}"):
        conversation_from_trace(trace, question="q", record_id="r1")


# ---------------------------------------------------------------- tool names
@pytest.mark.parametrize("name", ["", None, 3])
def test_tool_call_without_name_is_named(name):
    call = ev.ToolCallEvent(name)
    with pytest.raises(ConversationError,
                       match=r"trace 'r1': event 1 \(ToolCallEvent\): name is "):
        conversation_from_trace(_trace([_hello(), call]), question="q", record_id="r1")


def test_tool_result_without_name_takes_its_call_name():
    call = ev.ToolCallEvent("search")
    result = ev.ToolResultEvent(parent_id=call.id, result=ev.ToolResult.ensure_result("x"))
    error = ev.ToolErrorEvent(parent_id=call.id, error=TimeoutError("slow"),
                              result=ev.ToolResult.ensure_result("t"))
    delegate = ev.ToolCallEvent("ask_bob")
    sub = ev.ToolResultEvent(parent_id=delegate.id, result=ev.ToolResult.ensure_result("y"))
    conv, _ = conversation_from_trace(_trace([call, result, error, delegate, sub]),
                                      question="q", subagents={"ask_bob": "bob"})
    assert conv.speakers == ("tool:search", "tool:search", "tool:search", "tool:ask_bob",
                             "bob")
    assert conv.turns[2].content == "error in search: slow"


def test_tool_result_without_name_or_known_call_is_named():
    orphan = ev.ToolResultEvent(parent_id="c-9", result=ev.ToolResult.ensure_result("x"))
    with pytest.raises(ConversationError,
                       match=r"trace 'r1': event 1 \(ToolResultEvent\): name is None and "
                             r"no earlier ToolCallEvent has id 'c-9'"):
        conversation_from_trace(_trace([_hello(), orphan]), question="q", record_id="r1")


# ------------------------------------------------------------------- scorer
def test_scorer_records_the_located_error_as_the_feedback_comment(tmp_path):
    class _Never:
        def attribute(self, conversation, top_k=3):  # pragma: no cover - never reached
            raise AssertionError("a malformed trace must not reach the attributor")

    scorer = failure_attribution_scorer(_Never())
    bad = _trace([_hello(), _task_event(ev.TaskCompleted, "")])
    source = InMemoryTraceSource([(TraceRef(trace_id="bad", task_id="bad"), bad)])
    run = asyncio.run(evaluate_traces(source, scorers=[scorer], store_dir=tmp_path))
    (task_result,) = run.tasks
    (fb,) = task_result.feedback
    assert fb.score is None and fb.value is None
    assert "event 1 (TaskCompleted): agent_name is ''" in fb.comment


@pytest.mark.parametrize("agent", ["", None, 3])
def test_subagents_entries_must_be_names(agent):
    with pytest.raises(ValueError, match=r"subagents\['ask_bob'\] must be the sub-agent's name"):
        conversation_from_trace(_trace([_hello()]), question="q", subagents={"ask_bob": agent})
    with pytest.raises(ValueError, match=r"subagents\['ask_bob'\]"):
        failure_attribution_scorer(_Attributes(), subagents={"ask_bob": agent})


class _Attributes:
    def attribute(self, conversation, top_k=3):  # pragma: no cover - never called
        raise AssertionError
