"""OpenTelemetry GenAI spans to a :class:`~skafa.Conversation`, keeping who spoke.

Agent frameworks that emit OpenTelemetry traces (ag2's ``TelemetryMiddleware``,
OpenAI Agents / LangChain / CrewAI instrumentations following the GenAI
semantic conventions, OpenLLMetry) record every model call and tool execution
as a span, and every agent run as an ``invoke_agent`` span around them. Unlike
``ag2.eval``'s span reader, :func:`conversation_from_otel_spans` keeps the
agent name of each model call (from the nearest enclosing agent span), so a
multi-agent trace keeps its speakers without a ``subagents`` mapping.

Accepted input (no OpenTelemetry package needed):

- an OTLP/JSON export (``{"resourceSpans": [{"scopeSpans": [{"spans": [...]}]}]}``,
  what the collector's file exporter and ``ConsoleSpanExporter``-style dumps
  hold), or a list of such documents;
- an ``ag2.eval`` trace file written by ``save_trace`` (``{"spans": [...]}``);
- a list of spans, each a dict (OTLP keys ``spanId`` / ``parentSpanId`` /
  ``startTimeUnixNano`` with attribute lists, or flat keys ``span_id`` /
  ``parent_id`` / ``start_ns`` with an attribute dict) or an object with those
  attributes (``ag2``'s ``SpanData``, an SDK ``ReadableSpan``).

Which span is what
------------------
=======================================  =================================================
span                                     turns
=======================================  =================================================
model call: ``gen_ai.operation.name``    one turn, if the output has text: speaker the
in {chat, text_completion,               agent (``gen_ai.agent.name`` of the span or of
generate_content}, or                    its nearest agent span), else ``agent_name``;
``ag2.span.type == "llm"``               text from ``gen_ai.output.messages`` (``content``
                                         or text ``parts``), else OpenLLMetry's
                                         ``gen_ai.completion.<i>.content``
tool: ``execute_tool`` /                 a call turn ``call <name>(<arguments>)``
``ag2.span.type == "tool"``              (speaker ``tool:<name>``, or the calling agent
                                         with ``tool_calls="agent"``) and a result turn
                                         (``gen_ai.tool.call.result``; speaker
                                         ``tool:<name>`` or the sub-agent named in
                                         ``subagents``); a span with status ``ERROR``
                                         gives ``error in <name>: <message>`` instead
agent (``invoke_agent``,                 no turn: it names the agent of the spans inside
``create_agent``, ``ag2.span.type ==     it
"agent"``)
anything else (HTTP, database, usage,    no turn (listed in the ``UserWarning`` raised
embeddings, spans of other dialects)     when *no* span is a GenAI span)
=======================================  =================================================

Spans are taken in start-time order (ties keep input order). The returned
``event_indices`` point into the flattened input span list; a tool span gives
two turns with the same index.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from ..conversation import Conversation, Turn
from ..exceptions import ConversationError
from ._common import TraceConversation, as_text, blocks_text, reading

__all__ = ["conversation_from_otel_spans"]

_LLM_OPS = {"chat", "text_completion", "generate_content"}
#: Deepest nesting of OTLP ``arrayValue``/``kvlistValue`` read (GenAI attributes nest
#: a few levels); deeper input is refused rather than recursed into.
_MAX_VALUE_DEPTH = 64
_AGENT_OPS = {"invoke_agent", "create_agent"}


def _otlp_value(value, depth=0):
    """Decode an OTLP/JSON ``AnyValue``; entries without ``key`` are refused."""
    if not isinstance(value, Mapping):
        return value
    if depth > _MAX_VALUE_DEPTH:
        raise ValueError(f"an attribute value nests more than {_MAX_VALUE_DEPTH} "
                                "arrayValue/kvlistValue levels")
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    if "arrayValue" in value:
        return [_otlp_value(v, depth + 1) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        out = {}
        for kv in value["kvlistValue"].get("values", []):
            if not isinstance(kv, Mapping) or not isinstance(kv.get("key"), str):
                raise ValueError(f"a kvlistValue entry has no 'key' ({str(kv)[:60]})")
            out[kv["key"]] = _otlp_value(kv.get("value"), depth + 1)
        return out
    return None


def _attributes(raw):
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
        out = {}
        for j, kv in enumerate(raw):
            if not isinstance(kv, Mapping) or not isinstance(kv.get("key"), str):
                raise ValueError(f"attribute {j} has no 'key' ({str(kv)[:60]})")
            out[kv["key"]] = _otlp_value(kv.get("value"))
        return out
    if isinstance(raw, (str, bytes, int, float)):
        raise ValueError(f"its attributes are a {type(raw).__name__}, not a mapping "
                                "or a list of key/value entries")
    return dict(raw)  # e.g. an SDK BoundedAttributes


def _list_at(value, what, where):
    """``value``, which must be a list: a string or mapping where a list belongs is refused."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConversationError(f"{where}: {what} must be a list, got "
                                f"{type(value).__name__} {str(value)[:60]!r}.")
    return value


