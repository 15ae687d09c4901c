"""Save and load fitted skafa estimators as data, without pickle.

:func:`save` writes a fitted estimator — a skafa estimator, a scikit-learn
:class:`~sklearn.pipeline.Pipeline` of them, or a
:class:`~skafa.attributor.FailureAttributor` — to a directory holding two files:

``arrays.safetensors``
    Every numeric array (coefficients, scaler statistics, IDF weights, ...), keyed
    by its path in the estimator tree, e.g.
    ``steps.1.1.best_estimator_.estimator_.steps.1.1.coef_``.
``skafa.json``
    The format version; the skafa, scikit-learn and numpy versions that wrote
    it; the *estimator tree*: for every estimator its class (by public import
    path), its parameters (``get_params(deep=False)``; nested estimators
    recursively; a :class:`~skafa.prompt.PromptTemplate` through its
    ``to_dict``) and its fitted state (numbers, strings, lists and dicts in JSON;
    arrays by reference into the safetensors file; sparse matrices as
    ``data``/``indices``/``indptr`` arrays; shared objects by reference to their
    first occurrence); a summary of every model-reading step (model name,
    identity, architecture fingerprint, prompt settings, chat-template
    variables); and SHA-256 digests of the arrays file and of the tree.

:func:`load` rebuilds the estimator. It verifies both digests first (a
truncated or edited file raises a :class:`ValueError` naming the file and the
check that failed), then, for every model-reading step
(:class:`~skafa.extraction.TurnActivationTransformer`,
:class:`~skafa.judge.PromptedJudge`), loads the model it will use (``model=``,
else the saved name) and compares its architecture fingerprint with the saved
one: a different architecture raises a :class:`ValueError`; the same
architecture under another name, path or file warns with
:class:`ModelMismatchWarning`.

Why a file from a stranger is safe to load
------------------------------------------
Loading runs no code from the file. The JSON can only name classes from an
explicit allowlist (:func:`allowed_classes`: skafa's estimators and a few
scikit-learn estimators and splitters); those classes are imported by skafa
itself, by their fixed public path, and a class name that is not on the list is
refused *without being imported*. Each class is built with keyword parameters
that are plain data (numbers, strings, lists, dicts, arrays, other allowlisted
estimators) — scikit-learn constructors only store them — and the fitted
attributes are then set to plain data as well (never to callables; names that
would shadow a class attribute or method are refused). Arrays are read with
``safetensors``, which parses a JSON header and raw little-endian buffers.
There is no ``pickle``, no ``eval``, no import chosen by the file.

The worst a malicious file can do is describe a *wrong* model (bad
coefficients, a different prompt): as with any model you download, check where
it comes from and evaluate it before trusting its outputs.

scikit-learn users may also persist these estimators with :mod:`joblib` or
:mod:`pickle` (skafa estimators pickle without their language-model weights).
That is faster and supports any class, but unpickling executes code chosen by
the file: only load pickles you made yourself or fully trust.

Extending the allowlist
-----------------------
A custom estimator whose parameters and fitted attributes are plain data can be
allowed with :func:`register_class` (in the saving and in the loading process),
or at load time with ``load(path, trust=["package.module.Class"])`` — the
only case in which :func:`load` imports a module named in the file, because the
caller named it.

Examples
--------
>>> import os, tempfile
>>> import numpy as np
>>> from skafa import TurnFeatures
>>> from skafa.probes import GroupedArgmaxLogisticClassifier
>>> from skafa.persistence import save, load
>>> rng = np.random.default_rng(0)
>>> X = TurnFeatures(rng.normal(size=(40, 3)), np.arange(0, 41, 4))
>>> y = rng.integers(0, 4, size=10)
>>> probe = GroupedArgmaxLogisticClassifier().fit(X, y)
>>> path = save(probe, os.path.join(tempfile.mkdtemp(), "probe"))
>>> sorted(p.name for p in path.iterdir())
['arrays.safetensors', 'skafa.json']
>>> np.array_equal(load(path).predict(X), probe.predict(X))
True
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import datetime
import hashlib
import importlib
import inspect
import json
import math
import warnings
from pathlib import Path, PurePath

import numpy as np
import scipy.sparse as sp

from .utils._io import atomic_write_bytes

__all__ = [
    "save",
    "load",
    "register_class",
    "allowed_classes",
    "ModelMismatchWarning",
    "PersistenceVersionWarning",
    "FORMAT",
    "FORMAT_VERSION",
    "JSON_NAME",
    "ARRAYS_NAME",
]

#: Name of the format, written to ``skafa.json``.
FORMAT = "skafa.estimator"
#: Version of the format; :func:`load` refuses files from a newer version.
FORMAT_VERSION = 1
#: File names inside a saved directory.
JSON_NAME = "skafa.json"
ARRAYS_NAME = "arrays.safetensors"


class ModelMismatchWarning(UserWarning):
    """The model a loaded estimator will use is not the one it was saved with.

    Issued when the architecture fingerprint matches but the model's name,
    path, file or weights digest differs (e.g. another quantization of the same
    model, or a fine-tuned copy): the probe's coefficients were learnt on the
    saved model's activations and may not transfer.
    """


class PersistenceVersionWarning(UserWarning):
    """The file was written by another version of scikit-learn or skafa."""


# ---------------------------------------------------------------------------
# The allowlist
# ---------------------------------------------------------------------------

#: Public import path of every class :func:`load` may instantiate by default.
_DEFAULT_CLASSES = (
    # skafa
    "skafa.extraction.TurnActivationTransformer",
    "skafa.featurizers.TurnPositionTransformer",
    "skafa.featurizers.TurnTextTransformer",
    "skafa.composition.TurnFeatureUnion",
    "skafa.composition.SiteConcatenator",
    "skafa.dummies.DummyStepClassifier",
    "skafa.composition.PerTurn",
    "skafa.probes.GroupedArgmaxClassifier",
    "skafa.probes.GroupedArgmaxLogisticClassifier",
    "skafa.selection.SiteSelector",
    "skafa.judge.PromptedJudge",
    "skafa.attributor.FailureAttributor",
    "skafa.online.OnlineAuditor",  # online auditing (issue 11); plain-data attributes
    # scikit-learn estimators
    "sklearn.pipeline.Pipeline",
    "skafa.composition.AttributionPipeline",
    "sklearn.linear_model.LogisticRegression",
    "sklearn.svm.LinearSVC",
    "sklearn.preprocessing.StandardScaler",
    "sklearn.decomposition.PCA",
    "sklearn.feature_extraction.text.TfidfVectorizer",
    "sklearn.feature_extraction.text.CountVectorizer",
    "sklearn.feature_extraction.text.TfidfTransformer",
    # scikit-learn splitters (parameters only)
    "sklearn.model_selection.GroupKFold",
    "sklearn.model_selection.KFold",
    "sklearn.model_selection.StratifiedKFold",
    "sklearn.model_selection.StratifiedGroupKFold",
    "sklearn.model_selection.GroupShuffleSplit",
    "sklearn.model_selection.ShuffleSplit",
    "sklearn.model_selection.LeaveOneGroupOut",
)

_ALLOWED: dict = {}  # name -> class, filled lazily from _DEFAULT_CLASSES
_REGISTERED: dict = {}  # name -> class, from register_class


def _import_class(name):
    module, _, attr = name.rpartition(".")
    if not module:
        raise ValueError(f"{name!r} is not a 'package.module.Class' path.")
    obj = getattr(importlib.import_module(module), attr, None)
    if not isinstance(obj, type):
        raise ValueError(f"{name!r} does not name a class.")
    return obj


def _allowlist():
    if not _ALLOWED:
        _ALLOWED.update({name: _import_class(name) for name in _DEFAULT_CLASSES})
    return {**_ALLOWED, **_REGISTERED}


def allowed_classes():
    """Import paths of the classes :func:`load` instantiates without ``trust``.

    Returns
    -------
    names : list of str
        Sorted; the defaults plus anything added with :func:`register_class`.
    """
    return sorted(_allowlist())


def register_class(cls, *, name=None):
    """Allow a custom estimator class in :func:`save` and :func:`load` (this process).

    Only register classes whose parameters and fitted attributes are plain data
    (numbers, strings, lists, dicts, numpy arrays, sparse matrices, allowlisted
    estimators) and whose ``__init__`` only stores its arguments: loading a file
    calls ``cls(**params)`` with parameters read from the file.

    Parameters
    ----------
    cls : type
        The class (subclasses are not covered: register each one).
    name : str, default=None
        Name written to the file; default ``f"{cls.__module__}.{cls.__qualname__}"``.
        The loading process must register the same name (or pass it in
        ``load(..., trust=[name])``).

    Returns
    -------
    name : str
        The registered name.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_class takes a class, got {type(cls).__name__}.")
    name = name or f"{cls.__module__}.{cls.__qualname__}"
    current = _allowlist().get(name)
    if current is not None and current is not cls:
        raise ValueError(f"{name!r} is already allowlisted for another class ({current!r}).")
    _REGISTERED[name] = cls
    return name


