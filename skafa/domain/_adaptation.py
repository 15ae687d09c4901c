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

from ..features import TurnFeatures

__all__ = ["coral", "label_priority", "standardize_per_framework"]


def _dense(X, name):
    if not isinstance(X, TurnFeatures):
        raise TypeError(f"{name} must be TurnFeatures, got {type(X).__name__}.")
    if X.is_sparse:
        raise TypeError(f"{name} holds sparse features; adaptation reads dense ones.")
    values = np.asarray(X.values, dtype=np.float64)
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
    S = standardize_per_framework(X_source)
    T = standardize_per_framework(X_target)
    Vs, Vt = _dense(S, "X_source"), _dense(T, "X_target")
    if Vs.shape[1:] != Vt.shape[1:]:
        raise ValueError(f"X_source has {Vs.shape[1]} site(s) x {Vs.shape[2]} features; "
                         f"X_target has {Vt.shape[1]} x {Vt.shape[2]}.")
    out = np.empty_like(Vs)
    eye = regularization * np.eye(Vs.shape[2])
    for j in range(Vs.shape[1]):
        Cs = np.cov(Vs[:, j], rowvar=False) + eye
        Ct = np.cov(Vt[:, j], rowvar=False) + eye
        out[:, j] = Vs[:, j] @ _sqrtm(Cs, inverse=True) @ _sqrtm(Ct)
    return S.with_values(out.reshape(np.shape(S.values))), T


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
