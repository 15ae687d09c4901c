"""The shared helpers every estimator uses to read agents, average hits and check
features (magnitude, feature names)."""

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


# ------------------------------------------ feature magnitude and feature names
SIZES = [3, 1, 4, 2]


def _offsets(sizes=SIZES):
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _dense(**kwargs):
    rng = np.random.default_rng(0)
    off = _offsets()
    kwargs.setdefault("sites", ["resid_pre.0", "resid_pre.1"])
    kwargs.setdefault("speakers", [f"agent{i}" for i in range(off[-1])])
    kwargs.setdefault("task_ids", ["t0", "t1", "t2", "t0"])
    return TurnFeatures(rng.normal(size=(off[-1], 2, 3)), off, **kwargs)


def _probe_data(seed=0):
    rng = np.random.default_rng(seed)
    off = np.arange(0, 41, 4)
    values = rng.normal(size=(40, 3))
    y = rng.integers(0, 4, size=10)
    values[off[:-1] + y, 0] += 3.0
    return values, off, y


def test_huge_feature_value_names_its_place():
    from skafa.probes import GroupedArgmaxLogisticClassifier

    values, off, y = _probe_data()
    values[5, 1] = 1e300
    X = TurnFeatures(values, off, task_ids=[f"t{i}" for i in range(10)])
    with pytest.raises(ValueError, match=r"too large.*conversation 1 \(task 't1'\), turn 1, "
                                         r"site 'features', feature 1"):
        GroupedArgmaxLogisticClassifier().fit(X, y)


def test_permuted_feature_names_are_refused_at_predict():
    from skafa.probes import GroupedArgmaxClassifier, GroupedArgmaxLogisticClassifier

    values, off, y = _probe_data()
    X = TurnFeatures(values, off, feature_names=["a", "b", "c"])
    Xp = TurnFeatures(values, off, feature_names=["b", "a", "c"])
    Xu = TurnFeatures(values, off, feature_names=["a", "b", "z"])
    for probe in (GroupedArgmaxLogisticClassifier(), GroupedArgmaxClassifier()):
        probe.fit(X, y)
        assert probe.feature_names_in_.tolist() == ["a", "b", "c"]
        probe.predict(X)
        with pytest.raises(ValueError, match="same order"):
            probe.predict(Xp)
        with pytest.raises(ValueError, match="unseen at fit.*z"):
            probe.predict(Xu)
        with pytest.warns(UserWarning, match="no feature names"):
            probe.predict(TurnFeatures(values, off))
        probe.fit(TurnFeatures(values, off), y)
        assert not hasattr(probe, "feature_names_in_")
        with pytest.warns(UserWarning, match="fitted without feature names"):
            probe.predict(X)


def test_permuted_feature_names_are_refused_by_per_turn_and_site_concatenator():
    from sklearn.preprocessing import StandardScaler

    from skafa.compose import PerTurn, SiteConcatenator

    X = _dense(feature_names=["a", "b", "c"])
    Xp = _dense(feature_names=["c", "b", "a"])
    for est in (PerTurn(StandardScaler()), SiteConcatenator(["resid_pre.0", "resid_pre.1"])):
        est.fit(X)
        est.transform(X)
        with pytest.raises(ValueError, match="same order"):
            est.transform(Xp)


def test_check_steps_explains_minus_one_as_unlabelled():
    import numpy as np
    import pytest

    from skafa.utils.validation import check_steps

    with pytest.raises(ValueError, match=r"-1 marks an unlabelled conversation \(1 of 3"):
        check_steps(np.array([1, -1, 2]))
    with pytest.raises(ValueError) as exc:
        check_steps(np.array([1, -2, 2]))
    assert "unlabelled" not in str(exc.value)
