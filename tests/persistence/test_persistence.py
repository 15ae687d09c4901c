"""Tests for skafa.persistence._persistence: save/load as JSON + safetensors, without pickle."""

import json
import math
import os
import re
import sys
import textwrap
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import BaseEstimator
from sklearn.decomposition import PCA, TruncatedSVD
from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold, KFold
from sklearn.naive_bayes import GaussianNB
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC
from sklearn.utils import Bunch

from skafa import (
    AttributionPipeline,
    DummyStepClassifier,
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    PerTurn,
    SiteConcatenator,
    TurnFeatures,
    TurnFeatureUnion,
    TurnPositionTransformer,
    TurnTextTransformer,
)
from skafa.exceptions import ModelMismatchWarning, PersistenceVersionWarning
from skafa.llm import PromptTemplate, TurnActivationTransformer, register_model, unregister_model
from skafa.model_selection import SiteSelector
from skafa.persistence import ARRAYS_NAME, JSON_NAME, load, save
from skafa.persistence import _persistence as persistence
from skafa.testing import (
    make_conversations,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

SITES = ("s0", "s1", "s2")


def make_features(n=40, *, n_features=4, seed=0):
    rng = np.random.default_rng(seed)
    n_turns = rng.integers(2, 7, size=n)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n) * n_turns).astype(np.int64)
    values = rng.normal(size=(offsets[-1], len(SITES), n_features))
    values[offsets[:-1] + y, 1, 0] += 2.0
    X = TurnFeatures(values, offsets, sites=SITES,
                     speakers=[f"agent{j % 3}" for j in range(offsets[-1])],
                     task_ids=[f"task{i // 2}" for i in range(n)])
    return X, y


def roundtrip(est, tmp_path, name="est", **load_kw):
    path = save(est, tmp_path / name)
    return load(path, **load_kw)


def assert_bitwise(a, b):
    """Same dtype, shape and bytes (NaN-safe, sign-of-zero-safe)."""
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for u, v in zip(a, b):
            assert_bitwise(u, v)
        return
    if sp.issparse(a):
        assert sp.issparse(b) and a.format == b.format
        a, b = a.toarray(), b.toarray()
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == object:
        assert a.tolist() == b.tolist()
    else:
        assert a.tobytes() == b.tobytes()


def rewrite(path, edit):
    """Edit skafa.json's document and re-sign the tree (a consistent stranger's file)."""
    doc = json.loads((path / JSON_NAME).read_text())
    edit(doc)
    doc["tree_sha256"] = persistence._sha256(persistence._canonical(doc["tree"]))
    (path / JSON_NAME).write_text(json.dumps(doc))


# --------------------------------------------------------------------------- probes
PROBES = {
    "logistic": lambda: GroupedArgmaxLogisticClassifier(site="s1", random_state=0),
    "logistic-unscaled": lambda: GroupedArgmaxLogisticClassifier(
        site="s1", standardize=False, class_weight={0: 1.0, 1: 3.0}),
    "grouped-default": lambda: GroupedArgmaxClassifier(site=1),
    "grouped-logreg": lambda: GroupedArgmaxClassifier(LogisticRegression(C=0.5), site="s1"),
    "grouped-linearsvc": lambda: GroupedArgmaxClassifier(LinearSVC(random_state=0), site="s1"),
    "site-selector": lambda: SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)),
    "selector-kfold-top3": lambda: SiteSelector(GroupedArgmaxClassifier(LinearSVC()),
                                                cv=KFold(3, shuffle=True, random_state=1),
                                                scoring="top3", sites=["s0", "s1"]),
    "selector-param-grid-top2": lambda: SiteSelector(
        GroupedArgmaxLogisticClassifier(random_state=0), cv=GroupKFold(3), n_sites=2,
        param_grid={"C": [0.01, 1.0]}),
    "perturn-pipeline": lambda: Pipeline([
        ("scale", PerTurn(StandardScaler())),
        ("pca", PerTurn(PCA(n_components=3, random_state=0))),
        ("probe", SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3))),
    ]),
    "concat-pipeline": lambda: Pipeline([
        ("concat", SiteConcatenator(["s0", "s1"])),
        ("probe", GroupedArgmaxLogisticClassifier()),
    ]),
    "dummy-constant": lambda: DummyStepClassifier(strategy="constant", constant=1),
    "dummy-relative": lambda: DummyStepClassifier(strategy="most_frequent_relative"),
    "dummy-uniform": lambda: DummyStepClassifier(strategy="uniform", random_state=3),
    # scikit-learn classes the project's own tests combine with skafa's
    "perturn-svd-pipeline": lambda: Pipeline([
        ("svd", PerTurn(TruncatedSVD(n_components=3, random_state=0))),
        ("probe", GroupedArgmaxLogisticClassifier(site="s1", random_state=0)),
    ]),
    "grouped-gaussiannb": lambda: GroupedArgmaxClassifier(GaussianNB(), site="s1"),
}


@pytest.fixture(scope="module")
def features():
    X, y = make_features(60)
    return X[:40], y[:40], X[40:], y[40:]


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_roundtrip_bitwise(name, features, tmp_path):
    X_tr, y_tr, X_te, y_te = features
    est = PROBES[name]().fit(X_tr, y_tr)
    loaded = roundtrip(est, tmp_path)
    assert type(loaded) is type(est)
    assert repr(loaded) == repr(est)
    assert_bitwise(loaded.predict(X_te), est.predict(X_te))
    for method in ("turn_decision_function", "turn_predict_proba", "predict_agent"):
        final, Xt = (est, X_te)
        if isinstance(est, Pipeline):
            final, Xt = est[-1], est[:-1].transform(X_te)
            lfinal, lXt = loaded[-1], loaded[:-1].transform(X_te)
        else:
            lfinal, lXt = loaded, X_te
        assert_bitwise(getattr(lfinal, method)(lXt), getattr(final, method)(Xt))
    assert loaded.score(X_te, y_te) == est.score(X_te, y_te)


