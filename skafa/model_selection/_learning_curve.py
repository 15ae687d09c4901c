"""How accuracy on a framework grows with the number of its runs that are labelled.

:func:`grouped_learning_curve` follows :func:`sklearn.model_selection.learning_curve`:
an estimator, data, a list of training sizes, and cross-validated scores per size.
What differs is what a failure-attribution user needs to know about *their own*
framework: sizes count labelled runs (conversations), training runs are drawn **by
task groups** (a task never sits on both sides of a split), every size is drawn many
times (with 30 labelled runs the outcome swings), and labelled runs of *another*
framework (the source) may be pooled with the drawn target runs, so ``k = 0`` is
pure transfer.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import inspect
import numbers
import time
from dataclasses import dataclass, field

import numpy as np
from joblib import Parallel, delayed
from sklearn.base import clone
from sklearn.model_selection import GroupKFold
from sklearn.utils import check_random_state

from ..features import TurnFeatures
from ..utils.progress import say
from ..utils.sklearn_compat import safe_indexing
from ..utils.validation import check_groups, task_ids_of

__all__ = ["LearningCurveResult", "grouped_learning_curve"]


def _n_samples(X):
    return X.n_conversations if isinstance(X, TurnFeatures) else len(X)


def _take(X, idx):
    idx = np.asarray(idx, dtype=np.int64)
    return X[idx] if isinstance(X, TurnFeatures) else safe_indexing(X, idx)


def _join(a, b):
    if isinstance(a, TurnFeatures) != isinstance(b, TurnFeatures):
        raise TypeError("X and X_source must both be TurnFeatures or both be "
                        "lists of conversations.")
    if isinstance(a, TurnFeatures):
        return TurnFeatures.vstack([a, b])
    return list(a) + list(b)


def _groups_of(X, groups, name):
    if groups is not None:
        return np.asarray(check_groups(groups, _n_samples(X)), dtype=object)
    ids = X.task_ids if isinstance(X, TurnFeatures) else task_ids_of(X)
    if ids is None or any(g is None for g in ids):
        missing = (_n_samples(X) if ids is None else sum(g is None for g in ids))
        raise ValueError(f"{missing} conversation(s) of {name.replace('groups', 'X')} "
                         f"have no task id: pass {name}= (one task id per "
                         "conversation) so that training runs are drawn by task.")
    return np.asarray(list(ids), dtype=object)


def _fit(estimator, X, y, groups):
    """Fit, passing ``groups`` where the estimator's ``fit`` takes it."""
    try:
        params = inspect.signature(estimator.fit).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        params = {}
    if "groups" in params:
        return estimator.fit(X, y, groups=groups)
    return estimator.fit(X, y)


def _fit_and_predict(estimator, X, y, groups, source, picked, test):
    """One fit of the curve: on the picked target runs (pooled with the source)."""
    if source is not None and picked.size:
        X_source, y_source, g_src = source
        X_fit = _join(X_source, _take(X, picked))
        y_fit = np.concatenate([y_source, y[picked]])
        g_fit = np.concatenate([g_src, groups[picked]])
    elif source is not None:
        X_fit, y_fit, g_fit = source
    else:
        X_fit, y_fit, g_fit = _take(X, picked), y[picked], groups[picked]
    t = time.perf_counter()
    est = _fit(clone(estimator), X_fit, y_fit, g_fit)
    t_fit = time.perf_counter() - t
    t = time.perf_counter()
    pred = np.asarray(est.predict(_take(X, test)))
    return pred, t_fit, time.perf_counter() - t


def _draw_by_groups(pool, groups, k, rng):
    """``k`` members of ``pool`` drawn by whole groups (the last group trimmed)."""
    if k >= pool.size:
        return pool
    order = rng.permutation(np.unique(groups[pool].astype(str)))
    chosen = []
    for g in order:
        members = pool[groups[pool].astype(str) == g]
        chosen.extend(rng.permutation(members)[: k - len(chosen)].tolist())
        if len(chosen) >= k:
            break
    return np.sort(np.asarray(chosen, dtype=np.int64))


