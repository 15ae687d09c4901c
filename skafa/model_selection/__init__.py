"""Choosing a site (layer), ensembling sites and stacking per-turn scores, on
grouped cross-validation; nested comparisons of methods on shared outer folds, their
resumable result stores and the pre-registered rule; learning curves drawn by task
groups (how many labelled runs a framework needs).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._learning_curve import LearningCurveResult, grouped_learning_curve
from ._nested import (
    AGENT_MATCH_RULES,
    PREREGISTERED_HEADLINE,
    format_interval,
    grid_search_C,
    make_probe,
    method_table,
    outer_splits,
    paired_differences,
    preregistered_rule,
    reader_rule,
    select_single_and_top,
    summarize_predictions,
    tally_rule,
)
from ._results import (
    FoldResultStore,
    JudgeScoreStore,
    ResultStoreError,
    read_json,
    read_result,
    result_dtype,
    write_json,
)
from ._selection import (
    SiteEnsemble,
    SiteSelector,
    check_site_cv,
    grouped_splits,
    resolve_sites,
    site_sweep,
)
from ._stacking import (
    TurnScoreStacker,
)

__all__ = [
    "AGENT_MATCH_RULES",
    "PREREGISTERED_HEADLINE",
    "FoldResultStore",
    "JudgeScoreStore",
    "LearningCurveResult",
    "ResultStoreError",
    "SiteEnsemble",
    "SiteSelector",
    "TurnScoreStacker",
    "check_site_cv",
    "format_interval",
    "grid_search_C",
    "grouped_learning_curve",
    "grouped_splits",
    "make_probe",
    "method_table",
    "outer_splits",
    "paired_differences",
    "preregistered_rule",
    "read_json",
    "read_result",
    "reader_rule",
    "resolve_sites",
    "result_dtype",
    "select_single_and_top",
    "site_sweep",
    "summarize_predictions",
    "tally_rule",
    "write_json",
]
