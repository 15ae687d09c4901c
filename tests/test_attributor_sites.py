"""A fitted FailureAttributor extracts only the sites its selector reads.

``predict`` / ``attribute`` / ``evaluate`` read ``predict_sites_`` through a view
of the fitted extractor (``TurnActivationTransformer._restricted``) whose forward
passes stop after the deepest of them; the results are those of the full-site
``pipeline_`` (compared bit for bit with it: the "old path" below).
"""

import json

import numpy as np
import pytest
from sklearn.model_selection import GroupKFold

from skafa import GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier
from skafa.attributor import FailureAttributor
from skafa.compose import final_step_input
from skafa.llm import (
    ActivationCache,
    TurnActivationTransformer,
    decoder_layout,
    register_model,
    unregister_model,
)
from skafa.model_selection import SiteEnsemble, SiteSelector
from skafa.persistence import _persistence as persistence
from skafa.testing import (
    make_conversations,
    make_site_features,
    make_tiny_llama,
    make_tiny_tokenizer,
)

MODEL = "attributor-sites-tiny"
N_LAYERS = 4
ALL_SITES = ("resid_pre.0", "mlp_in.0", "resid_pre.1", "mlp_in.1", "resid_pre.2",
             "mlp_in.2", "resid_pre.3", "mlp_in.3", "resid_final")


@pytest.fixture(scope="module", autouse=True)
def tiny_model():
    register_model(MODEL, make_tiny_llama(n_layers=N_LAYERS, seed=3), make_tiny_tokenizer(),
                   overwrite=True)
    yield MODEL
    unregister_model(MODEL)


@pytest.fixture(scope="module")
def conversations():
    return make_conversations(32, seed=11)


def _extractor(**kw):
    # memory_cache=False: every predict runs its own forward passes, so the
    # restricted extraction itself is compared with the full one
    kw.setdefault("memory_cache", False)
    return TurnActivationTransformer(MODEL, **kw)


def _selector(kind):
    probe = GroupedArgmaxLogisticClassifier(random_state=0)
    if kind == "selector":  # one site chosen by CV among two
        return SiteSelector(probe, sites=["mlp_in.1", "resid_pre.2"], cv=GroupKFold(3))
    if kind == "selector-2":  # two sites averaged (a SiteEnsemble inside)
        return SiteSelector(probe, sites=["mlp_in.0", "mlp_in.1", "resid_pre.2"],
                            cv=GroupKFold(3), n_sites=2)
    if kind == "ensemble":
        return SiteEnsemble(probe, sites=["resid_pre.1", "mlp_in.1"])
    if kind == "probe":
        return GroupedSoftmaxClassifier(site="mlp_in.1")
    raise AssertionError(kind)


def _fit(kind, conversations, *, shift_detector="auto", **kw):
    # a plain probe or ensemble has no best_sites_, so the "auto" shift detector
    # would read every site: without it only the probe's sites are read
    if kind in ("ensemble", "probe"):
        shift_detector = None
    fa = FailureAttributor(_extractor(**kw), _selector(kind), shift_detector=shift_detector)
    return fa.fit(conversations[:20])


@pytest.fixture(scope="module")
def fitted(conversations):
    """``fitted(kind)``: one attributor per kind, fitted once for the module."""
    done = {}

    def get(kind):
        if kind not in done:
            done[kind] = _fit(kind, conversations)
        return done[kind]
    return get


def rewrite(path, edit):
    """Edit skafa.json's document and re-sign the tree (as in the persistence tests)."""
    doc = json.loads((path / "skafa.json").read_text())
    edit(doc)
    doc["tree_sha256"] = persistence._sha256(persistence._canonical(doc["tree"]))
    (path / "skafa.json").write_text(json.dumps(doc))


def _old_path(self, convs):
    """What every predicting method did before: the full-site pipeline_."""
    return final_step_input(self.pipeline_, convs)


class LayerSpy:
    """Counts the completed forward passes of every decoder layer and the final norm."""

    def __init__(self, model):
        layout = decoder_layout(model)
        self.counts = {}
        self.handles = []
        modules = [(f"layer.{i}", m) for i, m in enumerate(layout.layers)]
        modules.append(("final_norm", layout.final_norm))
        for name, module in modules:
            self.counts[name] = 0

            def hook(module, args, output, _name=name):
                self.counts[_name] += 1
            self.handles.append(module.register_forward_hook(hook))

    def ran(self):
        return {k for k, v in self.counts.items() if v}

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.fixture
def spy():
    spies = []

    def make(model):
        s = LayerSpy(model)
        spies.append(s)
        return s
    yield make
    for s in spies:
        s.close()


