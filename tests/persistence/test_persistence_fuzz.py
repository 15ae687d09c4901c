"""Fuzzing the estimator loader (skafa.persistence.load) with hypothesis.

Random byte flips and truncations of ``skafa.json`` and ``arrays.safetensors`` must
either load identical data or raise a clear ``ValueError``/``TypeError`` naming the
file; never another exception, never a crash, never an allocation far larger than
the files. A stranger's file is self-consistent, so the same is required of random
edits of the estimator tree and of the arrays that are re-signed (digests
recomputed) afterwards: they exercise every decoder, not only the digest checks.
"""

import json
import shutil
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.base import BaseEstimator
from sklearn.utils import Bunch

from skafa import GroupedArgmaxLogisticClassifier, TurnFeatures
from skafa.persistence import ARRAYS_NAME, JSON_NAME, load, save
from skafa.persistence import _persistence as persistence

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
#: Allowed peak of traced allocations during one load: this many times the files' size,
#: plus a constant (Python objects for the parsed JSON cost ~10-20x its text).
PEAK_FACTOR, PEAK_CONSTANT = 50, 2 << 20


class KitchenSink(BaseEstimator):
    """Holds one value of every kind the format encodes."""

    def __init__(self, alpha=1.0):
        self.alpha = alpha

    def fit(self, X=None, y=None):
        rng = np.random.default_rng(0)
        self.coef_ = rng.normal(size=(3, 4))
        self.fortran_ = np.asfortranarray(rng.normal(size=(2, 3)))
        self.ints_ = np.arange(-3, 3, dtype=np.int16)
        self.strings_ = np.array(["a", "bb", "ccc"])
        self.objects_ = np.array(["x", None, 3], dtype=object)
        self.csr_ = sp.random(6, 5, density=0.4, format="csr", random_state=0)
        self.csc_ = sp.random(5, 6, density=0.4, format="csc", random_state=1)
        self.coo_ = sp.random(4, 4, density=0.5, format="coo", random_state=2)
        self.vocab_ = {f"w{i}": i for i in range(20)}
        self.int_keys_ = {0: 1.0, 1: 2.5}
        self.bunch_ = Bunch(x=self.ints_, y="why")
        self.scalars_ = (np.float32(1.5), np.int64(7), np.str_("abc"), float("nan"))
        self.dtype_ = np.dtype("float32")
        return self


def _fingerprint(est):
    """Everything an estimator holds, as comparable bytes and reprs."""
    out = {"repr": repr(est)}
    for key, value in sorted(vars(est).items()):
        if isinstance(value, np.ndarray):
            out[key] = (value.dtype.str, value.shape, value.tobytes() if value.dtype != object
                        else repr(value.tolist()))
        elif sp.issparse(value):
            out[key] = (value.format, value.toarray().tobytes())
        elif isinstance(value, BaseEstimator):
            out[key] = _fingerprint(value)
        else:
            out[key] = repr(value)
    return out


