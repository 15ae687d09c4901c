"""Probe estimators over ragged per-turn features.

One sample is one conversation: ``X`` is a :class:`~skafa.TurnFeatures` (one entry
per conversation, several turn rows each) and ``y[i]`` is the index of the decisive
turn of conversation ``i``. The estimators here turn that ranking problem into a
binary problem on turn rows (label 1 at the decisive turn, 0 elsewhere), fit any
scikit-learn binary classifier on the rows, and predict, per conversation, the turn
with the highest score.

- :class:`GroupedArgmaxClassifier` wraps any binary estimator.
- :class:`GroupedArgmaxLogisticClassifier` is the standardized logistic-regression
  probe (the default model of the package).
- :class:`GroupedSoftmaxClassifier` is the listwise alternative: a conditional-logit
  model fitted to the task itself (one decisive turn per conversation, a softmax
  over its turns) instead of a binary problem on turn rows.

These are deliberately *not* scikit-learn classifiers: there is no fixed label set
(the label is a position inside each conversation), so they define no ``classes_``,
no ``decision_function``/``predict_proba`` with ``n_samples`` rows, and their
``estimator_type`` tag is ``None``. With an int ``cv`` scikit-learn therefore uses
``KFold``, not ``StratifiedKFold`` on step indices; pass a ``GroupKFold`` with task-id
``groups`` for honest estimates.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import warnings
from numbers import Integral, Real

import numpy as np
import scipy.sparse as sp
from scipy.optimize import minimize
from sklearn.base import BaseEstimator, MetaEstimatorMixin, clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils import metadata_routing
from sklearn.utils.validation import check_is_fitted, has_fit_parameter

from ..features import agents_at, check_turn_features
from ..utils.grouped import (
    grouped_argmax,
    grouped_logsumexp,
    grouped_normalise,
    grouped_softmax,
)
from ..utils.sklearn_compat import (
    HasMethods,
    Interval,
    StrOptions,
    check_sample_weight,
    fit_context,
)
from ..utils.validation import (
    check_feature_names,
    check_finite_rows,
    check_steps,
    describe,
    locate_row,
    mean_hits,
)

__all__ = [
    "GroupedArgmaxClassifier",
    "GroupedArgmaxLogisticClassifier",
    "GroupedSoftmaxClassifier",
]


# ---------------------------------------------------------------------------
# Grouped argmax probes
# ---------------------------------------------------------------------------


class _BaseGroupedArgmax(BaseEstimator):
    """Shared logic: flatten turns, fit a binary model, argmax per conversation.

    Subclasses provide ``_make_turn_estimator(M)`` returning an unfitted binary
    estimator for the 2-D turn matrix ``M``, and may extend ``_after_fit``. A
    subclass that fits its own turn model instead (:class:`GroupedSoftmaxClassifier`)
    overrides ``fit`` and ``_raw_turn_scores`` and reuses the rest (site handling,
    input checks, ``predict``, ``turn_*`` methods, ``score``).
    """

    # ``groups`` is in the signature of ``fit`` for API uniformity only; marking it
    # UNUSED keeps metadata routing from complaining that it was never requested.
    __metadata_request__fit = {"groups": metadata_routing.UNUSED}

    _parameter_constraints: dict = {"site": [str, Integral, None]}

    #: Whether the turn model squares features (standardization, logistic loss), so
    #: values too large to square are refused in ``fit`` with their place named.
    _squares_features = False

    def _make_turn_estimator(self, M):  # pragma: no cover - abstract
        raise NotImplementedError

    def _after_fit(self, M):
        """Hook for subclasses to expose fitted attributes of ``estimator_``."""

    def _fit_turn_estimator(self, estimator, M, labels, row_weight):
        """Fit the turn estimator on the rows, with per-row weights when given."""
        if row_weight is None:
            estimator.fit(M, labels)
            return
        if not has_fit_parameter(estimator, "sample_weight"):
            raise TypeError(
                f"sample_weight was given but the turn estimator {estimator!r} does not "
                "accept sample_weight in fit."
            )
        estimator.fit(M, labels, sample_weight=row_weight)

    # ------------------------------------------------------------------ helpers
    def _site_for_fit(self, X):
        if self.site is None:
            if X.n_sites != 1:
                raise ValueError(
                    f"X holds {X.n_sites} sites ({', '.join(X.sites[:4])}"
                    f"{', ...' if X.n_sites > 4 else ''}) and {type(self).__name__}"
                    "(site=None) does not know which one to read. Select a site with "
                    "X.select_sites(name), set site=..., or let skafa.SiteSelector "
                    "choose by cross-validation."
                )
            return X.sites[0]
        if isinstance(self.site, Integral):
            try:
                return X.sites[int(self.site)]
            except IndexError:
                raise ValueError(
                    f"site={self.site} is out of range; X holds {X.n_sites} sites."
                ) from None
        if self.site not in X.sites:
            raise ValueError(
                f"site={self.site!r} is not in X; available sites: {list(X.sites)}."
            )
        return self.site

    def _turn_matrix(self, X, *, fitting):
        X = check_turn_features(X, self)
        if fitting:
            site = self._site_for_fit(X)
        else:
            site = self.site_
            if site not in X.sites:
                raise ValueError(
                    f"{type(self).__name__} was fitted on site {site!r}, which X does "
                    f"not hold (X has {list(X.sites)}). Predict on features from the "
                    "same site."
                )
        M = X.turn_matrix(site)
        if not fitting and M.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {M.shape[1]} features per turn at site {site!r}, but "
                f"{type(self).__name__} was fitted with {self.n_features_in_}."
            )
        check_finite_rows(X, M, site, squared=fitting and self._squares_features)
        check_feature_names(self, X, reset=fitting)
        return X, site, M

    def _raw_turn_scores(self, M):
        if self.response_method_ == "decision_function":
            scores = np.asarray(self.estimator_.decision_function(M), dtype=np.float64)
        else:
            proba = np.asarray(self.estimator_.predict_proba(M), dtype=np.float64)
            col = int(np.flatnonzero(np.asarray(self.estimator_.classes_) == 1)[0])
            scores = proba[:, col]
        if scores.ndim != 1 or scores.shape[0] != M.shape[0]:
            raise ValueError(
                f"the turn estimator returned scores of shape {scores.shape} for "
                f"{M.shape[0]} turn rows; expected one score per turn."
            )
        return scores

    def _turn_scores(self, X):
        """Validated per-turn scores over all turn rows of ``X``."""
        check_is_fitted(self)
        X, site, M = self._turn_matrix(X, fitting=False)
        scores = self._raw_turn_scores(M)
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            conv, turn = locate_row(X, int(bad[0]))
            raise ValueError(
                f"the turn estimator produced a non-finite score ({scores[bad[0]]}) "
                f"for {describe(X, conv)}, turn {turn}, site {site!r}; "
                "refusing to pick a step from it."
            )
        return X, scores

    # ---------------------------------------------------------------------- API
    @fit_context(
        # the wrapped estimator is validated when it is fitted
        prefer_skip_nested_validation=False
    )
    def fit(self, X, y, groups=None, sample_weight=None):
        """Fit the turn-level binary model.

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
            Conversation weights: every turn row of conversation ``i`` gets weight
            ``sample_weight[i]`` in the turn model's fit (and in the scaler's, for
            :class:`GroupedArgmaxLogisticClassifier`), so an integer weight
            equals repeating the conversation. The turn estimator must accept
            ``sample_weight`` in ``fit``.

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
                "every training conversation has a single turn, so there is no "
                "negative (non-decisive) turn to learn from; provide conversations "
                "with at least two turns."
            )
        labels = np.zeros(X.n_turns_total, dtype=np.int64)
        labels[X.global_turn_index(y)] = 1

        estimator = self._make_turn_estimator(M)
        if hasattr(estimator, "decision_function"):
            response_method = "decision_function"
        elif hasattr(estimator, "predict_proba"):
            response_method = "predict_proba"
        else:
            raise TypeError(
                f"the turn estimator {estimator!r} implements neither "
                "decision_function nor predict_proba, so turns cannot be ranked."
            )
        row_weight = None if sample_weight is None else np.repeat(sample_weight, X.n_turns)
        self._fit_turn_estimator(estimator, M, labels, row_weight)

        self.estimator_ = estimator
        self.response_method_ = response_method
        self.site_ = site
        self.n_features_in_ = int(M.shape[1])
        self._after_fit(M)
        return self

    def turn_decision_function(self, X):
        """Score of every turn, per conversation.

        Scores come from the turn estimator's ``decision_function`` or, when it
        has none, from the probability of the positive class
        (``predict_proba(...)[:, 1]``), see ``response_method_``.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        scores : list of ndarray of shape (n_turns_i,)
            One 1-D float array per conversation.
        """
        X, scores = self._turn_scores(X)
        return X.split_rows(scores)

    def turn_predict_proba(self, X):
        """Probability that each turn is the decisive one, per conversation.

        With a ``decision_function`` the scores are turned into a distribution
        over the turns of each conversation by a softmax. With
        ``predict_proba`` the per-turn positive-class probabilities are
        renormalised to sum to one (the softmax of their logarithms), uniform
        when they are all zero. The argmax is the predicted step in both cases.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        proba : list of ndarray of shape (n_turns_i,)
            One array per conversation, non-negative, summing to 1.
        """
        X, scores = self._turn_scores(X)
        if self.response_method_ == "decision_function":
            proba = grouped_softmax(scores, X.offsets)
        else:
            proba = grouped_normalise(scores, X.offsets)
        return X.split_rows(proba)

    def predict(self, X):
        """Predict the decisive step of every conversation.

        The predicted step is the turn with the highest score; on ties the
        earliest such turn wins.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        steps : ndarray of int, shape (n_conversations,)
        """
        X, scores = self._turn_scores(X)
        return grouped_argmax(scores, X.offsets)

    def predict_agent(self, X):
        """Speaker of the predicted decisive turn of every conversation.

        Parameters
        ----------
        X : TurnFeatures
            Must carry ``speakers`` (TurnActivationTransformer sets them).

        Returns
        -------
        agents : ndarray of object, shape (n_conversations,)
        """
        X = check_turn_features(X, self)
        return agents_at(X, self.predict(X))

    def score(self, X, y, sample_weight=None):
        """Step accuracy: fraction of conversations whose decisive step is found.

        Parameters
        ----------
        X : TurnFeatures
        y : array-like of int, shape (n_conversations,)
        sample_weight : array-like of shape (n_conversations,), default=None
            Conversation weights (a weighted mean of hits).

        Returns
        -------
        score : float
        """
        X = check_turn_features(X, self)
        y = check_steps(y, X)
        return mean_hits(self.predict(X) == y, sample_weight)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # Not a classifier on purpose (see module docstring): estimator_type None.
        tags.target_tags.required = True
        # X is a TurnFeatures (ragged, one entry per conversation): bare arrays and
        # sparse matrices are refused (sparse blocks inside a TurnFeatures are read).
        tags.input_tags.two_d_array = False
        tags.input_tags.sparse = False
        return tags


