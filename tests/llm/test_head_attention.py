"""Per-head attention rows (skafa.llm._head_attention) and the head_attn.<l> sites."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.masking_utils")

from torch.utils._python_dispatch import TorchDispatchMode

from skafa.features import TurnFeatures
from skafa.llm import (
    PromptTemplate,
    TurnActivationTransformer,
    activation_key,
    banded_sliding_window_attention,
    extract_activations,
    head_attention_rows,
    head_attention_sites,
    is_head_attention_site,
    parse_site_spec,
    register_model,
    site_depth,
    turn_attention_mass,
    unregister_model,
    validate_sites,
)
from skafa.metrics import locator_head_accuracy
from skafa.testing import (
    make_conversations,
    make_tiny_gemma,
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

WINDOW = 8
BUILDERS = {
    "llama": lambda: make_tiny_llama(n_layers=2),
    "qwen2": lambda: make_tiny_qwen2(n_layers=2),
    "gemma2": lambda: make_tiny_gemma(n_layers=2),  # sliding 64 and logit soft-capping
    "gemma3-sliding": lambda: make_tiny_gemma3(n_layers=3, sliding_window=WINDOW),
    "gemma3-global": lambda: make_tiny_gemma3(n_layers=1),  # one full-attention layer
}


def _ids(shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(3, 200, size=shape))


def _reference(model, ids, mask=None):
    """Eager ``output_attentions`` of every layer, and the logits."""
    model.config._attn_implementation = "eager"
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
    return [a.float() for a in out.attentions], out.logits


IMPLEMENTATIONS = [("eager", False), ("sdpa", False), ("sdpa", True)]


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("implementation,banded", IMPLEMENTATIONS)
def test_rows_equal_eager_output_attentions(name, implementation, banded):
    model = BUILDERS[name]()
    if name == "gemma2" and implementation == "sdpa":
        pytest.skip("sdpa does not support Gemma-2's soft-capping (transformers refuses)")
    n = 80  # > 2 x WINDOW (banded Gemma-3 layers) and > Gemma-2's window of 64
    ids = _ids((2, n))
    reference, ref_logits = _reference(model, ids)
    model.config._attn_implementation = implementation
    positions = [5, -1, n - 20]
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=False).logits
        ctx = banded_sliding_window_attention(model) if banded else _nothing()
        with ctx, head_attention_rows(model, positions) as rows:
            logits = model(input_ids=ids, use_cache=False).logits
    assert model.config._attn_implementation == implementation
    assert rows.n_layers == model.config.num_hidden_layers and rows.n_heads == 4
    assert sorted(rows.weights) == list(range(rows.n_layers))
    index = [5, n - 1, n - 20]
    for layer in range(rows.n_layers):
        got = rows.weights[layer]
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert got.shape == (2, 4, 3, n)
        torch.testing.assert_close(got, reference[layer][:, :, index], atol=1e-6, rtol=1e-5)
        assert rows.positions[layer] == tuple(index)
    torch.testing.assert_close(logits, plain, atol=1e-6, rtol=1e-5)  # output unchanged
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert rows.stacked().shape == (rows.n_layers, 2, 4, 3, n)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_rows_with_a_padding_mask_equal_eager():
    model = make_tiny_qwen2()
    ids = _ids((2, 30))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    reference, _ = _reference(model, ids, mask)
    model.config._attn_implementation = "sdpa"
    with torch.inference_mode(), head_attention_rows(model, [3, 19]) as rows:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for layer in range(2):
        torch.testing.assert_close(rows.weights[layer], reference[layer][:, :, [3, 19]],
                                   atol=1e-6, rtol=1e-5)
        assert float(rows.weights[layer][1, :, :, 20:].abs().max()) == 0.0


class _LargestTensor(TorchDispatchMode):
    """The largest floating-point tensor any operator returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("name", ["llama", "gemma3-sliding"])
