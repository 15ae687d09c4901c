"""Tests for skafa.model_selection._selection: SiteSelector and site_sweep."""

import numpy as np
import pytest
import sklearn
from sklearn.exceptions import FitFailedWarning, NotFittedError
from sklearn.metrics import make_scorer
from sklearn.model_selection import GridSearchCV, GroupKFold, KFold, cross_validate

from skafa import GroupedArgmaxClassifier, GroupedArgmaxLogisticClassifier, TurnFeatures
from skafa.model_selection import SiteEnsemble, SiteSelector, site_sweep
from skafa.testing import make_site_features
from skafa.utils.estimator_checks import make_turn_features

SITES = ("s0", "s1", "s2", "s3", "s4")


def make_sites(n=90, **kwargs):
    """Multi-site TurnFeatures with the decisive-turn signal at one site."""
    return make_site_features(n, **kwargs)


def random_steps(X, seed):
    rng = np.random.default_rng(seed)
    return (rng.random(len(X)) * X.n_turns).astype(np.int64)


def chance(X):
    return float(np.mean(1.0 / X.n_turns))


@pytest.fixture(scope="module")
def data():
    X, y = make_sites(150)
    return X[:90], y[:90], X[90:], y[90:]


@pytest.fixture(scope="module")
def fitted(data):
    X_tr, y_tr, _, _ = data
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3))
    return sel.fit(X_tr, y_tr)


# ------------------------------------------------------------- recovery
def test_planted_site_is_recovered(data, fitted):
    _, _, X_te, y_te = data
    assert fitted.best_site_ == "s3"
    assert fitted.best_index_ == 3
    assert fitted.best_score_ == pytest.approx(fitted.cv_results_["mean_test_score"][3])
    assert fitted.best_score_ > 0.6
    other = np.delete(fitted.cv_results_["mean_test_score"], 3)
    assert np.all(other < 0.4)
    acc = fitted.score(X_te, y_te)
    assert acc > 0.6 and chance(X_te) < 0.25
    assert fitted.best_estimator_.site_ == "s3"


def test_unrelated_labels_stay_near_chance(data):
    X_tr, _, X_te, _ = data
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3))
    sel.fit(X_tr, random_steps(X_tr, 5))
    assert sel.best_score_ < 0.35  # the max over 5 sites of ~chance (0.2) scores
    assert sel.score(X_te, random_steps(X_te, 6)) < 0.35


def test_cv_results_layout(fitted):
    res = fitted.cv_results_
    assert list(res["site"]) == list(SITES)
    assert res["params"] == [{"site": s} for s in SITES]
    for key in ("mean_test_score", "std_test_score", "rank_test_score", "mean_fit_time",
                "std_fit_time", "mean_score_time", "std_score_time",
                "split0_test_score", "split1_test_score", "split2_test_score"):
        assert res[key].shape == (5,), key
    assert "split3_test_score" not in res
    assert fitted.n_splits_ == 3 and fitted.sites_ == SITES
    splits = np.column_stack([res[f"split{k}_test_score"] for k in range(3)])
    np.testing.assert_allclose(res["mean_test_score"], splits.mean(axis=1))
    np.testing.assert_allclose(res["std_test_score"], splits.std(axis=1))
    assert res["rank_test_score"][3] == 1
    assert res["rank_test_score"].dtype == np.int32
    assert fitted.refit_time_ >= 0


def test_delegated_methods(data, fitted):
    _, _, X_te, _ = data
    X_best = X_te.select_sites("s3")
    best = fitted.best_estimator_
    np.testing.assert_array_equal(fitted.predict(X_te), best.predict(X_best))
    np.testing.assert_array_equal(fitted.predict_agent(X_te), best.predict_agent(X_best))
    for a, b in zip(fitted.turn_predict_proba(X_te), best.turn_predict_proba(X_best)):
        np.testing.assert_allclose(a, b)
    for a, b in zip(fitted.turn_decision_function(X_te), best.turn_decision_function(X_best)):
        np.testing.assert_allclose(a, b)
    assert fitted.n_features_in_ == 6
    # The chosen site must be present in the input.
    with pytest.raises(ValueError, match="chose site 's3'"):
        fitted.predict(X_te.select_sites(["s0", "s1"]))
    with pytest.raises(TypeError, match="expects a skafa.TurnFeatures"):
        fitted.predict(np.zeros((3, 6)))