def _name_of(cls, allow):
    for name, c in allow.items():
        if c is cls:
            return name
    return None


def _unsupported_save(obj, path):
    cls = type(obj)
    full = f"{cls.__module__}.{cls.__qualname__}"
    return TypeError(
        f"skafa.persistence.save: cannot save {full} at {_where(path)}: the class is not "
        "in the allowlist of classes that can be loaded without running code from the "
        "file. If its parameters and fitted attributes are plain data (numbers, strings, "
        "arrays, dicts, allowlisted estimators), allow it with "
        f"skafa.persistence.register_class({cls.__qualname__}) in the saving process, and "
        f"register it (or pass trust=[{full!r}]) when loading. Otherwise persist the "
        "estimator with joblib (whose files execute code when loaded: trusted files only)."
    )


def _where(path):
    return f"'{path}'" if path else "the root"


# ---------------------------------------------------------------------------
# Per-class hooks
# ---------------------------------------------------------------------------

_EXTRACTION_CLASSES = ("skafa.extraction.TurnActivationTransformer", "skafa.judge.PromptedJudge")
_MODEL_PARAM_CLASSES = _EXTRACTION_CLASSES + ("skafa.attributor.FailureAttributor",)

#: State that is runtime-only (models, caches) or derived; never written, refused on load.
_EXCLUDED_STATE = {
    "skafa.extraction.TurnActivationTransformer": frozenset(
        {"_model", "_tokenizer", "_layout", "_cache", "_prompt_fingerprint"}
    ),
    "skafa.selection.SiteSelector": frozenset({"scorer_"}),
}


