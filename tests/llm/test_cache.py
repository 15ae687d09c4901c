"""Tests for skafa.llm._cache: keys, memory LRU, atomic and checked disk entries."""

import glob
import json
import multiprocessing
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from skafa.conversation import Conversation, Turn
from skafa.exceptions import CacheCorruptionWarning
from skafa.llm import ActivationCache, MemoryLRU, activation_key, shared_memory_cache

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
                           "writes": 1}
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
