"""Tests for skafa.features.TurnFeatures, the ragged per-turn container."""

import pickle
import time

import joblib
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.model_selection import GroupKFold, KFold, train_test_split
from sklearn.utils import _safe_indexing, check_consistent_length, indexable

from skafa.features import TurnFeatures

SIZES = [3, 1, 4, 2, 5]


def _offsets(sizes):
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _make(sizes=SIZES, n_sites=2, n_features=3, seed=0, **kwargs):
    rng = np.random.RandomState(seed)
    off = _offsets(sizes)
    values = rng.randn(off[-1], n_sites, n_features)
    kwargs.setdefault("sites", [f"resid_pre.{i}" for i in range(n_sites)])
    kwargs.setdefault("speakers", [f"agent{i}" for i in range(off[-1])])
    kwargs.setdefault("task_ids", [f"task{i % 3}" for i in range(len(sizes))])
    return TurnFeatures(values, off, **kwargs)


# ---------------------------------------------------------------- construction
def test_basic_properties():
    X = _make(feature_names=["f0", "f1", "f2"])
    assert len(X) == X.shape[0] == X.n_conversations == 5
    assert X.shape == (5,) and X.ndim == 1
    assert X.n_turns.tolist() == SIZES and X.n_turns_total == 15
    assert X.n_sites == 2 and X.n_features == 3 and not X.is_sparse
    assert X.sites == ("resid_pre.0", "resid_pre.1")
    assert X.feature_names == ("f0", "f1", "f2")
    assert X.dtype == np.float64
    assert "n_conversations=5" in repr(X) and "resid_pre.0" in repr(X)
    assert X.turn_conversation_index().tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 4, 4, 4, 4, 4]
    assert X.turn_positions().tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]
    assert [a.shape[0] for a in X] == SIZES


def test_default_site_names():
    assert TurnFeatures(np.zeros((3, 2, 1)), [0, 3]).sites == ("site0", "site1")
    assert TurnFeatures(np.zeros((3, 4)), [0, 1, 3]).sites == ("features",)
    X = TurnFeatures(np.zeros((3, 4)), np.array([0.0, 1.0, 3.0]))  # integral floats are fine
    assert X.offsets.dtype == np.int64


@pytest.mark.parametrize(
    "values, offsets, kwargs, error, message",
    [
        (np.zeros(4), [0, 4], {}, ValueError, "must be 2-D"),
        (np.zeros((4, 1, 1, 1)), [0, 4], {}, ValueError, "must be 2-D"),
        (np.zeros((4, 2)), [[0, 4]], {}, ValueError, "1-D array"),
        (np.zeros((4, 2)), [], {}, ValueError, "1-D array"),
        (np.zeros((4, 2)), [0, 1.5, 4], {}, ValueError, "must be integers"),
        (np.zeros((4, 2)), [1, 4], {}, ValueError, r"offsets\[0\] must be 0"),
        (np.zeros((4, 2)), [0, 3], {}, ValueError, "does not match the 4 turn rows"),
        (np.zeros((4, 2)), [0, 2, 2, 4], {}, ValueError, "conversation 1 has 0 turns"),
        (np.zeros((4, 2)), [0, 3, 2, 4], {}, ValueError, "conversation 1 has -1 turns"),
        (np.zeros((4, 2, 2)), [0, 4], {"sites": ["a"]}, ValueError, "1 site names for 2"),
        (np.zeros((4, 2, 2)), [0, 4], {"sites": ["a", "a"]}, ValueError, "must be unique"),
        (np.zeros((4, 2, 2)), [0, 4], {"sites": "ab"}, TypeError, "not a single string"),
        (np.zeros((4, 2)), [0, 4], {"feature_names": ["x"]}, ValueError, "1 feature names for 2"),
        (np.zeros((4, 2)), [0, 4], {"speakers": ["a"] * 3}, ValueError, "one entry per turn"),
        (np.zeros((4, 2)), [0, 4], {"task_ids": ["a", "b"]}, ValueError,
         "one entry per conversation"),
    ],
)
def test_construction_errors(values, offsets, kwargs, error, message):
    with pytest.raises(error, match=message):
        TurnFeatures(values, offsets, **kwargs)


def test_from_arrays_dense_sparse_and_empty():
    arrays = [np.ones((2, 3)), np.zeros((1, 3))]
    X = TurnFeatures.from_arrays(arrays, feature_names=["a", "b", "c"])
    assert X.n_turns.tolist() == [2, 1] and X.feature_names == ("a", "b", "c")
    S = TurnFeatures.from_arrays([sp.csr_matrix(a) for a in arrays])
    assert S.is_sparse and S.values.shape == (3, 3)
    with pytest.raises(ValueError, match="at least one conversation"):
        TurnFeatures.from_arrays([])


