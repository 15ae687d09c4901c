"""Per-turn features that need no language model: position and text.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._featurizers import (
    POSITION_FEATURE_GROUPS,
    TurnPositionTransformer,
    TurnTextTransformer,
)

__all__ = [
    "POSITION_FEATURE_GROUPS",
    "TurnPositionTransformer",
    "TurnTextTransformer",
]