def test_long_prompt_never_materialises_a_full_attention_matrix(name):
    n = 1536  # n x n = 2.4 M values; the largest legitimate tensor is n x vocab = 1.6 M
    model = BUILDERS[name]()
    ids = _ids((1, n))
    model.config._attn_implementation = "eager"
    with torch.inference_mode(), _LargestTensor() as eager:  # the detector can fail
        model.model(input_ids=ids, use_cache=False)
    assert eager.largest >= n * n
    model.config._attn_implementation = "sdpa"
    with torch.inference_mode(), banded_sliding_window_attention(model), \
            head_attention_rows(model, [-1, -2]) as rows, _LargestTensor() as spy:
        model(input_ids=ids, use_cache=False)
    assert spy.largest < n * n
    assert rows.weights[0].shape == (1, 4, 2, n)
    sums = rows.stacked().sum(axis=-1)
    np.testing.assert_allclose(sums, 1.0, atol=1e-5)


def test_override_changes_only_the_chosen_rows_and_heads():
    model = make_tiny_llama(n_layers=2)
    model.config._attn_implementation = "sdpa"
    ids = _ids((1, 24))
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=False).logits
        with head_attention_rows(model, [-1]) as rows:
            model(input_ids=ids, use_cache=False)
        own = {(1, 2): rows.weights[1][:, 2]}  # (batch, n_queries, n_keys)
        with head_attention_rows(model, [-1], override=own):
            same = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(same, plain, atol=1e-5, rtol=1e-4)
        onehot = np.zeros((1, 24), dtype=np.float32)
        onehot[0, 3] = 1.0  # all attention of head (0, 1) at the last token on token 3
        with head_attention_rows(model, [-1], override={(0, 1): onehot}) as forced:
            changed = model(input_ids=ids, use_cache=False).logits
        after = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(changed[:, :-1], plain[:, :-1])  # earlier rows unchanged
    assert float((changed[:, -1] - plain[:, -1]).abs().max()) > 1e-4
    torch.testing.assert_close(after, plain)  # inactive outside the block
    torch.testing.assert_close(forced.weights[0], rows.weights[0])  # records the model's own


def test_override_output_is_weights_times_values():
    model = make_tiny_llama(n_layers=1)
    ids = _ids((1, 10))
    attn = model.model.layers[0].self_attn
    seen = {}
    attn.o_proj.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    weights = torch.full((1, 10), 0.1)
    with torch.inference_mode(), head_attention_rows(model, [-1], override={(0, 3): weights}):
        model(input_ids=ids, use_cache=False)
    # V of head 3 (key head 1 of 2): recompute from the layer's input
    with torch.inference_mode():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        v = attn.v_proj(hidden).view(1, 10, 2, 8)[:, :, 1]
    got = seen["x"][0, -1].view(4, 8)[3]
    torch.testing.assert_close(got, v[0].mean(dim=0))


def test_restores_the_implementation_on_error_and_refuses_nesting():
    model = make_tiny_gemma3(n_layers=2, sliding_window=WINDOW)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with head_attention_rows(model, [0]):
            assert model.config._attn_implementation != "sdpa"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    with head_attention_rows(model, [0]):
        with pytest.raises(RuntimeError, match="already active"):
            with head_attention_rows(model, [0]):
                pass
    assert model.config._attn_implementation == "sdpa"


def test_bad_arguments_are_named():
    model = make_tiny_llama()
    ids = _ids((1, 6))
    with pytest.raises(ValueError, match="empty"):
        with head_attention_rows(model, []):
            pass
    with pytest.raises(ValueError, match="ints"):
        with head_attention_rows(model, [True]):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with torch.inference_mode(), head_attention_rows(model, [6]):
            model(input_ids=ids, use_cache=False)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        with head_attention_rows(model, [0], override={(5, 0): np.ones((1, 6))}):
            pass
    with pytest.raises(ValueError, match="shape"):
        with head_attention_rows(model, [0, 1], override={(0, 0): np.ones((1, 6))}):
            pass
    with pytest.raises(ValueError, match="covers 5 keys|cover 5 keys"):
        with torch.inference_mode(), head_attention_rows(
                model, [0], override={(0, 0): np.ones((1, 5)) / 5}):
            model(input_ids=ids, use_cache=False)
    assert model.config._attn_implementation == "eager"


