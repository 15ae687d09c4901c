"""Tests for the framework-free trace adapters: OpenTelemetry spans, AutoGen, LangGraph."""

import json
import warnings
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skafa import Conversation, ConversationError
from skafa.integrations import TraceConversation
from skafa.integrations.autogen import conversation_from_autogen
from skafa.integrations.langgraph import conversation_from_langgraph
from skafa.integrations.otel import conversation_from_otel_spans


# ------------------------------------------------------------------------ OTel
def _kv(key, value):
    if isinstance(value, bool):
        v = {"boolValue": value}
    elif isinstance(value, int):
        v = {"intValue": str(value)}
    else:
        v = {"stringValue": value}
    return {"key": key, "value": v}


def _otlp_span(name, span_id, parent, start, attrs, status=None, events=()):
    span = {"traceId": "t" * 32, "spanId": span_id, "name": name,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 5),
            "attributes": [_kv(k, v) for k, v in attrs.items()], "events": list(events)}
    if parent:
        span["parentSpanId"] = parent
    if status:
        span["status"] = status
    return span


def _otlp_doc():
    """A supervisor delegating to a researcher agent, as an OTLP/JSON export."""
    out_msg = lambda text: json.dumps([{"role": "assistant", "parts": [  # noqa: E731
        {"type": "text", "content": text}], "finish_reason": "stop"}])
    spans = [
        # listed out of start order on purpose
        _otlp_span("chat gpt", "c2", "sup", 50, {"gen_ai.operation.name": "chat",
                                                 "gen_ai.output.messages": out_msg("Done: 5")}),
        _otlp_span("invoke_agent supervisor", "sup", None, 10,
                   {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "supervisor"}),
        _otlp_span("chat gpt", "c1", "sup", 11, {"gen_ai.operation.name": "chat",
                                                 "gen_ai.output.messages": out_msg("Ask the "
                                                                                   "researcher.")}),
        _otlp_span("invoke_agent researcher", "res", "sup", 20,
                   {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "researcher"}),
        _otlp_span("chat gpt", "c3", "res", 21, {"gen_ai.operation.name": "chat",
                                                 "gen_ai.output.messages": json.dumps([{
                                                     "role": "assistant", "parts": [
                                                         {"type": "tool_call", "name": "add"}]}])}),
        _otlp_span("execute_tool add", "t1", "c3", 30,
                   {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "add",
                    "gen_ai.tool.call.arguments": '{"a": 2, "b": 2}',
                    "gen_ai.tool.call.result": "5"}),
        _otlp_span("execute_tool fetch", "t2", "res", 40,
                   {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "fetch"},
                   status={"code": 2, "message": ""},
                   events=[{"name": "exception", "attributes": [
                       _kv("exception.message", "HTTP 404")]}]),
        _otlp_span("GET /x", "h1", "t2", 41, {"http.method": "GET"}),
    ]
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {}, "spans": spans}]}]}


def test_otel_spans_keep_agent_names_and_order():
    doc = _otlp_doc()
    result = conversation_from_otel_spans(doc, question="2 + 2?", record_id="r")
    assert isinstance(result, TraceConversation)
    conv, indices = result
    expected = [
        (2, "supervisor", "Ask the researcher.", "assistant"),
        (5, "tool:add", 'call add({"a": 2, "b": 2})', "tool_call"),
        (5, "tool:add", "5", "tool"),
        (6, "tool:fetch", "call fetch({})", "tool_call"),
        (6, "tool:fetch", "error in fetch: HTTP 404", "tool_error"),
        (0, "supervisor", "Done: 5", "assistant"),
    ]
    assert [(i, t.speaker, t.content, t.role) for i, t in zip(indices, conv.turns)] == expected
    assert conv.task == "2 + 2?" and conv.record_id == "r"
    assert result.source_index(5) == 0


def test_otel_tool_calls_by_agent_and_subagents():
    conv, _ = conversation_from_otel_spans(_otlp_doc(), tool_calls="agent",
                                           subagents={"add": "calculator"})
    # the add tool runs under the researcher's model call: the researcher called it
    assert conv.speakers[1:3] == ("researcher", "calculator")
    assert conv.speakers[3] == "researcher"


