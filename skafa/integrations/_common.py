"""What every trace adapter shares: its result type and small text helpers."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import json
from typing import Any, NamedTuple

from ..conversation import Conversation

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
