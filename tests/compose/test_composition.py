"""The probe estimators composed with scikit-learn's tools.

Pipelines, grid searches, cross-validation (grouped, nested, with metadata
routing), clone/pickle/joblib round trips, the HTML repr, scikit-learn's estimator
checks, and an end-to-end pipeline from conversations through a tiny random
language model.
"""

import pickle
import warnings

import joblib
import numpy as np
import pytest
import sklearn
from sklearn.base import clone, is_classifier
from sklearn.decomposition import PCA
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import (
    GridSearchCV,
    GroupKFold,
    cross_val_predict,
    cross_val_score,
    cross_validate,
)
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils import estimator_html_repr
from sklearn.utils.validation import check_is_fitted

from skafa import (
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    PerTurn,
    TurnFeatures,
)
from skafa.model_selection import SiteSelector

SITES = ("s0", "s1", "s2", "s3")


def make_sites(n=72, *, signal_site=2, n_features=5, signal=3.0, seed=0, task_ids=True):
    rng = np.random.default_rng(seed)
    n_turns = rng.integers(3, 10, size=n)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n) * n_turns).astype(np.int64)
    values = rng.normal(size=(offsets[-1], len(SITES), n_features))
    values[offsets[:-1] + y, signal_site, 0] += signal
    # Sites on different scales: PerTurn(StandardScaler()) has work to do.
    values *= np.array([1.0, 10.0, 100.0, 0.1])[None, :, None]
    X = TurnFeatures(
        values, offsets, sites=SITES,
        speakers=[f"agent{j % 3}" for j in range(offsets[-1])],
        task_ids=[f"task{i // 2}" for i in range(n)] if task_ids else None,
    )
    return X, y


@pytest.fixture(scope="module")
def data():
    X, y = make_sites(108)
    return X[:72], y[:72], X[72:], y[72:]


def make_pipeline(**selector_kw):
    return Pipeline([
        ("feat", PerTurn(StandardScaler())),
        ("sel", SiteSelector(GroupedArgmaxLogisticClassifier(),
                             cv=selector_kw.pop("cv", GroupKFold(3)), **selector_kw)),
    ])


@pytest.fixture(scope="module")
def fitted_pipeline(data):
    X_tr, y_tr, _, _ = data
    return make_pipeline().fit(X_tr, y_tr, sel__groups=X_tr.task_ids)


# ---------------------------------------------------------------- pipeline
def test_pipeline_per_turn_then_site_selector(data, fitted_pipeline):
    X_tr, _, X_te, y_te = data
    pipe = fitted_pipeline
    assert pipe.named_steps["sel"].best_site_ == "s2"
    assert pipe.score(X_te, y_te) > 0.6
    pred = pipe.predict(X_te)
    assert pred.shape == (len(X_te),) and pred.dtype.kind == "i"
    # The scaler was fitted on the training turns of each site only.
    scalers = pipe.named_steps["feat"].transformers_
    for site in SITES:
        np.testing.assert_allclose(scalers[site].mean_, X_tr.turn_matrix(site).mean(axis=0))
    # Methods beyond predict/score: go through the fitted steps explicitly.
    Xt = pipe[:-1].transform(X_te)
    agents = pipe[-1].predict_agent(Xt)
    np.testing.assert_array_equal(agents, X_te.speakers[X_te.offsets[:-1] + pred])


def test_pipeline_with_pca_and_probe(data):
    X_tr, y_tr, X_te, y_te = data
    pipe = Pipeline([
        ("pca", PerTurn(PCA(n_components=4, random_state=0))),
        ("probe", GroupedArgmaxLogisticClassifier(site="s2")),
    ]).fit(X_tr, y_tr)
    assert pipe.score(X_te, y_te) > 0.5


def test_not_a_classifier():
    for est in (GroupedArgmaxClassifier(), GroupedArgmaxLogisticClassifier(),
                SiteSelector(GroupedArgmaxLogisticClassifier())):
        assert not is_classifier(est)


# ------------------------------------------------------------ grid search
def test_grid_search_over_c_and_site(data):
    X_tr, y_tr, X_te, y_te = data
    search = GridSearchCV(
        GroupedArgmaxLogisticClassifier(),
        {"C": [0.01, 1.0], "site": list(SITES)},
        cv=GroupKFold(3),
    )
    search.fit(X_tr, y_tr, groups=X_tr.task_ids)
    assert search.best_params_["site"] == "s2"
    assert search.best_estimator_.site_ == "s2"
    assert len(search.cv_results_["params"]) == 8
    assert search.score(X_te, y_te) > 0.6
    # The search's predict is the refitted probe's predict.
    np.testing.assert_array_equal(search.predict(X_te), search.best_estimator_.predict(X_te))


