"""skafa inside ``ag2``: traces to conversations, an ``ag2.eval`` blame scorer, mi4afa data.

Needs the optional ``ag2`` extra (``pip install "skafa[ag2]"``, i.e. ``ag2>=1.2,<2``);
``import skafa`` never imports it.

- :func:`conversation_from_trace` turns an :class:`ag2.eval.Trace` into a
  :class:`~skafa.Conversation`, remembering which ``trace.events`` entry became
  each turn.
- :func:`subagent_names` lists an agent's delegation tools, so that their results
  are spoken by the sub-agent rather than by ``tool:<name>``.
- :func:`failure_attribution_scorer` is an ``ag2.eval`` scorer: a fitted
  :class:`~skafa.FailureAttributor` blames one turn of every trace; the
  :class:`~ag2.eval.Feedback` ``value`` is the responsible agent, so
  ``RunResult.value_counts(key)`` is the blame distribution over many runs.
- :func:`to_mi4afa` / :func:`from_mi4afa` move conversations between skafa and
  ``ag2.extensions.mi4afa``.

Who speaks which event
----------------------
``ag2.eval`` events carry no speaker, so :func:`conversation_from_trace` decides:

======================================  ==========================  ===============================
event                                   speaker                     content
======================================  ==========================  ===============================
``ModelResponse`` with text             ``agent_name``              the response text
``ModelResponse`` without text          (no turn: its tool calls are the following events)
``ToolCallEvent``                       ``tool:<name>``             ``call <name>(<arguments>)``
                                        (``agent_name`` with
                                        ``tool_calls="agent"``)
``ToolResultEvent``                     ``tool:<name>``, or the     the result's text parts
                                        sub-agent for a delegation
                                        tool in ``subagents``
``ToolErrorEvent``                      ``tool:<name>`` (also for   ``error in <name>: <error>``
                                        delegation tools)
``TaskCompleted``                       ``event.agent_name``        the sub-task's result
``TaskFailed`` / ``TaskExpired`` /      ``event.agent_name``        ``failed: <error>`` / ...
``TaskCancelled``
``HumanInputRequest``                   ``agent_name``              ``asks the human: <prompt>``
``HumanMessage``                        ``human``                   the human's reply
======================================  ==========================  ===============================

Skipped, as carrying no turn of their own: usage and accounting events, model
requests (the task is passed as ``question``), task starts, the container events
``ToolCallsEvent`` / ``ToolResultsEvent`` (their members are separate events),
observer, compaction and aggregation lifecycle events, alerts and halts, voice
events, and every *transient* event (streaming chunks, reasoning, progress:
superseded by the durable event that follows). Any other event type is refused
(``on_unknown="error"``, naming its index and type) or skipped with a warning
(``on_unknown="skip"``).

Missing and malformed fields
----------------------------
``None`` is read as ag2 types it. A ``ModelResponse`` whose ``content`` is
``None`` (no ``message``, or ``ModelMessage(None)``) is legitimate: in ag2, as
in OpenAI chat messages, a response that only calls tools carries no text. It
gives no turn, whether or not it carries ``tool_calls``: its calls are the
``ToolCallEvent`` entries that follow, and a response with neither text nor
calls (an empty answer) has nothing to attribute, as in the other adapters
(a trace of nothing else is refused for having no turn). A ``ToolResultEvent``
or ``ToolErrorEvent`` without a ``name`` (ag2 allows ``None``) is spoken by
the tool of the earlier call whose ``id`` is its ``parent_id``.

Where ag2 types a field as text, anything else is a malformed event and is
refused with a :class:`~skafa.ConversationError` naming the trace
(``record_id``), the event's index in ``trace.events``, its type and the field:
an empty or non-text ``agent_name`` of a task event (the turn would have no
speaker), a tool call without a ``name``, a nameless result whose call is not
in the trace, a non-text ``ModelResponse`` ``message.content``, and a
``HumanMessage`` or ``HumanInputRequest`` whose ``content`` is not text (an
empty reply ``""`` is text, and a turn). For example ``trace 'run-7': event 12
(TaskCompleted): agent_name is ''; ...``.

A delegation tool returns only after running its sub-agent (a failed sub-agent
comes back as a result text), so its result is the sub-agent's turn; it errors
when its call is refused before the sub-agent runs (bad arguments), so its
errors stay with ``tool:<name>``. Traces rebuilt from OpenTelemetry spans (what
``run_agent`` and ``DirectoryTraceSource`` give) have no task events: there the
``subagents`` mapping is the only way to name a sub-agent.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import asyncio
import json
import threading
import warnings

import numpy as np

try:
    import ag2.eval as _eval
    from ag2 import events as _ev
    from ag2.eval.scorers import Attribution as _Ag2Attribution
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "skafa.integrations.ag2 needs the 'ag2' package (ag2>=1.2,<2). Install it with "
        "pip install \"skafa[ag2]\"."
    ) from exc

from ..conversation import Conversation, Turn
from ..exceptions import ConversationError
from ._common import TraceConversation, as_text, reading

__all__ = [
    "TraceConversation",
    "conversation_from_trace",
    "subagent_names",
    "failure_attribution_scorer",
    "to_mi4afa",
    "from_mi4afa",
]

_TOOL_CALLS = ("tool", "agent")
_ON_UNKNOWN = ("error", "skip")

# Events that are not a turn of anybody's (see the module docstring).
_NOT_TURNS = (
    _ev.UsageEvent,
    _ev.ModelRequest,
    _ev.MessageEnqueued,
    _ev.TaskStarted,
    _ev.TaskProgress,
    _ev.ToolCallsEvent,
    _ev.ToolResultsEvent,
    _ev.ClientToolCallEvent,
    _ev.ObserverStarted,
    _ev.ObserverCompleted,
    _ev.CompactionStarted,
    _ev.CompactionCompleted,
    _ev.CompactionFailed,
    _ev.AggregationStarted,
    _ev.AggregationCompleted,
    _ev.AggregationFailed,
    _ev.EventLogFailed,
    _ev.ObserverAlert,
    _ev.HaltEvent,
    _ev.TranscriptionChunkEvent,
    _ev.TranscriptionCompletedEvent,
    _ev.SynthesizedAudioEvent,
    _ev.RecordedAudioEvent,
    _ev.AudioPlaybackStartedEvent,
    _ev.AudioPlaybackCompletedEvent,
    _ev.AudioInterruptedEvent,
)


def _where(record_id):
    return "trace" if record_id is None else f"trace {record_id!r}"


def _shown(value):
    """``value`` for an error message: ``None`` or a string as such, else its type too."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return text if value is None or isinstance(value, str) else f"{type(value).__name__} {text}"


