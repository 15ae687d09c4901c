"""Label runs by hand: the decisive step and the responsible agent, in a terminal.

A probe needs labelled runs of *your* framework (``docs/your-own-framework.md``).
:func:`label_runs` is the loop behind ``skafa label RUNS --out labels.json``: it
shows each unlabelled run turn by turn (a page at a time, long turns folded), the
probe's top turns when a fitted attributor is given, and asks for the decisive step
and the agent. Every answer is written at once (atomically), so Ctrl-C loses
nothing and the same command resumes.

The labels file is a side file keyed by record id, with Who&When's field names::

    {"format": "skafa-labels", "version": 1,
     "labels": {"Algorithm-Generated/12": {"mistake_step": 3, "mistake_agent": "Coder"}}}

:func:`read_labels` reads it back (validating it fully) and :func:`apply_labels`
attaches the labels to conversations, which ``skafa fit --labels`` does.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from .utils.fileio import atomic_write_bytes, read_json_file

__all__ = ["LABELS_FORMAT", "apply_labels", "label_runs", "read_labels", "write_labels"]

#: The ``format`` field of a labels file.
LABELS_FORMAT = "skafa-labels"
_VERSION = 1
#: A labels file larger than this is refused before it is read.
MAX_LABELS_BYTES = 64 * 1024 * 1024


def _fail(path, msg):
    raise ValueError(f"labels file {str(path)!r}: {msg}")


def read_labels(path):
    """Read a labels file written by :func:`write_labels` (or ``skafa label``).

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    labels : dict
        ``{record_id: {"mistake_step": int, "mistake_agent": str}}``; an absent
        file gives ``{}``.

    Raises
    ------
    ValueError
        Naming the file and the record or field that is wrong (not a regular
        file, too large, not JSON, NaN, a step that is not a non-negative int,
        an empty agent).
    """
    path = Path(path)
    if not path.exists():
        return {}
    data = read_json_file(path, max_bytes=MAX_LABELS_BYTES,
                          where=f"labels file {str(path)!r}")
    if not isinstance(data, dict) or data.get("format") != LABELS_FORMAT:
        _fail(path, f"is not a labels file (expected an object with format "
                    f"{LABELS_FORMAT!r}).")
    if data.get("version") != _VERSION:
        _fail(path, f"has version {data.get('version')!r}; this skafa reads {_VERSION}.")
    labels = data.get("labels")
    if not isinstance(labels, dict):
        _fail(path, "field 'labels' must be an object keyed by record id.")
    out = {}
    for rid, lab in labels.items():
        if not isinstance(lab, dict):
            _fail(path, f"labels[{rid!r}] must be an object.")
        step, agent = lab.get("mistake_step"), lab.get("mistake_agent")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            _fail(path, f"labels[{rid!r}].mistake_step={step!r} is not an int >= 0.")
        if not isinstance(agent, str) or not agent.strip():
            _fail(path, f"labels[{rid!r}].mistake_agent={agent!r} is not a non-empty "
                        "string.")
        out[rid] = {"mistake_step": step, "mistake_agent": agent}
    return out


def write_labels(path, labels):
    """Write ``labels`` atomically (a temporary file in the same folder, then rename).

    Parameters
    ----------
    path : str or path-like
    labels : dict
        ``{record_id: {"mistake_step": int, "mistake_agent": str}}``.
    """
    data = {"format": LABELS_FORMAT, "version": _VERSION, "labels": labels}
    atomic_write_bytes(path, json.dumps(data, indent=1, ensure_ascii=False).encode("utf-8"))


def apply_labels(conversations, labels, *, source="labels"):
    """Return the conversations with the labels of ``labels`` attached.

    A conversation without an entry keeps what it had. An entry whose step is out
    of range for its run is refused, naming the record.

    Parameters
    ----------
    conversations : list of Conversation
    labels : dict
        From :func:`read_labels`.
    source : str, default="labels"
        Names the labels in error messages (e.g. the file).

    Returns
    -------
    conversations : list of Conversation
    n_applied : int
    """
    out, n = [], 0
    for conv in conversations:
        lab = labels.get(str(conv.record_id)) if conv.record_id is not None else None
        if lab is None:
            out.append(conv)
            continue
        if not lab["mistake_step"] < len(conv):
            raise ValueError(f"{source}: record {conv.record_id!r}: mistake_step="
                             f"{lab['mistake_step']} is outside its {len(conv)} turns.")
        out.append(dataclasses.replace(conv, mistake_step=lab["mistake_step"],
                                       mistake_agent=lab["mistake_agent"]))
        n += 1
    return out, n


def _fold(text, width):
    text = " ".join(str(text).split())
    if len(text) <= width:
        return text
    return f"{text[:width]} … (+{len(text) - width:,} characters; 'o N' shows all)"


class _Quit(Exception):
    pass


def _ask(prompt, read, write):
    write(prompt)
    try:
        answer = read()
    except EOFError:
        raise _Quit from None
    return answer.strip()


def _show_page(conv, page, page_turns, fold, write):
    lo = page * page_turns
    hi = min(len(conv), lo + page_turns)
    for i in range(lo, hi):
        t = conv.turns[i]
        write(f"  [{i}] {t.speaker}: {_fold(t.content, fold)}\n")
    n_pages = -(-len(conv) // page_turns)
    write(f"  -- turns {lo}-{hi - 1} of {len(conv)} (page {page + 1}/{n_pages}) --\n")


def _label_one(conv, top, *, page_turns, fold, read, write):
    """Ask for one run's labels; None when skipped."""
    page = 0
    n_pages = -(-len(conv) // page_turns)
    speakers = sorted(set(conv.speakers))
    _show_page(conv, page, page_turns, fold, write)
    while True:
        if top:
            write("  probe's top turns: " + ", ".join(f"{s} ({p:.2f})" for s, p in top) + "\n")
        answer = _ask("decisive step (number), Enter/n next page, p previous, 'o N' open "
                      "turn N, s skip, q quit: ", read, write)
        low = answer.lower()
        if low in ("", "n"):
            if page + 1 < n_pages:
                page += 1
            _show_page(conv, page, page_turns, fold, write)
            continue
        if low == "p":
            page = max(page - 1, 0)
            _show_page(conv, page, page_turns, fold, write)
            continue
        if low == "s":
            return None
        if low == "q":
            raise _Quit
        if low.startswith("o"):
            arg = low[1:].strip()
            if arg.isdigit() and int(arg) < len(conv):
                t = conv.turns[int(arg)]
                write(f"  [{arg}] {t.speaker}:\n{t.content}\n")
            else:
                write(f"  'o N' needs a turn number from 0 to {len(conv) - 1}.\n")
            continue
        if not answer.lstrip("-").isdigit():
            write(f"  {answer!r} is not a step: type a turn number from 0 to "
                  f"{len(conv) - 1}, or Enter, p, 'o N', s, q.\n")
            continue
        step = int(answer)
        if not 0 <= step < len(conv):
            write(f"  step {step} is out of range: this run has turns 0 to "
                  f"{len(conv) - 1}.\n")
            continue
        default = conv.turns[step].speaker
        while True:
            agent = _ask(f"responsible agent (Enter: {default}; one of "
                         f"{', '.join(speakers)}): ", read, write) or default
            if agent in speakers:
                return {"mistake_step": step, "mistake_agent": agent}
            write(f"  unknown agent {agent!r}: this run's agents are "
                  f"{', '.join(speakers)}.\n")


def label_runs(conversations, out, *, attributor=None, top_k=3, page_turns=10,
               fold=300, relabel=False, read=None, write=None):
    """Ask for the decisive step and agent of every unlabelled run; write as you go.

    Parameters
    ----------
    conversations : list of Conversation
        The runs (each needs a ``record_id``: the labels are keyed by it).
    out : str or path-like
        The labels file; read first, so a second call resumes where the first
        stopped (runs labelled there are not asked again).
    attributor : FailureAttributor, optional
        Fitted; its top ``top_k`` turns of each run are shown as hints.
    top_k : int, default=3
    page_turns : int, default=10
        Turns shown per page.
    fold : int, default=300
        Characters of a turn shown before it is folded (``o N`` shows it all).
    relabel : bool, default=False
        Ask again about runs the file (or the record) already labels.
    read, write : callable, optional
        Input and output (default: ``input`` without prompt and
        ``sys.stdout.write``); for tests.

    Returns
    -------
    summary : dict
        ``{"labelled": n new, "skipped": n, "total_in_file": n, "stopped": bool}``.
    """
    read = read or (lambda: input())
    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    ids = [c.record_id for c in conversations]
    missing = [i for i, r in enumerate(ids) if r is None]
    if missing:
        raise ValueError(f"runs at positions {missing[:5]} have no record_id; labels are "
                         "keyed by record id.")
    dupes = sorted({str(r) for r in ids if ids.count(r) > 1})
    if dupes:
        raise ValueError(f"record ids {dupes[:5]} occur more than once.")
    labels = read_labels(out)
    todo = [c for c in conversations
            if relabel or (str(c.record_id) not in labels and c.mistake_step is None)]
    done = len(conversations) - len(todo)
    write(f"{len(todo)} run(s) to label ({done} already labelled); answers are saved to "
          f"{out} as you go: Ctrl-C or q stops, the same command resumes.\n")
    new = skipped = 0
    stopped = False
    try:
        for j, conv in enumerate(todo, 1):
            write(f"\n=== run {j}/{len(todo)}: {conv.record_id} ({len(conv)} turns) ===\n")
            if conv.task:
                write(f"task: {_fold(conv.task, fold)}\n")
            top = None
            if attributor is not None:
                att = attributor.attribute(conv, top_k=top_k)
                top = [(r.step, r.probability) for r in att.top_k]
            answer = _label_one(conv, top, page_turns=page_turns, fold=fold,
                                read=read, write=write)
            if answer is None:
                skipped += 1
                continue
            labels[str(conv.record_id)] = answer
            write_labels(out, labels)
            new += 1
            write(f"  saved: step {answer['mistake_step']}, agent "
                  f"{answer['mistake_agent']} ({len(labels)} in {out})\n")
    except (_Quit, KeyboardInterrupt):
        stopped = True
        write(f"\nstopped: {len(labels)} label(s) in {out}; run the same command to "
              "resume.\n")
    return {"labelled": new, "skipped": skipped, "total_in_file": len(labels),
            "stopped": stopped}