def _after_load_site_selector(est, ctx, path):
    if hasattr(est, "cv_results_"):
        from .selection import _get_scorer

        est.scorer_ = _get_scorer(est.estimator, est.scoring)


def _after_load_pipeline(est, ctx, path):
    if est.memory is not None:
        warnings.warn(
            f"{ctx.json_path}: the Pipeline at {_where(path)} was saved with "
            f"memory={est.memory!r}; it is not restored (a joblib cache holds pickles). "
            "Set it again after loading if you trust that cache directory.",
            UserWarning, stacklevel=4,
        )
        est.memory = None


def _after_load_extraction(est, ctx, path):
    if hasattr(est, "prompt_") and hasattr(est, "tokenizer_fingerprint_"):
        est._prompt_fingerprint = est.prompt_.fingerprint()
    if hasattr(est, "model_fingerprint_"):
        ctx.check_model(est, path)


_AFTER_LOAD = {
    "sklearn.pipeline.Pipeline": _after_load_pipeline,
    "skafa.composition.AttributionPipeline": _after_load_pipeline,
    "skafa.selection.SiteSelector": _after_load_site_selector,
    "skafa.extraction.TurnActivationTransformer": _after_load_extraction,
    "skafa.judge.PromptedJudge": _after_load_extraction,
}


# ---------------------------------------------------------------------------
# Encoding (estimator -> JSON tree + arrays)
# ---------------------------------------------------------------------------

_SAFETENSORS_KINDS = "biuf"
_PY_TYPES = {"float": float, "int": int, "bool": bool, "str": str}


def _escape(key):
    return str(key).replace("~", "~0").replace(".", "~1")


def _join(path, key):
    key = _escape(key)
    return key if not path else f"{path}.{key}"


def _is_estimator_like(obj):
    return hasattr(obj, "get_params") and hasattr(obj, "fit")


def _is_splitter_like(obj):
    return hasattr(obj, "split") and hasattr(obj, "get_n_splits") and not isinstance(obj, type)