def _mapping_at(value, what, where):
    if not isinstance(value, Mapping):
        raise ConversationError(f"{where}: {what} must be an object, got "
                                f"{type(value).__name__} {str(value)[:60]!r}.")
    return value


def _flatten(spans, where="trace"):
    """Every span of the input, in input order, as dicts or objects."""
    if isinstance(spans, Mapping):
        if "resourceSpans" in spans:
            out = []
            for a, rs in enumerate(_list_at(spans["resourceSpans"], "resourceSpans", where)):
                rs = _mapping_at(rs, f"resourceSpans[{a}]", where)
                scopes = _list_at(rs.get("scopeSpans", []), f"resourceSpans[{a}].scopeSpans",
                                  where)
                for b, ss in enumerate(scopes):
                    ss = _mapping_at(ss, f"resourceSpans[{a}].scopeSpans[{b}]", where)
                    out.extend(_list_at(ss.get("spans", []),
                                        f"resourceSpans[{a}].scopeSpans[{b}].spans", where))
            return out
        if "spans" in spans:
            return list(_list_at(spans["spans"], "'spans'", where))
        raise TypeError("a span document must hold 'resourceSpans' (OTLP/JSON) or 'spans' "
                        "(an ag2 trace file).")
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise TypeError(f"spans must be a list of spans or a span document, got "
                        f"{type(spans).__name__}.")
    out = []
    for item in spans:
        if isinstance(item, Mapping) and ("resourceSpans" in item or "spans" in item):
            out.extend(_flatten(item, where))
        else:
            out.append(item)
    return out


def _norm_id(value):
    if value is None or value == "" or value == 0:
        return None
    if isinstance(value, int):
        return f"{value:016x}"
    return str(value)


def _span(item, i, where):
    """(name, span_id, parent_id, start, attributes, status, error message) of one span."""
    if isinstance(item, Mapping):
        get = item.get
    else:
        def get(key, default=None):
            return getattr(item, key, default)
    context = get("context")
    span_id = get("span_id", get("spanId"))
    if span_id is None and context is not None:
        span_id = getattr(context, "span_id", None)
    parent = get("parent_id", get("parentSpanId"))
    if parent is None and not isinstance(item, Mapping):
        parent_ctx = get("parent")
        parent = getattr(parent_ctx, "span_id", None) if parent_ctx is not None else None
    start = get("start_ns", get("startTimeUnixNano", get("start_time", 0))) or 0
    try:
        start = int(start)
    except (TypeError, ValueError):
        raise ConversationError(f"{where}: span {i} has a non-integer start time "
                                f"{start!r}.") from None
    status = get("status", "UNSET")
    message = ""
    if isinstance(status, Mapping):  # OTLP: {"code": 2 | "STATUS_CODE_ERROR", "message"}
        message = status.get("message", "")
        code = status.get("code")
        status = "ERROR" if code in (2, "STATUS_CODE_ERROR", "ERROR") else "OK"
    elif not isinstance(status, str):  # SDK Status object
        message = getattr(status, "description", "") or ""
        code = getattr(status, "status_code", None)
        status = "ERROR" if getattr(code, "name", code) == "ERROR" else "OK"
    for event in get("events", ()) or ():
        ev_get = event.get if isinstance(event, Mapping) else (
            lambda k, d=None, _e=event: getattr(_e, k, d))
        if ev_get("name") == "exception":
            attrs = _attributes(ev_get("attributes"))
            message = message or as_text(attrs.get("exception.message", ""))
    return (as_text(get("name", "")), _norm_id(span_id), _norm_id(parent), start,
            _attributes(get("attributes")), status.upper(), message)