class GroupedArgmaxClassifier(MetaEstimatorMixin, _BaseGroupedArgmax):
    """Pick the decisive turn of each conversation with any binary classifier.

    Every turn row of the training conversations becomes one binary sample,
    labelled 1 at the decisive turn and 0 elsewhere. A clone of ``estimator`` is
    fitted on those rows; at prediction time each turn is scored and the
    highest-scoring turn of every conversation is the predicted step.

    Despite the name this is not a scikit-learn classifier: the "class" of a
    conversation is a turn position, so there is no ``classes_`` and the
    ``estimator_type`` tag is ``None`` (an int ``cv`` gives ``KFold``). ``score``
    is step accuracy.

    Parameters
    ----------
    estimator : estimator object, default=None
        Binary classifier fitted on the turn rows. It must implement
        ``decision_function`` or ``predict_proba`` (used in that order of
        preference). ``None`` means ``LogisticRegression()``.
    site : str or int, default=None
        Site block of ``X`` to read. May be left to ``None`` when ``X`` holds a
        single site; with several sites use ``X.select_sites(...)``, set this, or
        wrap the estimator in :class:`skafa.SiteSelector`.

    Attributes
    ----------
    estimator_ : estimator object
        The fitted binary turn model.
    response_method_ : {"decision_function", "predict_proba"}
        Which method of ``estimator_`` scores the turns.
    site_ : str
        Name of the site block used in ``fit``; ``predict`` reads the same
        block and raises if ``X`` lacks it.
    n_features_in_ : int
        Number of features per turn.
    feature_names_in_ : ndarray of str
        Feature names of ``X`` in ``fit``, when it has them; ``predict`` refuses
        features whose names differ (other names, or the same in another order).

    See Also
    --------
    GroupedArgmaxLogisticClassifier : Standardized logistic-regression probe.
    skafa.SiteSelector : Choose the site by grouped cross-validation.

    Notes
    -----
    Ties between turns of one conversation go to the earliest turn.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.svm import LinearSVC
    >>> from skafa import TurnFeatures
    >>> from skafa.probes import GroupedArgmaxClassifier
    >>> rng = np.random.default_rng(0)
    >>> offsets = np.arange(0, 41, 4)             # 10 conversations x 4 turns
    >>> values = rng.normal(size=(40, 3))
    >>> y = rng.integers(0, 4, size=10)
    >>> values[offsets[:-1] + y, 0] += 5.0        # the decisive turn stands out
    >>> X = TurnFeatures(values, offsets)
    >>> clf = GroupedArgmaxClassifier(LinearSVC()).fit(X, y)
    >>> clf.score(X, y)
    1.0
    """

    _parameter_constraints: dict = {
        **_BaseGroupedArgmax._parameter_constraints,
        "estimator": [HasMethods(["fit"]), None],
    }

    def __init__(self, estimator=None, *, site=None):
        self.estimator = estimator
        self.site = site

    def _make_turn_estimator(self, M):
        if self.estimator is None:
            return LogisticRegression()
        return clone(self.estimator)


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
        ``standardize=True``).
    scaler_ : StandardScaler or None
        The fitted scaler, ``None`` when ``standardize=False``.
    coef_ : ndarray of shape (1, n_features)
        Weights in the *original* (unstandardized) feature space, so that the
        turn score is ``x @ coef_.ravel() + intercept_[0]``.
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
            self.coef_ = coef
            self.intercept_ = logistic.intercept_ - coef @ mean
        else:
            self.scaler_ = None
            logistic = self.estimator_
            self.coef_ = logistic.coef_.copy()
            self.intercept_ = logistic.intercept_.copy()
        self.n_iter_ = logistic.n_iter_


