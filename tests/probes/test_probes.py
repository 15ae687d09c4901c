"""Tests for skafa.probes (grouped-argmax probes) and skafa.compose.PerTurn."""

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import BaseEstimator, clone
from sklearn.decomposition import PCA, TruncatedSVD
from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.naive_bayes import GaussianNB
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC

from skafa import (
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
    PerTurn,
    TurnFeatures,
)


def make_planted(n=120, *, n_features=8, signal=3.0, n_sites=1, signal_site=0,
                 min_turns=3, max_turns=12, seed=0, task_ids=True, speakers=True):
    """Synthetic TurnFeatures: the decisive turn has +signal on feature 0."""
    rng = np.random.default_rng(seed)
    n_turns = rng.integers(min_turns, max_turns + 1, size=n)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n) * n_turns).astype(np.int64)
    values = rng.normal(size=(offsets[-1], n_sites, n_features))
    values[offsets[:-1] + y, signal_site, 0] += signal
    if n_sites == 1:
        values = values[:, 0, :]
    X = TurnFeatures(
        values,
        offsets,
        sites=None if n_sites == 1 else [f"s{k}" for k in range(n_sites)],
        speakers=[f"agent{j % 3}" for j in range(offsets[-1])] if speakers else None,
        task_ids=[f"task{i // 2}" for i in range(n)] if task_ids else None,
    )
    return X, y


def chance(X):
    """Expected step accuracy of a uniformly random turn."""
    return float(np.mean(1.0 / X.n_turns))


@pytest.fixture(scope="module")
def planted():
    X, y = make_planted(160)
    return X[:100], y[:100], X[100:], y[100:]


PROBES = [
    GroupedArgmaxLogisticClassifier(),
    GroupedArgmaxClassifier(),
    GroupedArgmaxClassifier(LinearSVC()),  # decision_function
    GroupedArgmaxClassifier(HistGradientBoostingClassifier(max_iter=30)),
    GroupedArgmaxClassifier(RandomForestClassifier(n_estimators=30, random_state=0)),
    GroupedArgmaxClassifier(GaussianNB()),  # predict_proba only
]


# --------------------------------------------------------------- learning
@pytest.mark.parametrize("probe", PROBES, ids=lambda e: repr(e)[:60])
def test_planted_signal_is_found(planted, probe):
    X_tr, y_tr, X_te, y_te = planted
    probe = clone(probe).fit(X_tr, y_tr)
    acc = probe.score(X_te, y_te)
    assert chance(X_te) < 0.2
    assert acc > 0.6, acc
    pred = probe.predict(X_te)
    assert pred.dtype.kind == "i" and pred.shape == (len(X_te),)
    assert np.all((pred >= 0) & (pred < X_te.n_turns))
    assert acc == pytest.approx(np.mean(pred == y_te))


def random_steps(X, seed):
    """Steps drawn independently of the features (a null target)."""
    rng = np.random.default_rng(seed)
    return (rng.random(len(X)) * X.n_turns).astype(np.int64)


def test_labels_unrelated_to_features_stay_near_chance(planted):
    # Null control: train and test steps drawn independently of the features.
    # (A plain permutation of y is not a clean null with ragged conversations:
    # permuted steps still hit the planted turn more often among positives than
    # among negatives when conversation lengths vary, and the argmax amplifies it.)
    X_tr, _, X_te, _ = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, random_steps(X_tr, 1))
    acc = probe.score(X_te, random_steps(X_te, 2))
    assert chance(X_te) < 0.2
    assert acc < 0.35, acc  # planted accuracy is > 0.6


def test_response_method(planted):
    X_tr, y_tr, _, _ = planted
    assert GroupedArgmaxClassifier(LinearSVC()).fit(X_tr, y_tr).response_method_ == (
        "decision_function"
    )
    assert GroupedArgmaxClassifier(GaussianNB()).fit(X_tr, y_tr).response_method_ == (
        "predict_proba"
    )


def test_default_estimator_is_logistic_regression(planted):
    X_tr, y_tr, _, _ = planted
    probe = GroupedArgmaxClassifier().fit(X_tr, y_tr)
    assert isinstance(probe.estimator_, LogisticRegression)
    assert probe.estimator is None  # parameter untouched
    assert probe.site_ == "features" and probe.n_features_in_ == 8
    assert not hasattr(probe, "classes_")
    assert not hasattr(probe, "decision_function")
    assert not hasattr(probe, "predict_proba")


