"""Tests for skafa.llm._cache: keys, memory LRU, atomic and checked disk entries."""

import atexit
import glob
import json
import multiprocessing
import os
import shutil
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skafa.conversation import Conversation, Turn
from skafa.exceptions import CacheCorruptionWarning
from skafa.llm import ActivationCache, MemoryLRU, activation_key, shared_memory_cache
from skafa.utils.fileio import DIGEST_KEY, read_safetensors, write_safetensors

SITES = ("resid_pre.0", "mlp_in.0", "resid_pre.1", "mlp_in.1", "resid_final")


def _conv(**kw):
    base = dict(turns=[Turn("a", "hello"), Turn("b", "world", role="user")], task="t",
                expected_answer="42", task_id="task-1", mistake_step=1, mistake_agent="b",
                record_id="r1", metadata={"x": 1})
    base.update(kw)
    return Conversation(**base)


def _key(conv=None, **kw):
    args = dict(model_identity="m", model_fingerprint={"arch": "llama", "n_layers": 2},
                dtype="float32", prompt_fingerprint="p", chat_template_kwargs=None,
                conversation=conv if conv is not None else _conv())
    args.update(kw)
    return activation_key(**args)


def _values(n_turns=3, n_sites=len(SITES), d=4, seed=0):
    return np.random.default_rng(seed).standard_normal((n_turns, n_sites, d)).astype(np.float32)


def test_key_depends_on_content_not_labels():
    k = _key()
    assert len(k) == 64 and k == _key()
    # Labels, ids and metadata do not change the activations.
    assert _key(_conv(mistake_step=0, mistake_agent="a", task_id="other", record_id="r2",
                      metadata={"y": 2})) == k
    # Content does.
    assert _key(_conv(task="t2")) != k
    assert _key(_conv(expected_answer="43")) != k
    assert _key(_conv(turns=[Turn("a", "hello"), Turn("c", "world", role="user")])) != k
    assert _key(_conv(turns=[Turn("a", "hello"), Turn("b", "world!", role="user")])) != k
    # So do model, architecture, dtype, prompt and template arguments; the device does not.
    assert _key(model_identity="m2") != k
    assert _key(model_fingerprint={"arch": "llama", "n_layers": 3}) != k
    assert _key(model_fingerprint={"arch": "llama", "n_layers": 2, "device": "cuda"}) == k
    assert _key(dtype="bfloat16") != k
    assert _key(prompt_fingerprint="q") != k
    assert _key(chat_template_kwargs={"date_string": "01 Jan 2024"}) != k
    assert _key(chat_template_kwargs={}) == k


def test_memory_lru_is_bounded_by_bytes():
    one = _values()  # 3*5*4*4 = 240 bytes
    lru = MemoryLRU(max_bytes=3 * one.nbytes)
    for i in range(4):
        lru.put_entry(f"k{i}", SITES, one + i)
    assert len(lru) == 3 and lru.nbytes == 3 * one.nbytes
    assert lru.get_entry("k0") is None  # least recently used went first
    lru.get_entry("k1")  # touch: k2 is now the oldest
    lru.put_entry("k4", SITES, one)
    assert lru.get_entry("k2") is None and lru.get_entry("k1") is not None
    sites, vals = lru.get_entry("k3")
    assert sites == SITES and not vals.flags.writeable
    np.testing.assert_array_equal(vals, one + 3)
    # Larger than the bound: not stored; zero bound disables.
    lru.put_entry("big", SITES, np.zeros((100, 5, 4), np.float32))
    assert "big" not in lru and lru.nbytes <= lru.max_bytes
    off = MemoryLRU(0)
    off.put_entry("k", SITES, one)
    assert len(off) == 0
    lru.clear()
    assert len(lru) == 0 and lru.nbytes == 0


def test_memory_entry_is_a_copy():
    lru = MemoryLRU(1 << 20)
    vals = _values()
    lru.put_entry("k", SITES, vals)
    vals[:] = 0
    assert np.abs(lru.get_entry("k")[1]).sum() > 0