def test_decoding_steps_record_their_own_rows():
    from transformers import DynamicCache

    model = make_tiny_llama()
    ids = _ids((1, 12))
    reference, _ = _reference(model, ids)
    model.config._attn_implementation = "sdpa"
    cache = DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    with torch.inference_mode(), head_attention_rows(model, [-1]) as rows:
        model(input_ids=ids[:, :11], use_cache=True, **{name: cache})
        model(input_ids=ids[:, 11:], use_cache=True, **{name: cache})
    torch.testing.assert_close(rows.weights[1], reference[1][:, :, [11]], atol=1e-6, rtol=1e-5)
    with torch.inference_mode(), head_attention_rows(model, [3]) as rows:
        model(input_ids=ids[:, 11:], use_cache=True, **{name: cache})
    assert rows.weights == {}  # position 3 is not in a one-token continuation


def test_turn_attention_mass():
    w = np.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    np.testing.assert_allclose(turn_attention_mass(w, [(0, 1), (1, 4), (2, 2)]),
                               [[0.1, 0.9, 0.0], [0.25, 0.75, 0.0]])
    np.testing.assert_allclose(turn_attention_mass(torch.tensor(w), [(0, 4)]), [[1.0], [1.0]])
    with pytest.raises(ValueError, match="span 0"):
        turn_attention_mass(w, [(3, 5)])
    with pytest.raises(ValueError, match="span 0"):
        turn_attention_mass(w, [(2, 1)])


# ------------------------------------------------------------- the head_attn sites
def test_site_names():
    assert head_attention_sites(2) == ["head_attn.0", "head_attn.1"]
    assert validate_sites("head_attn", 2) == ("head_attn.0", "head_attn.1")
    assert validate_sites(["head_attn.1"], 2) == ("head_attn.1",)
    assert "head_attn.0" not in validate_sites(None, 2)
    assert is_head_attention_site("head_attn.3") and not is_head_attention_site("resid_pre.3")
    assert not is_head_attention_site("head_attn")
    assert site_depth("resid_pre.1") < site_depth("head_attn.1") < site_depth("mlp_in.1")
    with pytest.raises(ValueError, match="out of range"):
        validate_sites(["head_attn.2"], 2)
    assert parse_site_spec("head_attn") == "head_attn"
    assert parse_site_spec("head_attn", n_layers=2) == ("head_attn.0", "head_attn.1")
    assert parse_site_spec("head_attn.1, head_attn.0") == ["head_attn.1", "head_attn.0"]


def test_cache_key_of_hidden_states_is_unchanged():
    conv = make_conversations(1)[0]
    kw = dict(model_identity={"kind": "x"}, model_fingerprint={"a": 1}, dtype="float32",
              prompt_fingerprint="p", chat_template_kwargs=None, conversation=conv)
    assert activation_key(**kw) == activation_key(**kw, site_kind=None)
    assert activation_key(**kw, site_kind="head_attn") != activation_key(**kw)
    with pytest.raises(ValueError, match="site_kind"):
        activation_key(**kw, site_kind="heads")


def _eager_turn_mass(model, tokenizer, conv):
    enc = PromptTemplate().encode(conv, tokenizer)
    reference, _ = _reference(model, torch.from_numpy(np.asarray(enc.input_ids))[None])
    spans = list(zip(enc.turn_start_positions, enc.turn_positions + 1))
    return np.stack([turn_attention_mass(a[0, :, -1], spans).T for a in reference], axis=1)


@pytest.fixture
def registered():
    names = []

    def register(builder, name):
        model, tokenizer = builder(), make_tiny_tokenizer()
        register_model(name, model, tokenizer)
        names.append(name)
        return model, tokenizer

    yield register
    for name in names:
        unregister_model(name)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3-sliding", "gemma3-global"])
def test_head_sites_equal_the_eager_reference(registered, name, tmp_path):
    model, tokenizer = registered(BUILDERS[name], f"skafa-tiny-heads-{name}")
    model.config._attn_implementation = "sdpa"
    X = make_conversations(3, seed=1)
    ext = TurnActivationTransformer(f"skafa-tiny-heads-{name}", sites="head_attn",
                                    dtype="float32", cache_dir=tmp_path, memory_cache=False)
    F = ext.fit_transform(X)
    n_layers = model.config.num_hidden_layers
    assert F.sites == tuple(head_attention_sites(n_layers))
    assert F.values.shape == (sum(len(c) for c in X), n_layers, 4)
    assert ext.n_features_out_ == 4 and len(ext.get_feature_names_out()) == 4
    for i, conv in enumerate(X):
        want = _eager_turn_mass(model, tokenizer, conv)
        np.testing.assert_allclose(F.values[F.offsets[i]:F.offsets[i + 1]], want, atol=1e-6)
    assert np.all(F.values >= 0)
    # the last layer is global: every head gives the turns some attention (a sliding
    # layer's window from the answer position may end before the transcript)
    assert np.all(F.values[:, -1].sum(axis=0) > 0)
    # a second extractor reads the same entries back from disk
    again = TurnActivationTransformer(f"skafa-tiny-heads-{name}", sites=["head_attn.0"],
                                      dtype="float32", cache_dir=tmp_path,
                                      memory_cache=False).fit(X)
    np.testing.assert_array_equal(again.transform(X).values[:, 0], F.values[:, 0])
    assert again.run_stats["n_forward_passes"] == 0