# ------------------------------------------------------------------ what is read
@pytest.mark.parametrize("kind, expected", [
    ("selector", None),  # whichever of the two sites CV picks
    ("selector-2", None),
    ("ensemble", ("mlp_in.1", "resid_pre.1")),
    ("probe", ("mlp_in.1",)),
])
def test_predict_sites_are_those_the_selector_reads(kind, expected, fitted):
    fa = fitted(kind)
    assert fa.pipeline_[0].sites_ == ALL_SITES  # pipeline_ still reads everything
    if expected is None:
        expected = tuple(s for s in ALL_SITES if s in fa.best_sites_)
        assert fa.shift_detector_ is not None
        assert set(fa.shift_detector_.sites_) <= set(expected)
    else:
        expected = tuple(s for s in ALL_SITES if s in expected)  # the extractor's order
    assert fa.predict_sites_ == expected


def test_a_plain_probe_and_its_shift_detector_read_the_probe_site(conversations):
    # the "auto" shift detector reads the sites the final step reads (a probe's site_)
    fa = FailureAttributor(_extractor(), _selector("probe")).fit(conversations[:20])
    probe_site = fa.pipeline_[-1].site_
    assert fa.shift_detector_.sites_ == (probe_site,)
    assert fa.predict_sites_ == (probe_site,)
    assert fa.pipeline_[0]._restricted(ALL_SITES) is fa.pipeline_[0]


# ------------------------------------------------------- (1) identical results
@pytest.mark.parametrize("kind", ["selector", "selector-2", "ensemble", "probe"])
def test_same_predictions_as_the_full_site_pipeline(kind, conversations, fitted,
                                                    monkeypatch):
    fa = fitted(kind)
    test = conversations[20:28]
    assert len(fa.predict_sites_) < len(ALL_SITES)
    acts = fa.pipeline_[0]
    before = acts.run_stats["n_forward_passes"]

    def results():
        out = {
            "predict": fa.predict(test),
            "agent": fa.predict_agent(test),
            "scores": fa.turn_decision_function(test),
            "proba": fa.turn_predict_proba(test),
            "score": fa.score(test),
            "evaluate": fa.evaluate(test, n_resamples=50, random_state=0).to_dict(),
            "attribute": [fa.attribute(c, top_k=4).to_dict() for c in test[:4]],
        }
        return out

    new = results()
    # the restricted path really extracted (memory_cache=False, no cache_dir)
    assert acts.run_stats["n_forward_passes"] > before
    _, Xt = fa._final_input(test[:2])
    assert Xt.sites == fa.predict_sites_
    monkeypatch.setattr(FailureAttributor, "_final_input", _old_path)
    old = results()
    np.testing.assert_array_equal(new["predict"], old["predict"])
    np.testing.assert_array_equal(new["agent"], old["agent"])
    assert len(new["scores"]) == len(old["scores"]) == len(test)
    for a, b in zip(new["scores"], old["scores"]):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # bit for bit
    for a, b in zip(new["proba"], old["proba"]):
        assert np.array_equal(a, b)
    assert new["score"] == old["score"]
    assert new["evaluate"] == old["evaluate"]
    assert new["attribute"] == old["attribute"]


def test_shift_scores_identical(conversations, fitted, monkeypatch):
    fa = fitted("selector")
    assert fa.shift_detector_ is not None
    new = [fa.attribute(c).shift_score for c in conversations[20:26]]
    monkeypatch.setattr(FailureAttributor, "_final_input", _old_path)
    old = [fa.attribute(c).shift_score for c in conversations[20:26]]
    assert new == old and all(s is not None for s in new)