class _Writer:
    def __init__(self):
        self.allow = _allowlist()
        self.arrays = {}
        self.memo = {}  # id(obj) -> path
        self.keep = []  # keeps memoized objects alive so ids stay unique
        self.models = []

    # ------------------------------------------------------------- helpers
    def _memo(self, obj, path):
        ref = self.memo.get(id(obj))
        if ref is not None:
            return {"__ref__": ref}
        self.memo[id(obj)] = path
        self.keep.append(obj)
        return None

    def _array(self, arr, path):
        arr = np.asarray(arr)
        order = "F" if (arr.ndim > 1 and arr.flags.f_contiguous
                        and not arr.flags.c_contiguous) else "C"
        stored = np.ascontiguousarray(arr)
        if stored.dtype.byteorder == ">":
            stored = stored.astype(stored.dtype.newbyteorder("<"))
        self.arrays[path] = stored
        out = {"__ndarray__": path, "dtype": arr.dtype.str.lstrip("<>=|"),
               "shape": list(arr.shape)}
        if order == "F":
            out["order"] = "F"
        return out

    # -------------------------------------------------------------- encode
    def encode(self, value, path):
        if value is None or type(value) in (bool, str, int):
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, np.generic):  # before str/float: np.str_, np.float64
            return self._scalar(value, path)
        if isinstance(value, type):
            return self._type(value, path)
        if isinstance(value, np.dtype):
            return {"__dtype__": value.str}
        if isinstance(value, PurePath):
            return {"__path__": str(value)}
        from .models import ModelHandle
        from .prompt import PromptTemplate

        if isinstance(value, PromptTemplate):
            return {"__prompt__": value.to_dict()}
        if isinstance(value, ModelHandle):
            return {"__model_handle__": value.name}
        if isinstance(value, tuple) and type(value) is tuple:
            return {"__tuple__": [self.encode(v, _join(path, i)) for i, v in enumerate(value)]}

        ref = None
        if isinstance(value, (np.ndarray, list, dict)) or sp.issparse(value) \
                or _is_estimator_like(value):
            ref = self._memo(value, path)
            if ref is not None:
                return ref
        if isinstance(value, np.ndarray):
            return self._ndarray(value, path)
        if sp.issparse(value):
            return self._sparse(value, path)
        if type(value) is list:
            return [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
        if isinstance(value, dict):
            return self._dict(value, path)
        if _is_estimator_like(value):
            return self._estimator(value, path)
        if _is_splitter_like(value):
            return self._splitter(value, path)
        if isinstance(value, np.random.RandomState):
            raise TypeError(
                f"skafa.persistence.save: {_where(path)} is a numpy RandomState instance, "
                "which cannot be stored as data; use an int seed (or None) for "
                "random_state."
            )
        raise TypeError(
            f"skafa.persistence.save: {_where(path)} holds a {type(value).__module__}."
            f"{type(value).__qualname__}, which cannot be stored as plain data (only "
            "numbers, strings, lists, tuples, dicts, numpy arrays, sparse matrices, "
            "PromptTemplates and allowlisted estimators can). If it is a callable "
            "parameter (a scorer, tokenizer or preprocessor function), use a named "
            "option instead, or persist with joblib (trusted files only)."
        )

    def _scalar(self, value, path):
        if value.dtype.kind in _SAFETENSORS_KINDS:
            item = value.item()
            if isinstance(item, float) and not math.isfinite(item):
                item = {"__float__": repr(item)}
            return {"__scalar__": value.dtype.str.lstrip("<>=|"), "value": item}
        if value.dtype.kind in "US":
            return {"__scalar__": value.dtype.str.lstrip("<>=|"), "value": str(value.item())
                    if value.dtype.kind == "U" else value.item().decode("latin-1")}
        raise TypeError(
            f"skafa.persistence.save: {_where(path)} is a numpy {value.dtype} scalar, which "
            "the format does not support."
        )

    def _type(self, value, path):
        if issubclass(value, np.generic) and np.dtype(value).kind in _SAFETENSORS_KINDS:
            return {"__type__": np.dtype(value).str.lstrip("<>=|")}
        for name, t in _PY_TYPES.items():
            if value is t:
                return {"__pytype__": name}
        raise TypeError(
            f"skafa.persistence.save: {_where(path)} is the class {value.__qualname__}; only "
            "numpy scalar types and float/int/bool/str can be stored as parameters."
        )

    def _ndarray(self, arr, path):
        kind = arr.dtype.kind
        if kind in _SAFETENSORS_KINDS:
            if arr.dtype.itemsize > 8 or (kind == "f" and arr.dtype.itemsize < 2):
                raise TypeError(f"skafa.persistence.save: {_where(path)} has dtype "
                                f"{arr.dtype}, which safetensors cannot store.")
            return self._array(arr, path)
        if kind == "U":
            return {"__strarray__": arr.tolist(), "dtype": arr.dtype.str.lstrip("<>=|"),
                    "shape": list(arr.shape)}
        if kind == "O":
            flat = [self.encode(v, _join(path, i)) for i, v in enumerate(arr.ravel().tolist())]
            return {"__objarray__": flat, "shape": list(arr.shape)}
        raise TypeError(f"skafa.persistence.save: {_where(path)} is an array of dtype "
                        f"{arr.dtype}, which the format does not support.")

    def _sparse(self, value, path):
        fmt = value.format if value.format in ("csr", "csc") else "csr"
        m = value.asformat(fmt)
        m.sort_indices()
        kind = "array" if isinstance(value, sp.sparray) else "matrix"
        return {
            "__sparse__": fmt,
            "original_format": value.format,
            "container": kind,
            "shape": list(m.shape),
            "data": self._array(m.data, _join(path, "data")),
            "indices": self._array(m.indices, _join(path, "indices")),
            "indptr": self._array(m.indptr, _join(path, "indptr")),
        }

    def _dict(self, value, path):
        from sklearn.utils import Bunch

        if isinstance(value, Bunch):
            return {"__bunch__": {str(k): self.encode(v, _join(path, k))
                                  for k, v in value.items()}}
        if type(value) is not dict:
            raise TypeError(f"skafa.persistence.save: {_where(path)} is a "
                            f"{type(value).__qualname__}; only plain dicts are supported.")
        keys = list(value)
        vals = list(value.values())
        if keys and all(type(k) is str for k in keys):
            # Compact form for large str -> int maps (vocabularies).
            if len(keys) > 16 and all(type(v) is int for v in vals):
                values = np.asarray(vals, dtype=np.int64)
                return {"__strintdict__": keys, "values": self._array(values, path),
                        "python_int": True}
            if len(keys) > 16 and vals and all(isinstance(v, np.integer) for v in vals) \
                    and len({v.dtype for v in vals}) == 1:
                values = np.asarray(vals, dtype=vals[0].dtype)
                return {"__strintdict__": keys, "values": self._array(values, path),
                        "python_int": False}
            return {"__dict__": {k: self.encode(v, _join(path, k)) for k, v in value.items()}}
        return {"__items__": [[self.encode(k, _join(path, f"key{i}")),
                               self.encode(v, _join(path, i))]
                              for i, (k, v) in enumerate(value.items())]}

    def _splitter(self, value, path):
        name = _name_of(type(value), self.allow)
        if name is None:
            raise _unsupported_save(value, path)
        params = {}
        for p in inspect.signature(type(value).__init__).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            params[p.name] = self.encode(getattr(value, p.name), _join(path, p.name))
        return {"__splitter__": name, "params": params}

    def _estimator(self, est, path):
        name = _name_of(type(est), self.allow)
        if name is None:
            raise _unsupported_save(est, path)
        params = est.get_params(deep=False)
        excluded = _EXCLUDED_STATE.get(name, frozenset())
        state = {k: v for k, v in vars(est).items() if k not in params and k not in excluded}
        node = {"__estimator__": name}
        node["params"] = {k: self.encode(v, _join(path, k)) for k, v in params.items()}
        node["state"] = {k: self.encode(v, _join(path, k)) for k, v in state.items()}
        if name in _EXTRACTION_CLASSES:
            self.models.append(_model_summary(est, name, path))
        return node


def _model_summary(est, name, path):
    prompt = getattr(est, "prompt_", None) or getattr(est, "prompt", None)
    return {
        "path": path,
        "class": name,
        "model": str(est.model),
        "model_identity": getattr(est, "model_identity_", None),
        "model_fingerprint": getattr(est, "model_fingerprint_", None),
        "dtype": getattr(est, "dtype", None),
        "sites": list(getattr(est, "sites_", ()) or ()) or None,
        "prompt": None if prompt is None else prompt.to_dict(),
        "chat_template_kwargs": (None if est.chat_template_kwargs is None
                                 else dict(est.chat_template_kwargs)),
    }


def _canonical(tree):
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("utf-8")


def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def save(estimator, path, *, overwrite=False):
    """Save an estimator to a directory, as JSON plus safetensors (no pickle).

    Parameters
    ----------
    estimator : estimator object
        A (fitted or unfitted) allowlisted estimator: any skafa estimator, a
        :class:`~sklearn.pipeline.Pipeline` of them, or one of the scikit-learn
        classes listed by :func:`allowed_classes`, nested arbitrarily.
    path : str or path-like
        Directory to write (created if missing). It receives ``skafa.json`` and
        ``arrays.safetensors``.
    overwrite : bool, default=False
        Replace an existing save in ``path``. Without it an existing
        ``skafa.json`` raises ``FileExistsError``.

    Returns
    -------
    path : pathlib.Path
        The directory.

    Raises
    ------
    TypeError
        For a class outside the allowlist (the message says how to add it) or a
        value that is not plain data (a callable parameter, a RandomState).
    """
    from safetensors.numpy import save as st_save

    from . import __version__ as skafa_version

    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory.")
    json_path = path / JSON_NAME
    if json_path.exists() and not overwrite:
        raise FileExistsError(
            f"{json_path} already exists; pass overwrite=True to replace the saved estimator."
        )
    if not _is_estimator_like(estimator):
        raise TypeError(
            f"save expects a scikit-learn style estimator, got {type(estimator).__name__}."
        )
    writer = _Writer()
    tree = writer.encode(estimator, "")
    arrays_blob = st_save(writer.arrays, metadata={"format": f"{FORMAT}/{FORMAT_VERSION}"})

    import sklearn

    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "skafa_version": skafa_version,
        "sklearn_version": sklearn.__version__,
        "numpy_version": np.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "root_class": tree["__estimator__"],
        "models": writer.models,
        "arrays": {
            "file": ARRAYS_NAME,
            "sha256": _sha256(arrays_blob),
            "n_arrays": len(writer.arrays),
            "n_bytes": len(arrays_blob),
        },
        "tree_sha256": _sha256(_canonical(tree)),
        "tree": tree,
    }
    text = json.dumps(document, indent=1, ensure_ascii=False, allow_nan=False)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path / ARRAYS_NAME, arrays_blob)
    atomic_write_bytes(json_path, text.encode("utf-8"))
    return path