def test_not_fitted_and_refit_false(data):
    X_tr, y_tr, X_te, _ = data
    with pytest.raises(NotFittedError):
        SiteSelector(GroupedArgmaxLogisticClassifier()).predict(X_te)
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3), refit=False)
    sel.fit(X_tr, y_tr)
    assert sel.best_site_ == "s3" and not hasattr(sel, "best_estimator_")
    with pytest.raises(AttributeError, match="refit=False"):
        sel.predict(X_te)


# ----------------------------------------------------------------- rules
def test_tie_goes_to_earliest_site_in_given_order():
    X, y = make_sites(60, n_sites=2, signal_site=1)
    # Make s0 an exact copy of s1: identical fold scores, a tie.
    values = X.values.copy()
    values[:, 0, :] = values[:, 1, :]
    X = TurnFeatures(values, X.offsets, sites=["s0", "s1"], task_ids=X.task_ids)
    for order in (["s0", "s1"], ["s1", "s0"]):
        sel = SiteSelector(GroupedArgmaxLogisticClassifier(), sites=order, cv=GroupKFold(3))
        sel.fit(X, y)
        assert sel.cv_results_["mean_test_score"][0] == sel.cv_results_["mean_test_score"][1]
        assert list(sel.cv_results_["rank_test_score"]) == [1, 1]
        assert sel.best_site_ == order[0] and sel.best_index_ == 0


def test_sites_parameter(data):
    X_tr, y_tr, _, _ = data
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), sites=["s4", "s3"], cv=GroupKFold(3))
    sel.fit(X_tr, y_tr)
    assert list(sel.cv_results_["site"]) == ["s4", "s3"] and sel.best_site_ == "s3"
    with pytest.raises(ValueError, match=r"\['nope'\] are not in X"):
        SiteSelector(GroupedArgmaxLogisticClassifier(), sites=["nope"]).fit(X_tr, y_tr)
    with pytest.raises(ValueError, match="duplicates"):
        SiteSelector(GroupedArgmaxLogisticClassifier(), sites=["s1", "s1"]).fit(X_tr, y_tr)
    with pytest.raises(ValueError, match="'sites' parameter"):  # a bare string
        SiteSelector(GroupedArgmaxLogisticClassifier(), sites="s1").fit(X_tr, y_tr)


def test_estimator_with_fixed_site_is_rejected(data):
    X_tr, y_tr, _, _ = data
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(site="s1"))
    with pytest.raises(ValueError, match="leave site=None"):
        sel.fit(X_tr, y_tr)


def test_int_cv_is_grouped(data):
    X_tr, y_tr, _, _ = data
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=3).fit(X_tr, y_tr)
    assert sel.n_splits_ == 3 and sel.best_site_ == "s3"


def test_n_jobs_2_equals_n_jobs_1(data, fitted):
    X_tr, y_tr, X_te, _ = data
    par = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3), n_jobs=2)
    par.fit(X_tr, y_tr)
    for k in range(3):
        np.testing.assert_array_equal(
            par.cv_results_[f"split{k}_test_score"], fitted.cv_results_[f"split{k}_test_score"]
        )
    assert par.best_site_ == fitted.best_site_
    np.testing.assert_array_equal(par.predict(X_te), fitted.predict(X_te))


def test_scoring_string_and_callable(data, fitted):
    X_tr, y_tr, X_te, y_te = data
    by_name = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3),
                           scoring="accuracy").fit(X_tr, y_tr)
    np.testing.assert_allclose(
        by_name.cv_results_["mean_test_score"], fitted.cv_results_["mean_test_score"]
    )

    def within_one(y_true, y_pred):
        return float(np.mean(np.abs(np.asarray(y_true) - y_pred) <= 1))

    lenient = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3),
                           scoring=make_scorer(within_one)).fit(X_tr, y_tr)
    assert lenient.best_site_ == "s3"
    assert np.all(lenient.cv_results_["mean_test_score"]
                  >= fitted.cv_results_["mean_test_score"] - 1e-12)
    assert lenient.score(X_te, y_te) == pytest.approx(
        within_one(y_te, lenient.predict(X_te))
    )


def test_skafa_scorer_names(data, fitted):
    X_tr, y_tr, _, _ = data
    top3 = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3),
                        scoring="top3").fit(X_tr, y_tr)
    assert top3.best_site_ == "s3"
    assert np.all(top3.cv_results_["mean_test_score"]
                  >= fitted.cv_results_["mean_test_score"] - 1e-12)
    agents = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3),
                          scoring="agent_accuracy").fit(X_tr, y_tr)
    assert agents.best_site_ == "s3"