def test_shared_objects_and_special_values_survive(features, tmp_path):
    X_tr, y_tr, _, _ = features
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(X_tr, y_tr)
    loaded = roundtrip(sel, tmp_path)
    best = loaded.best_estimator_
    assert best.scaler_ is best.estimator_.named_steps["scaler"]
    assert best.n_iter_ is best.estimator_.named_steps["logistic"].n_iter_
    assert math.isnan(loaded.error_score)
    assert loaded.sites_ == sel.sites_ and isinstance(loaded.sites_, tuple)
    assert isinstance(loaded.cv, GroupKFold) and loaded.cv.n_splits == 3
    for key, value in sel.cv_results_.items():
        if isinstance(value, np.ndarray):
            assert_bitwise(loaded.cv_results_[key], value)
        else:
            assert loaded.cv_results_[key] == value
    assert loaded.scorer_(loaded.best_estimator_, X_tr.select_sites(loaded.best_site_),
                          y_tr) == sel.score(X_tr, y_tr)


def test_reference_cycles_are_refused_on_save_and_load(tmp_path):
    """A parameter value that contains itself: save refuses it, and a (re-signed) file
    holding one is refused at load, naming both places: a loaded estimator would
    otherwise end clone() in a RecursionError (issue 33). Shared values load as before."""
    weights = {0: 1.0}
    weights["again"] = weights
    with pytest.raises(ValueError, match=r"'class_weight\.[^']+' is the object at "
                                         r"'class_weight'.*reference cycle"):
        save(GroupedArgmaxLogisticClassifier(class_weight=weights), tmp_path / "a")
    loop = GroupedArgmaxClassifier()
    loop.estimator = loop
    with pytest.raises(ValueError, match="object at the root.*reference cycle"):
        save(loop, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # a stranger's file: the cycle written by hand, the tree re-signed
    shared = {0: 1.0, 1: 3.0}
    save(GroupedArgmaxClassifier(GroupedArgmaxLogisticClassifier(class_weight=shared),
                                 site=[shared]), tmp_path / "c")
    assert "__ref__" in (tmp_path / "c" / JSON_NAME).read_text()   # the shared value
    loaded = load(tmp_path / "c")
    assert loaded.site[0] is loaded.estimator.class_weight == shared

    def cycle(doc):
        doc["tree"]["params"]["site"] = [{"__ref__": "site"}]
    rewrite(tmp_path / "c", cycle)
    with pytest.raises(ValueError, match=r"reference to 'site', which contains it: a "
                                         r"reference cycle.*at 'site.0'"):
        load(tmp_path / "c")


def test_unfitted_estimator_roundtrip(tmp_path):
    est = SiteSelector(GroupedArgmaxLogisticClassifier(C=0.3), sites=["a", "b"])
    loaded = roundtrip(est, tmp_path)
    assert repr(loaded) == repr(est)
    assert not hasattr(loaded, "best_site_")


# ------------------------------------------------------------- conversation inputs
@pytest.fixture(scope="module")
def conversations():
    return make_conversations(24, seed=3)


@pytest.mark.parametrize("make", [
    lambda: TurnPositionTransformer(),
    lambda: TurnPositionTransformer(include=("relative", "speaker"), min_speaker_frequency=3),
    lambda: TurnTextTransformer(),
    lambda: TurnTextTransformer(TfidfVectorizer(ngram_range=(1, 2), dtype=np.float32),
                                include_speaker=True),
    lambda: TurnTextTransformer(CountVectorizer(binary=True)),
    lambda: TurnFeatureUnion([("pos", TurnPositionTransformer()),
                              ("text", TurnTextTransformer()),
                              ("off", "drop")]),
], ids=["position", "position-subset", "tfidf-default", "tfidf-bigrams", "count", "union"])
def test_conversation_transformer_roundtrip(make, conversations, tmp_path):
    est = make().fit(conversations[:16])
    loaded = roundtrip(est, tmp_path)
    a, b = est.transform(conversations[16:]), loaded.transform(conversations[16:])
    assert b.equals(a)
    assert_bitwise(b.values, a.values)
    assert list(loaded.get_feature_names_out()) == list(est.get_feature_names_out())


def test_tfidf_vocabulary_and_idf_restored(conversations, tmp_path):
    text = TurnTextTransformer(TfidfVectorizer(min_df=2, max_features=30)).fit(conversations)
    loaded = roundtrip(text, tmp_path)
    v, lv = text.vectorizer_, loaded.vectorizer_
    assert lv.vocabulary_ == v.vocabulary_
    assert [type(x) for x in lv.vocabulary_.values()] == [type(x) for x in v.vocabulary_.values()]
    assert_bitwise(lv.idf_, v.idf_)
    assert lv.dtype is np.float64


def test_union_pipeline_on_conversations_bitwise(conversations, tmp_path):
    pipe = Pipeline([
        ("feats", TurnFeatureUnion([("pos", TurnPositionTransformer()),
                                    ("text", TurnTextTransformer())])),
        ("probe", GroupedArgmaxLogisticClassifier(random_state=0)),
    ])
    y = np.array([c.mistake_step for c in conversations])
    pipe.fit(conversations[:16], y[:16])
    loaded = roundtrip(pipe, tmp_path)
    assert_bitwise(loaded.predict(conversations[16:]), pipe.predict(conversations[16:]))
    union = loaded.named_steps["feats"]
    assert union.named_transformers_["pos"] is union.transformer_list_[0][1]
    assert isinstance(union.named_transformers_, Bunch)


# -------------------------------------------------------------- with a language model
@pytest.fixture(scope="module")
def tiny_models():
    tok = make_tiny_tokenizer()
    llama = make_tiny_llama(seed=0)
    names = {
        "main": "persist-tiny",
        "alias": "persist-tiny-alias",
        "other-weights": "persist-tiny-seed1",
        "deeper": "persist-tiny-3layers",
        "qwen": "persist-tiny-qwen",
    }
    register_model(names["main"], llama, tok, overwrite=True)
    register_model(names["alias"], llama, tok, overwrite=True)
    register_model(names["other-weights"], make_tiny_llama(seed=1), tok, overwrite=True)
    register_model(names["deeper"], make_tiny_llama(n_layers=3), tok, overwrite=True)
    register_model(names["qwen"], make_tiny_qwen2(), tok, overwrite=True)
    yield names
    for name in names.values():
        unregister_model(name)


@pytest.fixture(scope="module")
def fitted_lm_pipeline(tiny_models, conversations):
    y = np.array([c.mistake_step for c in conversations])
    prompt = PromptTemplate(shorten="head_tail", max_turn_chars=200)
    pipe = Pipeline([
        ("acts", TurnActivationTransformer(tiny_models["main"], prompt=prompt,
                                           chat_template_kwargs={"date_string": "1 Jan 2025"},
                                           memory_cache=False)),
        ("select", SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0),
                                cv=GroupKFold(3))),
    ])
    return pipe.fit(conversations[:16], y[:16])


