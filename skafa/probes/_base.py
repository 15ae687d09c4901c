"""Shared base of the grouped-argmax probes: flatten turns, score, argmax per conversation."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from numbers import Integral

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator
from sklearn.utils import metadata_routing
from sklearn.utils.validation import check_is_fitted, has_fit_parameter

from ..base import DecisiveStepMixin
from ..features import check_turn_features
from ..utils.grouped import grouped_normalise, grouped_softmax
from ..utils.sklearn_compat import check_sample_weight, fit_context
from ..utils.validation import (
    check_feature_names,
    check_finite_rows,
    check_steps,
    describe,
    locate_row,
)


def _used_columns(M):
    """Sorted indices of the columns of sparse ``M`` that hold a stored entry.

    O(nnz): never an array per declared column, which a hostile or careless
    ``shape`` (a hashing vectorizer's 2**26 columns) would make huge.
    """
    return np.unique(sp.csr_matrix(M).indices).astype(np.int64)


def _restrict_columns(M, columns):
    """``M`` restricted to the sorted ``columns`` (entries elsewhere are dropped).

    Sparse input is remapped in O(nnz log k) without scipy's column indexing,
    which allocates an array per declared column; dense input is indexed.
    """
    if not sp.issparse(M):
        return np.asarray(M)[:, columns]
    M = sp.csr_matrix(M)
    idx = M.indices
    pos = np.searchsorted(columns, idx)
    if columns.size:
        hit = columns[np.minimum(pos, columns.size - 1)] == idx
    else:
        hit = np.zeros(idx.shape, dtype=bool)
    indptr = np.concatenate(([0], np.cumsum(hit)))[M.indptr]
    return sp.csr_matrix((M.data[hit], pos[hit], indptr),
                         shape=(M.shape[0], columns.size))


class _BaseGroupedArgmax(DecisiveStepMixin, BaseEstimator):
    """Shared logic: flatten turns, fit a binary model, argmax per conversation.

    Subclasses provide ``_make_turn_estimator(M)`` returning an unfitted binary
    estimator for the 2-D turn matrix ``M``, and may extend ``_after_fit``. A
    subclass that fits its own turn model instead (:class:`GroupedSoftmaxClassifier`)
    overrides ``fit`` and ``_raw_turn_scores`` and reuses the rest (site handling,
    input checks). ``predict``, ``predict_agent``, ``score``, the ``turn_*``
    methods and the tags come from :class:`skafa.base.DecisiveStepMixin`, on top of
    ``_turn_scores`` and ``_turn_proba``.
    """

    # ``groups`` is in the signature of ``fit`` for API uniformity only; marking it
    # UNUSED keeps metadata routing from complaining that it was never requested.
    __metadata_request__fit = {"groups": metadata_routing.UNUSED}

    _parameter_constraints: dict = {"site": [str, Integral, None]}

    #: Whether the turn model squares features (standardization, logistic loss), so
    #: values too large to square are refused in ``fit`` with their place named.
    _squares_features = False

    #: Whether sparse turn rows are fitted on the columns that hold a value only
    #: (``active_features_``). True for the linear probes, whose L2-penalised
    #: weight on a column that is zero in every training row is exactly zero; an
    #: arbitrary turn estimator may depend on the column count, so it sees all.
    _compacts_sparse_columns = False

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

    def _fit_columns(self, M):
        """The matrix the turn model is fitted on, and ``active_features_``.

        Sparse input to a linear probe keeps the columns that hold a value in
        the training rows: memory and time follow the data, not the declared
        column count. Dense input (already allocated in full) is kept as is.
        """
        if not (self._compacts_sparse_columns and sp.issparse(M)):
            return M, None
        columns = _used_columns(M)
        if columns.size == 0 and M.shape[1]:  # no value anywhere: one (empty) column
            columns = np.zeros(1, dtype=np.int64)
        return _restrict_columns(M, columns), columns

    def _active_columns(self, M):
        """``M`` restricted to ``active_features_`` when ``fit`` compacted it."""
        columns = getattr(self, "active_features_", None)
        return M if columns is None else _restrict_columns(M, columns)

    def _widen_coef(self, coef):
        """Weights of the active columns as a ``(1, n_features_in_)`` row.

        Dense when every column was fitted; after a compacted (sparse) fit a CSR
        row holding the active columns, as ``LogisticRegression.sparsify()``
        gives, so a huge declared column count costs nothing.
        """
        coef = np.asarray(coef, dtype=np.float64).reshape(1, -1)
        columns = getattr(self, "active_features_", None)
        if columns is None:
            return coef
        return sp.csr_matrix((coef.ravel(), columns.copy(), np.array([0, columns.size])),
                             shape=(1, self.n_features_in_))

    def _check_fitted_consistency(self):
        """Check that a loaded probe's fitted pieces agree (see :mod:`skafa.persistence`).

        ``active_features_`` (after a compacted sparse fit) must be sorted, unique
        column indices below ``n_features_in_``; the turn model ``estimator_`` and
        the ``scaler_`` must have been fitted on as many features as the probe
        gives them: ``len(active_features_)`` after a compacted fit, else
        ``n_features_in_``. A file edited otherwise is refused at load instead of
        scoring the wrong columns at predict.

        Raises
        ------
        ValueError
            Naming the attributes that disagree and their values.
        """
        state = vars(self)
        n = state.get("n_features_in_")
        if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)):
            return  # absent (not fitted); a wrong type is refused by the loader's checks
        n = int(n)
        width, reads = n, f"n_features_in_ is {n}"
        active = state.get("active_features_")
        if active is not None:
            columns = np.asarray(active)
            if columns.ndim != 1 or (columns.size and columns.dtype.kind not in "iu"):
                raise ValueError(
                    f"active_features_ must be a 1-D array of column indices, got a "
                    f"{columns.dtype} array of shape {columns.shape}")
            outside = columns[(columns < 0) | (columns >= n)]
            if outside.size:
                raise ValueError(
                    f"active_features_ names column {int(outside[0])} but n_features_in_ "
                    f"is {n} (columns 0..{n - 1})")
            steps = np.flatnonzero(np.diff(columns) <= 0)
            if steps.size:
                k = int(steps[0])
                raise ValueError(
                    f"active_features_ must be sorted and unique, but entry {k} is "
                    f"{int(columns[k])} and entry {k + 1} is {int(columns[k + 1])} "
                    f"(columns {int(columns[k])}, {int(columns[k + 1])})")
            width = int(columns.size)
            reads = (f"active_features_ names {width} columns (the columns of "
                     f"n_features_in_ {n} that the compacted fit kept)")
        for name in ("estimator_", "scaler_"):
            step = state.get(name)
            if step is None:
                continue
            try:
                got = step.n_features_in_
            except AttributeError:  # a turn model that does not say
                continue
            if isinstance(got, (int, np.integer)) and int(got) != width:
                raise ValueError(
                    f"{name} ({type(step).__name__}) was fitted on {int(got)} features "
                    f"but the probe gives it {width}: {reads}")

    def _raw_turn_scores(self, M):
        M = self._active_columns(M)
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
                f"{type(self).__name__}: every one of the {len(X)} training conversations "
                "has a single turn (its decisive step can only be turn 0), so there is no "
                "negative (non-decisive) turn to learn from; provide conversations with "
                "at least two turns."
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
        n_features = int(M.shape[1])
        M, active = self._fit_columns(M)
        if self._compacts_sparse_columns:
            self.active_features_ = active
        self._fit_turn_estimator(estimator, M, labels, row_weight)

        self.estimator_ = estimator
        self.response_method_ = response_method
        self.site_ = site
        self.n_features_in_ = n_features
        self._after_fit(M)
        return self

    def _turn_proba(self, scores, offsets):
        """Per-turn scores to per-conversation probabilities.

        With a ``decision_function`` the scores are turned into a distribution
        over the turns of each conversation by a softmax. With ``predict_proba``
        the per-turn positive-class probabilities are renormalised to sum to one
        (the softmax of their logarithms), uniform when they are all zero. The
        argmax is the predicted step in both cases.
        """
        if self.response_method_ == "decision_function":
            return grouped_softmax(scores, offsets)
        return grouped_normalise(scores, offsets)

