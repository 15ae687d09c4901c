"""The shared helpers every estimator uses to read agents and average hits."""

import numpy as np
import pytest

from skafa import TurnFeatures
from skafa.features import agents_at
from skafa.testing import make_conversations
from skafa.utils.validation import mean_hits


def test_agents_at_turn_features_and_conversations_agree():
    convs = make_conversations(4, min_turns=2, max_turns=5, seed=1)
    speakers = [t.speaker for c in convs for t in c.turns]
    offsets = np.cumsum([0] + [len(c.turns) for c in convs])
    X = TurnFeatures(np.zeros((offsets[-1], 2)), offsets, speakers=speakers)
    steps = np.array([1, 0, -1, len(convs[3].turns) - 1])
    a, b = agents_at(X, steps), agents_at(convs, steps)
    assert a.tolist() == b.tolist()
    assert a[2] is None                                  # no alarm: no agent
    assert a[0] == convs[0].turns[1].speaker and a[3] == convs[3].turns[-1].speaker


def test_agents_at_without_speakers_says_why():
    X = TurnFeatures(np.zeros((3, 2)), [0, 3])
    with pytest.raises(ValueError, match="carries no speakers"):
        agents_at(X, [0])


def test_mean_hits_weighted_and_checked():
    assert mean_hits([True, False, True, True]) == 0.75
    assert mean_hits([True, False], [3.0, 1.0]) == 0.75
    with pytest.raises(ValueError):
        mean_hits([True, False], [1.0, 1.0, 1.0])