def test_pipeline_with_activation_transformer_bitwise(fitted_lm_pipeline, conversations,
                                                      tmp_path):
    pipe = fitted_lm_pipeline
    path = save(pipe, tmp_path / "pipe")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        loaded = load(path)
    test = conversations[16:]
    assert_bitwise(loaded.predict(test), pipe.predict(test))
    acts, lacts = pipe[0], loaded[0]
    assert lacts.prompt_ == acts.prompt_ and lacts.prompt == acts.prompt
    assert lacts.chat_template_kwargs == {"date_string": "1 Jan 2025"}
    assert_bitwise(lacts.transform(test).values, acts.transform(test).values)
    assert_bitwise(loaded[-1].turn_decision_function(lacts.transform(test)),
                   pipe[-1].turn_decision_function(acts.transform(test)))
    # The document names the model, its identity, fingerprint and prompt settings.
    doc = json.loads((path / JSON_NAME).read_text())
    (summary,) = doc["models"]
    assert summary["model"] == "persist-tiny"
    assert summary["model_fingerprint"] == acts.model_fingerprint_
    assert summary["model_identity"]["weights_sha256"] == acts.model_identity_["weights_sha256"]
    assert summary["prompt"]["max_turn_chars"] == 200
    assert summary["chat_template_kwargs"] == {"date_string": "1 Jan 2025"}
    assert doc["tree"]["__estimator__"] == "sklearn.pipeline.Pipeline"
    # No runtime objects (model, tokenizer, cache) were written.
    state = doc["tree"]["params"]["steps"][0]["__tuple__"][1]["state"]
    assert not {"_model", "_tokenizer", "_layout", "_cache"} & set(state)


@pytest.mark.parametrize("other", ["deeper", "qwen"])
def test_different_architecture_raises(fitted_lm_pipeline, tiny_models, other, tmp_path):
    path = save(fitted_lm_pipeline, tmp_path / "pipe")
    with pytest.raises(ValueError, match="different model architecture") as info:
        load(path, model=tiny_models[other])
    assert "TurnActivationTransformer" in str(info.value)
    assert str(path / JSON_NAME) in str(info.value)


@pytest.mark.parametrize("other", ["alias", "other-weights"])
def test_same_architecture_other_name_warns(fitted_lm_pipeline, tiny_models, conversations,
                                            other, tmp_path):
    path = save(fitted_lm_pipeline, tmp_path / "pipe")
    allow = {}
    if other == "other-weights":  # other weights: refused unless named and allowed
        with pytest.raises(ValueError, match="weights differ") as info:
            load(path, model=tiny_models[other])
        assert str(path / JSON_NAME) in str(info.value)
        assert fitted_lm_pipeline[0].model_identity_["weights_sha256"] in str(info.value)
        allow = {"allow_model_mismatch": True}
    with pytest.warns(ModelMismatchWarning, match=tiny_models[other]):
        loaded = load(path, model=tiny_models[other], **allow)
    assert loaded[0].model == tiny_models[other]
    # the cache key follows the model actually used
    assert loaded[0].model_identity_["name"] == tiny_models[other]
    steps = loaded.predict(conversations[16:])
    if other == "alias":  # same weights under another name: same predictions
        assert_bitwise(steps, fitted_lm_pipeline.predict(conversations[16:]))


def test_verify_model_false_defers_the_check(fitted_lm_pipeline, tiny_models, conversations,
                                             tmp_path):
    path = save(fitted_lm_pipeline, tmp_path / "pipe")
    loaded = load(path, model=tiny_models["deeper"], verify_model=False)
    with pytest.raises(RuntimeError, match="fingerprint"):
        loaded.predict(conversations[16:])


def test_verify_model_false_refuses_other_weights_at_the_first_transform(
        fitted_lm_pipeline, tiny_models, conversations, tmp_path):
    """Deferred (verify_model=False), the first transform checks the weights too, not
    only the architecture: other weights are refused as at load, naming both digests,
    unless the load named the model and allowed the mismatch (then it warns, and the
    activation cache is keyed by the model used)."""
    path = save(fitted_lm_pipeline, tmp_path / "pipe")
    saved = fitted_lm_pipeline[0].model_identity_["weights_sha256"]
    loaded = load(path, model=tiny_models["other-weights"], verify_model=False)
    with pytest.raises(ValueError, match="weights differ") as info:
        loaded.predict(conversations[16:])
    now = loaded[0].model_identity_
    assert now["weights_sha256"] == saved  # unchanged: nothing was read
    message = str(info.value)
    assert saved in message and "TurnActivationTransformer" in message
    with pytest.warns(ModelMismatchWarning):  # checked at load, as usual
        other = load(path, model=tiny_models["other-weights"], allow_model_mismatch=True)
    assert other[0].model_identity_["weights_sha256"] in message  # both digests named
    assert "allow_model_mismatch=True" in message
    with pytest.raises(ValueError, match="weights differ"):  # refused again: still unread
        loaded.predict(conversations[16:])

    allowed = load(path, model=tiny_models["other-weights"], verify_model=False,
                   allow_model_mismatch=True)
    with pytest.warns(ModelMismatchWarning, match="weights differ"):
        steps = allowed.predict(conversations[16:])
    assert allowed[0].model_identity_ == other[0].model_identity_
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        np.testing.assert_array_equal(allowed.predict(conversations[16:]), steps)
        np.testing.assert_array_equal(other.predict(conversations[16:]), steps)

    alias = load(path, model=tiny_models["alias"], verify_model=False)
    with pytest.warns(ModelMismatchWarning, match="same"):  # same weights: a warning only
        assert_bitwise(alias.predict(conversations[16:]),
                       fitted_lm_pipeline.predict(conversations[16:]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        load(path, verify_model=False).predict(conversations[16:])  # the saved model


def test_unavailable_model_is_a_clear_error(fitted_lm_pipeline, tmp_path):
    path = save(fitted_lm_pipeline, tmp_path / "pipe")
    with pytest.raises(ValueError, match="could not be loaded.*verify_model=False"):
        load(path, model=str(tmp_path / "missing.gguf"))


# ------------------------------------------------------------------ integrity checks
@pytest.fixture()
def saved_probe(features, tmp_path):
    X_tr, y_tr, X_te, _ = features
    est = GroupedArgmaxLogisticClassifier(site="s1").fit(X_tr, y_tr)
    return save(est, tmp_path / "probe"), est, X_te


def test_truncated_arrays_file(saved_probe):
    path, _, _ = saved_probe
    data = (path / ARRAYS_NAME).read_bytes()
    (path / ARRAYS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="sha256 check failed") as info:
        load(path)
    assert ARRAYS_NAME in str(info.value) and "truncated" in str(info.value)


def test_edited_arrays_file(saved_probe):
    path, _, _ = saved_probe
    data = bytearray((path / ARRAYS_NAME).read_bytes())
    data[-3] ^= 0xFF  # flip bits of the last coefficient
    (path / ARRAYS_NAME).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"arrays\.safetensors: sha256 check failed"):
        load(path)


def test_missing_arrays_file(saved_probe):
    path, _, _ = saved_probe
    (path / ARRAYS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=ARRAYS_NAME):
        load(path)


def test_truncated_json(saved_probe):
    path, _, _ = saved_probe
    text = (path / JSON_NAME).read_text()
    (path / JSON_NAME).write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"skafa\.json: not valid JSON .*truncated"):
        load(path)


