"""A saved estimator whose fitted arrays disagree with each other is refused at load
("Hostile and odd input, round four", item 4).

A stranger's file is self-consistent as far as the digests go: whoever edits it
re-signs it (the helpers below recompute both SHA-256 digests and the shapes recorded
in ``skafa.json``), so the digests are not what catches these edits. ``coef_`` one
column wider than the features the probe reads, an ``intercept_`` of the wrong length,
``classes_`` that do not match the coefficient rows, a chosen site outside the blocks
the extractor produces: each used to load and fail later, inside numpy, at predict.
Now :func:`skafa.persistence.load` checks the fitted attributes against each other
and raises its ``ValueError`` naming the file, the place, the attribute and both
shapes.
"""

import json

import numpy as np
import pytest
from sklearn.base import BaseEstimator
from sklearn.model_selection import GroupKFold

from skafa import FailureAttributor, TurnFeatures
from skafa.llm import TurnActivationTransformer, register_model, unregister_model
from skafa.model_selection import SiteSelector
from skafa.persistence import ARRAYS_NAME, JSON_NAME, load, register_class, save
from skafa.persistence import _persistence as persistence
from skafa.probes import (
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
)
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

SITES = ("s0", "s1", "s2")


def make_features(n=30, *, n_features=4, seed=0):
    rng = np.random.default_rng(seed)
    n_turns = rng.integers(2, 6, size=n)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n) * n_turns).astype(np.int64)
    values = rng.normal(size=(offsets[-1], len(SITES), n_features))
    values[offsets[:-1] + y, 1, 0] += 2.0
    X = TurnFeatures(values, offsets, sites=SITES,
                     task_ids=[f"task{i // 2}" for i in range(n)])
    return X, y


def rewrite(path, edit):
    """Edit skafa.json's document and re-sign the tree."""
    doc = json.loads((path / JSON_NAME).read_text())
    edit(doc)
    doc["tree_sha256"] = persistence._sha256(persistence._canonical(doc["tree"]))
    (path / JSON_NAME).write_text(json.dumps(doc))


def rewrite_arrays(path, edit):
    """Edit arrays.safetensors (a dict of arrays), then re-sign both files, with the
    shapes and dtypes recorded in skafa.json following the edit (as an attacker would)."""
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    arrays = dict(st_load((path / ARRAYS_NAME).read_bytes()))
    edit(arrays)
    blob = st_save(arrays, metadata={"format": "skafa.estimator/2"})
    (path / ARRAYS_NAME).write_bytes(blob)

    def sync(node):
        if isinstance(node, dict):
            if isinstance(node.get("__ndarray__"), str) and node["__ndarray__"] in arrays:
                arr = arrays[node["__ndarray__"]]
                node["dtype"], node["shape"] = arr.dtype.str.lstrip("<>=|"), list(arr.shape)
            for v in node.values():
                sync(v)
        elif isinstance(node, list):
            for v in node:
                sync(v)

    def edit_all(doc):
        doc["arrays"].update(sha256=persistence._sha256(blob), n_bytes=len(blob),
                             n_arrays=len(arrays))
        sync(doc["tree"])

    rewrite(path, edit_all)


def widen(key, extra=1):
    """An edit adding ``extra`` columns (last axis) to the array ``key``."""
    def edit(arrays):
        a = arrays[key]
        pad = np.zeros(a.shape[:-1] + (extra,), dtype=a.dtype)
        arrays[key] = np.concatenate([a, pad], axis=-1)
    return edit


def lengthen(key, extra=1):
    """An edit adding ``extra`` entries (first axis) to the array ``key``."""
    def edit(arrays):
        a = arrays[key]
        arrays[key] = np.concatenate([a, np.zeros((extra,) + a.shape[1:], dtype=a.dtype)])
    return edit


def refused(path, *words):
    """load raises the loader's ValueError naming the file and every word."""
    with pytest.raises(ValueError) as info:
        load(path)
    message = str(info.value)
    assert str(path / JSON_NAME) in message, message
    for word in words:
        assert word in message, (word, message)
    return message


@pytest.fixture(scope="module")
def data():
    return make_features()


def _saved(est, data, tmp_path, name="probe"):
    X, y = data
    return save(est.fit(X.select_sites("s1"), y), tmp_path / name)


# ----------------------------------------------------------------- coefficients
def test_softmax_coef_wider_than_the_features(data, tmp_path):
    """GroupedSoftmaxClassifier scores with coef_ itself: 5 weights for 4 features."""
    path = _saved(GroupedSoftmaxClassifier(), data, tmp_path)
    rewrite_arrays(path, widen("coef_"))
    refused(path, "GroupedSoftmaxClassifier", "coef_", "(1, 5)", "n_features_in_", "4")