def test_grid_search_over_pipeline_parameters(data):
    X_tr, y_tr, _, _ = data
    search = GridSearchCV(
        make_pipeline(),
        {"sel__estimator__C": [0.1, 1.0]},
        cv=GroupKFold(2),
    ).fit(X_tr, y_tr, groups=X_tr.task_ids)
    assert search.best_estimator_.named_steps["sel"].best_site_ == "s2"


# -------------------------------------------------------- cross-validation
def test_cross_val_score_and_predict_with_task_groups(data):
    X_tr, y_tr, _, _ = data
    X1 = X_tr.select_sites("s2")
    groups = X_tr.task_ids
    scores = cross_val_score(GroupedArgmaxLogisticClassifier(), X1, y_tr,
                             groups=groups, cv=GroupKFold(3))
    assert scores.shape == (3,) and scores.mean() > 0.6
    pred = cross_val_predict(GroupedArgmaxLogisticClassifier(), X1, y_tr,
                             groups=groups, cv=GroupKFold(3))
    assert pred.shape == (len(X1),) and pred.dtype.kind == "i"
    assert np.all(pred < X1.n_turns)
    assert np.mean(pred == y_tr) > 0.6


def test_int_cv_is_not_stratified(data):
    # Not a classifier: an int cv gives KFold, so no StratifiedKFold warnings
    # about rare step "classes".
    X_tr, y_tr, _, _ = data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cross_val_score(GroupedArgmaxLogisticClassifier(site="s2"), X_tr, y_tr, cv=3)


def test_probe_grid_search_and_pipeline_with_metadata_routing(data):
    # ``groups`` in the probes' fit signature is marked UNUSED, so routing it to the
    # splitter does not trip "unrequested metadata" errors; Pipeline.score passes
    # sample_weight=None, which the probes' score accepts.
    X_tr, y_tr, _, _ = data
    X1 = X_tr.select_sites("s2")
    groups = np.asarray(X_tr.task_ids)
    with sklearn.config_context(enable_metadata_routing=True):
        search = GridSearchCV(GroupedArgmaxLogisticClassifier(), {"C": [0.1, 1.0]},
                              cv=GroupKFold(3)).fit(X1, y_tr, groups=groups)
        assert search.best_score_ > 0.6
        pipe = Pipeline([("s", PerTurn(StandardScaler())),
                         ("p", GroupedArgmaxLogisticClassifier())])
        scores = cross_validate(pipe, X1, y_tr, cv=GroupKFold(3),
                                params={"groups": groups})["test_score"]
        assert np.all(np.isfinite(scores)) and scores.mean() > 0.6


def test_nested_cv_with_metadata_routing(data):
    X, y = make_sites(72, task_ids=False)  # groups must come through routing
    groups = np.arange(72) // 2
    with sklearn.config_context(enable_metadata_routing=True):
        search = GridSearchCV(make_pipeline(cv=GroupKFold(2)),
                              {"sel__estimator__C": [0.1, 1.0]}, cv=GroupKFold(2))
        res = cross_validate(search, X, y, cv=GroupKFold(3), params={"groups": groups},
                             return_estimator=True)
    assert res["test_score"].mean() > 0.6
    for est in res["estimator"]:
        assert est.best_estimator_.named_steps["sel"].best_site_ == "s2"
    # Without routing and without task ids the inner GroupKFold gets no groups.
    search = GridSearchCV(make_pipeline(cv=GroupKFold(2)), {"sel__estimator__C": [1.0]},
                          cv=GroupKFold(2), error_score="raise")
    with pytest.raises(ValueError, match="needs groups"):
        search.fit(X, y, groups=groups)


