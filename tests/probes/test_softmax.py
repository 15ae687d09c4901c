"""Tests for GroupedSoftmaxClassifier, the listwise (conditional-logit) probe."""

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV, GroupKFold, cross_val_score

from skafa import (
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
    SiteSelector,
    TurnFeatures,
)
from skafa.persistence import load, save
from skafa.probes._softmax import _softmax_objective


def listwise_data(n, *, n_turns=6, n_features=4, seed=0, offset_scale=3.0, signal=1.5,
                  n_sites=None, signal_site=0):
    """Decisive turn drawn from a softmax over the turns of each conversation.

    Feature 0 carries the signal; features 0 and 1 share a large per-conversation
    offset (a nuisance constant within each conversation), which misleads a pointwise
    model that pools turn rows of all conversations but not a listwise one.
    """
    rng = np.random.default_rng(seed)
    offsets = np.arange(0, n * n_turns + 1, n_turns)
    values = rng.normal(size=(n * n_turns, n_features))
    direction = np.zeros(n_features)
    direction[:2] = 1.0
    values += np.repeat(rng.normal(scale=offset_scale, size=n), n_turns)[:, None] * direction
    logits = (values[:, 0] * signal).reshape(n, n_turns)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = np.array([rng.choice(n_turns, p=pi) for pi in p])
    task_ids = [f"t{i // 2}" for i in range(n)]
    speakers = [f"agent{j % 3}" for j in range(n * n_turns)]
    if n_sites is None:
        return TurnFeatures(values, offsets, task_ids=task_ids, speakers=speakers), y
    blocks = rng.normal(size=(n * n_turns, n_sites, n_features))
    blocks[:, signal_site, :] = values
    sites = [f"s{k}" for k in range(n_sites)]
    return TurnFeatures(blocks, offsets, sites=sites, task_ids=task_ids,
                        speakers=speakers), y


def ragged_data(seed=0, n=12, n_features=5):
    rng = np.random.default_rng(seed)
    n_turns = rng.integers(1, 7, size=n)
    n_turns[0] = 3
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    values = rng.normal(size=(offsets[-1], n_features)) * rng.uniform(0.1, 10, n_features)
    y = (rng.random(n) * n_turns).astype(np.int64)
    return TurnFeatures(values, offsets), y


# ------------------------------------------------------------------- gradient
def _reference_objective(w, Z, offsets, y, alpha):
    """Loop-per-conversation reference (independent of the vectorised code)."""
    total = 0.0
    for i in range(len(offsets) - 1):
        z = Z[offsets[i]:offsets[i + 1]] @ w
        m = z.max()
        total += m + np.log(np.exp(z - m).sum()) - z[y[i]]
    return total / (len(offsets) - 1) + 0.5 * alpha * w @ w


@pytest.mark.parametrize("standardize", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_gradient_matches_central_differences(standardize, sparse):
    X, y = ragged_data(seed=1)
    M = sp.csr_matrix(X.values) if sparse else X.values
    probe = GroupedSoftmaxClassifier(standardize=standardize)
    Z = probe._design(M, fitting=True)
    target = X.global_turn_index(y)
    alpha = 0.37
    rng = np.random.default_rng(2)
    Zd = Z.toarray() if sparse else Z
    for _ in range(3):
        w = rng.normal(size=X.n_features)
        f, g = _softmax_objective(w, Z, X.offsets, target, alpha)
        assert f == pytest.approx(_reference_objective(w, Zd, X.offsets, y, alpha), rel=1e-12)
        h = 1e-6
        numeric = np.array([
            (_softmax_objective(w + h * e, Z, X.offsets, target, alpha)[0]
             - _softmax_objective(w - h * e, Z, X.offsets, target, alpha)[0]) / (2 * h)
            for e in np.eye(X.n_features)
        ])
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8)


def test_objective_is_stable_for_huge_scores():
    X, y = ragged_data(seed=3)
    w = np.full(X.n_features, 1e3)
    f, g = _softmax_objective(w, X.values, X.offsets, X.global_turn_index(y), 0.0)
    assert np.isfinite(f) and np.all(np.isfinite(g))


@pytest.mark.parametrize("standardize", [False, True])
def test_fitted_weights_are_a_stationary_point(standardize):
    X, y = ragged_data(seed=4, n=30)
    probe = GroupedSoftmaxClassifier(C=0.5, standardize=standardize, tol=1e-10).fit(X, y)
    Z = probe._design(X.values, fitting=False)
    w = probe.coef_.ravel() * (probe.scaler_.scale_ if standardize else 1.0)
    alpha = 1.0 / (probe.C * len(X))
    f, g = _softmax_objective(w, Z, X.offsets, X.global_turn_index(y), alpha)
    assert np.abs(g).max() < 1e-7
    assert f == pytest.approx(probe.objective_)
    # and coef_ is in the original units: scores are x @ coef_
    scores = np.concatenate(probe.turn_decision_function(X))
    np.testing.assert_allclose(scores, X.values @ probe.coef_.ravel())