def test_logistic_inner_coef_wider_than_the_features(data, tmp_path):
    """The scikit-learn LogisticRegression inside the probe: coef_ (1, 5), n_features_in_
    4; the place in the tree is named."""
    path = _saved(GroupedArgmaxLogisticClassifier(), data, tmp_path)
    rewrite_arrays(path, widen("estimator_.steps.1.1.coef_"))
    refused(path, "LogisticRegression", "coef_", "(1, 5)", "4", "estimator_.steps.1.1")


def test_logistic_probe_coef_wider_than_the_features(data, tmp_path):
    path = _saved(GroupedArgmaxLogisticClassifier(), data, tmp_path)
    rewrite_arrays(path, widen("coef_", 3))
    refused(path, "GroupedArgmaxLogisticClassifier", "coef_", "(1, 7)", "4")


def test_intercept_of_the_wrong_length(data, tmp_path):
    path = _saved(GroupedArgmaxLogisticClassifier(), data, tmp_path)
    rewrite_arrays(path, lengthen("estimator_.steps.1.1.intercept_", 2))
    refused(path, "intercept_", "(3,)", "coef_", "(1, 4)")


def test_classes_that_do_not_match_the_coefficient_rows(data, tmp_path):
    path = _saved(GroupedArgmaxLogisticClassifier(), data, tmp_path)

    def edit(arrays):
        arrays["estimator_.steps.1.1.classes_"] = np.array([0, 1, 2], dtype=np.int64)
    rewrite_arrays(path, edit)
    refused(path, "classes_", "(3,)", "coef_", "(1, 4)")


def test_scaler_statistics_of_another_width(data, tmp_path):
    path = _saved(GroupedArgmaxLogisticClassifier(), data, tmp_path)
    rewrite_arrays(path, lengthen("estimator_.steps.0.1.mean_"))
    refused(path, "StandardScaler", "mean_", "(5,)", "n_features_in_", "4")


def test_pipeline_steps_that_disagree_on_the_width(data, tmp_path):
    """Scaler and logistic regression each consistent, but 4 features out of the scaler
    and 5 into the regression."""
    path = _saved(GroupedArgmaxLogisticClassifier(), data, tmp_path)
    rewrite_arrays(path, widen("estimator_.steps.1.1.coef_"))

    def edit(doc):
        state = doc["tree"]["state"]["estimator_"]["params"]["steps"][1]["__tuple__"][1][
            "state"]
        state["n_features_in_"] = 5
    rewrite(path, edit)
    refused(path, "Pipeline", "n_features_in_", "5", "4", "'scaler'", "'logistic'")


def test_feature_count_of_another_type(data, tmp_path):
    path = _saved(GroupedSoftmaxClassifier(), data, tmp_path)
    rewrite(path, lambda doc: doc["tree"]["state"].update(n_features_in_="4"))
    refused(path, "n_features_in_", "'4'")


# ---------------------------------------------------------------- chosen sites
def test_best_index_outside_the_cv_results(data, tmp_path):
    X, y = data
    selector = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(X, y)
    path = save(selector, tmp_path / "selector")
    rewrite(path, lambda doc: doc["tree"]["state"].update(best_index_=7))
    refused(path, "best_index_", "7", "cv_results_", "3")


@pytest.fixture(scope="module")
def fitted_attributor():
    name = "consistency-tiny"
    register_model(name, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    fa = FailureAttributor(
        TurnActivationTransformer(name, sites=["resid_pre.1", "resid_final"],
                                  memory_cache=False),
        SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0), cv=GroupKFold(2)),
    ).fit(make_conversations(8, seed=2))
    yield fa
    unregister_model(name)


def _selector_state(doc):
    return doc["tree"]["state"]["pipeline_"]["params"]["steps"][1]["__tuple__"][1]["state"]


