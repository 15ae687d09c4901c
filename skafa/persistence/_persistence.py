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
    it; the *estimator tree*: for every estimator its class (by import path),
    its parameters (``get_params(deep=False)``; nested estimators recursively; a
    :class:`~skafa.llm.PromptTemplate` through its ``to_dict``) and its
    fitted state (numbers, strings, lists and dicts in JSON; arrays by reference
    into the safetensors file; sparse matrices as ``data``/``indices``/``indptr``
    arrays; shared objects by reference to their first occurrence); a summary of
    every model-reading step (model name, identity, architecture fingerprint,
    prompt settings, chat-template variables); and SHA-256 digests of the arrays
    file and of the tree.

:func:`load` rebuilds the estimator. It verifies both digests first (a
truncated or edited file raises a :class:`ValueError` naming the file and the
check that failed), then, for every fitted model-reading step
(:class:`~skafa.llm.TurnActivationTransformer`,
:class:`~skafa.baselines.PromptedJudge`), loads the model it will use (``model=``,
else the saved name) and compares its architecture fingerprint with the saved
one: a different architecture raises a :class:`ValueError`. The same
architecture with other weights (the SHA-256 digests of the weight files differ
from the saved ones, e.g. a relative ``models/tiny`` resolved from another
working directory) raises a :class:`ValueError` naming both places and both
digests, unless the caller names the model (``model=``) and allows it
(``allow_model_mismatch=True``): then it warns with
:class:`~skafa.exceptions.ModelMismatchWarning`, as it does for the same weights
under another name or place. Before any of that, every estimator's fitted
attributes are checked against each other (:meth:`PersistenceMixin._check_fitted_consistency`),
so a file whose arrays disagree is refused at load, naming the attribute and
both shapes, instead of failing inside numpy at predict.

What an estimator class declares
--------------------------------
There is no table of skafa classes here. Each class says, in its own module,
what persistence needs to know (:class:`PersistenceMixin` documents the
defaults; a class without the mixin gets them too):

``_runtime_attributes``
    Instance attributes that only exist at run time (a loaded model, a
    tokenizer, a cache, a scorer function): never written, refused on load.
``_load_overrides``
    Parameters that ``load(model=...)`` replaces (``"model"``).
