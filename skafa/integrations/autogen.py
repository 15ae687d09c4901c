"""AutoGen AgentChat message logs to a :class:`~skafa.Conversation`.

An AgentChat team run (``RoundRobinGroupChat``, ``SelectorGroupChat``,
``Swarm``, ``MagenticOneGroupChat``) returns a ``TaskResult`` whose
``messages`` list every message and event, each with a ``source`` (the agent
that produced it) and a ``type``. :func:`conversation_from_autogen` reads that
list, as message objects or as their ``model_dump()`` dicts (what
``TaskResult.model_dump_json()`` or a saved team state holds). AutoGen is not
needed. (The older ``autogen`` 0.2 / ``ag2`` group-chat ``messages``, dicts
with ``name`` / ``role`` / ``content``, are what
:meth:`skafa.Conversation.from_messages` reads; Who&When was recorded that way.)

Which message is whose turn
---------------------------
=====================================  ==========================  ==========================
``type``                               speaker                     content
=====================================  ==========================  ==========================
``TextMessage``, ``StopMessage``,      ``source``                  the text (multimodal:
``HandoffMessage``,                                                text items, ``[image]``
``ToolCallSummaryMessage``,                                        for others; structured:
``MultiModalMessage``,                                             JSON)
``StructuredMessage``,
``ThoughtEvent``,
``CodeGenerationEvent``,
``CodeExecutionEvent``
``ToolCallRequestEvent``               ``source`` (the agent that  ``call <name>(<arguments>)``,
                                       asked), one turn per call   one turn per call
``ToolCallExecutionEvent``             ``tool:<name>``, one turn   the result, or
                                       per result                  ``error in <name>: ...``
                                                                   when ``is_error``
``ModelClientStreamingChunkEvent``,    (no turn: superseded,
``MemoryQueryEvent``,                  bookkeeping, or a request
``UserInputRequestedEvent``,           for input that follows as
``SelectSpeakerEvent``,                its own message)
``SelectorEvent``
=====================================  ==========================  ==========================

Any other type is refused (``on_unknown="error"``) or skipped with a warning
(``on_unknown="skip"``).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

from ..conversation import Turn
from ..exceptions import ConversationError
from ._common import (
    as_text,
    check_message_list,
    finish_conversation,
    get_field,
    reading,
    tool_call_list,
    tool_call_name,
)

__all__ = ["conversation_from_autogen"]

_TEXT = {"TextMessage", "StopMessage", "HandoffMessage", "ToolCallSummaryMessage",
         "MultiModalMessage", "StructuredMessage", "ThoughtEvent", "CodeGenerationEvent",
         "CodeExecutionEvent"}
_SKIP = {"ModelClientStreamingChunkEvent", "MemoryQueryEvent", "UserInputRequestedEvent",
         "SelectSpeakerEvent", "SelectorEvent"}


def _type_of(msg):
    kind = get_field(msg, "type")
    if isinstance(kind, str) and kind:
        return kind
    return type(msg).__name__


def _content_text(content):
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # MultiModalMessage: str and Image items
        return "\n".join(item if isinstance(item, str) else "[image]" for item in content)
    if hasattr(content, "model_dump"):  # StructuredMessage content: a pydantic model
        return as_text(content.model_dump())
    return as_text(content)


def conversation_from_autogen(
    messages,
    *,
    task=None,
    expected_answer=None,
    on_unknown="error",
    task_id=None,
    mistake_step=None,
    mistake_agent=None,
    record_id=None,
):
    """Turn an AutoGen AgentChat ``TaskResult.messages`` list into a conversation.

    Read more in the module docstring (:mod:`skafa.integrations.autogen`),
    which lists which message becomes whose turn.

    Parameters
    ----------
    messages : sequence of message objects or dicts
        ``TaskResult.messages``, or ``[m.model_dump() for m in ...]``.
    task : str, default=None
        The task. ``None`` takes the text of the first message whose source is
        ``"user"`` (it stays a turn too), else ``""``.
    expected_answer : str, default=None
        The expected answer, when known.
    on_unknown : {"error", "skip"}, default="error"
        A message of an unlisted ``type`` raises, or is skipped with a warning.
    task_id, mistake_step, mistake_agent, record_id
        As in :class:`~skafa.Conversation`; ``mistake_step`` is a turn index of
        the result.

    Returns
    -------
    result : TraceConversation
        The conversation and, per turn, the index of its message.

    Raises
    ------
    skafa.ConversationError
        Naming the message, for a message without ``source``, an unknown
        type (``on_unknown="error"``), or when no message gives a turn.
    """
    where = "AutoGen log" + ("" if record_id is None else f" {record_id!r}")
    check_message_list(messages, where, on_unknown)
    turns, indices, unknown = [], [], {}
    first_user = None
    for i, msg in enumerate(messages):
        with reading(f"{where}: message {i}"):
            first_user = _read_message(i, msg, where, turns, indices, unknown, first_user,
                                       on_unknown)
    return finish_conversation(
        turns, indices, unknown=unknown, n_messages=len(messages), where=where,
        task=first_user or "" if task is None else task, expected_answer=expected_answer,
        source="autogen-agentchat", task_id=task_id, mistake_step=mistake_step,
        mistake_agent=mistake_agent, record_id=record_id)


def _read_message(i, msg, where, turns, indices, unknown, first_user, on_unknown):
    """Append the turns of message ``i``; return the first user text seen so far."""
    kind = _type_of(msg)
    if kind in _SKIP:
        return first_user
    if kind not in _TEXT and kind not in ("ToolCallRequestEvent", "ToolCallExecutionEvent"):
        if on_unknown == "error":
            raise ConversationError(
                f"{where}: message {i} has type {kind!r}, which conversation_from_autogen "
                "does not know; pass on_unknown='skip' to skip such messages.")
        unknown.setdefault(kind, []).append(i)
        return first_user
    source = get_field(msg, "source")
    if not isinstance(source, str) or not source.strip():
        raise ConversationError(f"{where}: message {i} ({kind}) has no 'source'.")
    content = get_field(msg, "content")
    if kind == "ToolCallRequestEvent":
        # a string, a dict or a number where the call list belongs, or a call
        # without a name, is refused: never a turn "call None({})"
        for j, call in enumerate(tool_call_list(content, f"{where}: message {i}")):
            name = tool_call_name(get_field(call, "name"), f"{where}: message {i}", j)
            turns.append(Turn(source, f"call {name}"
                                      f"({as_text(get_field(call, 'arguments', '{}'))})",
                              "tool_call"))
            indices.append(i)
    elif kind == "ToolCallExecutionEvent":
        for result in tool_call_list(content, f"{where}: message {i}"):
            name = get_field(result, "name") or "tool"
            text = as_text(get_field(result, "content", ""))
            if get_field(result, "is_error", False):
                turns.append(Turn(f"tool:{name}", f"error in {name}: {text}",
                                  "tool_error"))
            else:
                turns.append(Turn(f"tool:{name}", text, "tool"))
            indices.append(i)
    else:
        text = _content_text(content)
        if kind == "HandoffMessage" and get_field(msg, "target"):
            text = f"{text}\n[hands off to {get_field(msg, 'target')}]"
        role = "thought" if kind == "ThoughtEvent" else (
            "user" if source == "user" else "assistant")
        turns.append(Turn(source, text, role))
        indices.append(i)
        if first_user is None and source == "user":
            first_user = text
    return first_user