def _name_field(value, field, why):
    """A speaker-giving field of an event: refused unless non-empty text."""
    if not isinstance(value, str) or not value.strip():
        raise ConversationError(f"{field} is {_shown(value)}; {why}")
    return value


def _text_field(value, field, why):
    """A content field that ag2 types ``str``: refused unless text (empty is text)."""
    if not isinstance(value, str):
        raise ConversationError(f"{field} is {_shown(value)}, not text; {why}")
    return value


def _result_text(event) -> str:
    parts = []
    for part in getattr(event.result, "parts", ()) or ():
        content = getattr(part, "content", None)
        parts.append(content if isinstance(content, str) else f"[{type(part).__name__}]")
    return "\n".join(parts)


def _remember_calls(event, call_names):
    """Note ``id -> name`` of the tool calls an event carries (for nameless results)."""
    if isinstance(event, _ev.ModelResponse):
        calls = getattr(getattr(event, "tool_calls", None), "calls", None) or ()
    elif isinstance(event, _ev.ToolCallsEvent):
        calls = getattr(event, "calls", None) or ()
    elif isinstance(event, _ev.ToolCallEvent):
        calls = (event,)
    else:
        return
    for call in calls:
        name, call_id = getattr(call, "name", None), getattr(call, "id", None)
        if isinstance(name, str) and name.strip() and isinstance(call_id, str):
            call_names.setdefault(call_id, name)


def _tool_name(event, call_names):
    """The tool a result or error answers: its ``name``, else that of its call."""
    name = event.name
    if isinstance(name, str) and name.strip():
        return name
    parent = getattr(event, "parent_id", None)
    known = call_names.get(parent) if isinstance(parent, str) else None
    if known is None:
        raise ConversationError(
            f"name is {_shown(name)} and no earlier ToolCallEvent has id {parent!r} "
            "(parent_id); the result cannot be given to a tool.")
    return known