def test_head_sites_early_stop_and_keys(registered):
    registered(lambda: make_tiny_llama(n_layers=3), "skafa-tiny-heads-keys")
    X = make_conversations(2, seed=2)
    hidden = TurnActivationTransformer("skafa-tiny-heads-keys", sites=["resid_pre.0"],
                                       dtype="float32").fit(X)
    heads = TurnActivationTransformer("skafa-tiny-heads-keys", sites=["head_attn.0"],
                                      dtype="float32", memory_cache=False).fit(X)
    full = TurnActivationTransformer("skafa-tiny-heads-keys", sites="head_attn",
                                     dtype="float32", memory_cache=False).fit(X)
    assert hidden._key(X[0]) != heads._key(X[0])
    np.testing.assert_array_equal(heads.transform(X).values[:, 0],
                                  full.transform(X).values[:, 0])
    assert hidden.transform(X).values.shape[2] == 32


def test_head_sites_refuse_mixing_and_streaming(registered):
    registered(make_tiny_llama, "skafa-tiny-heads-mix")
    X = make_conversations(2)
    with pytest.raises(ValueError, match="mixes head-attention sites"):
        TurnActivationTransformer("skafa-tiny-heads-mix", sites=["head_attn.0", "resid_final"],
                                  dtype="float32").fit(X)
    ext = TurnActivationTransformer("skafa-tiny-heads-mix", sites="head_attn",
                                    dtype="float32").fit(X)
    with pytest.raises(ValueError, match="not streamed"):
        ext.stream("head_attn.0", task="t")
    model = make_tiny_llama()
    from skafa.llm import SiteReader, decoder_layout

    with pytest.raises(ValueError, match="head-attention sites"):
        SiteReader(decoder_layout(model), ["head_attn.0"])
    with pytest.raises(ValueError, match="cannot be read together"):
        extract_activations(model, [np.arange(3, 9)], [np.array([5])],
                            ["head_attn.0", "resid_final"], starts=[np.array([0])])


def test_locator_head_probe_and_accuracy_on_head_features(registered):
    from sklearn.model_selection import GroupKFold

    from skafa.model_selection import SiteSelector
    from skafa.probes import GroupedArgmaxLogisticClassifier

    registered(make_tiny_llama, "skafa-tiny-heads-probe")
    X = make_conversations(8, seed=3)
    y = np.array([c.mistake_step for c in X])
    F = TurnActivationTransformer("skafa-tiny-heads-probe", sites="head_attn",
                                  dtype="float32").fit_transform(X)
    assert isinstance(F, TurnFeatures)
    acc, chance = locator_head_accuracy(F, y)
    assert acc.shape == (2, 4) and np.all((acc >= 0) & (acc <= 1))
    assert chance == pytest.approx(np.mean([1 / len(c) for c in X]))
    selector = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(n_splits=2)).fit(
        F, y, groups=np.arange(8) % 4)
    assert selector.best_site_ in F.sites
    assert selector.predict(F).shape == (8,)


def test_head_extractor_round_trips_through_save_and_load(registered, tmp_path):
    from skafa import load, save

    registered(make_tiny_qwen2, "skafa-tiny-heads-save")
    X = make_conversations(2, seed=4)
    ext = TurnActivationTransformer("skafa-tiny-heads-save", sites="head_attn",
                                    dtype="float32").fit(X)
    save(ext, tmp_path / "ext")
    back = load(tmp_path / "ext")
    assert back.sites_ == ext.sites_ and back.n_features_out_ == 4
    np.testing.assert_array_equal(back.transform(X).values, ext.transform(X).values)
