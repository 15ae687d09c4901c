"""Tests for skafa.model_selection.TurnScoreStacker."""

import numpy as np
import pytest
import sklearn
from sklearn.base import BaseEstimator, clone
from sklearn.model_selection import (
    GridSearchCV,
    GroupKFold,
    KFold,
    ShuffleSplit,
    cross_val_score,
    cross_validate,
)

from skafa import (
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
    SiteConcatenator,
    TurnFeatures,
    TurnPositionTransformer,
    TurnScoreStacker,
    TurnTextTransformer,
    make_attribution_pipeline,
)
from skafa.persistence import load, save
from skafa.testing import make_conversations


def two_views(n, *, n_turns=5, signal=1.2, seed=0):
    """Decisive-turn signal split over two sites, independent noise at each."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(0, n * n_turns + 1, n_turns)
    y = rng.integers(0, n_turns, size=n)
    values = rng.normal(size=(n * n_turns, 2, 3))
    values[offsets[:-1] + y, :, 0] += signal
    X = TurnFeatures(values, offsets, sites=["a", "b"],
                     task_ids=[f"t{i // 2}" for i in range(n)],
                     speakers=[f"agent{j % 3}" for j in range(n * n_turns)])
    return X, y


def view(site, probe=None):
    return make_attribution_pipeline(SiteConcatenator([site]),
                                     probe or GroupedSoftmaxClassifier())


def stacker(**kw):
    kw.setdefault("cv", GroupKFold(4))
    return TurnScoreStacker([("a", view("a")), ("b", view("b"))], **kw)


class Memoriser(BaseEstimator):
    """Knows the decisive turn of every training conversation, nothing else.

    Its turn scores are a one-hot of the memorised step for a conversation it was
    fitted on, and zero for any other: perfect in-sample, useless out of sample.
    """

    def fit(self, X, y, groups=None):
        self.memory_ = {self._key(X, i): int(s) for i, s in enumerate(y)}
        return self

    @staticmethod
    def _key(X, i):
        return X.values[X.offsets[i]].tobytes()

    def turn_decision_function(self, X):
        out = []
        for i, n in enumerate(X.n_turns):
            s = np.zeros(n)
            step = self.memory_.get(self._key(X, i))
            if step is not None:
                s[step] = 10.0
            out.append(s)
        return out

    def predict(self, X):
        return np.array([int(np.argmax(s)) for s in self.turn_decision_function(X)])


# ------------------------------------------------------------------ leakage
def test_memorising_base_gets_no_weight_from_out_of_fold_scores():
    X, y = two_views(60, seed=1)
    X_te, _ = two_views(200, seed=2)
    stack = TurnScoreStacker([("honest", view("a")), ("memo", Memoriser())],
                             cv=GroupKFold(4)).fit(X, y)
    coef = dict(zip(stack.feature_names_, stack.final_estimator_.coef_.ravel()))
    assert abs(coef["memo"]) < 1e-8 < coef["honest"]
    honest = view("a").fit(X, y)
    np.testing.assert_array_equal(stack.predict(X_te), honest.predict(X_te))
    # the same final model fitted on in-sample scores would trust the memoriser:
    # that is the leak out-of-fold scores prevent (and what this test would catch)
    memo = Memoriser().fit(X, y)
    inside = TurnFeatures(np.column_stack([
        np.concatenate(honest.turn_decision_function(X)),
        np.concatenate(memo.turn_decision_function(X))]), X.offsets)
    leaky = GroupedSoftmaxClassifier().fit(inside, y)
    assert 10 * leaky.coef_[0, 1] > 3.0         # a logit margin of > 3 for the memoriser
    assert leaky.score(inside, y) == 1.0


def test_out_of_fold_scores_come_from_models_that_did_not_see_the_conversation():
    X, y = two_views(40, seed=3)
    cv = list(GroupKFold(4).split(X, y, groups=X.task_ids))
    stack = TurnScoreStacker([("a", view("a"))], cv=cv,
                             final_estimator=_Recorder()).fit(X, y)
    Z = stack.final_estimator_.X_
    for train, test in cv:
        fold = view("a").fit(X[train], y[train])
        expected = np.concatenate(fold.turn_decision_function(X[test]))
        got = np.concatenate([Z[int(i)][:, 0] for i in test])
        np.testing.assert_allclose(got, expected)
    assert Z.feature_names == ("a",) and Z.task_ids.tolist() == list(X.task_ids)


class _Recorder(GroupedSoftmaxClassifier):
    """Final estimator that keeps what it was fitted on."""

    def fit(self, X, y, groups=None):
        super().fit(X, y)
        self.X_ = X
        return self


# --------------------------------------------------------------- benefit
def test_stacking_beats_the_best_single_base_on_complementary_signal():
    gains = []
    for seed in range(2):
        X, y = two_views(60, seed=10 + seed)
        X_te, y_te = two_views(300, seed=20 + seed)
        best_single = max(view(s).fit(X, y).score(X_te, y_te) for s in ("a", "b"))
        gains.append(stacker().fit(X, y).score(X_te, y_te) - best_single)
    assert np.mean(gains) > 0.05


def test_on_conversations_with_position_and_tfidf():
    convs = make_conversations(32, seed=4)
    y = np.array([c.mistake_step for c in convs])
    stack = TurnScoreStacker(
        [("position", make_attribution_pipeline(TurnPositionTransformer(),
                                                GroupedArgmaxLogisticClassifier())),
         ("tfidf", make_attribution_pipeline(TurnTextTransformer(),
                                             GroupedSoftmaxClassifier())),
         ("off", "drop")],
        cv=GroupKFold(4)).fit(convs[:24], y[:24])
    assert stack.feature_names_ == ("position", "tfidf")
    assert set(stack.named_estimators_) == {"position", "tfidf"}
    test = convs[24:]
    agents = stack.predict_agent(test)
    steps = stack.predict(test)
    assert agents.tolist() == [c.speakers[s] for c, s in zip(test, steps)]
    proba = stack.turn_predict_proba(test)
    assert [len(p) for p in proba] == [len(c) for c in test]
    assert np.allclose([p.sum() for p in proba], 1.0)
    assert 0.0 <= stack.score(test, y[24:]) <= 1.0


# ------------------------------------------------------------ sklearn API
def test_clone_params_grid_search_and_cross_val_score():
    X, y = two_views(48, seed=5)
    groups = np.arange(48) // 2
    est = stacker(cv=GroupKFold(3))
    params = est.get_params()
    assert "a__groupedsoftmaxclassifier__C" in params and "final_estimator" in params
    c = clone(est).set_params(a__groupedsoftmaxclassifier__C=0.5)
    assert c.named_estimators["a"][-1].C == 0.5
    search = GridSearchCV(est, {"final_estimator": [None, GroupedSoftmaxClassifier(C=0.01)]},
                          cv=GroupKFold(3)).fit(X, y, groups=groups)
    assert search.best_estimator_.predict(X).shape == (48,)
    scores = cross_val_score(est, X, y, groups=groups, cv=GroupKFold(3))
    assert scores.shape == (3,) and scores.mean() > 0.3


def test_groups_routed_with_metadata_routing():
    X, y = two_views(40, seed=6)
    X = TurnFeatures(X.values, X.offsets, sites=X.sites)        # no task ids
    groups = np.arange(40) // 2
    with pytest.raises(ValueError, match="needs groups"):
        stacker().fit(X, y)
    stacker().fit(X, y, groups=groups)
    with sklearn.config_context(enable_metadata_routing=True):
        res = cross_validate(stacker(cv=GroupKFold(3)), X, y, cv=GroupKFold(3),
                             params={"groups": groups})
    assert res["test_score"].shape == (3,)
    stacker(cv=KFold(4)).fit(X, y)            # an ungrouped splitter needs none


def test_input_errors():
    X, y = two_views(20, seed=7)
    with pytest.raises(ValueError, match="partition"):
        stacker(cv=ShuffleSplit(3, random_state=0)).fit(X, y)
    with pytest.raises(TypeError, match="turn_decision_function"):
        TurnScoreStacker([("bad", _NoScores())], cv=GroupKFold(2)).fit(X, y)
    with pytest.raises(ValueError, match="'drop'"):
        TurnScoreStacker([("x", "drop")]).fit(X, y)
    with pytest.raises(ValueError, match="unique"):
        TurnScoreStacker([("a", view("a")), ("a", view("b"))]).fit(X, y)
    with pytest.raises(TypeError, match="list of Conversation"):
        stacker().fit("not conversations", y)


class _NoScores(BaseEstimator):
    def fit(self, X, y):
        return self

    def predict(self, X):
        return np.zeros(len(X), dtype=int)


def test_save_load_roundtrip(tmp_path):
    X, y = two_views(40, seed=8)
    stack = stacker(final_estimator=GroupedSoftmaxClassifier(C=2.0)).fit(X, y)
    loaded = load(save(stack, tmp_path / "stack"))
    assert repr(loaded) == repr(stack)
    assert loaded.feature_names_ == stack.feature_names_
    for a, b in zip(loaded.turn_predict_proba(X), stack.turn_predict_proba(X)):
        assert a.tobytes() == b.tobytes()
    assert loaded.named_estimators_["a"] is loaded.estimators_[0]
    np.testing.assert_array_equal(loaded.predict_agent(X), stack.predict_agent(X))
