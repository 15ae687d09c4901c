"""Runs from files in any format the adapters read: what the ``skafa`` command loads.

:func:`read_runs` takes a Who&When folder or file, or a JSON file or a folder of JSON
files with one run each in another framework's shape — OpenTelemetry GenAI spans
(OTLP/JSON exports, ag2 trace files, span lists), LangGraph / LangChain messages,
AutoGen AgentChat messages — detected from the content or named with ``format=``.
Trace formats carry no labels: pass a labels side file (``skafa label`` writes one;
:mod:`skafa.labelling`), keyed by the record id, which is the file's path relative to
the folder without ``.json``.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

from pathlib import Path

from ..exceptions import ConversationError
from ..utils.fileio import read_json_file

__all__ = ["FORMATS", "MAX_TRACE_BYTES", "detect_format", "read_runs"]

#: Formats :func:`read_runs` knows (``"auto"`` detects one of them per file).
FORMATS = ("who-and-when", "otel", "langgraph", "autogen")

#: A trace file larger than this is refused before it is read.
MAX_TRACE_BYTES = 256 * 1024 * 1024

_LANGCHAIN_TYPES = {"human", "ai", "tool", "system", "function", "chat",
                    "HumanMessage", "AIMessage", "ToolMessage", "SystemMessage"}


def _load_json(file, where):
    try:
        return read_json_file(file, max_bytes=MAX_TRACE_BYTES, where=where)
    except ValueError as exc:
        raise ConversationError(str(exc)) from None


def _messages(doc):
    if isinstance(doc, dict) and isinstance(doc.get("messages"), list):
        return doc["messages"]
    return doc if isinstance(doc, list) else None


def detect_format(doc):
    """Which format a parsed JSON document is in, or None.

    Parameters
    ----------
    doc : object
        ``json.loads`` of one file.

    Returns
    -------
    format : str or None
        One of :data:`FORMATS`.

    Examples
    --------
    >>> detect_format({"history": [], "question": "q"})
    'who-and-when'
    >>> detect_format([{"type": "human", "content": "hi"}])
    'langgraph'
    >>> detect_format([{"source": "user", "type": "TextMessage", "content": "hi"}])
    'autogen'
    >>> detect_format({"resourceSpans": []})
    'otel'
    """
    if isinstance(doc, dict) and "history" in doc:
        return "who-and-when"
    if isinstance(doc, list) and doc and all(isinstance(r, dict) and "history" in r
                                             for r in doc):
        return "who-and-when"
    if isinstance(doc, dict) and ("resourceSpans" in doc or "spans" in doc):
        return "otel"
    msgs = _messages(doc)
    if not msgs or not all(isinstance(m, dict) for m in msgs):
        return None
    first = msgs[0]
    if "span_id" in first or "spanId" in first or "trace_id" in first:
        return "otel"
    if "source" in first and "type" in first:
        return "autogen"
    if first.get("type") in _LANGCHAIN_TYPES or "role" in first or (
            first.get("type") == "constructor"):
        return "langgraph"
    return None


def _one_run(doc, fmt, record_id, where):
    from . import autogen, langgraph, otel

    if fmt == "otel":
        meta = doc if isinstance(doc, dict) else {}
        result = otel.conversation_from_otel_spans(
            doc, question=str(meta.get("question", "")), record_id=record_id,
            task_id=meta.get("task_id"))
    elif fmt == "langgraph":
        result = langgraph.conversation_from_langgraph(_messages(doc), record_id=record_id)
    elif fmt == "autogen":
        result = autogen.conversation_from_autogen(_messages(doc), record_id=record_id)
    else:  # pragma: no cover - guarded by the caller
        raise ValueError(fmt)
    conv = result.conversation
    if conv.task_id is None:  # each run its own task, so grouped CV can split them
        import dataclasses

        conv = dataclasses.replace(conv, task_id=record_id)
    return conv


def read_runs(path, *, format="auto", subset=None):
    """Read every run under ``path``, in the format given or detected.

    Parameters
    ----------
    path : str or path-like
        A Who&When folder, subset folder or JSON file; or a JSON file or a folder
        of ``*.json`` files (searched recursively, sorted) with one run each.
    format : {"auto", "who-and-when", "otel", "langgraph", "autogen"}, default="auto"
        ``"auto"``: a folder with Who&When subsets, or files whose content looks
        like Who&When records, are read as Who&When; any other file is detected
        on its own (:func:`detect_format`).
    subset : str, optional
        Who&When only: the subset to read.

    Returns
    -------
    conversations : list of Conversation
        Unlabelled unless the records carry labels (Who&When); trace runs get
        ``record_id`` = the file's relative path without ``.json`` and, when the
        trace names none, ``task_id`` = the record id.

    Raises
    ------
    skafa.ConversationError
        Naming the file (and, from the adapters, the span, message or event).
    FileNotFoundError
        When ``path`` does not exist or holds no JSON file.
    """
    from ..datasets import load_who_and_when

    if format not in ("auto", *FORMATS):
        raise ValueError(f"format={format!r}; expected 'auto' or one of {FORMATS}.")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found (no such file or folder).")
    if format == "who-and-when" or (format == "auto" and _looks_who_and_when(path)):
        return list(load_who_and_when(path, subset=subset, labelled="auto").conversations)
    if subset is not None:
        raise ValueError(f"--subset {subset!r} applies to Who&When data; {path} holds "
                         "traces.")
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*.json") if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"{path}: no .json file to read.")
    runs = []
    for file in files:
        rel = file.name if file == path else file.relative_to(path).as_posix()
        record_id = rel[:-5] if rel.endswith(".json") else rel
        where = f"file {str(file)!r}"
        doc = _load_json(file, where)
        fmt = detect_format(doc) if format == "auto" else format
        if fmt is None:
            raise ConversationError(
                f"{where}: format not recognised (not Who&When records, OpenTelemetry "
                "spans, LangGraph or AutoGen messages); name it with --format.")
        if fmt == "who-and-when":
            raise ConversationError(f"{where}: holds Who&When records among trace files; "
                                    "read Who&When data on its own.")
        try:
            runs.append(_one_run(doc, fmt, record_id, where))
        except (ConversationError, TypeError, ValueError) as exc:
            raise ConversationError(f"{where} ({fmt}): {exc}") from exc
    return runs


def _looks_who_and_when(path):
    if path.is_dir():
        if any((path / s).is_dir() for s in ("Algorithm-Generated", "Hand-Crafted")):
            return True
        files = sorted(p for p in path.glob("*.json") if p.is_file())
        if not files:
            return False
        path = files[0]
    try:
        doc = _load_json(path, f"file {str(path)!r}")
    except (ConversationError, OSError, ValueError):
        return False
    return detect_format(doc) == "who-and-when"