# ---------------------------------------------------------------------------
# Decoding (JSON tree + arrays -> estimator)
# ---------------------------------------------------------------------------


class _Reader:
    def __init__(self, arrays, json_path, *, model, device, trust, verify_model):
        self.arrays = arrays
        self.json_path = json_path
        self.model = model
        self.device = device
        self.verify_model = verify_model
        self.allow = _allowlist()
        self.trust = {str(t) for t in trust}
        self.objects = {}
        self.saved_models = {}  # path -> model name as saved

    def fail(self, path, message):
        return ValueError(f"{self.json_path}: {message} (at {_where(path)}).")

    # ------------------------------------------------------------ classes
    def lookup(self, name, path):
        if not isinstance(name, str):
            raise self.fail(path, f"class name must be a string, got {name!r}")
        cls = self.allow.get(name)
        if cls is not None:
            return cls
        if name in self.trust:
            try:
                cls = _import_class(name)
            except (ImportError, ValueError) as exc:
                raise self.fail(path, f"the trusted class {name!r} cannot be imported: "
                                      f"{exc}") from exc
            return cls
        raise ValueError(
            f"{self.json_path}: refusing to load class {name!r} at {_where(path)}: it is not "
            "in skafa's allowlist of classes that can be built from data, and it was not "
            "imported. If you trust this file and that class, load with "
            f"trust=[{name!r}] (or call skafa.persistence.register_class on it first)."
        )

    # ------------------------------------------------------------- decode
    def decode(self, value, path):
        if value is None or isinstance(value, (bool, str, int, float)):
            return value
        if isinstance(value, list):
            out = []
            self.objects[path] = out
            out.extend(self.decode(v, _join(path, i)) for i, v in enumerate(value))
            return out
        if not isinstance(value, dict) or not value:
            raise self.fail(path, f"unexpected JSON value {value!r}")
        tag = next(iter(value))
        handler = _DECODERS.get(tag)
        if handler is None:
            raise self.fail(path, f"unknown entry type {tag!r}")
        try:
            return handler(self, value, path)
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise self.fail(path, f"malformed {tag} entry ({type(exc).__name__}: {exc})") \
                from exc

    def array(self, node, path):
        key = node["__ndarray__"]
        if key not in self.arrays:
            raise self.fail(path, f"array {key!r} is missing from {ARRAYS_NAME}")
        arr = self.arrays[key]
        if node.get("shape") == [] and arr.shape == (1,):
            arr = arr.reshape(())  # safetensors returns 0-d tensors as shape (1,)
        dtype = np.dtype(node["dtype"])
        if arr.dtype != dtype or list(arr.shape) != list(node["shape"]):
            raise self.fail(path, f"array {key!r} in {ARRAYS_NAME} has dtype {arr.dtype} and "
                                  f"shape {arr.shape}, but {dtype} and {tuple(node['shape'])} "
                                  "are recorded")
        arr = np.array(arr, order=node.get("order", "C"), copy=True)
        self.objects[path] = arr
        return arr

    def estimator(self, node, path):
        name = node["__estimator__"]
        cls = self.lookup(name, path)
        params = {k: self.decode(v, _join(path, k)) for k, v in node["params"].items()}
        if name in _MODEL_PARAM_CLASSES:
            self.saved_models[path] = str(params.get("model"))
            if self.model is not None:
                params["model"] = self.model
            if self.device is not None and "device" in params:
                params["device"] = self.device
        try:
            est = cls(**params)
        except TypeError as exc:
            raise self.fail(path, f"{name} does not accept the saved parameters "
                                  f"{sorted(params)}: {exc}") from exc
        self.objects[path] = est
        excluded = _EXCLUDED_STATE.get(name, frozenset())
        for key, raw in node["state"].items():
            if (not isinstance(key, str) or not key.isidentifier() or key.startswith("__")
                    or key in excluded or hasattr(type(est), key) or key in params):
                raise self.fail(path, f"refusing to set attribute {key!r} on {name}")
            value = self.decode(raw, _join(path, key))
            if callable(value) and not isinstance(value, type) \
                    and not _is_estimator_like(value):
                raise self.fail(path, f"refusing a callable value for {key!r}")
            setattr(est, key, value)
        hook = _AFTER_LOAD.get(name)
        if hook is not None:
            hook(est, self, path)
        return est

    # -------------------------------------------------------- model check
    def check_model(self, est, path):
        from .models import load_model, model_fingerprint, model_identity

        saved_model = self.saved_models.get(path, str(est.model))
        if not self.verify_model:
            return
        try:
            lm, tokenizer = load_model(est.model, device=est.device, dtype=est.dtype)
        except Exception as exc:
            raise ValueError(
                f"{self.json_path}: the {type(est).__name__} at {_where(path)} needs the model "
                f"{str(est.model)!r} to check its architecture, but it could not be loaded "
                f"({type(exc).__name__}: {exc}). Pass model=<name or path> to load, or "
                "verify_model=False to defer the check to the first transform."
            ) from exc
        saved_fp = est.model_fingerprint_
        fp = model_fingerprint(lm)
        if fp != saved_fp:
            diff = {k: (saved_fp.get(k), fp.get(k)) for k in sorted(set(fp) | set(saved_fp))
                    if fp.get(k) != saved_fp.get(k)}
            details = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{self.json_path}: the {type(est).__name__} at {_where(path)} was fitted on "
                f"a different model architecture than {str(est.model)!r} ({details}). Its "
                "probes cannot read this model's activations; load with model=<the original "
                "model> or refit."
            )
        identity = model_identity(est.model)
        saved_identity = est.model_identity_
        if identity != saved_identity or str(est.model) != saved_model:
            warnings.warn(
                f"{type(est).__name__} at {_where(path)}: saved with model {saved_model!r} "
                f"(identity {saved_identity}), now using {str(est.model)!r} (identity "
                f"{identity}). The architecture matches, but the weights may differ, so the "
                "probe's coefficients may not transfer; evaluate before trusting it.",
                ModelMismatchWarning,
                stacklevel=4,
            )
            est.model_identity_ = identity
            if hasattr(est, "tokenizer_fingerprint_"):
                from .extraction import _tokenizer_fingerprint

                est.tokenizer_fingerprint_ = _tokenizer_fingerprint(tokenizer)


