"""One validation style, run statistics outside fitted state, truthful tags,
consistent sample_weight, feature names of the extractor, task ids that keep their type.
"""

import inspect

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import BaseEstimator, clone
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import Pipeline
from sklearn.utils import get_tags
from sklearn.utils.validation import has_fit_parameter

from skafa import (
    Conversation,
    DummyStepClassifier,
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    SiteSelector,
    Turn,
    TurnActivationTransformer,
    TurnFeatures,
    TurnFeatureUnion,
    TurnPositionTransformer,
)
from skafa.attributor import _groups_from
from skafa.testing import make_conversations, register_tiny_model
from skafa.utils import all_estimators
from skafa.utils.estimator_checks import make_turn_features

ESTIMATORS = [cls for _, cls in all_estimators() if not issubclass(cls, Pipeline)]


# ------------------------------------------------------------ validation style
@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_one_validation_style(cls):
    # Every parameter has a constraint, fit goes through _fit_context, and no
    # class shadows scikit-learn's _validate_params with a method of its own.
    params = set(inspect.signature(cls.__init__).parameters) - {"self"}
    assert set(cls._parameter_constraints) == params
    assert hasattr(cls.fit, "__wrapped__"), f"{cls.__name__}.fit lacks _fit_context"
    for klass in cls.__mro__:
        if klass.__module__.startswith("skafa"):
            assert "_validate_params" not in vars(klass), klass


def test_constraints_reject_bad_parameters_with_sklearn_errors():
    from sklearn.utils._param_validation import InvalidParameterError

    X, y = make_turn_features(8)
    convs = make_conversations(4)
    with pytest.raises(InvalidParameterError, match="'strategy' parameter"):
        DummyStepClassifier(strategy="nope").fit(X, y)
    with pytest.raises(InvalidParameterError, match="'max_index' parameter"):
        TurnPositionTransformer(max_index=0).fit(convs)
    with pytest.raises(InvalidParameterError, match="'batch_size' parameter"):
        TurnActivationTransformer(register_tiny_model(), batch_size=0).fit(convs)
    # the extra checks stay in fit, with their hints
    with pytest.raises(ValueError, match="strategy='constant' needs an int"):
        DummyStepClassifier(strategy="constant").fit(X, y)
    with pytest.raises(TypeError, match="register_model"):
        TurnActivationTransformer(object()).fit(convs)


# ------------------------------------------------------------ run statistics
def _fitted_state(est):
    import joblib

    return {k: joblib.hash(v) for k, v in vars(est).items()
            if k.endswith("_") and not k.startswith("_")}


def test_transform_changes_no_fitted_attribute_and_run_stats_count():
    convs = make_conversations(5, seed=3)
    ext = TurnActivationTransformer(register_tiny_model(), sites=["resid_final"],
                                    memory_cache=True).fit(convs)
    before = _fitted_state(ext)
    assert ext.run_stats["n_forward_passes"] == 0
    ext.transform(convs)
    first = ext.run_stats
    ext.transform(convs)
    assert _fitted_state(ext) == before
    assert not any(k in vars(ext) for k in ("n_forward_passes_", "cache_stats_"))
    second = ext.run_stats
    assert second["n_forward_passes"] == first["n_forward_passes"]  # served from cache
    assert second["memory_hits"] == first["memory_hits"] + 5
    assert first["n_forward_passes"] <= 5
    # a copy, not a live view; reset by fit
    first["n_forward_passes"] = -1
    assert ext.run_stats["n_forward_passes"] != -1
    assert ext.fit(convs).run_stats["n_forward_passes"] == 0
    assert "_run_stats" not in ext.__getstate__()


def test_run_stats_needs_fit():
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        TurnActivationTransformer(register_tiny_model()).run_stats  # noqa: B018


# ------------------------------------------------------------ feature names
def test_extractor_feature_names_make_union_feature_names_work():
    convs = make_conversations(4)
    union = TurnFeatureUnion([
        ("acts", TurnActivationTransformer(register_tiny_model(), sites=["resid_final"])),
        ("pos", TurnPositionTransformer(include=["relative"])),
    ])
    Xt = union.fit_transform(convs)
    names = union.get_feature_names_out()
    assert list(names) == list(Xt.feature_names)
    assert names[0] == "acts__x0" and names[-1] == "pos__relative" and len(names) == 33