def test_logistic_specialization_attributes(planted):
    X_tr, y_tr, X_te, _ = planted
    probe = GroupedArgmaxLogisticClassifier(C=0.5).fit(X_tr, y_tr)
    assert isinstance(probe.scaler_, StandardScaler)
    assert probe.coef_.shape == (1, 8) and probe.intercept_.shape == (1,)
    assert probe.n_iter_.shape == (1,)
    logistic = probe.estimator_.named_steps["logistic"]
    assert logistic.C == 0.5 and logistic.class_weight == "balanced"
    # coef_/intercept_ live in the original feature space.
    raw = X_te.turn_matrix() @ probe.coef_.ravel() + probe.intercept_[0]
    np.testing.assert_allclose(
        np.concatenate(probe.turn_decision_function(X_te)), raw, rtol=1e-8, atol=1e-8
    )
    # The scaler holds the training rows' statistics.
    np.testing.assert_allclose(probe.scaler_.mean_, X_tr.turn_matrix().mean(axis=0))

    plain = GroupedArgmaxLogisticClassifier(standardize=False).fit(X_tr, y_tr)
    assert plain.scaler_ is None and isinstance(plain.estimator_, LogisticRegression)
    raw = X_te.turn_matrix() @ plain.coef_.ravel() + plain.intercept_[0]
    np.testing.assert_allclose(np.concatenate(plain.turn_decision_function(X_te)), raw)


def test_no_future_warnings_from_our_code(planted):
    X_tr, y_tr, _, _ = planted
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
        GroupedArgmaxClassifier().fit(X_tr, y_tr)


def test_invalid_parameter_is_rejected_in_fit(planted):
    X_tr, y_tr, _, _ = planted
    probe = GroupedArgmaxLogisticClassifier(C=-1.0)  # __init__ does not validate
    with pytest.raises(ValueError, match="'C' parameter"):
        probe.fit(X_tr, y_tr)


# ------------------------------------------------------- per-turn outputs
def test_turn_scores_and_probabilities(planted):
    X_tr, y_tr, X_te, _ = planted
    for probe in (GroupedArgmaxLogisticClassifier(), GroupedArgmaxClassifier(GaussianNB())):
        probe.fit(X_tr, y_tr)
        scores = probe.turn_decision_function(X_te)
        proba = probe.turn_predict_proba(X_te)
        assert isinstance(scores, list) and len(scores) == len(X_te)
        assert [s.shape[0] for s in scores] == X_te.n_turns.tolist()
        for s, p in zip(scores, proba):
            assert s.ndim == 1 and p.shape == s.shape
            assert np.all(p >= 0)
            assert p.sum() == pytest.approx(1.0)
            assert np.argmax(p) == np.argmax(s)
        np.testing.assert_array_equal(
            probe.predict(X_te), [int(np.argmax(s)) for s in scores]
        )


def test_softmax_matches_definition(planted):
    X_tr, y_tr, X_te, _ = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    for s, p in zip(probe.turn_decision_function(X_te), probe.turn_predict_proba(X_te)):
        e = np.exp(s - s.max())
        np.testing.assert_allclose(p, e / e.sum())


class _ConstantScorer(LogisticRegression):
    """Binary model whose turn scores are fixed by the test (ties, NaN)."""

    def __init__(self, scores=None):
        super().__init__()
        self.scores = scores

    def decision_function(self, X):
        return np.asarray(self.scores, dtype=float)[: X.shape[0]]


def test_ties_go_to_earliest_turn():
    X = TurnFeatures(np.zeros((7, 2)), [0, 3, 7])
    # conversation 0: scores (1, 5, 5) -> turn 1; conversation 1: all equal -> turn 0
    scores = [1.0, 5.0, 5.0, 2.0, 2.0, 2.0, 2.0]
    probe = GroupedArgmaxClassifier(_ConstantScorer(scores)).fit(X, [0, 1])
    np.testing.assert_array_equal(probe.predict(X), [1, 0])
    proba = probe.turn_predict_proba(X)
    np.testing.assert_allclose(proba[1], np.full(4, 0.25))


