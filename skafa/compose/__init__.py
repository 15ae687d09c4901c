"""Composition on ragged per-turn input: per-turn wrappers, unions, concatenation, the
attribution pipeline.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._composition import (
    AttributionPipeline,
    PerTurn,
    SiteConcatenator,
    TurnFeatureUnion,
    final_step_call,
    final_step_input,
    make_attribution_pipeline,
)

__all__ = [
    "AttributionPipeline",
    "PerTurn",
    "SiteConcatenator",
    "TurnFeatureUnion",
    "final_step_call",
    "final_step_input",
    "make_attribution_pipeline",
]