def test_asarray_raises_helpful_type_error():
    X = _make()
    for convert in (np.asarray, np.array, lambda x: np.asarray(x, dtype=float)):
        with pytest.raises(TypeError, match="ragged.*PerTurn.*turn_matrix"):
            convert(X)


# -------------------------------------------------------------------- indexing
def _reference(X):
    return [X[i] for i in range(len(X))]


@pytest.mark.parametrize(
    "key, expected",
    [
        (np.array([3, 0]), [3, 0]),
        ([4, 1, 1], [4, 1, 1]),
        (np.array([True, False, True, False, True]), [0, 2, 4]),
        ([False, True, False, False, True], [1, 4]),
        (slice(1, 4), [1, 2, 3]),
        (slice(None, None, -2), [4, 2, 0]),
        ([-1, -5], [4, 0]),
        ((np.array([2, 3]), Ellipsis), [2, 3]),
        ((np.array([True] * 5), Ellipsis), [0, 1, 2, 3, 4]),
        ((slice(0, 2),), [0, 1]),
        (np.array([1, 2], dtype=np.uint8), [1, 2]),
    ],
)
def test_indexing_matches_reference(key, expected):
    X = _make()
    ref = _reference(X)
    Y = X[key]
    assert isinstance(Y, TurnFeatures)
    assert Y.n_turns.tolist() == [SIZES[i] for i in expected]
    np.testing.assert_array_equal(Y.values, np.concatenate([ref[i] for i in expected]))
    rows = np.concatenate([np.arange(X.offsets[i], X.offsets[i + 1]) for i in expected])
    assert Y.speakers.tolist() == X.speakers[rows].tolist()
    assert Y.task_ids.tolist() == [X.task_ids[i] for i in expected]
    assert Y.sites == X.sites


def test_int_indexing_returns_rows():
    X = _make()
    np.testing.assert_array_equal(X[1], X.values[3:4])
    np.testing.assert_array_equal(X[-1], X.values[10:15])
    np.testing.assert_array_equal(X[np.int64(2)], X.values[4:8])
    with pytest.raises(IndexError, match="out of range"):
        X[5]
    with pytest.raises(IndexError, match="out of range"):
        X[-6]


@pytest.mark.parametrize(
    "key, message",
    [
        ([0, 5], "out of range"),
        (np.array([-6]), "out of range"),
        (np.array([0.0, 1.0]), "dtype float64"),
        (np.array([True, False]), "boolean mask of shape"),
        ([], "zero conversations"),
        (slice(3, 3), "zero conversations"),
        (np.zeros(5, dtype=bool), "zero conversations"),
        ((np.array([0]), slice(None), 0), "X\\[index\\] and X\\[index, ...\\] only"),
        ((np.array([0]), 0), "X\\[index\\] and X\\[index, ...\\] only"),
        (True, "boolean mask"),
    ],
)
def test_indexing_errors(key, message):
    with pytest.raises(IndexError, match=message):
        _make()[key]


def test_sparse_indexing():
    rng = np.random.RandomState(0)
    values = sp.random(15, 4, density=0.4, format="csr", random_state=rng)
    X = TurnFeatures(values, _offsets(SIZES))
    Y = X[[4, 0]]
    assert Y.is_sparse
    dense = values.toarray()
    np.testing.assert_array_equal(Y.values.toarray(), np.vstack([dense[10:15], dense[0:3]]))
    np.testing.assert_array_equal(X[2].toarray(), dense[4:8])


# --------------------------------------------------------------------- sites
def test_select_sites_and_turn_matrix():
    X = _make(n_sites=3)
    one = X.select_sites("resid_pre.1")
    assert one.sites == ("resid_pre.1",) and one.values.shape == (15, 1, 3)
    np.testing.assert_array_equal(one.turn_matrix(), X.values[:, 1, :])
    two = X.select_sites([2, "resid_pre.0"])
    assert two.sites == ("resid_pre.2", "resid_pre.0")
    np.testing.assert_array_equal(two.values[:, 0], X.values[:, 2])
    assert X.select_sites(-1).sites == ("resid_pre.2",)
    assert two.speakers is not None and two.task_ids is not None
    np.testing.assert_array_equal(X.turn_matrix("resid_pre.2"), X.values[:, 2, :])
    np.testing.assert_array_equal(X.turn_matrix(0), X.values[:, 0, :])
    with pytest.raises(ValueError, match="holds 3 sites"):
        X.turn_matrix()
    with pytest.raises(KeyError, match="unknown site 'mlp_in.0'"):
        X.select_sites("mlp_in.0")
    with pytest.raises(KeyError, match="out of range"):
        X.select_sites(3)
    with pytest.raises(ValueError, match="at least one site"):
        X.select_sites([])