def _dec_float(r, node, path):
    text = node["__float__"]
    if text not in ("nan", "inf", "-inf"):
        raise r.fail(path, f"bad float {text!r}")
    return float(text)


def _dec_scalar(r, node, path):
    dtype = np.dtype(node["__scalar__"])
    value = node["value"]
    if isinstance(value, dict):
        value = _dec_float(r, value, path)
    if dtype.kind not in _SAFETENSORS_KINDS + "US":
        raise r.fail(path, f"unsupported scalar dtype {dtype}")
    return dtype.type(value)


def _dec_type(r, node, path):
    dtype = np.dtype(node["__type__"])
    if dtype.kind not in _SAFETENSORS_KINDS:
        raise r.fail(path, f"unsupported type {dtype}")
    return dtype.type


def _dec_pytype(r, node, path):
    t = _PY_TYPES.get(node["__pytype__"])
    if t is None:
        raise r.fail(path, f"unsupported type {node['__pytype__']!r}")
    return t


def _dec_dtype(r, node, path):
    dtype = np.dtype(node["__dtype__"])
    if dtype.kind not in _SAFETENSORS_KINDS + "U":
        raise r.fail(path, f"unsupported dtype {dtype}")
    return dtype


def _dec_path(r, node, path):
    return node["__path__"]


