"""Estimator checks for ragged, one-sample-per-conversation input.

scikit-learn's estimator checks feed plain 2-D arrays. skafa estimators take a
:class:`~skafa.TurnFeatures` (a ragged container: one entry per conversation, one
feature row per turn) or a list of :class:`~skafa.Conversation`, and truthfully
declare ``two_d_array=False``, so scikit-learn's own generator runs none of its
array checks on them. The invariants behind those checks hold for ragged input
too; this module tests them there:

========================================  ==============================================
scikit-learn check (2-D arrays)           ragged version here
========================================  ==============================================
check_estimators_fit_returns_self         :func:`check_fit_returns_self`
check_estimators_unfitted                 :func:`check_fit_check_is_fitted`
check_fit_check_is_fitted                 :func:`check_fit_check_is_fitted`
check_fit_idempotent                      :func:`check_fit_idempotent`
check_methods_subset_invariance           :func:`check_methods_subset_invariance`
check_methods_sample_order_invariance     :func:`check_methods_sample_order_invariance`
check_dict_unchanged                      :func:`check_dict_unchanged`
check_dont_overwrite_parameters           :func:`check_dont_overwrite_parameters`
check_estimators_overwrite_params         :func:`check_estimators_overwrite_params`
check_estimators_pickle                   :func:`check_pickle_round_trip`
check_readonly_memmap_input               :func:`check_readonly_memmap_input`
check_n_features_in(_after_fitting)       :func:`check_n_features_in`
check_estimators_empty_data_messages      :func:`check_empty_input_message`
check_pipeline_consistency                :func:`check_pipeline_consistency`
check_fit_score_takes_y                   :func:`check_fit_score_takes_y`
check_sample_weight_* (``fit`` / score)   :func:`check_sample_weight_consistency`
check_positive_only_tag_during_fit        :func:`check_tags_truthful`
========================================  ==============================================

scikit-learn's API checks that feed no data (tags, ``repr``, ``get_params`` /
``set_params``, cloning, ``__init__``) are run as they are.

:func:`parametrize_with_checks` is a pytest decorator over both, in the spirit of
scikit-learn's and imbalanced-learn's decorators of the same name.
:func:`estimator_instances` says how to build fittable instances of an
estimator class: ``cls()`` unless ``utils/_test_common/instance_generator.py`` has an
entry (for classes with required parameters or that need a model).

Examples
--------
>>> from skafa import GroupedArgmaxLogisticClassifier
>>> from skafa.utils.estimator_checks import check_fit_idempotent
>>> check_fit_idempotent("probe", GroupedArgmaxLogisticClassifier())
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import inspect
import os
import pickle
import tempfile
from functools import partial

import numpy as np
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.utils import get_tags
from sklearn.utils.validation import check_is_fitted

__all__ = [
    "parametrize_with_checks",
    "estimator_checks",
    "estimator_instances",
    "input_kind",
    "make_turn_features",
    "make_check_data",
    "check_fit_returns_self",
    "check_fit_check_is_fitted",
    "check_fit_idempotent",
    "check_methods_subset_invariance",
    "check_methods_sample_order_invariance",
    "check_dict_unchanged",
    "check_dont_overwrite_parameters",
    "check_estimators_overwrite_params",
    "check_pickle_round_trip",
    "check_readonly_memmap_input",
    "check_n_features_in",
    "check_empty_input_message",
    "check_pipeline_consistency",
    "check_fit_score_takes_y",
    "check_sample_weight_consistency",
    "check_tags_truthful",
    "SKLEARN_ARRAY_CHECKS",
]

#: Methods whose outputs the invariance checks compare.
_METHODS = ("predict", "transform", "turn_decision_function", "turn_predict_proba",
            "predict_agent", "score")

#: scikit-learn's API checks that feed 2-D arrays, and the ragged check run instead.
SKLEARN_ARRAY_CHECKS = {
    "check_fit_score_takes_y": "check_fit_score_takes_y",
    "check_estimators_overwrite_params": "check_estimators_overwrite_params",
    "check_dont_overwrite_parameters": "check_dont_overwrite_parameters",
    "check_estimators_fit_returns_self": "check_fit_returns_self",
    "check_readonly_memmap_input": "check_readonly_memmap_input",
    "check_estimators_unfitted": "check_fit_check_is_fitted",
    "check_n_features_in_after_fitting": "check_n_features_in",
    "check_positive_only_tag_during_fit": "check_tags_truthful",
}


# --------------------------------------------------------------------------- data
def make_turn_features(n_conversations=16, *, n_features=4, min_turns=2, max_turns=5,
                       seed=0):
    """Tiny single-site TurnFeatures with a learnable decisive turn, and its steps.

    Parameters
    ----------
    n_conversations : int, default=16
    n_features : int, default=4
    min_turns, max_turns : int, default=2, 5
        Inclusive range of turns per conversation.
    seed : int, default=0

    Returns
    -------
    X : TurnFeatures
        With speakers (``"a"``, ``"b"``, ``"c"`` in turn) and task ids (two
        conversations per task).
    y : ndarray of int64, shape (n_conversations,)
        The decisive step of every conversation.
    """
    from ..features import TurnFeatures

    rng = np.random.default_rng(seed)
    n_turns = rng.integers(min_turns, max_turns + 1, size=n_conversations)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n_conversations) * n_turns).astype(np.int64)
    values = rng.normal(size=(int(offsets[-1]), n_features))
    values[offsets[:-1] + y, 0] += 3.0
    speakers = [("a", "b", "c")[k % 3] for n in n_turns for k in range(n)]
    X = TurnFeatures(values, offsets, speakers=speakers,
                     task_ids=[f"task-{i // 2}" for i in range(n_conversations)])
    return X, y


def make_check_data(kind, *, seed=0):
    """``(X, y)`` for the checks: TurnFeatures or labelled conversations.

    Parameters
    ----------
    kind : {"turn_features", "conversations"}
    seed : int, default=0

    Returns
    -------
    X : TurnFeatures or list of Conversation
    y : ndarray of int64
    """
    if kind == "turn_features":
        return make_turn_features(16, seed=seed)
    from ..testing import make_conversations

    convs = make_conversations(12, min_turns=2, max_turns=5, seed=seed)
    return convs, np.asarray([c.mistake_step for c in convs], dtype=np.int64)


def _subset(X, idx):
    from ..features import TurnFeatures

    if isinstance(X, TurnFeatures):
        return X[np.asarray(idx)]
    return [X[i] for i in idx]


def _empty_like(X):
    from ..features import TurnFeatures

    if isinstance(X, TurnFeatures):
        return TurnFeatures(np.empty((0, X.n_features)), [0])
    return []


_KINDS = {}


def input_kind(estimator):
    """``"turn_features"`` or ``"conversations"``: what ``estimator`` fits on.

    Found by fitting a clone on tiny TurnFeatures: estimators that take
    conversations refuse it with a ``TypeError`` before any work.

    Parameters
    ----------
    estimator : estimator object

    Returns
    -------
    str
    """
    key = (type(estimator), repr(estimator))
    if key not in _KINDS:
        X, y = make_turn_features(8)
        try:
            clone(estimator).fit(X, y)
            _KINDS[key] = "turn_features"
        except TypeError:
            _KINDS[key] = "conversations"
    return _KINDS[key]


# ------------------------------------------------------------------------ helpers
def _set_random_state(estimator, seed=0):
    params = estimator.get_params()
    fixed = {k: seed for k, v in params.items()
             if (k == "random_state" or k.endswith("__random_state")) and v is None}
    if fixed:
        estimator.set_params(**fixed)
    return estimator


def _fitted(estimator, X, y):
    est = _set_random_state(clone(estimator))
    return est.fit(X, y)


def _outputs(estimator, X, y):
    """Outputs of every available method, by name."""
    out = {}
    for method in _METHODS:
        if hasattr(estimator, method):
            fn = getattr(estimator, method)
            out[method] = fn(X, y) if method == "score" else fn(X)
    return out


def _assert_same(a, b, what, *, rtol=1e-7, atol=1e-9):
    from ..features import TurnFeatures

    if isinstance(a, TurnFeatures):
        assert isinstance(b, TurnFeatures), what
        np.testing.assert_array_equal(a.offsets, b.offsets, err_msg=what)
        assert a.sites == b.sites and a.feature_names == b.feature_names, what
        for name in ("speakers", "task_ids"):
            pa, pb = getattr(a, name), getattr(b, name)
            assert (pa is None) == (pb is None), what
            if pa is not None:
                assert pa.tolist() == pb.tolist(), what
        va = a.values.toarray() if sp.issparse(a.values) else np.asarray(a.values)
        vb = b.values.toarray() if sp.issparse(b.values) else np.asarray(b.values)
        np.testing.assert_allclose(va, vb, rtol=rtol, atol=atol, err_msg=what)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), what
        for k, (x, z) in enumerate(zip(a, b)):
            _assert_same(x, z, f"{what}[{k}]", rtol=rtol, atol=atol)
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
        if a.dtype.kind in "fc":
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)
        else:
            assert a.tolist() == b.tolist(), what


def _take(output, idx, X):
    """The entries of ``output`` (computed on X) for conversations ``idx``."""
    from ..features import TurnFeatures

    if isinstance(output, TurnFeatures):
        return output[np.asarray(idx)]
    if isinstance(output, list):
        return [output[i] for i in idx]
    return np.asarray(output)[np.asarray(idx)]


def _fitted_state(estimator):
    import joblib

    return {k: joblib.hash(v) for k, v in vars(estimator).items()
            if k.endswith("_") and not k.startswith("_")}


# ------------------------------------------------------------------------- checks
def check_fit_returns_self(name, estimator):
    """``fit`` returns the estimator itself."""
    X, y = make_check_data(input_kind(estimator))
    est = _set_random_state(clone(estimator))
    assert est.fit(X, y) is est, f"{name}.fit does not return self"


def check_fit_check_is_fitted(name, estimator):
    """Unfitted: ``check_is_fitted`` and every method raise NotFittedError; fitted: not."""
    X, y = make_check_data(input_kind(estimator))
    est = _set_random_state(clone(estimator))
    try:
        check_is_fitted(est)
        raise AssertionError(f"{name} passes check_is_fitted before fit")
    except NotFittedError:
        pass
    for method in _METHODS:
        if hasattr(est, method):
            args = (X, y) if method == "score" else (X,)
            try:
                getattr(est, method)(*args)
            except NotFittedError:
                continue
            raise AssertionError(f"unfitted {name}.{method} does not raise NotFittedError")
    est.fit(X, y)
    check_is_fitted(est)


def check_fit_idempotent(name, estimator):
    """Fitting twice on the same data gives the same outputs as fitting once."""
    X, y = make_check_data(input_kind(estimator))
    est = _fitted(estimator, X, y)
    first = _outputs(est, X, y)
    est.fit(X, y)
    for method, out in _outputs(est, X, y).items():
        _assert_same(first[method], out, f"{name}.{method} after a second fit")


def _skip_if_non_deterministic(estimator):
    if get_tags(estimator).non_deterministic:
        import unittest

        raise unittest.SkipTest("non_deterministic tag: outputs depend on the batch")


def check_methods_subset_invariance(name, estimator):
    """Outputs on a subset of conversations equal the subset of outputs on all."""
    _skip_if_non_deterministic(estimator)
    X, y = make_check_data(input_kind(estimator))
    est = _fitted(estimator, X, y)
    idx = np.arange(1, len(y), 2)
    Xs = _subset(X, idx)
    for method in _METHODS[:-1]:
        if hasattr(est, method):
            full = getattr(est, method)(X)
            part = getattr(est, method)(Xs)
            _assert_same(_take(full, idx, X), part, f"{name}.{method} on a subset",
                         rtol=1e-5, atol=1e-6)


def check_methods_sample_order_invariance(name, estimator):
    """Permuting the conversations permutes the outputs the same way."""
    _skip_if_non_deterministic(estimator)
    X, y = make_check_data(input_kind(estimator))
    est = _fitted(estimator, X, y)
    perm = np.random.default_rng(1).permutation(len(y))
    for method in _METHODS[:-1]:
        if hasattr(est, method):
            full = getattr(est, method)(X)
            shuffled = getattr(est, method)(_subset(X, perm))
            _assert_same(_take(full, perm, X), shuffled,
                         f"{name}.{method} on permuted conversations", rtol=1e-5, atol=1e-6)
    if hasattr(est, "score"):
        assert np.isclose(est.score(X, y), est.score(_subset(X, perm), y[perm]))


def check_dict_unchanged(name, estimator):
    """Prediction methods change no attribute; fitted attributes stay equal deeply.

    Every attribute keeps its identity (as in scikit-learn's check), and the
    content of every fitted attribute (public, ending in ``_``) is unchanged,
    so run-time counters must live outside fitted state.
    """
    X, y = make_check_data(input_kind(estimator))
    est = _fitted(estimator, X, y)
    for method in _METHODS:
        if not hasattr(est, method):
            continue
        before = dict(vars(est))
        state = _fitted_state(est)
        getattr(est, method)(*((X, y) if method == "score" else (X,)))
        after = vars(est)
        assert set(after) == set(before), (
            f"{name}.{method} added or removed attributes: "
            f"{sorted(set(after) ^ set(before))}")
        changed = [k for k in before if after[k] is not before[k]]
        assert not changed, f"{name}.{method} replaced attributes {changed}"
        changed = [k for k, v in _fitted_state(est).items() if state[k] != v]
        assert not changed, f"{name}.{method} changed fitted attributes {changed}"


def check_dont_overwrite_parameters(name, estimator):
    """``fit`` adds only ``_``-prefixed or ``_``-suffixed attributes and changes no parameter."""
    X, y = make_check_data(input_kind(estimator))
    est = _set_random_state(clone(estimator))
    before = dict(vars(est))
    est.fit(X, y)
    public = [k for k in vars(est) if not (k.startswith("_") or k.endswith("_"))]
    added = [k for k in public if k not in before]
    assert not added, f"{name}.fit added public attributes {added}"
    changed = [k for k in public if vars(est)[k] is not before[k]]
    assert not changed, f"{name}.fit changed public attributes {changed}"


def check_estimators_overwrite_params(name, estimator):
    """``fit`` leaves ``get_params(deep=True)`` exactly as it was."""
    import joblib

    X, y = make_check_data(input_kind(estimator))
    est = _set_random_state(clone(estimator))
    before = {k: joblib.hash(v) for k, v in est.get_params(deep=True).items()}
    est.fit(X, y)
    after = {k: joblib.hash(v) for k, v in est.get_params(deep=True).items()}
    changed = sorted(k for k in before if before[k] != after.get(k))
    assert not changed, f"{name}.fit changed parameters {changed}"


def check_pickle_round_trip(name, estimator):
    """A pickled and unpickled fitted estimator gives the same outputs."""
    X, y = make_check_data(input_kind(estimator))
    est = _fitted(estimator, X, y)
    expected = _outputs(est, X, y)
    again = pickle.loads(pickle.dumps(est))
    for method, out in _outputs(again, X, y).items():
        _assert_same(expected[method], out, f"{name}.{method} after a pickle round trip")


def check_readonly_memmap_input(name, estimator):
    """Fitting and predicting on read-only memory-mapped TurnFeatures works, same results."""
    import unittest

    from ..features import TurnFeatures

    kind = input_kind(estimator)
    if kind != "turn_features":
        raise unittest.SkipTest("takes conversations: there is no array to memory-map")
    X, y = make_check_data(kind)
    expected = _outputs(_fitted(estimator, X, y), X, y)
    with tempfile.TemporaryDirectory() as folder:
        paths = {}
        for part in ("values", "offsets", "y"):
            paths[part] = os.path.join(folder, f"{part}.npy")
        np.save(paths["values"], np.asarray(X.values))
        np.save(paths["offsets"], X.offsets)
        np.save(paths["y"], y)
        values = np.load(paths["values"], mmap_mode="r")
        offsets = np.load(paths["offsets"], mmap_mode="r")
        y_mm = np.load(paths["y"], mmap_mode="r")
        assert not values.flags.writeable
        X_mm = TurnFeatures(values, offsets, speakers=X.speakers, task_ids=X.task_ids)
        est = _fitted(estimator, X_mm, y_mm)
        for method, out in _outputs(est, X_mm, y_mm).items():
            _assert_same(expected[method], out, f"{name}.{method} on read-only memmaps")
        del values, offsets, y_mm, X_mm, est


def check_n_features_in(name, estimator):
    """``n_features_in_`` is the per-turn width of fitted TurnFeatures, checked on predict.

    For TurnFeatures input: after ``fit`` either ``n_features_in_`` equals
    ``X.n_features`` and a different width at prediction raises a ValueError
    naming both numbers, or the estimator has no ``n_features_in_`` and reads no
    feature (a different width changes nothing). For conversations there is
    no feature count, so ``n_features_in_`` must not be set.
    """
    kind = input_kind(estimator)
    X, y = make_check_data(kind)
    est = _set_random_state(clone(estimator))
    assert not hasattr(est, "n_features_in_"), f"unfitted {name} has n_features_in_"
    est.fit(X, y)
    if kind == "conversations":
        assert not hasattr(est, "n_features_in_"), (
            f"{name} sets n_features_in_ although conversations have no feature count")
        return
    from ..features import TurnFeatures

    wider = TurnFeatures(np.hstack([X.values, X.values[:, :1]]), X.offsets,
                         speakers=X.speakers, task_ids=X.task_ids)
    methods = [m for m in _METHODS[:-1] if hasattr(est, m)]
    if hasattr(est, "n_features_in_"):
        assert est.n_features_in_ == X.n_features, (
            f"{name}.n_features_in_={est.n_features_in_}, X has {X.n_features}")
        for method in methods:
            try:
                getattr(est, method)(wider)
            except ValueError as exc:
                msg = str(exc)
                assert str(X.n_features) in msg and str(X.n_features + 1) in msg, (
                    f"{name}.{method}: unclear message for a wrong width: {msg}")
                continue
            raise AssertionError(f"{name}.{method} accepted {X.n_features + 1} features "
                                 f"after fitting on {X.n_features}")
    else:
        for method in methods:
            _assert_same(_outputs(est, X, y)[method], getattr(est, method)(wider),
                         f"{name}.{method}: no n_features_in_, yet the width matters")


def check_empty_input_message(name, estimator):
    """Zero conversations are refused by ``fit`` and by predictions with a clear ValueError."""
    import re

    kind = input_kind(estimator)
    X, y = make_check_data(kind)
    empty = _empty_like(X)
    pattern = re.compile(r"\b(0|zero) conversations|empty", re.IGNORECASE)
    est = _set_random_state(clone(estimator))
    for call in ("fit", *_METHODS[:-1]):
        if call != "fit" and not hasattr(est, call):
            continue
        try:
            if call == "fit":
                est.fit(empty, np.empty(0, dtype=np.int64))
            else:
                getattr(est, call)(empty)
        except ValueError as exc:
            assert pattern.search(str(exc)), f"{name}.{call}: unclear message: {exc}"
        else:
            raise AssertionError(f"{name}.{call} accepted zero conversations")
        if call == "fit":
            est.fit(X, y)


def check_pipeline_consistency(name, estimator):
    """The estimator alone and as the only step of an AttributionPipeline agree."""
    from ..compose import make_attribution_pipeline

    X, y = make_check_data(input_kind(estimator))
    est = _fitted(estimator, X, y)
    pipe = make_attribution_pipeline(_set_random_state(clone(estimator))).fit(X, y)
    for method, out in _outputs(est, X, y).items():
        if hasattr(pipe, method):
            fn = getattr(pipe, method)
            _assert_same(out, fn(X, y) if method == "score" else fn(X),
                         f"{name}.{method} inside a pipeline")


def check_fit_score_takes_y(name, estimator):
    """``fit`` and ``score`` take ``(X, y, ...)`` and ``fit`` accepts ``y``."""
    X, y = make_check_data(input_kind(estimator))
    for method in ("fit", "score", "partial_fit", "fit_transform", "fit_predict"):
        fn = getattr(type(estimator), method, None)
        if fn is None:
            continue
        args = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert args[:2] == ["X", "y"], f"{name}.{method} takes {args[:2]}, not (X, y)"
    _set_random_state(clone(estimator)).fit(X, y)


def _sample_weight_fit_kwargs(estimator):
    """How ``fit`` takes conversation weights: ``w -> fit kwargs``, or None if it does not.

    ``sample_weight=w`` when ``fit`` names it, or forwards ``**params`` to an
    ``estimator`` that takes it (as :class:`~skafa.SiteSelector` does); for a
    Pipeline, ``<last step>__sample_weight=w`` when the last step takes it.
    """
    from sklearn.pipeline import Pipeline

    if isinstance(estimator, Pipeline):
        name, last = estimator.steps[-1]
        if _sample_weight_fit_kwargs(last) is None:
            return None
        return lambda w: {f"{name}__sample_weight": w}
    params = inspect.signature(type(estimator).fit).parameters
    if "sample_weight" in params:
        return lambda w: {"sample_weight": w}
    inner = getattr(estimator, "estimator", None)
    if (any(p.kind is p.VAR_KEYWORD for p in params.values()) and inner is not None
            and _sample_weight_fit_kwargs(inner) is not None):
        return lambda w: {"sample_weight": w}
    return None


def check_sample_weight_consistency(name, estimator):
    """``fit`` and ``score`` both take ``sample_weight`` or neither; unit weights change nothing."""
    import unittest

    fit_kwargs = _sample_weight_fit_kwargs(estimator)
    fit_takes = fit_kwargs is not None
    score = getattr(type(estimator), "score", None)
    score_takes = score is not None and "sample_weight" in inspect.signature(score).parameters
    # DecisiveStepMixin.score has sample_weight in its signature and refuses it when
    # the estimator sets _score_takes_sample_weight = False
    score_takes = score_takes and getattr(type(estimator), "_score_takes_sample_weight", True)
    if score is not None and fit_takes != score_takes:
        raise AssertionError(
            f"{name}: fit {'takes' if fit_takes else 'does not take'} sample_weight but "
            f"score {'does' if score_takes else 'does not'}")
    if not fit_takes:
        raise unittest.SkipTest("no sample_weight")
    X, y = make_check_data(input_kind(estimator))
    plain = _fitted(estimator, X, y)
    est = _set_random_state(clone(estimator)).fit(X, y, **fit_kwargs(np.ones(len(y))))
    for method, out in _outputs(plain, X, y).items():
        _assert_same(out, _outputs(est, X, y)[method], f"{name}.{method} with unit weights",
                     rtol=1e-5, atol=1e-6)
    if score_takes:
        assert np.isclose(plain.score(X, y, sample_weight=np.ones(len(y))), plain.score(X, y))


def check_tags_truthful(name, estimator):
    """The input tags say what ``fit`` accepts.

    ``two_d_array`` / ``sparse``: a plain 2-D array / a sparse matrix is
    accepted exactly when the tag says so. ``positive_only=False``: negative
    feature values fit. ``target_tags.required``: ``fit`` refuses ``y=None``
    exactly when the tag says so (or reads labels from the conversations).
    """
    tags = get_tags(estimator)
    kind = input_kind(estimator)
    X, y = make_check_data(kind)
    rng = np.random.default_rng(0)
    for tag, data in (("two_d_array", rng.normal(size=(12, 3))),
                      ("sparse", sp.csr_matrix(rng.normal(size=(12, 3))))):
        try:
            clone(estimator).fit(data, np.arange(12) % 2)
            accepted = True
        except (TypeError, ValueError):
            accepted = False
        assert accepted == getattr(tags.input_tags, tag), (
            f"{name}: tags.input_tags.{tag}={getattr(tags.input_tags, tag)} but fit "
            f"{'accepts' if accepted else 'refuses'} it")
    assert not tags.input_tags.string, f"{name} claims string input; it takes {kind}"
    if kind == "turn_features" and not tags.input_tags.positive_only:
        negative = X.with_values(-np.abs(np.asarray(X.values)))
        _set_random_state(clone(estimator)).fit(negative, y)
    try:  # labelled conversations: an estimator may read y from them
        _set_random_state(clone(estimator)).fit(X, None)
        needs_y = False
    except ValueError:
        needs_y = True
    assert needs_y == tags.target_tags.required, (
        f"{name}: target_tags.required={tags.target_tags.required} but fit "
        f"{'refuses' if needs_y else 'accepts'} y=None")


#: The ragged checks, in the order they run.
RAGGED_CHECKS = (
    check_fit_returns_self,
    check_fit_check_is_fitted,
    check_fit_score_takes_y,
    check_fit_idempotent,
    check_methods_subset_invariance,
    check_methods_sample_order_invariance,
    check_dict_unchanged,
    check_dont_overwrite_parameters,
    check_estimators_overwrite_params,
    check_pickle_round_trip,
    check_readonly_memmap_input,
    check_n_features_in,
    check_empty_input_message,
    check_pipeline_consistency,
    check_sample_weight_consistency,
    check_tags_truthful,
)


# ------------------------------------------------------------------ generators
def estimator_instances(cls):
    """Fittable instances of an estimator class for the checks.

    The entry of ``skafa.utils._test_common.instance_generator`` for classes with
    required parameters, or that need a language model (built from
    :mod:`skafa.testing`), else ``[cls()]``.

    Parameters
    ----------
    cls : type

    Returns
    -------
    list of estimator
    """
    from ._test_common.instance_generator import INSTANCE_FACTORIES

    factory = INSTANCE_FACTORIES.get(cls.__name__)
    return list(factory()) if factory is not None else [cls()]


def _sklearn_api_checks(estimator):
    """scikit-learn's data-free API checks, run as they are."""
    from sklearn.utils import estimator_checks as sk

    from .sklearn_compat import yield_api_checks

    yield sk.check_estimator_cloneable
    for check in yield_api_checks(estimator):
        if check.__name__ not in SKLEARN_ARRAY_CHECKS:
            yield check
    yield sk.check_parameters_default_constructible
    yield sk.check_get_params_invariance
    yield sk.check_set_params


def estimator_checks(estimator, *, sklearn_checks=True):
    """Yield every check callable for ``estimator``: scikit-learn's API checks, then ragged.

    Parameters
    ----------
    estimator : estimator object
    sklearn_checks : bool, default=True
        Include scikit-learn's data-free API checks.

    Yields
    ------
    check : callable
        ``check(estimator)``; named like the underlying check function.
    """
    name = type(estimator).__name__
    checks = list(_sklearn_api_checks(estimator)) if sklearn_checks else []
    for check in (*checks, *RAGGED_CHECKS):
        bound = partial(check, name)
        bound.__name__ = check.__name__
        yield bound


def _check_id(value):
    if isinstance(value, partial) or callable(value) and not hasattr(value, "get_params"):
        return getattr(value, "__name__", repr(value))
    params = value.get_params(deep=False)
    short = {k: v for k, v in params.items()
             if isinstance(v, (str, int, float, bool, type(None)))}
    changed = {k: v for k, v in short.items()
               if inspect.signature(type(value)).parameters.get(k) is None
               or inspect.signature(type(value)).parameters[k].default != v}
    inner = ",".join(f"{k}={v!r}" for k, v in sorted(changed.items()))
    return f"{type(value).__name__}({inner})"


def parametrize_with_checks(estimators, *, expected_failed_checks=None, sklearn_checks=True):
    """Pytest decorator running every check on every estimator (strict xfails).

    Parameters
    ----------
    estimators : list of estimator objects
    expected_failed_checks : callable, default=None
        ``expected_failed_checks(estimator) -> {check_name: reason}``. Those
        checks are marked ``xfail(strict=True)``: one that passes fails the
        test run, so no expected failure can be stale.
    sklearn_checks : bool, default=True
        Include scikit-learn's data-free API checks.

    Returns
    -------
    decorator : pytest.mark.parametrize
        Over ``"estimator, check"``.
    """
    import pytest

    params = []
    for estimator in estimators:
        failed = expected_failed_checks(estimator) if expected_failed_checks else {}
        for check in estimator_checks(estimator, sklearn_checks=sklearn_checks):
            marks = ()
            if check.__name__ in failed:
                marks = pytest.mark.xfail(reason=failed[check.__name__], strict=True)
            params.append(pytest.param(estimator, check, marks=marks))
    return pytest.mark.parametrize("estimator, check", params, ids=_check_id)
