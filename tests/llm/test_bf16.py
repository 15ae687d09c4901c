"""bfloat16 linear layers through float32's kernel on CPUs without bfloat16 units."""

import pickle

import pytest
import torch
import torch.nn.functional as F

from skafa.llm import (
    _models,
    bf16_matmul_via_float32,
    clear_model_cache,
    decoder_layout,
    load_model,
    model_fingerprint,
    uses_bf16_matmul_via_float32,
)
from skafa.llm._batching import _activation_bytes
from skafa.testing import make_tiny_llama, make_tiny_tokenizer


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_large_products_are_float32_products_rounded_once():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40).to(torch.bfloat16)
    native = torch.nn.Linear(48, 40).to(torch.bfloat16)
    native.load_state_dict(layer.state_dict())
    assert bf16_matmul_via_float32(layer, min_rows=8) == 1
    assert uses_bf16_matmul_via_float32(layer) and not uses_bf16_matmul_via_float32(native)
    x = torch.randn(2, 5, 48).to(torch.bfloat16)  # 10 rows >= 8: float32's kernel
    with torch.inference_mode():
        got = layer(x)
        want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.dtype is torch.bfloat16
        # the native kernel: the same up to the order of float32 sums (one bf16 unit)
        torch.testing.assert_close(got, native(x), rtol=2 ** -7, atol=1e-2)
        small = x[:1, :3]  # 3 rows < 8: the native kernel, bit for bit
        torch.testing.assert_close(layer(small), native(small), rtol=0, atol=0)
        x32 = x.float()  # float32 inputs of a float32 layer are not touched
        layer32 = torch.nn.Linear(48, 40)
        bf16_matmul_via_float32(layer32)
        torch.testing.assert_close(layer32(x32), F.linear(x32, layer32.weight, layer32.bias),
                                   rtol=0, atol=0)


def test_a_model_keeps_its_weights_hooks_and_fingerprint():
    lm = make_tiny_llama(seed=3).to(torch.bfloat16)
    keys, fingerprint = list(lm.state_dict()), model_fingerprint(lm)
    native = make_tiny_llama(seed=3).to(torch.bfloat16)
    seen = []
    handle = lm.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen.append(o.shape))
    n = bf16_matmul_via_float32(lm)
    assert n == len(_linears(lm)) == len(_linears(native)) and n > 0
    assert bf16_matmul_via_float32(lm, min_rows=4) == n  # again: min_rows only
    assert list(lm.state_dict()) == keys and model_fingerprint(lm) == fingerprint
    ids = torch.randint(0, lm.config.vocab_size, (1, 64))
    with torch.inference_mode():
        got = lm(input_ids=ids).logits.float()
        want = native(input_ids=ids).logits.float()
    handle.remove()
    assert seen == [(1, 64, lm.config.hidden_size)]
    assert torch.isfinite(got).all()
    # a whole forward pass in bfloat16 either way: the same model, not the same bits
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    clone = pickle.loads(pickle.dumps(lm))  # the class is found by its module-level name
    assert uses_bf16_matmul_via_float32(clone)
    with torch.inference_mode():
        torch.testing.assert_close(clone(input_ids=ids).logits.float(), got, rtol=0, atol=0)


def test_the_batch_estimate_counts_float32_products():
    lm = make_tiny_llama().to(torch.bfloat16)
    before = _activation_bytes(decoder_layout(lm))
    bf16_matmul_via_float32(lm)
    after = _activation_bytes(decoder_layout(lm))
    assert after[0] == 2 * before[0] - 4 * lm.config.hidden_size  # 4 bytes, not 2, a value


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "32"])
def test_min_rows_is_checked(bad):
    with pytest.raises(ValueError, match="min_rows"):
        bf16_matmul_via_float32(torch.nn.Linear(2, 2), min_rows=bad)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        bf16_matmul_via_float32("model")


@pytest.mark.parametrize("native", [False, True])
def test_load_model_uses_it_for_bfloat16_on_a_cpu_without_bf16_units(tmp_path, monkeypatch,
                                                                     native):
    folder = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    monkeypatch.setattr(_models, "cpu_has_bf16", lambda: native)
    clear_model_cache()
    try:
        lm, _ = load_model(folder, dtype="bfloat16")
        assert uses_bf16_matmul_via_float32(lm) is (not native)
        lm32, _ = load_model(folder, dtype="float32")
        assert not uses_bf16_matmul_via_float32(lm32)
    finally:
        clear_model_cache()
