"""Listwise (conditional-logit) probe: a softmax over the turns of each run."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import warnings
from numbers import Integral, Real

import numpy as np
import scipy.sparse as sp
from scipy.optimize import minimize
from sklearn.exceptions import ConvergenceWarning
from sklearn.preprocessing import StandardScaler

from ..utils.grouped import grouped_logsumexp
from ..utils.progress import log
from ..utils.sklearn_compat import Interval, check_sample_weight, fit_context
from ..utils.validation import check_steps
from ._base import _BaseGroupedArgmax

__all__ = ["GroupedSoftmaxClassifier"]


def _softmax_objective(w, Z, offsets, target, alpha, weight=None):
    """Mean conditional-logit loss plus ``alpha / 2 * ||w||^2``, and its gradient.

    ``Z`` holds the turn rows (dense or sparse), ``offsets`` the conversation
    boundaries and ``target`` the row index of each decisive turn. With
    ``p = softmax(Z @ w)`` within each conversation and ``E`` the one-hot rows of
    the decisive turns, the gradient of the mean loss is ``Z.T @ (p - E) / n``.
    ``weight`` (one per conversation) weighs each conversation's loss.
    """
    n = offsets.size - 1
    z = np.asarray(Z @ w, dtype=np.float64).ravel()
    lse = grouped_logsumexp(z, offsets)
    nll = lse - z[target]
    residual = np.exp(z - np.repeat(lse, np.diff(offsets)))
    residual[target] -= 1.0
    if weight is not None:
        nll = nll * weight
        residual *= np.repeat(weight, np.diff(offsets))
    loss = nll.sum() / n + 0.5 * alpha * (w @ w)
    grad = np.asarray(Z.T @ residual, dtype=np.float64).ravel() / n + alpha * w
    return loss, grad


class GroupedSoftmaxClassifier(_BaseGroupedArgmax):
    """Listwise (conditional-logit) probe: a softmax over the turns of each run.

    Each conversation has exactly one decisive turn, so the model scores every
    turn linearly, ``s_t = x_t @ w``, and treats the softmax of those scores
    over the turns of a conversation as the probability that each turn is the
    decisive one. The weights maximise the penalised likelihood of the
    observed decisive turns. Unlike :class:`GroupedArgmaxLogisticClassifier`,
    which separates decisive from other turn rows pooled over all
    conversations, only differences *between turns of the same conversation*
    enter the model; the predicted step is the highest-scoring turn (earliest
    on ties).

    Parameters
    ----------
    C : float, default=1.0
        Inverse of the L2 regularization strength (see Notes for the exact
        objective). Large values leave the likelihood nearly unpenalised.
    standardize : bool, default=True
        Divide every feature by its standard deviation over the training turn
        rows (:class:`~sklearn.preprocessing.StandardScaler` with
        ``with_mean=False``) before fitting, so that ``C`` penalises all
        features alike. Centring is omitted on purpose: it adds the same
        constant to every turn score of a conversation, which the softmax
        ignores. ``coef_`` is reported in the original units either way.
    max_iter : int, default=1000
        Maximum number of L-BFGS iterations.
    tol : float, default=1e-4
        L-BFGS stops when the largest absolute component of the gradient of the
        scaled objective (see Notes) falls below ``tol``.
    site : str or int, default=None
        Site block of ``X`` to read; see :class:`GroupedArgmaxClassifier`.
    verbose : int, default=0
        With a positive value, print the objective every ``verbose``
        iterations and a summary line at the end.

    Attributes
    ----------
    coef_ : ndarray or scipy.sparse CSR matrix of shape (1, n_features)
        Weights in the *original* (unstandardized) feature space: the turn
        score is ``x @ coef_.T``. There is no intercept: a constant
        added to every turn of a conversation cancels in the softmax. Fitted on
        sparse features, a CSR row whose entries are the ``active_features_``
        (the penalised weight of a column that is zero in every training turn is
        exactly zero).
    active_features_ : ndarray of int or None
        Columns of sparse training features that hold a value in some training
        turn: the model is fitted on those only, so memory and time follow the
        data, not the declared column count. ``None`` for dense features.
    scaler_ : StandardScaler or None
        The fitted scaler (``with_mean=False``), ``None`` when
        ``standardize=False``; after a sparse fit it covers ``active_features_``.
    n_iter_ : ndarray of shape (1,)
        Number of L-BFGS iterations run.
    objective_ : float
        Final value of the scaled objective (see Notes).
    response_method_ : str
        Always ``"decision_function"`` (the turn scores are logits).
    site_ : str
        Name of the site block used in ``fit``.
    n_features_in_ : int
        Number of features per turn.

    See Also
    --------
    GroupedArgmaxLogisticClassifier : Pointwise (per-turn binary) probe.
    skafa.SiteSelector : Choose the site by grouped cross-validation.

    Notes
    -----
    With ``z_i`` the standardized turn rows of conversation ``i`` (all
    ``n`` training conversations), ``y_i`` its decisive turn and
    ``NLL_i(w) = log(sum_t exp(z_i[t] @ w)) - z_i[y_i] @ w``, the fitted weights
    minimise, as in scikit-learn's ``LogisticRegression``::

        0.5 * ||w||^2  +  C * sum_{i=1..n} NLL_i(w)

    The solver (:func:`scipy.optimize.minimize`, ``method="L-BFGS-B"``, with
    the exact gradient) works on the same objective divided by ``C * n``, the
    mean loss plus ``||w||^2 / (2 C n)``, so that ``tol`` does not depend on
    the number of conversations; ``objective_`` is that scaled value. The
    log-sum-exp is computed stably and the model is fitted in float64.

    Conversations with a single turn contribute nothing (their only turn has
    probability one whatever the weights). A feature that is constant within
    every conversation (for example the conversation's length) gets weight
    zero: it cannot tell turns of a conversation apart.

    :meth:`turn_predict_proba` returns the model's own softmax, which sums to
    one over the turns of each conversation.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> from skafa.probes import GroupedSoftmaxClassifier
    >>> rng = np.random.default_rng(0)
    >>> offsets = np.arange(0, 41, 4)             # 10 conversations x 4 turns
    >>> values = rng.normal(size=(40, 3))
    >>> y = rng.integers(0, 4, size=10)
    >>> values[offsets[:-1] + y, 0] += 5.0        # the decisive turn stands out
    >>> X = TurnFeatures(values, offsets)
    >>> probe = GroupedSoftmaxClassifier(C=10.0).fit(X, y)
    >>> probe.score(X, y)
    1.0
    >>> proba = probe.turn_predict_proba(X)
    >>> bool(np.allclose([p.sum() for p in proba], 1.0))
    True
    """

    _compacts_sparse_columns = True

    _parameter_constraints: dict = {
        **_BaseGroupedArgmax._parameter_constraints,
        "C": [Interval(Real, 0, None, closed="neither")],
        "standardize": ["boolean"],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "verbose": ["verbose"],
    }

    def __init__(self, *, C=1.0, standardize=True, max_iter=1000, tol=1e-4, site=None,
                 verbose=0):
        self.C = C
        self.standardize = standardize
        self.max_iter = max_iter
        self.tol = tol
        self.site = site
        self.verbose = verbose

    def _design(self, M, *, fitting, row_weight=None):
        """Turn rows as float64, divided by the training standard deviations."""
        if sp.issparse(M):
            M = sp.csr_matrix(M, dtype=np.float64)
        else:
            M = np.asarray(M, dtype=np.float64)
        if fitting:
            self.scaler_ = (
                StandardScaler(with_mean=False).fit(M, sample_weight=row_weight)
                if self.standardize else None
            )
        return M if self.scaler_ is None else self.scaler_.transform(M)

    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, groups=None, sample_weight=None):
        """Fit the conditional-logit model by L-BFGS.

        Parameters
        ----------
        X : TurnFeatures
            Per-turn features; one entry per conversation. With several sites,
            ``site`` selects the block to read.
        y : array-like of int, shape (n_conversations,)
            Index of the decisive turn of each conversation.
        groups : array-like, default=None
            Ignored; accepted so every conversation-level estimator shares
            ``fit(X, y, groups=None)`` (groups only feed splitters).
        sample_weight : array-like of shape (n_conversations,), default=None
            Weight of each conversation's loss (and of its turn rows in the
            scaler); an integer weight is the same as repeating the conversation.

        Returns
        -------
        self : object
            Fitted estimator.
        """
        X, site, M = self._turn_matrix(X, fitting=True)
        y = check_steps(y, X)
        if sample_weight is not None:
            sample_weight = check_sample_weight(sample_weight, np.empty(len(X)))
        if np.all(X.n_turns == 1):
            raise ValueError(
                f"{type(self).__name__}: every one of the {len(X)} training conversations "
                "has a single turn (its decisive step can only be turn 0), so there is no "
                "choice between turns to learn from; provide conversations with at least "
                "two turns."
            )
        n_features = int(M.shape[1])
        M, self.active_features_ = self._fit_columns(M)
        Z = self._design(M, fitting=True, row_weight=None if sample_weight is None
                         else np.repeat(sample_weight, X.n_turns))
        target = X.global_turn_index(y)
        offsets = X.offsets
        alpha = 1.0 / (self.C * X.n_conversations)

        callback = None
        if self.verbose:
            state = {"it": 0}

            def callback(intermediate_result):
                state["it"] += 1
                if state["it"] % int(self.verbose) == 0:
                    log(self, 1, f"iteration {state['it']:4d}: "
                                 f"objective={intermediate_result.fun:.6g}")

        result = minimize(
            _softmax_objective,
            np.zeros(Z.shape[1], dtype=np.float64),
            args=(Z, offsets, target, alpha, sample_weight),
            method="L-BFGS-B",
            jac=True,
            callback=callback,
            options={
                "maxiter": int(self.max_iter),
                "gtol": float(self.tol),
                "ftol": 64 * np.finfo(np.float64).eps,
                "maxls": 50,
            },
        )
        if not result.success:
            warnings.warn(
                f"GroupedSoftmaxClassifier: L-BFGS did not converge in {result.nit} "
                f"iterations ({result.message}). Increase max_iter, raise tol, or "
                "lower C.",
                ConvergenceWarning,
            )
        log(self, 1, f"{result.nit} iterations, objective={result.fun:.6g}, "
                     f"converged={bool(result.success)}")

        w = np.asarray(result.x, dtype=np.float64)
        if self.scaler_ is not None:
            w = w / self.scaler_.scale_
        self.n_features_in_ = n_features
        self.coef_ = self._widen_coef(w)
        self.n_iter_ = np.array([result.nit], dtype=np.int32)
        self.objective_ = float(result.fun)
        self.response_method_ = "decision_function"
        self.site_ = site
        return self

    def _raw_turn_scores(self, M):
        w = self.coef_
        if sp.issparse(w):  # a compacted fit: the weights of the active columns
            w = self._active_columns(w).toarray()
        scores = self._active_columns(M) @ np.asarray(w).ravel()
        return np.asarray(scores, dtype=np.float64).ravel()