def test_shared_memory_cache_is_a_singleton():
    assert shared_memory_cache() is shared_memory_cache()
    assert ActivationCache().memory is shared_memory_cache()
    assert ActivationCache(memory=False).memory is None


def test_disk_roundtrip_subset_and_counters(tmp_path):
    vals = _values()
    cache = ActivationCache(tmp_path, memory=False)
    key = _key()
    assert cache.get(key, SITES, n_turns=3, hidden_size=4) is None
    cache.put(key, SITES, vals)
    path = cache.path(key)
    assert os.path.exists(path) and path.startswith(str(tmp_path))
    np.testing.assert_array_equal(cache.get(key, SITES, n_turns=3, hidden_size=4), vals)
    sub = cache.get(key, ["resid_final", "mlp_in.0"], n_turns=3, hidden_size=4)
    np.testing.assert_array_equal(sub, vals[:, [4, 1]])
    # A fresh cache object on the same folder (another process would do the same).
    again = ActivationCache(tmp_path, memory=False)
    np.testing.assert_array_equal(again.get(key, ["resid_pre.1"], n_turns=3, hidden_size=4),
                                  vals[:, [2]])
    assert cache.stats == {"memory_hits": 0, "disk_hits": 2, "misses": 1, "corrupt": 0,
                           "unsigned": 0, "writes": 1}
    # No temporary files left behind.
    assert glob.glob(os.path.join(tmp_path, "**", ".tmp-*"), recursive=True) == []


def test_missing_site_is_a_miss_and_put_merges(tmp_path):
    vals = _values()
    cache = ActivationCache(tmp_path, memory=MemoryLRU(1 << 20))
    key = _key()
    cache.put(key, SITES[:2], vals[:, :2])
    assert cache.get(key, ["resid_final"], n_turns=3, hidden_size=4) is None
    assert cache.get(key, ["mlp_in.0"], n_turns=3, hidden_size=4) is not None
    # Writing other sites keeps the earlier ones (memory and disk).
    cache.put(key, ("resid_final", "resid_pre.1"), vals[:, [4, 2]])
    for c in (cache, ActivationCache(tmp_path, memory=False)):
        got = c.get(key, SITES[:3] + ("resid_final",), n_turns=3, hidden_size=4)
        np.testing.assert_array_equal(got, vals[:, [0, 1, 2, 4]])
    # Stored in depth order.
    assert cache.memory.get_entry(key)[0] == ("resid_pre.0", "mlp_in.0", "resid_pre.1",
                                              "resid_final")


def test_memory_layer_hit_does_not_touch_disk(tmp_path):
    cache = ActivationCache(tmp_path, memory=MemoryLRU(1 << 20))
    key = _key()
    cache.put(key, SITES, _values())
    os.remove(cache.path(key))
    assert cache.get(key, SITES, n_turns=3, hidden_size=4) is not None
    assert cache.stats["memory_hits"] == 1


def _corrupt_truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)


def _corrupt_garbage(path):
    with open(path, "wb") as f:
        f.write(b"\x00\x01garbage" * 10)


def _corrupt_flip_data(path):
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


def _corrupt_empty(path):
    open(path, "wb").close()


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_garbage, _corrupt_flip_data,
                                     _corrupt_empty])
def test_corrupt_entry_is_detected_warned_and_replaced(tmp_path, corrupt):
    cache = ActivationCache(tmp_path, memory=False)
    key = _key()
    vals = _values()
    cache.put(key, SITES, vals)
    corrupt(cache.path(key))
    with pytest.warns(CacheCorruptionWarning, match=key):
        assert cache.get(key, SITES, n_turns=3, hidden_size=4) is None
    assert cache.stats["corrupt"] == 1 and cache.stats["misses"] == 1
    cache.put(key, SITES, vals)  # recomputed values overwrite the bad file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(cache.get(key, SITES, n_turns=3, hidden_size=4), vals)


