"""Fuzzing the file readers: ``TurnFeatures.load`` and activation cache entries.

Random byte flips and truncations of a valid file must either load identical data or
raise a clear ``ValueError`` (a ``CacheCorruptionWarning`` and a miss for the cache),
never crash the process (every case runs in this process: a segfault would kill
pytest) and never allocate far more than the file size (``tracemalloc`` peak).

Because a SHA-256 digest is no signature, a second family of cases edits the tensors
and header of a file and then *recomputes* the digest, as an attacker could: the
structure checks alone must then refuse the file or give a container that is safe to
use (``toarray`` of a sparse block must not write out of bounds).
"""

import atexit
import json
import os
import shutil
import tempfile
import tracemalloc
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skafa import TurnFeatures
from skafa.exceptions import CacheCorruptionWarning
from skafa.llm import ActivationCache
from skafa.utils.fileio import DIGEST_KEY, read_safetensors, write_safetensors

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

#: Allocation bound of one read: a multiple of the file size plus a constant for
#: Python objects (the decoded header, small arrays). Measured traced peaks: about
#: 6x for these 1.2-1.7 KB files (the constant dominates), 2.0x for a 1.3 MB dense
#: and 2.1x for a 5.2 MB sparse file (the file's bytes, then the arrays).
PEAK_FACTOR, PEAK_SLACK = 8, 256 * 1024

SIZES = [3, 1, 4, 2, 5, 1]


def _offsets():
    return np.concatenate([[0], np.cumsum(SIZES)]).astype(np.int64)


def _features():
    rng = np.random.default_rng(0)
    off = _offsets()
    n = int(off[-1])
    common = dict(speakers=[f"agent{i % 3}" for i in range(n)],
                  task_ids=["t0", None, "t1", "t0", "t2", "t3"])
    dense3 = TurnFeatures(rng.normal(size=(n, 2, 4)).astype(np.float32), off,
                          sites=["resid_pre.0", "resid_final"],
                          feature_names=[f"f{i}" for i in range(4)], **common)
    dense2 = TurnFeatures(rng.normal(size=(n, 5)), off, **common)
    sparse = TurnFeatures(sp.random(n, 7, density=0.4, format="csr", random_state=1,
                                    dtype=np.float64), off,
                          feature_names=[f"w{i}" for i in range(7)], **common)
    return {"dense3": dense3, "dense2": dense2, "sparse": sparse}


FEATURES = _features()
_TMP = tempfile.mkdtemp(prefix="skafa-fuzz-")
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
BLOBS = {}
for _name, _X in FEATURES.items():
    _path = os.path.join(_TMP, f"{_name}.safetensors")
    _X.save(_path)
    with open(_path, "rb") as _f:
        BLOBS[_name] = _f.read()
    TurnFeatures.load(_path)  # warm up imports before measuring allocations


def _write(data, name="case.safetensors"):
    path = os.path.join(_TMP, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


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


def _check_usable(X):
    """A loaded container must be safe to use: touch every value."""
    assert isinstance(X, TurnFeatures)
    for site in X.sites:
        M = X.turn_matrix(site)
        dense = M.toarray() if sp.issparse(M) else np.asarray(M)
        assert dense.shape == (X.n_turns_total, X.n_features)
    assert X.n_turns.sum() == X.n_turns_total
    if X.speakers is not None:
        assert X.speakers.shape == (X.n_turns_total,)
    if X.task_ids is not None:
        assert X.task_ids.shape == (X.n_conversations,)


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


@pytest.mark.parametrize("kind", sorted(BLOBS))
@FUZZ
@given(data=st.data())
def test_turnfeatures_flips_and_truncations(kind, data):
    blob = _mutate(BLOBS[kind], data)
    path = _write(blob)
    out, peak = _measured(lambda: TurnFeatures.load(path))
    if isinstance(out, Exception):
        assert isinstance(out, ValueError), f"{type(out).__name__}: {out}"
        assert "case.safetensors" in str(out)
    else:  # only a no-op edit can load, and then it is the same data
        assert out.equals(FEATURES[kind])
    assert peak <= PEAK_FACTOR * len(BLOBS[kind]) + PEAK_SLACK, peak


def _resigned_edit(kind, data):
    """Edit tensor bytes or a header field, then recompute the digest."""
    tensors, meta = read_safetensors(_write(BLOBS[kind], "orig.safetensors"))
    tensors = {k: np.array(v) for k, v in tensors.items()}
    meta = {k: v for k, v in meta.items() if k != DIGEST_KEY}
    if data.draw(st.booleans(), label="edit tensor"):
        name = data.draw(st.sampled_from(sorted(tensors)), label="tensor")
        raw = bytearray(tensors[name].tobytes())
        for _ in range(data.draw(st.integers(1, 3), label="n_flips")):
            i = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[i] ^= data.draw(st.integers(1, 255), label="mask")
        arr = tensors[name]
        tensors[name] = np.frombuffer(bytes(raw), dtype=arr.dtype).reshape(arr.shape).copy()
    else:
        key = data.draw(st.sampled_from(sorted(meta)), label="field")
        text = meta[key]
        choice = data.draw(st.sampled_from(["flip", "json"]), label="how")
        if choice == "flip" and text:
            chars = list(text)
            i = data.draw(st.integers(0, len(chars) - 1), label="at")
            chars[i] = data.draw(st.characters(codec="utf-8"), label="char")
            meta[key] = "".join(chars)
        else:
            value = data.draw(st.recursive(
                st.none() | st.booleans() | st.integers(-3, 20) | st.text(max_size=4),
                lambda inner: st.lists(inner, max_size=12), max_leaves=30), label="json")
            meta[key] = json.dumps(value)
    path = os.path.join(_TMP, "case.safetensors")
    write_safetensors(path, tensors, meta)
    return path


@pytest.mark.parametrize("kind", sorted(BLOBS))
@FUZZ
@given(data=st.data())
def test_turnfeatures_resigned_edits_never_crash(kind, data):
    path = _resigned_edit(kind, data)
    size = os.path.getsize(path)
    out, peak = _measured(lambda: TurnFeatures.load(path))
    if isinstance(out, Exception):
        assert isinstance(out, ValueError), f"{type(out).__name__}: {out}"
    else:
        _check_usable(out)
    assert peak <= PEAK_FACTOR * size + PEAK_SLACK, peak


# ------------------------------------------------------------------ cache entries
CACHE_SITES = ("resid_pre.0", "resid_pre.1", "resid_final")
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


def test_measured_peak_is_a_real_bound():
    """The bound is not vacuous: reading a file allocates about its size."""
    big = TurnFeatures(np.zeros((20_000, 16), np.float32), [0, 10_000, 20_000])
    path = os.path.join(_TMP, "big.safetensors")
    big.save(path)
    size = os.path.getsize(path)
    out, peak = _measured(lambda: TurnFeatures.load(path))
    assert out.equals(big)
    assert size <= peak <= 4 * size + PEAK_SLACK, (size, peak)