def test_attributor_chose_a_site_the_extractor_does_not_produce(fitted_attributor,
                                                                 tmp_path):
    path = fitted_attributor.save(tmp_path / "fa")
    assert FailureAttributor.load(path).best_site_ == fitted_attributor.best_site_

    def rename(node, old, new):
        """Every string ``old`` in ``node`` (the selector's results) becomes ``new``."""
        if isinstance(node, dict):
            return {k: v if k == "best_estimator_" else rename(v, old, new)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rename(v, old, new) for v in node]
        return new if node == old else node

    def edit(doc):
        # the selector's own results stay consistent (it compared and chose resid_pre.7),
        # so only the attributor sees that its extractor does not produce that site
        selector = doc["tree"]["state"]["pipeline_"]["params"]["steps"][1]["__tuple__"][1]
        selector["state"] = rename(selector["state"], fitted_attributor.best_site_,
                                   "resid_pre.7")
        state = doc["tree"]["state"]
        state["best_site_"] = "resid_pre.7"
        state["best_sites_"] = {"__tuple__": ["resid_pre.7"]}
    rewrite(path, edit)
    refused(path, "FailureAttributor", "best_site", "resid_pre.7", "resid_pre.1",
            "resid_final")


def test_attributor_copies_disagree_with_its_selector(fitted_attributor, tmp_path):
    path = fitted_attributor.save(tmp_path / "fa")
    other = ({"resid_pre.1", "resid_final"} - {fitted_attributor.best_site_}).pop()
    rewrite(path, lambda doc: doc["tree"]["state"].update(best_site_=other))
    refused(path, "FailureAttributor", "best_site_", other, fitted_attributor.best_site_)


def test_attributor_probe_coef_wider_than_the_activations(fitted_attributor, tmp_path):
    path = fitted_attributor.save(tmp_path / "fa")
    from safetensors.numpy import load as st_load

    keys = [k for k in st_load((path / ARRAYS_NAME).read_bytes())
            if k.endswith("best_estimator_.estimator_.steps.1.1.coef_")]
    assert len(keys) == 1
    rewrite_arrays(path, widen(keys[0], 2))
    refused(path, "coef_", "(1, 34)", "32", "LogisticRegression")


# ------------------------------------------------------------- the class hook
class Lookup(BaseEstimator):
    """A custom estimator carrying its own consistency check."""

    def fit(self):
        self.keys_ = np.arange(3)
        self.values_ = np.ones(3)
        return self

    def _check_fitted_consistency(self):
        if self.keys_.shape != self.values_.shape:
            raise ValueError(f"keys_ has shape {self.keys_.shape} but values_ has shape "
                             f"{self.values_.shape}")


def test_a_class_checks_its_own_fitted_state(tmp_path):
    register_class(Lookup)
    path = save(Lookup().fit(), tmp_path / "lookup")
    assert load(path).keys_.shape == (3,)
    rewrite_arrays(path, lengthen("values_"))
    refused(path, "Lookup", "keys_ has shape (3,) but values_ has shape (4,)")


def test_consistent_files_still_load(data, tmp_path):
    X, y = data
    for i, est in enumerate([GroupedArgmaxLogisticClassifier(standardize=False),
                             GroupedArgmaxClassifier(), GroupedSoftmaxClassifier(),
                             SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3),
                                          n_sites=2)]):
        Xs = X if isinstance(est, SiteSelector) else X.select_sites("s1")
        est.fit(Xs, y)
        loaded = load(save(est, tmp_path / f"e{i}"))
        np.testing.assert_array_equal(loaded.predict(Xs), est.predict(Xs))