def _resolve_sizes(train_sizes, n_pool):
    sizes = []
    for s in train_sizes:
        if isinstance(s, (bool, np.bool_)):
            raise TypeError(f"train_sizes holds {s!r}; expected ints (runs) or floats "
                            "in (0, 1] (share of the training part).")
        if isinstance(s, numbers.Integral):
            if s < 0:
                raise ValueError(f"train_sizes holds {s}; a number of runs is >= 0.")
            sizes.append(int(s))
        elif isinstance(s, numbers.Real):
            if not 0 < s <= 1:
                raise ValueError(f"train_sizes holds {s}; a share of the training "
                                 "part lies in (0, 1].")
            sizes.append(s)
        else:
            raise TypeError(f"train_sizes holds {s!r}; expected ints or floats.")
    if not sizes:
        raise ValueError("train_sizes is empty.")
    return sizes


@dataclass
class LearningCurveResult:
    """Scores of :func:`grouped_learning_curve`.

    Attributes
    ----------
    train_sizes : list of (int or float)
        The sizes asked for (runs, or a share of each fold's training part).
    n_labelled : ndarray of shape (n_sizes, n_draws, n_folds)
        How many target runs were labelled in each fit.
    hits : ndarray of shape (n_sizes, n_draws, n_conversations)
        1.0 where a run's held-out prediction was its decisive step, 0.0 where not,
        NaN where a size could not be fitted (``k = 0`` without a source).
    groups : ndarray of shape (n_conversations,)
        Task ids of the target runs (the bootstrap's clusters).
    pooled : bool
        Whether source runs were pooled with the drawn target runs.
    times : dict
        Seconds spent fitting and predicting.
    """

    train_sizes: list
    n_labelled: np.ndarray
    hits: np.ndarray
    groups: np.ndarray
    pooled: bool
    times: dict = field(default_factory=dict)

    @property
    def draw_scores(self):
        """Step accuracy of every draw, shape (n_sizes, n_draws) (NaN: not fitted)."""
        with np.errstate(invalid="ignore"):
            return np.nanmean(self.hits, axis=2) if np.isfinite(self.hits).any() \
                else np.full(self.hits.shape[:2], np.nan)

    def summary(self, *, n_resamples=2000, confidence=0.95, random_state=0,
                spread=(10, 90)):
        """One row per size: mean, a two-way bootstrap CI and the spread over draws.

        The CI resamples draws and task clusters together (both with replacement),
        so it covers the uncertainty of which runs were labelled and of which tasks
        were tested. ``spread`` gives percentiles of the per-draw accuracies: what a
        single user with that many labelled runs might see.

        Parameters
        ----------
        n_resamples : int, default=2000
        confidence : float, default=0.95
        random_state : int, default=0
        spread : tuple of two floats, default=(10, 90)

        Returns
        -------
        rows : list of dict
            Keys ``size``, ``n_labelled`` (mean), ``mean``, ``low``, ``high``,
            ``spread_low``, ``spread_high``, ``n_draws``, ``n``.
        """
        if not isinstance(n_resamples, numbers.Integral) or n_resamples < 1:
            raise ValueError(f"n_resamples={n_resamples!r}; expected an int >= 1.")
        rng = check_random_state(random_state)
        tasks, cluster = np.unique(self.groups.astype(str), return_inverse=True)
        rows = []
        for i, size in enumerate(self.train_sizes):
            h = self.hits[i]
            if not np.isfinite(h).all():
                rows.append(dict(size=size, n_labelled=float("nan"), mean=float("nan"),
                                 low=float("nan"), high=float("nan"),
                                 spread_low=float("nan"), spread_high=float("nan"),
                                 n_draws=h.shape[0], n=h.shape[1]))
                continue
            # sums and counts per (draw, task) so a resample is two index draws
            sums = np.zeros((h.shape[0], tasks.size))
            np.add.at(sums, (slice(None), cluster), h)
            counts = np.bincount(cluster, minlength=tasks.size).astype(float)
            stats = np.empty(n_resamples)
            for b in range(n_resamples):
                d = rng.randint(h.shape[0], size=h.shape[0])
                t = rng.randint(tasks.size, size=tasks.size)
                stats[b] = sums[np.ix_(d, t)].sum() / (counts[t].sum() * d.size)
            alpha = (1 - confidence) / 2
            per_draw = h.mean(axis=1)
            rows.append(dict(
                size=size, n_labelled=float(self.n_labelled[i].mean()),
                mean=float(h.mean()),
                low=float(np.quantile(stats, alpha)), high=float(np.quantile(stats, 1 - alpha)),
                spread_low=float(np.percentile(per_draw, spread[0])),
                spread_high=float(np.percentile(per_draw, spread[1])),
                n_draws=int(h.shape[0]), n=int(h.shape[1])))
        return rows

    def plot(self, ax=None, *, label=None, **summary_params):
        """Draw the curve: the mean, its CI band and the draws' spread (whiskers).

        Parameters
        ----------
        ax : matplotlib Axes, optional
            Drawn on a new figure when None.
        label : str, optional
            Legend label of the curve.
        **summary_params
            Passed to :meth:`summary`.

        Returns
        -------
        ax : matplotlib Axes
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 3.5))
        rows = [r for r in self.summary(**summary_params) if np.isfinite(r["mean"])]
        x = np.array([r["n_labelled"] for r in rows])
        mean = np.array([r["mean"] for r in rows])
        line, = ax.plot(x, mean, marker="o", label=label)
        ax.fill_between(x, [r["low"] for r in rows], [r["high"] for r in rows],
                        alpha=0.2, color=line.get_color())
        ax.errorbar(x, mean, yerr=[mean - np.array([r["spread_low"] for r in rows]),
                                   np.array([r["spread_high"] for r in rows]) - mean],
                    fmt="none", ecolor=line.get_color(), alpha=0.6, capsize=3)
        ax.set_xlabel("labelled target runs (k)")
        ax.set_ylabel("step accuracy")
        if label is not None:
            ax.legend()
        return ax


def grouped_learning_curve(estimator, X, y, *, groups=None,
                           train_sizes=(0, 5, 10, 20, 1.0), n_draws=20, n_splits=5,
                           X_source=None, y_source=None, groups_source=None,
                           label_order=None, n_jobs=None, random_state=None, verbose=0):
    """Step accuracy against the number of labelled runs, drawn by task groups.

    For every draw, the target runs ``X`` are split by a freshly shuffled
    ``GroupKFold(n_splits)`` over ``groups``; for every fold and every size ``k``,
    ``k`` runs are drawn at random from the fold's training part, whole tasks at a
    time (the last task trimmed to reach ``k``), a clone of ``estimator`` is fitted
    on them — pooled with every source run when ``X_source`` is given — and the
    fold's held-out runs are predicted. Every target run is thus scored once per
    draw and size.

    Parameters
    ----------
    estimator : estimator object
        Any skafa estimator (a pipeline, a :class:`~skafa.SiteSelector`, a probe)
        whose ``predict`` returns one step per conversation. ``groups`` is passed
        to its ``fit`` when that takes it.
    X : list of Conversation or TurnFeatures
        The target framework's labelled runs.
    y : array-like of int, shape (n_conversations,)
        Their decisive steps.
    groups : array-like, shape (n_conversations,), optional
        Task ids; default: the conversations' own task ids.
    train_sizes : sequence of int or float, default=(0, 5, 10, 20, 1.0)
        Labelled target runs per fit: an int is a number of runs (capped at the
        fold's training part), a float in (0, 1] a share of it (1.0: all). ``0``
        needs a source (without one its row is NaN).
    n_draws : int, default=20
        Draws per size.
    n_splits : int, default=5
        Folds of the target runs per draw.
    X_source, y_source : optional
        Labelled runs of another framework, pooled with every draw (same type as
        ``X``).
    groups_source : array-like, optional
        Their task ids (default: their own); prefixed so they never equal a
        target task.
    label_order : array-like of float, shape (n_conversations,), optional
        Simulates a labelling order instead of random draws: in every fold the
        ``k`` runs of the training part with the *lowest* values are labelled
        (e.g. the margin between a probe's two most probable turns,
        :func:`skafa.domain.label_priority`). Draws then differ only by their folds,
        so a comparison with random draws on the same ``random_state`` is paired.
    n_jobs : int, default=None
        Fits run in parallel (joblib); the draws are made before, in this
        process, so the result does not depend on it.
    random_state : int, RandomState instance or None, default=None
        Seeds the folds and the draws.
    verbose : int, default=0
        ``> 0``: one line per size with its mean, and the time spent.

    Returns
    -------
    LearningCurveResult

    Examples
    --------
    >>> from skafa.testing import make_site_features
    >>> from skafa import GroupedArgmaxLogisticClassifier
    >>> X, y = make_site_features(n=30, n_sites=1, seed=0, signal_site=0)
    >>> res = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y,
    ...                              train_sizes=[6, 1.0], n_draws=2, random_state=0)
    >>> res.hits.shape
    (2, 2, 30)
    """
    n = _n_samples(X)
    y = np.asarray(y)
    if y.shape != (n,):
        raise ValueError(f"y has shape {y.shape}; expected ({n},).")
    groups = _groups_of(X, groups, "groups")
    sizes = _resolve_sizes(train_sizes, n)
    for name, value, low in (("n_draws", n_draws, 1), ("n_splits", n_splits, 2)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r}; expected an int >= {low}.")
    n_tasks = np.unique(groups.astype(str)).size
    if n_tasks < n_splits:
        raise ValueError(f"X holds {n_tasks} task(s); n_splits={n_splits} needs at "
                         "least as many.")
    if label_order is not None:
        label_order = np.asarray(label_order, dtype=float)
        if label_order.shape != (n,) or not np.isfinite(label_order).all():
            raise ValueError(f"label_order must hold {n} finite values (one per run); "
                             f"got shape {label_order.shape}.")
    pooled = X_source is not None
    if pooled:
        if y_source is None:
            raise ValueError("X_source is given without y_source.")
        y_source = np.asarray(y_source)
        if y_source.shape != (_n_samples(X_source),):
            raise ValueError(f"y_source has shape {y_source.shape}; expected "
                             f"({_n_samples(X_source)},).")
        g_src = _groups_of(X_source, groups_source, "groups_source")
        g_src = np.asarray([f"source:{g}" for g in g_src], dtype=object)
    rng = check_random_state(random_state)
    hits = np.full((len(sizes), n_draws, n), np.nan)
    n_lab = np.zeros((len(sizes), n_draws, n_splits), dtype=np.int64)
    times = {"fit": 0.0, "predict": 0.0}
    start = time.perf_counter()
    fold_seeds = rng.randint(np.iinfo(np.int32).max, size=n_draws)
    jobs = []  # every fit, drawn here in one process so n_jobs cannot change them
    for i, size in enumerate(sizes):
        for d in range(n_draws):
            cv = GroupKFold(n_splits=n_splits, shuffle=True, random_state=int(fold_seeds[d]))
            draw_rng = np.random.RandomState((int(fold_seeds[d]) + 7919 * i) % 2**32)
            for f, (train, test) in enumerate(cv.split(np.zeros(n), y, groups.astype(str))):
                k = size if isinstance(size, int) else int(round(size * train.size))
                k = min(k, train.size)
                if label_order is None:
                    picked = _draw_by_groups(train, groups, k, draw_rng)
                else:
                    picked = np.sort(train[np.argsort(label_order[train], kind="stable")[:k]])
                n_lab[i, d, f] = picked.size
                if picked.size or pooled:
                    jobs.append((i, d, picked, test))
    source = (X_source, y_source, g_src) if pooled else None
    # with no target run drawn, every fold fits the same source runs: fit them once
    everything = np.arange(n)
    unique = [j for j in jobs if j[2].size] + ([(-1, -1, jobs[0][2][:0], everything)]
                                              if any(not j[2].size for j in jobs) else [])
    fitted = Parallel(n_jobs=n_jobs)(
        delayed(_fit_and_predict)(estimator, X, y, groups, source, picked, test)
        for _, _, picked, test in unique)
    source_only = fitted[-1] if unique and unique[-1][0] == -1 else None
    done, it = [], iter(fitted)
    for _, _, picked, test in jobs:
        if picked.size:
            done.append(next(it))
        else:
            pred, t_fit, t_pred = source_only
            done.append((pred[test], t_fit / len(jobs), t_pred / len(jobs)))
    for (i, d, _, test), (pred, t_fit, t_pred) in zip(jobs, done):
        hits[i, d, test] = (pred == y[test]).astype(float)
        times["fit"] += t_fit
        times["predict"] += t_pred
    if verbose > 0:
        for i, size in enumerate(sizes):
            with np.errstate(invalid="ignore"):
                mean = np.nanmean(hits[i]) if np.isfinite(hits[i]).any() else float("nan")
            say("grouped_learning_curve", f"size {size!r}: mean step accuracy {mean:.3f} "
                f"over {n_draws} draws")
        say("grouped_learning_curve", f"{len(jobs)} fits in "
            f"{time.perf_counter() - start:.0f} s")
    return LearningCurveResult(train_sizes=list(sizes), n_labelled=n_lab, hits=hits,
                               groups=groups, pooled=pooled, times=times)