def test_error_score(data):
    X_tr, y_tr, _, _ = data
    values = X_tr.values.copy()
    values[5, 1, 2] = np.nan  # site s1 cannot be fitted
    X_bad = TurnFeatures(values, X_tr.offsets, sites=X_tr.sites, task_ids=X_tr.task_ids)
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), sites=["s1", "s3"], cv=GroupKFold(3))
    with pytest.warns(FitFailedWarning, match="site 's1'"):
        sel.fit(X_bad, y_tr)
    assert np.isnan(sel.cv_results_["mean_test_score"][0])
    assert list(sel.cv_results_["rank_test_score"]) == [2, 1]
    assert sel.best_site_ == "s3"
    with pytest.raises(ValueError, match="non-finite feature"):
        sel.set_params(error_score="raise").fit(X_bad, y_tr)
    with pytest.warns(FitFailedWarning), pytest.raises(ValueError, match="no site has a finite mean"):
        SiteSelector(GroupedArgmaxLogisticClassifier(), sites=["s1"], cv=GroupKFold(3)).fit(
            X_bad, y_tr
        )


def test_input_errors(data):
    X_tr, y_tr, _, _ = data
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3))
    with pytest.raises(TypeError, match="TurnActivationTransformer"):
        sel.fit(np.zeros((5, 3)), [0] * 5)
    with pytest.raises(ValueError, match="entries but X holds"):
        sel.fit(X_tr, y_tr[:-1])


# ---------------------------------------------------------------- groups
_RECORDED = []


class RecordingGroupKFold(GroupKFold):
    """GroupKFold that records the groups (and conversations) it is asked to split.

    Records go to a module-level list: ``clone`` deep-copies splitters.
    """

    def split(self, X, y=None, groups=None):
        ids = _conversation_ids(X)
        _RECORDED.append((ids, None if groups is None else np.asarray(groups).copy()))
        return super().split(X, y, groups)


_FINGERPRINT = {}


def _conversation_ids(X):
    """Original conversation index of every entry of X (via a unique value)."""
    keys = X.turn_matrix("s0")[X.offsets[:-1], 1]
    return np.array([_FINGERPRINT[float(k)] for k in keys])


def _register(X):
    keys = X.turn_matrix("s0")[X.offsets[:-1], 1]
    assert len(set(keys.tolist())) == len(X)
    _FINGERPRINT.clear()
    _FINGERPRINT.update({float(k): i for i, k in enumerate(keys)})


def _assert_all_grouped(expected_groups, n_calls):
    assert len(_RECORDED) == n_calls
    for ids, groups in _RECORDED:
        assert groups is not None, "a splitter received no groups"
        np.testing.assert_array_equal(groups, expected_groups[ids])


def test_groups_passed_to_fit_reach_the_splitter():
    X, y = make_sites(45, n_sites=2, signal_site=1, task_ids=False)
    _register(X)
    g = np.arange(45) // 3
    _RECORDED.clear()
    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=RecordingGroupKFold(3)).fit(X, y, groups=g)
    _assert_all_grouped(g, 1)


def test_task_ids_are_the_default_groups():
    X, y = make_sites(45, n_sites=2, signal_site=1, task_ids=True)
    _register(X)
    _RECORDED.clear()
    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=RecordingGroupKFold(3)).fit(X, y)
    _assert_all_grouped(X.task_ids, 1)
    # Explicit groups take precedence over task ids.
    g = np.arange(45) // 5
    _RECORDED.clear()
    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=RecordingGroupKFold(3)).fit(X, y, groups=g)
    _assert_all_grouped(g, 1)


def test_missing_groups_give_a_clear_error():
    X, y = make_sites(30, n_sites=2, signal_site=1, task_ids=False)
    with pytest.raises(ValueError, match="needs groups: pass groups="):
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(X, y)
    # An ungrouped splitter needs none.
    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=KFold(3)).fit(X, y)


def test_nested_cv_groups_both_loops_with_metadata_routing():
    X, y = make_sites(48, n_sites=3, signal_site=1, task_ids=False)  # no fallback
    _register(X)
    g = np.arange(48) // 2
    _RECORDED.clear()
    with sklearn.config_context(enable_metadata_routing=True):
        search = GridSearchCV(
            SiteSelector(GroupedArgmaxLogisticClassifier(), cv=RecordingGroupKFold(3)),
            {"estimator__C": [0.1, 1.0]},
            cv=RecordingGroupKFold(3),
        )
        res = cross_validate(search, X, y, cv=RecordingGroupKFold(3), params={"groups": g})
    # outer 1 + grid 3 + selector (3 outer x 2 candidates x 3 inner + 3 refits) = 25
    _assert_all_grouped(g, 25)
    assert res["test_score"].shape == (3,)


