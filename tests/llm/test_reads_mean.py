"""``read="mean"``: turn vectors averaged over each turn's line, checked against a reference."""

import numpy as np
import pytest
import torch
from sklearn.base import clone

from skafa.attributor import FailureAttributor
from skafa.llm import (
    PromptTemplate,
    TurnActivationTransformer,
    decoder_layout,
    extract_activations,
    register_model,
    shared_memory_cache,
    unregister_model,
)
from skafa.testing import (
    make_conversations,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    shared_memory_cache().clear()
    yield
    shared_memory_cache().clear()


@pytest.fixture
def tiny(request):
    factory = {"llama": make_tiny_llama, "qwen2": make_tiny_qwen2}[request.param]
    model, tok = factory(n_layers=2, seed=7), make_tiny_tokenizer()
    name = f"test-read-mean-{request.param}"
    register_model(name, model, tok)
    yield name, model, tok
    unregister_model(name)


def test_start_positions_cover_each_turn_line():
    tok = make_tiny_tokenizer()
    for conv in make_conversations(6, min_turns=1, max_turns=7, seed=11):
        enc = PromptTemplate().encode(conv, tok)
        starts, ends = enc.turn_start_positions, enc.turn_positions
        assert starts.dtype == np.int64 and starts.shape == ends.shape
        assert np.all(starts <= ends)
        # Spans never reach back into the previous turn.
        assert np.all(starts[1:] > ends[:-1])
        for i, (s, (line_start, _)) in enumerate(zip(starts, enc.turn_char_spans)):
            tok_start, tok_end = enc.offsets[s]
            # The first token holds the line's first character (or starts after it).
            assert tok_end > line_start, (i, tok_start, tok_end, line_start)
            if s > 0 and s - 1 != (ends[i - 1] if i else -1):
                assert enc.offsets[s - 1][1] <= line_start
            line = enc.text[enc.turn_char_spans[i][0]:enc.turn_char_spans[i][1]]
            assert line.startswith(f"{i} - {conv.turns[i].speaker}:")


@pytest.mark.parametrize("tiny", ["llama", "qwen2"], indirect=True)
def test_mean_read_matches_reference(tiny):
    name, model, tok = tiny
    convs = make_conversations(3, min_turns=2, max_turns=5, seed=3)
    t = TurnActivationTransformer(name, read="mean", memory_cache=False).fit(convs)
    X = t.transform(convs)
    last = TurnActivationTransformer(name, memory_cache=False).fit_transform(convs)
    layout = decoder_layout(model)
    for i, conv in enumerate(convs):
        enc = t.prompt_.encode(conv, tok)
        with torch.no_grad():
            hs = layout.decoder(torch.as_tensor(enc.input_ids)[None],
                                output_hidden_states=True, use_cache=False).hidden_states
        for j, site in enumerate(t.sites_):
            if not site.startswith("resid_pre"):
                continue
            h = hs[int(site.split(".")[1])][0].numpy()
            ref = np.stack([h[s:e + 1].mean(axis=0) for s, e in
                            zip(enc.turn_start_positions, enc.turn_positions)])
            np.testing.assert_allclose(X[i][:, j], ref, rtol=1e-5, atol=1e-5,
                                       err_msg=f"conversation {i} {site}")
        # The test can fail: a mean over several tokens is not the last token.
        multi = enc.turn_positions > enc.turn_start_positions
        assert multi.any()
        assert not np.allclose(X[i][multi], last[i][multi], atol=1e-3)


def test_mean_over_one_token_equals_plain_read_and_batches_agree():
    model = make_tiny_llama(n_layers=2, seed=4)
    rng = np.random.default_rng(0)
    lengths = (5, 40, 17, 1)
    ids = [rng.integers(7, 600, size=n) for n in lengths]
    pos = [np.array([0, n - 1]) if n > 1 else np.array([0]) for n in lengths]
    sites = ["resid_final", "resid_pre.0", "mlp_in.1"]
    plain = extract_activations(model, ids, pos, sites)
    same = extract_activations(model, ids, pos, sites, starts=pos)
    for a, b in zip(plain, same):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # Overlapping spans, padded batches: equal to one sequence at a time.
    starts = [np.zeros_like(p) for p in pos]
    one = extract_activations(model, ids, pos, sites, starts=starts)
    batched = extract_activations(model, ids, pos, sites, starts=starts, batch_size=3)
    for a, b, p in zip(one, batched, pos):
        assert a.shape == (len(p), 3, 32)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # A span from 0 to the end is the mean of the plain reads at every position.
    every = extract_activations(model, [ids[0]], [np.arange(5)], sites)[0]
    np.testing.assert_allclose(one[0][1], every.mean(axis=0), rtol=1e-5, atol=1e-5)


def test_bad_starts_and_read_are_refused():
    model = make_tiny_llama(n_layers=1, seed=0)
    ids = [np.arange(7, 17)]
    with pytest.raises(ValueError, match="sequence 0: starts"):
        extract_activations(model, ids, [np.array([3, 5])], ["resid_final"],
                            starts=[np.array([4, 5])])
    with pytest.raises(ValueError, match="sequence 0: starts"):
        extract_activations(model, ids, [np.array([3, 5])], ["resid_final"],
                            starts=[np.array([1])])
    with pytest.raises(ValueError, match="'read' parameter.*among"):
        TurnActivationTransformer("x", read="first").fit(make_conversations(1))


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_read_is_part_of_the_cache_key(tiny, tmp_path):
    name, _, _ = tiny
    convs = make_conversations(2, seed=1)
    last = TurnActivationTransformer(name, cache_dir=tmp_path).fit(convs)
    a = last.transform(convs)
    mean = TurnActivationTransformer(name, read="mean", cache_dir=tmp_path).fit(convs)
    b = mean.transform(convs)
    assert mean.run_stats["n_forward_passes"] == 2  # no reuse of the "last" entries
    assert not np.allclose(a.values, b.values)
    again = clone(mean).fit(convs)
    np.testing.assert_array_equal(again.transform(convs).values, b.values)
    assert again.run_stats["n_forward_passes"] == 0
    # "last" keeps the key it had before the option existed.
    from skafa.llm import activation_key
    base = dict(model_identity="m", model_fingerprint={}, dtype="float32",
                prompt_fingerprint="p", chat_template_kwargs=None, conversation=convs[0])
    assert activation_key(**base) == activation_key(**base, read="last")
    assert activation_key(**base) != activation_key(**base, read="mean")


def test_failure_attributor_forwards_read():
    fa = FailureAttributor(TurnActivationTransformer("smollm2", read="mean"))
    assert fa.get_params()["extractor__read"] == "mean"
    assert fa._make_pipeline().named_steps["acts"].read == "mean"
