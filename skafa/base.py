"""Base classes shared by skafa's estimators.

:class:`DecisiveStepMixin` owns the public methods of every *decisive-step*
estimator (one that predicts, per conversation, the turn that decided the run):
``predict``, ``predict_agent``, ``score``, ``turn_decision_function``,
``turn_predict_proba`` and the scikit-learn tags. A subclass implements hooks
(in the manner of imbalanced-learn, where the base class owns the validated
public method and a subclass implements ``_fit_resample``):

- ``_turn_scores(X)``: validate ``X`` and return ``(X, scores)``, a
  :class:`~skafa.TurnFeatures` and one float score per turn row. ``predict`` is
  the earliest best turn of each conversation, ``turn_decision_function`` the
  scores split per conversation, ``turn_predict_proba`` their softmax (see
  ``_turn_proba``).
- or ``_decisive_delegate(X, method)``: for a meta-estimator, the fitted inner
  estimator and its input; every public method is then forwarded to it.

:class:`TurnInputMixin` holds the one input tag of every estimator whose ``X``
is a list of :class:`~skafa.Conversation` or a :class:`~skafa.TurnFeatures`
rather than a 2-D array (transformers included).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from .features import agents_at, check_turn_features
from .utils.grouped import grouped_argmax, grouped_softmax
from .utils.validation import check_steps, mean_hits, reference_cycle

__all__ = ["DecisiveStepMixin", "TurnInputMixin"]


class TurnInputMixin:
    """Tag an estimator whose ``X`` is conversations or TurnFeatures, not an array.

    Sets ``input_tags.two_d_array = False``: scikit-learn's checks then do not feed
    it bare 2-D arrays. Place it before :class:`~sklearn.base.BaseEstimator` in the
    bases. Its ``clone`` refuses a parameter that contains itself with an error
    naming it (:func:`skafa.utils.validation.reference_cycle`).
    """

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False
        return tags

    def __sklearn_clone__(self):
        """:func:`sklearn.base.clone`, refusing a parameter that contains itself.

        scikit-learn's clone copies dict and list parameters element by element,
        so a reference cycle (``d["self"] = d``) ends in a ``RecursionError``
        from deep inside; this names the parameter instead.
        """
        cycle = reference_cycle(self)
        if cycle is not None:
            inner, outer = cycle
            raise ValueError(
                f"{type(self).__name__}: the parameter value {inner} is {outer} itself (a "
                "reference cycle), so the estimator cannot be cloned (scikit-learn's clone "
                "would recurse without end); pass a value without the cycle.")
        return super().__sklearn_clone__()


def _decisive_method_available(name):
    """``available_if`` check: ask the estimator's ``_has_decisive_method`` hook."""

    def check(self):
        return self._has_decisive_method(name)

    return check


