"""Utilities for people who write skafa-compatible estimators.

- :func:`all_estimators` lists every public skafa estimator, discovered from the
  package itself (no hand-kept list);
- :mod:`skafa.utils.estimator_checks` holds scikit-learn-style checks for
  estimators on ragged per-conversation input.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from .discovery import all_estimators, public_estimator_paths, public_path

__all__ = ["all_estimators", "public_estimator_paths", "public_path"]
