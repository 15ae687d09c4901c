"""Tests for skafa.featurizers._featurizers, skafa.compose._composition (TurnFeatureUnion, SiteConcatenator) and skafa.baselines._dummy."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import BaseEstimator, TransformerMixin, clone
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.model_selection import GroupKFold, cross_val_score

from skafa import (
    DummyStepClassifier,
    SiteConcatenator,
    TurnFeatureUnion,
    TurnPositionTransformer,
    TurnTextTransformer,
)
from skafa.conversation import Conversation, Turn
from skafa.features import TurnFeatures


# ----------------------------------------------------------------------- fixtures
def conv(speakers, contents=None, task_id=None, step=None):
    contents = contents or [f"turn {k}" for k in range(len(speakers))]
    return Conversation([Turn(s, c) for s, c in zip(speakers, contents)],
                        task_id=task_id, mistake_step=step)


@pytest.fixture
def tiny():
    """Two training conversations: speakers a,b,a (3 turns) and a (1 turn)."""
    return [
        conv(["a", "b", "a"], ["hi", "", "abcd"], task_id="t0"),
        conv(["a"], ["x" * 9], task_id="t1"),
    ]


def synthetic(n, seed, *, last_is_decisive=True, min_turns=2, max_turns=8):
    rng = np.random.default_rng(seed)
    convs, y = [], []
    for i in range(n):
        k = int(rng.integers(min_turns, max_turns + 1))
        speakers = [("planner", "coder", "critic")[t % 3] for t in range(k)]
        contents = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"], size=5))
                    for _ in range(k)]
        convs.append(conv(speakers, contents, task_id=f"task-{i // 2}"))
        y.append(k - 1 if last_is_decisive else int(rng.integers(k)))
    return convs, np.asarray(y)


def who_and_when_dir() -> Path:
    env = os.environ.get("SKAFA_WHO_AND_WHEN")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "who_and_when"


# ------------------------------------------------------------ position features
def test_position_hand_checked_values(tiny):
    tr = TurnPositionTransformer(max_index=2).fit(tiny)
    names = list(tr.get_feature_names_out())
    assert names == [
        "index=0", "index=1", "index>=2", "index", "relative", "is_first", "is_last",
        "n_turns", "log_n_turns", "log1p_length", "speaker=a", "speaker=b",
        "speaker_other", "speaker_changed",
    ]
    assert list(tr.speakers_) == ["a", "b"]
    assert tr.speaker_counts_ == {"a": 3, "b": 1}
    Xt = tr.transform(tiny)
    assert isinstance(Xt, TurnFeatures)
    assert Xt.n_turns.tolist() == [3, 1]
    assert Xt.feature_names == tuple(names)
    assert Xt.speakers.tolist() == ["a", "b", "a", "a"]
    assert Xt.task_ids.tolist() == ["t0", "t1"]
    M = Xt.turn_matrix()
    assert M.dtype == np.float64 and M.shape == (4, len(names))
    l3 = np.log(3.0)
    expected = np.array([
        # onehot(3)  idx rel  first last n  log_n  length      a  b  oth chg
        [1, 0, 0, 0, 0.0, 1, 0, 3, l3, np.log1p(2), 1, 0, 0, 0],
        [0, 1, 0, 1, 0.5, 0, 0, 3, l3, 0.0, 0, 1, 0, 1],
        [0, 0, 1, 2, 1.0, 0, 1, 3, l3, np.log1p(4), 1, 0, 0, 1],
        [1, 0, 0, 0, 0.0, 1, 1, 1, 0.0, np.log1p(9), 1, 0, 0, 0],
    ])
    np.testing.assert_allclose(M, expected)


def test_position_unseen_and_rare_speakers_go_to_other(tiny):
    test = [conv(["a", "zed", "zed", "b"])]
    tr = TurnPositionTransformer(include=["speaker", "speaker_changed"]).fit(tiny)
    M = tr.transform(test).turn_matrix()
    # columns: speaker=a, speaker=b, speaker_other, speaker_changed
    np.testing.assert_array_equal(M, [[1, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 0, 1]])
    rare = TurnPositionTransformer(include=["speaker"], min_speaker_frequency=2).fit(tiny)
    assert list(rare.speakers_) == ["a"]  # b speaks once
    assert list(rare.get_feature_names_out()) == ["speaker=a", "speaker_other"]
    np.testing.assert_array_equal(rare.transform(tiny).turn_matrix()[:, 1], [0, 1, 0, 0])


def test_position_speaker_change_does_not_cross_conversations():
    convs = [conv(["a", "b"]), conv(["a", "a", "c"])]
    tr = TurnPositionTransformer(include=["speaker_changed"]).fit(convs)
    # conversation 1 starts with "a" after "b": not a change, it is a first turn
    np.testing.assert_array_equal(tr.transform(convs).turn_matrix()[:, 0], [0, 1, 0, 0, 1])


def test_position_include_order_and_onehot_overflow():
    c = [conv(["a"] * 13)]
    tr = TurnPositionTransformer(include=["relative", "index_onehot"], max_index=10).fit(c)
    names = list(tr.get_feature_names_out())
    assert names[:2] == ["index=0", "index=1"] and names[-1] == "relative"  # canonical order
    M = tr.transform(c).turn_matrix()
    assert M[:10, :10].tolist() == np.eye(10).tolist()
    np.testing.assert_array_equal(M[10:, 10], 1.0)  # turns 10, 11, 12 in ">= 10"
    assert M[:, :11].sum(axis=1).tolist() == [1.0] * 13


@pytest.mark.parametrize("params, err", [
    (dict(include="speaker"), TypeError),
    (dict(include=["speaker", "nope"]), ValueError),
    (dict(include=[]), ValueError),
    (dict(include=["index", "index"]), ValueError),
    (dict(max_index=0), ValueError),
    (dict(min_speaker_frequency=0), ValueError),
])
def test_position_bad_params(tiny, params, err):
    with pytest.raises(err):
        TurnPositionTransformer(**params).fit(tiny)


def test_transformers_reject_bad_input(tiny):
    tr = TurnPositionTransformer().fit(tiny)
    with pytest.raises(TypeError, match="conversation 1 is a dict"):
        tr.transform([tiny[0], {"history": []}])
    with pytest.raises(TypeError, match="list of Conversation"):
        tr.transform(tiny[0])
    with pytest.raises(TypeError, match="not TurnFeatures"):
        tr.transform(tr.transform(tiny))
    with pytest.raises(ValueError, match="zero conversations"):
        TurnTextTransformer().fit([])


# ---------------------------------------------------------------- text features
def test_text_sparse_and_fitted_on_train_only():
    train = [conv(["a", "b"], ["the cat sat", "the dog sat"]), conv(["a"], ["a cat ran"])]
    test = [conv(["b", "c"], ["the zebra sat", "unicorn"])]
    tr = TurnTextTransformer()  # default TF-IDF, min_df=2
    Xt = tr.fit_transform(train)
    assert Xt.is_sparse and Xt.values.shape == (3, 3)
    assert list(tr.get_feature_names_out()) == ["cat", "sat", "the"]  # min_df=2 drops dog, ran
    assert tr.vectorizer is None  # parameter untouched
    Xs = tr.transform(test)
    assert isinstance(Xs.values, sp.csr_matrix) and Xs.values.shape == (2, 3)
    assert "zebra" not in Xs.feature_names and "unicorn" not in Xs.feature_names
    assert Xs.values[1].nnz == 0  # only unseen words
    assert Xs.speakers.tolist() == ["b", "c"]


def test_text_custom_vectorizer_cloned_and_speaker_prefix():
    vec = CountVectorizer()
    train = [conv(["planner", "coder"], ["go now", "go"])]
    tr = TurnTextTransformer(vec, include_speaker=True).fit(train)
    assert tr.vectorizer is vec and not hasattr(vec, "vocabulary_")
    assert tr.vectorizer_ is not vec
    assert list(tr.get_feature_names_out()) == ["coder", "go", "now", "planner"]
    M = tr.transform(train).turn_matrix().toarray()
    np.testing.assert_array_equal(M, [[0, 1, 1, 1], [1, 1, 0, 0]])
    # equality of fit_transform and fit().transform()
    M2 = clone(tr).fit_transform(train).turn_matrix().toarray()
    np.testing.assert_array_equal(M, M2)


# ---------------------------------------------------------------- feature union
class FakeSites(TransformerMixin, BaseEstimator, auto_wrap_output_keys=None):
    """Per-turn 'activations' at two sites: [len(content), scale * site]."""

    def __init__(self, scale=1.0, sites=("s0", "s1")):
        self.scale = scale
        self.sites = sites

    def fit(self, X, y=None):
        self.fitted_ = True
        return self

    def transform(self, X):
        rows = [[[len(t.content), self.scale * j] for j in range(len(self.sites))]
                for c in X for t in c.turns]
        return TurnFeatures.from_arrays(
            [np.asarray(rows[o:o + len(c)], dtype=float)
             for o, c in zip(np.cumsum([0] + [len(c) for c in X])[:-1], X)],
            sites=self.sites, feature_names=["len", "site"],
        )


def test_union_equals_manual_concatenation(tiny):
    pos = TurnPositionTransformer(include=["relative", "speaker"])
    text = TurnTextTransformer(CountVectorizer(token_pattern=r"\w+"))
    union = TurnFeatureUnion([("pos", pos), ("text", text)])
    Xt = union.fit_transform(tiny)
    manual = TurnFeatures.concatenate(
        [clone(pos).fit_transform(tiny), clone(text).fit_transform(tiny)],
        prefixes=["pos", "text"],
    )
    assert Xt.equals(manual)
    assert Xt.equals(union.transform(tiny))
    assert Xt.is_sparse  # dense + sparse single blocks stay sparse
    assert list(union.get_feature_names_out()) == list(Xt.feature_names)
    assert Xt.feature_names[:2] == ("pos__relative", "pos__speaker=a")
    assert not hasattr(pos, "speakers_")  # parameters are cloned, not fitted in place
    assert list(union.named_transformers_.pos.speakers_) == ["a", "b"]


def test_union_nested_params_and_drop(tiny):
    union = TurnFeatureUnion([("pos", TurnPositionTransformer()), ("fake", FakeSites())])
    params = union.get_params()
    assert params["pos__max_index"] == 10 and params["fake__scale"] == 1.0
    union.set_params(pos__include=["relative"], fake__scale=3.0)
    assert union.named_transformers.pos.include == ["relative"]
    Xt = union.fit_transform(tiny)
    assert Xt.sites == ("s0", "s1") and Xt.n_features == 3
    np.testing.assert_array_equal(Xt.turn_matrix("s1")[:, 2], 3.0)  # pos__relative, len, site
    union.set_params(fake="drop")
    Xd = union.fit_transform(tiny)
    assert Xd.feature_names == ("pos__relative",)
    union.set_params(pos="drop")
    with pytest.raises(ValueError, match="every transformer is 'drop'"):
        union.fit(tiny)
    with pytest.raises(ValueError, match="not unique"):
        TurnFeatureUnion([("a", FakeSites()), ("a", FakeSites())]).fit(tiny)
    with pytest.raises(TypeError, match="'x'"):
        TurnFeatureUnion([("x", object())]).fit(tiny)


def test_union_broadcasts_single_block_onto_sites(tiny):
    union = TurnFeatureUnion([
        ("acts", FakeSites(scale=2.0)),
        ("pos", TurnPositionTransformer(include=["relative", "first_last"])),
    ])
    Xt = union.fit_transform(tiny)
    assert Xt.sites == ("s0", "s1") and Xt.values.shape == (4, 2, 5)
    assert Xt.feature_names == ("acts__len", "acts__site", "pos__relative",
                                "pos__is_first", "pos__is_last")
    pos = np.array([[0, 1, 0], [0.5, 0, 0], [1, 0, 1], [0, 1, 1]])
    for j, site in enumerate(Xt.sites):
        M = Xt.turn_matrix(site)
        np.testing.assert_array_equal(M[:, 2:], pos)
        np.testing.assert_array_equal(M[:, 1], 2.0 * j)
        np.testing.assert_array_equal(M[:, 0], [2, 0, 4, 9])
    # SiteSelector-style choice of one site still works
    assert Xt.select_sites("s1").turn_matrix().shape == (4, 5)
    bad = TurnFeatureUnion([("a", FakeSites()), ("b", FakeSites(sites=("s0", "s9")))])
    with pytest.raises(ValueError, match="different sites"):
        bad.fit_transform(tiny)


def test_union_detects_disagreeing_turn_counts(tiny):
    class Short(FakeSites):
        def transform(self, X):
            return TurnFeatures(np.zeros((len(X), 1)), np.arange(len(X) + 1))

    union = TurnFeatureUnion([("pos", TurnPositionTransformer()), ("short", Short())])
    with pytest.raises(ValueError, match="'pos' and 'short' disagree.*conversation 0"):
        union.fit_transform(tiny)


def test_union_verbose(tiny, capsys):
    TurnFeatureUnion([("pos", TurnPositionTransformer())], verbose=True).fit(tiny)
    assert "(step 1 of 1) Processing pos" in capsys.readouterr().out


# ------------------------------------------------------------- site concatenator
def test_site_concatenator():
    X = TurnFeatures(np.arange(24.0).reshape(4, 3, 2), [0, 3, 4], sites=["a", "b", "c"],
                     feature_names=["f0", "f1"], speakers=list("pqrs"), task_ids=["t", "u"])
    sc = SiteConcatenator(["c", "a"]).fit(X)
    Xt = sc.transform(X)
    assert Xt.sites == ("c+a",)
    assert Xt.feature_names == ("c__f0", "c__f1", "a__f0", "a__f1")
    np.testing.assert_array_equal(Xt.turn_matrix(), np.concatenate(
        [X.turn_matrix("c"), X.turn_matrix("a")], axis=1))
    assert Xt.speakers.tolist() == list("pqrs") and Xt.task_ids.tolist() == ["t", "u"]
    with pytest.raises(ValueError, match=r"\['zz'\] not in the input"):
        SiteConcatenator(["a", "zz"]).fit(X)
    with pytest.raises(ValueError, match="duplicate"):
        SiteConcatenator(["a", "a"]).fit(X)
    with pytest.raises(ValueError, match="not in this input"):
        sc.transform(X.select_sites(["a", "b"]))


# -------------------------------------------------------------- dummy classifier
def convs_of_lengths(*lengths):
    return [conv([f"s{k}" for k in range(n)], task_id=f"t{i}") for i, n in enumerate(lengths)]


@pytest.mark.parametrize("as_features", [False, True])
def test_dummy_first_constant_clipping(as_features):
    convs = convs_of_lengths(1, 3, 6)
    X = TurnPositionTransformer().fit_transform(convs) if as_features else convs
    y = [0, 2, 4]
    first = DummyStepClassifier().fit(X, y)
    assert first.predict(X).tolist() == [0, 0, 0]
    assert first.score(X, y) == pytest.approx(1 / 3)
    c4 = DummyStepClassifier(strategy="constant", constant=4).fit(X, y)
    assert c4.predict(X).tolist() == [0, 2, 4]  # clipped to each last turn
    assert c4.predict(X).dtype.kind == "i"
    assert c4.predict_agent(X).tolist() == ["s0", "s2", "s4"]
    last = DummyStepClassifier(strategy="constant", constant=-1).fit(X, y)
    assert last.predict(X).tolist() == [0, 2, 5]
    m3 = DummyStepClassifier(strategy="constant", constant=-3).fit(X, y)
    assert m3.predict(X).tolist() == [0, 0, 3]  # clipped to the first turn
    assert c4.expected_accuracy(X, y) == 1.0
    proba = c4.turn_predict_proba(X)
    assert [p.tolist() for p in proba] == [[1.0], [0, 0, 1.0], [0, 0, 0, 0, 1.0, 0]]
    assert all(np.array_equal(a, b) for a, b in zip(c4.turn_decision_function(X), proba))


def test_dummy_most_frequent_ties_and_clipping():
    X = convs_of_lengths(5, 5, 5, 5, 2)
    d = DummyStepClassifier(strategy="most_frequent").fit(X, [3, 1, 3, 1, 0])
    assert d.most_frequent_step_ == 1  # tie 1 vs 3 -> smallest
    assert d.step_counts_.tolist() == [1, 2, 0, 2]
    d = DummyStepClassifier(strategy="most_frequent").fit(X, [3, 3, 1, 3, 1])
    assert d.most_frequent_step_ == 3
    assert d.predict(convs_of_lengths(10, 2, 1)).tolist() == [3, 1, 0]


def test_dummy_most_frequent_relative():
    # relative positions of y: 8/9 -> bin 8, 4/5 -> bin 8, 1/2 -> bin 5
    X = convs_of_lengths(10, 6, 3)
    d = DummyStepClassifier(strategy="most_frequent_relative").fit(X, [8, 4, 1])
    assert d.relative_bin_counts_.tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 2, 0]
    assert d.most_frequent_bin_ == 8
    # bin 8 = [0.8, 0.9), centre 0.85: nearest turn of n=11 is 8 (0.8) vs 9 (0.9): tie
    # -> earlier (8); n=21 -> 17 (0.85); n=3 -> 2 (1.0); n=1 -> 0; n=2 -> 1
    assert d.predict(convs_of_lengths(11, 21, 3, 1, 2)).tolist() == [8, 17, 2, 0, 1]
    d5 = DummyStepClassifier(strategy="most_frequent_relative", n_bins=5).fit(X, [8, 4, 1])
    assert d5.relative_bin_counts_.tolist() == [0, 0, 1, 0, 2]  # 0.5 -> bin 2, 0.8/0.89 -> 4
    assert d5.predict(convs_of_lengths(11)).tolist() == [9]  # centre 0.9


def test_dummy_uniform_reproducible_and_expected_accuracy():
    X = convs_of_lengths(*([2, 4, 5, 10] * 50))
    y = np.zeros(len(X), dtype=int)
    d = DummyStepClassifier(strategy="uniform", random_state=0).fit(X, y)
    p1, p2 = d.predict(X), d.predict(X)
    np.testing.assert_array_equal(p1, p2)
    assert np.all((p1 >= 0) & (p1 < [len(c) for c in X]))
    assert len(set(p1[3::4])) > 5  # actually random over the 10-turn conversations
    assert not np.array_equal(
        p1, DummyStepClassifier(strategy="uniform", random_state=1).fit(X, y).predict(X))
    assert d.expected_accuracy(X, y) == pytest.approx(np.mean([1 / 2, 1 / 4, 1 / 5, 1 / 10]))
    assert abs(d.score(X, y) - d.expected_accuracy(X, y)) < 0.1
    proba = d.turn_predict_proba(X[:2])
    assert [p.tolist() for p in proba] == [[0.5, 0.5], [0.25] * 4]
    assert d.__sklearn_tags__().non_deterministic


@pytest.mark.parametrize("params, y, match", [
    (dict(strategy="nope"), [0], "'strategy' parameter of DummyStepClassifier"),
    (dict(strategy="constant"), [0], "needs an int constant"),
    (dict(), [3], r"y\[0\]=3 is outside conversation 0 \(task 't0'\)"),
    (dict(), [0, 1], "1 conversations"),
    (dict(), [0.5], "not an integer"),
    (dict(), None, "required"),
    (dict(n_bins=0), [0], "n_bins"),
])
def test_dummy_errors(params, y, match):
    with pytest.raises(ValueError, match=match):
        DummyStepClassifier(**params).fit(convs_of_lengths(2), y)


def test_dummy_in_grouped_cross_validation():
    convs, y = synthetic(24, seed=3, last_is_decisive=False)
    groups = [c.task_id for c in convs]
    scores = cross_val_score(DummyStepClassifier(strategy="constant", constant=-1),
                             convs, y, groups=groups, cv=GroupKFold(3))
    expected = np.mean(y == np.array([len(c) - 1 for c in convs]))
    assert scores.shape == (3,) and np.mean(scores) == pytest.approx(expected, abs=0.1)


# -------------------------------------------------- probe vs dummy on synthetic data
def test_logistic_probe_on_position_beats_first_dummy():
    from sklearn.pipeline import Pipeline

    from skafa import probes as estimators

    train, y_train = synthetic(40, seed=0)
    test, y_test = synthetic(30, seed=1)
    probe = Pipeline([("pos", TurnPositionTransformer()),
                      ("clf", estimators.GroupedArgmaxLogisticClassifier())])
    probe.fit(train, y_train)
    dummy = DummyStepClassifier().fit(train, y_train)
    assert dummy.score(test, y_test) == 0.0  # every conversation has >= 2 turns
    assert probe.score(test, y_test) >= 0.9


# ---------------------------------------------------------- clone / pickle round trip
@pytest.mark.parametrize("make", [
    lambda: TurnPositionTransformer(max_index=3, min_speaker_frequency=1),
    lambda: TurnTextTransformer(CountVectorizer(), include_speaker=True),
    lambda: TurnFeatureUnion([("pos", TurnPositionTransformer()), ("fake", FakeSites())]),
])
def test_transformer_clone_and_pickle(make, tiny):
    est = make()
    c = clone(est)
    assert c.get_params(deep=False).keys() == est.get_params(deep=False).keys()
    Xt = est.fit_transform(tiny)
    back = pickle.loads(pickle.dumps(est))
    assert back.transform(tiny).equals(Xt)


def test_dummy_clone_and_pickle():
    X = convs_of_lengths(3, 4, 5)
    d = DummyStepClassifier(strategy="uniform", random_state=7).fit(X, [0, 1, 2])
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(d)).predict(X), d.predict(X))
    c = clone(d)
    assert c.get_params() == d.get_params() and not hasattr(c, "step_counts_")
    assert d.__sklearn_tags__().estimator_type is None


# ------------------------------------------------------------------- Who&When data
def test_who_and_when_records_featurise():
    folder = who_and_when_dir() / "Algorithm-Generated"
    if not folder.is_dir():
        pytest.skip(f"Who&When data not found at {folder} (set SKAFA_WHO_AND_WHEN)")
    files = sorted(folder.glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else 0)
    convs = [Conversation.from_who_and_when(json.loads(f.read_text()),
                                            record_id=f"Algorithm-Generated/{f.stem}")
             for f in files[:40]]
    y = np.asarray([c.mistake_step for c in convs])
    union = TurnFeatureUnion([("pos", TurnPositionTransformer()),
                              ("text", TurnTextTransformer())])
    Xt = union.fit_transform(convs[:30])
    Xs = union.transform(convs[30:])
    for X, part in ((Xt, convs[:30]), (Xs, convs[30:])):
        assert X.n_turns.tolist() == [len(c) for c in part]
        assert X.is_sparse and np.all(np.isfinite(X.values.data))
        assert X.speakers.tolist() == [t.speaker for c in part for t in c.turns]
    assert Xt.n_features > 100
    pos = union.named_transformers_.pos
    assert "speaker=Computer_terminal" in pos.get_feature_names_out()
    d = DummyStepClassifier(strategy="most_frequent").fit(Xt, y[:30])
    assert 0.0 <= d.score(Xs, y[30:]) <= 1.0
    assert d.predict_agent(Xs).shape == (10,)