def test_edited_json_tree(saved_probe):
    path, _, _ = saved_probe
    doc = json.loads((path / JSON_NAME).read_text())
    doc["tree"]["params"]["C"] = 123.0
    (path / JSON_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="does not match the sha256"):
        load(path)


def test_not_a_save(tmp_path):
    with pytest.raises(FileNotFoundError, match="skafa.json"):
        load(tmp_path)
    (tmp_path / JSON_NAME).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a skafa estimator file"):
        load(tmp_path)


def test_newer_format_refused(saved_probe):
    path, _, _ = saved_probe
    rewrite(path, lambda doc: doc.update(format_version=99))
    with pytest.raises(ValueError, match="format version 99"):
        load(path)


def test_version_mismatch_warns(saved_probe):
    path, est, X_te = saved_probe
    rewrite(path, lambda doc: doc.update(sklearn_version="0.0.1"))
    with pytest.warns(PersistenceVersionWarning, match="scikit-learn 0.0.1"):
        loaded = load(path)
    assert_bitwise(loaded.predict(X_te), est.predict(X_te))


def test_array_shape_mismatch_in_json(saved_probe):
    path, _, _ = saved_probe

    def edit(doc):
        doc["tree"]["state"]["coef_"]["shape"] = [2, 2]

    rewrite(path, edit)
    with pytest.raises(ValueError, match="coef_"):
        load(path)


# ----------------------------------------------------------------------- allowlist
@pytest.fixture()
def trap_module(tmp_path, monkeypatch):
    """A module that records being imported (it must never be)."""
    name = "skafa_persistence_trap_mod"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import builtins
        builtins.SKAFA_TRAP_IMPORTED = True
        from sklearn.base import BaseEstimator
        class Evil(BaseEstimator):
            def __init__(self, C=1.0):
                self.C = C
            def fit(self, X, y=None):
                return self
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    import builtins

    if hasattr(builtins, "SKAFA_TRAP_IMPORTED"):
        del builtins.SKAFA_TRAP_IMPORTED


def test_non_allowlisted_class_refused_without_import(saved_probe, trap_module):
    path, _, _ = saved_probe
    rewrite(path, lambda doc: doc["tree"].update({"__estimator__": f"{trap_module}.Evil"}))
    with pytest.raises(ValueError, match="refusing to load class") as info:
        load(path)
    assert f"{trap_module}.Evil" in str(info.value) and "trust=" in str(info.value)
    assert trap_module not in sys.modules
    import builtins

    assert not hasattr(builtins, "SKAFA_TRAP_IMPORTED")
    # importable builtins are refused the same way
    rewrite(path, lambda doc: doc["tree"].update({"__estimator__": "os.system"}))
    with pytest.raises(ValueError, match="refusing to load class 'os.system'"):
        load(path)


def test_nested_non_allowlisted_class_refused(features, tmp_path, trap_module):
    X_tr, y_tr, _, _ = features
    est = GroupedArgmaxClassifier(LogisticRegression(), site="s1").fit(X_tr, y_tr)
    path = save(est, tmp_path / "g")
    rewrite(path, lambda doc: doc["tree"]["state"]["estimator_"].update(
        {"__estimator__": f"{trap_module}.Evil"}))
    with pytest.raises(ValueError, match="refusing to load class .* at 'estimator_'"):
        load(path)
    assert trap_module not in sys.modules


def test_trust_imports_only_the_named_class(saved_probe, trap_module):
    path, _, _ = saved_probe

    def edit(doc):
        doc["tree"] = {"__estimator__": f"{trap_module}.Evil", "params": {"C": 2.0},
                       "state": {}}

    rewrite(path, edit)
    loaded = load(path, trust=[f"{trap_module}.Evil"])
    assert type(loaded).__name__ == "Evil" and loaded.C == 2.0


def test_state_cannot_shadow_methods(saved_probe):
    path, _, _ = saved_probe
    rewrite(path, lambda doc: doc["tree"]["state"].update({"predict": "boom"}))
    with pytest.raises(ValueError, match="refusing to set attribute 'predict'"):
        load(path)
    rewrite(path, lambda doc: doc["tree"]["state"].pop("predict") and None
            or doc["tree"]["state"].update({"__class__": "x"}))
    with pytest.raises(ValueError, match="refusing to set attribute '__class__'"):
        load(path)


def test_unknown_entry_type_refused(saved_probe):
    path, _, _ = saved_probe
    rewrite(path, lambda doc: doc["tree"]["params"].update({"C": {"__pickle__": "gASV"}}))
    with pytest.raises(ValueError, match="unknown entry type '__pickle__'"):
        load(path)


