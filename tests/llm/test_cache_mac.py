"""Tests for the activation cache's optional keyed MAC (a cache shared between users)."""

import glob
import os
import pickle
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest

from skafa.exceptions import CacheCorruptionWarning
from skafa.llm import ActivationCache, MemoryLRU
from skafa.llm._cache import _crc
from skafa.utils.fileio import DIGEST_KEY, read_safetensors, write_safetensors

MAC_KEY = "skafa_hmac_sha256"  # the header field of the MAC (skafa.llm._cache.MAC_KEY)
SITES = ("resid_pre.0", "mlp_in.0", "resid_final")
KEY = "ab" * 32
KEY_A = b"key A: thirty-two bytes of secret"
KEY_B = b"key B: another secret, as long.."


@pytest.fixture(autouse=True)
def _no_key_in_environment(monkeypatch):
    monkeypatch.delenv("SKAFA_CACHE_KEY", raising=False)
    monkeypatch.delenv("SKAFA_CACHE_KEY_FILE", raising=False)


def _values(seed=0):
    return np.random.default_rng(seed).standard_normal((3, len(SITES), 4)).astype(np.float32)


def _get(cache, key=KEY):
    return cache.get(key, SITES, n_turns=3, hidden_size=4)


def _tamper_and_resign(path):
    """Change the values and re-sign the entry the way the format does (plain checksum).

    What anyone who can write the cache folder can do: the CRC-32 and the SHA-256
    digest are recomputed, the MAC field (if any) is left as it was.
    """
    tensors, metadata = read_safetensors(path)
    values = tensors["activations"].copy()
    values[0, 0, 0] += 100.0
    metadata.pop(DIGEST_KEY)
    metadata["crc32"] = _crc(values)
    write_safetensors(path, {"activations": values}, metadata)
    return values


def _messages(caught):
    return [str(w.message) for w in caught]


def test_tampered_and_resigned_entry_is_used_without_a_key(tmp_path):
    # the threat: the plain checksum is no signature
    cache = ActivationCache(tmp_path, memory=False)
    cache.put(KEY, SITES, _values())
    forged = _tamper_and_resign(cache.path(KEY))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(_get(ActivationCache(tmp_path, memory=False)), forged)


def test_tampered_and_resigned_entry_is_recomputed_with_a_key(tmp_path):
    cache = ActivationCache(tmp_path, memory=False, mac_key=KEY_A)
    assert cache.signed
    vals = _values()
    cache.put(KEY, SITES, vals)
    assert MAC_KEY in read_safetensors(cache.path(KEY))[1]
    _tamper_and_resign(cache.path(KEY))
    reader = ActivationCache(tmp_path, memory=False, mac_key=KEY_A)
    with pytest.warns(CacheCorruptionWarning, match=rf"{KEY}.*MAC does not match") as caught:
        assert _get(reader) is None
    assert reader.stats["unsigned"] == 1 and reader.stats["corrupt"] == 0
    assert reader.stats["misses"] == 1
    assert not any(KEY_A.decode() in m for m in _messages(caught))  # never the key
    assert not reader.contains(KEY, SITES, n_turns=3, hidden_size=4)
    reader.put(KEY, SITES, vals)  # recomputed: overwritten, signed again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(_get(ActivationCache(tmp_path, memory=False,
                                                           mac_key=KEY_A)), vals)


def test_entry_written_without_a_key_is_recomputed_with_a_key(tmp_path):
    vals = _values()
    ActivationCache(tmp_path, memory=False).put(KEY, SITES, vals)
    reader = ActivationCache(tmp_path, memory=False, mac_key=KEY_A)
    with pytest.warns(CacheCorruptionWarning, match=rf"{KEY}.*has no MAC"):
        assert _get(reader) is None
    assert reader.stats["unsigned"] == 1
    # an unsigned entry's sites are not merged into the signed one either
    reader.put(KEY, SITES[:1], vals[:, :1])
    tensors, metadata = read_safetensors(reader.path(KEY))
    assert tensors["activations"].shape == (3, 1, 4) and MAC_KEY in metadata