def _kind(attrs):
    op = attrs.get("gen_ai.operation.name")
    ag2_kind = attrs.get("ag2.span.type")
    if op in _LLM_OPS or ag2_kind == "llm":
        return "llm"
    if op == "execute_tool" or ag2_kind == "tool":
        return "tool"
    if op in _AGENT_OPS or ag2_kind == "agent":
        return "agent"
    return None


def _output_text(attrs):
    raw = attrs.get("gen_ai.output.messages")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return raw
    texts = []
    if isinstance(raw, Mapping):
        raw = [raw]
    if isinstance(raw, Sequence) and not isinstance(raw, str):
        for msg in raw:
            if not isinstance(msg, Mapping):
                continue
            if "parts" in msg:
                parts = [p for p in msg["parts"] if isinstance(p, Mapping)
                         and p.get("type", "text") == "text"]
                texts.append(blocks_text(parts))
            else:
                texts.append(blocks_text(msg.get("content")))
    else:  # OpenLLMetry: gen_ai.completion.0.content, gen_ai.completion.1.content, ...
        k = 0
        while f"gen_ai.completion.{k}.content" in attrs:
            texts.append(as_text(attrs[f"gen_ai.completion.{k}.content"]))
            k += 1
    return "\n".join(t for t in texts if t)


