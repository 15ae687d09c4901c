"""Per-head locator accuracy (skafa.metrics._locator)."""

import numpy as np
import pytest

from skafa.features import TurnFeatures
from skafa.metrics import locator_head_accuracy


def _features(n_turns, y, seed=0, locator=(1, 2), n_layers=3, n_heads=4):
    """Random attention mass; head ``locator`` puts its peak on the decisive turn."""
    rng = np.random.default_rng(seed)
    blocks = []
    for n, step in zip(n_turns, y):
        block = rng.uniform(0.0, 0.1, size=(n, n_layers, n_heads))
        block[step, locator[0], locator[1]] = 0.5
        blocks.append(block)
    return blocks


def test_the_locator_head_scores_one_and_chance_is_the_mean_inverse_length():
    n_turns, y = [3, 5, 4, 6, 2], [0, 4, 2, 1, 1]
    blocks = _features(n_turns, y)
    acc, chance = locator_head_accuracy(blocks, y)
    assert acc.shape == (3, 4)
    assert acc[1, 2] == 1.0
    assert np.all(np.delete(acc.ravel(), 1 * 4 + 2) < 1.0)
    assert chance == pytest.approx(np.mean([1 / n for n in n_turns]))
    # the same through a TurnFeatures, one site per layer
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    F = TurnFeatures(np.concatenate(blocks).astype(np.float32), offsets,
                     sites=["head_attn.0", "head_attn.1", "head_attn.2"])
    acc2, chance2 = locator_head_accuracy(F, y)
    np.testing.assert_array_equal(acc2, acc)
    assert chance2 == chance


def test_wrong_labels_lower_the_score_and_ties_go_to_the_first_turn():
    blocks = _features([4, 4], [3, 3])
    acc, _ = locator_head_accuracy(blocks, [0, 3])
    assert acc[1, 2] == 0.5
    flat = [np.ones((3, 1, 1)), np.ones((2, 1, 1))]
    assert locator_head_accuracy(flat, [0, 0])[0][0, 0] == 1.0
    assert locator_head_accuracy(flat, [1, 1])[0][0, 0] == 0.0


def test_bad_input_is_named():
    blocks = _features([3, 3], [0, 1])
    with pytest.raises(ValueError, match="different lengths"):
        locator_head_accuracy(blocks, [0])
    with pytest.raises(ValueError, match=r"y\[1\]=3 is outside conversation 1"):
        locator_head_accuracy(blocks, [0, 3])
    with pytest.raises(ValueError, match="shape"):
        locator_head_accuracy([np.ones((3, 4))], [0])
    with pytest.raises(ValueError, match="NaN"):
        locator_head_accuracy([np.full((2, 1, 1), np.nan)], [0])
    with pytest.raises(ValueError, match="per-head"):
        locator_head_accuracy(TurnFeatures(np.ones((3, 2), dtype=np.float32), [0, 3]), [0])
