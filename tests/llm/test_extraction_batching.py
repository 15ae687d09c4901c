"""The GPU-oriented paths, tested on CPU: bf16/fp16 compute, batch_size="auto",
splitting a batch that runs out of memory, resuming an interrupted transform."""

import numpy as np
import pytest
import torch

from skafa.llm import (
    ActivationCache,
    TurnActivationTransformer,
    extract_activations,
    shared_memory_cache,
)
from skafa.llm import _batching as batching
from skafa.llm import _extraction as extraction
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

#: Documented tolerance of bfloat16 compute against float32, per site: the relative
#: L2 error of every turn vector (docs/user-guide.md, "Devices, dtypes and batches").
BF16_RTOL = 0.02
FP16_RTOL = 0.005


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-batching")
    make_tiny_llama(n_layers=3, seed=5).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    shared_memory_cache().clear()
    yield
    shared_memory_cache().clear()


def _relative_errors(a, b):
    """Relative L2 error of every (turn, site) vector of ``a`` against ``b``."""
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("dtype, rtol", [("bfloat16", BF16_RTOL), (torch.float16, FP16_RTOL)])
def test_half_precision_on_cpu_is_close_to_float32_at_every_site(model_dir, dtype, rtol):
    convs = make_conversations(6, min_turns=2, max_turns=5, seed=1)
    ref = TurnActivationTransformer(model_dir, memory_cache=False).fit_transform(convs)
    t = TurnActivationTransformer(model_dir, dtype=dtype, memory_cache=False, batch_size=3)
    got = t.fit_transform(convs)
    assert t.model_fingerprint_["dtype"] == str(dtype).replace("torch.", "")
    assert got.values.dtype == np.float32 and got.values.shape == ref.values.shape
    err = _relative_errors(got.values, ref.values)  # (n_turns, n_sites)
    assert err.max() < rtol, dict(zip(t.sites_, err.max(axis=0).round(4)))
    assert err.max() > 1e-5  # really computed in half precision (the test can fail)


def test_dtype_spellings_share_cache_entries(model_dir):
    convs = make_conversations(2)
    a = TurnActivationTransformer(model_dir, dtype="bfloat16").fit(convs)
    b = TurnActivationTransformer(model_dir, dtype=torch.bfloat16).fit(convs)
    assert a._key(convs[0]) == b._key(convs[0])
    c = TurnActivationTransformer(model_dir).fit(convs)
    assert c._key(convs[0]) != a._key(convs[0])
    with pytest.raises(ValueError, match="dtype must be one of"):
        TurnActivationTransformer(model_dir, dtype="int8").fit(convs)


def test_auto_batches_follow_free_memory(model_dir, monkeypatch):
    convs = make_conversations(9, min_turns=1, max_turns=6, seed=2)
    one = TurnActivationTransformer(model_dir, memory_cache=False).fit_transform(convs)
    monkeypatch.setattr(batching, "_free_memory", lambda device: 8 * 2**30)
    big = TurnActivationTransformer(model_dir, memory_cache=False, batch_size="auto").fit(convs)
    np.testing.assert_allclose(big.transform(convs).values, one.values, rtol=1e-5, atol=1e-5)
    assert big.run_stats["n_forward_passes"] == 1  # 8 GiB holds every tiny conversation at once
    # With room for about two sequences, long ones run alone and short ones share.
    model = big._model
    layout = extraction.decoder_layout(model)
    per_token, per_pair = batching._activation_bytes(layout)
    lengths = [len(big.prompt_.encode(c, big._tokenizer).input_ids) for c in convs]
    w = max(lengths)
    monkeypatch.setattr(batching, "_free_memory",
                        lambda device: 2.2 * (w * per_token + w * w * per_pair) / 0.8)
    small = TurnActivationTransformer(model_dir, memory_cache=False, batch_size="auto").fit(convs)
    np.testing.assert_allclose(small.transform(convs).values, one.values, rtol=1e-5, atol=1e-5)
    assert 1 < small.run_stats["n_forward_passes"] < len(convs)


def test_auto_batch_size_refuses_a_conversation_that_alone_does_not_fit(model_dir, monkeypatch):
    convs = make_conversations(3, seed=3)
    monkeypatch.setattr(batching, "_free_memory", lambda device: 1000)
    t = TurnActivationTransformer(model_dir, memory_cache=False, batch_size="auto").fit(convs)
    with pytest.raises(MemoryError, match=r"conversation \d \(task 'task-\d'.*tokens\) needs "
                                          r"about .* GiB"):
        t.transform(convs)
    with pytest.raises(ValueError, match="batch_size.*an int in the range.*or a str among .'auto'."):
        TurnActivationTransformer(model_dir, batch_size="big").fit(convs)


