"""Baselines a probe must beat: a dummy step classifier and a prompted LLM judge.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._dummy import (
    DummyStepClassifier,
)
from ._judge import (
    PromptedJudge,
)

__all__ = [
    "DummyStepClassifier",
    "PromptedJudge",
]