def _dec_prompt(r, node, path):
    from .prompt import PromptTemplate

    try:
        return PromptTemplate.from_dict(node["__prompt__"])
    except ValueError as exc:
        raise r.fail(path, f"invalid PromptTemplate: {exc}") from exc


def _dec_model_handle(r, node, path):
    from .models import ModelHandle

    return ModelHandle(node["__model_handle__"])


def _dec_tuple(r, node, path):
    return tuple(r.decode(v, _join(path, i)) for i, v in enumerate(node["__tuple__"]))


def _dec_ref(r, node, path):
    target = node["__ref__"]
    if target not in r.objects:
        raise r.fail(path, f"reference to {target!r}, which was not loaded before it")
    return r.objects[target]


def _dec_ndarray(r, node, path):
    return r.array(node, path)


def _dec_strarray(r, node, path):
    dtype = np.dtype(node["dtype"])
    if dtype.kind != "U":
        raise r.fail(path, f"bad string dtype {dtype}")
    arr = np.array(node["__strarray__"], dtype=dtype).reshape(node["shape"])
    r.objects[path] = arr
    return arr


def _dec_objarray(r, node, path):
    shape = tuple(int(v) for v in node["shape"])
    if any(v < 0 for v in shape) or math.prod(shape) != len(node["__objarray__"]):
        raise r.fail(path, f"object array of shape {shape} has "
                           f"{len(node['__objarray__'])} entries")
    arr = np.empty(len(node["__objarray__"]), dtype=object)
    r.objects[path] = arr
    for i, v in enumerate(node["__objarray__"]):
        arr[i] = r.decode(v, _join(path, i))
    arr = arr.reshape(shape)
    r.objects[path] = arr
    return arr


def _dec_sparse(r, node, path):
    fmt = node["__sparse__"]
    if fmt not in ("csr", "csc"):
        raise r.fail(path, f"bad sparse format {fmt!r}")
    data = r.array(node["data"], _join(path, "data"))
    indices = r.array(node["indices"], _join(path, "indices"))
    indptr = r.array(node["indptr"], _join(path, "indptr"))
    array = node.get("container") == "array"
    cls = {("csr", False): sp.csr_matrix, ("csc", False): sp.csc_matrix,
           ("csr", True): sp.csr_array, ("csc", True): sp.csc_array}[(fmt, array)]
    try:
        m = cls((data, indices, indptr), shape=tuple(node["shape"]))
        m.check_format(full_check=True)
        m = m.asformat(node.get("original_format", fmt))
    except ValueError as exc:
        raise r.fail(path, f"inconsistent sparse matrix: {exc}") from exc
    r.objects[path] = m
    return m


def _dec_dict(r, node, path):
    out = {}
    r.objects[path] = out
    for k, v in node["__dict__"].items():
        out[k] = r.decode(v, _join(path, k))
    return out


def _dec_strintdict(r, node, path):
    keys = node["__strintdict__"]
    values = r.array(node["values"], path)
    if len(keys) != values.shape[0] or values.ndim != 1 or values.dtype.kind not in "iu":
        raise r.fail(path, "keys and values of a str->int dict do not match")
    vals = values.tolist() if node.get("python_int") else list(values)
    out = dict(zip(keys, vals))
    r.objects[path] = out
    return out


def _dec_items(r, node, path):
    out = {}
    r.objects[path] = out
    for i, (k, v) in enumerate(node["__items__"]):
        key = r.decode(k, _join(path, f"key{i}"))
        try:
            hash(key)
        except TypeError:
            raise r.fail(path, f"unhashable dict key {key!r}") from None
        out[key] = r.decode(v, _join(path, i))
    return out


def _dec_bunch(r, node, path):
    from sklearn.utils import Bunch

    out = Bunch()
    r.objects[path] = out
    for k, v in node["__bunch__"].items():
        out[k] = r.decode(v, _join(path, k))
    return out


def _dec_splitter(r, node, path):
    cls = r.lookup(node["__splitter__"], path)
    params = {k: r.decode(v, _join(path, k)) for k, v in node["params"].items()}
    try:
        return cls(**params)
    except TypeError as exc:
        raise r.fail(path, f"{node['__splitter__']} rejected the saved parameters: {exc}") \
            from exc


def _dec_estimator(r, node, path):
    return r.estimator(node, path)


_DECODERS = {
    "__float__": _dec_float,
    "__scalar__": _dec_scalar,
    "__type__": _dec_type,
    "__pytype__": _dec_pytype,
    "__dtype__": _dec_dtype,
    "__path__": _dec_path,
    "__prompt__": _dec_prompt,
    "__model_handle__": _dec_model_handle,
    "__tuple__": _dec_tuple,
    "__ref__": _dec_ref,
    "__ndarray__": _dec_ndarray,
    "__strarray__": _dec_strarray,
    "__objarray__": _dec_objarray,
    "__sparse__": _dec_sparse,
    "__dict__": _dec_dict,
    "__strintdict__": _dec_strintdict,
    "__items__": _dec_items,
    "__bunch__": _dec_bunch,
    "__splitter__": _dec_splitter,
    "__estimator__": _dec_estimator,
}