# ---------------------------------------------------------------------------
# Listwise probe
# ---------------------------------------------------------------------------


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
    coef_ : ndarray of shape (1, n_features)
        Weights in the *original* (unstandardized) feature space: the turn
        score is ``x @ coef_.ravel()``. There is no intercept: a constant
        added to every turn of a conversation cancels in the softmax.
    scaler_ : StandardScaler or None
        The fitted scaler (``with_mean=False``), ``None`` when
        ``standardize=False``.
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
                "every training conversation has a single turn, so there is no "
                "choice between turns to learn from; provide conversations with at "
                "least two turns."
            )
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
                    print(f"[GroupedSoftmaxClassifier] iteration {state['it']:4d}: "
                          f"objective={intermediate_result.fun:.6g}", flush=True)

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
        if self.verbose:
            print(f"[GroupedSoftmaxClassifier] {result.nit} iterations, "
                  f"objective={result.fun:.6g}, converged={bool(result.success)}",
                  flush=True)

        w = np.asarray(result.x, dtype=np.float64)
        if self.scaler_ is not None:
            w = w / self.scaler_.scale_
        self.coef_ = w.reshape(1, -1)
        self.n_iter_ = np.array([result.nit], dtype=np.int32)
        self.objective_ = float(result.fun)
        self.response_method_ = "decision_function"
        self.site_ = site
        self.n_features_in_ = int(M.shape[1])
        return self

    def _raw_turn_scores(self, M):
        scores = M @ self.coef_.ravel()
        return np.asarray(scores, dtype=np.float64).ravel()

    def turn_decision_function(self, X):
        """Logit of every turn, ``x @ coef_.ravel()``, per conversation.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        scores : list of ndarray of shape (n_turns_i,)
            One 1-D float array per conversation.
        """
        return super().turn_decision_function(X)

    def turn_predict_proba(self, X):
        """The model's probability that each turn is the decisive one.

        The softmax of :meth:`turn_decision_function` over the turns of each
        conversation: the distribution the model was fitted to.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        proba : list of ndarray of shape (n_turns_i,)
            One array per conversation, positive, summing to 1.
        """
        return super().turn_predict_proba(X)
