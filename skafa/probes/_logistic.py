"""Standardized logistic-regression probe (the package's default model)."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from numbers import Integral, Real

import numpy as np
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from ..utils.sklearn_compat import Interval, StrOptions
from ._base import _BaseGroupedArgmax

__all__ = ["GroupedArgmaxLogisticClassifier"]


class GroupedArgmaxLogisticClassifier(_BaseGroupedArgmax):
    """Standardized logistic-regression probe that picks the decisive turn.

    The turn rows are standardized with statistics of the training turns
    (``StandardScaler``; ``with_mean=False`` for sparse input) and a
    :class:`~sklearn.linear_model.LogisticRegression` separates decisive from
    other turns. The step predicted for a conversation is its highest-scoring
    turn (earliest on ties). This is :class:`GroupedArgmaxClassifier` with a
    fixed, tuned-by-parameter turn model.

    Parameters
    ----------
    C : float, default=1.0
        Inverse of the L2 regularization strength.
    class_weight : dict, "balanced" or None, default="balanced"
        Weights of the turn classes; ``"balanced"`` compensates for there
        being one decisive turn per conversation.
    standardize : bool, default=True
        Standardize turn rows before the logistic regression.
    max_iter : int, default=1000
        Maximum number of solver iterations.
    tol : float, default=1e-4
        Stopping tolerance.
    solver : {"lbfgs", "liblinear", "newton-cg", "newton-cholesky", "sag", \
            "saga"}, default="lbfgs"
        Solver of the logistic regression.
    random_state : int, RandomState instance or None, default=None
        Used by the "sag", "saga" and "liblinear" solvers.
    site : str or int, default=None
        Site block of ``X`` to read; see :class:`GroupedArgmaxClassifier`.

    Attributes
    ----------
    estimator_ : Pipeline or LogisticRegression
        The fitted turn model (scaler + logistic regression when
        ``standardize=True``); after a sparse fit it reads the columns
        ``active_features_`` only.
    scaler_ : StandardScaler or None
        The fitted scaler, ``None`` when ``standardize=False``.
    coef_ : ndarray or scipy.sparse CSR matrix of shape (1, n_features)
        Weights in the *original* (unstandardized) feature space, so that the
        turn score is ``x @ coef_.T + intercept_[0]``. Fitted on sparse
        features, a CSR row (as ``LogisticRegression.sparsify()`` gives) whose
        entries are the ``active_features_``: the L2-penalised weight of a column
        that is zero in every training turn is exactly zero.
    active_features_ : ndarray of int or None
        Columns of sparse training features that hold a value in some training
        turn: the turn model is fitted on those only, so memory and time follow
        the data, not the declared column count. ``None`` for dense features.
    intercept_ : ndarray of shape (1,)
        Intercept in the original feature space.
    n_iter_ : ndarray of shape (1,)
        Solver iterations.
    response_method_ : str
        Always ``"decision_function"``.
    site_ : str
        Name of the site block used in ``fit``.
    n_features_in_ : int
        Number of features per turn.
    feature_names_in_ : ndarray of str
        Feature names of ``X`` in ``fit``, when it has them; ``predict`` refuses
        features whose names differ (other names, or the same in another order).

    See Also
    --------
    GroupedArgmaxClassifier : The same with any binary estimator.
    skafa.SiteSelector : Choose the site by grouped cross-validation.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> from skafa.probes import GroupedArgmaxLogisticClassifier
    >>> rng = np.random.default_rng(0)
    >>> offsets = np.arange(0, 41, 4)
    >>> values = rng.normal(size=(40, 3))
    >>> y = rng.integers(0, 4, size=10)
    >>> values[offsets[:-1] + y, 0] += 5.0
    >>> probe = GroupedArgmaxLogisticClassifier().fit(TurnFeatures(values, offsets), y)
    >>> probe.predict(TurnFeatures(values, offsets)).tolist() == y.tolist()
    True
    """

    _squares_features = True
    _compacts_sparse_columns = True

    _parameter_constraints: dict = {
        **_BaseGroupedArgmax._parameter_constraints,
        "C": [Interval(Real, 0, None, closed="neither")],
        "class_weight": [dict, StrOptions({"balanced"}), None],
        "standardize": ["boolean"],
        "max_iter": [Interval(Integral, 0, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "solver": [
            StrOptions(
                {"lbfgs", "liblinear", "newton-cg", "newton-cholesky", "sag", "saga"}
            )
        ],
        "random_state": ["random_state"],
    }

    def __init__(
        self,
        *,
        C=1.0,
        class_weight="balanced",
        standardize=True,
        max_iter=1000,
        tol=1e-4,
        solver="lbfgs",
        random_state=None,
        site=None,
    ):
        self.C = C
        self.class_weight = class_weight
        self.standardize = standardize
        self.max_iter = max_iter
        self.tol = tol
        self.solver = solver
        self.random_state = random_state
        self.site = site

    def _make_turn_estimator(self, M):
        # ``penalty`` is deprecated in scikit-learn 1.8; the default l1_ratio=0 is
        # the L2 penalty, so it is simply not passed.
        logistic = LogisticRegression(
            C=self.C,
            class_weight=self.class_weight,
            max_iter=self.max_iter,
            tol=self.tol,
            solver=self.solver,
            random_state=self.random_state,
        )
        if not self.standardize:
            return logistic
        scaler = StandardScaler(with_mean=not sp.issparse(M))
        return Pipeline([("scaler", scaler), ("logistic", logistic)])

    def _fit_turn_estimator(self, estimator, M, labels, row_weight):
        if row_weight is None or not self.standardize:
            super()._fit_turn_estimator(estimator, M, labels, row_weight)
            return
        # Fit the steps one by one: weights reach the scaler and the logistic
        # regression whether or not metadata routing is enabled.
        scaler, logistic = (step for _, step in estimator.steps)
        Z = scaler.fit(M, sample_weight=row_weight).transform(M)
        logistic.fit(Z, labels, sample_weight=row_weight)

    def _after_fit(self, M):
        if self.standardize:
            self.scaler_ = self.estimator_.named_steps["scaler"]
            logistic = self.estimator_.named_steps["logistic"]
            scale = self.scaler_.scale_
            mean = (
                self.scaler_.mean_
                if self.scaler_.with_mean
                else np.zeros_like(scale)
            )
            coef = logistic.coef_ / scale
            self.coef_ = self._widen_coef(coef)
            self.intercept_ = logistic.intercept_ - coef @ mean
        else:
            self.scaler_ = None
            logistic = self.estimator_
            self.coef_ = self._widen_coef(logistic.coef_.copy())
            self.intercept_ = logistic.intercept_.copy()
        self.n_iter_ = logistic.n_iter_
