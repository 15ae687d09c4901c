"""LangGraph / LangChain message lists to a :class:`~skafa.Conversation`.

A LangGraph agent or multi-agent graph (supervisor, swarm, a hand-built
``StateGraph`` over ``MessagesState``) keeps its run in ``state["messages"]``:
LangChain ``HumanMessage`` / ``AIMessage`` / ``ToolMessage`` / ``SystemMessage``
objects, where multi-agent graphs set ``AIMessage.name`` to the agent that
spoke. :func:`conversation_from_langgraph` reads that list as message objects,
as ``langchain_core.messages.messages_to_dict`` output
(``{"type": "ai", "data": {...}}``) or as plain dicts with a ``type`` or an
OpenAI-style ``role``. LangChain is not needed.

Which message is whose turn
---------------------------
===========================  ============================  ================================
message                      speaker                       content
===========================  ============================  ================================
human / user                 its ``name``, else ``human``  the text
ai / assistant               its ``name``, else            the text (if any), then one
                             ``agent_name``                ``call <name>(<args>)`` turn per
                                                           entry of ``tool_calls``
tool / function              ``tool:<name>``               the result, or ``error in
                                                           <name>: ...`` when ``status`` is
                                                           ``"error"``
chat (``ChatMessage``)       its ``name``, else its        the text
                             ``role``
system                       (no turn unless               the text
                             ``include_system=True``;
                             speaker ``system``)
===========================  ============================  ================================

Text comes from a string ``content`` or the text blocks of a block list
(other blocks show as ``[<type>]``). ``*MessageChunk`` types read like their
message. Any other type is refused (``on_unknown="error"``) or skipped with a
warning (``on_unknown="skip"``). An AI message with neither text nor tool
calls gives no turn.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

from collections.abc import Mapping

from ..conversation import Turn
from ..exceptions import ConversationError
from ._common import (
    as_text,
    blocks_text,
    check_message_list,
    finish_conversation,
    get_field,
    reading,
    tool_call_list,
    tool_call_name,
)

__all__ = ["conversation_from_langgraph"]

_ROLES = {"user": "human", "assistant": "ai", "developer": "system"}


def _fields(msg):
    """(type, data mapping-or-object) of one message in any accepted form."""
    if isinstance(msg, Mapping):
        if "data" in msg and isinstance(msg.get("data"), Mapping) and "type" in msg:
            return msg["type"], msg["data"]  # messages_to_dict
        kind = msg.get("type") or _ROLES.get(msg.get("role"), msg.get("role"))
        return kind, msg
    return getattr(msg, "type", type(msg).__name__), msg


def _tool_calls(data, where):
    """``(name, arguments text)`` of every tool call of an AI message.

    ``tool_calls`` that is not a list, or a call without a name, is refused
    (a ConversationError naming the message), never turned into ``call None({})``.
    """
    calls = tool_call_list(get_field(data, "tool_calls"), where)
    out = []
    for j, call in enumerate(calls):
        fn = get_field(call, "function")
        if fn is not None:  # OpenAI shape: {"function": {"name", "arguments"}}
            out.append((tool_call_name(get_field(fn, "name"), where, j),
                        as_text(get_field(fn, "arguments", "{}"))))
        else:  # LangChain shape: {"name", "args", "id"}
            out.append((tool_call_name(get_field(call, "name"), where, j),
                        as_text(get_field(call, "args", {}))))
    return out


def conversation_from_langgraph(
    messages,
    *,
    task=None,
    expected_answer=None,
    agent_name="assistant",
    include_system=False,
    on_unknown="error",
    task_id=None,
    mistake_step=None,
    mistake_agent=None,
    record_id=None,
):
    """Turn a LangGraph ``state["messages"]`` list into a conversation.

    Read more in the module docstring (:mod:`skafa.integrations.langgraph`),
    which lists which message becomes whose turn.

    Parameters
    ----------
    messages : sequence of LangChain messages or dicts
    task : str, default=None
        The task. ``None`` takes the text of the first human message (it
        stays a turn too), else ``""``.
    expected_answer : str, default=None
        The expected answer, when known.
    agent_name : str, default="assistant"
        Speaker of AI messages without a ``name``.
    include_system : bool, default=False
        Keep system messages as turns by ``system``.
    on_unknown : {"error", "skip"}, default="error"
        A message of an unlisted type raises, or is skipped with a warning.
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
        Naming the message, for an unknown type (``on_unknown="error"``), or
        when no message gives a turn.

    Examples
    --------
    >>> msgs = [{"type": "human", "content": "2 + 2?"},
    ...         {"type": "ai", "name": "math_agent", "content": "",
    ...          "tool_calls": [{"name": "add", "args": {"a": 2, "b": 2}, "id": "1"}]},
    ...         {"type": "tool", "name": "add", "content": "5", "tool_call_id": "1"}]
    >>> conv, idx = conversation_from_langgraph(msgs)
    >>> conv.speakers, idx, conv.task
    (('human', 'math_agent', 'tool:add'), (0, 1, 2), '2 + 2?')
    """
    where = "LangGraph messages" + ("" if record_id is None else f" {record_id!r}")
    check_message_list(messages, where, on_unknown)
    turns, indices, unknown = [], [], {}
    first_human = None
    for i, msg in enumerate(messages):
        with reading(f"{where}: message {i}"):
            first_human = _read_message(i, msg, where, turns, indices, unknown, first_human,
                                        agent_name, include_system, on_unknown)
    return finish_conversation(
        turns, indices, unknown=unknown, n_messages=len(messages), where=where,
        task=first_human or "" if task is None else task, expected_answer=expected_answer,
        source="langgraph", task_id=task_id, mistake_step=mistake_step,
        mistake_agent=mistake_agent, record_id=record_id)


def _read_message(i, msg, where, turns, indices, unknown, first_human, agent_name,
                  include_system, on_unknown):
    """Append the turns of message ``i``; return the first human text seen so far."""
    kind, data = _fields(msg)
    kind = str(kind).lower().removesuffix("messagechunk").removesuffix("message")
    if kind.endswith("chunk"):
        kind = kind[: -len("chunk")]
    name = get_field(data, "name")
    name = name if isinstance(name, str) and name.strip() else None
    text = blocks_text(get_field(data, "content"))
    if kind == "human":
        turns.append(Turn(name or "human", text, "user"))
        indices.append(i)
        first_human = text if first_human is None else first_human
    elif kind == "ai":
        speaker = name or agent_name
        if text.strip():
            turns.append(Turn(speaker, text, "assistant"))
            indices.append(i)
        for tool, args in _tool_calls(data, f"{where}: message {i}"):
            turns.append(Turn(speaker, f"call {tool}({args})", "tool_call"))
            indices.append(i)
    elif kind in ("tool", "function"):
        tool = name or "tool"
        if get_field(data, "status") == "error":
            turns.append(Turn(f"tool:{tool}", f"error in {tool}: {text}", "tool_error"))
        else:
            turns.append(Turn(f"tool:{tool}", text, "tool"))
        indices.append(i)
    elif kind == "chat":
        role = get_field(data, "role")
        speaker = name or (role if isinstance(role, str) and role.strip() else "chat")
        turns.append(Turn(speaker, text, role if isinstance(role, str) else None))
        indices.append(i)
    elif kind == "system":
        if include_system:
            turns.append(Turn("system", text, "system"))
            indices.append(i)
    elif on_unknown == "error":
        raise ConversationError(
            f"{where}: message {i} has type {kind!r}, which conversation_from_langgraph "
            "does not know; pass on_unknown='skip' to skip such messages.")
    else:
        unknown.setdefault(kind, []).append(i)
    return first_human
