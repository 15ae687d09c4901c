"""Verbose progress lines in scikit-learn's style."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import sys
import time

__all__ = ["Timer", "log", "say"]


class Timer:
    """Print ``[Class] ..... message, total=  0.1s`` like scikit-learn's verbose steps."""

    def __init__(self, source, message):
        self.source, self.message = source, message

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        #: seconds inside the ``with`` block (read it after the block; message=None: silent)
        self.elapsed = elapsed = time.perf_counter() - self.start
        if self.message is not None:
            head = f"[{self.source}] "
            tail = f"{self.message}, total={elapsed:6.1f}s"
            say(self.source, "." * max(70 - len(head) - len(tail), 1) + " " + tail)
        return False


def log(estimator, level, message):
    """Write ``[Class] message`` to standard output when ``estimator.verbose >= level``.

    The one way skafa's estimators report progress (scikit-learn's verbose
    convention: standard output, silent at ``verbose=0``). Long loops use
    ``tqdm`` instead.

    Parameters
    ----------
    estimator : estimator object
        Its ``verbose`` parameter (int or bool; missing means 0) gates the line.
    level : int
        Smallest ``verbose`` at which the line is written.
    message : str
    """
    if int(getattr(estimator, "verbose", 0) or 0) >= level:
        say(type(estimator).__name__, message)


def say(source, message):
    """Write ``[source] message`` to standard output: the one place library code writes.

    Callers decide whether to speak (their ``verbose``); :func:`log` is the
    estimator form.
    """
    sys.stdout.write(f"[{source}] {message}\n" if source else f"{message}\n")
    sys.stdout.flush()