def test_shape_mismatch_is_corrupt(tmp_path):
    cache = ActivationCache(tmp_path, memory=False)
    key = _key()
    cache.put(key, SITES, _values())
    with pytest.warns(CacheCorruptionWarning, match="shape"):
        assert cache.get(key, SITES, n_turns=4, hidden_size=4) is None
    with pytest.warns(CacheCorruptionWarning, match="shape"):
        assert cache.get(key, SITES, n_turns=3, hidden_size=8) is None


def test_entry_under_wrong_name_is_corrupt(tmp_path):
    cache = ActivationCache(tmp_path, memory=False)
    k1, k2 = _key(), _key(dtype="float16")
    cache.put(k1, SITES, _values())
    os.makedirs(os.path.dirname(cache.path(k2)), exist_ok=True)
    os.replace(cache.path(k1), cache.path(k2))
    with pytest.warns(CacheCorruptionWarning, match="key"):
        assert cache.get(k2, SITES, n_turns=3, hidden_size=4) is None


def test_put_rejects_bad_shape(tmp_path):
    cache = ActivationCache(tmp_path, memory=False)
    with pytest.raises(ValueError, match="shape"):
        cache.put(_key(), SITES, np.zeros((3, 2, 4), np.float32))


def _hammer(directory, key, seed, n):
    cache = ActivationCache(directory, memory=False)
    for _ in range(n):
        cache.put(key, SITES, _values(seed=seed))


def test_concurrent_writers_never_leave_a_corrupt_entry(tmp_path):
    key = _key()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), key, s, 40)) for s in (1, 2)]
    for p in procs:
        p.start()
    reader = ActivationCache(tmp_path, memory=False)
    seen = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any corruption warning fails the test
        while any(p.is_alive() for p in procs):
            got = reader.get(key, SITES, n_turns=3, hidden_size=4)
            if got is not None:
                seen += 1
                assert any(np.array_equal(got, _values(seed=s)) for s in (1, 2))
    for p in procs:
        p.join()
        assert p.exitcode == 0
    got = reader.get(key, SITES, n_turns=3, hidden_size=4)
    assert any(np.array_equal(got, _values(seed=s)) for s in (1, 2))
    assert glob.glob(os.path.join(tmp_path, "**", ".tmp-*"), recursive=True) == []


def test_failed_disk_write_warns_and_continues(tmp_path, monkeypatch):
    import skafa.llm._cache as cache_mod

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod, "_write_entry", boom)
    cache = ActivationCache(tmp_path, memory=MemoryLRU(1 << 20))
    with pytest.warns(RuntimeWarning, match="No space left"):
        cache.put(_key(), SITES, _values())
    assert cache.stats["writes"] == 0
    assert cache.get(_key(), SITES, n_turns=3, hidden_size=4) is not None  # memory still works


def test_claims_are_exclusive_and_released(tmp_path):
    a, b = ActivationCache(tmp_path, memory=False), ActivationCache(tmp_path, memory=False)
    key = "c" * 64
    assert a.claim(key)
    assert not b.claim(key) and not a.claim(key)        # one holder at a time
    claim = Path(a.path(key) + ".claim")
    assert json.loads(claim.read_text())["pid"] == os.getpid()
    a.release(key)
    assert not claim.exists() and b.claim(key)
    b.release(key)
    b.release(key)                                      # releasing twice is harmless
    assert ActivationCache(None, memory=False).claim(key)  # nobody to share with
    assert a.stat(key) is None
    a.put(key, ["resid_final"], np.zeros((1, 1, 2), np.float32))
    first = a.stat(key)
    assert first is not None
    a.put(key, ["resid_pre.0"], np.ones((1, 1, 2), np.float32))  # rewritten: a new file
    assert a.stat(key) != first


