"""Former home of the probes and :class:`PerTurn` (kept so old import paths work).

The probes now live in :mod:`skafa.probes` and :class:`PerTurn` in
:mod:`skafa.composition`; import them from there or from :mod:`skafa`.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from .composition import PerTurn
from .probes import GroupedArgmaxClassifier, GroupedArgmaxLogisticClassifier

__all__ = ["GroupedArgmaxClassifier", "GroupedArgmaxLogisticClassifier", "PerTurn"]
