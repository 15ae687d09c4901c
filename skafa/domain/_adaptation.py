"""Unsupervised adaptation to another framework's runs, and which runs to label first.

The candidates pre-registered in ``docs/your-own-framework.md``: per-framework
standardisation (A1) and CORAL (A2). Both see the target framework's runs without
their labels. They are functions of :class:`~skafa.TurnFeatures`, applied before a
probe is fitted (source runs) or asked (target runs).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numbers

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

from ..base import TurnInputMixin
from ..features import TurnFeatures, check_turn_features
from ..utils.sklearn_compat import Interval, fit_context

__all__ = ["CoralAdapter", "coral", "label_priority", "standardize_per_framework"]


def _dense(X, name):
    if not isinstance(X, TurnFeatures):
        raise TypeError(f"{name} must be TurnFeatures, got {type(X).__name__}.")
    if X.is_sparse:
        raise TypeError(f"{name} holds sparse features; adaptation reads dense ones.")
    values = np.asarray(X.values, dtype=np.float64)
    if not np.isfinite(values).all():
        bad = ~np.isfinite(values).reshape(values.shape[0], -1).all(axis=1)
        row = int(np.flatnonzero(bad)[0])
        conv = int(np.searchsorted(np.asarray(X.offsets), row, side="right") - 1)
        raise ValueError(f"{name} holds a value that is not finite (NaN or infinite) at "
                         f"turn {row - int(X.offsets[conv])} of conversation {conv}.")
    return values if values.ndim == 3 else values[:, None, :]


def _moments(V):
    mean = V.mean(axis=0)
    std = V.std(axis=0)
    return mean, np.where(std > 0, std, 1.0)


def standardize_per_framework(X, reference=None):
    """Z-score every feature of every site with one framework's turn statistics.

    Candidate A1: source runs are standardised with the source's statistics, a
    user's runs with their own framework's (its unlabelled runs). A shift that is
    constant within a run cannot change a per-run argmax; the scales can.

    Parameters
    ----------
    X : TurnFeatures
        The runs to standardise.
    reference : TurnFeatures, optional
        Runs of the same framework whose turns give the statistics (e.g. every
        unlabelled run); default ``X`` itself.

    Returns
    -------
    TurnFeatures
        ``X`` with standardised values (float64), same sites and metadata.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa.testing import make_site_features
    >>> X, _ = make_site_features(n=20, n_sites=2, signal_site=0)
    >>> Z = standardize_per_framework(X.with_values(X.values * 5 + 3))
    >>> bool(np.allclose(Z.values.mean(axis=0), 0) and np.allclose(Z.values.std(axis=0), 1))
    True
    """
    V = _dense(X, "X")
    R = V if reference is None else _dense(reference, "reference")
    if R.shape[1:] != V.shape[1:]:
        raise ValueError(f"reference has {R.shape[1]} site(s) x {R.shape[2]} features; "
                         f"X has {V.shape[1]} x {V.shape[2]}.")
    mean, std = _moments(R)
    return X.with_values(((V - mean) / std).reshape(np.shape(X.values)))


def _sqrtm(C, inverse=False):
    w, U = np.linalg.eigh(C)
    w = np.clip(w, 1e-12, None)
    return (U * (w ** (-0.5 if inverse else 0.5))) @ U.T


def coral(X_source, X_target, *, regularization=1.0):
    """Re-colour the source runs' turn features with the target's covariance (CORAL).

    Candidate A2 (Sun, Feng & Saenko, 2016), per site: both frameworks are
    standardised with their own statistics (as :func:`standardize_per_framework`),
    then the source's turn features are whitened with the source covariance and
    re-coloured with the target's, each regularised by ``regularization`` times
    the identity. Fit a probe on the returned source runs; ask it about the target
    runs standardised with their own statistics.

    Parameters
    ----------
    X_source, X_target : TurnFeatures
        Same sites and width; ``X_target`` without labels.
    regularization : float, default=1.0

    Returns
    -------
    source : TurnFeatures
        The re-coloured source runs.
    target : TurnFeatures
        The standardised target runs.
    """
    if not isinstance(regularization, numbers.Real) or regularization <= 0:
        raise ValueError(f"regularization={regularization!r}; expected a float > 0.")
    adapter = CoralAdapter(regularization=regularization)
    return adapter.fit_transform(X_source, target_X=X_target), adapter.transform(X_target)


def label_priority(turn_proba, offsets):
    """Margin between each run's two most probable turns: label the smallest first.

    Parameters
    ----------
    turn_proba : array-like of float, shape (n_turns_total,)
        Per-turn probabilities of being the decisive step (e.g. a probe's
        ``turn_decision_function`` passed through a per-run softmax).
    offsets : array-like of int, shape (n_conversations + 1,)
        Where each run's turns start (``TurnFeatures.offsets``).

    Returns
    -------
    margin : ndarray of shape (n_conversations,)
        ``p(top turn) - p(second turn)``; a one-turn run gets 1.0 (nothing to ask).

    Examples
    --------
    >>> label_priority([0.5, 0.4, 0.1, 0.9, 0.1, 1.0], [0, 3, 5, 6]).round(2).tolist()
    [0.1, 0.8, 1.0]
    """
    p = np.asarray(turn_proba, dtype=float)
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != p.size \
            or np.any(np.diff(offsets) < 1):
        raise ValueError("offsets must start at 0, end at len(turn_proba) and give "
                         "every run at least one turn.")
    out = np.empty(offsets.size - 1)
    for i in range(out.size):
        run = np.sort(p[offsets[i]:offsets[i + 1]])[::-1]
        out[i] = 1.0 if run.size == 1 else run[0] - run[1]
    return out


class CoralAdapter(TurnInputMixin, BaseEstimator):
    """CORAL between a labelled framework and a user's unlabelled one, as a transformer.

    The pre-registered rule (``docs/your-own-framework.md``) adopted CORAL (A2) as
    what skafa does when a user passes unlabelled runs of their framework. Fitted
    on the training runs' features ``X`` and the target runs' features
    ``target_X`` (no labels), it keeps, per site, both frameworks' turn statistics
    and the map that whitens the training turns with their covariance and
    re-colours them with the target's (each regularised by ``regularization``
    times the identity, after standardisation).

    ``fit_transform(X, target_X=...)`` returns the *re-coloured training runs*
    (what the probe is fitted on); ``transform(X)`` of new runs standardises them
    with the *target's* statistics (what the probe is asked about). So
    ``fit_transform`` is not ``fit().transform()``, as for scikit-learn's
    ``TargetEncoder``: the training runs and the runs to attribute come from two
    frameworks.

    Parameters
    ----------
    regularization : float, default=1.0

    Attributes
    ----------
    source_mean_, source_scale_, target_mean_, target_scale_ : ndarray of shape \
            (n_sites, n_features)
    coloring_ : ndarray of shape (n_sites, n_features, n_features)
        Whitening with the source covariance, then re-colouring with the target's.
    sites_ : tuple of str
    n_features_in_ : int
    n_target_runs_ : int

    Examples
    --------
    >>> from skafa.testing import make_site_features
    >>> X, _ = make_site_features(n=30, n_sites=2, signal_site=0, seed=0)
    >>> T = X.with_values(X.values * 3 + 1)
    >>> ad = CoralAdapter()
    >>> Xs = ad.fit_transform(X, target_X=T)
    >>> Xs.sites == X.sites, ad.n_target_runs_
    (True, 30)
    """

    _parameter_constraints = {
        "regularization": [Interval(numbers.Real, 0, None, closed="neither")],
    }

    def __init__(self, *, regularization=1.0):
        self.regularization = regularization

    def _fit(self, X, target_X):
        X = check_turn_features(X, self)
        if target_X is None:  # no other framework: the training runs are the target
            target_X = X
        target_X = check_turn_features(target_X, self)
        Vs, Vt = _dense(X, "X"), _dense(target_X, "target_X")
        if tuple(target_X.sites) != tuple(X.sites) or Vs.shape[1:] != Vt.shape[1:]:
            raise ValueError(f"target_X has sites {list(target_X.sites)} x {Vt.shape[2]} "
                             f"features; X has {list(X.sites)} x {Vs.shape[2]}.")
        self.source_mean_, self.source_scale_ = _moments(Vs)
        self.target_mean_, self.target_scale_ = _moments(Vt)
        eye = self.regularization * np.eye(Vs.shape[2])
        Zs = (Vs - self.source_mean_) / self.source_scale_
        Zt = (Vt - self.target_mean_) / self.target_scale_
        self.coloring_ = np.stack([
            _sqrtm(np.cov(Zs[:, j], rowvar=False) + eye, inverse=True)
            @ _sqrtm(np.cov(Zt[:, j], rowvar=False) + eye) for j in range(Vs.shape[1])])
        self.sites_ = tuple(X.sites)
        self.n_features_in_ = int(Vs.shape[2])
        self.n_target_runs_ = int(target_X.n_conversations)
        return Zs

    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None, target_X=None):
        """Learn both frameworks' statistics and the CORAL map.

        Parameters
        ----------
        X : TurnFeatures
            The training runs' features.
        y : ignored
        target_X : TurnFeatures, optional
            Features of unlabelled runs of the target framework; None: ``X`` itself
            (no adaptation: the map is the identity on standardised features).

        Returns
        -------
        self : CoralAdapter
        """
        self._fit(X, target_X)
        return self

    def fit_transform(self, X, y=None, target_X=None):
        """Fit, and return the training runs re-coloured (what a probe is fitted on).

        Parameters
        ----------
        X : TurnFeatures
        y : ignored
        target_X : TurnFeatures

        Returns
        -------
        TurnFeatures
        """
        self._validate_params()
        Zs = self._fit(X, target_X)
        X = check_turn_features(X, self)
        out = np.einsum("tsf,sfg->tsg", Zs, self.coloring_)
        return X.with_values(out.reshape(np.shape(X.values)))

    def transform(self, X):
        """Standardise runs of the target framework with its statistics.

        Parameters
        ----------
        X : TurnFeatures
            Any subset of the fitted sites, in any order.

        Returns
        -------
        TurnFeatures
        """
        check_is_fitted(self)
        X = check_turn_features(X, self)
        V = _dense(X, "X")
        missing = [s for s in X.sites if s not in self.sites_]
        if missing or V.shape[2] != self.n_features_in_:
            raise ValueError(f"X has sites {list(X.sites)} x {V.shape[2]} features; the "
                             f"adapter was fitted on {list(self.sites_)} x "
                             f"{self.n_features_in_}.")
        # any subset of the fitted sites (a predictor reading only its own sites)
        idx = [self.sites_.index(s) for s in X.sites]
        out = (V - self.target_mean_[idx]) / self.target_scale_[idx]
        return X.with_values(out.reshape(np.shape(X.values)))