# ------------------------------------------------ the probes' own check (follow-up)
def _sparse_features(n=30, seed=0):
    """Turn rows with 50 declared columns, 4 of which (2, 9, 31, 47) hold values: a
    linear probe fits on those 4 (``active_features_``)."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    n_turns = rng.integers(2, 6, size=n)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n) * n_turns).astype(np.int64)
    dense = np.abs(rng.normal(size=(offsets[-1], 4)))
    dense[dense < 0.7] = 0.0
    dense[offsets[:-1] + y, 0] += 2.0
    M = sp.csr_matrix(dense)
    wide = sp.csr_matrix((M.data, np.array([2, 9, 31, 47])[M.indices], M.indptr),
                         shape=(M.shape[0], 50))
    return TurnFeatures(wide, offsets), y


def _saved_sparse(est, tmp_path):
    X, y = _sparse_features()
    path = save(est.fit(X, y), tmp_path / "sparse")
    np.testing.assert_array_equal(load(path).active_features_, [2, 9, 31, 47])
    return path


def _set_active(columns):
    def edit(arrays):
        arrays["active_features_"] = np.asarray(columns, dtype=np.int64)
    return edit


def test_turn_model_of_another_width_than_the_probe_reads(data, tmp_path):
    """GroupedArgmaxClassifier's turn model (a LogisticRegression, consistent in itself)
    was fitted on 4 features; the probe is edited to read 5 (nothing else holds that
    width for the conventions to compare)."""
    path = _saved(GroupedArgmaxClassifier(), data, tmp_path)
    rewrite(path, lambda doc: doc["tree"]["state"].update(n_features_in_=5))
    refused(path, "GroupedArgmaxClassifier", "estimator_", "4 features",
            "n_features_in_ is 5")


@pytest.mark.parametrize("probe", [GroupedArgmaxLogisticClassifier(),
                                   GroupedSoftmaxClassifier()],
                         ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("columns, words", [
    ([2, 9, 31, 60], ["active_features_", "column 60", "n_features_in_ is 50"]),
    ([2, -1, 31, 47], ["active_features_", "column -1"]),
    ([9, 2, 31, 47], ["active_features_", "sorted and unique", "9, 2"]),
    ([2, 9, 9, 47], ["active_features_", "sorted and unique", "9, 9"]),
    ([2, 9, 31], ["fitted on 4 features", "active_features_ names 3 columns"]),
], ids=["beyond", "negative", "unsorted", "repeated", "fewer"])
def test_compacted_probe_columns_that_disagree(probe, columns, words, tmp_path):
    """After a sparse fit the turn model reads the columns ``active_features_`` names:
    they must be sorted, unique and below n_features_in_, one per column the turn model
    (and its scaler) was fitted on."""
    from sklearn.base import clone

    path = _saved_sparse(clone(probe), tmp_path)
    rewrite_arrays(path, _set_active(columns))
    refused(path, type(probe).__name__, *words)


# ------------------------------------- the selector's and ensemble's own check (follow-up)
@pytest.fixture(scope="module")
def fitted_selectors(data):
    X, y = data
    one = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(X, y)
    two = SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3), n_sites=2).fit(X, y)
    return one, two


def test_selector_chose_a_site_it_did_not_compare(fitted_selectors, tmp_path):
    path = save(fitted_selectors[0], tmp_path / "selector")
    rewrite(path, lambda doc: doc["tree"]["state"].update(
        best_site_="s9", best_sites_={"__tuple__": ["s9"]}))
    refused(path, "SiteSelector", "best_site_", "'s9'", "sites_", "'s0', 's1', 's2'")


def test_selector_kept_sites_it_did_not_compare(fitted_selectors, tmp_path):
    selector = fitted_selectors[1]
    path = save(selector, tmp_path / "selector")
    kept = [selector.best_site_, "s7"]
    rewrite(path, lambda doc: doc["tree"]["state"].update(best_sites_={"__tuple__": kept}))
    refused(path, "SiteSelector", "best_sites_", "'s7'", "sites_")


def test_selector_best_site_is_not_the_cv_results_row(fitted_selectors, tmp_path):
    selector = fitted_selectors[0]
    path = save(selector, tmp_path / "selector")
    other = next(s for s in SITES if s != selector.best_site_)
    rewrite(path, lambda doc: doc["tree"]["state"].update(
        best_site_=other, best_sites_={"__tuple__": [other]}))
    refused(path, "SiteSelector", "best_site_", repr(other), "best_index_",
            repr(selector.best_site_))


def test_selector_ensemble_reads_other_sites_than_it_kept(fitted_selectors, tmp_path):
    selector = fitted_selectors[1]
    path = save(selector, tmp_path / "selector")
    kept = list(selector.best_sites_)
    swapped = [next(s for s in SITES if s not in kept), kept[1]]

    def edit(doc):
        doc["tree"]["state"]["best_estimator_"]["state"]["sites_"] = {"__tuple__": swapped}
    rewrite(path, edit)
    refused(path, "SiteSelector", "best_estimator_", "sites_", repr(swapped[0]),
            "best_sites_")


def test_ensemble_with_a_member_missing(data, tmp_path):
    from skafa.model_selection import SiteEnsemble

    X, y = data
    path = save(SiteEnsemble(GroupedSoftmaxClassifier()).fit(X, y), tmp_path / "ensemble")
    rewrite(path, lambda doc: doc["tree"]["state"]["estimators_"].pop())
    refused(path, "SiteEnsemble", "estimators_", "2", "sites_", "3")


def test_ensemble_scales_of_another_length(data, tmp_path):
    from skafa.model_selection import SiteEnsemble

    X, y = data
    path = save(SiteEnsemble(GroupedSoftmaxClassifier()).fit(X, y), tmp_path / "ensemble")
    rewrite_arrays(path, lengthen("score_scale_"))
    refused(path, "SiteEnsemble", "score_scale_", "(4,)", "sites_", "3")