def test_otel_flat_dicts_ag2_files_and_span_objects():
    ag2_file = {"trace_id": "x", "spans": [
        {"name": "agent", "span_id": "root", "parent_id": None, "start_ns": 1,
         "attributes": {"ag2.span.type": "agent", "gen_ai.agent.name": "boss"}},
        {"name": "llm", "span_id": "a", "parent_id": "root", "start_ns": 2,
         "attributes": {"ag2.span.type": "llm", "gen_ai.output.messages":
                        json.dumps([{"role": "assistant", "content": "hello"}])}},
    ]}
    conv, idx = conversation_from_otel_spans(ag2_file)
    assert conv.speakers == ("boss",) and idx == (1,)
    objects = [SimpleNamespace(name="chat", span_id="s", parent_id=None, start_ns=3,
                               status="OK", events=(),
                               attributes={"gen_ai.operation.name": "chat",
                                           "gen_ai.completion.0.content": "from OpenLLMetry"})]
    conv, _ = conversation_from_otel_spans(objects, agent_name="solo")
    assert conv.turns[0].speaker == "solo" and conv.turns[0].content == "from OpenLLMetry"


def test_otel_errors():
    with pytest.raises(ConversationError, match="there are no spans"):
        conversation_from_otel_spans([])
    with pytest.raises(ConversationError, match=r"none of its 1 spans.*'GET /x'"):
        conversation_from_otel_spans([{"name": "GET /x", "span_id": "1", "start_ns": 0,
                                       "attributes": {"http.method": "GET"}}])
    with pytest.raises(TypeError, match="resourceSpans"):
        conversation_from_otel_spans({"foo": 1})
    with pytest.raises(ConversationError, match="span 0 has a non-integer start time"):
        conversation_from_otel_spans([{"name": "x", "start_ns": "soon"}])


# --------------------------------------------------------------------- AutoGen
def _autogen_log():
    """A SelectorGroupChat run as TaskResult.messages model_dump() dicts."""
    return [
        {"type": "TextMessage", "source": "user", "content": "What is 2 + 2?"},
        {"type": "SelectSpeakerEvent", "source": "selector", "content": ["planner"]},
        {"type": "ThoughtEvent", "source": "planner", "content": "Let coder add."},
        {"type": "TextMessage", "source": "planner", "content": "coder: add 2 and 2."},
        {"type": "ModelClientStreamingChunkEvent", "source": "coder", "content": "ca"},
        {"type": "ToolCallRequestEvent", "source": "coder", "content": [
            {"id": "1", "name": "add", "arguments": '{"a": 2, "b": 2}'},
            {"id": "2", "name": "log", "arguments": "{}"}]},
        {"type": "ToolCallExecutionEvent", "source": "coder", "content": [
            {"call_id": "1", "name": "add", "content": "5", "is_error": False},
            {"call_id": "2", "name": "log", "content": "disk full", "is_error": True}]},
        {"type": "ToolCallSummaryMessage", "source": "coder", "content": "5"},
        {"type": "MultiModalMessage", "source": "critic", "content": ["Looks right.", {}]},
        {"type": "HandoffMessage", "source": "critic", "content": "Back to you.",
         "target": "planner"},
        {"type": "StopMessage", "source": "planner", "content": "TERMINATE"},
    ]


def test_autogen_mapping():
    conv, idx = conversation_from_autogen(_autogen_log(), expected_answer="4", task_id="T")
    expected = [
        (0, "user", "What is 2 + 2?", "user"),
        (2, "planner", "Let coder add.", "thought"),
        (3, "planner", "coder: add 2 and 2.", "assistant"),
        (5, "coder", 'call add({"a": 2, "b": 2})', "tool_call"),
        (5, "coder", "call log({})", "tool_call"),
        (6, "tool:add", "5", "tool"),
        (6, "tool:log", "error in log: disk full", "tool_error"),
        (7, "coder", "5", "assistant"),
        (8, "critic", "Looks right.\n[image]", "assistant"),
        (9, "critic", "Back to you.\n[hands off to planner]", "assistant"),
        (10, "planner", "TERMINATE", "assistant"),
    ]
    assert [(i, t.speaker, t.content, t.role) for i, t in zip(idx, conv.turns)] == expected
    assert conv.task == "What is 2 + 2?" and conv.expected_answer == "4" and conv.task_id == "T"


def test_autogen_objects_and_unknown_types():
    msgs = [SimpleNamespace(type="TextMessage", source="a", content="hi"),
            SimpleNamespace(type="FancyEvent", source="a", content="?")]
    with pytest.raises(ConversationError, match=r"message 1 has type 'FancyEvent'"):
        conversation_from_autogen(msgs)
    with pytest.warns(UserWarning, match=r"FancyEvent at \[1\]"):
        conv, idx = conversation_from_autogen(msgs, on_unknown="skip", task="given")
    assert idx == (0,) and conv.task == "given"
    with pytest.raises(ConversationError, match=r"message 0 \(TextMessage\) has no 'source'"):
        conversation_from_autogen([{"type": "TextMessage", "content": "x"}])
    with pytest.raises(ConversationError, match="none of its 1 messages is a turn"):
        conversation_from_autogen([{"type": "MemoryQueryEvent", "source": "m", "content": []}])


