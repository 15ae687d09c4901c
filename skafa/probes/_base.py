"""Shared base of the grouped-argmax probes: flatten turns, score, argmax per conversation."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from numbers import Integral

import numpy as np
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

