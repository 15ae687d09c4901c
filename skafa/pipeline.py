"""A scikit-learn Pipeline that also passes on skafa's conversation-level methods.

:class:`sklearn.pipeline.Pipeline` delegates ``predict``, ``score`` and the other
standard methods to its last step, but not methods it does not know. skafa's
estimators answer three more questions per conversation — the responsible agent
(``predict_agent``) and the per-turn scores and probabilities
(``turn_decision_function``, ``turn_predict_proba``) — so
:class:`AttributionPipeline` adds exactly those, and nothing else.
"""

from __future__ import annotations

from sklearn.pipeline import Pipeline, _final_estimator_has
from sklearn.utils.metaestimators import available_if

__all__ = ["AttributionPipeline", "make_attribution_pipeline", "final_step_call"]


def final_step_call(estimator, method, X):
    """Call ``method`` of an estimator, or of a pipeline's last step on transformed ``X``.

    Parameters
    ----------
    estimator : estimator or sklearn Pipeline
        A fitted skafa estimator, or a fitted Pipeline ending in one.
    method : str
        ``"predict_agent"``, ``"turn_decision_function"`` or ``"turn_predict_proba"``
        (any method of the last step works).
    X : list of Conversation or TurnFeatures
        Input of the pipeline.

    Returns
    -------
    object
        What the last step's ``method`` returns.
    """
    if isinstance(estimator, Pipeline):
        Xt = X
        for _, _, transform in estimator._iter(with_final=False):
            Xt = transform.transform(Xt)
        return getattr(estimator.steps[-1][1], method)(Xt)
    return getattr(estimator, method)(X)


class AttributionPipeline(Pipeline):
    """A :class:`~sklearn.pipeline.Pipeline` that also delegates skafa's methods.

    Identical to scikit-learn's Pipeline (same parameters, cloning, grid search,
    HTML repr), plus ``predict_agent``, ``turn_decision_function`` and
    ``turn_predict_proba``, available when the last step has them. They run the
    transforms of all earlier steps, then call the last step.

    Parameters
    ----------
    steps : list of (str, estimator) tuples
        As in :class:`~sklearn.pipeline.Pipeline`.
    transform_input : list of str, default=None
        As in :class:`~sklearn.pipeline.Pipeline`.
    memory : str or object with the joblib.Memory interface, default=None
        As in :class:`~sklearn.pipeline.Pipeline`.
    verbose : bool, default=False
        As in :class:`~sklearn.pipeline.Pipeline`.

    See Also
    --------
    make_attribution_pipeline : Build one without naming the steps.

    Examples
    --------
    >>> from skafa import AttributionPipeline, TurnPositionTransformer, GroupedArgmaxLogisticClassifier
    >>> from skafa.testing import make_conversations
    >>> convs = make_conversations(12)
    >>> y = [c.mistake_step for c in convs]
    >>> pipe = AttributionPipeline([("pos", TurnPositionTransformer()),
    ...                             ("probe", GroupedArgmaxLogisticClassifier())]).fit(convs, y)
    >>> len(pipe.predict_agent(convs)) == len(pipe.turn_predict_proba(convs)) == 12
    True
    """

    def __init__(self, steps, *, transform_input=None, memory=None, verbose=False):
        super().__init__(steps, transform_input=transform_input, memory=memory,
                         verbose=verbose)

    @available_if(_final_estimator_has("predict_agent"))
    def predict_agent(self, X):
        """Speaker of the predicted decisive turn of each conversation.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
            Input of the first step.

        Returns
        -------
        ndarray of object, shape (n_conversations,)
        """
        return final_step_call(self, "predict_agent", X)

    @available_if(_final_estimator_has("turn_decision_function"))
    def turn_decision_function(self, X):
        """Per-turn scores of each conversation (a list of 1-D arrays).

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
            Input of the first step.

        Returns
        -------
        list of ndarray
            One array of length ``n_turns_i`` per conversation.
        """
        return final_step_call(self, "turn_decision_function", X)

    @available_if(_final_estimator_has("turn_predict_proba"))
    def turn_predict_proba(self, X):
        """Per-conversation probabilities over turns (a list of 1-D arrays).

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
            Input of the first step.

        Returns
        -------
        list of ndarray
            One array per conversation, summing to 1.
        """
        return final_step_call(self, "turn_predict_proba", X)


def make_attribution_pipeline(*steps, memory=None, verbose=False):
    """Build an :class:`AttributionPipeline`, naming steps like ``make_pipeline``.

    Parameters
    ----------
    *steps : estimators
    memory : str or object with the joblib.Memory interface, default=None
    verbose : bool, default=False

    Returns
    -------
    AttributionPipeline
    """
    from sklearn.pipeline import _name_estimators

    return AttributionPipeline(_name_estimators(steps), memory=memory, verbose=verbose)
