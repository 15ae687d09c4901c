"""Linear probes that score every turn and predict one decisive turn per conversation.

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

from ._argmax import GroupedArgmaxClassifier
from ._logistic import GroupedArgmaxLogisticClassifier
from ._softmax import GroupedSoftmaxClassifier

__all__ = [
    "GroupedArgmaxClassifier",
    "GroupedArgmaxLogisticClassifier",
    "GroupedSoftmaxClassifier",
]
