"""Probes fitted directly on single-turn conversations (issue "Hostile and odd input,
round four", item 7): a clear refusal when all have one turn, normal fits otherwise."""

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from skafa import TurnFeatures
from skafa.probes import (
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
)

PROBES = [GroupedArgmaxLogisticClassifier(), GroupedSoftmaxClassifier(),
          GroupedArgmaxClassifier(LogisticRegression())]


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: type(p).__name__)
def test_all_single_turn_training_set_is_refused_naming_probe_and_count(probe):
    X = TurnFeatures(np.random.default_rng(0).normal(size=(7, 3)), np.arange(8))
    with pytest.raises(ValueError, match=(
            rf"^{type(probe).__name__}: every one of the 7 training conversations has a "
            r"single turn \(its decisive step can only be turn 0\)")):
        probe.fit(X, np.zeros(7, dtype=np.int64))


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: type(p).__name__)
def test_a_few_single_turn_conversations_are_fitted_and_predicted(probe):
    rng = np.random.default_rng(1)
    n_turns = np.array([1, 4, 1, 3, 5, 1, 2, 4, 1, 3])
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n_turns.size) * n_turns).astype(np.int64)
    values = rng.normal(size=(offsets[-1], 3))
    values[offsets[:-1] + y, 0] += 4.0
    X = TurnFeatures(values, offsets)
    fitted = probe.fit(X, y)
    pred = fitted.predict(X)
    assert np.all(pred[n_turns == 1] == 0)
    proba = fitted.turn_predict_proba(X)
    assert all(np.allclose(p, [1.0]) for p, n in zip(proba, n_turns) if n == 1)
    assert fitted.score(X, y) >= 0.8