class DecisiveStepMixin(TurnInputMixin):
    """Mixin for estimators that predict the decisive step of each conversation.

    One sample is one conversation; the target ``y[i]`` is the index of its
    decisive turn. These estimators are deliberately not scikit-learn
    classifiers (the label is a position inside each conversation), so the
    ``estimator_type`` tag stays ``None`` and an int ``cv`` gives ``KFold``.

    The public methods are written here once, on top of hooks:

    ``_turn_scores(X)``
        Return ``(X, scores)``: the validated :class:`~skafa.TurnFeatures` and
        one float score per turn row (``X.n_turns_total``). Called after
        ``check_is_fitted``.
    ``_turn_proba(scores, offsets)``
        Per-turn scores to per-conversation probabilities; default: softmax
        within each conversation.
    ``_decisive_delegate(X, method)``
        For meta-estimators: return ``(estimator, Xt)`` and ``method`` is called
        on the fitted inner ``estimator`` with ``Xt``; ``None`` (default) means
        "not a delegator".
    ``_has_decisive_method(name)``
        Whether the public method ``name`` is available (``available_if``);
        default ``True``.
    ``_check_decisive_input(X)``
        Validate ``X`` for ``predict_agent`` and ``score``; default
        :func:`~skafa.features.check_turn_features`.
    ``_check_decisive_steps(y, X)``
        Validate the true steps for ``score``; default
        :func:`~skafa.utils.validation.check_steps`.
    ``_score(X, y, sample_weight)``
        The score; default: step accuracy (a weighted mean of hits with
        ``sample_weight``).

    Class attributes: ``_decisive_requires_y`` (the ``target_tags.required``
    tag, default ``True``) and ``_score_takes_sample_weight`` (default
    ``True``; an estimator that sets it to ``False`` should also declare
    ``__metadata_request__score = {"sample_weight": metadata_routing.UNUSED}``).

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.base import BaseEstimator
    >>> from skafa import TurnFeatures
    >>> from skafa.base import DecisiveStepMixin
    >>> class FirstFeature(DecisiveStepMixin, BaseEstimator):
    ...     def fit(self, X, y=None):
    ...         self.fitted_ = True
    ...         return self
    ...     def _turn_scores(self, X):
    ...         return X, np.asarray(X.turn_matrix(X.sites[0]))[:, 0]
    >>> X = TurnFeatures(np.array([[0.], [2.], [1.], [5.], [3.]]), np.array([0, 3, 5]))
    >>> est = FirstFeature().fit(X)
    >>> est.predict(X).tolist()
    [1, 0]
    >>> est.score(X, [1, 1])
    0.5
    """

    #: ``target_tags.required``: whether ``fit`` needs ``y``.
    _decisive_requires_y = True
    #: Whether ``score`` takes ``sample_weight`` (a weighted mean of hits).
    _score_takes_sample_weight = True

    # ------------------------------------------------------------------ hooks
    def _has_decisive_method(self, name):
        return True

    def _decisive_delegate(self, X, method):
        return None

    def _turn_scores(self, X):  # pragma: no cover - abstract
        raise NotImplementedError(
            f"{type(self).__name__} must implement _turn_scores(X) or "
            "_decisive_delegate(X, method)."
        )

    def _turn_proba(self, scores, offsets):
        return grouped_softmax(scores, offsets)

    def _check_decisive_input(self, X):
        return check_turn_features(X, self)

    def _check_decisive_steps(self, y, X):
        return check_steps(y, X)

    def _score(self, X, y, sample_weight):
        X = self._check_decisive_input(X)
        y = self._check_decisive_steps(y, X)
        return mean_hits(self.predict(X) == y, sample_weight)

    def _checked_turn_scores(self, X):
        check_is_fitted(self)
        return self._turn_scores(X)

    # ------------------------------------------------------------- public API
    @available_if(_decisive_method_available("predict"))
    def predict(self, X):
        """Predict the decisive step of every conversation.

        The predicted step is the turn with the highest score; on ties the
        earliest such turn wins.

        Parameters
        ----------
        X : TurnFeatures or list of Conversation

        Returns
        -------
        steps : ndarray of int, shape (n_conversations,)
        """
        delegate = self._decisive_delegate(X, "predict")
        if delegate is not None:
            estimator, Xt = delegate
            return estimator.predict(Xt)
        X, scores = self._checked_turn_scores(X)
        return grouped_argmax(scores, X.offsets)

    @available_if(_decisive_method_available("predict_agent"))
    def predict_agent(self, X):
        """Speaker of the predicted decisive turn of every conversation.

        Parameters
        ----------
        X : TurnFeatures or list of Conversation
            A TurnFeatures must carry ``speakers`` (TurnActivationTransformer
            sets them).

        Returns
        -------
        agents : ndarray of object, shape (n_conversations,)
            ``None`` where the predicted step is negative (no step).
        """
        delegate = self._decisive_delegate(X, "predict_agent")
        if delegate is not None:
            estimator, Xt = delegate
            return estimator.predict_agent(Xt)
        X = self._check_decisive_input(X)
        return agents_at(X, self.predict(X))

    @available_if(_decisive_method_available("turn_decision_function"))
    def turn_decision_function(self, X):
        """Score of every turn, per conversation.

        Parameters
        ----------
        X : TurnFeatures or list of Conversation

        Returns
        -------
        scores : list of ndarray of shape (n_turns_i,)
            One 1-D float array per conversation.
        """
        delegate = self._decisive_delegate(X, "turn_decision_function")
        if delegate is not None:
            estimator, Xt = delegate
            return estimator.turn_decision_function(Xt)
        X, scores = self._checked_turn_scores(X)
        return X.split_rows(scores)

    @available_if(_decisive_method_available("turn_predict_proba"))
    def turn_predict_proba(self, X):
        """Probability that each turn is the decisive one, per conversation.

        By default the softmax of the turn scores within each conversation.

        Parameters
        ----------
        X : TurnFeatures or list of Conversation

        Returns
        -------
        proba : list of ndarray of shape (n_turns_i,)
            One array per conversation, non-negative, summing to 1.
        """
        delegate = self._decisive_delegate(X, "turn_predict_proba")
        if delegate is not None:
            estimator, Xt = delegate
            return estimator.turn_predict_proba(Xt)
        X, scores = self._checked_turn_scores(X)
        return X.split_rows(self._turn_proba(scores, X.offsets))

    def score(self, X, y=None, sample_weight=None):
        """Step accuracy: fraction of conversations whose decisive step is found.

        Some estimators score otherwise (see their ``_score``): an online
        auditor reports Exact-F1, a site selector its ``scoring``.

        Parameters
        ----------
        X : TurnFeatures or list of Conversation
        y : array-like of int, shape (n_conversations,)
            True decisive steps. Estimators that read labels off the
            conversations accept ``None``.
        sample_weight : array-like of shape (n_conversations,), default=None
            Conversation weights (a weighted mean of hits), for the estimators
            that support them.

        Returns
        -------
        score : float
        """
        if sample_weight is not None and not self._score_takes_sample_weight:
            raise TypeError(
                f"{type(self).__name__}.score() takes no sample_weight."
            )
        return float(self._score(X, y, sample_weight))

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.required = self._decisive_requires_y
        # X is ragged (TurnFeatures or conversations): bare sparse matrices are
        # refused (sparse blocks inside a TurnFeatures are read).
        tags.input_tags.sparse = False
        return tags