class _Custom(BaseEstimator):
    """A custom estimator holding every kind of value the format supports."""

    def __init__(self, alpha=1.0, options=None):
        self.alpha = alpha
        self.options = options

    def fit(self, X=None, y=None):
        rng = np.random.default_rng(0)
        self.f16_ = rng.normal(size=5).astype(np.float16)
        self.i8_ = np.arange(-3, 3, dtype=np.int8)
        self.u32_ = np.arange(4, dtype=np.uint32)
        self.bool_ = np.array([True, False])
        self.fortran_ = np.asfortranarray(rng.normal(size=(3, 4)))
        self.scalar0d_ = np.array(2.5)
        self.empty_ = np.zeros((0, 3))
        self.nonfinite_ = np.array([np.nan, np.inf, -np.inf, -0.0])
        self.strings_ = np.array(["a", "bb", "ccc"])
        self.objects_ = np.array(["x", None, 3], dtype=object)
        self.np_scalars_ = (np.float32(1.5), np.int64(7), np.bool_(True), np.float64("nan"),
                            np.str_("abc"), np.uint8(255))
        self.int_keys_ = {0: 1.0, 1: 2.5}
        self.nested_ = {"a.b": [1, (2, 3)], "c~d": {"e": None}}
        self.big_vocab_ = {f"w{i}": np.int64(i) for i in range(40)}
        self.csc_ = sp.random(6, 5, density=0.3, format="csc", random_state=0)
        self.coo_ = sp.random(4, 4, density=0.5, format="coo", random_state=1)
        self.csr_array_ = sp.csr_array(np.eye(3))
        self.bunch_ = Bunch(x=self.i8_, y="why")
        self.shared_ = self.fortran_
        self.nan_float_ = float("nan")
        self.dtype_ = np.dtype("float32")
        self.type_ = np.int32
        self._private = "kept"
        return self


def test_generic_encoder_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setitem(persistence._REGISTERED, "tests.Custom", _Custom)
    est = _Custom(alpha=0.5, options={"k": [1, 2]}).fit()
    loaded = roundtrip(est, tmp_path)
    assert type(loaded) is _Custom and loaded.options == {"k": [1, 2]}
    for key, value in vars(est).items():
        got = getattr(loaded, key)
        if isinstance(value, np.ndarray) or sp.issparse(value):
            assert_bitwise(got, value)
            assert type(got) is type(value), key
        elif key == "np_scalars_":
            assert [type(v) for v in got] == [type(v) for v in value]
            assert [np.asarray(v).tobytes() for v in got] == [np.asarray(v).tobytes()
                                                             for v in value]
        elif key == "nan_float_":
            assert math.isnan(got)
        elif key in ("bunch_",):
            assert isinstance(got, Bunch) and got.y == "why"
            assert got.x is loaded.i8_
        elif key == "big_vocab_":
            assert got == value and all(type(v) is np.int64 for v in got.values())
        else:
            assert got == value, key
    assert loaded.fortran_.flags.f_contiguous
    assert loaded.shared_ is loaded.fortran_
    assert loaded.coo_.format == "coo"


def test_unsupported_class_at_save_explains(tmp_path):
    est = _Custom().fit()
    with pytest.raises(TypeError, match=r"cannot save .*_Custom at the root.*register_class"):
        save(est, tmp_path / "x")
    pipe = Pipeline([("custom", _Custom())])
    with pytest.raises(TypeError, match=r"at 'steps\.0\.1'"):
        save(pipe, tmp_path / "y")


def test_register_class_then_trust_on_load(tmp_path, monkeypatch):
    name = f"{_Custom.__module__}.{_Custom.__qualname__}"
    monkeypatch.setitem(persistence._REGISTERED, name, _Custom)
    path = save(_Custom(alpha=3.0), tmp_path / "c")
    monkeypatch.delitem(persistence._REGISTERED, name)
    with pytest.raises(ValueError, match="refusing to load class"):
        load(path)
    assert load(path, trust=[name]).alpha == 3.0
    assert name not in persistence.allowed_classes()


def test_non_data_values_refused(tmp_path, conversations):
    text = TurnTextTransformer(CountVectorizer(tokenizer=str.split, token_pattern=None))
    text.fit(conversations)
    with pytest.raises(TypeError, match=r"'vectorizer~?.*tokenizer'|vectorizer\.tokenizer"):
        save(text, tmp_path / "t")
    probe = GroupedArgmaxLogisticClassifier(random_state=np.random.RandomState(0))
    with pytest.raises(TypeError, match="RandomState"):
        save(probe, tmp_path / "p")


def test_overwrite(saved_probe, features):
    path, est, _ = saved_probe
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save(est, path)
    other = GroupedArgmaxLogisticClassifier(site="s0", C=0.1).fit(*features[:2])
    save(other, path, overwrite=True)
    assert load(path).C == 0.1


def test_allowlist_contents():
    names = persistence.allowed_classes()
    for required in ("skafa.llm.TurnActivationTransformer",
                     "skafa.attributor.FailureAttributor", "sklearn.pipeline.Pipeline",
                     "sklearn.feature_extraction.text.TfidfVectorizer"):
        assert required in names
    assert not any("pickle" in n or n.startswith(("os.", "builtins.")) for n in names)


def test_pipeline_memory_not_restored(features, tmp_path):
    X_tr, y_tr, X_te, _ = features
    pipe = Pipeline([("scale", PerTurn(StandardScaler())),
                     ("probe", GroupedArgmaxLogisticClassifier(site="s1"))],
                    memory=str(tmp_path / "joblib-cache")).fit(X_tr, y_tr)
    path = save(pipe, tmp_path / "pipe")
    with pytest.warns(UserWarning, match="memory=.*not restored"):
        loaded = load(path)
    assert loaded.memory is None
    assert_bitwise(loaded.predict(X_te), pipe.predict(X_te))


def test_device_override(fitted_lm_pipeline, tmp_path):
    path = save(fitted_lm_pipeline, tmp_path / "pipe")

    def edit(doc):
        doc["tree"]["params"]["steps"][0]["__tuple__"][1]["params"]["device"] = "cuda:7"

    rewrite(path, edit)
    assert load(path, device="cpu", verify_model=False)[0].device == "cpu"
    # the device is a runtime setting: the caller's, else the default, never the file's
    assert load(path, verify_model=False)[0].device == "cpu"
    assert load(path, device="cuda:3", verify_model=False)[0].device == "cuda:3"