def test_non_finite_turn_score_raises():
    X = TurnFeatures(np.zeros((5, 2)), [0, 2, 5], task_ids=["a", "b"])
    scores = [0.0, 1.0, 0.5, np.nan, 0.2]
    probe = GroupedArgmaxClassifier(_ConstantScorer(scores)).fit(X, [0, 1])
    msg = r"non-finite score .*conversation 1 \(task 'b'\), turn 1"
    with pytest.raises(ValueError, match=msg):
        probe.predict(X)
    with pytest.raises(ValueError, match=msg):
        probe.turn_predict_proba(X)


def test_vectorised_argmax_matches_loop():
    rng = np.random.default_rng(3)
    from skafa.utils.grouped import grouped_argmax as _grouped_argmax

    n_turns = rng.integers(1, 9, size=500)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    scores = rng.integers(0, 4, size=offsets[-1]).astype(float)  # many ties
    expected = [int(np.argmax(scores[a:b])) for a, b in zip(offsets[:-1], offsets[1:])]
    np.testing.assert_array_equal(_grouped_argmax(scores, offsets), expected)


def test_predict_agent(planted):
    X_tr, y_tr, X_te, y_te = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    agents = probe.predict_agent(X_te)
    pred = probe.predict(X_te)
    expected = X_te.speakers[X_te.offsets[:-1] + pred]
    assert agents.dtype == object
    np.testing.assert_array_equal(agents, expected)


def test_predict_agent_without_speakers(planted):
    X_tr, y_tr, _, _ = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    X, _ = make_planted(5, speakers=False)
    with pytest.raises(ValueError, match="carries no speakers"):
        probe.predict_agent(X)


# ----------------------------------------------------------------- sites
def test_site_handling():
    X, y = make_planted(60, n_sites=3, signal_site=2)
    with pytest.raises(ValueError, match=r"X.select_sites.*SiteSelector"):
        GroupedArgmaxLogisticClassifier().fit(X, y)
    probe = GroupedArgmaxLogisticClassifier(site="s2").fit(X, y)
    assert probe.site_ == "s2"
    assert probe.score(X, y) > 0.6
    # Predicting on the single site, or on the full container, reads s2.
    np.testing.assert_array_equal(probe.predict(X), probe.predict(X.select_sites("s2")))
    with pytest.raises(ValueError, match="fitted on site 's2'"):
        probe.predict(X.select_sites("s0"))
    by_index = GroupedArgmaxLogisticClassifier(site=2).fit(X, y)
    assert by_index.site_ == "s2"
    with pytest.raises(ValueError, match="not in X"):
        GroupedArgmaxLogisticClassifier(site="nope").fit(X, y)
    with pytest.raises(ValueError, match="out of range"):
        GroupedArgmaxLogisticClassifier(site=7).fit(X, y)
    single = GroupedArgmaxLogisticClassifier().fit(X.select_sites("s2"), y)
    assert single.site_ == "s2"


def test_predict_with_different_n_features(planted):
    X_tr, y_tr, _, _ = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    X_small = TurnFeatures(np.zeros((6, 5)), [0, 3, 6])
    with pytest.raises(ValueError, match="5 features per turn.*fitted with 8"):
        probe.predict(X_small)


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "bad_X", [np.zeros((4, 3)), [np.zeros((2, 3)), np.zeros((3, 3))], None]
)
@pytest.mark.parametrize(
    "est", [GroupedArgmaxLogisticClassifier(), GroupedArgmaxClassifier(), PerTurn(PCA())]
)
def test_not_turn_features_raises_type_error(bad_X, est):
    with pytest.raises(TypeError, match="TurnActivationTransformer"):
        est.fit(bad_X, [0, 1])


def test_predict_not_turn_features(planted):
    X_tr, y_tr, _, _ = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    with pytest.raises(TypeError, match="expects a skafa.TurnFeatures"):
        probe.predict(np.zeros((3, 8)))