# ------------------------------------------- tampered entries (digest, nesting)
# One site list for the tampering and the fuzzing below.
CACHE_SITES = ("resid_pre.0", "resid_pre.1", "resid_final")


def _cache_entry(tmp_path):
    from skafa.llm import ActivationCache

    cache = ActivationCache(tmp_path, memory=False)
    key = "ab" * 32
    values = np.arange(3 * len(CACHE_SITES) * 4,
                       dtype=np.float32).reshape(3, len(CACHE_SITES), 4)
    cache.put(key, CACHE_SITES, values)
    return cache, key, values


def _rewrite(path, edit):
    """Apply ``edit(tensors, metadata)`` and write the file back *with a fresh digest*.

    A digest is no signature: whoever edits a file can recompute it, so structure
    checks must catch what the digest cannot.
    """
    tensors, meta = read_safetensors(path)
    tensors = {k: np.array(v) for k, v in tensors.items()}
    meta = {k: v for k, v in meta.items() if k != DIGEST_KEY}
    edit(tensors, meta)
    write_safetensors(path, tensors, meta)


def test_cache_entry_with_reversed_site_names_is_corrupt(tmp_path):
    from skafa.exceptions import CacheCorruptionWarning
    from skafa.llm._cache import _crc

    cache, key, values = _cache_entry(tmp_path)
    path = cache.path(key)
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = header["__metadata__"]
    assert json.loads(meta["sites"]) == list(CACHE_SITES)
    meta["sites"] = json.dumps(list(CACHE_SITES[::-1]))  # same length, CRC unchanged
    assert meta["crc32"] == _crc(values)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    open(path, "wb").write(raw[:8] + new + raw[8 + n:])
    with pytest.warns(CacheCorruptionWarning, match="digest"):
        assert cache.get(key, CACHE_SITES, n_turns=3, hidden_size=4) is None


def test_cache_entry_without_digest_is_a_miss(tmp_path):
    from safetensors.numpy import save_file

    from skafa.exceptions import CacheCorruptionWarning

    cache, key, values = _cache_entry(tmp_path)
    tensors, meta = read_safetensors(cache.path(key))
    meta.pop(DIGEST_KEY)
    save_file({k: np.array(v) for k, v in tensors.items()}, cache.path(key), metadata=meta)
    with pytest.warns(CacheCorruptionWarning, match="digest"):
        assert cache.get(key, CACHE_SITES, n_turns=3, hidden_size=4) is None


def test_deeply_nested_cache_header_is_a_value_error(tmp_path):
    from skafa.llm._cache import _read_entry

    cache, key, values = _cache_entry(tmp_path)
    _rewrite(cache.path(key), lambda t, m: m.__setitem__("sites", "[" * 100_000))
    with pytest.raises(ValueError, match="nested"):
        _read_entry(cache.path(key), key, n_turns=3, hidden_size=4)


# -------------------------------------------------------- fuzzing cache entries
# Random byte flips and truncations of an entry must give identical data or a
# ``CacheCorruptionWarning`` and a miss, never crash the process and never allocate
# far more than the file size (``tracemalloc`` peak).
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


#: Allocation bound of one read: a multiple of the file size plus a constant for
#: Python objects (the decoded header, small arrays). Measured traced peaks: about
#: 6x for these 1.2-1.7 KB files (the constant dominates), 2.0x for a 1.3 MB dense
#: and 2.1x for a 5.2 MB sparse file (the file's bytes, then the arrays).
PEAK_FACTOR, PEAK_SLACK = 8, 256 * 1024


_TMP = tempfile.mkdtemp(prefix="skafa-fuzz-")
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


def _measured(fn):
    """Run ``fn()``; return (result or exception, peak bytes traced)."""
    tracemalloc.start()
    try:
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - classified by the caller
            out = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


