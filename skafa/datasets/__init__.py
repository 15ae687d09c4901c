"""Readers for failure-attribution datasets (Who&When).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._who_and_when import (
    SUBSETS,
    WHO_AND_WHEN_URL,
    fetch_who_and_when,
    get_data_home,
    load_who_and_when,
    who_and_when_path,
)

__all__ = [
    "SUBSETS",
    "WHO_AND_WHEN_URL",
    "fetch_who_and_when",
    "get_data_home",
    "load_who_and_when",
    "who_and_when_path",
]