# ------------------------------------------------------------------- LangGraph
def test_langgraph_supervisor_log_in_three_shapes():
    plain = [
        {"type": "system", "content": "You supervise."},
        {"type": "human", "content": "Find the population of Lima."},
        {"type": "ai", "name": "supervisor", "content": "",
         "tool_calls": [{"name": "transfer_to_research_agent", "args": {}, "id": "a"}]},
        {"type": "tool", "name": "transfer_to_research_agent",
         "content": "Successfully transferred", "tool_call_id": "a"},
        {"type": "ai", "name": "research_agent",
         "content": [{"type": "text", "text": "Searching."}, {"type": "image_url"}],
         "tool_calls": [{"name": "search", "args": {"q": "Lima population"}, "id": "b"}]},
        {"type": "tool", "name": "search", "content": "timeout", "status": "error",
         "tool_call_id": "b"},
        {"type": "ai", "content": "About 10 million."},
    ]
    expected = [
        (1, "human", "Find the population of Lima.", "user"),
        (2, "supervisor", "call transfer_to_research_agent({})", "tool_call"),
        (3, "tool:transfer_to_research_agent", "Successfully transferred", "tool"),
        (4, "research_agent", "Searching.\n[image_url]", "assistant"),
        (4, "research_agent", 'call search({"q": "Lima population"})', "tool_call"),
        (5, "tool:search", "error in search: timeout", "tool_error"),
        (6, "boss", "About 10 million.", "assistant"),
    ]
    as_dicts = [{"type": m["type"], "data": {k: v for k, v in m.items() if k != "type"}}
                for m in plain]  # langchain_core.messages.messages_to_dict
    classes = {"system": "SystemMessage", "human": "HumanMessage", "ai": "AIMessage",
               "tool": "ToolMessage"}
    objects = [type(classes[m["type"]], (), {})() for m in plain]
    for obj, m in zip(objects, plain):
        obj.__dict__.update({k: v for k, v in m.items() if k != "type"})
    for shape in (plain, as_dicts, objects):
        conv, idx = conversation_from_langgraph(shape, agent_name="boss")
        got = [(i, t.speaker, t.content, t.role) for i, t in zip(idx, conv.turns)]
        assert got == expected
        assert conv.task == "Find the population of Lima."
    conv, idx = conversation_from_langgraph(plain, include_system=True)
    assert conv.speakers[0] == "system" and idx[0] == 0


def test_langgraph_openai_roles_and_errors():
    conv, idx = conversation_from_langgraph([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "name": "f", "content": "ok"},
    ])
    assert conv.speakers == ("human", "assistant", "tool:f") and idx == (0, 1, 2)
    with pytest.raises(ConversationError, match=r"message 0 has type 'remove'"):
        conversation_from_langgraph([{"type": "remove", "id": "x"}])
    with pytest.raises(ConversationError, match="none of its 1 messages"):
        conversation_from_langgraph([{"type": "ai", "content": ""}])
    with pytest.raises(TypeError, match="must be a list"):
        conversation_from_langgraph("hello")


def test_adapters_return_labelled_conversations():
    conv, _ = conversation_from_langgraph(
        [{"type": "human", "content": "q"}, {"type": "ai", "name": "x", "content": "a"}],
        mistake_step=1, mistake_agent="x", task_id="t")
    assert isinstance(conv, Conversation) and conv.mistake_speaker == "x"
    with pytest.raises(ConversationError, match="mistake_step"):
        conversation_from_autogen([{"type": "TextMessage", "source": "a", "content": "x"}],
                                  mistake_step=3)


@pytest.mark.parametrize("adapter, unknown", [
    (conversation_from_autogen, {"type": "FancyEvent", "source": "a", "content": "x"}),
    (conversation_from_langgraph, {"type": "remove", "id": "x"}),
])
def test_message_adapters_share_one_wording(adapter, unknown):
    """Both message-list adapters check and report through the same helpers."""
    good = ({"type": "TextMessage", "source": "user", "content": "q"}
            if adapter is conversation_from_autogen else {"type": "human", "content": "q"})
    with pytest.raises(ValueError, match="on_unknown must be 'error' or 'skip'"):
        adapter([good], on_unknown="ignore")
    with pytest.raises(TypeError, match="must be a list, got dict"):
        adapter(good)
    with pytest.warns(UserWarning, match=r"skipped messages of unknown types: .* at \[1\]"
                      ) as record:
        conv, idx = adapter([good, unknown], on_unknown="skip", record_id="r1")
    assert record[0].filename == __file__          # the warning points at the caller
    assert conv.task == "q" and idx == (0,) and conv.record_id == "r1"