# ------------------------------------------------------------ round trips
def test_clone_pickle_joblib_round_trips(data, fitted_pipeline, tmp_path):
    X_tr, y_tr, X_te, _ = data
    expected = fitted_pipeline.predict(X_te)
    proba = fitted_pipeline[-1].turn_predict_proba(fitted_pipeline[:-1].transform(X_te))

    restored = pickle.loads(pickle.dumps(fitted_pipeline))
    np.testing.assert_array_equal(restored.predict(X_te), expected)
    for a, b in zip(restored[-1].turn_predict_proba(restored[:-1].transform(X_te)), proba):
        np.testing.assert_array_equal(a, b)

    path = tmp_path / "pipe.joblib"
    joblib.dump(fitted_pipeline, path)
    np.testing.assert_array_equal(joblib.load(path).predict(X_te), expected)

    fresh = clone(fitted_pipeline)
    with pytest.raises(NotFittedError):
        check_is_fitted(fresh[-1])
    fresh.fit(X_tr, y_tr, sel__groups=X_tr.task_ids)
    np.testing.assert_array_equal(fresh.predict(X_te), expected)

    for est in (GroupedArgmaxClassifier(), GroupedArgmaxLogisticClassifier(C=0.3, site="s1"),
                PerTurn(PCA(2)), SiteSelector(GroupedArgmaxClassifier(), sites=["s1"])):
        assert repr(clone(est)) == repr(est)
        assert clone(est).get_params().keys() == est.get_params().keys()


def test_html_repr(fitted_pipeline):
    html = estimator_html_repr(make_pipeline())
    for name in ("PerTurn", "StandardScaler", "SiteSelector", "GroupedArgmaxLogisticClassifier"):
        assert name in html
    assert "SiteSelector" in estimator_html_repr(fitted_pipeline)
    assert "LinearSVC" in estimator_html_repr(
        GroupedArgmaxClassifier(__import__("sklearn.svm").svm.LinearSVC())
    )


# ------------------------------------------------------- estimator checks
# scikit-learn's API checks and skafa's ragged-input checks run over every public
# estimator, discovered automatically, in tests/test_estimator_checks.py.


# ------------------------------------------------------------- end to end
TINY_MODEL = "skafa-tests-tiny-llama-composition"


@pytest.fixture(scope="module")
def tiny_model():
    """Register a tiny random llama under a name (skips if the modules are absent)."""
    extraction = pytest.importorskip("skafa.llm._extraction")
    if not hasattr(extraction, "TurnActivationTransformer"):
        pytest.skip("skafa.llm.TurnActivationTransformer is not available yet")
    testing = pytest.importorskip("skafa.testing")
    models = pytest.importorskip("skafa.llm._models")
    model = testing.make_tiny_llama(n_layers=2, hidden=32, seed=0)
    tokenizer = testing.make_tiny_tokenizer()
    models.register_model(TINY_MODEL, model, tokenizer, overwrite=True)
    yield model
    models.unregister_model(TINY_MODEL)


def test_end_to_end_from_conversations(tiny_model):
    from skafa.llm import TurnActivationTransformer
    from skafa.testing import make_conversations

    convs = make_conversations(24, min_turns=2, max_turns=5, seed=0)
    y = np.array([c.mistake_step for c in convs])
    groups = np.array([c.task_id for c in convs])
    pipe = Pipeline([
        ("acts", TurnActivationTransformer(model=TINY_MODEL)),
        ("sel", SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(2))),
    ])
    pipe.fit(convs, y, sel__groups=groups)
    sel = pipe.named_steps["sel"]
    Xt = pipe[:-1].transform(convs)
    assert isinstance(Xt, TurnFeatures) and len(Xt) == 24
    assert tuple(sel.cv_results_["site"]) == Xt.sites  # every extracted site compared
    assert sel.best_site_ in Xt.sites
    pred = pipe.predict(convs)
    assert pred.shape == (24,)
    assert np.all((pred >= 0) & (pred < np.array([len(c) for c in convs])))
    agents = sel.predict_agent(Xt)
    np.testing.assert_array_equal(
        agents, [c.speakers[p] for c, p in zip(convs, pred)]
    )
    # Cross-validation through the whole pipeline, grouped by task.
    scores = cross_val_score(pipe, convs, y, groups=groups, cv=GroupKFold(2))
    assert scores.shape == (2,) and np.all((scores >= 0) & (scores <= 1))

    # Cloning copies the model *name*, never the weights.
    cloned = clone(pipe)
    assert cloned.named_steps["acts"].model == TINY_MODEL
    assert len(pickle.dumps(cloned)) < 20_000
    n_weight_bytes = sum(p.numel() * p.element_size() for p in tiny_model.parameters())
    assert len(pickle.dumps(cloned)) < n_weight_bytes
    # The name resolves to the one registered object (process registry, no copy).
    from skafa.llm import load_model

    loaded_model, _ = load_model(cloned.named_steps["acts"].model)
    assert loaded_model is tiny_model
