"""Linear probes that score every turn and predict one decisive turn per conversation.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._probes import (
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
)

__all__ = [
    "GroupedArgmaxClassifier",
    "GroupedArgmaxLogisticClassifier",
    "GroupedSoftmaxClassifier",
]