def test_entry_written_with_another_key_is_recomputed(tmp_path):
    ActivationCache(tmp_path, memory=False, mac_key=KEY_B).put(KEY, SITES, _values())
    reader = ActivationCache(tmp_path, memory=False, mac_key=KEY_A)
    with pytest.warns(CacheCorruptionWarning, match="MAC does not match"):
        assert _get(reader) is None
    assert reader.stats["unsigned"] == 1


def test_valid_mac_is_used(tmp_path):
    vals = _values()
    ActivationCache(tmp_path, memory=False, mac_key=KEY_A).put(KEY, SITES, vals)
    reader = ActivationCache(tmp_path, memory=False, mac_key=bytearray(KEY_A))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(_get(reader), vals)
        assert reader.contains(KEY, SITES, n_turns=3, hidden_size=4)
    assert reader.stats == {"memory_hits": 0, "disk_hits": 1, "misses": 0, "corrupt": 0,
                            "unsigned": 0, "writes": 0}
    # without a key, a signed entry reads as before (its MAC is ignored)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(_get(ActivationCache(tmp_path, memory=False)), vals)


def test_key_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SKAFA_CACHE_KEY", KEY_A.decode())
    cache = ActivationCache(tmp_path, memory=False)
    assert cache.signed
    cache.put(KEY, SITES, _values())
    _tamper_and_resign(cache.path(KEY))
    with pytest.warns(CacheCorruptionWarning, match="MAC"):
        assert _get(ActivationCache(tmp_path, memory=False)) is None
    # mac_key=False ignores the environment
    assert not ActivationCache(tmp_path, memory=False, mac_key=False).signed


def test_key_file_from_the_environment_and_its_permissions(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY_A + b"\n")  # a final newline is not part of the key
    key_file.chmod(0o600)
    monkeypatch.setenv("SKAFA_CACHE_KEY_FILE", str(key_file))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ActivationCache(tmp_path / "c", memory=False).put(KEY, SITES, _values())
        # the same key given as bytes verifies it
        assert _get(ActivationCache(tmp_path / "c", memory=False, mac_key=KEY_A)) is not None
        assert _get(ActivationCache(tmp_path / "c", memory=False, mac_key=key_file)) is not None
    key_file.chmod(0o644)
    with pytest.warns(RuntimeWarning, match=r"key.*can be read by every user") as caught:
        ActivationCache(tmp_path / "c", memory=False)
    assert not any(KEY_A.decode() in m for m in _messages(caught))
    monkeypatch.setenv("SKAFA_CACHE_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing.*does not exist"):
        ActivationCache(tmp_path, memory=False)


def test_bad_keys_are_refused_without_showing_them(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="at least 16") as info:
        ActivationCache(tmp_path, mac_key=b"short secret")
    assert "short secret" not in str(info.value)
    with pytest.raises(TypeError, match="pathlib.Path") as info:
        ActivationCache(tmp_path, mac_key=KEY_A.decode())  # a str: key or path?
    assert KEY_A.decode() not in str(info.value)
    monkeypatch.setenv("SKAFA_CACHE_KEY", KEY_A.decode())
    monkeypatch.setenv("SKAFA_CACHE_KEY_FILE", str(tmp_path / "key"))
    with pytest.raises(ValueError, match="both"):
        ActivationCache(tmp_path)
    monkeypatch.delenv("SKAFA_CACHE_KEY_FILE")
    monkeypatch.setenv("SKAFA_CACHE_KEY", "")
    with pytest.raises(ValueError, match="0 bytes"):
        ActivationCache(tmp_path)


def test_mac_field_name_is_pinned():
    from skafa.llm._cache import MAC_KEY as field

    assert field == MAC_KEY  # a rename would make every signed entry unsigned


