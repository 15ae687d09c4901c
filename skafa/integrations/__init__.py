"""Adapters from the places failed runs live to skafa :class:`~skafa.Conversation` objects.

One module per source shape; none is imported by ``import skafa``, and each
imports its framework (if any) only when used:

- :mod:`skafa.integrations.ag2` — ``ag2.eval`` traces and scorer, and
  ``ag2.extensions.mi4afa`` conversations (needs the ``ag2`` extra:
  ``pip install "skafa[ag2]"``).
- :mod:`skafa.integrations.otel` — OpenTelemetry GenAI spans (OTLP JSON
  exports, ``ag2`` trace files, or plain span dicts); keeps each span's agent
  name. No dependency.
- :mod:`skafa.integrations.autogen` — AutoGen AgentChat message logs
  (``TaskResult.messages`` / their ``model_dump()`` dicts). No dependency.
- :mod:`skafa.integrations.langgraph` — LangGraph / LangChain message lists
  (message objects, ``messages_to_dict`` output or ``{"role", ...}`` dicts).
  No dependency.

Every adapter returns a :class:`TraceConversation`: the conversation and, for
every turn, the index of the source item (event, span or message) behind it.
"""

from ._common import TraceConversation

__all__ = ["TraceConversation"]