def _check_subagents(subagents):
    """``subagents`` as a dict of tool name -> sub-agent name, every entry checked."""
    subagents = dict(subagents or {})
    for tool, agent in subagents.items():
        if not isinstance(agent, str) or not agent.strip():
            raise ValueError(f"subagents[{tool!r}] must be the sub-agent's name (a non-empty "
                             f"string), got {agent!r}.")
    return subagents


_NO_AGENT = "the agent that ran the sub-task must be named to speak its turn."


def _event_turn(event, agent_name, subagents, tool_calls, call_names):
    """The Turn an event becomes, ``None`` for a non-turn, or ``NotImplemented`` if unknown.

    A malformed field raises a :class:`ConversationError` naming the field;
    the caller adds the trace and the event index.
    """
    if isinstance(event, _ev.ModelResponse):
        text = event.content
        if text is None:  # no message, or a tool-call-only one: not a turn of its own
            return None
        _text_field(text, "message.content", "a model response's content must be text, "
                    "or None when it carries only tool calls.")
        return Turn(agent_name, text, "assistant") if text.strip() else None
    # ToolErrorEvent subclasses ToolResultEvent: test it first.
    if isinstance(event, _ev.ToolErrorEvent):
        name = _tool_name(event, call_names)
        return Turn(f"tool:{name}", f"error in {name}: {event.error}", "tool_error")
    if isinstance(event, _ev.ToolResultEvent):
        name = _tool_name(event, call_names)
        speaker = subagents.get(name) or f"tool:{name}"
        return Turn(speaker, _result_text(event), "tool")
    if isinstance(event, _ev.ToolCallEvent):
        name = _name_field(event.name, "name", "a tool call must name its tool.")
        speaker = agent_name if tool_calls == "agent" else f"tool:{name}"
        return Turn(speaker, f"call {name}({as_text(event.arguments)})", "tool_call")
    if isinstance(event, _ev.TaskCompleted):
        return Turn(_name_field(event.agent_name, "agent_name", _NO_AGENT),
                    as_text(event.result), "task")
    if isinstance(event, _ev.TaskFailed):
        return Turn(_name_field(event.agent_name, "agent_name", _NO_AGENT),
                    f"failed: {event.error}", "task")
    if isinstance(event, _ev.TaskCancelled):
        speaker = _name_field(event.agent_name, "agent_name", _NO_AGENT)
        reason = f": {as_text(event.reason)}" if event.reason else ""
        return Turn(speaker, f"cancelled{reason}", "task")
    if isinstance(event, _ev.TaskExpired):
        return Turn(_name_field(event.agent_name, "agent_name", _NO_AGENT),
                    "expired before finishing", "task")
    if isinstance(event, _ev.HumanInputRequest):
        prompt = _text_field(event.content, "content", "a request for human input must "
                             "hold its prompt as text.")
        return Turn(agent_name, f"asks the human: {prompt}", "assistant")
    if isinstance(event, _ev.HumanMessage):
        reply = _text_field(event.content, "content", "a human reply must be text (an "
                            "empty reply is '').")
        return Turn("human", reply, "user")
    if isinstance(event, _NOT_TURNS) or getattr(type(event), "__transient__", False):
        return None
    return NotImplemented