def test_prompted_judge_roundtrip(tiny_models, conversations, tmp_path):
    from skafa.baselines import PromptedJudge

    judge = PromptedJudge(tiny_models["main"], prompt=PromptTemplate(history_header=None),
                          chat_template_kwargs={"date_string": "2 Feb 2025"}).fit(
        conversations[:4])
    path = save(judge, tmp_path / "judge")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        loaded = load(path)
    assert repr(loaded) == repr(judge)
    assert loaded.prompt_ == judge.prompt_ and loaded.model_fingerprint_ == judge.model_fingerprint_
    assert_bitwise(loaded.predict(conversations[:3]), judge.predict(conversations[:3]))
    doc = json.loads((path / JSON_NAME).read_text())
    assert doc["models"][0]["class"] == "skafa.baselines.PromptedJudge"
    with pytest.raises(ValueError, match="different model architecture"):
        load(path, model=tiny_models["qwen"])


# ------------------------------------------------------------------- hostile files
# A stranger's file is self-consistent: the digests in skafa.json cover accidents, not
# an attacker, who re-signs what they edit (as `rewrite` and `rewrite_arrays` do).
def rewrite_arrays(path, edit, edit_doc=None):
    """Edit arrays.safetensors (a dict of numpy arrays), then re-sign both files.

    The dtype and shape recorded for every array in skafa.json follow the edit, as an
    attacker would make them; ``edit_doc`` may then change the document further.
    """
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    arrays = dict(st_load((path / ARRAYS_NAME).read_bytes()))
    edit(arrays)
    blob = st_save(arrays, metadata={"format": "skafa.estimator/1"})
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
        if edit_doc is not None:
            edit_doc(doc)

    rewrite(path, edit_all)


def file_size(path):
    return sum(p.stat().st_size for p in path.iterdir())


