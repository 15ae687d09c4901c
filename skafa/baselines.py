"""Former home of the featurizers, composition helpers and dummies (old import paths).

:class:`TurnPositionTransformer` and :class:`TurnTextTransformer` now live in
:mod:`skafa.featurizers`, :class:`TurnFeatureUnion` and :class:`SiteConcatenator` in
:mod:`skafa.composition`, and :class:`DummyStepClassifier` in :mod:`skafa.dummies`;
import them from there or from :mod:`skafa`.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from .composition import SiteConcatenator, TurnFeatureUnion
from .dummies import DummyStepClassifier
from .featurizers import (
    POSITION_FEATURE_GROUPS,
    TurnPositionTransformer,
    TurnTextTransformer,
)

__all__ = [
    "TurnPositionTransformer",
    "TurnTextTransformer",
    "TurnFeatureUnion",
    "SiteConcatenator",
    "DummyStepClassifier",
    "POSITION_FEATURE_GROUPS",
]
