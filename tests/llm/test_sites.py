"""Tests for skafa.llm._sites: names, validation, decoder layouts."""

import numpy as np
import pytest
import torch

from skafa.llm import (
    all_sites,
    decoder_layout,
    parse_site,
    parse_site_spec,
    site_depth,
    stride_sites,
    validate_sites,
)
from skafa.testing import make_tiny_gemma, make_tiny_llama, make_tiny_qwen2


def test_all_sites_depth_order():
    assert all_sites(2) == ["resid_pre.0", "mlp_in.0", "resid_pre.1", "mlp_in.1", "resid_final"]
    sites = all_sites(30)
    assert len(sites) == 61
    assert sites[0] == "resid_pre.0" and sites[-1] == "resid_final"
    assert sorted(sites, key=site_depth) == sites
    assert all_sites(np.int64(1)) == ["resid_pre.0", "mlp_in.0", "resid_final"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True, None])
def test_all_sites_rejects_bad_n_layers(bad):
    with pytest.raises(ValueError, match="n_layers"):
        all_sites(bad)


def test_stride_sites_and_spec():
    assert stride_sites(30, 3) == [f"resid_pre.{k}" for k in range(0, 30, 3)] + ["resid_final"]
    assert len(stride_sites(30, 3)) == 11 and len(stride_sites(24, 3)) == 9
    assert len(stride_sites(18, 3)) == 7
    assert stride_sites(2, 5) == ["resid_pre.0", "resid_final"]
    assert validate_sites("stride:3", 7) == tuple(stride_sites(7, 3))
    assert validate_sites("stride:1", 2) == ("resid_pre.0", "resid_pre.1", "resid_final")
    for bad in ("stride:0", "stride:x", "stride:", "stride:-1", "stride:1.5"):
        with pytest.raises(ValueError, match="stride must be an integer >= 1"):
            validate_sites(bad, 4)
    for bad in (0, -2, 1.0, True, "3"):
        with pytest.raises(ValueError, match="stride must be an int >= 1"):
            stride_sites(4, bad)


def test_parse_site_spec():
    assert parse_site_spec("all") is None and parse_site_spec(" all ") is None
    assert parse_site_spec("stride:3") == "stride:3"
    assert parse_site_spec(" resid_pre.1 ,resid_final, ") == ["resid_pre.1", "resid_final"]
    assert parse_site_spec("resid_final") == ["resid_final"]
    # with a layer count the spec is resolved exactly as validate_sites resolves it
    assert parse_site_spec("all", 3) == validate_sites(None, 3)
    assert parse_site_spec("stride:2", 5) == tuple(stride_sites(5, 2))
    assert parse_site_spec("mlp_in.0,resid_final", 2) == ("mlp_in.0", "resid_final")
    for bad in ("", " ", ",", " , "):
        with pytest.raises(ValueError, match="names no site"):
            parse_site_spec(bad)
    with pytest.raises(ValueError, match="stride must be an integer >= 1"):
        parse_site_spec("stride:0")
    with pytest.raises(ValueError, match=r"'resid_pre.9' \(layer 9 out of range 0..1\)"):
        parse_site_spec("resid_pre.9", 2)
    with pytest.raises(ValueError, match="Duplicate"):
        parse_site_spec("resid_final,resid_final", 2)
    with pytest.raises(TypeError, match="string"):
        parse_site_spec(["resid_final"])


def test_parse_site():
    assert parse_site("resid_pre.0") == ("resid_pre", 0)
    assert parse_site("mlp_in.29") == ("mlp_in", 29)
    assert parse_site("resid_final") == ("resid_final", None)
    for bad in ["resid_pre", "resid_pre.", "resid_pre.01", "mlp_in.-1", "resid_post.3",
                "RESID_PRE.1", " resid_pre.1", "resid_final.0"]:
        with pytest.raises(ValueError, match="Unknown site"):
            parse_site(bad)
    with pytest.raises(ValueError, match="string"):
        parse_site(3)


def test_validate_sites():
    assert validate_sites(None, 2) == tuple(all_sites(2))
    assert validate_sites("all", 2) == tuple(all_sites(2))
    assert validate_sites("mlp_in.1", 2) == ("mlp_in.1",)
    assert validate_sites(["resid_final", "resid_pre.0"], 2) == ("resid_final", "resid_pre.0")
    with pytest.raises(ValueError) as err:
        validate_sites(["resid_pre.0", "resid_pre.2", "foo", "mlp_in.7"], 2)
    msg = str(err.value)
    assert "'resid_pre.2'" in msg and "'foo'" in msg and "'mlp_in.7'" in msg
    assert "'resid_pre.0'" not in msg.split("Valid")[0]
    assert "out of range 0..1" in msg
    with pytest.raises(ValueError, match="Duplicate"):
        validate_sites(["resid_final", "resid_final"], 2)
    with pytest.raises(ValueError, match="empty"):
        validate_sites([], 2)
    with pytest.raises(ValueError, match="not a string"):
        validate_sites([1], 2)


@pytest.mark.parametrize("make, family, attr", [
    (make_tiny_llama, "pre-norm", "post_attention_layernorm"),
    (make_tiny_qwen2, "pre-norm", "post_attention_layernorm"),
    (make_tiny_gemma, "sandwich-norm", "pre_feedforward_layernorm"),
])
def test_decoder_layout_families(make, family, attr):
    model = make(n_layers=3)
    layout = decoder_layout(model)
    assert layout.family == family and layout.mlp_in_attribute == attr
    assert layout.n_layers == 3
    assert layout.decoder is model.model
    assert layout.final_norm is model.model.norm
    assert layout.embedding is model.model.embed_tokens
    for layer, norm in zip(model.model.layers, layout.mlp_in_norms):
        assert norm is getattr(layer, attr)
    assert layout.post_attention_norm(1) is layout.mlp_in_norms[1]
    # The base decoder itself is accepted too.
    assert decoder_layout(model.model).layers == layout.layers


@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_qwen2, make_tiny_gemma])
def test_mlp_in_norm_output_is_what_the_mlp_reads(make):
    """The module chosen for mlp_in.l produces exactly the MLP's input."""
    model = make(n_layers=2)
    layout = decoder_layout(model)
    seen = {}
    handles = []
    for i, (layer, norm) in enumerate(zip(layout.layers, layout.mlp_in_norms)):
        handles.append(norm.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(("norm", i), o)))
        handles.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(("mlp", i), a[0])))
    with torch.no_grad():
        model(torch.arange(3, 40)[None])
    for h in handles:
        h.remove()
    for i in range(2):
        assert torch.equal(seen[("norm", i)], seen[("mlp", i)])


def test_resid_pre_0_is_scaled_embedding_for_gemma():
    model = make_tiny_gemma(n_layers=1)
    layout = decoder_layout(model)
    ids = torch.arange(5, 25)[None]
    got = {}
    h = layout.layers[0].register_forward_pre_hook(
        lambda m, a, k: got.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        model(ids)
    h.remove()
    raw = model.model.embed_tokens.weight[ids]
    scale = model.config.hidden_size ** 0.5
    torch.testing.assert_close(got["x"], raw * scale, rtol=1e-6, atol=1e-6)


def test_unknown_layout_is_refused_with_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                      n_positions=32))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*'layers'"):
        decoder_layout(gpt2)


def test_post_norm_layout_is_refused_naming_attribute():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    olmo = Olmo2ForCausalLM(Olmo2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2))
    with pytest.raises(ValueError, match="Olmo2ForCausalLM.*'input_layernorm'"):
        decoder_layout(olmo)