def test_single_block_sites():
    X = TurnFeatures(np.ones((4, 2)), [0, 4])
    assert X.select_sites("features").equals(X)
    np.testing.assert_array_equal(X.turn_matrix(), np.ones((4, 2)))
    np.testing.assert_array_equal(X.turn_matrix("features"), np.ones((4, 2)))
    with pytest.raises(KeyError, match="unknown site"):
        X.turn_matrix("resid_pre.0")


# ---------------------------------------------------------------- per-turn helpers
def test_global_turn_index_and_speakers_at():
    X = _make()
    steps = np.array([2, 0, 3, 1, 4])
    idx = X.global_turn_index(steps)
    assert idx.tolist() == [2, 3, 7, 9, 14]
    assert X.speakers_at(steps).tolist() == ["agent2", "agent3", "agent7", "agent9", "agent14"]
    with pytest.raises(ValueError,
                       match=r"steps\[1\]=1 is outside conversation 1 \(task 'task1'\)"):
        X.global_turn_index([0, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="one decisive step per conversation"):
        X.global_turn_index([0, 0])
    with pytest.raises(ValueError, match=r"steps\[0\]=-1 is negative.*conversation 0"):
        X.global_turn_index([-1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="carries no speakers"):
        TurnFeatures(np.ones((2, 1)), [0, 2]).speakers_at([0])


def test_split_rows_with_values_astype():
    X = _make()
    parts = X.split_rows(np.arange(15))
    assert [p.tolist() for p in parts[:2]] == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="expected 15 rows"):
        X.split_rows(np.arange(14))
    Y = X.with_values(np.zeros((15, 2, 4)))
    assert Y.sites == X.sites and Y.n_features == 4 and Y.feature_names is None
    assert Y.speakers.tolist() == X.speakers.tolist()
    Z = X.with_values(np.zeros((15, 7)))
    assert Z.sites == ("features",)
    with pytest.raises(ValueError, match="14 rows for 15 turns"):
        X.with_values(np.zeros((14, 2, 3)))
    assert X.astype(np.float32).dtype == np.float32


# ---------------------------------------------------------------- concatenate
def test_concatenate_broadcasts_single_block_to_every_site():
    X = _make(n_sites=2, n_features=3, feature_names=["a", "b", "c"])
    pos = TurnFeatures(np.arange(30.0).reshape(15, 2), X.offsets, feature_names=["p", "q"])
    Z = TurnFeatures.concatenate([X, pos], prefixes=["act", "pos"])
    assert Z.sites == X.sites and Z.values.shape == (15, 2, 5)
    for s in range(2):
        np.testing.assert_array_equal(Z.values[:, s, :3], X.values[:, s])
        np.testing.assert_array_equal(Z.values[:, s, 3:], pos.values)
    assert Z.feature_names == ("act__a", "act__b", "act__c", "pos__p", "pos__q")
    assert Z.speakers.tolist() == X.speakers.tolist()
    # A sparse single block is densified to broadcast.
    spos = TurnFeatures(sp.csr_matrix(pos.values), X.offsets)
    np.testing.assert_array_equal(TurnFeatures.concatenate([spos, X]).values[:, 1, :2],
                                  pos.values)


def test_concatenate_sparse_stays_sparse():
    off = _offsets(SIZES)
    a = TurnFeatures(sp.random(15, 3, density=0.5, format="csr", random_state=0), off)
    b = TurnFeatures(sp.random(15, 2, density=0.5, format="csr", random_state=1), off)
    Z = TurnFeatures.concatenate([a, b])
    assert Z.is_sparse and Z.values.shape == (15, 5)
    np.testing.assert_array_equal(Z.values.toarray(),
                                  np.hstack([a.values.toarray(), b.values.toarray()]))
    assert Z.feature_names is None


def test_concatenate_single_site_3d_keeps_site_name():
    X = _make(n_sites=1, n_features=2, sites=["resid_final"])
    Y = _make(n_sites=1, n_features=3, sites=["resid_final"], seed=1)
    Z = TurnFeatures.concatenate([X, Y])
    assert Z.sites == ("resid_final",) and Z.values.shape == (15, 1, 5)


def test_concatenate_errors():
    X = _make()
    other = _make(sizes=[2, 2, 4, 2, 5])
    with pytest.raises(ValueError, match="part 1 describes different conversations"):
        TurnFeatures.concatenate([X, other])
    with pytest.raises(ValueError, match="must share sites"):
        TurnFeatures.concatenate([X, _make(sites=["a", "b"])])
    with pytest.raises(TypeError, match="part 1 is a ndarray"):
        TurnFeatures.concatenate([X, np.zeros((15, 2))])
    with pytest.raises(TypeError, match="part 0 is a ndarray"):
        TurnFeatures.concatenate([np.zeros((15, 2)), X])
    with pytest.raises(ValueError, match="nothing to concatenate"):
        TurnFeatures.concatenate([])
    with pytest.raises(ValueError, match="1 prefixes for 2 parts"):
        TurnFeatures.concatenate([X, X.select_sites(0)], prefixes=["a"])


# ------------------------------------------------------------- pickling, saving
def test_pickle_and_joblib_hash_are_stable_and_cheap():
    X = _make()
    Y = pickle.loads(pickle.dumps(X))
    assert Y.equals(X)
    assert joblib.hash(X) == joblib.hash(Y) == joblib.hash(_make())
    assert joblib.hash(X) != joblib.hash(_make(seed=1))
    rng = np.random.RandomState(0)
    big = TurnFeatures(rng.randn(20_000, 2, 64).astype(np.float32), np.arange(0, 20_001, 10))
    start = time.perf_counter()
    joblib.hash(big)
    assert time.perf_counter() - start < 2.0  # ~10 MB: hashed as raw buffers, not per turn
    assert len(pickle.dumps(big)) < 1.1 * big.values.nbytes + 1_000_000


def test_equals():
    X = _make()
    assert X.equals(X[np.arange(5)])
    assert not X.equals(X[[1, 0, 2, 3, 4]])
    assert not X.equals(X.values)
    assert not X.equals(_make(speakers=None))
    assert not X.equals(_make(task_ids=None))


@pytest.mark.parametrize("sparse", [False, True])
def test_save_load_round_trip(tmp_path, sparse):
    if sparse:
        values = sp.random(15, 6, density=0.3, format="csr", random_state=0, dtype=np.float32)
        X = TurnFeatures(values, _offsets(SIZES), feature_names=[f"f{i}" for i in range(6)],
                         speakers=[f"s{i}" for i in range(15)],
                         task_ids=["a", None, "b", "c", "a"])
    else:
        X = _make(feature_names=["x", "y", "z"])
    path = tmp_path / "features.safetensors"
    X.save(path)
    Y = TurnFeatures.load(path)
    assert Y.equals(X)
    assert Y.is_sparse == sparse
    if sparse:
        assert Y.task_ids.tolist() == ["a", None, "b", "c", "a"]


def test_load_errors(tmp_path):
    from safetensors.numpy import save_file

    from skafa.utils.fileio import write_safetensors

    X = _make()
    path = tmp_path / "x.safetensors"
    X.save(path)
    raw = path.read_bytes()
    for cut in (len(raw) // 2, len(raw) - 8, 4):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(raw[:cut])
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            TurnFeatures.load(bad)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"definitely not safetensors")
    with pytest.raises(ValueError, match=str(garbage.name)):
        TurnFeatures.load(garbage)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": np.zeros(3)}, str(foreign))
    with pytest.raises(ValueError, match="not a skafa TurnFeatures file"):
        TurnFeatures.load(foreign)
    partial = tmp_path / "partial.safetensors"
    write_safetensors(partial, {"values": np.zeros((3, 2))},
                      {"format": "skafa.TurnFeatures/1", "shape": "[3, 2]", "sparse": "false"})
    with pytest.raises(ValueError, match="corrupt TurnFeatures file"):
        TurnFeatures.load(partial)
    with pytest.raises(ValueError, match="not a readable"):
        TurnFeatures.load(tmp_path / "missing.safetensors")


# --------------------------------------------------------------- scikit-learn
def test_sklearn_safe_indexing_and_helpers():
    X = _make()
    y = np.arange(5)
    for key in ([1, 3], np.array([4, 0]), np.array([True, False, True, False, False]),
                slice(1, 3)):
        Y = _safe_indexing(X, key)
        assert isinstance(Y, TurnFeatures)
    assert _safe_indexing(X, [1, 3]).n_turns.tolist() == [1, 2]
    check_consistent_length(X, y)
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        check_consistent_length(X, np.arange(4))
    Xi, yi = indexable(X, y)
    assert Xi is X


def test_train_test_split_keeps_container():
    X = _make()
    y = np.arange(5)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=2, random_state=0)
    assert isinstance(X_tr, TurnFeatures) and isinstance(X_te, TurnFeatures)
    assert len(X_tr) == 3 and len(X_te) == 2
    for part, labels in ((X_tr, y_tr), (X_te, y_te)):
        for j, i in enumerate(labels):  # y[i] == i identifies the conversation
            np.testing.assert_array_equal(part[j], X[int(i)])