def _position(blob, data, label):
    """A byte position, in the header or in the tensor data with equal odds.

    (hypothesis favours small integers, which would almost always hit the header.)
    """
    n = 8 + int.from_bytes(blob[:8], "little")
    if data.draw(st.booleans(), label=f"{label} in data"):
        return n + data.draw(st.integers(0, len(blob) - n - 1), label=label)
    return data.draw(st.integers(0, n - 1), label=label)


def _mutate(blob, data):
    """Flip 1-4 random bytes, or truncate, as chosen by hypothesis."""
    raw = bytearray(blob)
    if data.draw(st.booleans(), label="truncate"):
        return bytes(raw[:_position(blob, data, "cut")])
    for _ in range(data.draw(st.integers(1, 4), label="n_flips")):
        raw[_position(blob, data, "at")] ^= data.draw(st.integers(1, 255), label="mask")
    return bytes(raw)


CACHE_KEY = "c0" * 32
CACHE_VALUES = np.random.default_rng(2).normal(size=(5, 3, 8)).astype(np.float32)
_CACHE_DIR = os.path.join(_TMP, "cache")
ActivationCache(_CACHE_DIR, memory=False).put(CACHE_KEY, CACHE_SITES, CACHE_VALUES)
_CACHE_PATH = ActivationCache(_CACHE_DIR, memory=False).path(CACHE_KEY)
with open(_CACHE_PATH, "rb") as _f:
    CACHE_BLOB = _f.read()


@FUZZ
@given(data=st.data())
def test_cache_entry_flips_and_truncations(data):
    blob = _mutate(CACHE_BLOB, data)
    with open(_CACHE_PATH, "wb") as f:
        f.write(blob)
    cache = ActivationCache(_CACHE_DIR, memory=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, peak = _measured(lambda: cache.get(CACHE_KEY, CACHE_SITES, n_turns=5,
                                                hidden_size=8))
    assert not isinstance(out, Exception), f"{type(out).__name__}: {out}"
    if out is None:  # a miss, reported
        assert cache.stats["corrupt"] == 1
        assert any(issubclass(w.category, CacheCorruptionWarning) for w in caught)
    else:
        np.testing.assert_array_equal(out, CACHE_VALUES)
    assert peak <= PEAK_FACTOR * len(CACHE_BLOB) + PEAK_SLACK, peak


def test_cache_fuzz_leaves_a_working_cache():
    with open(_CACHE_PATH, "wb") as f:
        f.write(CACHE_BLOB)
    out = ActivationCache(_CACHE_DIR, memory=False).get(CACHE_KEY, CACHE_SITES, n_turns=5,
                                                        hidden_size=8)
    np.testing.assert_array_equal(out, CACHE_VALUES)


def test_activation_keys_are_pinned():
    """A key that changes silently throws away every cache written before (hours of
    extraction for a large reader): these values were computed on 2026-12-05 and
    must only change with a deliberate format bump."""
    from skafa import Conversation
    from skafa.llm._cache import activation_key

    conv = Conversation.from_dict({"task": "t", "expected_answer": "a", "turns": [
        {"speaker": "alice", "content": "hi"}, {"speaker": "bob", "content": "ok"}]})
    kw = dict(model_identity={"kind": "file", "sha256": "ab" * 32},
              model_fingerprint={"arch": "LlamaForCausalLM", "n_layers": 2},
              dtype="float32", prompt_fingerprint="p" * 16, chat_template_kwargs=None,
              conversation=conv, tokenizer_fingerprint="tok", template_date=None)
    assert activation_key(read="last", **kw) == (
        "3e0a136b5e75d6b2f0ca7b66bfde84647660028a6cbf3aff90a3c1c4614ea621")
    assert activation_key(read="echo", **kw) == (
        "4cb8d881a5a92c131c942a077bfec8acec5f5a36086ff979330e657c11b1452f")
    assert activation_key(read="last", site_kind="head_attn", **kw) == (
        "889c4a28a08b42c2f047d76379ac9b3f419905afa3e4449ea30b031ea3877188")
