"""Benchmarks as package code: the Who&When comparison (plain and pre-registered) and the
online-auditing benchmark over
:mod:`skafa.model_selection`'s nested-comparison machinery, and the peers it is compared
with (the prompted judge, mi4afa); the extraction benchmark (skafa's extraction next to a
bare forward pass, nnsight, TransformerLens and mi4afa); the main job (the
quickstart's steps); and the transfer study between two frameworks
(``docs/your-own-framework.md``). The scripts under ``examples/`` are their commands.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._extraction import (
    EXTRACTION_PEERS,
    ExtractionBenchmarkSettings,
    first_records,
    measure_peak_memory,
    run_device_benchmark,
    run_extraction_benchmark,
    run_peers_benchmark,
)
from ._locator_cost import (
    LOCATOR_COST_METHODS,
    LocatorCostSettings,
    run_locator_cost_benchmark,
)
from ._locators import (
    LOCATOR_ROWS,
    LocatorBenchmarkSettings,
    gap_closed,
    locator_heads_summary,
    locator_markdown,
    recommended_fits_from_store,
    run_locator_benchmark,
    top_locator_head,
)
from ._main_job import (
    MainJob,
    MainJobSettings,
    main_job_extractor,
    main_job_table,
    prepare_main_job,
    run_main_job,
)
from ._online import (
    POSITION_AUDITOR,
    TURN_CHAR_GRID,
    OnlineBenchmarkSettings,
    choose_online_template,
    online_markdown,
    paired_online,
    paired_online_rows,
    plot_alarm_scores,
    rescore_online,
    run_online_benchmark,
    summarize_online,
)
from ._peers import (
    JUDGE,
    PLAIN_CHAT_TEMPLATE,
    attention_note,
    dask_backend,
    earlier_judge_store,
    judge_cache_head,
    judge_from_result,
    judge_predictions,
    mi4afa_activations,
    mi4afa_fold,
    mi4afa_setup,
    peak_rss_during,
    peer_cost,
)
from ._rematch import (
    REMATCH_CANDIDATES,
    REMATCH_SUBSETS,
    RematchSettings,
    rematch_markdown,
    run_rematch_candidates,
)
from ._transfer import ADAPTATIONS, adaptation_rule, run_transfer_study
from ._who_and_when import (
    AUTO,
    MI4AFA,
    BenchmarkSettings,
    model_tag,
    plain_markdown,
    plot_site_curves,
    preregistered_deviations,
    preregistered_markdown,
    preregistered_names,
    run_benchmark,
)

__all__ = [
    "ADAPTATIONS",
    "adaptation_rule",
    "run_transfer_study",
    "LOCATOR_COST_METHODS",
    "LocatorCostSettings",
    "run_locator_cost_benchmark",
    "LOCATOR_ROWS",
    "LocatorBenchmarkSettings",
    "gap_closed",
    "locator_heads_summary",
    "locator_markdown",
    "recommended_fits_from_store",
    "run_locator_benchmark",
    "top_locator_head",
    "REMATCH_CANDIDATES",
    "REMATCH_SUBSETS",
    "RematchSettings",
    "rematch_markdown",
    "run_rematch_candidates",
    "AUTO",
    "BenchmarkSettings",
    "EXTRACTION_PEERS",
    "ExtractionBenchmarkSettings",
    "MainJob",
    "MainJobSettings",
    "OnlineBenchmarkSettings",
    "POSITION_AUDITOR",
    "TURN_CHAR_GRID",
    "choose_online_template",
    "online_markdown",
    "paired_online",
    "paired_online_rows",
    "plot_alarm_scores",
    "rescore_online",
    "run_online_benchmark",
    "summarize_online",
    "JUDGE",
    "MI4AFA",
    "PLAIN_CHAT_TEMPLATE",
    "attention_note",
    "dask_backend",
    "first_records",
    "judge_cache_head",
    "judge_from_result",
    "judge_predictions",
    "earlier_judge_store",
    "main_job_extractor",
    "main_job_table",
    "measure_peak_memory",
    "mi4afa_activations",
    "mi4afa_fold",
    "mi4afa_setup",
    "model_tag",
    "peak_rss_during",
    "peer_cost",
    "plain_markdown",
    "plot_site_curves",
    "preregistered_deviations",
    "preregistered_markdown",
    "preregistered_names",
    "prepare_main_job",
    "run_benchmark",
    "run_device_benchmark",
    "run_extraction_benchmark",
    "run_main_job",
    "run_peers_benchmark",
]
