"""Locator heads: which attention heads point at the decisive turn.

A head *locates* the failing step when its attention, from the position where a
judge writes its answer, concentrates on the decisive turn. With per-turn
attention features (``TurnActivationTransformer(sites="head_attn")``: per turn,
one feature per head, the attention mass from the prompt's answer position to the
turn's tokens), :func:`locator_head_accuracy` scores every head without training
anything: the share of conversations whose most-attended turn is the decisive one.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numpy as np

from ..utils.validation import check_steps

__all__ = ["locator_head_accuracy"]


def _blocks(features):
    """Per-conversation ``(n_turns, n_sites, n_heads)`` arrays and the site names."""
    if hasattr(features, "offsets") and hasattr(features, "values"):
        values = features.values
        if hasattr(values, "toarray") or getattr(values, "ndim", 0) != 3:
            raise ValueError(
                "locator_head_accuracy needs dense per-head features of shape "
                "(n_turns_total, n_sites, n_heads), e.g. from "
                "TurnActivationTransformer(sites='head_attn').")
        offsets = np.asarray(features.offsets)
        blocks = [values[offsets[i]:offsets[i + 1]] for i in range(offsets.size - 1)]
        return blocks, tuple(features.sites)
    try:
        blocks = [np.asarray(block, dtype=np.float64) for block in features]
    except (TypeError, ValueError) as exc:
        raise ValueError("features must be a TurnFeatures or a list of arrays of shape "
                         "(n_turns, n_layers, n_heads), one per conversation.") from exc
    for i, block in enumerate(blocks):
        if block.ndim != 3:
            raise ValueError(f"conversation {i}: features must have shape (n_turns, n_layers, "
                             f"n_heads), got {block.shape}.")
    shapes = {block.shape[1:] for block in blocks}
    if len(shapes) > 1:
        raise ValueError(f"the conversations have different (n_layers, n_heads): "
                         f"{sorted(shapes)}.")
    n_layers = blocks[0].shape[1] if blocks else 0
    return blocks, tuple(f"layer {k}" for k in range(n_layers))


def locator_head_accuracy(features, y):
    """Per head, the share of conversations whose most-attended turn is the decisive one.

    Parameters
    ----------
    features : TurnFeatures or sequence of ndarray
        Per-turn attention features: a :class:`~skafa.TurnFeatures` of shape
        ``(n_turns_total, n_sites, n_heads)`` (e.g. from
        ``TurnActivationTransformer(sites="head_attn")``, one site per layer), or
        one ``(n_turns, n_layers, n_heads)`` array per conversation.
    y : array-like of int, shape (n_conversations,)
        The decisive turn of every conversation (0-based).

    Returns
    -------
    accuracy : ndarray of float64, shape (n_sites, n_heads)
        Row ``l`` is the ``l``-th site of ``features`` (layer ``l`` for
        ``sites="head_attn"``), column ``h`` the head. The most-attended turn of a
        conversation is the first turn with the largest mass (ties go to the
        earliest turn).
    chance : float
        What a head that picks a uniformly random turn scores on average: the mean
        of ``1 / n_turns`` over the conversations.

    Raises
    ------
    ValueError
        For features that are not per-head blocks, ``y`` of another length, a step
        outside its conversation, or a conversation without turns.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa.metrics import locator_head_accuracy
    >>> a = np.zeros((3, 1, 2)); a[1, 0, 0] = 1.0; a[0, 0, 1] = 1.0  # head 0 -> turn 1
    >>> acc, chance = locator_head_accuracy([a, a], [1, 1])
    >>> acc.tolist(), round(chance, 3)
    ([[1.0, 0.0]], 0.333)
    """
    blocks, _ = _blocks(features)
    if not blocks:
        raise ValueError("features hold no conversation.")
    steps = check_steps(y, name="y")
    if steps.size != len(blocks):
        raise ValueError(f"features and y have different lengths ({len(blocks)} "
                         f"conversations vs {steps.size} labels).")
    n_sites, n_heads = blocks[0].shape[1:]
    hits = np.zeros((n_sites, n_heads), dtype=np.float64)
    inverse = 0.0
    for i, (block, step) in enumerate(zip(blocks, steps)):
        n_turns = block.shape[0]
        if n_turns == 0:
            raise ValueError(f"conversation {i} has no turns.")
        if step >= n_turns:
            raise ValueError(f"y[{i}]={step} is outside conversation {i}, which has "
                             f"{n_turns} turns.")
        block = np.asarray(block, dtype=np.float64)
        if not np.isfinite(block).all():
            raise ValueError(f"conversation {i}: the features hold NaN or infinite values.")
        hits += np.argmax(block, axis=0) == step
        inverse += 1.0 / n_turns
    return hits / len(blocks), inverse / len(blocks)