def conversation_from_otel_spans(
    spans,
    *,
    question="",
    ground_truth=None,
    agent_name="assistant",
    subagents=None,
    tool_calls="tool",
    task_id=None,
    record_id=None,
):
    """Turn OpenTelemetry GenAI spans of one run into a conversation.

    Read more in the module docstring (:mod:`skafa.integrations.otel`), which
    lists which span becomes whose turn.

    Parameters
    ----------
    spans : list of spans, or a span document
        One trace: an OTLP/JSON export, an ``ag2`` trace file dict, or a list
        of span dicts or span objects.
    question : str, default=""
        The task of the run (``Conversation.task``).
    ground_truth : str, default=None
        The expected answer, when known.
    agent_name : str, default="assistant"
        Speaker of model calls outside any named agent span.
    subagents : mapping of str to str, default=None
        Delegation tool name -> sub-agent, for results spoken by the sub-agent.
    tool_calls : {"tool", "agent"}, default="tool"
        Speaker of a tool call: ``tool:<name>``, or the agent that made it.
    task_id, record_id : str, default=None
        Identifiers kept on the conversation (``record_id`` names it in errors).

    Returns
    -------
    result : TraceConversation
        The conversation and, per turn, the index of its span in the
        flattened input.

    Raises
    ------
    skafa.ConversationError
        When there are no spans, or no span gives a turn (the message names
        the span names seen).
    TypeError
        For input that is not a span list or document.

    Examples
    --------
    >>> spans = [
    ...   {"name": "invoke_agent coder", "span_id": "a", "start_ns": 1,
    ...    "attributes": {"gen_ai.operation.name": "invoke_agent",
    ...                   "gen_ai.agent.name": "coder"}},
    ...   {"name": "chat", "span_id": "b", "parent_id": "a", "start_ns": 2,
    ...    "attributes": {"gen_ai.operation.name": "chat", "gen_ai.output.messages":
    ...                   '[{"role": "assistant", "parts": [{"type": "text", '
    ...                   '"content": "x = 2 + 2"}]}]'}}]
    >>> conv, idx = conversation_from_otel_spans(spans, question="Add.")
    >>> conv.turns[0].speaker, conv.turns[0].content, idx
    ('coder', 'x = 2 + 2', (1,))
    """
    where = "trace" if record_id is None else f"trace {record_id!r}"
    if tool_calls not in ("tool", "agent"):
        raise ValueError(f"tool_calls must be 'tool' or 'agent', got {tool_calls!r}.")
    subagents = dict(subagents or {})
    items = _flatten(spans, where)
    if not items:
        raise ConversationError(f"{where}: there are no spans.")
    parsed = []
    for i, item in enumerate(items):
        with reading(f"{where}: span {i}"):
            parsed.append(_span(item, i, where))
    by_id = {}
    for i, p in enumerate(parsed):
        if p[1] is None:
            continue
        if p[1] in by_id:  # which one would be the parent of their children?
            first = next(j for j, q in enumerate(parsed) if q[1] == p[1])
            raise ConversationError(f"{where}: spans {first} and {i} have the same span id "
                                    f"{p[1][:60]!r}; span ids must be unique in a trace.")
        by_id[p[1]] = p

    def named(name):
        return isinstance(name, str) and name.strip() and name != "unknown"

    inherited = {}  # span id -> agent name its descendants inherit (memoised: linear)

    def agent_above(parent):
        """Agent name of the nearest agent span at or above the span ``parent``."""
        chain, seen, result = [], set(), agent_name
        while parent is not None:
            if parent in inherited:
                result = inherited[parent]
                break
            if parent in seen or parent not in by_id:  # a cycle or an unknown parent
                break
            seen.add(parent)
            chain.append(parent)
            attrs = by_id[parent][4]
            if named(attrs.get("gen_ai.agent.name")) and _kind(attrs) == "agent":
                result = attrs["gen_ai.agent.name"]
                break
            parent = by_id[parent][2]
        for span_id in chain:
            inherited[span_id] = result
        return result

    def agent_of(span):
        """Agent name of a span: its own, else its nearest agent ancestor's."""
        name = span[4].get("gen_ai.agent.name")
        return name if named(name) else agent_above(span[2])

    order = sorted(range(len(parsed)), key=lambda i: (parsed[i][3], i))
    turns, indices = [], []
    for i in order:
        with reading(f"{where}: span {i}"):
            _span_turns(i, parsed[i], turns, indices, agent_of, tool_calls, subagents)
    if not turns:
        names = sorted({p[0] for p in parsed})[:10]
        raise ConversationError(
            f"{where}: none of its {len(parsed)} spans is a GenAI model call with text or a "
            f"tool execution (span names: {', '.join(map(repr, names))}); expected "
            "gen_ai.operation.name or ag2.span.type attributes."
        )
    conv = Conversation(turns, task=question or "",
                        expected_answer="" if ground_truth is None else ground_truth,
                        task_id=task_id, record_id=record_id,
                        metadata={"source": "opentelemetry"})
    return TraceConversation(conv, tuple(indices))


def _span_turns(i, span, turns, indices, agent_of, tool_calls, subagents):
    """Append the turns span ``i`` gives (none, one, or a tool call and its result)."""
    name, _, _, _, attrs, status, message = span
    kind = _kind(attrs)
    if kind == "llm":
        text = _output_text(attrs)
        if text.strip():
            turns.append(Turn(agent_of(span), text, "assistant"))
            indices.append(i)
    elif kind == "tool":
        tool = as_text(attrs.get("gen_ai.tool.name") or name.removeprefix("execute_tool ")
                       or "tool")
        caller = agent_of(span) if tool_calls == "agent" else f"tool:{tool}"
        args = as_text(attrs.get("gen_ai.tool.call.arguments", "{}"))
        turns.append(Turn(caller, f"call {tool}({args})", "tool_call"))
        indices.append(i)
        if status == "ERROR":
            turns.append(Turn(f"tool:{tool}", f"error in {tool}: {message}", "tool_error"))
        else:
            result = as_text(attrs.get("gen_ai.tool.call.result", ""))
            turns.append(Turn(subagents.get(tool) or f"tool:{tool}", result, "tool"))
        indices.append(i)