# ---------------------------------------------------- (2) reads less, stops early
def test_restricted_extractor_reads_only_the_chosen_sites(conversations, fitted):
    fa = fitted("selector-2")
    acts = fa.pipeline_[0]
    fitted = dict(vars(acts))
    view = acts._restricted(fa.predict_sites_)
    assert view is not acts and view.sites_ == fa.predict_sites_
    assert view._model is acts._model and view._cache is acts._cache  # nothing loaded twice
    assert view.run_stats == acts.run_stats
    X = view.transform(conversations[20:22])
    assert X.sites == fa.predict_sites_
    full = acts.transform(conversations[20:22])
    np.testing.assert_array_equal(X.values, full.select_sites(list(X.sites)).values)
    # the fitted extractor is unchanged (its sites and everything else)
    assert acts.sites_ == ALL_SITES
    assert set(vars(acts)) == set(fitted)
    for name, value in fitted.items():
        if name != "_run_stats":
            assert vars(acts)[name] is value, name
    with pytest.raises(ValueError, match="does not read.*resid_pre.9"):
        acts._restricted(["resid_pre.9"])


def test_forward_pass_stops_after_the_deepest_chosen_site(conversations, spy, monkeypatch):
    # one site, resid_pre.2: layers 2 and 3 and the final norm must not run
    selector = SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0),
                            sites=["resid_pre.2"], cv=GroupKFold(3))
    fa = FailureAttributor(_extractor(), selector).fit(conversations[:20])
    assert fa.predict_sites_ == ("resid_pre.2",)
    acts = fa.pipeline_[0]
    layers = spy(acts._model)
    before = acts.run_stats["n_forward_passes"]
    fa.attribute(conversations[25])
    fa.predict(conversations[26:28])
    assert acts.run_stats["n_forward_passes"] == before + 3
    assert layers.ran() == {"layer.0", "layer.1"}
    assert layers.counts["layer.0"] == 3
    # the full-site path (before) ran every layer and the final norm
    layers.counts = dict.fromkeys(layers.counts, 0)
    monkeypatch.setattr(FailureAttributor, "_final_input", _old_path)
    fa.attribute(conversations[25])
    assert layers.ran() == {"layer.0", "layer.1", "layer.2", "layer.3", "final_norm"}


def test_resid_final_runs_the_whole_model(conversations, spy):
    selector = SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0),
                            sites=["resid_final"], cv=GroupKFold(3))
    fa = FailureAttributor(_extractor(), selector).fit(conversations[:20])
    assert fa.predict_sites_ == ("resid_final",)
    layers = spy(fa.pipeline_[0]._model)
    fa.attribute(conversations[25])
    assert layers.ran() == {"layer.0", "layer.1", "layer.2", "layer.3", "final_norm"}


# ------------------------------------------------------------------- (3) cache
@pytest.mark.parametrize("memory", [False, True])
def test_cache_entries_with_more_sites_serve_the_restricted_read(
        memory, conversations, tmp_path, monkeypatch, spy):
    fa = _fit("selector-2", conversations, cache_dir=tmp_path / "acts", memory_cache=memory)
    acts = fa.pipeline_[0]
    assert acts.run_stats["writes"] == 20  # fit wrote every training run, all sites
    asked = []
    get = ActivationCache.get

    def recording_get(self, key, sites, **kw):
        asked.append(tuple(sites))
        return get(self, key, sites, **kw)
    monkeypatch.setattr(ActivationCache, "get", recording_get)
    layers = spy(acts._model)
    stats = acts.run_stats
    train = conversations[:6]  # cached at fit with every site
    out = [fa.attribute(c) for c in train]
    assert asked == [fa.predict_sites_] * len(train)  # read at the chosen sites only
    after = acts.run_stats
    assert after["n_forward_passes"] == stats["n_forward_passes"]  # no forward pass
    assert layers.ran() == set()
    hits = "memory_hits" if memory else "disk_hits"
    assert after[hits] - stats[hits] == len(train)
    assert after["misses"] == stats["misses"]
    # ...with the values the full-site entries hold
    monkeypatch.setattr(FailureAttributor, "_final_input", _old_path)
    for a, c in zip(out, train):
        assert a.to_dict() == fa.attribute(c).to_dict()


def test_restricted_entry_is_merged_not_replaced(conversations, tmp_path):
    fa = _fit("selector-2", conversations, cache_dir=tmp_path / "acts")
    acts = fa.pipeline_[0]
    new = conversations[30]
    fa.attribute(new)  # a miss: extracted at the chosen sites, written
    cache = ActivationCache(tmp_path / "acts", memory=False)
    key = acts._key(new)
    assert cache.contains(key, fa.predict_sites_, n_turns=len(new),
                          hidden_size=acts.n_features_out_)
    assert not cache.contains(key, ALL_SITES, n_turns=len(new),
                              hidden_size=acts.n_features_out_)
    acts.transform([new])  # the full extractor fills in the rest
    assert cache.contains(key, ALL_SITES, n_turns=len(new), hidden_size=acts.n_features_out_)


