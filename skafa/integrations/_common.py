"""What every trace adapter shares: its result type and small text helpers."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from ..conversation import Conversation
from ..exceptions import ConversationError

__all__ = ["TraceConversation"]


class TraceConversation(NamedTuple):
    """A conversation built from a trace or message log, and where each turn came from.

    Unpacks as a pair: ``conversation, event_indices = conversation_from_...(...)``.

    Attributes
    ----------
    conversation : Conversation
        The converted run.
    event_indices : tuple of int
        For every turn ``t``, the index in the source sequence (``trace.events``,
        the span list in start order, or the message list) of the item that
        became turn ``t``. Non-decreasing: one source item can give several
        turns (an OpenTelemetry tool span gives its call and its result).
    """

    conversation: Conversation
    event_indices: tuple

    def source_index(self, turn: int) -> int:
        """Index in the source sequence of ``turn`` (a turn index of the conversation)."""
        return int(self.event_indices[int(turn)])


def as_text(value: Any) -> str:
    """Render a message payload as text: strings as they are, other values as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def blocks_text(content: Any) -> str:
    """Text of a message ``content`` that may be a string or a list of content blocks.

    Blocks are dicts such as ``{"type": "text", "text": ...}`` (OpenAI,
    Anthropic, LangChain) or ``{"type": "text", "content": ...}`` (OpenTelemetry
    GenAI ``parts``); text blocks are joined with newlines, any other block is
    written as ``[<type>]`` so that no block disappears without a trace.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for block in content:
            if isinstance(block, str):
                out.append(block)
            elif isinstance(block, dict):
                text = block.get("text", block.get("content"))
                if block.get("type", "text") == "text" and isinstance(text, str):
                    out.append(text)
                else:
                    out.append(f"[{block.get('type', 'block')}]")
            else:
                out.append(as_text(block))
        return "\n".join(out)
    return as_text(content)


def get_field(obj: Any, key: str, default: Any = None) -> Any:
    """``obj[key]`` for a mapping, ``obj.key`` for an object (a message in either form)."""
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


@contextmanager
def reading(where: str):
    """Turn any error raised while reading one item into a ConversationError naming it.

    Every adapter reads each event, span or message inside ``with reading(...)``,
    so malformed input never escapes as a bare ``KeyError``, ``TypeError``,
    ``AttributeError`` or ``RecursionError`` from deep inside (which callers and
    ``strict=False`` loops cannot tell from a bug); ``where`` names the trace and
    the item.
    """
    try:
        yield
    except ConversationError:
        raise
    except RecursionError:
        raise ConversationError(f"{where}: nested too deeply to be read.") from None
    except ValueError as exc:  # a reader's own check, or int("x")
        raise ConversationError(f"{where}: {str(exc)[:300]}.") from None
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as exc:
        raise ConversationError(
            f"{where}: malformed ({type(exc).__name__}: {str(exc)[:200]}).") from None


def tool_call_list(calls: Any, where: str) -> Sequence:
    """The tool calls of one message, refused when they are not a list of calls."""
    if calls is None:
        return ()
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise ConversationError(f"{where}: the tool calls must be a list of calls, got "
                                f"{type(calls).__name__} {str(calls)[:60]!r}.")
    return calls


def tool_call_name(name: Any, where: str, j: int) -> str:
    """The name of tool call ``j``; a call without a text name is refused."""
    if not isinstance(name, str) or not name.strip():
        raise ConversationError(f"{where}: tool call {j} has no name (got {str(name)[:60]!r}); "
                                "a call without a name cannot be a turn.")
    return name


def check_message_list(messages: Any, where: str, on_unknown: str) -> None:
    """The argument checks every message-list adapter makes, with one wording."""
    if on_unknown not in ("error", "skip"):
        raise ValueError(f"on_unknown must be 'error' or 'skip', got {on_unknown!r}.")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: messages must be a list, got {type(messages).__name__}.")


def finish_conversation(turns, indices, *, unknown, n_messages, where, task, expected_answer,
                        source, **labels) -> TraceConversation:
    """Warn about skipped message types, refuse an empty result, build the conversation.

    ``unknown`` maps each skipped type to its message indices; ``labels`` are the
    :class:`~skafa.Conversation` keywords ``task_id``, ``mistake_step``,
    ``mistake_agent`` and ``record_id``; ``source`` goes to its metadata.
    """
    if unknown:
        listed = "; ".join(f"{k} at {v}" for k, v in unknown.items())
        warnings.warn(f"{where}: skipped messages of unknown types: {listed}.", UserWarning,
                      stacklevel=3)
    if not turns:
        raise ConversationError(f"{where}: none of its {n_messages} messages is a turn.")
    conv = Conversation(turns, task=task,
                        expected_answer="" if expected_answer is None else expected_answer,
                        metadata={"source": source}, **labels)
    return TraceConversation(conv, tuple(indices))