def _read_document(json_path):
    try:
        raw = json_path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{json_path} not found: not a directory written by skafa.persistence.save."
        ) from None
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{json_path}: not valid JSON ({exc}); the file is truncated or was edited."
        ) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{json_path}: not a skafa estimator file (format "
                         f"{document.get('format') if isinstance(document, dict) else None!r}, "
                         f"expected {FORMAT!r}).")
    version = document.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ValueError(
            f"{json_path}: format version {version!r} is not supported by this skafa "
            f"(reads versions 1 to {FORMAT_VERSION}); upgrade skafa."
        )
    for key in ("tree", "tree_sha256", "arrays"):
        if key not in document:
            raise ValueError(f"{json_path}: the entry {key!r} is missing; the file is "
                             "truncated or was edited.")
    try:
        digest = _sha256(_canonical(document["tree"]))
    except ValueError as exc:  # NaN/inf smuggled into the tree
        raise ValueError(f"{json_path}: the estimator tree is not canonical JSON ({exc}).") \
            from None
    if digest != document["tree_sha256"]:
        raise ValueError(
            f"{json_path}: the estimator tree does not match the sha256 recorded in the same "
            f"file (recorded {document['tree_sha256']}, computed {digest}); the file was "
            "edited or corrupted."
        )
    return document


def _read_arrays(arrays_path, document, json_path):
    from safetensors.numpy import load as st_load

    try:
        blob = arrays_path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{arrays_path} not found; {json_path} refers to it (the save is incomplete)."
        ) from None
    recorded = document["arrays"].get("sha256") if isinstance(document["arrays"], dict) else None
    digest = _sha256(blob)
    if digest != recorded:
        size = document["arrays"].get("n_bytes") if isinstance(document["arrays"], dict) else None
        raise ValueError(
            f"{arrays_path}: sha256 check failed (file has {len(blob)} bytes and sha256 "
            f"{digest}; {JSON_NAME} records {size} bytes and sha256 {recorded}). The file is "
            "truncated, was edited, or belongs to another save."
        )
    try:
        return st_load(blob)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{arrays_path}: unreadable safetensors data ({exc}).") from exc


def _version_warnings(document, json_path):
    import sklearn

    from . import __version__ as skafa_version

    for lib, saved, now in (("scikit-learn", document.get("sklearn_version"), sklearn.__version__),
                            ("skafa", document.get("skafa_version"), skafa_version)):
        if saved != now:
            warnings.warn(
                f"{json_path} was written with {lib} {saved}; this is {lib} {now}. Fitted "
                "attributes are restored as saved; check predictions on a few examples.",
                PersistenceVersionWarning,
                stacklevel=3,
            )


def load(path, *, model=None, device=None, trust=(), verify_model=True):
    """Load an estimator written by :func:`save`, instantiating only allowlisted classes.

    Parameters
    ----------
    path : str or path-like
        Directory written by :func:`save`.
    model : str or ModelHandle, default=None
        Model for every model-reading step (``TurnActivationTransformer``,
        ``PromptedJudge``, and the ``model`` of a ``FailureAttributor``) instead
        of the saved name: e.g. a local path to the same GGUF file. Its
        architecture must match the saved fingerprint. The model named in the
        file is loaded through :func:`skafa.models.load_model`
        (``trust_remote_code=False``); pass ``model`` to choose it yourself.
    device : str, default=None
        Torch device for those steps instead of the saved one (e.g. ``"cpu"``
        for an estimator saved on a GPU machine).
    trust : iterable of str, default=()
        Extra classes (``"package.module.Class"``) that the file may use and that
        may be imported to build it. Only list classes you trust to be built from
        data (see the module docstring).
    verify_model : bool, default=True
        Load the model of every fitted model-reading step now and compare its
        architecture with the saved fingerprint. With ``False`` nothing is
        loaded; the extraction step still refuses a different architecture when
        it first loads the model.

    Returns
    -------
    estimator : estimator object
        The estimator as saved, fitted attributes restored.

    Raises
    ------
    ValueError
        Truncated, edited or inconsistent files (naming the file and the check
        that failed); a class outside the allowlist and ``trust`` (never
        imported); a model whose architecture differs from the saved one.
    FileNotFoundError
        When ``path`` holds no ``skafa.json`` or its ``arrays.safetensors``.

    Warns
    -----
    ModelMismatchWarning
        Same architecture, but another model name, file or weights.
    PersistenceVersionWarning
        Written by another version of scikit-learn or skafa.
    """
    path = Path(path).expanduser()
    json_path = path / JSON_NAME
    if path.is_file() and path.name == JSON_NAME:
        json_path, path = path, path.parent
    document = _read_document(json_path)
    arrays_name = document["arrays"].get("file", ARRAYS_NAME) \
        if isinstance(document["arrays"], dict) else ARRAYS_NAME
    if arrays_name != ARRAYS_NAME:
        raise ValueError(f"{json_path}: unexpected arrays file name {arrays_name!r}.")
    arrays = _read_arrays(path / ARRAYS_NAME, document, json_path)
    _version_warnings(document, json_path)
    if isinstance(trust, str):
        trust = [trust]
    reader = _Reader(arrays, json_path, model=model, device=device, trust=trust,
                     verify_model=verify_model)
    tree = document["tree"]
    if not isinstance(tree, dict) or "__estimator__" not in tree:
        raise ValueError(f"{json_path}: the tree does not describe an estimator.")
    return reader.decode(tree, "")