@pytest.fixture()
def peak_memory():
    """Peak of traced (Python and numpy) allocations inside the `with` block."""
    import contextlib
    import tracemalloc

    @contextlib.contextmanager
    def measure():
        box = {}
        tracemalloc.start()
        try:
            yield box
        finally:
            box["peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()

    return measure


def test_wide_string_array_refused_without_allocating(saved_probe, peak_memory):
    # The 80-byte edit of issue 9: one string, declared 200,000,000 characters wide.
    path, _, _ = saved_probe
    rewrite(path, lambda doc: doc["tree"]["state"].update(
        {"x_": {"__strarray__": ["a"], "dtype": "U200000000", "shape": [1]}}))
    with peak_memory() as mem:
        with pytest.raises(ValueError, match=r"U200000000 would allocate 800000000 bytes.*at 'x_'"):
            load(path)
    assert mem["peak"] < 50 * file_size(path) + 2**20


def test_string_array_shape_must_match_its_entries(saved_probe):
    path, _, _ = saved_probe
    rewrite(path, lambda doc: doc["tree"]["state"].update(
        {"x_": {"__strarray__": ["a", "b"], "dtype": "U1", "shape": [10**9]}}))
    with pytest.raises(ValueError, match=r"x_"):
        load(path)


def test_array_used_twice_refused(saved_probe):
    # Each reference would copy the array: N references, N times the file's arrays.
    path, _, _ = saved_probe

    def edit(doc):
        node = doc["tree"]["state"]["coef_"]
        doc["tree"]["state"].update({f"copy{i}_": dict(node) for i in range(3)})

    rewrite(path, edit)
    with pytest.raises(ValueError, match=r"used more than once.*at 'copy0_'"):
        load(path)


def test_deep_nesting_refused_with_a_clear_error(saved_probe):
    path, _, _ = saved_probe
    depth = 100_000
    doc = json.loads((path / JSON_NAME).read_text())
    doc["tree"]["state"]["x_"] = "@@DEEP@@"
    deep = "[" * depth + "]" * depth
    canonical = persistence._canonical(doc["tree"]).decode().replace('"@@DEEP@@"', deep)
    doc["tree_sha256"] = persistence._sha256(canonical.encode())
    (path / JSON_NAME).write_text(json.dumps(doc).replace('"@@DEEP@@"', deep))
    with pytest.raises(ValueError, match=r"skafa\.json.*nest") as info:
        load(path)
    assert str(persistence.MAX_JSON_DEPTH) in str(info.value)


def _sparse_probe_file(tmp_path, monkeypatch, matrix):
    monkeypatch.setitem(persistence._REGISTERED, "tests.SparseHolder", _SparseHolder)
    return save(_SparseHolder(matrix).fit(), tmp_path / "sparse")


class _SparseHolder(BaseEstimator):
    def __init__(self, matrix=None):
        self.matrix = matrix

    def fit(self, X=None, y=None):
        self.m_ = self.matrix.copy()
        return self


SPARSE_EDITS = {
    "index-out-of-range": lambda a: a["m_.indices"].__setitem__(-1, 1000),
    "negative-index": lambda a: a["m_.indices"].__setitem__(0, -1),
    "indptr-decreasing": lambda a: a["m_.indptr"].__setitem__(slice(1, 3),
                                                              a["m_.indptr"][2:0:-1].copy()),
    "indptr-not-from-zero": lambda a: a["m_.indptr"].__setitem__(0, 1),
    "indptr-too-short": lambda a: a.update({"m_.indptr": a["m_.indptr"][:-1]}),
    "float-indices": lambda a: a.update({"m_.indices": a["m_.indices"] + 0.5}),
    "float-indptr": lambda a: a.update({"m_.indptr": a["m_.indptr"].astype(np.float64)}),
    "bool-indices": lambda a: a.update({"m_.indices": a["m_.indices"] > 0}),
    "2d-indices": lambda a: a.update({"m_.indices": a["m_.indices"][:, None]}),
    "data-too-short": lambda a: a.update({"m_.data": a["m_.data"][:-1]}),
}


@pytest.mark.parametrize("case", sorted(SPARSE_EDITS) + ["shape-negative", "shape-3d",
                                                         "shape-strings"])
def test_tampered_sparse_parts_refused(tmp_path, monkeypatch, case):
    m = sp.random(5, 4, density=0.5, format="csr", random_state=0)
    path = _sparse_probe_file(tmp_path, monkeypatch, m)
    shapes = {"shape-negative": [-5, 4], "shape-3d": [5, 4, 1], "shape-strings": ["5", "4"]}

    def edit_doc(doc):
        if case in shapes:
            doc["tree"]["state"]["m_"]["shape"] = shapes[case]

    rewrite_arrays(path, SPARSE_EDITS.get(case, lambda a: None), edit_doc)
    with pytest.raises(ValueError, match=r"at 'm_'"):
        load(path)


@pytest.mark.parametrize("fmt", ["dia", "lil"])
def test_sparse_format_conversion_is_bounded(tmp_path, monkeypatch, fmt, peak_memory):
    # Three non-zeros on three diagonals of a 3 x 2e6 matrix: 48 MB as dia.
    # As lil, a csc part with 2e6 rows builds 4e6 Python lists (the row count is free).
    m = sp.csr_matrix((np.ones(3), np.array([0, 1, 2]), np.array([0, 1, 2, 3])), shape=(3, 3))
    path = _sparse_probe_file(tmp_path, monkeypatch, m)
    big = 2 * 10**6

    def edit_arrays(arrays):
        if fmt == "dia":
            arrays["m_.indices"] = np.array([0, big // 2, big - 1], dtype=np.int32)

    def edit(doc):
        node = doc["tree"]["state"]["m_"]
        node["original_format"] = fmt
        if fmt == "dia":
            node["shape"] = [3, big]
        else:  # csc: indptr has columns + 1 entries; the row count is free
            node["__sparse__"] = "csc"
            node["shape"] = [big, 3]

    rewrite_arrays(path, edit_arrays, edit)
    with peak_memory() as mem:
        with pytest.raises(ValueError, match=r"format would allocate .* bytes.*at 'm_'"):
            load(path)
    assert mem["peak"] < 50 * file_size(path) + 2**20


# ------------------------------------------------- classes allowed by where they live
def test_old_import_paths_still_load(conversations, tmp_path):
    y = np.array([c.mistake_step for c in conversations])
    pipe = AttributionPipeline([("pos", TurnPositionTransformer()),
                                ("probe", GroupedArgmaxLogisticClassifier())])
    pipe.fit(conversations[:16], y[:16])
    path = save(pipe, tmp_path / "old")

    def edit(doc):  # the names a file written before the module split holds
        doc["tree"]["__estimator__"] = "skafa.compose.AttributionPipeline"
        steps = doc["tree"]["params"]["steps"]
        steps[0]["__tuple__"][1]["__estimator__"] = "skafa.featurizers.TurnPositionTransformer"
        steps[1]["__tuple__"][1]["__estimator__"] = \
            "skafa.probes.GroupedArgmaxLogisticClassifier"

    rewrite(path, edit)
    loaded = load(path)
    assert type(loaded) is AttributionPipeline
    assert_bitwise(loaded.predict(conversations[16:]), pipe.predict(conversations[16:]))
    # and a new save writes each class's home module
    doc = json.loads((save(loaded, tmp_path / "new") / JSON_NAME).read_text())
    assert doc["tree"]["__estimator__"] == "skafa.compose.AttributionPipeline"


@pytest.mark.parametrize("name", [
    "skafa.probes._logistic.LogisticRegression",  # imported into a skafa module, defined in sklearn
    "skafa.compose._composition.Pipeline",        # same: scikit-learn's class, not skafa's
    "skafa.persistence._persistence.np",              # a module, not a class
    "skafa.features.TurnFeatures",       # a skafa class, but not an estimator
    "skafa.no_such_module.Estimator",
    "skafa_evil.Estimator",
    "skafa..probes.X",
])
def test_names_outside_skafa_estimators_refused(saved_probe, name):
    path, _, _ = saved_probe
    rewrite(path, lambda doc: doc["tree"].update({"__estimator__": name}))
    with pytest.raises(ValueError, match="refusing to load class"):
        load(path)


def test_runtime_attributes_refused_on_load(features, tmp_path):
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(*features[:2])
    path = save(sel, tmp_path / "sel")
    doc = json.loads((path / JSON_NAME).read_text())
    assert "scorer_" not in doc["tree"]["state"]  # declared runtime-only: never written
    rewrite(path, lambda doc: doc["tree"]["state"].update({"scorer_": "accuracy"}))
    with pytest.raises(ValueError, match="refusing to set attribute 'scorer_'"):
        load(path)


NEW_ESTIMATOR_MODULE = '''
import numpy as np
from sklearn.base import BaseEstimator
from skafa.persistence import PersistenceMixin


class MeanShiftProbe(PersistenceMixin, BaseEstimator):
    """A new skafa estimator: nothing outside this module knows about it."""

    _runtime_attributes = frozenset({"_lookup"})

    def _restore_after_load(self, context):
        self._lookup = {"restored at": context.path}

    def __init__(self, shift=0.0):
        self.shift = shift

    def fit(self, X, y=None):
        self.mean_ = np.asarray(X, dtype=float).mean(axis=0) + self.shift
        self._lookup = {"fitted": True}
        return self

    def predict(self, X):
        return np.asarray(X, dtype=float) @ self.mean_
'''


def test_new_skafa_estimator_needs_no_registration(tmp_path, monkeypatch, request):
    import types

    import skafa.probes
    from skafa.utils import discovery

    # a new estimator in a private module of a subpackage, exported by the subpackage
    name = "skafa.probes._persistence_demo"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(NEW_ESTIMATOR_MODULE, f"<{name}>", "exec"), module.__dict__)
    monkeypatch.setattr(skafa.probes, "MeanShiftProbe", module.MeanShiftProbe, raising=False)
    monkeypatch.setattr(skafa.probes, "__all__", [*skafa.probes.__all__, "MeanShiftProbe"])
    discovery._homes.cache_clear()
    request.addfinalizer(discovery._homes.cache_clear)  # runs after monkeypatch's undo
    X = np.arange(12.0).reshape(4, 3)
    est = module.MeanShiftProbe(shift=0.5).fit(X)
    pipe = Pipeline([("scale", StandardScaler()), ("probe", module.MeanShiftProbe())]).fit(X)
    path = save(pipe, tmp_path / "new")
    doc = json.loads((path / JSON_NAME).read_text())
    step = doc["tree"]["params"]["steps"][1]["__tuple__"][1]
    assert step["__estimator__"] == "skafa.probes.MeanShiftProbe"
    assert "_lookup" not in step["state"]
    loaded = load(path)
    assert_bitwise(loaded.predict(X), pipe.predict(X))
    assert loaded[-1]._lookup == {"restored at": "steps.1.1"}
    assert_bitwise(roundtrip(est, tmp_path, "alone").predict(X), est.predict(X))


def test_allowed_sklearn_classes_include_what_the_tests_combine():
    names = persistence.allowed_classes()
    for required in ("sklearn.decomposition.TruncatedSVD", "sklearn.naive_bayes.GaussianNB",
                     "skafa.compose.PerTurn", "skafa.probes.GroupedArgmaxClassifier"):
        assert required in names


def test_persistence_holds_no_per_class_table():
    # Each class declares what persistence needs in its own module: persistence.py
    # names no skafa class in code and imports no private helper of another module.
    import ast
    import inspect as _inspect

    source = _inspect.getsource(persistence)
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    named = [node.value for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and id(node) not in docstrings
             and re.search(r"\bskafa\.[a-z_]+\.[A-Z]\w+", node.value)]
    assert named == []
    private = [f"{node.module}.{alias.name}" for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level and node.module
               and not node.module.startswith("utils")
               for alias in node.names
               if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert private == []
    for table in ("_DEFAULT_CLASSES", "_EXCLUDED_STATE", "_AFTER_LOAD", "_EXTRACTION_CLASSES",
                  "_MODEL_PARAM_CLASSES"):
        assert not hasattr(persistence, table)


def test_nesting_up_to_the_limit_roundtrips_and_beyond_is_refused_at_save(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setitem(persistence._REGISTERED, "tests.Custom", _Custom)

    def nested(depth):
        value = []
        for _ in range(depth):
            value = [value]
        return value

    # document -> tree -> params -> options: 3 levels above the parameter's value
    ok = _Custom(options=nested(persistence.MAX_JSON_DEPTH - 4))
    assert roundtrip(ok, tmp_path, "ok").options == ok.options
    with pytest.raises(ValueError, match="MAX_JSON_DEPTH"):
        save(_Custom(options=nested(persistence.MAX_JSON_DEPTH)), tmp_path / "deep")


def test_save_refuses_what_load_would_refuse(tmp_path, monkeypatch):
    monkeypatch.setitem(persistence._REGISTERED, "tests.SparseHolder", _SparseHolder)
    wide = sp.csr_matrix(([1.0, 1.0], ([0, 1], [0, 10**6])), shape=(2, 10**6 + 1)).todia()
    with pytest.raises(ValueError, match="would allocate"):
        save(_SparseHolder(wide).fit(), tmp_path / "dia")


def test_state_cannot_set_persistence_declarations(features, tmp_path):
    pipe = Pipeline([("probe", GroupedArgmaxLogisticClassifier(site="s1"))]).fit(*features[:2])
    path = save(pipe, tmp_path / "p")
    for key, value in (("_restore_after_load", {"__pytype__": "int"}),
                       ("_runtime_attributes", [])):
        rewrite(path, lambda doc: doc["tree"]["state"].update({key: value}))
        with pytest.raises(ValueError, match=f"refusing to set attribute '{key}'"):
            load(path)
        rewrite(path, lambda doc: doc["tree"]["state"].pop(key))


# ------------------------------------------- hostile files, runtime settings (issue 33)
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_saved_estimator_symlinked_to_dev_zero_is_refused(tmp_path):
    from skafa.persistence import load

    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / "skafa.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a regular file"):
        load(folder)


def test_load_takes_runtime_settings_from_the_caller(tmp_path):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    from skafa.persistence import RUNTIME_PARAMS, load, save

    assert {"cache_dir", "n_jobs", "device", "verbose"} <= set(RUNTIME_PARAMS)
    X = np.random.default_rng(0).normal(size=(20, 3))
    y = np.arange(20) % 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # sklearn 1.8: n_jobs has no effect
        pipe = Pipeline([("lr", LogisticRegression(n_jobs=8, verbose=3))],
                        verbose=True).fit(X, y)
    path = save(pipe, tmp_path / "p")
    loaded = load(path)
    assert loaded.steps[0][1].n_jobs is None and loaded.steps[0][1].verbose == 0
    assert loaded.verbose is False
    again = load(path, n_jobs=2, verbose=1)
    assert again.steps[0][1].n_jobs == 2 and again.steps[0][1].verbose == 1


def test_loaded_extractor_writes_nowhere(tmp_path):
    from skafa.llm import TurnActivationTransformer, register_model
    from skafa.persistence import load, save
    from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

    register_model("hostile-tiny", make_tiny_llama(seed=0), make_tiny_tokenizer(),
                   overwrite=True)
    cache = tmp_path / "named-in-file"
    X = make_conversations(3)
    ext = TurnActivationTransformer("hostile-tiny", sites=["resid_final"],
                                    cache_dir=str(cache), n_jobs=1).fit(X)
    path = save(ext, tmp_path / "ext")
    import shutil

    shutil.rmtree(cache, ignore_errors=True)
    loaded = load(path, verify_model=False)
    assert loaded.cache_dir is None and loaded.n_jobs is None and loaded.device == "cpu"
    loaded.transform(X)
    assert not cache.exists()
    own = tmp_path / "mine"
    assert load(path, cache_dir=str(own), verify_model=False).cache_dir == str(own)



def test_value_codec_tags_are_unique_but_a_reimported_class_may_register_again():
    from skafa.llm import ModelHandle
    from skafa.persistence import register_value_codec

    with pytest.raises(ValueError, match="already used"):
        register_value_codec(dict, "__model_handle__", str, lambda data: data)
    # the same class again (a module imported a second time): accepted, one entry kept
    register_value_codec(ModelHandle, "__model_handle__", lambda h: h.name, ModelHandle)