def test_y_errors():
    X = TurnFeatures(np.zeros((7, 2)), [0, 3, 7], task_ids=["a", "b"])
    probe = GroupedArgmaxLogisticClassifier()
    with pytest.raises(ValueError, match="3 entries but X holds 2"):
        probe.fit(X, [0, 1, 2])
    with pytest.raises(ValueError, match=r"outside conversation 1 \(task 'b'\)"):
        probe.fit(X, [0, 4])
    with pytest.raises(ValueError, match=r"negative.*conversation 0 \(task 'a'\)"):
        probe.fit(X, [-1, 0])
    with pytest.raises(ValueError, match=r"y\[1\]=1.5 is not an integer.*task 'b'"):
        probe.fit(X, [0.0, 1.5])
    with pytest.raises(ValueError, match=r"y\[0\]=nan"):
        probe.fit(X, [np.nan, 1.0])
    with pytest.raises(ValueError, match="integer turn indices"):
        probe.fit(X, ["a", "b"])
    with pytest.raises(ValueError, match="integer turn indices"):
        probe.fit(X, [True, False])
    with pytest.raises(ValueError, match="y is required"):
        probe.fit(X, None)
    with pytest.raises(ValueError, match="1-D"):
        probe.fit(X, np.zeros((2, 2), dtype=int))
    # Integral floats are accepted.
    X2, y2 = make_planted(20)
    GroupedArgmaxLogisticClassifier().fit(X2, y2.astype(float))


def test_score_checks_y(planted):
    X_tr, y_tr, X_te, y_te = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    with pytest.raises(ValueError, match="entries but X holds"):
        probe.score(X_te, y_te[:-1])


def test_score_sample_weight(planted):
    X_tr, y_tr, X_te, y_te = planted
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    hits = probe.predict(X_te) == y_te
    assert 0 < hits.mean() < 1
    assert probe.score(X_te, y_te, sample_weight=hits.astype(float)) == 1.0
    assert probe.score(X_te, y_te, sample_weight=(~hits).astype(float)) == 0.0
    assert probe.score(X_te, y_te, sample_weight=np.ones(len(X_te))) == pytest.approx(
        hits.mean()
    )