def conversation_from_trace(
    trace,
    *,
    question,
    ground_truth=None,
    agent_name="assistant",
    subagents=None,
    tool_calls="tool",
    on_unknown="error",
    mistake_event=None,
    mistake_agent=None,
    task_id=None,
    record_id=None,
):
    """Turn the events of an ``ag2.eval`` trace into a conversation.

    Read more in the module docstring (:mod:`skafa.integrations.ag2`), which
    lists which event becomes whose turn.

    Parameters
    ----------
    trace : ag2.eval.Trace
        The captured run (from ``run_agent``, a trace source, or built by hand).
    question : str
        The task the run was solving (becomes ``Conversation.task``).
    ground_truth : str, default=None
        The expected answer, when known (``Conversation.expected_answer``).
    agent_name : str, default="assistant"
        Speaker of the traced agent's own model responses.
    subagents : mapping of str to str, default=None
        Delegation tool name -> the sub-agent it runs, as :func:`subagent_names`
        returns; those tools' results are spoken by the sub-agent.
    tool_calls : {"tool", "agent"}, default="tool"
        Speaker of a ``ToolCallEvent``: ``"tool"`` gives ``tool:<name>``;
        ``"agent"`` gives ``agent_name`` (the model that wrote the arguments),
        closer to Who&When, where the agent that writes code owns it and the
        terminal that runs it speaks the output.
    on_unknown : {"error", "skip"}, default="error"
        An event of a type not listed in the module docstring raises
        (``"error"``) or is skipped with one ``UserWarning`` naming the types
        (``"skip"``).
    mistake_event : int, default=None
        Index into ``trace.events`` of the annotated decisive event, when known;
        becomes ``mistake_step`` (the turn built from that event). It must be an
        event that became a turn.
    mistake_agent : str, default=None
        The annotated responsible agent, when known.
    task_id, record_id : str, default=None
        Identifiers kept on the conversation (``record_id`` also names the
        trace in errors).

    Returns
    -------
    result : TraceConversation
        ``(conversation, event_indices)``: ``event_indices[t]`` is the index in
        ``trace.events`` of the event behind turn ``t``.

    Raises
    ------
    skafa.ConversationError
        When the trace has no events, when none of its events is a turn (the
        message names the event types seen), for an unknown event type under
        ``on_unknown="error"``, when ``mistake_event`` is not a turn, or for a
        malformed event (see "Missing and malformed fields" in the module
        docstring); the message names the trace (``record_id``), the event's
        index and type, and the field.
    TypeError
        When ``trace`` has no ``events``.
    ValueError
        For a bad argument: ``tool_calls``, ``on_unknown``, an empty
        ``agent_name``, or a ``subagents`` entry that is not a non-empty name.

    Notes
    -----
    A trace without any model response (the agent only called tools or
    delegated, or it crashed before answering) is converted all the same: its
    tool and sub-agent turns are what there is to blame. ``trace.exception``
    is not a turn; its text is kept in ``metadata["trace_exception"]``.

    Examples
    --------
    >>> from ag2.eval import Trace
    >>> from ag2.events import ModelMessage, ModelResponse, ToolCallEvent, ToolResultEvent
    >>> call = ToolCallEvent("search", arguments='{"q": "capital of Peru"}')
    >>> trace = Trace(events=[call, ToolResultEvent.from_call(call, "Lima"),
    ...                       ModelResponse(ModelMessage("It is Cusco."))],
    ...               exception=None, duration_ms=5)
    >>> conv, idx = conversation_from_trace(trace, question="Capital of Peru?")
    >>> conv.speakers, idx
    (('tool:search', 'tool:search', 'assistant'), (0, 1, 2))
    """
    where = _where(record_id)
    if tool_calls not in _TOOL_CALLS:
        raise ValueError(f"tool_calls must be one of {_TOOL_CALLS}, got {tool_calls!r}.")
    if on_unknown not in _ON_UNKNOWN:
        raise ValueError(f"on_unknown must be one of {_ON_UNKNOWN}, got {on_unknown!r}.")
    if not isinstance(agent_name, str) or not agent_name.strip():
        raise ValueError(f"agent_name must be a non-empty string, got {agent_name!r}.")
    subagents = _check_subagents(subagents)
    events = getattr(trace, "events", None)
    if events is None:
        raise TypeError(f"{where}: expected an ag2.eval.Trace, got {type(trace).__name__}.")
    events = tuple(events)
    if not events:
        raise ConversationError(f"{where}: the trace has no events; there is nothing to "
                                "attribute.")
    turns, indices, unknown, call_names = [], [], {}, {}
    for i, event in enumerate(events):
        label = f"{where}: event {i} ({type(event).__name__})"
        with reading(label):
            _remember_calls(event, call_names)
            try:
                turn = _event_turn(event, agent_name, subagents, tool_calls, call_names)
            except ConversationError as exc:  # a field check, or Turn's own
                raise ConversationError(f"{label}: {exc}") from None
        if turn is NotImplemented:
            if on_unknown == "error":
                raise ConversationError(
                    f"{where}: event {i} has type {type(event).__name__}, which "
                    "conversation_from_trace does not know how to read; pass "
                    "on_unknown='skip' to skip such events (with a warning)."
                )
            unknown.setdefault(type(event).__name__, []).append(i)
            continue
        if turn is not None:
            turns.append(turn)
            indices.append(i)
    if unknown:
        listed = "; ".join(f"{name} at {ix}" for name, ix in unknown.items())
        warnings.warn(f"{where}: skipped events of unknown types: {listed}.", UserWarning,
                      stacklevel=2)
    if not turns:
        seen = sorted({type(e).__name__ for e in events})
        raise ConversationError(
            f"{where}: none of its {len(events)} events is a turn (seen: {', '.join(seen)}); "
            "a run needs model responses, tool calls or results, or sub-task results to "
            "be attributed."
        )
    step = None
    if mistake_event is not None:
        try:
            step = indices.index(int(mistake_event))
        except ValueError:
            raise ConversationError(
                f"{where}: mistake_event={mistake_event} is not an event that became a turn "
                f"(turn events: {indices})."
            ) from None
    metadata = {"source": "ag2.eval.Trace", "agent_name": agent_name}
    if getattr(trace, "exception", None) is not None:
        exc = trace.exception
        metadata["trace_exception"] = f"{type(exc).__name__}: {exc}"
    conv = Conversation(
        turns,
        task="" if question is None else question,
        expected_answer="" if ground_truth is None else ground_truth,
        task_id=task_id,
        mistake_step=step,
        mistake_agent=mistake_agent,
        record_id=record_id,
        metadata=metadata,
    )
    return TraceConversation(conv, tuple(indices))


