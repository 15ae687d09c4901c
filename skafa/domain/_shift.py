"""Does a run look like the runs a probe was trained on?"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numbers
import warnings

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.model_selection import GroupKFold
from sklearn.utils.validation import check_is_fitted

from ..base import TurnInputMixin
from ..exceptions import DistributionShiftWarning
from ..features import check_turn_features
from ..utils.sklearn_compat import Interval, fit_context
from ..utils.validation import check_groups, describe

__all__ = ["ShiftDetector"]


def _listed(names, limit=5):
    shown = ", ".join(str(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _turn_matrix(X, sites):
    """Turn rows of ``sites`` side by side, float64: (n_turns_total, n_sites * width)."""
    if X.is_sparse:
        raise TypeError("ShiftDetector reads dense features (activations); got sparse "
                        "TurnFeatures.")
    block = X.select_sites(list(sites)).values if X.values.ndim == 3 else X.values[:, None]
    return np.asarray(block, dtype=np.float64).reshape(block.shape[0], -1)


def _reference(M, k):
    """Standardised principal subspace (``k`` components) of training turns."""
    mean = M.mean(axis=0)
    scale = M.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    Z = (M - mean) / scale
    _, s, vt = np.linalg.svd(Z, full_matrices=False)
    components = vt[:k]
    var = (s[:k] ** 2) / max(Z.shape[0] - 1, 1)
    var = np.where(var > 0, var, 1.0)
    resid = Z - (Z @ components.T) @ components
    resid_energy = max(float(np.mean(np.sum(resid ** 2, axis=1))), 1e-12)
    return {"reference_mean_": mean, "reference_scale_": scale,
            "reference_components_": components, "reference_variance_": var,
            "reference_residual_": resid_energy}


def _turn_scores(ref, M):
    Z = (M - ref["reference_mean_"]) / ref["reference_scale_"]
    P = Z @ ref["reference_components_"].T
    inside = np.mean(P ** 2 / ref["reference_variance_"], axis=1)
    outside = np.sum((Z - P @ ref["reference_components_"]) ** 2, axis=1)
    outside = outside / ref["reference_residual_"]
    return inside + outside


def _per_run(turn_scores, offsets):
    return np.add.reduceat(turn_scores, offsets[:-1]) / np.diff(offsets)


class ShiftDetector(TurnInputMixin, BaseEstimator):
    """Flag runs whose turn features look unlike the training runs'.

    Fitted on the turn features a probe was trained on (its sites), it scores a run
    by the mean over its turns of a distance to the training turns: the turn's
    standardised features, whitened in the top ``n_components`` principal
    components of the training turns, plus the energy outside them (relative to
    the training turns'). A run is flagged when its score leaves the central
    ``quantile`` of the scores of *held-out* training runs under a grouped ``cv``
    (above ``threshold_``, or below ``lower_threshold_`` with ``two_sided=True``)
    — so on runs like the training runs about ``1 - quantile`` of them are
    flagged, by construction. Two-sided, because in many dimensions distances
    concentrate: runs of a framework whose features vary *less* than the training
    runs' sit unusually close to the centre, and are as unlike them as runs far
    away.

    Parameters
    ----------
    sites : list of str, default=None
        Site blocks to read (e.g. the probe's ``best_sites_``); None: every site.
    n_components : int, default=20
        Principal components of the standardised training turns.
    quantile : float, default=0.95
        Quantile of held-out training runs' scores used as the threshold.
    cv : int, default=5
        Folds of the grouped calibration (``GroupKFold``).
    two_sided : bool, default=True
        Flag scores below the central interval too (``lower_threshold_``).

    Attributes
    ----------
    sites_ : tuple of str
        The sites read.
    threshold_ : float
        Scores above it are flagged.
    lower_threshold_ : float
        Scores below it are flagged (``-inf`` when ``two_sided=False``).
    calibration_scores_ : ndarray of shape (n_conversations,)
        Held-out scores of the training runs (one per run) the threshold came from.
    n_features_in_ : int
        Features per turn and site.
    reference_mean_, reference_scale_ : ndarray of shape (cv, n_sites * n_features)
        Standardisation of each calibration fold's training turns (sites side by
        side).
    reference_components_ : ndarray of shape (cv, k, n_sites * n_features)
        Top principal directions of each fold's standardised training turns.
    reference_variance_ : ndarray of shape (cv, k)
    reference_residual_ : ndarray of shape (cv,)
        Mean squared norm of each fold's training turns outside its components.

    Notes
    -----
    Cross-fitted: a held-out training run is scored against the reference of the
    folds that do not hold it, and a new run by the mean of its scores against
    every fold's reference — references of the same size, so new runs' scores and
    the calibration scores are comparable. (A reference refitted on all training
    runs would score new runs systematically lower, and a two-sided threshold
    would flag them.) The training runs themselves sit closer to the references than
    new runs do: scored in-sample, more of them fall below ``lower_threshold_`` (on
    Who&When, 8% and 10% flagged instead of about 5%; ``docs/your-own-framework.md``).
    Ask it about new runs; ``two_sided=False`` flags the upper tail only.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa.testing import make_site_features
    >>> from skafa.domain import ShiftDetector
    >>> X, _ = make_site_features(n=60, n_sites=2, signal_site=0, seed=0)
    >>> det = ShiftDetector(n_components=3).fit(X)
    >>> other = X.with_values(X.values * 3 + 5)
    >>> float(det.predict(X).mean()) < 0.2, bool(det.predict(other).all())
    (True, True)
    """

    _parameter_constraints = {
        "sites": [list, tuple, None],
        "n_components": [Interval(numbers.Integral, 1, None, closed="left")],
        "quantile": [Interval(numbers.Real, 0, 1, closed="neither")],
        "cv": [Interval(numbers.Integral, 2, None, closed="left")],
        "two_sided": ["boolean"],
    }

    def __init__(self, *, sites=None, n_components=20, quantile=0.95, cv=5, two_sided=True):
        self.sites = sites
        self.n_components = n_components
        self.quantile = quantile
        self.cv = cv
        self.two_sided = two_sided

    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None, groups=None):
        """Fit the reference and calibrate the threshold on held-out training runs.

        Parameters
        ----------
        X : TurnFeatures
            The training runs' turn features.
        y : ignored
        groups : array-like of shape (n_conversations,), optional
            Task ids for the grouped calibration; default ``X.task_ids``, else one
            group per run.

        Returns
        -------
        self : ShiftDetector
        """
        X = check_turn_features(X, self)
        sites = tuple(X.sites) if self.sites is None else tuple(self.sites)
        missing = [s for s in sites if s not in X.sites]
        if missing:
            raise ValueError(f"ShiftDetector: sites {_listed(missing)} are not in X "
                             f"(it has {_listed(list(X.sites))}).")
        if groups is None:
            groups = (X.task_ids if X.task_ids is not None and not any(
                g is None for g in X.task_ids) else np.arange(X.n_conversations))
        groups = check_groups(groups, X.n_conversations)
        n_groups = np.unique(np.asarray(groups).astype(str)).size
        if n_groups < self.cv:
            raise ValueError(f"ShiftDetector: {n_groups} task group(s) in X; cv={self.cv} "
                             "needs at least as many to calibrate the threshold on "
                             "held-out runs.")
        M = _turn_matrix(X, sites)
        offsets = np.asarray(X.offsets)
        held_out = np.empty(X.n_conversations)
        folds = list(GroupKFold(n_splits=self.cv).split(
            np.zeros(X.n_conversations), groups=np.asarray(groups).astype(str)))
        fewest = min(int(X.n_turns[train].sum()) for train, _ in folds)
        k = max(1, min(self.n_components, fewest - 1, M.shape[1]))
        refs = []
        for train, test in folds:
            ref = _reference(_rows_in_order(M, offsets, train), k)
            test_offsets = np.concatenate([[0], np.cumsum(X.n_turns[test])])
            held_out[test] = _per_run(_turn_scores(ref, _rows_in_order(M, offsets, test)),
                                      test_offsets)
            refs.append(ref)
        for name in refs[0]:
            setattr(self, name, np.stack([np.asarray(r[name]) for r in refs]))
        self.sites_ = sites
        self.n_features_in_ = int(X.n_features)
        self.calibration_scores_ = held_out
        if self.two_sided:
            tail = (1 - self.quantile) / 2
            self.threshold_ = float(np.quantile(held_out, 1 - tail))
            self.lower_threshold_ = float(np.quantile(held_out, tail))
        else:
            self.threshold_ = float(np.quantile(held_out, self.quantile))
            self.lower_threshold_ = -np.inf
        return self

    def score_samples(self, X):
        """Shift score of every run (higher: less like the training runs).

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        scores : ndarray of shape (n_conversations,)
        """
        check_is_fitted(self)
        X = check_turn_features(X, self)
        if X.n_features != self.n_features_in_:
            raise ValueError(f"ShiftDetector: X has {X.n_features} features per turn; "
                             f"it was fitted with {self.n_features_in_}.")
        missing = [s for s in self.sites_ if s not in X.sites]
        if missing:
            raise ValueError(f"ShiftDetector: X lacks the sites {_listed(missing)} it was "
                             "fitted on.")
        M = _turn_matrix(X, self.sites_)
        names = ("reference_mean_", "reference_scale_", "reference_components_",
                 "reference_variance_", "reference_residual_")
        turn = np.mean([_turn_scores({n: getattr(self, n)[f] for n in names}, M)
                        for f in range(self.reference_residual_.shape[0])], axis=0)
        return _per_run(turn, np.asarray(X.offsets))

    def predict(self, X):
        """Whether each run is flagged as unlike the training runs.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        flagged : ndarray of bool, shape (n_conversations,)
        """
        return self._flag(self.score_samples(X))

    def _flag(self, scores):
        return (scores > self.threshold_) | (scores < self.lower_threshold_)

    def check(self, X, *, names=None, stacklevel=2, return_scores=False):
        """:meth:`predict`, warning with :class:`DistributionShiftWarning` if any run is flagged.

        Parameters
        ----------
        X : TurnFeatures
        names : sequence of str, optional
            How to name the runs in the warning (default: their positions and task
            ids).
        stacklevel : int, default=2
        return_scores : bool, default=False
            Also return :meth:`score_samples` (computed once either way).

        Returns
        -------
        flagged : ndarray of bool, shape (n_conversations,)
        scores : ndarray of shape (n_conversations,)
            Only with ``return_scores=True``.
        """
        scores = self.score_samples(X)
        flagged = self._flag(scores)
        if flagged.any():
            idx = np.flatnonzero(flagged)
            named = [names[i] if names is not None else describe(X, i) for i in idx]
            warnings.warn(
                f"{idx.size} of {flagged.size} run(s) look unlike the runs the probe was "
                f"trained on ({_listed(named)}: shift score outside the central "
                f"{self.quantile:.0%} of held-out training runs' scores). A probe "
                "scores near chance on another framework's runs: label some of yours "
                "(skafa label) and refit, pooled with the training runs.",
                DistributionShiftWarning, stacklevel=stacklevel)
        return (flagged, scores) if return_scores else flagged


def _rows_in_order(M, offsets, conversations):
    """Rows of ``M`` of the given conversations, in that order."""
    return np.concatenate([M[offsets[i]:offsets[i + 1]] for i in conversations])