``_runtime_params``
    Parameters that are settings of the machine running the estimator, not
    of the estimator (by default ``cache_dir``, ``n_jobs``, ``device``,
    ``verbose``, for every class, scikit-learn's included): never taken from
    the file; :func:`load` sets them to the caller's value or the
    constructor's default, so a file decides neither where skafa writes, nor
    how many processes it starts, nor which device it uses.
``_reads_model``
    ``True`` for a step that reads a language model: :func:`save` summarises it
    in ``skafa.json``.
``_check_fitted_consistency(self)``
    Raises :class:`ValueError` when the fitted attributes just set disagree
    with each other (the default does nothing); :func:`load` calls it before
    ``_restore_after_load`` and refuses the file, naming it, the place in the
    tree and the class's message. The class knows which of its arrays must
    agree (e.g. the sites a composite's selector reads and those its extractor
    produces).
``_restore_after_load(self, context)``
    Rebuilds the runtime attributes after the fitted state is set (the default
    does nothing); ``context`` is a :class:`LoadContext`; model-reading steps
    pass it to :func:`skafa.llm.verify_saved_model` for the model check above.

Consistency of fitted attributes
--------------------------------
Besides a class's own ``_check_fitted_consistency``, :func:`load` checks the
fitted attributes that follow scikit-learn's conventions on every skafa and
scikit-learn estimator (scikit-learn's classes cannot carry declarations, so,
as for the Pipeline, one adapter here knows them): ``n_features_in_`` is a
non-negative integer; ``coef_`` is an array with one column per feature
(``coef_.shape[-1] == n_features_in_``); an array ``intercept_`` has one entry
per row of a 2-D ``coef_``; ``classes_`` matches the rows of ``coef_`` (one row
for two classes, else one per class) and of ``theta_``/``class_count_``;
``mean_``, ``var_``, ``scale_``, ``theta_`` and ``components_`` have one entry
per feature on their last axis; ``best_index_`` is a row of ``cv_results_``,
whose columns all have the same length; and in a
:class:`~sklearn.pipeline.Pipeline` a scikit-learn step's output width equals
the next step's ``n_features_in_``. A file that breaks one of these loads no
further: :func:`load` raises its :class:`ValueError` naming the file, the place,
the attribute and both shapes, rather than letting numpy fail at predict.

scikit-learn's :class:`~sklearn.pipeline.Pipeline` cannot carry declarations, so
one small adapter here handles it (and its subclasses, such as
:class:`~skafa.compose.AttributionPipeline`): its ``memory`` (a joblib cache,
which holds pickles) is not restored, with a warning.

Which classes a file may name
-----------------------------
:func:`load` builds only

- estimators *defined in skafa*: a name ``skafa.<module>.<Class>`` is looked up
  by importing that module of skafa (never a module outside ``skafa``) and is
  accepted only if it resolves to a subclass of
  :class:`~sklearn.base.BaseEstimator` whose ``__module__`` is a skafa module
  and whose own import path resolves to the same class. Old paths
  (``skafa.probes.X``, ``skafa.baselines.X``, ``skafa.compose.X``) keep
  loading through their alias modules;
- a short explicit list of scikit-learn estimators and splitters
  (:func:`allowed_classes`), imported by skafa by their fixed public path;
- classes added with :func:`register_class`, or named by the caller in
  ``load(..., trust=[...])``.

Any other name is refused *without being imported*. A new skafa estimator
therefore needs no change here: its module and its docs page are the only
places that know about it.

Why a file from a stranger is safe to load
------------------------------------------
*No code execution.* The JSON can only name the classes above. Each is built
with keyword parameters that are plain data (numbers, strings, lists, dicts,
arrays, other allowed estimators) — scikit-learn constructors only store them —
and its fitted attributes are then set to plain data as well (never to
callables; names that would shadow a class attribute or method, or that the
class declares runtime-only, are refused). Arrays are read with
``safetensors``, which parses a JSON header and raw little-endian buffers.
There is no ``pickle``, no ``eval``, no import chosen by the file.

*Bounded allocations.* What :func:`load` allocates is bounded by what the file
can justify: each array of ``arrays.safetensors`` is used once (so the copies
total the file's size); a fixed-width string array must hold exactly the strings
its shape announces, none longer than its width; and everything that is not
backed by bytes of the file (string arrays' padding, object arrays, sparse
matrices converted back to their saved format, e.g. ``dia`` or ``lil``) is
charged to a budget of :data:`MAX_EXTRA_BYTES` plus :data:`EXTRA_BYTES_PER_BYTE`
times the size of the two files; going over it raises a :class:`ValueError`
before anything is allocated. JSON nested deeper than :data:`MAX_JSON_DEPTH`
levels is refused with a :class:`ValueError` (the deepest estimator skafa
writes nests far less). :func:`save` applies the same limits, so it never writes
a file that :func:`load` refuses.

*Tamper detection.* The SHA-256 of the arrays file and of the tree detect
truncation and accidental edits. They are stored in the same file, so they do
not authenticate it: someone who edits a file can recompute them. Every
structure is therefore validated on load as if it were hostile: shapes and
dtypes against the arrays, sparse ``indices``/``indptr`` in full (integer
dtypes, in range, non-decreasing), references to earlier objects only.

The worst a malicious file can do is describe a *wrong* model (bad
coefficients, a different prompt): as with any model you download, check where
it comes from and evaluate it before trusting its outputs.

Why not skops
-------------
``skops.io`` (0.16.0) is the scikit-learn community's pickle-free format.
Measured against the three points above (the experiment and its numbers are in
the saving section of ``docs/user-guide.md``):

- it cannot load ``Pipeline([PerTurn(TruncatedSVD()), probe])`` unless the
  caller trusts skafa's classes by name (``skops.io.get_untrusted_types``
  reports ``skafa.compose.PerTurn`` and
  ``skafa.probes.GroupedArgmaxLogisticClassifier``; the default load raises
  ``UntrustedTypesFoundException``); a trusted type then receives whatever
  attributes the file holds, runtime-only ones included;
- widening one string array's ``.npy`` header from ``<U1`` to ``<U200000000``
  makes it allocate 763 MiB before failing;
- it keeps no digest (an edited coefficient loads silently), and 100,000-deep
  nesting in its ``schema.json`` raises ``RecursionError``.

skafa therefore keeps its own format: it meets the bar with no extra
dependency, allows skafa's classes by where they are defined instead of by
trusted type names, and records the language model each step reads.

scikit-learn users may also persist these estimators with :mod:`joblib` or
:mod:`pickle` (skafa estimators pickle without their language-model weights).
That is faster and supports any class, but unpickling executes code chosen by
the file: only load pickles you made yourself or fully trust.

Extending the allowlist
-----------------------
A custom estimator outside skafa whose parameters and fitted attributes are
plain data can be allowed with :func:`register_class` (in the saving and in the
loading process), or at load time with ``load(path, trust=["package.module.Class"])``
— the only case in which :func:`load` imports a module outside skafa named in
the file, because the caller named it.

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
import re
import warnings
from pathlib import Path, PurePath

import numpy as np
import scipy.sparse as sp

from ..exceptions import PersistenceVersionWarning
from ..utils.fileio import atomic_write_bytes, read_regular_file

__all__ = [
    "save",
    "load",
    "register_value_codec",
    "register_class",
    "allowed_classes",
    "PersistenceMixin",
    "LoadContext",
    "FORMAT",
    "FORMAT_VERSION",
    "JSON_NAME",
    "ARRAYS_NAME",
    "MAX_JSON_DEPTH",
    "MAX_EXTRA_BYTES",
    "EXTRA_BYTES_PER_BYTE",
    "RUNTIME_PARAMS",
]

#: Name of the format, written to ``skafa.json``.
FORMAT = "skafa.estimator"
#: Version of the format; :func:`load` refuses files from a newer version.
#: 2: classes are named by their public path (``skafa.probes.X``) since the package was
#: laid out by concept (0.2.0); version-1 files named the old flat modules.
FORMAT_VERSION = 2
#: File names inside a saved directory.
JSON_NAME = "skafa.json"
ARRAYS_NAME = "arrays.safetensors"
#: Deepest nesting of JSON arrays and objects that :func:`load` reads and
#: :func:`save` writes. A saved, fitted ``FailureAttributor`` nests 21 levels.
MAX_JSON_DEPTH = 200
#: Memory :func:`load` may allocate beyond what the files' bytes back (string
#: padding, object arrays, sparse format conversions), plus
#: :data:`EXTRA_BYTES_PER_BYTE` per byte of the two files.
MAX_EXTRA_BYTES = 1 << 20
EXTRA_BYTES_PER_BYTE = 16


class _LoadError(ValueError):
    """A file :func:`load` refuses; the message names the file and the place."""


# ---------------------------------------------------------------------------
# What a class declares
# ---------------------------------------------------------------------------


class PersistenceMixin:
    """Declarations :mod:`skafa.persistence` reads from an estimator class.

    Inherit it (left of :class:`~sklearn.base.BaseEstimator`) and override what
    applies; the values below are the defaults for every class, with or without
    the mixin. Subclasses inherit the declarations like any class attribute.

    Attributes
    ----------
    _runtime_attributes : frozenset of str
        Instance attributes that exist only at run time (a loaded model, a
        tokenizer, a cache, a scorer function): :func:`save` skips them and
        :func:`load` refuses a file that sets them. Rebuild them in
        :meth:`_restore_after_load` or lazily.
    _load_overrides : frozenset of str
        Parameters replaced by the argument of the same name of :func:`load`
        when it is given (``"model"``).
    _runtime_params : frozenset of str
        Runtime settings among the parameters: :func:`load` never takes them
        from the file but from its keyword argument of the same name, or,
        when that is ``None``, from the constructor's default. The default set
        is :data:`RUNTIME_PARAMS`.
    _reads_model : bool
        The estimator reads a language model: :func:`save` writes a summary
        (model name, identity, fingerprint, prompt, chat-template variables) to
        ``skafa.json``'s ``models`` list.

    Examples
    --------
    >>> from sklearn.base import BaseEstimator
    >>> from skafa.persistence import PersistenceMixin
    >>> class CachedScaler(PersistenceMixin, BaseEstimator):
    ...     _runtime_attributes = frozenset({"_cache"})
    ...
    ...     def _restore_after_load(self, context):
    ...         self._cache = {}
    """

    _runtime_attributes = frozenset()
    _load_overrides = frozenset()
    _runtime_params = frozenset({"cache_dir", "n_jobs", "device", "verbose"})
    _reads_model = False

    def _check_fitted_consistency(self):
        """Check that the fitted attributes agree with each other (after :func:`load`).

        Override to check what only the class knows, e.g. that two arrays have
        the same length; :func:`load` calls it once the saved attributes are
        set, after checking scikit-learn's conventions (see the module
        docstring), and refuses the file naming it and the place.

        Raises
        ------
        ValueError
            Naming the attributes that disagree and their shapes or values.
        """

    def _restore_after_load(self, context):
        """Rebuild runtime-only state once the fitted attributes are set.

        Parameters
        ----------
        context : LoadContext
            Where the estimator sits in the file; its
            :meth:`~LoadContext.check_model` loads and checks a model.
        """


_DECLARATIONS = frozenset({"_runtime_attributes", "_load_overrides", "_runtime_params",
                           "_reads_model", "_restore_after_load",
                           "_check_fitted_consistency"})

#: Parameters that are runtime settings for every class (see
#: :attr:`PersistenceMixin._runtime_params`): never read from a file.
RUNTIME_PARAMS = PersistenceMixin._runtime_params


def _constructor_default(cls, name):
    """The default of ``cls.__init__``'s parameter ``name`` (None when it has none)."""
    import inspect

    try:
        param = inspect.signature(cls.__init__).parameters.get(name)
    except (TypeError, ValueError):
        return None
    if param is None or param.default is inspect.Parameter.empty:
        return None
    return param.default


def _declared(cls, name):
    """A persistence declaration of ``cls`` (code, never the file), or its default."""
    return getattr(cls, name, getattr(PersistenceMixin, name))


def _restore_pipeline(pipe, context):
    """scikit-learn Pipeline: ``memory`` is a joblib cache of pickles; never restored."""
    if pipe.memory is not None:
        context.warn(
            f"the Pipeline at {_where(context.path)} was saved with memory={pipe.memory!r}; "
            "it is not restored (a joblib cache holds pickles). Set it again after "
            "loading if you trust that cache directory.", UserWarning)
        pipe.memory = None


def _restore_hooks(est):
    """What runs after load: the adapter of a scikit-learn base, then the class's own."""
    from sklearn.pipeline import Pipeline

    hooks = []
    if isinstance(est, Pipeline):  # also covers skafa's AttributionPipeline
        hooks.append(lambda context: _restore_pipeline(est, context))
    method = getattr(type(est), "_restore_after_load", None)  # the class's, never the file's
    if method is not None:
        hooks.append(lambda context: method(est, context))
    return hooks


# ---------------------------------------------------------------------------
# Fitted attributes that must agree
# ---------------------------------------------------------------------------


def _is_array(value):
    return isinstance(value, np.ndarray) or sp.issparse(value)


def _shape_text(value):
    return str(tuple(value.shape)) if _is_array(value) else _short(value, 40)


def _fitted_int(state, name):
    """``state[name]`` as an int (None when absent); refuse anything but an integer."""
    if name not in state:
        return None
    value = state[name]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {_short(value, 40)}")
    return int(value)


def _fitted_array(state, name, ndims):
    """``state[name]`` when it is an array (None when absent or None); refuse another
    type or number of dimensions."""
    value = state.get(name)
    if value is None:
        return None
    if not _is_array(value) or value.ndim not in ndims:
        what = (f"a {value.ndim}-D array" if _is_array(value)
                else f"a {type(value).__name__} ({_short(value, 40)})")
        raise ValueError(f"{name} must be a {' or '.join(f'{d}-D' for d in ndims)} array, "
                         f"got {what}")
    return value


def _check_conventions(est):
    """scikit-learn's fitted-attribute conventions (see the module docstring): the
    shapes of ``coef_``, ``intercept_``, ``classes_``, per-feature statistics and
    search results must agree with each other and with ``n_features_in_``."""
    state = vars(est)
    n = _fitted_int(state, "n_features_in_")
    coef = _fitted_array(state, "coef_", (1, 2))
    classes = _fitted_array(state, "classes_", (1,))
    if coef is not None and n is not None and coef.shape[-1] != n:
        raise ValueError(f"coef_ has shape {_shape_text(coef)} but n_features_in_ is {n}: "
                         "one weight per feature is needed")
    if "intercept_" in state and state["intercept_"] is not None:
        intercept = state["intercept_"]
        if isinstance(intercept, np.ndarray):
            if intercept.ndim > 1:
                raise ValueError(f"intercept_ must be a number or a 1-D array, got shape "
                                 f"{_shape_text(intercept)}")
            if coef is not None and coef.ndim == 2 and intercept.ndim == 1 \
                    and intercept.shape[0] != coef.shape[0]:
                raise ValueError(f"intercept_ has shape {_shape_text(intercept)} but coef_ "
                                 f"has shape {_shape_text(coef)}: one intercept per row of "
                                 "coef_ is needed")
        elif isinstance(intercept, (bool, np.bool_)) \
                or not isinstance(intercept, (int, float, np.number)):
            raise ValueError(f"intercept_ must be a number or an array, got "
                             f"{_short(intercept, 40)}")
    if classes is not None and coef is not None and coef.ndim == 2 and classes.shape[0] >= 2:
        rows = 1 if classes.shape[0] == 2 else classes.shape[0]
        if coef.shape[0] != rows:
            raise ValueError(f"classes_ has shape {_shape_text(classes)} but coef_ has shape "
                             f"{_shape_text(coef)}: {classes.shape[0]} classes need "
                             f"{rows} row{'s' if rows > 1 else ''} of coefficients")
    for name in ("mean_", "var_", "scale_", "theta_", "components_"):
        value = state.get(name)
        if n is not None and isinstance(value, np.ndarray) and value.ndim >= 1 \
                and value.shape[-1] != n:
            raise ValueError(f"{name} has shape {_shape_text(value)} but n_features_in_ is "
                             f"{n}: one entry per feature is needed")
    if classes is not None:
        for name in ("theta_", "class_count_", "class_prior_"):
            value = state.get(name)
            if isinstance(value, np.ndarray) and value.ndim >= 1 \
                    and value.shape[0] != classes.shape[0]:
                raise ValueError(f"{name} has shape {_shape_text(value)} but classes_ has "
                                 f"shape {_shape_text(classes)}: one row per class is needed")
    components = state.get("components_")
    n_components = _fitted_int(state, "n_components_")
    if isinstance(components, np.ndarray) and components.ndim == 2 \
            and n_components is not None and components.shape[0] != n_components:
        raise ValueError(f"components_ has shape {_shape_text(components)} but n_components_ "
                         f"is {n_components}")
    _check_search_results(state)


def _check_search_results(state):
    """``best_index_`` is a row of ``cv_results_``; every column has one entry per row."""
    results = state.get("cv_results_")
    if "best_index_" not in state or not isinstance(results, dict):
        return
    best = _fitted_int(state, "best_index_")
    lengths = {k: len(v) for k, v in results.items()
               if isinstance(v, (np.ndarray, list)) and (not isinstance(v, np.ndarray)
                                                        or v.ndim >= 1)}
    if not lengths:
        return
    key = "mean_test_score" if "mean_test_score" in lengths else next(iter(lengths))
    n_rows = lengths[key]
    for k, length in lengths.items():
        if length != n_rows:
            raise ValueError(f"cv_results_[{_short(k, 40)}] has {length} rows but "
                             f"cv_results_[{key!r}] has {n_rows}")
    if best >= n_rows:
        raise ValueError(f"best_index_ is {best} but cv_results_ has {n_rows} rows "
                         f"(0..{n_rows - 1})")


def _features_out(step):
    """How many features a fitted scikit-learn transformer outputs, or None if unknown."""
    from sklearn.base import ClassNamePrefixFeaturesOutMixin, OneToOneFeatureMixin

    state = vars(step)
    if isinstance(step, OneToOneFeatureMixin):
        return _fitted_int(state, "n_features_in_")
    if isinstance(step, ClassNamePrefixFeaturesOutMixin):
        components = state.get("components_")
        if isinstance(components, np.ndarray) and components.ndim == 2:
            return int(components.shape[0])
    return None


def _check_pipeline(pipe):
    """Consecutive scikit-learn steps agree on the number of features between them."""
    steps = [(name, step) for name, step in getattr(pipe, "steps", ())
             if step is not None and step != "passthrough"]
    for (name_a, a), (name_b, b) in zip(steps, steps[1:]):
        if not (_is_sklearn(type(a)) and _is_sklearn(type(b))):
            continue
        out = _features_out(a)
        n_in = _fitted_int(vars(b), "n_features_in_")
        if out is not None and n_in is not None and out != n_in:
            raise ValueError(
                f"step {name_a!r} ({type(a).__name__}) outputs {out} features but the next "
                f"step {name_b!r} ({type(b).__name__}) was fitted with n_features_in_ "
                f"{n_in}")


def _is_sklearn(cls):
    return cls.__module__.split(".")[0] == "sklearn"


def _consistency_checks(est):
    """What checks the fitted state after load: the conventions adapter (skafa and
    scikit-learn classes), the Pipeline adapter, then the class's own hook."""
    from sklearn.pipeline import Pipeline

    cls = type(est)
    checks = []
    if cls.__module__.split(".")[0] in ("skafa", "sklearn"):
        checks.append(lambda: _check_conventions(est))
    if isinstance(est, Pipeline):
        checks.append(lambda: _check_pipeline(est))
    method = getattr(cls, "_check_fitted_consistency", None)  # the class's, never the file's
    if method is not None:
        checks.append(lambda: method(est))
    return checks


# ---------------------------------------------------------------------------
# Which classes a file may name
# ---------------------------------------------------------------------------

#: scikit-learn classes :func:`load` may build (by public import path). skafa's own
#: estimators are allowed by where they are defined, not listed here.
_SKLEARN_CLASSES = (
    # estimators
    "sklearn.pipeline.Pipeline",
    "sklearn.linear_model.LogisticRegression",
    "sklearn.svm.LinearSVC",
    "sklearn.naive_bayes.GaussianNB",
    "sklearn.preprocessing.StandardScaler",
    "sklearn.decomposition.PCA",
    "sklearn.decomposition.TruncatedSVD",
    "sklearn.feature_extraction.text.TfidfVectorizer",
    "sklearn.feature_extraction.text.CountVectorizer",
    "sklearn.feature_extraction.text.TfidfTransformer",
    # splitters (parameters only)
    "sklearn.model_selection.GroupKFold",
    "sklearn.model_selection.KFold",
    "sklearn.model_selection.StratifiedKFold",
    "sklearn.model_selection.StratifiedGroupKFold",
    "sklearn.model_selection.GroupShuffleSplit",
    "sklearn.model_selection.ShuffleSplit",
    "sklearn.model_selection.LeaveOneGroupOut",
)

_SKLEARN: dict = {}  # name -> class, filled on first use from _SKLEARN_CLASSES
_REGISTERED: dict = {}  # name -> class, from register_class
_SKAFA_NAME = re.compile(r"skafa(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _import_class(name):
    module, _, attr = name.rpartition(".")
    if not module:
        raise ValueError(f"{name!r} is not a 'package.module.Class' path.")
    obj = getattr(importlib.import_module(module), attr, None)
    if not isinstance(obj, type):
        raise ValueError(f"{name!r} does not name a class.")
    return obj


def _sklearn_classes():
    if not _SKLEARN:
        _SKLEARN.update({name: _import_class(name) for name in _SKLEARN_CLASSES})
    return _SKLEARN


def _skafa_class(name):
    """The estimator class ``name`` refers to if it is a public skafa estimator, else None.

    ``name`` must be a public path listed by :func:`skafa.utils.all_estimators`
    (``skafa.probes.GroupedArgmaxLogisticClassifier``); it is looked up in that
    table, so a name from a file never makes skafa import a module it names.
    """
    if not isinstance(name, str) or _SKAFA_NAME.fullmatch(name) is None:
        return None
    from ..utils import public_estimator_paths

    return public_estimator_paths().get(name)


def _default_class(name):
    """The class ``name`` refers to without registration or trust, else None."""
    return _sklearn_classes().get(name) or _skafa_class(name)


def _class_name(cls):
    """Name written to the file for ``cls``, or None when load could not build it."""
    for name, c in _REGISTERED.items():
        if c is cls:
            return name
    for name, c in _sklearn_classes().items():
        if c is cls:
            return name
    from ..utils import public_path

    name = public_path(cls)
    return name if name is not None and _skafa_class(name) is cls else None


def allowed_classes():
    """Import paths of the classes :func:`load` instantiates without ``trust``.

    Returns
    -------
    names : list of str
        Sorted: skafa's public estimators (found by
        :func:`skafa.utils.all_estimators`), the scikit-learn classes skafa
        allows, and anything added with :func:`register_class`. Any other
        class is refused.
    """
    from ..utils import public_estimator_paths

    return sorted({*public_estimator_paths(), *_sklearn_classes(), *_REGISTERED})


def register_class(cls, *, name=None):
    """Allow a custom estimator class in :func:`save` and :func:`load` (this process).

    Only register classes whose parameters and fitted attributes are plain data
    (numbers, strings, lists, dicts, numpy arrays, sparse matrices, allowed
    estimators) and whose ``__init__`` only stores its arguments: loading a file
    calls ``cls(**params)`` with parameters read from the file. Estimators
    defined in skafa need no registration.

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
    current = _REGISTERED.get(name) or _default_class(name)
    if current is not None and current is not cls:
        raise ValueError(f"{name!r} is already allowlisted for another class ({current!r}).")
    _REGISTERED[name] = cls
    return name


def _unsupported_save(obj, path):
    cls = type(obj)
    full = f"{cls.__module__}.{cls.__qualname__}"
    return TypeError(
        f"skafa.persistence.save: cannot save {full} at {_where(path)}: it is neither an "
        "estimator defined in skafa nor one of the scikit-learn classes that can be loaded "
        "without running code from the file (skafa.persistence.allowed_classes()). If its "
        "parameters and fitted attributes are plain data (numbers, strings, arrays, dicts, "
        f"allowed estimators), allow it with skafa.persistence.register_class({cls.__qualname__}) "
        f"in the saving process, and register it (or pass trust=[{full!r}]) when loading. "
        "Otherwise persist the estimator with joblib (whose files execute code when "
        "loaded: trusted files only)."
    )


def _where(path):
    return f"'{path}'" if path else "the root"


# ---------------------------------------------------------------------------
# Limits shared by save and load
# ---------------------------------------------------------------------------


def _json_depth(obj):
    """Nesting depth of a parsed JSON value (iterative: never recurses)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            return depth
        stack.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    return deepest


def _extra_bytes_allowed(n_file_bytes):
    return MAX_EXTRA_BYTES + EXTRA_BYTES_PER_BYTE * int(n_file_bytes)


def _sparse_conversion_bytes(fmt, shape, nnz, n_diagonals, itemsize):
    """Memory a csr/csc matrix needs to become ``fmt`` (upper bound)."""
    rows, cols = shape
    if fmt in ("csr", "csc"):
        return 0
    if fmt == "coo":
        return nnz * (itemsize + 16)
    if fmt == "dok":
        return nnz * (itemsize + 200)
    if fmt == "lil":  # one Python list of indices and one of values per row
        return rows * 2 * 64 + nnz * (itemsize + 40)
    if fmt == "dia":
        return n_diagonals * cols * itemsize + n_diagonals * 8
    if fmt == "bsr":  # blocks are chosen so that they are mostly filled
        return 2 * nnz * (itemsize + 8)
    return None
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


def _contains(outer, path):
    """Whether the place ``outer`` holds ``path`` (a reference there is a cycle)."""
    return outer == "" or path == outer or path.startswith(outer + ".")


def _is_estimator_like(obj):
    return hasattr(obj, "get_params") and hasattr(obj, "fit")


def _is_splitter_like(obj):
    return hasattr(obj, "split") and hasattr(obj, "get_n_splits") and not isinstance(obj, type)


class _Writer:
    def __init__(self):
        self.arrays = {}
        self.extra_bytes = 0  # what load allocates beyond the files' bytes (same count)
        self.memo = {}  # id(obj) -> path
        self.keep = []  # keeps memoized objects alive so ids stay unique
        self.models = []

    # ------------------------------------------------------------- helpers
    def _memo(self, obj, path):
        ref = self.memo.get(id(obj))
        if ref is not None:
            if _contains(ref, path):
                raise ValueError(
                    f"skafa.persistence.save: the value at {_where(path)} is the object at "
                    f"{_where(ref)}, which contains it: a reference cycle. scikit-learn's "
                    "clone() cannot copy such a parameter either (it recurses without "
                    "end); break the cycle.")
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
        for cls, (tag, to_plain, _) in _VALUE_CODECS.items():
            if isinstance(value, cls):
                return {tag: to_plain(value)}
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
            self.extra_bytes += arr.size * arr.dtype.itemsize
            return {"__strarray__": arr.tolist(), "dtype": arr.dtype.str.lstrip("<>=|"),
                    "shape": list(arr.shape)}
        if kind == "O":
            self.extra_bytes += 8 * arr.size
            flat = [self.encode(v, _join(path, i)) for i, v in enumerate(arr.ravel().tolist())]
            return {"__objarray__": flat, "shape": list(arr.shape)}
        raise TypeError(f"skafa.persistence.save: {_where(path)} is an array of dtype "
                        f"{arr.dtype}, which the format does not support.")

    def _sparse(self, value, path):
        fmt = value.format if value.format in ("csr", "csc") else "csr"
        m = value.asformat(fmt)
        m.sort_indices()
        kind = "array" if isinstance(value, sp.sparray) else "matrix"
        self.extra_bytes += _sparse_conversion_bytes(
            value.format, m.shape, m.nnz, _n_diagonals(m) if value.format == "dia" else 0,
            m.data.dtype.itemsize) or 0
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
        name = _class_name(type(value))
        if name is None:
            raise _unsupported_save(value, path)
        params = {}
        for p in inspect.signature(type(value).__init__).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            params[p.name] = self.encode(getattr(value, p.name), _join(path, p.name))
        return {"__splitter__": name, "params": params}

    def _estimator(self, est, path):
        cls = type(est)
        name = _class_name(cls)
        if name is None:
            raise _unsupported_save(est, path)
        params = est.get_params(deep=False)
        runtime = _declared(cls, "_runtime_attributes")
        state = {k: v for k, v in vars(est).items() if k not in params and k not in runtime}
        node = {"__estimator__": name}
        node["params"] = {k: self.encode(v, _join(path, k)) for k, v in params.items()}
        node["state"] = {k: self.encode(v, _join(path, k)) for k, v in state.items()}
        if _declared(cls, "_reads_model"):
            self.models.append(_model_summary(est, name, path))
        return node


def _n_diagonals(m):
    """Number of distinct diagonals holding a stored entry of a csr/csc matrix."""
    if m.nnz == 0:
        return 0
    major = np.repeat(np.arange(len(m.indptr) - 1), np.diff(m.indptr))
    rows, cols = (major, m.indices) if m.format == "csr" else (m.indices, major)
    return int(np.unique(cols.astype(np.int64) - rows).size)


#: ``model -> str`` registered by the module that resolves models (skafa.llm), so
#: this module names none: where the model of a saved estimator lives (absolute path).
_MODEL_LOCATOR = None


def register_model_locator(func):
    """Teach :func:`save` where a model-reading estimator's model lives.

    ``func(model)`` returns the resolved location of the estimator's ``model``
    parameter (an absolute folder or file path, a registered name, a hub id)
    or ``None``; :func:`save` records it in ``skafa.json`` next to the model's
    identity (its weights digest), and :class:`LoadContext` gives it back as
    ``saved_model_location``, so a load that finds another model under the same
    (relative) name can name both places.

    Parameters
    ----------
    func : callable
    """
    global _MODEL_LOCATOR
    _MODEL_LOCATOR = func


def _model_location(est):
    model = getattr(est, "model", None)
    if _MODEL_LOCATOR is None or model is None:
        return None
    try:
        return _MODEL_LOCATOR(model)
    except (OSError, ValueError, TypeError, KeyError):
        return None  # not resolvable here (a hub id offline, a model gone): nothing to record


def _model_summary(est, name, path):
    prompt = getattr(est, "prompt_", None) or getattr(est, "prompt", None)
    kwargs = getattr(est, "chat_template_kwargs", None)
    return {
        "path": path,
        "class": name,
        "model": str(getattr(est, "model", None)),
        "model_location": _model_location(est),
        "model_identity": getattr(est, "model_identity_", None),
        "model_fingerprint": getattr(est, "model_fingerprint_", None),
        "dtype": getattr(est, "dtype_", None) or getattr(est, "dtype", None),
        "sites": list(getattr(est, "sites_", ()) or ()) or None,
        "prompt": None if prompt is None else prompt.to_dict(),
        "chat_template_kwargs": None if kwargs is None else dict(kwargs),
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
        A (fitted or unfitted) estimator: any estimator defined in skafa, a
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
        For a class that :func:`load` would not build (the message says how to
        allow it) or a value that is not plain data (a callable parameter, a
        RandomState).
    ValueError
        For an estimator that :func:`load` would refuse: nested deeper than
        :data:`MAX_JSON_DEPTH`, or holding fixed-width string arrays (or sparse
        matrices in ``dia``/``lil``/... format) much larger than the file.
    """
    from safetensors.numpy import save as st_save

    from .._version import __version__ as skafa_version

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
    depth = _json_depth(document)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"skafa.persistence.save: the estimator nests {depth} levels deep in JSON, more "
            f"than load accepts (MAX_JSON_DEPTH={MAX_JSON_DEPTH}); flatten its parameters."
        )
    data = json.dumps(document, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8")
    allowed = _extra_bytes_allowed(len(data) + len(arrays_blob))
    if writer.extra_bytes > allowed:
        raise ValueError(
            f"skafa.persistence.save: loading this estimator would allocate "
            f"{writer.extra_bytes} bytes beyond its {len(data) + len(arrays_blob)} bytes of "
            f"files (fixed-width string arrays, object arrays, sparse matrices in dia/lil/dok "
            f"format), more than load allows ({allowed}); store such attributes as object "
            "arrays of str, or as csr/csc matrices."
        )
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path / ARRAYS_NAME, arrays_blob)
    atomic_write_bytes(json_path, data)
    return path


# ---------------------------------------------------------------------------
# Decoding (JSON tree + arrays -> estimator)
# ---------------------------------------------------------------------------


def _short(value, limit=80):
    """``repr(value)``, cut to ``limit`` characters (a hostile file may hold huge values)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _clip(value, limit=80):
    """``str(value)``, cut to ``limit`` characters."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


#: value type -> (tag, to_plain, from_plain): plain-data values other modules teach
#: persistence to store (e.g. ``PromptTemplate``, ``ModelHandle``); see
#: :func:`register_value_codec`.
_VALUE_CODECS: dict = {}
_CODEC_DECODERS: dict = {}  # tag -> from_plain


def register_value_codec(cls, tag, to_plain, from_plain):
    """Teach :func:`save` and :func:`load` a plain-data parameter type.

    The class that owns the knowledge registers it from its own module, so this
    module names no skafa class. ``to_plain(value)`` must return JSON data (str,
    numbers, lists, dicts); ``from_plain(data)`` rebuilds the value and raises
    ``ValueError`` or ``TypeError`` on data it does not accept (the loader then
    names the file and the place).

    Parameters
    ----------
    cls : type
    tag : str
        ``"__name__"``, unique: the key written to the file.
    to_plain, from_plain : callable
    """
    if not (isinstance(tag, str) and tag.startswith("__") and tag.endswith("__")):
        raise ValueError(f"tag must look like '__name__', got {tag!r}.")
    def same(a, b):  # the same object, or the same one from a re-imported module
        return a is b or (getattr(a, "__module__", None) == getattr(b, "__module__", 0)
                          and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0))

    if tag in _DECODERS or not same(_CODEC_DECODERS.get(tag, from_plain), from_plain):
        raise ValueError(f"the tag {tag!r} is already used.")
    for old_cls, (old_tag, _, _) in list(_VALUE_CODECS.items()):
        if old_tag == tag:  # a re-imported module registers its class again
            del _VALUE_CODECS[old_cls]
    _VALUE_CODECS[cls] = (tag, to_plain, from_plain)
    _CODEC_DECODERS[tag] = from_plain


def _codec_decoder(tag):
    if not isinstance(tag, str):
        return None
    if tag not in _CODEC_DECODERS and re.fullmatch(r"__[a-z_]+__", tag):
        from ..utils import public_estimator_paths

        public_estimator_paths()  # imports the public modules: they register their codecs
    from_plain = _CODEC_DECODERS.get(tag)
    if from_plain is None:
        return None
    return lambda r, node, path: from_plain(node[tag])


class LoadContext:
    """What an estimator's ``_restore_after_load`` receives from :func:`load`.

    Attributes
    ----------
    path : str
        Where the estimator sits in the saved tree (``""`` for the root), e.g.
        ``"steps.0.1"``.
    json_path : pathlib.Path
        The ``skafa.json`` being loaded.
    """

    def __init__(self, reader, path):
        self._reader = reader
        self.path = path
        self.json_path = reader.json_path

    @property
    def verify_model(self):
        """False when :func:`load` was called with ``verify_model=False``."""
        return self._reader.verify_model

    @property
    def model_named(self):
        """True when :func:`load` was called with ``model=`` (the caller named the model
        every model-reading step uses instead of the saved one)."""
        return self._reader.model is not None

    @property
    def allow_model_mismatch(self):
        """True when :func:`load` was called with ``allow_model_mismatch=True`` (always
        together with ``model=``): a named model of the saved architecture whose weights
        differ from the saved ones is used, with a
        :class:`~skafa.exceptions.ModelMismatchWarning`, instead of being refused."""
        return self._reader.allow_model_mismatch

    @property
    def saved_model(self):
        """The model name or path the estimator at :attr:`path` was saved with, or None."""
        return self._reader.saved_models.get(self.path)

    @property
    def saved_model_location(self):
        """Where that model was when the estimator was saved (the absolute path the
        name resolved to; see :func:`register_model_locator`), or None."""
        return self._reader.saved_locations.get(self.path)

    def warn(self, message, category=UserWarning):
        """Warn about the estimator at :attr:`path`, naming the file."""
        warnings.warn(f"{self.json_path}: {message}", category, stacklevel=5)

    def fail(self, message):
        """A :class:`ValueError` naming the file and :attr:`path`, to raise."""
        return self._reader.fail(self.path, message)


def _saved_locations(document):
    """``{tree path: model location}`` from the file's model summary (text for messages
    only: a hostile value is clipped, never followed)."""
    models = document.get("models")
    out = {}
    for entry in models if isinstance(models, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) \
                and isinstance(entry.get("model_location"), str):
            out[entry["path"]] = _clip(entry["model_location"], 500)
    return out


class _Reader:
    def __init__(self, arrays, json_path, *, n_file_bytes, model, runtime, trust,
                 verify_model, allow_model_mismatch=False):
        self.arrays = arrays
        self.json_path = json_path
        self.model = model
        self.allow_model_mismatch = bool(allow_model_mismatch)
        self.runtime = runtime  # name -> the caller's value (None: constructor default)
        self.verify_model = verify_model
        self.trust = {str(t) for t in trust}
        self.objects = {}
        self.saved_models = {}  # path -> model name as saved
        self.saved_locations = {}  # path -> where the model was at save time (skafa.json)
        self.used_arrays = set()
        self.n_file_bytes = n_file_bytes
        self.extra_bytes = 0
        self.extra_allowed = _extra_bytes_allowed(n_file_bytes)

    def fail(self, path, message):
        return _LoadError(f"{self.json_path}: {message} (at {_where(path)}).")

    def charge(self, n_bytes, path, what):
        """Count memory not backed by the files' bytes; refuse before allocating it."""
        self.extra_bytes += int(n_bytes)
        if self.extra_bytes > self.extra_allowed:
            raise self.fail(
                path, f"{what} would allocate {int(n_bytes)} bytes; with what was allocated "
                      f"before, that is more than the file's {self.n_file_bytes} bytes can "
                      f"justify (at most {self.extra_allowed} bytes beyond them: "
                      f"MAX_EXTRA_BYTES + EXTRA_BYTES_PER_BYTE x file size)")

    # ------------------------------------------------------------ classes
    def lookup(self, name, path):
        if not isinstance(name, str):
            raise self.fail(path, f"class name must be a string, got {_short(name)}")
        cls = _REGISTERED.get(name) or _default_class(name)
        if cls is not None:
            return cls
        if name in self.trust:
            try:
                cls = _import_class(name)
            except (ImportError, ValueError) as exc:
                raise self.fail(path, f"the trusted class {name!r} cannot be imported: "
                                      f"{exc}") from exc
            return cls
        raise _LoadError(
            f"{self.json_path}: refusing to load class {_short(name)} at {_where(path)}: it "
            "is neither an estimator defined in skafa nor one of the scikit-learn classes "
            "that can be built from data, and it was not imported. If you trust this file "
            f"and that class, load with trust=[{_short(name)}] (or call "
            "skafa.persistence.register_class on it first)."
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
            raise self.fail(path, f"unexpected JSON value {_short(value)}")
        tag = next(iter(value))
        handler = _DECODERS.get(tag) or _codec_decoder(tag)
        if handler is None:
            raise self.fail(path, f"unknown entry type {_short(tag)}")
        try:
            return handler(self, value, path)
        except _LoadError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError,
                OverflowError) as exc:
            raise self.fail(path, f"malformed {tag} entry ({type(exc).__name__}: "
                                  f"{_clip(exc, 200)})") from exc

    def array(self, node, path):
        key = node["__ndarray__"]
        if not isinstance(key, str) or key not in self.arrays:
            raise self.fail(path, f"array {_short(key)} is missing from {ARRAYS_NAME}")
        if key in self.used_arrays:
            raise self.fail(path, f"array {key!r} of {ARRAYS_NAME} is used more than once "
                                  "(save writes each array once; shared arrays are "
                                  "references)")
        self.used_arrays.add(key)
        arr = self.arrays[key]
        shape = _shape(self, node.get("shape"), path)
        if shape == () and arr.shape == (1,):
            arr = arr.reshape(())  # safetensors returns 0-d tensors as shape (1,)
        dtype = np.dtype(node["dtype"])
        if arr.dtype != dtype or arr.shape != shape:
            raise self.fail(path, f"array {key!r} in {ARRAYS_NAME} has dtype {arr.dtype} and "
                                  f"shape {arr.shape}, but {dtype} and {shape} are recorded")
        order = node.get("order", "C")
        if order not in ("C", "F"):
            raise self.fail(path, f"bad array order {_short(order)}")
        arr = np.array(arr, order=order, copy=True)
        self.objects[path] = arr
        return arr

    def estimator(self, node, path):
        name = node["__estimator__"]
        cls = self.lookup(name, path)
        if not isinstance(node["params"], dict) or not isinstance(node["state"], dict):
            raise self.fail(path, "an estimator's params and state must be JSON objects")
        params = {k: self.decode(v, _join(path, k)) for k, v in node["params"].items()}
        overrides = _declared(cls, "_load_overrides")
        if "model" in overrides:
            self.saved_models[path] = str(params.get("model"))
            if self.model is not None:
                params["model"] = self.model
        for key in _declared(cls, "_runtime_params") & params.keys():
            # a runtime setting comes from the caller, never from the file
            value = self.runtime.get(key)
            params[key] = _constructor_default(cls, key) if value is None else value
        try:
            est = cls(**params)
        except TypeError as exc:
            raise self.fail(path, f"{name} does not accept the saved parameters "
                                  f"{_short(sorted(params), 200)}: {exc}") from exc
        self.objects[path] = est
        runtime = _declared(cls, "_runtime_attributes")
        for key, raw in node["state"].items():
            if (not key.isidentifier() or key.startswith("__") or key in runtime
                    or key in _DECLARATIONS or hasattr(type(est), key) or key in params):
                raise self.fail(path, f"refusing to set attribute {_short(key)} on {name}")
            value = self.decode(raw, _join(path, key))
            if callable(value) and not isinstance(value, type) \
                    and not _is_estimator_like(value):
                raise self.fail(path, f"refusing a callable value for {key!r}")
            setattr(est, key, value)
        for check in _consistency_checks(est):
            try:
                check()
            except _LoadError:
                raise
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                raise self.fail(path, f"the fitted attributes of {name} disagree: "
                                      f"{_clip(exc, 500)}; the file was edited or "
                                      "corrupted, or written by a skafa with another "
                                      "layout") from exc
        for hook in _restore_hooks(est):
            try:
                hook(LoadContext(self, path))
            except _LoadError:
                raise
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                raise self.fail(path, f"{name} could not restore its runtime state from the "
                                      f"saved attributes ({type(exc).__name__}: "
                                      f"{_clip(exc, 200)})") from exc
        return est


def _shape(r, value, path):
    if (not isinstance(value, list) or len(value) > 64
            or not all(type(v) is int and v >= 0 for v in value)):
        raise r.fail(path, f"bad shape {_short(value)}")
    return tuple(value)


def _dec_float(r, node, path):
    text = node["__float__"]
    if text not in ("nan", "inf", "-inf"):
        raise r.fail(path, f"bad float {_short(text)}")
    return float(text)


def _dec_scalar(r, node, path):
    dtype = np.dtype(node["__scalar__"])
    value = node["value"]
    if isinstance(value, dict):
        value = _dec_float(r, value, path)
    if dtype.kind not in _SAFETENSORS_KINDS + "US":
        raise r.fail(path, f"unsupported scalar dtype {dtype}")
    if dtype.kind in "US" and not isinstance(value, str):
        raise r.fail(path, f"a {dtype} scalar needs a string value")
    if dtype.kind == "S":
        value = value.encode("latin-1")
    return dtype.type(value)


def _dec_type(r, node, path):
    dtype = np.dtype(node["__type__"])
    if dtype.kind not in _SAFETENSORS_KINDS:
        raise r.fail(path, f"unsupported type {dtype}")
    return dtype.type


def _dec_pytype(r, node, path):
    t = _PY_TYPES.get(node["__pytype__"])
    if t is None:
        raise r.fail(path, f"unsupported type {_short(node['__pytype__'])}")
    return t


def _dec_dtype(r, node, path):
    dtype = np.dtype(node["__dtype__"])
    if dtype.kind not in _SAFETENSORS_KINDS + "U":
        raise r.fail(path, f"unsupported dtype {dtype}")
    return dtype


def _dec_path(r, node, path):
    if not isinstance(node["__path__"], str):
        raise r.fail(path, "a path must be a string")
    return node["__path__"]


def _dec_tuple(r, node, path):
    if not isinstance(node["__tuple__"], list):
        raise r.fail(path, "a tuple must be a JSON list")
    return tuple(r.decode(v, _join(path, i)) for i, v in enumerate(node["__tuple__"]))


def _dec_ref(r, node, path):
    target = node["__ref__"]
    if not isinstance(target, str) or target not in r.objects:
        raise r.fail(path, f"reference to {_short(target)}, which was not loaded before it")
    if _contains(target, path):
        raise r.fail(path, f"reference to {_where(target)}, which contains it: a reference "
                           "cycle (scikit-learn's clone() would recurse without end on it)")
    return r.objects[target]


def _dec_ndarray(r, node, path):
    return r.array(node, path)


def _flatten(r, entries, shape, path):
    """The leaves of nested lists that must have exactly ``shape`` (no recursion)."""
    items = [entries]
    for dim in shape:
        nxt = []
        for item in items:
            if not isinstance(item, list) or len(item) != dim:
                raise r.fail(path, f"the entries do not have the recorded shape {shape}")
            nxt.extend(item)
        items = nxt
    return items


def _dec_strarray(r, node, path):
    dtype = np.dtype(node["dtype"])
    if dtype.kind != "U":
        raise r.fail(path, f"bad string dtype {dtype}")
    shape = _shape(r, node["shape"], path)
    flat = _flatten(r, node["__strarray__"], shape, path)
    if not all(type(s) is str for s in flat):
        raise r.fail(path, "a string array holds a value that is not a string")
    longest = max(map(len, flat), default=0)
    if longest > dtype.itemsize // 4:
        raise r.fail(path, f"a string of {longest} characters is wider than the array's "
                           f"dtype {dtype}")
    r.charge(len(flat) * dtype.itemsize, path,
             f"a string array of shape {shape} and dtype {dtype}")
    arr = np.array(flat, dtype=dtype).reshape(shape)
    r.objects[path] = arr
    return arr


def _dec_objarray(r, node, path):
    shape = _shape(r, node["shape"], path)
    entries = node["__objarray__"]
    if not isinstance(entries, list) or math.prod(shape) != len(entries):
        raise r.fail(path, f"object array of shape {shape} has "
                           f"{len(entries) if isinstance(entries, list) else 'no'} entries")
    r.charge(8 * len(entries), path, f"an object array of shape {shape}")
    arr = np.empty(len(entries), dtype=object)
    r.objects[path] = arr
    for i, v in enumerate(entries):
        arr[i] = r.decode(v, _join(path, i))
    arr = arr.reshape(shape)
    r.objects[path] = arr
    return arr


_SPARSE_FORMATS = ("csr", "csc", "coo", "lil", "dok", "dia", "bsr")


def _dec_sparse(r, node, path):
    fmt = node["__sparse__"]
    if fmt not in ("csr", "csc"):
        raise r.fail(path, f"bad sparse format {_short(fmt)}")
    original = node.get("original_format", fmt)
    container = node.get("container", "matrix")
    if original not in _SPARSE_FORMATS or container not in ("matrix", "array"):
        raise r.fail(path, f"bad sparse format {_short(original)} / {_short(container)}")
    shape = _shape(r, node["shape"], path)
    if len(shape) != 2:
        raise r.fail(path, f"a sparse matrix needs a 2-d shape, got {shape}")
    data = r.array(node["data"], _join(path, "data"))
    indices = r.array(node["indices"], _join(path, "indices"))
    indptr = r.array(node["indptr"], _join(path, "indptr"))
    # Validate every part before scipy sees it (scipy casts float or bool indices).
    for part, arr in (("indices", indices), ("indptr", indptr)):
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise r.fail(path, f"sparse {part} must be a 1-d integer array, got dtype "
                               f"{arr.dtype} and shape {arr.shape}")
    if data.ndim != 1 or data.size != indices.size:
        raise r.fail(path, f"sparse data has shape {data.shape} for {indices.size} indices")
    n_major, n_minor = shape if fmt == "csr" else shape[::-1]
    if indptr.size != n_major + 1:
        raise r.fail(path, f"sparse indptr has {indptr.size} entries for {n_major} "
                           f"{'rows' if fmt == 'csr' else 'columns'}")
    too_big = indptr.dtype.kind == "u" and int(indptr.max()) > np.iinfo(np.int64).max
    ptr = indptr.astype(np.int64)
    if too_big or int(ptr[0]) != 0 or int(ptr[-1]) != indices.size \
            or bool(np.any(np.diff(ptr) < 0)):
        raise r.fail(path, f"sparse indptr must rise from 0 to {indices.size} without "
                           "decreasing")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= n_minor):
        raise r.fail(path, f"sparse indices must lie in [0, {n_minor})")
    n_diagonals = 0
    if original == "dia":
        major = np.repeat(np.arange(n_major, dtype=np.int64), np.diff(ptr))
        rows, cols = (major, indices) if fmt == "csr" else (indices, major)
        n_diagonals = int(np.unique(cols.astype(np.int64) - rows).size)
    r.charge(_sparse_conversion_bytes(original, shape, indices.size, n_diagonals,
                                      data.dtype.itemsize), path,
             f"a {shape[0]} x {shape[1]} sparse matrix in {original} format")
    cls = {("csr", False): sp.csr_matrix, ("csc", False): sp.csc_matrix,
           ("csr", True): sp.csr_array, ("csc", True): sp.csc_array}[(fmt, container == "array")]
    m = cls((data, indices, indptr), shape=shape)
    m.check_format(full_check=True)
    m = m.asformat(original)
    r.objects[path] = m
    return m


def _dec_dict(r, node, path):
    items = node["__dict__"]
    if not isinstance(items, dict):
        raise r.fail(path, "a dict must be a JSON object")
    out = {}
    r.objects[path] = out
    for k, v in items.items():
        out[k] = r.decode(v, _join(path, k))
    return out


def _dec_strintdict(r, node, path):
    keys = node["__strintdict__"]
    values = r.array(node["values"], path)
    if (not isinstance(keys, list) or not all(type(k) is str for k in keys)
            or values.ndim != 1 or len(keys) != values.shape[0] or values.dtype.kind not in "iu"):
        raise r.fail(path, "keys and values of a str->int dict do not match")
    vals = values.tolist() if node.get("python_int") else list(values)
    out = dict(zip(keys, vals))
    r.objects[path] = out
    return out


def _dec_items(r, node, path):
    pairs = node["__items__"]
    if not isinstance(pairs, list):
        raise r.fail(path, "dict items must be a JSON list")
    out = {}
    r.objects[path] = out
    for i, pair in enumerate(pairs):
        if not isinstance(pair, list) or len(pair) != 2:
            raise r.fail(path, f"dict item {i} is not a [key, value] pair")
        key = r.decode(pair[0], _join(path, f"key{i}"))
        try:
            hash(key)
        except TypeError:
            raise r.fail(path, f"unhashable dict key {_short(key)}") from None
        out[key] = r.decode(pair[1], _join(path, i))
    return out


def _dec_bunch(r, node, path):
    from sklearn.utils import Bunch

    items = node["__bunch__"]
    if not isinstance(items, dict):
        raise r.fail(path, "a Bunch must be a JSON object")
    out = Bunch()
    r.objects[path] = out
    for k, v in items.items():
        out[k] = r.decode(v, _join(path, k))
    return out


def _dec_splitter(r, node, path):
    cls = r.lookup(node["__splitter__"], path)
    if not isinstance(node["params"], dict):
        raise r.fail(path, "a splitter's params must be a JSON object")
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
        raw = read_regular_file(json_path)  # regular files only, at most their size
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{json_path} not found: not a directory written by skafa.persistence.save."
        ) from None
    too_deep = ValueError(
        f"{json_path}: the JSON nests more than {MAX_JSON_DEPTH} levels deep "
        f"(MAX_JSON_DEPTH); skafa never writes such a file, so it was edited or corrupted."
    )
    try:
        document = json.loads(raw.decode("utf-8"))
    except RecursionError:  # json.loads recurses once per level; refuse it cleanly
        raise too_deep from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit int
        raise ValueError(
            f"{json_path}: not valid JSON ({_clip(exc, 200)}); the file is truncated "
            "or was edited."
        ) from None
    if _json_depth(document) > MAX_JSON_DEPTH:
        raise too_deep
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise ValueError(f"{json_path}: not a skafa estimator file (format "
                         f"{_short(found)}, expected {FORMAT!r}).")
    version = document.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        hint = ("it names classes by the module paths of skafa before 0.2 (a flat package); "
                "fit and save it again with this skafa" if version == 1 else "upgrade skafa")
        raise ValueError(
            f"{json_path}: format version {_clip(version)} is not supported by this skafa "
            f"(reads version {FORMAT_VERSION}); {hint}."
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
            f"file (recorded {_short(document['tree_sha256'])}, computed {digest}); the file "
            "was edited or corrupted."
        )
    return document, len(raw)