def subagent_names(agent) -> dict:
    """Map each delegation tool of an ``ag2`` agent to the name of its sub-agent.

    Delegation tools are those made by ``Agent.as_tool`` or ``subagent_tool``
    (under any name), also inside a ``Toolkit``. Left out, because their result
    need not be the sub-agent's answer: tools with their own middleware (an
    approval step can answer in the sub-agent's place) and background sub-agent
    tools (they return a task id). Tools passed to ``ask`` rather than held in
    ``agent.tools`` are not seen.

    Parameters
    ----------
    agent : ag2.Agent

    Returns
    -------
    names : dict of str to str
        ``{tool name: sub-agent name}``; pass it as ``subagents=``.
    """
    from ag2.tools.final import Toolkit
    from ag2.tools.subagents.subagent_tool import SubagentTool

    tools = getattr(agent, "tools", None)
    if tools is None:
        raise TypeError(f"subagent_names expects an ag2 Agent, got {type(agent).__name__}.")
    found = {}
    stack = list(tools)
    while stack:
        tool = stack.pop(0)
        if isinstance(tool, Toolkit):
            stack[:0] = list(tool.tools)
        elif isinstance(tool, SubagentTool) and not tuple(tool.middleware):
            found[tool.name] = tool.agent.name
    return found


# --------------------------------------------------------------------------- scorer
def _field(values, field, default_key):
    """One field of ``inputs`` / ``reference_outputs`` as text (see the scorer's docs)."""
    if not values:
        return ""
    if field is not None:
        value = values.get(field)
        return "" if value is None else as_text(value)
    if default_key is not None and default_key in values:
        return as_text(values[default_key])
    if len(values) == 1:
        return as_text(next(iter(values.values())))
    return json.dumps(values, ensure_ascii=False, default=str)


def _reasoning(attribution, indices):
    best = attribution.top_k[0] if attribution.top_k else None
    head = (f"skafa probe at site {attribution.site!r} blames turn {attribution.step} "
            f"(trace event {indices[attribution.step]}, {attribution.agent})")
    if best is not None:
        head += f" with score {best.score:+.3f} (p={best.probability:.3f})"
    others = [f"turn {r.step} (event {indices[r.step]}, {r.agent}) {r.score:+.3f} "
              f"(p={r.probability:.3f})" for r in attribution.top_k[1:]]
    if others:
        head += "; runner-ups: " + ", ".join(others)
    return head + f". {attribution.n_turns} turns scored."


