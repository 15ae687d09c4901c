"""Verbose progress lines in scikit-learn's style."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import sys
import time

import numpy as np

__all__ = ["Timer", "WorkBar", "log", "say"]


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


class WorkBar:
    """A tqdm bar over the work of a list of items, with a ``k/n <items>`` postfix.

    Each item advances the bar by its cost (e.g. the forward FLOPs of its prompt,
    :func:`skafa.llm.forward_flops`), not by one: long prompts run first, so a
    per-item rate makes the early ETA far too long (2.5x on a 1.5B ``echo`` read).

    Parameters
    ----------
    cost : array-like of float
        One cost per item, in the order the items will be done (any order is
        fine for :meth:`done`, which takes the item's index).
    desc : str
        The bar's label.
    unit : str, default="FLOP"
        The cost's unit (shown with SI prefixes).
    items : str, default="conversations"
        What the postfix counts.

    Notes
    -----
    An item another process computes (:meth:`elsewhere`) leaves the bar's total:
    the bar then measures this process's own work, so its rate and ETA stay this
    process's, however many others share the items.
    """

    def __init__(self, cost, desc, *, unit="FLOP", items="conversations"):
        from tqdm.auto import tqdm

        self.cost = np.atleast_1d(np.asarray(cost, dtype=np.float64))
        self.items, self.n_done = items, 0
        self._elsewhere = set()
        self.bar = tqdm(total=float(self.cost.sum()), unit=unit, unit_scale=True, desc=desc,
                        postfix=f"0/{len(self.cost)} {items}")

    def elsewhere(self, j, flag=True):
        """Item ``j`` is (``flag``), or after all is not, computed by another process.

        Its cost leaves the bar's total (or comes back); its :meth:`done` then
        only counts it.
        """
        j = int(j)
        if bool(flag) == (j in self._elsewhere):
            return
        (self._elsewhere.add if flag else self._elsewhere.discard)(j)
        self.bar.total += -float(self.cost[j]) if flag else float(self.cost[j])
        self.bar.refresh()

    def done(self, j):
        """Item ``j`` (its index in ``cost``) is done."""
        self.n_done += 1
        self.bar.set_postfix_str(f"{self.n_done}/{len(self.cost)} {self.items}", refresh=False)
        if int(j) in self._elsewhere:
            self.bar.refresh()
        else:
            self.bar.update(float(self.cost[j]))

    def close(self):
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
