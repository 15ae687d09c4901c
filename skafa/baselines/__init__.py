"""Baselines a probe must beat: a dummy step classifier, a prompted LLM judge and the
grafted judge (the prompted judge with locator heads routed into writer heads).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._dummy import (
    DummyStepClassifier,
)
from ._grafted import (
    GraftedJudge,
    grafted_split_predictions,
    head_direct_effects,
    recheck_graft_store,
)
from ._judge import (
    PromptedJudge,
)

__all__ = [
    "DummyStepClassifier",
    "GraftedJudge",
    "PromptedJudge",
    "grafted_split_predictions",
    "head_direct_effects",
    "recheck_graft_store",
]
