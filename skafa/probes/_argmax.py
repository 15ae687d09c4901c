"""Grouped-argmax probe around any binary turn classifier."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from sklearn.base import MetaEstimatorMixin, clone
from sklearn.linear_model import LogisticRegression

from ..utils.sklearn_compat import HasMethods
from ._base import _BaseGroupedArgmax

__all__ = ["GroupedArgmaxClassifier"]


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