def test_single_turn_conversations_only():
    X = TurnFeatures(np.random.default_rng(0).normal(size=(4, 8)), [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="single turn.*no negative"):
        GroupedArgmaxLogisticClassifier().fit(X, [0, 0, 0, 0])
    # ... but predicting on them is fine (the only turn is the answer).
    X_tr, y_tr = make_planted(20)
    probe = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
    np.testing.assert_array_equal(probe.predict(X), [0, 0, 0, 0])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features_fit_and_predict(bad):
    X, y = make_planted(10, task_ids=True)
    values = X.values.copy()
    row = X.offsets[3] + 1
    values[row, 5] = bad
    X_bad = TurnFeatures(values, X.offsets, task_ids=X.task_ids)
    msg = (r"non-finite feature.*conversation 3 \(task 'task1'\), turn 1, "
           r"site 'features', feature 5")
    with pytest.raises(ValueError, match=msg):
        GroupedArgmaxLogisticClassifier().fit(X_bad, y)
    probe = GroupedArgmaxLogisticClassifier().fit(X, y)
    with pytest.raises(ValueError, match=msg):
        probe.predict(X_bad)
    with pytest.raises(ValueError, match=msg):
        probe.turn_decision_function(X_bad)


def test_non_finite_sparse_features():
    X, y = make_planted(10, task_ids=False)
    values = sp.csr_matrix(X.values)
    values.data[values.indptr[X.offsets[2]] + 2] = np.nan
    X_bad = TurnFeatures(values, X.offsets)
    with pytest.raises(ValueError, match=r"non-finite feature.*conversation 2, turn 0"):
        GroupedArgmaxLogisticClassifier().fit(X_bad, y)


class _FitOnly(BaseEstimator):
    """A binary model that can neither score nor give probabilities."""

    def fit(self, X, y):
        return self


def test_estimator_without_scores_raises(planted):
    X_tr, y_tr, _, _ = planted
    with pytest.raises(TypeError, match="neither decision_function nor predict_proba"):
        GroupedArgmaxClassifier(_FitOnly()).fit(X_tr, y_tr)


def test_not_fitted(planted):
    from sklearn.exceptions import NotFittedError

    _, _, X_te, _ = planted
    for method in ("predict", "turn_decision_function", "turn_predict_proba"):
        with pytest.raises(NotFittedError):
            getattr(GroupedArgmaxLogisticClassifier(), method)(X_te)


# -------------------------------------------------------------- sparse
def test_sparse_tfidf_like_input():
    """Sparse single-block features (e.g. TF-IDF of turn texts) work end to end."""
    X, y = make_planted(120, task_ids=False)
    dense = np.abs(X.values)
    dense[dense < 1.0] = 0.0  # mostly zeros
    Xs = TurnFeatures(sp.csr_matrix(dense), X.offsets)
    assert Xs.is_sparse
    probe = GroupedArgmaxLogisticClassifier().fit(Xs[:80], y[:80])
    assert probe.scaler_.with_mean is False
    assert probe.score(Xs[80:], y[80:]) > 0.5
    # Same predictions as on the dense copy with the same (mean-free) scaling.
    dense_probe = GroupedArgmaxClassifier(
        Pipeline([("s", StandardScaler(with_mean=False)),
                  ("l", LogisticRegression(class_weight="balanced", max_iter=1000))])
    ).fit(TurnFeatures(dense, X.offsets)[:80], y[:80])
    np.testing.assert_array_equal(
        probe.predict(Xs[80:]), dense_probe.predict(TurnFeatures(dense, X.offsets)[80:])
    )
    # PerTurn(TruncatedSVD) on sparse input stays inside the pipeline contract.
    pipe = Pipeline([
        ("svd", PerTurn(TruncatedSVD(n_components=4, random_state=0))),
        ("probe", GroupedArgmaxLogisticClassifier()),
    ]).fit(Xs[:80], y[:80])
    assert pipe.predict(Xs[80:]).shape == (40,)


# --------------------------------------------------------------- PerTurn
def test_per_turn_fits_on_training_turns_only(planted):
    X_tr, y_tr, X_te, y_te = planted
    pipe = Pipeline([
        ("scale", PerTurn(StandardScaler())),
        ("probe", GroupedArgmaxLogisticClassifier(standardize=False)),
    ]).fit(X_tr, y_tr)
    per_turn = pipe.named_steps["scale"]
    fitted = per_turn.transformers_["features"]
    np.testing.assert_allclose(fitted.mean_, X_tr.turn_matrix().mean(axis=0))
    assert not np.allclose(fitted.mean_, X_te.turn_matrix().mean(axis=0))
    assert pipe.score(X_te, y_te) > 0.6


def test_per_turn_preserves_container(planted):
    X, y = make_planted(30, n_sites=3, signal_site=1)
    Xt = PerTurn(StandardScaler()).fit_transform(X)
    assert isinstance(Xt, TurnFeatures)
    np.testing.assert_array_equal(Xt.offsets, X.offsets)
    np.testing.assert_array_equal(Xt.speakers, X.speakers)
    np.testing.assert_array_equal(Xt.task_ids, X.task_ids)
    assert Xt.sites == X.sites
    for site in X.sites:  # one scaler per site
        np.testing.assert_allclose(Xt.turn_matrix(site).mean(axis=0), 0.0, atol=1e-12)
        np.testing.assert_allclose(Xt.turn_matrix(site).std(axis=0), 1.0)


def test_per_turn_per_site_clones_and_pca():
    X, y = make_planted(30, n_sites=2, n_features=6)
    pt = PerTurn(PCA(n_components=3)).fit(X)
    assert set(pt.transformers_) == {"s0", "s1"}
    assert pt.transformers_["s0"] is not pt.transformers_["s1"]
    assert pt.transformer not in pt.transformers_.values()
    Xt = pt.transform(X)
    assert Xt.n_features == 3 and Xt.n_sites == 2
    np.testing.assert_allclose(
        Xt.turn_matrix("s1"), pt.transformers_["s1"].transform(X.turn_matrix("s1"))
    )
    assert list(pt.get_feature_names_out()) == ["pca0", "pca1", "pca2"]
    assert Xt.feature_names == ("pca0", "pca1", "pca2")
    # A subset of the fitted sites can be transformed; an unknown one cannot.
    assert pt.transform(X.select_sites("s1")).sites == ("s1",)
    other = TurnFeatures(X.values, X.offsets, sites=["s0", "zz"])
    with pytest.raises(ValueError, match=r"unknown site\(s\) \['zz'\]"):
        pt.transform(other)
    with pytest.raises(ValueError, match="features per turn"):
        pt.transform(TurnFeatures(np.zeros((4, 2)), [0, 2, 4]))


def test_per_turn_feature_names():
    X = TurnFeatures(np.arange(12.0).reshape(4, 3), [0, 2, 4], feature_names=["a", "b", "c"])
    pt = PerTurn(StandardScaler()).fit(X)
    assert list(pt.get_feature_names_out()) == ["a", "b", "c"]
    assert pt.transform(X).feature_names == ("a", "b", "c")
    with pytest.raises(ValueError, match="length 3"):
        pt.get_feature_names_out(["x"])


# ------------------------------------------- sparse: fit on the columns used
def _spread_columns(dense, n_columns, columns):
    """``dense`` (k columns) as a sparse matrix of ``n_columns`` with its columns at
    ``columns``; every other column is empty."""
    M = sp.csr_matrix(dense)
    return sp.csr_matrix((M.data, np.asarray(columns)[M.indices], M.indptr),
                         shape=(M.shape[0], n_columns))


@pytest.mark.parametrize("probe", [GroupedArgmaxLogisticClassifier(),
                                   GroupedArgmaxLogisticClassifier(standardize=False),
                                   GroupedSoftmaxClassifier()])
def test_sparse_fit_equals_the_full_width_fit(probe):
    """Fitted on the columns that hold a value, the probe scores every turn as the
    model fitted on all declared columns (an independent scikit-learn reference, or the
    dense fit for the listwise probe), and its ``coef_`` is the full-width weights."""
    X, y = make_planted(60, n_features=4, task_ids=False, seed=3)
    dense = np.abs(X.values)
    dense[dense < 0.7] = 0.0
    columns = [2, 9, 31, 47]
    wide = _spread_columns(dense, 50, columns)   # 46 of 50 columns empty
    Xw = TurnFeatures(wide, X.offsets)
    fitted = clone(probe).fit(Xw, y)
    np.testing.assert_array_equal(fitted.active_features_, columns)
    assert sp.issparse(fitted.coef_) and fitted.coef_.shape == (1, 50)
    scores = np.concatenate(fitted.turn_decision_function(Xw))
    if isinstance(probe, GroupedSoftmaxClassifier):
        ref = GroupedSoftmaxClassifier(tol=1e-10).fit(TurnFeatures(wide.toarray(),
                                                                   X.offsets), y)
        fitted = GroupedSoftmaxClassifier(tol=1e-10).fit(Xw, y)
        scores = np.concatenate(fitted.turn_decision_function(Xw))
        ref_coef, ref_scores = ref.coef_, wide.toarray() @ ref.coef_.ravel()
    else:
        steps = [("l", LogisticRegression(class_weight="balanced", max_iter=1000))]
        if probe.standardize:
            steps.insert(0, ("s", StandardScaler(with_mean=False)))
        labels = np.zeros(X.n_turns_total, dtype=int)
        labels[X.global_turn_index(y)] = 1
        ref = Pipeline(steps).fit(wide, labels)     # all 50 columns, as before the fix
        ref_scores = ref.decision_function(wide)
        ref_coef = ref[-1].coef_ / (ref[0].scale_ if probe.standardize else 1.0)
        np.testing.assert_allclose(wide @ fitted.coef_.T.toarray().ravel()
                                   + fitted.intercept_[0], ref_scores, rtol=1e-5,
                                   atol=1e-6)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fitted.coef_.toarray(), ref_coef, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(fitted.predict(Xw),
                                  [int(np.argmax(s)) for s in X.split_rows(ref_scores)])
    # prediction on features holding values in columns never seen in training:
    # those columns have weight zero
    extra = wide.tolil()
    extra[:, 5] = 7.0
    np.testing.assert_allclose(np.concatenate(fitted.turn_decision_function(
        TurnFeatures(extra.tocsr(), X.offsets))), scores, rtol=1e-10, atol=1e-12)
    # dense input is fitted as before: every column, a dense coef_
    assert not sp.issparse(clone(probe).fit(TurnFeatures(dense, X.offsets), y).coef_)


_HUGE_SPARSE = textwrap.dedent("""
    import resource, sys, tracemalloc
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
    import numpy as np, scipy.sparse as sp
    from skafa import TurnFeatures
    from skafa.persistence import load, save
    from skafa.probes import GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier
    rng = np.random.default_rng(0)
    offsets = np.arange(0, 121, 4)
    y = rng.integers(0, 4, size=30)
    dense = rng.random((120, 4)) * (rng.random((120, 4)) < 0.5)
    dense[offsets[:-1] + y, 0] += 3.0
    n_columns = 67_108_864                 # the most a TurnFeatures may declare
    columns = np.array([3, 1000, 2**25, n_columns - 1])
    M = sp.csr_matrix(dense)
    X = TurnFeatures(sp.csr_matrix((M.data, columns[M.indices], M.indptr),
                                   shape=(120, n_columns)), offsets)
    small = TurnFeatures(sp.csr_matrix(dense), offsets)
    for cls in (GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier):
        tracemalloc.start()
        probe = cls().fit(X, y)
        scores = np.concatenate(probe.turn_decision_function(X))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 * 2**20, (cls.__name__, peak)
        assert probe.coef_.shape == (1, n_columns) and probe.coef_.nnz == 4
        ref = cls().fit(small, y)          # the same features without the empty columns
        np.testing.assert_allclose(scores, np.concatenate(ref.turn_decision_function(small)),
                                   rtol=1e-6, atol=1e-9)
        assert (probe.predict(X) == ref.predict(small)).all()
        save(probe, sys.argv[1] + "/" + cls.__name__)
        again = load(sys.argv[1] + "/" + cls.__name__)
        assert (again.predict(X) == probe.predict(X)).all()
    print("ok")
""")


def test_huge_declared_sparse_width_allocates_by_the_columns_used(tmp_path):
    """67,108,864 declared columns holding 4 used ones: fit, predict, save and load
    stay under a 3 GiB address-space cap and a 64 MiB traced peak (before: 20 GB)."""
    if sys.platform != "linux":
        pytest.skip("RLIMIT_AS is enforced on Linux")
    done = subprocess.run([sys.executable, "-c", _HUGE_SPARSE, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


# ------------------------------------------------------- clone and reference cycles
def test_clone_names_a_parameter_that_contains_itself():
    """scikit-learn's clone recurses without end on a cyclic parameter value; the probes
    refuse it with a ValueError naming the parameter (issue 33)."""
    weights = {0: 1.0}
    weights["again"] = weights
    with pytest.raises(ValueError, match=r"class_weight\['again'\] is class_weight itself"):
        clone(GroupedArgmaxLogisticClassifier(class_weight=weights))
    loop = GroupedArgmaxClassifier()
    loop.estimator = loop
    with pytest.raises(ValueError, match="estimator is the GroupedArgmaxClassifier itself"):
        clone(loop)
    inner = [1]
    nested = GroupedArgmaxClassifier(GroupedSoftmaxClassifier(site=[inner, [inner]]))
    with pytest.raises(ValueError, match="reference cycle") as info:
        nested.estimator.site.append(nested.estimator.site)
        clone(nested)
    assert "estimator.site[2] is estimator.site itself" in str(info.value)
    # shared values that form no cycle, and deep acyclic ones, clone as before
    shared = {0: 1.0, 1: 3.0}
    deep = GroupedArgmaxClassifier(GroupedArgmaxLogisticClassifier(class_weight=shared),
                                   site=[shared, shared])
    twin = clone(deep)
    assert twin.estimator.class_weight == shared and twin.site == [shared, shared]


@pytest.mark.parametrize("cls", [GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier])
def test_sparse_features_without_any_value_still_fit(cls):
    """No column holds a value: the probe fits (all weights zero) as before the
    compaction, and predicts the earliest turn."""
    X = TurnFeatures(sp.csr_matrix((12, 1000)), np.arange(0, 13, 3))
    probe = cls().fit(X, [0, 1, 2, 0])
    assert probe.coef_.shape == (1, 1000) and not probe.coef_.toarray().any()
    assert probe.predict(X).tolist() == [0, 0, 0, 0]
