"""Vectorised operations over groups of consecutive rows (one group per conversation).

``offsets`` has one entry more than there are groups: group ``g`` is rows
``offsets[g]:offsets[g + 1]``, as in :class:`~skafa.TurnFeatures`.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import numpy as np

__all__ = [
    "grouped_argmax",
    "grouped_softmax",
    "grouped_normalise",
    "grouped_logsumexp",
    "grouped_center",
]


def grouped_argmax(scores, offsets):
    """Per group, the position (within the group) of the first maximum."""
    starts = offsets[:-1]
    sizes = np.diff(offsets)
    group_max = np.maximum.reduceat(scores, starts)
    positions = np.arange(scores.shape[0]) - np.repeat(starts, sizes)
    candidates = np.where(
        scores == np.repeat(group_max, sizes), positions, np.iinfo(np.int64).max
    )
    return np.minimum.reduceat(candidates, starts).astype(np.int64)


def grouped_softmax(scores, offsets):
    """Softmax of ``scores`` within every group (vectorised)."""
    starts = offsets[:-1]
    sizes = np.diff(offsets)
    shifted = scores - np.repeat(np.maximum.reduceat(scores, starts), sizes)
    e = np.exp(shifted)
    return e / np.repeat(np.add.reduceat(e, starts), sizes)


def grouped_normalise(scores, offsets):
    """``scores / sum(scores)`` within every group; uniform where the sum is 0."""
    starts = offsets[:-1]
    sizes = np.diff(offsets)
    totals = np.repeat(np.add.reduceat(scores, starts), sizes)
    uniform = 1.0 / np.repeat(sizes, sizes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(totals > 0, scores / np.where(totals > 0, totals, 1.0), uniform)




def grouped_logsumexp(scores, offsets):
    """``log(sum(exp(scores)))`` of every group, computed stably (one value per group)."""
    starts = offsets[:-1]
    sizes = np.diff(offsets)
    group_max = np.maximum.reduceat(scores, starts)
    shifted = scores - np.repeat(group_max, sizes)
    return group_max + np.log(np.add.reduceat(np.exp(shifted), starts))


def grouped_center(scores, offsets):
    """``scores`` minus the mean of its group (the within-group deviation)."""
    starts = offsets[:-1]
    sizes = np.diff(offsets)
    return scores - np.repeat(np.add.reduceat(scores, starts) / sizes, sizes)