# ------------------------------------------------------------ sample_weight
@pytest.mark.parametrize("est", [
    GroupedArgmaxLogisticClassifier(), GroupedArgmaxLogisticClassifier(standardize=False),
    GroupedArgmaxClassifier(), DummyStepClassifier(strategy="most_frequent"),
    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)),
], ids=lambda e: type(e).__name__)
def test_sample_weight_in_fit_and_score(est):
    X, y = make_turn_features(12, seed=1)
    assert "sample_weight" in inspect.signature(type(est).score).parameters
    if not isinstance(est, SiteSelector):  # SiteSelector passes **params to the estimator
        assert has_fit_parameter(est, "sample_weight")
    plain = clone(est).fit(X, y)
    ones = clone(est).fit(X, y, sample_weight=np.ones(len(X)))
    np.testing.assert_array_equal(plain.predict(X), ones.predict(X))
    # an integer weight is a repeated conversation
    w = np.ones(len(X), dtype=int)
    w[:3] = [3, 0, 2]
    idx = np.repeat(np.arange(len(X)), w)
    weighted = clone(est).fit(X, y, sample_weight=w)
    repeated = clone(est).fit(X[idx], y[idx])
    if hasattr(weighted, "turn_decision_function") and not isinstance(est, SiteSelector):
        for a, b in zip(weighted.turn_decision_function(X), repeated.turn_decision_function(X)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if not isinstance(est, SiteSelector):  # folds differ with repetition
        np.testing.assert_array_equal(weighted.predict(X), repeated.predict(X))
    hits = (plain.predict(X) == y).astype(float)
    assert plain.score(X, y, sample_weight=w) == pytest.approx(np.average(hits, weights=w))


def test_sample_weight_needs_a_turn_estimator_that_takes_it():
    from sklearn.neighbors import KNeighborsClassifier

    X, y = make_turn_features(8)
    with pytest.raises(TypeError, match="does not accept sample_weight"):
        GroupedArgmaxClassifier(KNeighborsClassifier()).fit(X, y, sample_weight=np.ones(8))


# ------------------------------------------------------------ tags
@pytest.mark.parametrize("est", [GroupedArgmaxLogisticClassifier(), GroupedArgmaxClassifier(),
                                 SiteSelector(GroupedArgmaxLogisticClassifier())],
                         ids=lambda e: type(e).__name__)
def test_probes_refusing_arrays_do_not_claim_them(est):
    tags = get_tags(est)
    assert not tags.input_tags.two_d_array and not tags.input_tags.sparse
    with pytest.raises(TypeError, match="TurnFeatures"):
        clone(est).fit(np.zeros((6, 2)), [0, 1, 0, 1, 0, 1])
    with pytest.raises(TypeError, match="TurnFeatures"):
        clone(est).fit(sp.csr_matrix(np.zeros((6, 2))), [0, 1, 0, 1, 0, 1])


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_no_estimator_claims_string_input(cls):
    # None of them takes a list of strings: they take Conversation or TurnFeatures.
    assert issubclass(cls, BaseEstimator)
    from skafa.utils.estimator_checks import estimator_instances

    for est in estimator_instances(cls):
        assert not get_tags(est).input_tags.string


# ------------------------------------------------------------ task ids
def test_task_ids_keep_their_type():
    X = TurnFeatures(np.zeros((4, 1)), [0, 2, 4], task_ids=[np.int64(1), "1"])
    assert X.task_ids.tolist() == [1, "1"] and type(X.task_ids[0]) is int
    with pytest.raises(TypeError, match=r"task_ids\[0\] must be a str, an int or None"):
        TurnFeatures(np.zeros((2, 1)), [0, 2], task_ids=[1.5])
    convs = [Conversation([Turn("a", "x"), Turn("b", "y")], task_id=t) for t in (1, "1")]
    assert [c.task_id for c in convs] == [1, "1"]
    assert _groups_from(convs).tolist() == [0, 1]  # two groups, not one


def test_task_ids_survive_save_and_load(tmp_path):
    X = TurnFeatures(np.ones((4, 2)), [0, 2, 4], task_ids=[7, "7"])
    X.save(tmp_path / "x.safetensors")
    assert TurnFeatures.load(tmp_path / "x.safetensors").task_ids.tolist() == [7, "7"]


def test_selector_keeps_int_and_str_task_ids_apart():
    X, y = make_turn_features(12, seed=2)
    ids = [1, "1"] * 6  # two tasks, whose ids print the same
    X = TurnFeatures(X.values, X.offsets, task_ids=ids)
    seen = []

    class Spy(GroupKFold):
        def split(self, X, y=None, groups=None):
            seen.append(np.asarray(groups))
            return super().split(X, y, groups)

    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=Spy(2)).fit(X, y)
    assert len(set(seen[0].tolist())) == 2
