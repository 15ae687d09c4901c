"""Claim files: how processes sharing a folder split work, and wait for each other.

A claim is a small file created atomically (``O_CREAT | O_EXCL``) beside what is
being computed; it says "being computed by this process". It holds the process's
pid, host name and start time, so another process of the same host can tell
whether the claimant is still running (a pid reused after the claimant was killed
is another process: it started at another time). Claims are advisory: they order
work, they never decide a result. The activation cache
(:meth:`skafa.llm.ActivationCache.claim`) and the grafted judge's shared store use
them.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import json
import os
import socket
import time

from .fileio import read_regular_file

__all__ = ["POLL_SECONDS", "claim_text", "claim_holder_alive", "create_claim",
           "process_start", "wait_while_claimed"]

#: How often a process waiting for another's claimed item looks again (seconds).
POLL_SECONDS = 10.0


def _proc_stat(pid):
    """``(state, start)`` of process ``pid`` from ``/proc/<pid>/stat``, or ``None``."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read(4096)
        # the command name (field 2) is in parentheses and may hold spaces or ')'
        fields = text[text.rindex(b")") + 2:].split()
        return fields[0].decode("ascii"), int(fields[19])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None


def process_start(pid):
    """Start time of process ``pid`` (clock ticks after boot), or ``None``.

    Field 22 of ``/proc/<pid>/stat`` (Linux); ``None`` where there is no such file
    (another system, a process that is gone) or it cannot be parsed. With the pid
    it names one process: a pid reused after its process ended gets another start.

    Parameters
    ----------
    pid : int

    Returns
    -------
    start : int or None
    """
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def claim_text():
    """What this process writes into a claim file: JSON of pid, host and start time."""
    pid = os.getpid()
    return json.dumps({"pid": pid, "host": socket.gethostname(),
                       "start": process_start(pid)})


def create_claim(path):
    """Create the claim file ``path`` for this process, atomically, if nobody holds it.

    ``O_CREAT | O_EXCL`` (atomic on a local or NFSv3+ file system); the file holds
    :func:`claim_text`.

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    created : bool or None
        ``True``: the claim is this process's. ``False``: the file exists (another
        process holds it). ``None``: it could not be written (a read-only folder);
        the caller decides what that means.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return None
    with os.fdopen(fd, "w") as f:
        f.write(claim_text())
    return True


def claim_holder_alive(path):
    """Whether a running process of this host, other than this one, holds the claim ``path``.

    The file is read as untrusted: a regular file (no symlink), at most 4 KiB, JSON
    with an int ``pid`` and this host's name; anything else, a process that is gone
    (or has ended and is not yet reaped: a zombie), a process under the claim's pid
    that started at another time than the claim records (the pid was reused), or a
    claim of another host (whose processes cannot be seen from here) gives
    ``False``, so nobody waits for it.

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    alive : bool
    """
    try:
        who = json.loads(read_regular_file(path, max_bytes=4096, follow_symlinks=False))
    except (OSError, ValueError):  # gone, not a regular file, too big, not JSON
        return False
    pid = who.get("pid") if isinstance(who, dict) else None
    if (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0
            or pid == os.getpid() or who.get("host") != socket.gethostname()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        pass
    stat = _proc_stat(pid)
    if stat is not None and stat[0] in ("Z", "X"):  # ended, not yet reaped by its parent
        return False
    start = who.get("start")
    if isinstance(start, int) and not isinstance(start, bool):
        if stat is not None and stat[1] != start:  # another process under a reused pid
            return False
    return True


def wait_while_claimed(path, done):
    """Sleep while ``done()`` is false and a live process of this host holds ``path``.

    Polls every :data:`POLL_SECONDS`. Returns at once when the claim is this
    process's, gone, stale or another host's (:func:`claim_holder_alive`).

    Parameters
    ----------
    path : str or path-like
        The claim file.
    done : callable
        ``done()`` is true once the claimed item is there (then no wait is needed).

    Returns
    -------
    waited : bool
        Whether it slept at all.
    """
    waited = False
    while not done() and claim_holder_alive(path):
        time.sleep(POLL_SECONDS)
        waited = True
    return waited