# ---------------------------------------------------------------- behaviour
def test_planted_signal_recovered_and_beats_pointwise_probe():
    accs = []
    for seed in range(3):
        X_tr, y_tr = listwise_data(60, seed=seed)
        X_te, y_te = listwise_data(300, seed=100 + seed)
        soft = GroupedSoftmaxClassifier().fit(X_tr, y_tr)
        logi = GroupedArgmaxLogisticClassifier().fit(X_tr, y_tr)
        accs.append((soft.score(X_te, y_te), logi.score(X_te, y_te)))
        # the signal feature carries the largest weight
        assert np.argmax(np.abs(soft.coef_.ravel())) == 0
    soft_acc, logi_acc = np.mean(accs, axis=0)
    assert soft_acc > 1 / 6 + 0.2            # far above chance (6 turns)
    assert soft_acc >= logi_acc              # comparable or better than pointwise


def test_probabilities_are_the_softmax_and_sum_to_one():
    X, y = ragged_data(seed=5)
    probe = GroupedSoftmaxClassifier().fit(X, y)
    proba = probe.turn_predict_proba(X)
    scores = probe.turn_decision_function(X)
    for p, s, n in zip(proba, scores, X.n_turns):
        assert p.shape == (n,) and np.all(p >= 0)
        assert p.sum() == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_allclose(p, np.exp(s - s.max()) / np.exp(s - s.max()).sum())
    np.testing.assert_array_equal(probe.predict(X), [int(np.argmax(s)) for s in scores])


def test_penalty_strength_follows_C():
    X, y = listwise_data(40, seed=6)
    norms = [np.linalg.norm(GroupedSoftmaxClassifier(C=C, tol=1e-8).fit(X, y).coef_)
             for C in (1e-4, 1e-2, 1.0, 1e2)]
    assert np.all(np.diff(norms) > 0)
    # tiny C: weights near zero, near-uniform probabilities
    tiny = GroupedSoftmaxClassifier(C=1e-6).fit(X, y)
    assert np.abs(tiny.coef_).max() < 1e-3
    np.testing.assert_allclose(np.concatenate(tiny.turn_predict_proba(X)), 1 / 6, atol=1e-3)
    # huge C: the penalty is negligible, the unpenalised optimum is reached
    a = GroupedSoftmaxClassifier(C=1e6, tol=1e-9).fit(X, y).coef_
    b = GroupedSoftmaxClassifier(C=1e8, tol=1e-9).fit(X, y).coef_
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_per_conversation_constant_is_ignored():
    X, y = listwise_data(40, seed=7)
    rng = np.random.default_rng(0)
    shift = np.repeat(rng.normal(scale=5.0, size=len(X)), X.n_turns)
    values = X.values.copy()
    values[:, 2] += shift
    X_shift = X.with_values(values)
    a = GroupedSoftmaxClassifier(standardize=False, tol=1e-10).fit(X, y)
    b = GroupedSoftmaxClassifier(standardize=False, tol=1e-10).fit(X_shift, y)
    np.testing.assert_allclose(a.coef_, b.coef_, atol=1e-6)
    for p, q in zip(a.turn_predict_proba(X), b.turn_predict_proba(X_shift)):
        np.testing.assert_allclose(p, q, atol=1e-6)
    # a feature constant within every conversation gets weight zero
    const = np.column_stack([X.values, shift])
    c = GroupedSoftmaxClassifier().fit(X.with_values(const), y)
    assert abs(c.coef_[0, -1]) < 1e-8


def test_single_turn_conversations_contribute_nothing():
    X, y = ragged_data(seed=8, n=20)
    keep = np.flatnonzero(X.n_turns > 1)
    a = GroupedSoftmaxClassifier(standardize=False, C=1e3, tol=1e-10).fit(X, y)
    b = GroupedSoftmaxClassifier(standardize=False, C=1e3 * len(X) / keep.size,
                                 tol=1e-10).fit(X[keep], y[keep])
    # same objective up to the 1/n scaling, so the same weights
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=1e-5, atol=1e-7)
    single = TurnFeatures(np.ones((3, 2)), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="single turn"):
        GroupedSoftmaxClassifier().fit(single, [0, 0, 0])


def test_sparse_and_dense_agree():
    X, y = ragged_data(seed=9, n=20)
    dense = GroupedSoftmaxClassifier(tol=1e-10).fit(X, y)
    Xs = TurnFeatures(sp.csr_matrix(X.values), X.offsets)
    sparse = GroupedSoftmaxClassifier(tol=1e-10).fit(Xs, y)
    assert sp.issparse(sparse.coef_) and sparse.coef_.shape == dense.coef_.shape
    np.testing.assert_allclose(dense.coef_, sparse.coef_.toarray(), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.concatenate(dense.turn_decision_function(X)),
                               np.concatenate(sparse.turn_decision_function(Xs)),
                               rtol=1e-6, atol=1e-9)