def _probe():
    rng = np.random.default_rng(0)
    X = TurnFeatures(rng.normal(size=(48, 2, 3)), np.arange(0, 49, 4), sites=["a", "b"])
    return GroupedArgmaxLogisticClassifier(site="b", random_state=0).fit(
        X, rng.integers(0, 4, size=12))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, fingerprint of the saved estimator)."""
    persistence.register_class(KitchenSink, name="tests.fuzz.KitchenSink")
    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    for name, est in (("probe", _probe()), ("sink", KitchenSink().fit())):
        path = save(est, root / name)
        out[name] = (path, _fingerprint(load(path)))
    yield out
    persistence._REGISTERED.pop("tests.fuzz.KitchenSink", None)


def _load_checked(path, expected):
    """Load with the allocation bound; return the outcome: 'same', 'other' or 'error'."""
    size = sum(p.stat().st_size for p in path.iterdir())
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # version and model warnings are not the point
            est = load(path)
    except (ValueError, TypeError) as exc:
        assert JSON_NAME in str(exc) or ARRAYS_NAME in str(exc), str(exc)
        outcome = "error"
    else:
        outcome = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < PEAK_FACTOR * size + PEAK_CONSTANT, (peak, size)
    if outcome is None:
        # a loaded sparse matrix is valid: densifying it must not read out of bounds
        got = _fingerprint(est)
        outcome = "same" if got == expected else "other"
    return outcome


def _copy(path):
    tmp = Path(tempfile.mkdtemp(prefix="skafa-fuzz-"))
    shutil.copytree(path, tmp / "est")
    return tmp, tmp / "est"


def _resign(path, doc):
    doc["tree_sha256"] = persistence._sha256(persistence._canonical(doc["tree"]))
    (path / JSON_NAME).write_text(json.dumps(doc))


# ------------------------------------------------------------------ raw bytes
@SETTINGS
@given(which=st.sampled_from(["probe", "sink"]), name=st.sampled_from([JSON_NAME, ARRAYS_NAME]),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                      min_size=1, max_size=4))
def test_byte_flips_load_identical_data_or_raise(saved, which, name, flips):
    path, expected = saved[which]
    tmp, copy = _copy(path)
    try:
        data = bytearray((copy / name).read_bytes())
        for where, mask in flips:
            data[int(where * len(data))] ^= mask
        (copy / name).write_bytes(bytes(data))
        # undetected flips are only in parts outside the digests (dates, versions,
        # the model summary): the data must then be identical
        assert _load_checked(copy, expected) in ("same", "error")
    finally:
        shutil.rmtree(tmp)


@SETTINGS
@given(which=st.sampled_from(["probe", "sink"]), name=st.sampled_from([JSON_NAME, ARRAYS_NAME]),
       keep=st.floats(0, 1, exclude_max=True))
def test_truncations_raise(saved, which, name, keep):
    path, expected = saved[which]
    tmp, copy = _copy(path)
    try:
        data = (copy / name).read_bytes()
        (copy / name).write_bytes(data[: int(keep * len(data))])
        assert _load_checked(copy, expected) == "error"
    finally:
        shutil.rmtree(tmp)


# ------------------------------------------------------- re-signed (hostile) edits
TAGS = sorted(persistence._DECODERS)
KEYS = TAGS + ["shape", "dtype", "params", "state", "data", "indices", "indptr", "values",
               "original_format", "container", "order", "python_int", "value", "x_"]
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 10**9, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.sampled_from(["U200000000", "U1", "<f8", "f8", "i8", "int8", "O", "V8", "S3", "csr",
                     "csc", "dia", "lil", "dok", "bsr", "F", "K", "nan", "inf", "", "matrix",
                     "array", "coef_", "x_", "skafa.probes.GroupedArgmaxClassifier",
                     "sklearn.pipeline.Pipeline", "os.system", "tests.fuzz.KitchenSink"]),
)
json_values = st.recursive(
    leaves,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(KEYS), children, max_size=4)),
    max_leaves=12,
)


def _nodes(tree):
    """(container, key) of every value in the tree, iteratively."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for key, value in items:
            out.append((node, key))
            stack.append(value)
    return out


@SETTINGS
@given(which=st.sampled_from(["probe", "sink"]), data=st.data())
def test_resigned_tree_edits_raise_or_load_within_bounds(saved, which, data):
    path, expected = saved[which]
    tmp, copy = _copy(path)
    try:
        doc = json.loads((copy / JSON_NAME).read_text())
        nodes = _nodes(doc["tree"])
        for _ in range(data.draw(st.integers(1, 3), label="n_edits")):
            parent, key = nodes[data.draw(st.integers(0, len(nodes) - 1), label="node")]
            action = data.draw(st.sampled_from(["replace", "delete", "copy"]), label="action")
            if action == "delete":
                del parent[key]
                nodes = _nodes(doc["tree"])
            elif action == "copy":  # e.g. an array reference used twice
                src_parent, src_key = nodes[data.draw(st.integers(0, len(nodes) - 1))]
                parent[key] = json.loads(json.dumps(src_parent[src_key]))
                nodes = _nodes(doc["tree"])
            else:
                parent[key] = data.draw(json_values, label="value")
                nodes = _nodes(doc["tree"])
            if not nodes:
                break
        _resign(copy, doc)
        _load_checked(copy, expected)
    finally:
        shutil.rmtree(tmp)


@SETTINGS
@given(which=st.sampled_from(["probe", "sink"]),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                      min_size=1, max_size=4))
def test_resigned_array_edits_raise_or_load_within_bounds(saved, which, flips):
    # Flips in the safetensors header (its JSON, offsets, dtypes, shapes) and data,
    # with the arrays digest recomputed as an attacker would.
    path, expected = saved[which]
    tmp, copy = _copy(path)
    try:
        data = bytearray((copy / ARRAYS_NAME).read_bytes())
        for where, mask in flips:
            data[int(where * len(data))] ^= mask
        (copy / ARRAYS_NAME).write_bytes(bytes(data))
        doc = json.loads((copy / JSON_NAME).read_text())
        doc["arrays"].update(sha256=persistence._sha256(bytes(data)), n_bytes=len(data))
        _resign(copy, doc)
        _load_checked(copy, expected)
    finally:
        shutil.rmtree(tmp)