class _BlameScorer:
    """The callable behind :func:`failure_attribution_scorer` (one per scorer)."""

    def __init__(self, attributor, key, agent_name, subagents, ground_truth_field,
                 question_field, tool_calls, top_k):
        self.attributor = attributor
        self.key = key
        self.agent_name = agent_name
        self.subagents = _check_subagents(subagents)
        self.ground_truth_field = ground_truth_field
        self.question_field = question_field
        self.tool_calls = tool_calls
        self.top_k = top_k
        # One forward pass at a time: evaluate_traces grades several traces at once,
        # and the model and the activation cache are shared.
        self._lock = threading.Lock()

    def _attribute(self, conversation):
        with self._lock:
            return self.attributor.attribute(conversation, top_k=self.top_k)

    async def __call__(self, inputs, reference_outputs, trace):
        converted = conversation_from_trace(
            trace,
            question=_field(inputs, self.question_field, "input"),
            ground_truth=_field(reference_outputs, self.ground_truth_field, None),
            agent_name=self.agent_name,
            subagents=self.subagents,
            tool_calls=self.tool_calls,
        )
        conv, indices = converted
        attribution = await asyncio.to_thread(self._attribute, conv)
        scores = np.asarray(attribution.turn_scores, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            return _eval.Feedback(
                key=self.key,
                score=None,
                comment=(f"skafa probe gave non-finite scores to turns {bad.tolist()} of "
                         f"{scores.size}; no blame recorded."),
            )
        detail = _Ag2Attribution(
            failed=True,
            error_mode="other",
            decisive_step=int(indices[attribution.step]),
            responsible_agent=attribution.agent,
            reasoning=_reasoning(attribution, indices),
        )
        return _eval.Feedback(key=self.key, value=attribution.agent, comment=detail.reasoning,
                              detail=detail.model_dump())


def failure_attribution_scorer(
    attributor,
    *,
    key="skafa_blame",
    agent_name="assistant",
    subagents=None,
    ground_truth_field=None,
    question_field=None,
    tool_calls="tool",
    top_k=3,
):
    """An ``ag2.eval`` scorer that blames one turn of every trace with a fitted probe.

    The white-box counterpart of ``ag2.eval.scorers.failure_attribution``. Each
    trace is converted with :func:`conversation_from_trace`, the attributor
    scores every turn (in a worker thread, one trace at a time, so the event
    loop stays responsive), and the scorer emits one :class:`ag2.eval.Feedback`:

    - ``value``: the responsible agent (speaker of the blamed turn), so
      ``RunResult.value_counts(key)`` is the blame distribution;
    - ``comment``: the reasoning (below);
    - ``detail``: an ``ag2.eval.scorers.Attribution`` dump with ``failed=True``,
      ``error_mode="other"`` (a probe localizes a failure, it does not classify
      it), ``decisive_step`` the index into ``trace.events`` of the blamed
      turn's event, ``responsible_agent`` and a ``reasoning`` naming the top
      turns with their scores and probabilities.

    A trace that cannot be converted (no events, no turns, an unknown event
    type, a malformed event) makes the scorer raise, which ``ag2.eval`` records
    as a ``Feedback`` with ``score=None`` and the message as comment; the
    message names the event's index in ``trace.events``, its type and the
    field (the trace itself is the feedback's own). Non-finite turn scores give
    a ``Feedback`` with ``score=None``, ``value=None`` and a comment saying so —
    never a blame.

    The probe always names a turn: it assumes the run failed. Score failed runs
    only, or read the blame next to a correctness scorer.

    Parameters
    ----------
    attributor : FailureAttributor
        A fitted (or loaded) attributor; anything with ``attribute(conversation,
        top_k=...)`` returning an :class:`~skafa.Attribution` works.
    key : str, default="skafa_blame"
        Feedback key (``RunResult.value_counts(key)``).
    agent_name, subagents, tool_calls
        Who speaks which event; see :func:`conversation_from_trace`.
    ground_truth_field : str, default=None
        Field of the task's ``reference_outputs`` holding the expected answer.
        ``None``: the only field of a one-field ``reference_outputs``, else all
        of it as JSON (empty when there is none).
    question_field : str, default=None
        Field of the task's ``inputs`` holding the question. ``None``:
        ``inputs["input"]`` (what ``run_agent`` asks), else the only field, else
        all of ``inputs`` as JSON.
    top_k : int, default=3
        Turns named in the reasoning.

    Returns
    -------
    scorer : ag2.eval.Scorer

    Examples
    --------
    >>> import asyncio
    >>> from ag2.eval import evaluate_traces
    >>> scorer = failure_attribution_scorer(fitted_attributor)          # doctest: +SKIP
    >>> run = asyncio.run(evaluate_traces(source, scorers=[scorer],
    ...                                   store_dir="runs"))            # doctest: +SKIP
    >>> run.value_counts("skafa_blame")                                 # doctest: +SKIP
    {'assistant': 7, 'tool:search': 2, 'researcher': 3}
    """
    if not callable(getattr(attributor, "attribute", None)):
        raise TypeError("failure_attribution_scorer needs a fitted skafa FailureAttributor "
                        f"(with an attribute method), got {type(attributor).__name__}.")
    from sklearn.base import BaseEstimator
    from sklearn.utils.validation import check_is_fitted

    if isinstance(attributor, BaseEstimator):
        check_is_fitted(attributor)
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}.")
    if not isinstance(agent_name, str) or not agent_name.strip():
        raise ValueError(f"agent_name must be a non-empty string, got {agent_name!r}.")
    if tool_calls not in _TOOL_CALLS:
        raise ValueError(f"tool_calls must be one of {_TOOL_CALLS}, got {tool_calls!r}.")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}.")
    fn = _BlameScorer(attributor, key, agent_name, subagents, ground_truth_field,
                      question_field, tool_calls, int(top_k))
    return _eval.Scorer(fn, key=key)