@pytest.mark.parametrize("cv", [GroupKFold(n_splits=3), KFold(n_splits=5)])
def test_splitters_yield_turn_features(cv):
    X = _make()
    y = np.zeros(5, dtype=int)
    seen = []
    groups = X.task_ids if isinstance(cv, GroupKFold) else None
    for train, test in cv.split(X, y, groups):
        for idx in (train, test):
            part = _safe_indexing(X, idx)
            assert isinstance(part, TurnFeatures)
            assert part.n_turns.tolist() == [SIZES[i] for i in idx]
        if isinstance(cv, GroupKFold):
            assert not set(X.task_ids[train]) & set(X.task_ids[test])
        seen.extend(test.tolist())
    assert sorted(seen) == list(range(5))


# ------------------------------------------------------------------ hypothesis
@st.composite
def _layouts(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=7))
    sparse = draw(st.booleans())
    n_sites = 1 if sparse else draw(st.integers(1, 3))
    n_features = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.RandomState(seed)
    arrays = []
    for n in sizes:
        shape = (n, n_features) if sparse or draw(st.booleans()) and n_sites == 1 else (
            n, n_sites, n_features)
        arrays.append(rng.randint(-9, 9, size=shape).astype(float))
    ndims = {a.ndim for a in arrays}
    if len(ndims) > 1:  # keep one layout for all conversations
        arrays = [a.reshape(a.shape[0], -1) for a in arrays]
    return sizes, arrays, sparse


