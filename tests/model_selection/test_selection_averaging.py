"""Tests for site averaging: SiteEnsemble and SiteSelector(n_sites=k)."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold, cross_val_score
from sklearn.preprocessing import StandardScaler

from skafa import (
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
    SiteEnsemble,
    SiteSelector,
    TurnFeatures,
)
from skafa.compose import PerTurn, make_attribution_pipeline
from skafa.persistence import load, save
from skafa.utils.grouped import grouped_center


def spread(n, *, n_turns=5, n_sites=4, n_features=3, signal=1.0, signal_sites=None,
           seed=0):
    """The decisive-turn signal at several sites, with independent noise at each."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(0, n * n_turns + 1, n_turns)
    y = rng.integers(0, n_turns, size=n)
    values = rng.normal(size=(n * n_turns, n_sites, n_features))
    signal_sites = list(range(n_sites)) if signal_sites is None else signal_sites
    for s in signal_sites:
        values[offsets[:-1] + y, s, 0] += signal
    X = TurnFeatures(values, offsets, sites=[f"s{k}" for k in range(n_sites)],
                     task_ids=[f"t{i // 2}" for i in range(n)],
                     speakers=[f"a{j % 3}" for j in range(n * n_turns)])
    return X, y


# ------------------------------------------------------------------ averaging
def test_averaging_beats_single_site_when_signal_is_spread():
    single, averaged = [], []
    for seed in range(2):
        X_tr, y_tr = spread(40, seed=seed)
        X_te, y_te = spread(200, seed=50 + seed)
        kw = {"cv": GroupKFold(3)}
        single.append(SiteSelector(GroupedSoftmaxClassifier(), **kw).fit(X_tr, y_tr)
                      .score(X_te, y_te))
        averaged.append(SiteSelector(GroupedSoftmaxClassifier(), n_sites=4, **kw)
                        .fit(X_tr, y_tr).score(X_te, y_te))
    assert np.mean(averaged) > np.mean(single) + 0.1


def test_ensemble_is_the_mean_of_standardized_member_scores():
    X, y = spread(30, seed=3)
    ens = SiteEnsemble(GroupedArgmaxLogisticClassifier(), sites=["s2", "s0"]).fit(X, y)
    assert ens.sites_ == ("s2", "s0") and len(ens.estimators_) == 2
    expected = np.zeros(X.n_turns_total)
    for site, scale in zip(("s2", "s0"), ens.score_scale_):
        member = GroupedArgmaxLogisticClassifier().fit(X.select_sites(site), y)
        raw = np.concatenate(member.turn_decision_function(X.select_sites(site)))
        centred = grouped_center(raw, X.offsets)
        # the scale is the training within-conversation RMS of the member's scores
        assert scale == pytest.approx(np.sqrt(np.mean(centred**2)))
        expected += centred / scale / 2
    np.testing.assert_allclose(np.concatenate(ens.turn_decision_function(X)), expected)
    proba = ens.turn_predict_proba(X)
    assert np.allclose([p.sum() for p in proba], 1.0)
    np.testing.assert_array_equal(ens.predict(X), [int(np.argmax(p)) for p in proba])
    assert ens.predict_agent(X).shape == (len(X),)
    assert ens.score(X, y) == np.mean(ens.predict(X) == y)
    with pytest.raises(ValueError, match="lacks"):
        ens.predict(X.select_sites("s1"))


def test_ensemble_accepts_pipelines_and_rejects_fixed_sites():
    X, y = spread(20, seed=4)
    pipe = make_attribution_pipeline(PerTurn(StandardScaler()), GroupedSoftmaxClassifier())
    ens = SiteEnsemble(pipe, sites=["s0", "s1"]).fit(X, y)
    assert ens.predict(X).shape == (20,)
    with pytest.raises(ValueError, match="leave site=None"):
        SiteEnsemble(GroupedSoftmaxClassifier(site="s0")).fit(X, y)


# --------------------------------------------------------------- selection
def test_n_sites_1_is_the_plain_selection():
    X, y = spread(40, seed=5, signal_sites=[2], signal=2.0)
    plain = SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3)).fit(X, y)
    one = SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3), n_sites=1).fit(X, y)
    assert plain.best_site_ == one.best_site_ == "s2"
    assert one.best_sites_ == ("s2",)
    assert type(one.best_estimator_) is GroupedSoftmaxClassifier
    ref = GroupedSoftmaxClassifier().fit(X.select_sites("s2"), y)
    np.testing.assert_array_equal(one.best_estimator_.coef_, ref.coef_)
    for a, b in zip(one.turn_decision_function(X), ref.turn_decision_function(
            X.select_sites("s2"))):
        np.testing.assert_array_equal(a, b)