# --------------------------------------------------------------------------- mi4afa
def to_mi4afa(conversation):
    """Convert a skafa conversation to an ``ag2.extensions.mi4afa.Conversation``.

    ``task`` -> ``question``, ``expected_answer`` -> ``ground_truth``, each
    turn's ``speaker`` -> ``name``; ``mistake_step`` and ``mistake_agent`` are
    kept. mi4afa has no place for turn roles, ``task_id``, ``record_id`` or
    ``metadata``: they are dropped.

    Parameters
    ----------
    conversation : Conversation

    Returns
    -------
    ag2.extensions.mi4afa.Conversation
    """
    from ag2.extensions.mi4afa import Conversation as MConversation
    from ag2.extensions.mi4afa import Turn as MTurn

    if not isinstance(conversation, Conversation):
        raise TypeError(f"to_mi4afa takes a skafa Conversation, got "
                        f"{type(conversation).__name__}.")
    return MConversation(
        question=conversation.task,
        ground_truth=conversation.expected_answer,
        history=tuple(MTurn(name=t.speaker, content=t.content) for t in conversation.turns),
        mistake_step=conversation.mistake_step,
        mistake_agent=conversation.mistake_agent,
    )


def from_mi4afa(conversation, *, task_id=None, record_id=None):
    """Convert an ``ag2.extensions.mi4afa.Conversation`` to a skafa conversation.

    ``question`` -> ``task``, ``ground_truth`` -> ``expected_answer``, each
    turn's ``name`` -> ``speaker`` (roles are ``None``); labels are kept.

    mi4afa's Who&When loader reads the speaker from ``name`` only, so every
    turn of a Hand-Crafted record (whose speaker is in ``role``) arrives as
    ``"Unknown Agent"``. Such turns are converted as they are, with a
    ``UserWarning``: reload those records with :func:`skafa.load_who_and_when`
    to get their speakers back.

    Parameters
    ----------
    conversation : ag2.extensions.mi4afa.Conversation
    task_id, record_id : str, default=None
        mi4afa keeps neither; set them here (``task_id`` groups runs of one
        task in grouped cross-validation).

    Returns
    -------
    Conversation

    Raises
    ------
    skafa.ConversationError
        Naming the turn, for an empty speaker name (skafa needs one).
    """
    history = getattr(conversation, "history", None)
    if history is None or not hasattr(conversation, "question"):
        raise TypeError("from_mi4afa takes an ag2.extensions.mi4afa.Conversation, got "
                        f"{type(conversation).__name__}.")
    where = "mi4afa conversation" + ("" if record_id is None else f" {record_id!r}")
    turns = []
    unknown = 0
    for i, turn in enumerate(history):
        name = getattr(turn, "name", None)
        if not isinstance(name, str) or not name.strip():
            raise ConversationError(f"{where}: turn {i} has no speaker name ({name!r}).")
        unknown += name == "Unknown Agent"
        turns.append(Turn(name, as_text(getattr(turn, "content", ""))))
    if unknown:
        warnings.warn(
            f"{where}: {unknown} of {len(turns)} turns are named 'Unknown Agent' (mi4afa's "
            "Who&When loader names every Hand-Crafted speaker so); load the records with "
            "skafa.load_who_and_when to keep their speakers.", UserWarning, stacklevel=2)
    return Conversation(
        turns,
        task=as_text(conversation.question),
        expected_answer=as_text(conversation.ground_truth),
        task_id=task_id,
        mistake_step=conversation.mistake_step,
        mistake_agent=conversation.mistake_agent,
        record_id=record_id,
    )
