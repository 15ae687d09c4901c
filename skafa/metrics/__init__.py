"""Step and agent accuracy, scorers, bootstrap confidence intervals and online metrics.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._metrics import (
    AGENT_RULES,
    SCORERS,
    BootstrapResult,
    StepScorer,
    agent_accuracy,
    agent_accuracy_scorer,
    bootstrap_ci,
    bootstrap_ci_from_scores,
    exact_f1,
    get_step_scorer,
    make_step_scorer,
    mean_absolute_step_shift,
    normalize_agent,
    online_step_accuracy,
    paired_bootstrap_ci,
    step_accuracy,
    step_accuracy_scorer,
    top_k_step_accuracy,
    top_k_step_scorer,
    within_k_accuracy,
    within_k_scorer,
)

__all__ = [
    "AGENT_RULES",
    "BootstrapResult",
    "SCORERS",
    "StepScorer",
    "agent_accuracy",
    "agent_accuracy_scorer",
    "bootstrap_ci",
    "bootstrap_ci_from_scores",
    "exact_f1",
    "get_step_scorer",
    "make_step_scorer",
    "mean_absolute_step_shift",
    "normalize_agent",
    "online_step_accuracy",
    "paired_bootstrap_ci",
    "step_accuracy",
    "step_accuracy_scorer",
    "top_k_step_accuracy",
    "top_k_step_scorer",
    "within_k_accuracy",
    "within_k_scorer",
]