def test_top_k_follow_the_inner_cv_ranking_with_stable_ties():
    X, y = spread(40, seed=6, n_sites=5, signal_sites=[1, 3, 4])
    sel = SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3), n_sites=3).fit(X, y)
    means = sel.cv_results_["mean_test_score"]
    order = np.argsort(-means, kind="stable")[:3]
    assert sel.best_sites_ == tuple(sel.sites_[i] for i in order)
    assert sel.best_site_ == sel.best_sites_[0]
    assert isinstance(sel.best_estimator_, SiteEnsemble)
    assert sel.best_estimator_.sites_ == sel.best_sites_
    assert sel.n_features_in_ == 3
    # ties: equal means keep the earlier site
    from skafa.model_selection._selection import _top_sites
    assert _top_sites(("a", "b", "c"), np.array([0.5, 0.7, 0.7]),
                      np.array([False] * 3), 2) == ("b", "c")
    with pytest.warns(UserWarning, match="only 1 site"):
        assert _top_sites(("a", "b"), np.array([0.5, -1.0]), np.array([False, True]),
                          2) == ("a",)
    with pytest.raises(ValueError, match="averages the 6 best sites, but X holds only 5"):
        SiteSelector(GroupedSoftmaxClassifier(), n_sites=6).fit(X, y)


class _SpyProbe(GroupedSoftmaxClassifier):
    """Records the task ids of every fit and score call (class-level log)."""

    log: list = []  # noqa: RUF012 - a test spy shared by the clones

    def fit(self, X, y, groups=None):
        type(self).log.append(("fit", set(X.task_ids)))
        return super().fit(X, y)

    def score(self, X, y, sample_weight=None):
        type(self).log.append(("score", set(X.task_ids)))
        return super().score(X, y, sample_weight)


def test_sites_are_ranked_on_inner_folds_of_the_training_data_only():
    X, y = spread(60, seed=7, signal_sites=[0, 1], signal=1.5)
    # the held-out part carries its signal at other sites: a selector that looked
    # at it would rank s2/s3 first
    X_out, y_out = spread(60, seed=8, signal_sites=[2, 3], signal=3.0)
    train_tasks = set(X.task_ids)
    _SpyProbe.log = []
    sel = SiteSelector(_SpyProbe(), cv=GroupKFold(3), n_sites=2).fit(X, y)
    assert set(sel.best_sites_) == {"s0", "s1"}
    fits = [tasks for kind, tasks in _SpyProbe.log if kind == "fit"]
    scores = [tasks for kind, tasks in _SpyProbe.log if kind == "score"]
    # 4 sites x 3 folds: every inner fit is scored on disjoint, held-out tasks
    assert len(scores) == 12
    for fit_tasks, score_tasks in zip(fits[:12], scores):
        assert fit_tasks.isdisjoint(score_tasks)
        assert fit_tasks | score_tasks == train_tasks
    # then one refit per kept site, on all the training data
    assert fits[12:] == [train_tasks, train_tasks]
    # the choice depends on the training data only: same on a refit, whatever the
    # held-out conversations say
    again = clone(sel).fit(X, y)
    assert again.best_sites_ == sel.best_sites_
    # (and the held-out part would have changed it, so the check above can fail)
    other = SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3), n_sites=2)
    assert set(other.fit(X_out, y_out).best_sites_) == {"s2", "s3"}


def test_grid_search_over_n_sites_and_cross_val_score():
    X, y = spread(48, seed=9)
    groups = np.arange(48) // 2
    search = GridSearchCV(SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3)),
                          {"n_sites": [1, 4]}, cv=GroupKFold(3))
    search.fit(X, y, groups=groups)
    assert search.best_params_ == {"n_sites": 4}
    scores = cross_val_score(SiteEnsemble(GroupedSoftmaxClassifier()), X, y, groups=groups,
                             cv=GroupKFold(3))
    assert scores.mean() > 0.4


def test_save_load_roundtrip(tmp_path):
    X, y = spread(30, seed=10)
    sel = SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3), n_sites=3).fit(X, y)
    loaded = load(save(sel, tmp_path / "sel"))
    assert loaded.best_sites_ == sel.best_sites_
    assert isinstance(loaded.best_estimator_, SiteEnsemble)
    for a, b in zip(loaded.turn_decision_function(X), sel.turn_decision_function(X)):
        assert a.tobytes() == b.tobytes()
    assert loaded.score(X, y) == sel.score(X, y)
    ens = SiteEnsemble(GroupedArgmaxLogisticClassifier(), sites=["s1", "s3"]).fit(X, y)
    back = load(save(ens, tmp_path / "ens"))
    np.testing.assert_array_equal(back.score_scale_, ens.score_scale_)
    np.testing.assert_array_equal(back.predict(X), ens.predict(X))
