"""Choosing a site (layer), ensembling sites and stacking per-turn scores, on
grouped cross-validation.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

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
    "SiteEnsemble",
    "SiteSelector",
    "TurnScoreStacker",
    "check_site_cv",
    "grouped_splits",
    "resolve_sites",
    "site_sweep",
]