# ------------------------------------------------------------ (4) persistence
def test_save_load_round_trip(conversations, fitted, tmp_path):
    fa = fitted("selector-2")
    test = conversations[20:26]
    path = fa.save(tmp_path / "fa")
    loaded = FailureAttributor.load(path)
    assert tuple(loaded.predict_sites_) == fa.predict_sites_
    assert loaded.pipeline_[0].sites_ == ALL_SITES
    want_scores = fa.turn_decision_function(test)
    want = [fa.attribute(c).to_dict() for c in test]
    np.testing.assert_array_equal(loaded.predict(test), fa.predict(test))
    for a, b in zip(loaded.turn_decision_function(test), want_scores):
        assert np.array_equal(a, b)
    assert [loaded.attribute(c).to_dict() for c in test] == want
    _, Xt = loaded._final_input(test[:1])
    assert Xt.sites == fa.predict_sites_
    # a file saved before predict_sites_ existed: the sites come from its pieces
    meta = json.loads((path / "skafa.json").read_text())
    text = json.dumps(meta)
    assert "predict_sites_" in text

    def drop(node):
        if isinstance(node, dict):
            node.pop("predict_sites_", None)
            for v in node.values():
                drop(v)
        elif isinstance(node, list):
            for v in node:
                drop(v)
    rewrite(path, drop)
    older = FailureAttributor.load(path)
    assert "predict_sites_" not in vars(older)
    _, Xt = older._final_input(test[:1])
    assert Xt.sites == fa.predict_sites_
    assert "predict_sites_" not in vars(older)  # nothing fitted was set
    assert [older.attribute(c).to_dict() for c in test] == want


def test_load_refuses_predict_sites_the_extractor_does_not_produce(fitted, tmp_path):
    fa = fitted("selector")
    path = fa.save(tmp_path / "fa")
    found = []

    def edit(node):  # predict_sites_ names a site the extractor does not read
        if isinstance(node, dict):
            if "predict_sites_" in node:
                found.append(node["predict_sites_"])
                text = json.dumps(node["predict_sites_"])
                node["predict_sites_"] = json.loads(
                    text.replace(json.dumps(fa.predict_sites_[0]), '"resid_pre.7"'))
            for v in node.values():
                edit(v)
        elif isinstance(node, list):
            for v in node:
                edit(v)
    rewrite(path, edit)
    assert len(found) == 1
    with pytest.raises(ValueError, match="predict_sites_"):
        FailureAttributor.load(path)


# ------------------------------------- selectors predict on the chosen sites alone
@pytest.mark.parametrize("kind", ["selector", "selector-2", "ensemble", "probe"])
def test_selectors_predict_on_features_holding_only_their_sites(kind):
    from skafa.attributor import _sites_read_by

    X, y = make_site_features(n=60, n_sites=5, seed=2)
    names = list(X.sites)
    probe = GroupedArgmaxLogisticClassifier(random_state=0)
    groups = np.arange(len(y)) // 2
    if kind == "selector":
        est = SiteSelector(probe, cv=GroupKFold(3)).fit(X, y, groups=groups)
    elif kind == "selector-2":
        est = SiteSelector(probe, cv=GroupKFold(3), n_sites=2).fit(X, y, groups=groups)
    elif kind == "ensemble":
        est = SiteEnsemble(probe, sites=[names[3], names[1]]).fit(X, y)
    else:
        est = GroupedSoftmaxClassifier(site=names[2]).fit(X, y)
    read = _sites_read_by(est)
    assert read and set(read) < set(names)
    # the chosen sites alone, in the extractor's order (maybe not the selector's)
    sub = X.select_sites([s for s in names if s in read])
    np.testing.assert_array_equal(est.predict(sub), est.predict(X))
    for a, b in zip(est.turn_decision_function(sub), est.turn_decision_function(X)):
        assert np.array_equal(a, b)
    lacking = X.select_sites([s for s in names if s != read[0]])
    with pytest.raises(ValueError, match=repr(read[0])):
        est.predict(lacking)
