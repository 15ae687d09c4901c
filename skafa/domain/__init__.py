"""Runs from another framework: telling them apart from the training runs.

A probe trained on one agent framework's runs reads that framework's transcripts and
scores near chance on another's (``docs/your-own-framework.md``).
:class:`ShiftDetector` flags runs that look unlike the training runs, with a
threshold calibrated on held-out training runs; a fitted
:class:`~skafa.FailureAttributor` uses one to warn with
:class:`~skafa.DistributionShiftWarning`. :func:`standardize_per_framework` and
:func:`coral` are the pre-registered unsupervised adaptations (they read a framework's
unlabelled runs); :func:`label_priority` orders unlabelled runs for labelling.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._adaptation import CoralAdapter, coral, label_priority, standardize_per_framework
from ._shift import ShiftDetector

__all__ = ["CoralAdapter", "ShiftDetector", "coral", "label_priority", "standardize_per_framework"]