def test_nested_cv_without_routing_falls_back_to_task_ids():
    # Without routing, cross_validate passes groups to its own splitter only; the
    # selector's inner splits still group by task through X.task_ids.
    X, y = make_sites(48, n_sites=2, signal_site=1, task_ids=True)
    _register(X)
    groups = np.asarray(X.task_ids)
    _RECORDED.clear()
    selector = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=RecordingGroupKFold(2))
    cross_validate(selector, X, y, cv=RecordingGroupKFold(3), groups=groups)
    # outer 1 + selector (3 outer folds x 1 inner split call) = 4, all grouped by task.
    _assert_all_grouped(groups, 4)


def test_metadata_routing_object():
    sel = SiteSelector(GroupedArgmaxLogisticClassifier())
    routing = sel.get_metadata_routing()
    assert "groups" in str(routing)
    with sklearn.config_context(enable_metadata_routing=True):
        X, y = make_sites(30, n_sites=2, signal_site=1, task_ids=False)
        _register(X)
        _RECORDED.clear()
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=RecordingGroupKFold(3)).fit(
            X, y, groups=np.arange(30) // 2
        )
        _assert_all_grouped(np.arange(30) // 2, 1)


# ------------------------------------------------------------ site_sweep
def test_site_sweep(data):
    X_tr, y_tr, X_te, y_te = data
    res = site_sweep(GroupedArgmaxLogisticClassifier(), X_tr, y_tr, X_te, y_te)
    assert list(res["site"]) == list(SITES)
    assert set(res) == {"site", "train_score", "test_score", "fit_time"}
    assert int(np.argmax(res["test_score"])) == 3
    assert res["test_score"][3] > 0.6
    expected = GroupedArgmaxLogisticClassifier().fit(X_tr.select_sites("s0"), y_tr).score(
        X_te.select_sites("s0"), y_te
    )
    assert res["test_score"][0] == pytest.approx(expected)
    sub = site_sweep(GroupedArgmaxClassifier(), X_tr, y_tr, X_te, y_te,
                     sites=["s3", "s1"], scoring="accuracy", n_jobs=2)
    assert list(sub["site"]) == ["s3", "s1"]
    with pytest.raises(ValueError, match="X_test lacks"):
        site_sweep(GroupedArgmaxLogisticClassifier(), X_tr, y_tr,
                   X_te.select_sites(["s0"]), y_te, sites=["s0", "s1"])
    assert "optimistic" in site_sweep.__doc__


def test_task_id_fallback_not_passed_to_splitters_that_ignore_groups():
    """KFold gets no fallback groups (so no 'groups parameter is ignored' warning)."""
    import warnings

    from sklearn.model_selection import KFold

    from skafa import GroupedArgmaxLogisticClassifier, SiteSelector, TurnFeatures

    rng = np.random.default_rng(0)
    sizes = rng.integers(3, 6, 20)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    X = TurnFeatures(rng.normal(size=(offsets[-1], 2, 4)), offsets, sites=["a", "b"],
                     task_ids=[f"t{i // 2}" for i in range(20)])
    y = np.array([rng.integers(0, s) for s in sizes])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=KFold(3)).fit(X, y)


# ------------------------------------------------------------- joint param_grid
def test_param_grid_searches_candidates_jointly_with_sites():
    from sklearn.dummy import DummyClassifier
    from sklearn.linear_model import LogisticRegression

    X, y = make_sites(90, signal=3.0, seed=11)
    # a constant turn model (always the first turn) cannot beat a fitted one
    blind, fitted = DummyClassifier(), LogisticRegression()
    sel = SiteSelector(GroupedArgmaxClassifier(), cv=GroupKFold(3),
                       param_grid={"estimator": [blind, fitted]}).fit(X, y)
    n = len(SITES[:5])
    assert len(sel.cv_results_["params"]) == 2 * n
    assert sel.cv_results_["params"][n + 3] == {"site": SITES[3], "estimator": fitted}
    assert list(sel.cv_results_["param_estimator"]) == [blind] * n + [fitted] * n
    assert sel.best_params_ == {"estimator": fitted} and sel.best_site_ == SITES[3]
    assert sel.best_index_ == n + 3
    assert isinstance(sel.best_estimator_.estimator_, LogisticRegression)
    means = sel.cv_results_["mean_test_score"]
    np.testing.assert_allclose(sel.candidate_scores_, [means[:n].max(), means[n:].max()])
    assert sel.candidate_scores_[1] > sel.candidate_scores_[0]
    # the same as a plain selection with the winner (same splits, same scores)
    plain = SiteSelector(GroupedArgmaxClassifier(LogisticRegression()),
                         cv=GroupKFold(3)).fit(X, y)
    np.testing.assert_array_equal(plain.cv_results_["mean_test_score"], means[n:])
    np.testing.assert_array_equal(plain.predict(X), sel.predict(X))