def _read_arrays(arrays_path, document, json_path):
    from safetensors.numpy import load as st_load

    try:
        blob = read_regular_file(arrays_path)
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
            f"{digest}; {JSON_NAME} records {_short(size)} bytes and sha256 "
            f"{_short(recorded)}). The file is truncated, was edited, or belongs to another "
            "save."
        )
    try:
        return st_load(blob), len(blob)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{arrays_path}: unreadable safetensors data ({exc}).") from exc


def _version_warnings(document, json_path):
    import sklearn

    from .._version import __version__ as skafa_version

    for lib, saved, now in (("scikit-learn", document.get("sklearn_version"), sklearn.__version__),
                            ("skafa", document.get("skafa_version"), skafa_version)):
        if saved != now:
            warnings.warn(
                f"{json_path} was written with {lib} {_clip(saved)}; this is {lib} {now}. "
                "Fitted attributes are restored as saved; check predictions on a few "
                "examples.",
                PersistenceVersionWarning,
                stacklevel=3,
            )


def load(path, *, model=None, device=None, trust=(), verify_model=True, cache_dir=None,
         n_jobs=None, verbose=None, allow_model_mismatch=False):
    """Load an estimator written by :func:`save`, instantiating only allowed classes.

    Runtime settings (the parameters ``cache_dir``, ``n_jobs``, ``device`` and
    ``verbose`` of every step, see ``_runtime_params``) are never taken from the
    file: each comes from the argument of the same name here, or, when that is
    ``None``, from the step's constructor default (no cache folder, no worker
    processes, ``"cpu"``, quiet). A file therefore cannot decide where skafa
    writes, how many processes it starts, or which device it uses.

    Parameters
    ----------
    path : str or path-like
        Directory written by :func:`save`.
    model : str or ModelHandle, default=None
        Model for every step that declares a ``model`` parameter replaceable at
        load (``TurnActivationTransformer``, ``PromptedJudge``, and the ``model``
        of a ``FailureAttributor``) instead of the saved name: e.g. a local path
        to the same GGUF file. Its architecture must match the saved
        fingerprint, and its weights the saved weights digest unless
        ``allow_model_mismatch=True``. The model named in the file is loaded
        through :func:`skafa.llm.load_model` (``trust_remote_code=False``); pass
        ``model`` to choose it yourself.
    device : str, default=None
        Torch device for every step with a ``device`` parameter; ``None``: the
        constructor's default (``"cpu"``). The saved device is not used.
    trust : iterable of str, default=()
        Extra classes (``"package.module.Class"``) that the file may use and that
        may be imported to build it. Only list classes you trust to be built from
        data (see the module docstring).
    verify_model : bool, default=True
        Load the model of every fitted model-reading step now and compare its
        architecture with the saved fingerprint. With ``False`` nothing is
        loaded; the extraction step still refuses a different architecture when
        it first loads the model.
    cache_dir : str or path-like, default=None
        Activation cache folder for every step with a ``cache_dir`` parameter;
        ``None``: no cache. The saved folder is not used.
    n_jobs : int, default=None
        ``n_jobs`` of every step that has one; ``None``: the constructor's
        default (one process). The saved value is not used.
    verbose : int, default=None
        ``verbose`` of every step that has one; ``None``: the constructor's
        default (quiet). The saved value is not used.
    allow_model_mismatch : bool, default=False
        Go on when the model ``model=`` names has the saved architecture but
        other weights than the saved ones (their SHA-256 digests differ, or
        cannot be compared): the steps use it, with a
        :class:`~skafa.exceptions.ModelMismatchWarning`. Requires ``model``:
        a model found under the saved name (e.g. a relative ``models/tiny``
        resolved from another working directory) is never used silently.
        Without it such a model is refused with a :class:`ValueError` naming
        where the model was at save time, where it is now, and both digests.

    Returns
    -------
    estimator : estimator object
        The estimator as saved, fitted attributes restored.

    Raises
    ------
    ValueError
        Truncated, edited or inconsistent files (naming the file and the check
        that failed), including JSON nested deeper than :data:`MAX_JSON_DEPTH`
        and structures that would allocate more than the file can justify; a
        class outside the allowed ones and ``trust`` (never imported); fitted
        attributes that disagree with each other (e.g. ``coef_`` of another
        width than ``n_features_in_``, naming the attribute and both shapes); a
        model whose architecture differs from the saved one; a model whose
        weights differ from the saved ones, unless it is named with ``model``
        and ``allow_model_mismatch=True``; ``allow_model_mismatch=True``
        without ``model``.
    FileNotFoundError
        When ``path`` holds no ``skafa.json`` or its ``arrays.safetensors``.

    Warns
    -----
    ModelMismatchWarning
        Same architecture and weights under another name or place; or other
        weights, used because ``model`` named them and
        ``allow_model_mismatch=True``.
    PersistenceVersionWarning
        Written by another version of scikit-learn or skafa.
    """
    if allow_model_mismatch and model is None:
        raise ValueError(
            "allow_model_mismatch=True needs model=<name or path>: name the model to use "
            "in place of the saved one. A model found under the saved name is only used "
            "when its weights are the saved ones.")
    path = Path(path).expanduser()
    json_path = path / JSON_NAME
    if path.is_file() and path.name == JSON_NAME:
        json_path, path = path, path.parent
    document, n_json_bytes = _read_document(json_path)
    arrays_name = document["arrays"].get("file", ARRAYS_NAME) \
        if isinstance(document["arrays"], dict) else ARRAYS_NAME
    if arrays_name != ARRAYS_NAME:
        raise ValueError(f"{json_path}: unexpected arrays file name {_short(arrays_name)}.")
    arrays, n_array_bytes = _read_arrays(path / ARRAYS_NAME, document, json_path)
    _version_warnings(document, json_path)
    if isinstance(trust, str):
        trust = [trust]
    reader = _Reader(arrays, json_path, n_file_bytes=n_json_bytes + n_array_bytes,
                     model=model, trust=trust, verify_model=verify_model,
                     allow_model_mismatch=allow_model_mismatch,
                     runtime={"cache_dir": cache_dir, "n_jobs": n_jobs, "device": device,
                              "verbose": verbose})
    reader.saved_locations = _saved_locations(document)
    tree = document["tree"]
    if not isinstance(tree, dict) or "__estimator__" not in tree:
        raise ValueError(f"{json_path}: the tree does not describe an estimator.")
    try:
        return reader.decode(tree, "")
    except RecursionError:  # unreachable within MAX_JSON_DEPTH; never let it escape
        raise ValueError(f"{json_path}: the estimator tree nests too deeply.") from None