def test_repr_and_pickle_never_show_the_key_and_workers_keep_it(tmp_path):
    cache = ActivationCache(tmp_path, memory=False, mac_key=KEY_A)
    assert KEY_A.decode() not in repr(cache) and "signed=True" in repr(cache)
    worker = pickle.loads(pickle.dumps(cache.disk_only()))  # what a joblib worker gets
    assert worker.signed and worker.memory is None
    worker.put(KEY, SITES, _values())
    assert _get(cache) is not None
    assert not ActivationCache(tmp_path, memory=False).disk_only().signed


def test_memory_layer_does_not_trust_what_a_keyless_cache_read(tmp_path):
    # one process, one shared memory layer: an entry a keyless cache read (and so
    # trusted) must not be served to a cache that requires the key
    memory = MemoryLRU(1 << 20)
    ActivationCache(tmp_path, memory=False, mac_key=KEY_A).put(KEY, SITES, _values())
    forged = _tamper_and_resign(ActivationCache(tmp_path, memory=False).path(KEY))
    np.testing.assert_array_equal(_get(ActivationCache(tmp_path, memory=memory)), forged)
    signed = ActivationCache(tmp_path, memory=memory, mac_key=KEY_A)
    with pytest.warns(CacheCorruptionWarning, match="MAC"):
        assert _get(signed) is None
    assert signed.stats["memory_hits"] == 0


def test_extractor_uses_the_key_from_the_environment(tmp_path, monkeypatch):
    from skafa.llm import TurnActivationTransformer, register_model, unregister_model
    from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

    name = "test-cache-mac-extractor"
    register_model(name, make_tiny_llama(n_layers=2, seed=31), make_tiny_tokenizer())
    try:
        convs = make_conversations(2, seed=32)
        first = TurnActivationTransformer(name, sites=["resid_final"], cache_dir=tmp_path,
                                          memory_cache=False).fit(convs).transform(convs)
        monkeypatch.setenv("SKAFA_CACHE_KEY", KEY_A.decode())
        signed = TurnActivationTransformer(name, sites=["resid_final"], cache_dir=tmp_path,
                                           memory_cache=False).fit(convs)
        with pytest.warns(CacheCorruptionWarning, match="has no MAC"):
            again = signed.transform(convs)  # unsigned entries: recomputed, signed
        assert signed.run_stats["unsigned"] == 2 and signed.run_stats["n_forward_passes"] == 2
        assert np.array_equal(first.values, again.values)
        for path in glob.glob(str(tmp_path / "*" / "*.safetensors")):
            assert MAC_KEY in read_safetensors(path)[1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            third = TurnActivationTransformer(name, sites=["resid_final"], cache_dir=tmp_path,
                                              memory_cache=False).fit(convs)
            third.transform(convs)
        assert third.run_stats["n_forward_passes"] == 0
    finally:
        unregister_model(name)


def test_key_file_is_read_as_a_regular_file_only(tmp_path):
    link = tmp_path / "key"
    os.symlink("/dev/zero", link)
    with pytest.raises(ValueError, match="key file"):
        ActivationCache(tmp_path, mac_key=Path(link))
    assert stat.S_ISLNK(os.lstat(link).st_mode)


def test_extraction_workers_sign_with_the_parent_s_key(tmp_path):
    # joblib workers open the folder themselves: they get the key with the job, not
    # from the environment (here unset)
    from joblib import parallel_backend

    from skafa.llm import TurnActivationTransformer, register_model, unregister_model
    from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

    name = "test-cache-mac-workers"
    register_model(name, make_tiny_llama(n_layers=2, seed=33), make_tiny_tokenizer())
    try:
        convs = make_conversations(4, seed=34)
        t = TurnActivationTransformer(name, sites=["resid_final"], cache_dir=tmp_path,
                                      memory_cache=False, n_jobs=2).fit(convs)
        t._cache = ActivationCache(tmp_path, memory=False, mac_key=KEY_A)
        with parallel_backend("threading", n_jobs=2):
            t.transform(convs)
        paths = glob.glob(str(tmp_path / "*" / "*.safetensors"))
        assert len(paths) == len(convs)
        assert all(MAC_KEY in read_safetensors(p)[1] for p in paths)
    finally:
        unregister_model(name)
