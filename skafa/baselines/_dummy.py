"""Rule-of-thumb decisive-step predictors: the floor every probe has to beat.

:class:`DummyStepClassifier` predicts the first turn, a constant index, the most
frequent index, the most frequent relative position, or a uniformly random turn,
reading no content.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numbers

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state, metadata_routing
from sklearn.utils.validation import check_is_fitted

from ..base import DecisiveStepMixin
from ..conversation import check_conversations
from ..features import TurnFeatures, check_turn_features
from ..utils.sklearn_compat import (
    Interval,
    StrOptions,
    check_sample_weight,
    fit_context,
)
from ..utils.validation import check_steps

__all__ = ["DummyStepClassifier"]


# ------------------------------------------------------------------ dummy classifier
_STRATEGIES = ("first", "constant", "most_frequent", "most_frequent_relative", "uniform")


def _relative_bins(steps, n_turns, n_bins):
    # floor(n_bins * i / (n - 1)) in exact integer arithmetic; 0 for one-turn conversations.
    bins = (np.asarray(steps, dtype=np.int64) * n_bins) // np.maximum(n_turns - 1, 1)
    return np.minimum(bins, n_bins - 1)


class DummyStepClassifier(DecisiveStepMixin, BaseEstimator):
    """Predict the decisive step by a rule that reads no content.

    The floor a failure-attribution model has to beat. Works on a list of
    :class:`~skafa.Conversation` or on a :class:`~skafa.TurnFeatures` (only the
    number of turns, and the speakers for :meth:`predict_agent`, are used).

    Parameters
    ----------
    strategy : {"first", "constant", "most_frequent", "most_frequent_relative", \
            "uniform"}, default="first"
        * ``"first"``: turn 0.
        * ``"constant"``: turn ``constant``. A negative value counts from the end
          (``-1`` is the last turn). The index is clipped into each conversation:
          a conversation with fewer than ``constant + 1`` turns gets its last
          turn, one with fewer than ``-constant`` turns its first.
        * ``"most_frequent"``: the decisive index seen most often in training
          (ties go to the smallest), clipped to each conversation's last turn.
        * ``"most_frequent_relative"``: the relative position ``i / (n - 1)``
          (0 for one-turn conversations) is cut into ``n_bins`` equal bins; the
          bin seen most often in training (ties: smallest) is mapped back, in each
          conversation, to the turn whose relative position is nearest the bin's
          centre (ties: the earlier turn). That turn lies in the bin whenever the
          conversation has a turn there.
        * ``"uniform"``: a turn drawn uniformly from each conversation.
    constant : int, default=None
        The turn index for ``strategy="constant"`` (required there).
    n_bins : int, default=10
        Number of relative-position bins for ``"most_frequent_relative"``.
    random_state : int, RandomState instance or None, default=None
        Seeds ``"uniform"``. With an int, every call of :meth:`predict` draws the
        same steps.

    Attributes
    ----------
    n_train_ : int
        Number of training conversations.
    step_counts_ : ndarray of float
        ``step_counts_[i]``: total weight (number, without ``sample_weight``) of the
        training conversations whose decisive step is ``i``.
    most_frequent_step_ : int
        The most frequent training step (smallest on ties).
    relative_bin_counts_ : ndarray of float, shape (n_bins,)
        Training steps (weights) per relative-position bin.
    most_frequent_bin_ : int
        The most frequent bin (smallest on ties).

    Notes
    -----
    Not a scikit-learn classifier (no ``ClassifierMixin``): one sample is a whole
    conversation and ``score`` is step accuracy. Pass an explicit grouped splitter
    to cross-validation utilities.

    Examples
    --------
    >>> from skafa import Conversation, Turn
    >>> from skafa.baselines import DummyStepClassifier
    >>> convs = [Conversation([Turn("a", "x")] * n) for n in (2, 3, 4)]
    >>> dummy = DummyStepClassifier(strategy="constant", constant=2).fit(convs, [1, 2, 2])
    >>> dummy.predict(convs).tolist(), dummy.score(convs, [1, 2, 2])
    ([1, 2, 2], 1.0)
    """

    # ``groups`` is accepted for API uniformity only (see skafa.probes).
    __metadata_request__fit = {"groups": metadata_routing.UNUSED}

    _parameter_constraints: dict = {
        "strategy": [StrOptions(set(_STRATEGIES))],
        "constant": [numbers.Integral, None],
        "n_bins": [Interval(numbers.Integral, 1, None, closed="left")],
        "random_state": ["random_state"],
    }

    def __init__(self, *, strategy="first", constant=None, n_bins=10, random_state=None):
        self.strategy = strategy
        self.constant = constant
        self.n_bins = n_bins
        self.random_state = random_state

    # ------------------------------------------------------------------ input
    @staticmethod
    def _turn_counts(X):
        if isinstance(X, TurnFeatures):
            return check_turn_features(X, "DummyStepClassifier").n_turns.astype(np.int64)
        convs = check_conversations(X, "DummyStepClassifier")
        return np.asarray([len(c) for c in convs], dtype=np.int64)

    @staticmethod
    def _check_y(X, y, n_turns):
        return check_steps(y, X if isinstance(X, TurnFeatures) else list(X))

    # -------------------------------------------------------------------- fit
    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, groups=None, sample_weight=None):
        """Record the training step distribution.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
            Training conversations.
        y : array-like of int, shape (n_conversations,)
            Decisive step of each conversation.
        groups : array-like, default=None
            Ignored; accepted for API compatibility.
        sample_weight : array-like of shape (n_conversations,), default=None
            Conversation weights of the step and bin counts (``"most_frequent"``
            and ``"most_frequent_relative"``); ``None`` weighs every conversation 1.

        Returns
        -------
        self : DummyStepClassifier
            Fitted estimator.
        """
        if self.strategy == "constant" and (
                self.constant is None or isinstance(self.constant, bool)):
            raise ValueError(
                "DummyStepClassifier: strategy='constant' needs an int constant "
                f"(a turn index; negative counts from the end), got {self.constant!r}."
            )
        n_turns = self._turn_counts(X)
        y = self._check_y(X, y, n_turns)
        weights = (np.ones(y.size) if sample_weight is None
                   else check_sample_weight(sample_weight, np.empty(y.size)))
        self.n_train_ = int(y.size)
        self.step_counts_ = np.bincount(y, weights=weights)
        self.most_frequent_step_ = int(np.argmax(self.step_counts_))
        self.relative_bin_counts_ = np.bincount(_relative_bins(y, n_turns, self.n_bins),
                                                weights=weights, minlength=self.n_bins)
        self.most_frequent_bin_ = int(np.argmax(self.relative_bin_counts_))
        return self

    # ---------------------------------------------------------------- predict
    def _deterministic_steps(self, n_turns):
        last = n_turns - 1
        if self.strategy == "first":
            return np.zeros_like(n_turns)
        if self.strategy == "constant":
            c = int(self.constant)
            steps = np.full_like(n_turns, c) if c >= 0 else n_turns + c
            return np.clip(steps, 0, last)
        if self.strategy == "most_frequent":
            return np.minimum(self.most_frequent_step_, last)
        if self.strategy == "most_frequent_relative":
            centre = (self.most_frequent_bin_ + 0.5) / self.n_bins
            steps = np.empty_like(n_turns)
            for i, n in enumerate(n_turns):
                rel = np.arange(n) / (n - 1) if n > 1 else np.zeros(1)
                steps[i] = int(np.argmin(np.abs(rel - centre)))  # first minimum on ties
            return steps
        raise AssertionError(self.strategy)

    def predict(self, X):
        """Predict the decisive step of each conversation.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures

        Returns
        -------
        steps : ndarray of int, shape (n_conversations,)
        """
        check_is_fitted(self)
        n_turns = self._turn_counts(X)
        if self.strategy == "uniform":
            rng = check_random_state(self.random_state)
            return rng.randint(0, n_turns).astype(np.int64)
        return self._deterministic_steps(n_turns).astype(np.int64)

    def _check_decisive_input(self, X):
        # the DecisiveStepMixin hook: conversations or TurnFeatures
        return X if isinstance(X, TurnFeatures) else list(X)

    def _check_decisive_steps(self, y, X):
        return self._check_y(X, y, self._turn_counts(X))

    def turn_predict_proba(self, X):
        """Probability that each turn is the predicted one.

        One-hot on the predicted turn for the deterministic strategies;
        ``1 / n_turns`` everywhere for ``"uniform"``.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures

        Returns
        -------
        proba : list of ndarray
            One 1-D array per conversation, summing to 1.
        """
        check_is_fitted(self)
        n_turns = self._turn_counts(X)
        if self.strategy == "uniform":
            return [np.full(n, 1.0 / n) for n in n_turns]
        out = []
        for n, s in zip(n_turns, self._deterministic_steps(n_turns)):
            p = np.zeros(n)
            p[s] = 1.0
            out.append(p)
        return out

    def turn_decision_function(self, X):
        """Score of every turn: equal to :meth:`turn_predict_proba`.

        For ``"uniform"`` all turns score the same, so the scores do not say
        which turn :meth:`predict` draws.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures

        Returns
        -------
        scores : list of ndarray
            One 1-D array per conversation.
        """
        return self.turn_predict_proba(X)

    def expected_accuracy(self, X, y):
        """Expected step accuracy over the strategy's randomness.

        ``mean(1 / n_turns)`` for ``"uniform"``; the exact accuracy of
        :meth:`predict` for the deterministic strategies.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
        y : array-like of int, shape (n_conversations,)

        Returns
        -------
        accuracy : float
        """
        check_is_fitted(self)
        n_turns = self._turn_counts(X)
        y = self._check_y(X, y, n_turns)
        if self.strategy == "uniform":
            return float(np.mean(1.0 / n_turns))
        return float(np.mean(self._deterministic_steps(n_turns) == y))

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.non_deterministic = self.strategy == "uniform"
        return tags