def test_out_of_memory_batch_is_split_and_retried(monkeypatch):
    model = make_tiny_llama(n_layers=2, seed=4)
    rng = np.random.default_rng(0)
    ids = [rng.integers(7, 600, size=n) for n in (5, 30, 17, 30, 2)]
    pos = [np.array([0, n - 1]) for n in (5, 30, 17, 30, 2)]
    sites = ["resid_pre.1", "resid_final"]
    ref = extract_activations(model, ids, pos, sites)
    monkeypatch.setattr(batching, "_free_memory", lambda device: 8 * 2**30)
    run = extraction.SiteReader.run
    sizes = []

    def run_or_oom(self, input_ids, *args, **kwargs):
        sizes.append(int(input_ids.shape[0]))
        if input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(extraction.SiteReader, "run", run_or_oom)
    got, n_passes = extraction._extract(model, ids, pos, sites, batch_size="auto")
    assert sizes == [5, 2, 3, 1, 2] and n_passes == 3  # 5 -> 2 + 3 -> 2 + (1 + 2)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # One sequence that still runs out of memory: a clear error.

    def always_oom(self, input_ids, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(extraction.SiteReader, "run", always_oom)
    with pytest.raises(MemoryError, match="alone ran out of memory"):
        extract_activations(model, ids[:2], pos[:2], sites, batch_size="auto")
    # Without "auto", an out-of-memory error is not hidden.
    with pytest.raises(torch.OutOfMemoryError):
        extract_activations(model, ids[:2], pos[:2], sites, batch_size=2)


def test_interrupted_transform_resumes_from_the_disk_cache(model_dir, tmp_path, monkeypatch):
    """Ctrl-C mid-transform keeps every finished conversation; the rerun skips them."""
    convs = make_conversations(6, seed=6)
    ref = TurnActivationTransformer(model_dir, memory_cache=False).fit_transform(convs)
    cache_dir = str(tmp_path / "cache")
    put = ActivationCache.put
    calls = []

    def put_then_interrupt(self, *args, **kwargs):
        put(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C after two conversations

    monkeypatch.setattr(ActivationCache, "put", put_then_interrupt)
    t = TurnActivationTransformer(model_dir, cache_dir=cache_dir, memory_cache=False,
                                  verbose=1).fit(convs)
    with pytest.raises(KeyboardInterrupt):
        t.transform(convs)
    monkeypatch.setattr(ActivationCache, "put", put)
    again = TurnActivationTransformer(model_dir, cache_dir=cache_dir, memory_cache=False,
                                      verbose=1).fit(convs)
    X = again.transform(convs)
    assert again.run_stats["disk_hits"] == 2 and again.run_stats["n_forward_passes"] == 4
    np.testing.assert_array_equal(X.values, ref.values)


def test_estimate_cost_before_extracting(model_dir, tmp_path):
    convs = make_conversations(5, seed=7)
    t = TurnActivationTransformer(model_dir, cache_dir=str(tmp_path / "c")).fit(convs)
    t.transform(convs[:2])
    est = t.estimate_cost(convs)
    assert (est["n_conversations"], est["n_cached"], est["n_to_extract"]) == (5, 2, 3)
    n_tokens = [len(t.prompt_.encode(c, t._tokenizer).input_ids) for c in convs[2:]]
    assert est["n_tokens_to_extract"] == sum(n_tokens)
    assert est["flops_to_extract"] > 0 and est["tokens_per_s"] > 0 and est["eta_s"] > 0
    assert "3 of 5 conversations to extract" in est["summary"]
    t.transform(convs)
    assert t.estimate_cost(convs, calibrate=False)["n_to_extract"] == 0


def test_estimate_cost_times_the_calibration_at_a_workers_threads(model_dir, monkeypatch):
    """n_jobs loky workers run with cpu_count // n_jobs threads: the ETA is timed so."""
    from skafa.llm import _cost

    seen = []

    def fake(model, n_tokens, **kw):
        seen.append(torch.get_num_threads())
        return {"seconds": np.ones(len(n_tokens)), "per_flop": (1.0, 1.0),
                "passes": [{"n_tokens": 512, "seconds": 1.0, "tokens_per_s": 512.0,
                            "flops_per_s": 1.0}]}

    monkeypatch.setattr(_cost, "calibrate_seconds", fake)
    import joblib

    monkeypatch.setattr(joblib, "cpu_count", lambda *a, **k: 4)
    convs = make_conversations(4, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for n_jobs, threads, workers in ((1, 3, 1), (2, 2, 2), (4, 1, 4)):
            est = TurnActivationTransformer(model_dir, n_jobs=n_jobs).fit(convs).estimate_cost(
                convs)
            assert seen[-1] == threads and torch.get_num_threads() == 3  # restored
            assert est["workers"] == workers and est["eta_s"] == pytest.approx(4 / workers)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("read", ["recap", "echo"])
def test_estimate_cost_counts_the_tokens_of_the_read(model_dir, read):
    """recap and echo prompts are longer than the transcript: the estimate counts them."""
    convs = make_conversations(3, seed=8)
    last = TurnActivationTransformer(model_dir).fit(convs)
    t = TurnActivationTransformer(model_dir, read=read).fit(convs)
    est = t.estimate_cost(convs, calibrate=False)
    n_tokens = [t.prompt_.encode(c, t._tokenizer, read=read).n_tokens for c in convs]
    assert est["n_tokens_to_extract"] == sum(n_tokens)
    n_last = last.estimate_cost(convs, calibrate=False)["n_tokens_to_extract"]
    assert est["n_tokens_to_extract"] > n_last