def test_convergence_warning_and_n_iter():
    X, y = listwise_data(40, seed=10)
    with pytest.warns(ConvergenceWarning, match="did not converge"):
        probe = GroupedSoftmaxClassifier(max_iter=1, tol=0.0).fit(X, y)
    assert probe.n_iter_.tolist() == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        assert GroupedSoftmaxClassifier().fit(X, y).n_iter_[0] > 1


def test_verbose_prints(capsys):
    X, y = listwise_data(20, seed=11)
    GroupedSoftmaxClassifier(verbose=1).fit(X, y)
    out = capsys.readouterr().out
    assert "iteration    1" in out and "converged=True" in out


def test_parameter_validation_and_site_checks():
    X, y = listwise_data(20, seed=12, n_sites=3)
    with pytest.raises(ValueError, match="C"):
        GroupedSoftmaxClassifier(C=0).fit(X, y)
    with pytest.raises(ValueError, match="does not know which one"):
        GroupedSoftmaxClassifier().fit(X, y)
    probe = GroupedSoftmaxClassifier(site="s0").fit(X, y)
    assert probe.site_ == "s0" and probe.n_features_in_ == 4
    with pytest.raises(ValueError, match="fitted on site 's0'"):
        probe.predict(X.select_sites("s1"))
    assert probe.predict_agent(X).shape == (len(X),)
    bad = X.values.copy()
    bad[5, 0, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        GroupedSoftmaxClassifier(site="s0").fit(X.with_values(bad), y)


# -------------------------------------------------------------- integration
def test_save_load_roundtrip_bitwise(tmp_path):
    X, y = listwise_data(30, seed=13, n_sites=2)
    for probe in (GroupedSoftmaxClassifier(site="s0", C=3.0),
                  GroupedSoftmaxClassifier(site=1, standardize=False)):
        probe.fit(X, y)
        loaded = load(save(probe, tmp_path / f"p{probe.standardize}"))
        assert repr(loaded) == repr(probe)
        assert loaded.coef_.tobytes() == probe.coef_.tobytes()
        for a, b in zip(loaded.turn_predict_proba(X), probe.turn_predict_proba(X)):
            assert a.tobytes() == b.tobytes()
        np.testing.assert_array_equal(loaded.predict(X), probe.predict(X))


def test_site_selector_and_grid_search():
    X, y = listwise_data(48, seed=14, n_sites=3, signal_site=1)
    groups = np.arange(len(X)) // 2
    selector = SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3))
    selector.fit(X, y, groups=groups)
    assert selector.best_site_ == "s1"
    search = GridSearchCV(GroupedSoftmaxClassifier(site="s1"), {"C": [0.01, 1.0]},
                          cv=GroupKFold(3))
    search.fit(X, y, groups=groups)
    assert search.best_params_["C"] in (0.01, 1.0)
    assert search.best_estimator_.score(X, y) > 0.4
    scores = cross_val_score(clone(selector), X, y, groups=groups, cv=GroupKFold(3))
    assert scores.shape == (3,) and scores.mean() > 1 / 6


@pytest.mark.parametrize("standardize", [False, True])
def test_integer_sample_weight_equals_repeating_conversations(standardize):
    X, y = listwise_data(30, seed=4)
    w = np.random.default_rng(0).integers(0, 4, size=len(y))
    weighted = GroupedSoftmaxClassifier(C=0.5, standardize=standardize, tol=1e-10).fit(
        X, y, sample_weight=w)
    rows = np.repeat(np.arange(len(y)), w)
    repeated = GroupedSoftmaxClassifier(C=0.5, standardize=standardize, tol=1e-10).fit(
        X[rows], y[rows])
    # same penalised objective up to the 1/n scaling: same minimiser
    np.testing.assert_allclose(weighted.coef_, repeated.coef_, rtol=1e-4, atol=1e-6)
    unweighted = GroupedSoftmaxClassifier(C=0.5, standardize=standardize).fit(X, y)
    assert not np.allclose(weighted.coef_, unweighted.coef_)  # the weights matter


def test_weighted_gradient_matches_central_differences():
    X, y = ragged_data(seed=2)
    Z = X.turn_matrix()
    target = X.global_turn_index(y)
    weight = np.random.default_rng(1).uniform(0.1, 3.0, size=len(y))
    w0 = np.random.default_rng(2).normal(size=Z.shape[1])
    _, grad = _softmax_objective(w0, Z, X.offsets, target, 0.3, weight)
    eps = 1e-6
    num = np.array([
        (_softmax_objective(w0 + eps * e, Z, X.offsets, target, 0.3, weight)[0]
         - _softmax_objective(w0 - eps * e, Z, X.offsets, target, 0.3, weight)[0]) / (2 * eps)
        for e in np.eye(Z.shape[1])])
    np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-8)
