"""Banded sliding-window attention (skafa.llm._attention): equal to dense sdpa and eager."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.masking_utils")

from skafa.llm import (
    BANDED_SDPA,
    banded_sdpa_attention_forward,
    banded_sliding_window_attention,
    extract_activations,
    forward_flops,
    has_sliding_window,
)
from skafa.llm import _attention as attn
from skafa.testing import make_tiny_gemma3, make_tiny_llama

WINDOW = 16


@pytest.fixture
def spy(monkeypatch):
    """Query lengths of every dense sdpa call the banded implementation makes."""
    calls = []
    real = attn._sdpa()

    def recording(module, query, *args, **kwargs):
        calls.append(int(query.shape[2]))
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(attn, "_sdpa", lambda: recording)
    return calls


def _gemma3(implementation, n_layers=3):
    model = make_tiny_gemma3(n_layers=n_layers, sliding_window=WINDOW)
    model.config._attn_implementation = implementation
    return model


def _hidden(model, ids, mask=None):
    with torch.inference_mode():
        return model.model(input_ids=ids, attention_mask=mask,
                           use_cache=False).last_hidden_state


def _ids(shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(3, 200, size=shape))


def test_has_sliding_window():
    assert has_sliding_window(_gemma3("eager"))
    assert not has_sliding_window(make_tiny_llama())


@pytest.mark.parametrize("padded", [False, True])
def test_banded_equals_dense_sdpa_and_eager(spy, padded):
    n = 7 * WINDOW + 5
    ids = _ids((2, n))
    mask = None
    if padded:  # right padding, as skafa's extraction batches
        mask = torch.ones((2, n), dtype=torch.long)
        mask[1, n - 23:] = 0
    eager = _hidden(_gemma3("eager"), ids, mask)
    model = _gemma3("sdpa")
    dense = _hidden(model, ids, mask)
    assert spy == []
    with banded_sliding_window_attention(model) as banded:
        assert banded and model.config._attn_implementation == BANDED_SDPA
        out = _hidden(model, ids, mask)
    assert model.config._attn_implementation == "sdpa"
    # The two sliding layers ran chunk by chunk, the global one dense.
    assert spy == 2 * ([WINDOW] * 7 + [5]) + [n]
    keep = slice(None) if mask is None else mask.bool()
    np.testing.assert_allclose(out[keep].numpy(), dense[keep].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[keep].numpy(), eager[keep].numpy(), rtol=1e-4, atol=1e-4)


def test_short_inputs_and_cached_queries_run_dense(spy):
    model = _gemma3("sdpa")
    with banded_sliding_window_attention(model):
        _hidden(model, _ids((1, 2 * WINDOW)))
    assert spy == [2 * WINDOW] * 3


class _Module(torch.nn.Module):
    num_key_value_groups = 1
    is_causal = True


def _qkv(n, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, dim, generator=g) for _ in range(3)]


def _window_mask(n, window, bidirectional=False):
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = (i - j < window) & (j <= i)
    if bidirectional:
        allowed = (i - j).abs() < window
    return allowed[None, None]


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_direct_call_equals_sdpa(spy, kind):
    n = 10 * WINDOW
    q, k, v = _qkv(n)
    mask = _window_mask(n, WINDOW)
    if kind == "float":
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    out, _ = banded_sdpa_attention_forward(_Module(), q, k, v, mask, sliding_window=WINDOW)
    assert len(spy) == 10
    ref, _ = attn._sdpa()(_Module(), q, k, v, mask)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", ["bidirectional", "one_far_key"])
def test_a_mask_reaching_outside_the_band_runs_dense(spy, change):
    n = 6 * WINDOW
    q, k, v = _qkv(n)
    mask = _window_mask(n, WINDOW, bidirectional=change == "bidirectional")
    if change == "one_far_key":
        mask = mask.clone()
        mask[0, 0, n - 1, 0] = True  # the last query also sees the first key
    out, _ = banded_sdpa_attention_forward(_Module(), q, k, v, mask, sliding_window=WINDOW)
    assert spy == [n]  # one dense call, nothing left out
    ref, _ = attn._sdpa()(_Module(), q, k, v, mask)
    np.testing.assert_array_equal(out.numpy(), ref.numpy())


def test_context_leaves_other_models_alone():
    llama = make_tiny_llama()
    llama.config._attn_implementation = "sdpa"
    with banded_sliding_window_attention(llama) as banded:
        assert not banded and llama.config._attn_implementation == "sdpa"
    eager = _gemma3("eager")
    with banded_sliding_window_attention(eager) as banded:
        assert not banded and eager.config._attn_implementation == "eager"


def test_context_restores_on_error_and_nests():
    model = _gemma3("sdpa")
    with pytest.raises(RuntimeError, match="boom"), banded_sliding_window_attention(model):
        with banded_sliding_window_attention(model) as inner:
            assert inner
        assert model.config._attn_implementation == BANDED_SDPA
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_extraction_reads_the_same_activations(spy):
    n = 9 * WINDOW
    ids = [_ids((n,), seed=1).numpy(), _ids((n - 40,), seed=2).numpy()]
    positions = [np.array([5, 70, n - 1]), np.array([3, n - 41])]
    sites = ["resid_pre.1", "resid_pre.2", "resid_final"]
    dense = extract_activations(_gemma3("eager"), ids, positions, sites, batch_size=2)
    banded = extract_activations(_gemma3("sdpa"), ids, positions, sites, batch_size=2)
    assert spy  # skafa's extraction ran the banded layers
    for a, b in zip(dense, banded):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_judge_scores_the_same(spy):
    from skafa.baselines._judge import score_candidates

    prefix = list(_ids((6 * WINDOW,), seed=3).numpy())
    conts = [[[5], [6, 7], [8]]]
    model = _gemma3("eager")
    number_mask = np.arange(model.config.vocab_size) % 7 == 0
    eager = score_candidates(model, [prefix], conts, number_mask)
    banded = score_candidates(_gemma3("sdpa"), [prefix], conts, number_mask)
    assert WINDOW in spy
    np.testing.assert_allclose(banded[0], eager[0], rtol=1e-4, atol=1e-4)


def test_forward_flops_counts_the_band():
    from skafa.llm import layer_parameters

    model = _gemma3("sdpa")  # layers: sliding, sliding, global; 4 heads x 8 = 32 wide
    linear = 2.0 * layer_parameters(model)

    def expected(n):  # 4 * width flops per attended pair
        return n * linear + 4.0 * 32 * (n * n / 2 + 2 * n * min(n / 2, WINDOW))

    for n in (WINDOW, 2 * WINDOW, 40 * WINDOW):
        assert forward_flops(model, n) == pytest.approx(expected(n))
    # At 40 W the window cuts the two sliding layers' attention to about n * W pairs.
    n = 40 * WINDOW
    assert forward_flops(model, n) < n * linear + 4.0 * 32 * 3 * n * n / 2 * 0.4


def test_kv_cache_appends_equal_eager(spy):
    """A long first append (empty cache) runs banded; the short continuation dense."""
    from transformers import DynamicCache

    from skafa.llm import SiteReader, decoder_layout

    ids = _ids((1, 5 * WINDOW + 3), seed=4)
    first, second = ids[:, : 4 * WINDOW], ids[:, 4 * WINDOW:]
    sites = ["resid_pre.2", "resid_final"]
    out = {}
    for implementation in ("eager", "sdpa"):
        model = _gemma3(implementation)
        reader = SiteReader(decoder_layout(model), sites)
        cache = DynamicCache(config=model.config)
        a = reader.run(first, torch.arange(first.shape[1]), past_key_values=cache)
        b = reader.run(second, torch.arange(second.shape[1]), past_key_values=cache)
        out[implementation] = torch.cat([a, b]).numpy()
    assert spy.count(WINDOW) == 2 * 4  # both sliding layers of the first append
    np.testing.assert_allclose(out["sdpa"], out["eager"], rtol=1e-4, atol=1e-4)