# ------------------------------------ malformed traces: the readers' own errors
def _chat(span_id, parent=None, t=0, agent=None):
    attrs = {"gen_ai.operation.name": "chat",
             "gen_ai.output.messages": '[{"role": "assistant", "content": "hi"}]'}
    if agent:
        attrs["gen_ai.agent.name"] = agent
    return {"name": "chat", "span_id": span_id, "parent_id": parent, "start_ns": t,
            "attributes": attrs}


def _nested(depth):
    value = {"stringValue": "x"}
    for _ in range(depth):
        value = {"arrayValue": {"values": [value]}}
    return value


@pytest.mark.parametrize("spans, match", [
    ([{"name": "chat", "spanId": "a", "attributes": [{"value": {"stringValue": "x"}}]}],
     r"span 0: attribute 0 has no 'key'"),
    ({"spans": "abc"}, "'spans' must be a list, got str"),
    ({"resourceSpans": [{"scopeSpans": "x"}]}, r"resourceSpans\[0\]\.scopeSpans must be a list"),
    ([_chat("a"), _chat("a", t=1)], "spans 0 and 1 have the same span id 'a'"),
    ([{"name": "chat", "spanId": "a", "attributes": [{"key": "k", "value": _nested(100_000)}]}],
     "span 0: an attribute value nests more than"),
    ([{"name": "c", "span_id": "a", "attributes": 5}], "span 0: its attributes are a int"),
])
def test_otel_errors_name_the_trace_and_span(spans, match):
    with pytest.raises(ConversationError, match=r"trace 'r1': " + match):
        conversation_from_otel_spans(spans, record_id="r1")


def test_otel_deep_python_nesting_is_not_a_recursion_error():
    deep = current = []
    for _ in range(100_000):
        current.append([])
        current = current[0]
    span = {"name": "t", "span_id": "a", "attributes": {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "f",
        "gen_ai.tool.call.arguments": deep}}
    with pytest.raises(ConversationError, match="span 0: nested too deeply"):
        conversation_from_otel_spans([span])


def test_otel_agent_lookup_is_linear():
    import time

    spans = [{"name": "invoke_agent", "span_id": "s0", "start_ns": 0, "attributes": {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "boss"}}]
    spans += [_chat(f"s{i}", f"s{i - 1}", t=i) for i in range(1, 20_000)]
    start = time.perf_counter()
    conv, _ = conversation_from_otel_spans(spans)
    assert set(conv.speakers) == {"boss"}
    assert time.perf_counter() - start < 20  # quadratic: minutes


def test_otel_agent_lookup_keeps_nearest_agent():
    spans = [
        {"name": "a", "span_id": "A", "start_ns": 0, "attributes": {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "outer"}},
        {"name": "b", "span_id": "B", "parent_id": "A", "start_ns": 1, "attributes": {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "inner"}},
        _chat("c", "B", t=2), _chat("d", "A", t=3), _chat("e", "zz", t=4),
        _chat("f", "B", t=5, agent="own"),
    ]
    conv, _ = conversation_from_otel_spans(spans, agent_name="dflt")
    assert conv.speakers == ("inner", "outer", "dflt", "own")


@pytest.mark.parametrize("calls, match", [
    (5, "tool calls must be a list of calls, got int"),
    ("call it", "tool calls must be a list of calls, got str"),
    ({"name": "f"}, "tool calls must be a list of calls, got dict"),
    ([{"args": {}}], "tool call 0 has no name"),
])
def test_malformed_tool_calls_are_refused(calls, match):
    with pytest.raises(ConversationError, match="message 1: .*" + match):
        conversation_from_langgraph([{"type": "human", "content": "q"},
                                     {"type": "ai", "content": "", "tool_calls": calls}])
    with pytest.raises(ConversationError, match="message 1: .*" + match):
        conversation_from_autogen([
            {"type": "TextMessage", "source": "user", "content": "q"},
            {"type": "ToolCallRequestEvent", "source": "a", "content": calls}])


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                       st.text(max_size=5))


_json = st.recursive(_json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=3), st.dictionaries(st.sampled_from(
        ["name", "type", "content", "span_id", "parent_id", "spanId", "attributes", "key",
         "value", "tool_calls", "source", "spans", "resourceSpans", "scopeSpans",
         "gen_ai.operation.name", "start_ns", "args", "function", "status"]), c, max_size=4)),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(data=_json)
def test_adapters_fuzz_raise_only_their_own_errors(data):
    for adapter in (conversation_from_otel_spans, conversation_from_langgraph,
                    conversation_from_autogen):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                adapter(data)
        except (ConversationError, TypeError) as exc:
            # TypeError only for input that is not a list/document at all
            if isinstance(exc, TypeError):
                assert not isinstance(data, list), exc
