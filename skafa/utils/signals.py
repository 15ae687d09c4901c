"""Stop requests (SIGTERM, Ctrl-C) that a broad ``except`` must not swallow.

A long loop that reads files someone else may have written catches broad errors on
purpose: an unreadable file is counted as damaged, deleted or recomputed, and the
loop goes on. A signal that arrives during such a read can surface as *another*
error: its handler raises ``KeyboardInterrupt`` in Python code that a library (torch,
safetensors) runs under its own ``try``, and the caller sees a ``RuntimeError``. The
broad ``except`` would then take the stop for a damaged file, delete a good file and
go on: the stop is swallowed.

:func:`stop_requests` records every SIGTERM and SIGINT that arrives while it is
active, and :func:`raise_if_stop_requested`, called first in each broad ``except``,
turns a failure that follows a stop request into :class:`StopRequested`: the file is
left alone and the process stops, as it was asked to. One concept, one place: every
long loop of skafa that catches broad errors uses these two.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["StopRequested", "raise_if_stop_requested", "stop_requested", "stop_requests"]

#: The signals :func:`stop_requests` records.
STOP_SIGNALS = ("SIGTERM", "SIGINT")

_lock = threading.Lock()
_depth = 0          # nesting of active stop_requests() blocks (main thread only)
_previous = {}      # signal number -> handler in place before the outermost block
_received = []      # signal numbers received while a block was active
_raised = []        # what the application's own handlers raised for them


def _name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequested(KeyboardInterrupt, SystemExit):
    """The process was asked to stop (SIGTERM or SIGINT) while skafa was working.

    A :class:`KeyboardInterrupt`, so a broad ``except Exception`` never catches it
    and code that already handles Ctrl-C (clean-ups, the command line's
    "interrupted" message) handles a ``kill`` the same way; and a
    :class:`SystemExit` with ``code`` ``128 + signum``, so that, left uncaught, it
    ends the process (after the ``finally`` clauses ran) with the status a shell
    reports for a process that signal ended: 143 for SIGTERM, 130 for SIGINT.

    Parameters
    ----------
    signum : int
        The signal received.
    what : str, optional
        What was being done (e.g. the file being read), for the message.

    Attributes
    ----------
    signum : int
    code : int
        ``128 + signum``: the exit status when nothing catches it.
    """

    def __init__(self, signum, what=None):
        self.signum = int(signum)
        message = f"stopped by signal {self.signum} ({_name(self.signum)})"
        if what:
            message += f" while {what}"
        super().__init__(message)
        self.code = 128 + self.signum


def stop_requested():
    """The first stop signal received inside an active :func:`stop_requests` block.

    Returns
    -------
    signum : int or None
        ``None`` when none was received (or no block is active).
    """
    return _received[0] if _received else None


def raise_if_stop_requested(what=None, *, cause=None):
    """Stop if a stop signal was received; else do nothing.

    Call it first in every broad ``except`` of a long loop: the error being handled
    may be the stop request itself, surfaced as another exception, and must then
    not be counted as a damaged file. When the application's own handler of that
    signal raised an exception (e.g. ``SystemExit``), that exception is raised
    again (a library may have turned it into the error being handled); otherwise
    :class:`StopRequested`.

    Parameters
    ----------
    what : str, optional
        What was being done, named in the message (e.g. ``"reading <file>"``).
    cause : BaseException, optional
        The error being handled; chained as the new exception's ``__cause__``.

    Raises
    ------
    StopRequested
        When :func:`stop_requested` is not ``None`` (or what the application's
        handler raised).
    """
    signum = stop_requested()
    if signum is None:
        return
    if _raised:
        raise _raised[0]
    raise StopRequested(signum, what) from cause


def _handler(signum, frame):
    _received.append(signum)
    previous = _previous.get(signum)
    if callable(previous) and previous is not signal.default_int_handler:
        try:
            previous(signum, frame)  # the application's own handler decides
        except BaseException as exc:
            _raised.append(exc)
            raise
        return
    raise StopRequested(signum)  # SIG_DFL (SIGTERM) or Python's Ctrl-C: stop now


@contextlib.contextmanager
def stop_requests():
    """Record SIGTERM and SIGINT while the block runs, and stop on them.

    In the block, either signal raises :class:`StopRequested` (a
    ``KeyboardInterrupt``; uncaught, the process exits with status ``128 + signum``)
    where Python code runs, so ``finally`` clauses and clean-ups run; and it is
    recorded, so that :func:`raise_if_stop_requested` tells a failure it caused
    (inside a library that turned it into another error) from a damaged file. A handler the application had installed is called instead of
    raising (its decision stands; the signal is still recorded); a signal that was
    ignored (``SIG_IGN``, e.g. SIGINT under ``nohup ... &``) stays ignored.

    Blocks nest (only the outermost one installs and restores the handlers). Outside
    the main thread, where Python cannot install handlers, the block installs
    nothing; :func:`raise_if_stop_requested` still sees what a block of the main
    thread recorded. The record is cleared when the outermost block ends.

    Yields
    ------
    None

    Examples
    --------
    >>> from skafa.utils.signals import raise_if_stop_requested, stop_requests
    >>> with stop_requests():
    ...     for path in []:                      # a long loop over files
    ...         try:
    ...             pass                         # read(path)
    ...         except Exception as exc:
    ...             raise_if_stop_requested(f"reading {path}", cause=exc)
    ...             pass                         # count it as damaged, go on
    """
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _lock:
        outermost = _depth == 0
        _depth += 1
    installed = {}
    try:
        if outermost:
            _received.clear()
            _raised.clear()
            for name in STOP_SIGNALS:
                signum = getattr(signal, name, None)
                if signum is None:
                    continue
                current = signal.getsignal(signum)
                if current is None:  # set outside Python: the default is the closest
                    current = signal.SIG_DFL
                if current == signal.SIG_IGN:
                    continue
                _previous[signum] = current
                signal.signal(signum, _handler)
                installed[signum] = current
        yield
    finally:
        if outermost:
            for signum, previous in installed.items():
                signal.signal(signum, previous)
            _previous.clear()
            _received.clear()
            _raised.clear()
        with _lock:
            _depth -= 1