def test_param_grid_ties_go_to_the_earliest_candidate():
    X, y = make_sites(60, signal=3.0, seed=12)
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3),
                       param_grid=[{"C": [0.5]}, {"C": [0.5]}]).fit(X, y)
    assert sel.best_index_ < len(SITES[:5])                 # the first of two equal candidates


def test_param_grid_with_n_sites_compares_the_site_averages():
    from sklearn.model_selection import cross_val_score

    X, y = make_sites(90, signal=1.0, seed=13)
    groups = np.asarray(X.task_ids, dtype=object)
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3), n_sites=2,
                       param_grid={"C": [0.01, 1.0]}).fit(X, y, groups=groups)
    for j, C in enumerate([0.01, 1.0]):
        one = SiteSelector(GroupedArgmaxLogisticClassifier(C=C), cv=GroupKFold(3),
                           n_sites=2).fit(X, y, groups=groups)
        expect = np.mean(cross_val_score(
            SiteEnsemble(GroupedArgmaxLogisticClassifier(C=C), sites=list(one.best_sites_)),
            X, y, groups=groups, cv=GroupKFold(3)))
        assert sel.candidate_scores_[j] == pytest.approx(expect)
        if sel.best_params_["C"] == C:
            assert sel.best_sites_ == one.best_sites_
            np.testing.assert_array_equal(sel.predict(X), one.predict(X))
    assert sel.candidate_scores_[[0.01, 1.0].index(sel.best_params_["C"])] == \
        sel.candidate_scores_.max()


@pytest.mark.parametrize("grid, match", [
    ({"site": ["a"]}, "chooses the site itself"),
    ({"nope": [1]}, "param_grid candidate"),
    ([], "param_grid is empty"),
])
def test_param_grid_bad_candidates_are_refused(grid, match):
    X, y = make_sites(30, seed=14)
    with pytest.raises(ValueError, match=match):
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3),
                     param_grid=grid).fit(X, y)


# ---------------------------------------------------- refit=False after a refit
def test_refit_false_drops_the_previous_best_estimator():
    X, y = make_turn_features(16, n_features=4)
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(2)).fit(X, y)
    assert sel.n_features_in_ == 4 and hasattr(sel, "refit_time_")
    narrow, _ = make_turn_features(16, n_features=3)
    sel.set_params(refit=False).fit(narrow, y)
    assert not hasattr(sel, "best_estimator_")  # was the 4-feature model of the first fit
    assert not hasattr(sel, "refit_time_")
    assert not hasattr(sel, "n_features_in_")  # was 4, for data with 3 features
    with pytest.raises(AttributeError, match="refit=False"):
        sel.predict(narrow)
    # refitting with refit=True brings them back, for the new data
    assert sel.set_params(refit=True).fit(narrow, y).n_features_in_ == 3


def test_more_sites_asked_than_compared_is_a_configuration_error():
    """Issue 31: a bare ValueError the CLI reported as unexpected."""
    from skafa.exceptions import ConfigurationError
    from skafa.testing import make_site_features

    X, y = make_site_features(30, n_sites=2, signal_site=1)[:2]
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), n_sites=3, cv=GroupKFold(3))
    with pytest.raises(ConfigurationError, match="averages the 3 best sites, but X holds only 2"):
        sel.fit(X, y)


def test_groups_with_a_missing_entry_are_named():
    """Issue 33: groups holding None failed with a bare TypeError from sorting."""
    from skafa.testing import make_site_features

    X, y = make_site_features(30, n_sites=2, signal_site=1)[:2]
    groups = [f"t{i // 3}" for i in range(30)]
    groups[7] = None
    with pytest.raises(ValueError, match=r"groups\[7\] is None"):
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(
            X, y, groups=groups)
    with pytest.raises(ValueError, match="groups has 29 entries for 30"):
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(
            X, y, groups=groups[:29])