@st.composite
def _keys(draw, n):
    kind = draw(st.sampled_from(["ints", "list", "mask", "slice", "ellipsis", "negative"]))
    if kind in ("ints", "list", "ellipsis"):
        idx = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n))
        key = np.array(idx) if kind != "list" else list(idx)
        return (key, Ellipsis) if kind == "ellipsis" else key, idx
    if kind == "negative":
        idx = draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=n))
        return np.array(idx), [i % n for i in idx]
    if kind == "mask":
        mask = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any))
        return np.array(mask), [i for i, m in enumerate(mask) if m]
    start = draw(st.integers(-n, n))
    stop = draw(st.integers(-n, n))
    step = draw(st.sampled_from([1, 2, -1, -2]))
    idx = list(range(n))[start:stop:step]
    if not idx:
        idx = [0]
        return slice(0, 1), idx
    return slice(start, stop, step), idx


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_hypothesis_indexing_matches_per_conversation_reference(data):
    sizes, arrays, sparse = data.draw(_layouts())
    n = len(sizes)
    speakers_per_conv = [[f"c{i}t{t}" for t in range(s)] for i, s in enumerate(sizes)]
    task_ids = [f"task{i % 2}" for i in range(n)]
    blocks = [sp.csr_matrix(a) for a in arrays] if sparse else arrays
    X = TurnFeatures.from_arrays(blocks, speakers=sum(speakers_per_conv, []), task_ids=task_ids)
    key, idx = data.draw(_keys(n))
    Y = X[key]
    assert isinstance(Y, TurnFeatures) and len(Y) == len(idx)
    assert Y.n_turns.tolist() == [sizes[i] for i in idx]
    expected = np.concatenate([arrays[i] for i in idx], axis=0)
    got = Y.values.toarray() if sparse else Y.values
    np.testing.assert_array_equal(got, expected)
    assert Y.speakers.tolist() == sum((speakers_per_conv[i] for i in idx), [])
    assert Y.task_ids.tolist() == [task_ids[i] for i in idx]
    for j, i in enumerate(idx):
        row = Y[j].toarray() if sparse else Y[j]
        np.testing.assert_array_equal(row, arrays[i])
    # sklearn's indexing agrees with ours.
    Z = _safe_indexing(X, np.array(idx))
    assert Z.equals(Y)
