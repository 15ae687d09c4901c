"""Private input checks shared by every skafa estimator: one helper per check.

- :func:`describe_conversation` and :func:`describe` name a conversation in errors
  (``"conversation 3 (task 'abc', record 'algo_12')"``);
- :func:`check_conversations` validates a list of :class:`~skafa.Conversation`;
- :func:`check_turn_features` validates a :class:`~skafa.TurnFeatures`;
- :func:`check_steps` validates decisive-step labels and always raises ``ValueError``;
- :func:`check_finite_rows` names the conversation, turn, site and feature of a NaN/inf
  (and, with ``squared=True``, of a value too large to square in float64);
- :func:`check_feature_names` records feature names in ``fit`` and compares them later;
- :func:`check_int` validates an integer argument outside ``_parameter_constraints``.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numbers

import numpy as np
import scipy.sparse as sp

__all__ = [
    "describe_conversation",
    "describe",
    "check_steps",
    "check_finite_rows",
    "check_feature_names",
    "locate_row",
    "check_int",
    "task_ids_of",
    "group_labels",
    "check_groups",
    "check_task_id",
    "labels_from_conversations",
    "reference_cycle",
]


def describe_conversation(i, *, task_id=None, record_id=None) -> str:
    """Name conversation ``i`` for an error message.

    Parameters
    ----------
    i : int or None
        Position of the conversation in the input (None: not known).
    task_id, record_id : object, default=None
        Shown when not None.

    Returns
    -------
    str
        ``"conversation 3 (task 'abc', record 'algo_12')"``, or ``"conversation 3"``.
    """
    parts = []
    if task_id is not None:
        parts.append(f"task {task_id!r}")
    if record_id is not None:
        parts.append(f"record {record_id!r}")
    head = "conversation" if i is None else f"conversation {int(i)}"
    return head + (f" ({', '.join(parts)})" if parts else "")


def describe(X, i) -> str:
    """Name entry ``i`` of a list of conversations or of a TurnFeatures.

    Parameters
    ----------
    X : list of Conversation or TurnFeatures
    i : int

    Returns
    -------
    str
    """
    if hasattr(X, "offsets"):  # a TurnFeatures (utils imports no domain class)
        task = None if X.task_ids is None else X.task_ids[i]
        return describe_conversation(i, task_id=task)
    conv = X[i]
    return describe_conversation(i, task_id=getattr(conv, "task_id", None),
                                 record_id=getattr(conv, "record_id", None))


def task_ids_of(convs):
    """Task ids of conversations, or None when none has one."""
    ids = [c.task_id for c in convs]
    return ids if any(t is not None for t in ids) else None


def check_task_id(task_id, where="task_id"):
    """Return a task id as ``None``, a ``str`` or an ``int``, keeping its type.

    Task ids group runs of one task; ``1`` and ``"1"`` are different tasks, so
    neither is converted to the other (NumPy integers become ``int``).

    Parameters
    ----------
    task_id : object
    where : str, default="task_id"
        Names the value in the error message.

    Returns
    -------
    None, str or int

    Raises
    ------
    TypeError
        For any other type (bool, float, ...).
    """
    if task_id is None or isinstance(task_id, str):
        return task_id
    if isinstance(task_id, numbers.Integral) and not isinstance(task_id, (bool, np.bool_)):
        return int(task_id)
    raise TypeError(
        f"{where} must be a str, an int or None, got {type(task_id).__name__} "
        f"{task_id!r}."
    )


def group_labels(ids):
    """Task ids as ``groups`` for a splitter, keeping ``1`` and ``"1"`` apart.

    Ids of one type (all ``str`` or all ``int``) are returned as they are.
    Splitters such as :class:`~sklearn.model_selection.GroupKFold` sort their
    groups, which fails on a mix of ints and strings, so a mix is returned as
    integer codes instead: one per distinct id, in order of first appearance,
    ``1`` and ``"1"`` getting two.

    Parameters
    ----------
    ids : sequence of str or int

    Returns
    -------
    groups : ndarray of object (one type) or of int64 (a mix), shape (len(ids),)

    Examples
    --------
    >>> group_labels(["b", "a", "b"]).tolist()
    ['b', 'a', 'b']
    >>> group_labels(["b", 1, "1", "b"]).tolist()
    [0, 1, 2, 0]
    """
    ids = list(ids)
    if len({isinstance(t, str) for t in ids}) <= 1:
        return np.asarray(ids, dtype=object)
    seen = {}
    return np.asarray([seen.setdefault((isinstance(t, str), t), len(seen)) for t in ids],
                      dtype=np.int64)


def check_groups(groups, n_samples=None):
    """Validate ``groups`` for a grouped splitter: one id per conversation, none missing.

    Parameters
    ----------
    groups : array-like of shape (n_samples,)
        Task ids (str or int; a mix is kept apart, see :func:`group_labels`).
    n_samples : int, optional
        The number of conversations ``groups`` must match.

    Returns
    -------
    groups : ndarray
        :func:`group_labels` of ``groups``.

    Raises
    ------
    ValueError
        Naming the first missing (None or NaN) entry, or the length mismatch.

    Examples
    --------
    >>> check_groups(["a", "b", "a"]).tolist()
    ['a', 'b', 'a']
    >>> check_groups(["a", None])
    Traceback (most recent call last):
    ...
    ValueError: groups[1] is None: every conversation needs a group (its task id); ...
    """
    values = list(np.asarray(groups, dtype=object).ravel()) if not isinstance(
        groups, (list, tuple)) else list(groups)
    if n_samples is not None and len(values) != int(n_samples):
        raise ValueError(f"groups has {len(values)} entries for {int(n_samples)} "
                         "conversations; give one group (task id) per conversation.")
    for i, g in enumerate(values):
        if g is None or (isinstance(g, float) and g != g):
            raise ValueError(
                f"groups[{i}] is {g!r}: every conversation needs a group (its task id); "
                "give the missing ones an id of their own, or use an ungrouped splitter "
                "such as KFold.")
    return group_labels(values)


def _describe_default(i):
    return f"conversation {int(i)}"


def _n_turns(X):
    if hasattr(X, "offsets"):  # a TurnFeatures
        return np.asarray(X.n_turns, dtype=np.int64)
    return np.asarray([len(c) for c in X], dtype=np.int64)


def check_steps(y, X=None, *, name="y"):
    """Validate decisive-step labels (the one step-label check of the package).

    Steps are 0-based turn indices, one per conversation. Integers, and floats
    that hold an integer value (``2.0``), are accepted; anything else raises a
    ``ValueError`` naming the first offending entry.

    Parameters
    ----------
    y : array-like
        One decisive step per conversation.
    X : TurnFeatures or list of Conversation, default=None
        The conversations; when given, ``y`` must have one entry per
        conversation, each step must lie inside its conversation, and messages
        name the conversation (index, task, record).
    name : str, default="y"
        Name of the argument in messages.

    Returns
    -------
    ndarray of int64, shape (n_conversations,)

    Raises
    ------
    ValueError
        For a missing, non-1-D, non-integer, negative or out-of-range step.
    """
    if X is None:
        n_turns = None
        name_of = _describe_default
    else:
        n_turns = _n_turns(X)
        def name_of(i):
            return describe(X, i)
    if y is None:
        raise ValueError(
            f"{name} is required: the index of the decisive turn of every conversation."
        )
    if isinstance(y, (str, bytes)):
        raise ValueError(f"{name} must be a 1-D sequence of int steps, got a string.")
    try:
        arr = np.asarray(y)
    except ValueError as exc:  # ragged nesting
        raise ValueError(f"{name} must be a 1-D sequence of int steps ({exc}).") from exc
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must be 1-D (one decisive step per conversation), got shape {arr.shape}."
        )
    if n_turns is not None and arr.shape[0] != len(n_turns):
        raise ValueError(
            f"{name} has {arr.shape[0]} entries but X holds {len(n_turns)} conversations; "
            "give one decisive step per conversation."
        )
    if arr.dtype.kind == "O":
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, bool) or not isinstance(v, (numbers.Integral, numbers.Real)):
                raise ValueError(
                    f"{name}[{i}]={v!r} is not an integer turn index; it is the step of "
                    f"{name_of(i)}."
                )
        arr = np.asarray(arr.tolist(), dtype=float)
    if arr.dtype.kind == "b":
        raise ValueError(f"{name} must hold integer turn indices, got booleans.")
    if arr.size and arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold integer turn indices, got dtype {arr.dtype}.")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{name}[{i}]={arr[i].item()!r} is not an integer turn index; it is the "
                f"step of {name_of(i)}."
            )
    arr = arr.astype(np.int64)
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        i = int(neg[0])
        unlabelled = (f" -1 marks an unlabelled conversation ({int((arr == -1).sum())} of "
                      f"{arr.size} here): fitting needs a decisive step for every "
                      f"conversation, so keep X[i] where {name}[i] >= 0, or label them "
                      "(skafa label)." if arr[i] == -1 else "")
        raise ValueError(
            f"{name}[{i}]={int(arr[i])} is negative; steps are 0-based turn indices "
            f"(the step of {name_of(i)}).{unlabelled}"
        )
    if n_turns is not None:
        bad = np.flatnonzero(arr >= n_turns)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{name}[{i}]={int(arr[i])} is outside {name_of(i)}, which has "
                f"{int(n_turns[i])} turns."
            )
    return arr


def labels_from_conversations(convs, caller):
    """Each conversation's ``mistake_step``; a clear error listing unlabelled ones.

    Used when ``y`` is not given to ``fit``/``score``: the labels then come from the
    conversations themselves.
    """
    missing = [i for i, c in enumerate(convs) if c.mistake_step is None]
    if missing:
        listed = "; ".join(describe(convs, i) for i in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"{caller}: y was not given and {len(missing)} of {len(convs)} conversations "
            f"carry no mistake_step label: {listed}{more}. Pass y=<decisive step of each "
            "conversation>, or label the conversations (Conversation(..., mistake_step=...))."
        )
    return np.asarray([c.mistake_step for c in convs], dtype=np.int64)


def locate_row(X, row):
    """Conversation index and turn position of a global turn row of ``X``."""
    conv = int(np.searchsorted(X.offsets, row, side="right") - 1)
    return conv, int(row - X.offsets[conv])


def check_finite_rows(X, M, site, *, what="feature value", squared=False):
    """Raise a ValueError naming the conversation/turn/site of a NaN or inf in ``M``.

    Parameters
    ----------
    X : TurnFeatures
        Gives the conversation boundaries and task ids.
    M : ndarray or sparse matrix, shape (n_turns_total, n_features)
    site : str
    what : str
        What the values are, for the message.
    squared : bool, default=False
        Also refuse finite values so large that a sum of squares over the rows
        overflows (``|x| > sqrt(max / n_rows) / 2``, with the float32 maximum for
        float32 input and the float64 one otherwise), as in the
        variance of standardization or the gradients of a logistic regression.
        Without this check one value of ``1e300`` comes back from scikit-learn as
        "Input X contains NaN".
    """
    if sp.issparse(M):
        data = sp.csr_matrix(M).data if M.format != "csr" else M.data
        bad = ~np.isfinite(data)
        if not bad.any():
            if squared:
                _check_squares(X, M, site, what)
            return
        M = sp.csr_matrix(M)
        k = int(np.flatnonzero(~np.isfinite(M.data))[0])
        row = int(np.searchsorted(M.indptr, k, side="right") - 1)
        col = int(M.indices[k])
        value = M.data[k]
    else:
        M = np.asarray(M)
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.add.reduce(M, axis=None, dtype=np.float64)
        if np.isfinite(total):
            if squared:
                _check_squares(X, M, site, what)
            return
        bad = ~np.isfinite(M)
        if not bad.any():  # the fast path overflowed on huge but finite values
            if squared:
                _check_squares(X, M, site, what)
            return
        row, col = (int(v) for v in np.argwhere(bad)[0])
        value = M[row, col]
    conv, turn = locate_row(X, row)
    raise ValueError(
        f"non-finite {what} ({value}) at {describe(X, conv)}, turn {turn}, "
        f"site {site!r}, feature {col}. Clean or impute the features before fitting "
        "or predicting."
    )


def _check_squares(X, M, site, what):
    """Raise when a value of ``M`` is too large for a sum of squares over its rows."""
    n_rows = max(int(M.shape[0]), 1)
    # scikit-learn keeps float32 input in float32 (StandardScaler squares in it).
    dtype = np.dtype(np.float32) if M.dtype == np.float32 else np.dtype(np.float64)
    limit = np.sqrt(np.finfo(dtype).max / n_rows) / 2
    if sp.issparse(M):
        M = sp.csr_matrix(M)
        data = np.abs(M.data.astype(np.float64, copy=False))
        if not data.size or data.max() <= limit:
            return
        k = int(np.flatnonzero(data > limit)[0])
        row = int(np.searchsorted(M.indptr, k, side="right") - 1)
        col, value = int(M.indices[k]), M.data[k]
    else:
        if M.dtype.kind not in "fc" or not M.size:
            return
        absolute = np.abs(M)
        if absolute.max() <= limit:
            return
        row, col = (int(v) for v in np.argwhere(absolute > limit)[0])
        value = M[row, col]
    conv, turn = locate_row(X, row)
    raise ValueError(
        f"{what} too large for {dtype} standardization and logistic regression: "
        f"{float(value):g} at {describe(X, conv)}, turn {turn}, site {site!r}, feature "
        f"{col}. Over {n_rows} turn rows a magnitude above {limit:.3g} makes sums of "
        "squares overflow (scikit-learn would then report NaN). Rescale or clip the "
        "features."
    )


def check_feature_names(estimator, X, *, reset):
    """Record the feature names of ``X`` in ``fit``; compare them afterwards.

    The TurnFeatures counterpart of scikit-learn's feature-name check: feature
    names are shared by every site of a :class:`~skafa.TurnFeatures`, so one list
    is recorded, as ``feature_names_in_`` (only when ``X`` has names).

    Parameters
    ----------
    estimator : estimator
    X : TurnFeatures
    reset : bool
        True in ``fit`` (record or forget the names), False in
        ``predict``/``transform`` (compare).

    Raises
    ------
    ValueError
        When both have names and they differ: names unseen at fit, names missing,
        or the same names in another order.

    Warns
    -----
    UserWarning
        When only one of the fitted estimator and ``X`` has feature names.
    """
    import warnings

    names = None if X.feature_names is None else np.asarray(X.feature_names, dtype=object)
    cls = type(estimator).__name__
    if reset:
        if names is not None:
            estimator.feature_names_in_ = names
        elif hasattr(estimator, "feature_names_in_"):
            del estimator.feature_names_in_
        return
    fitted = getattr(estimator, "feature_names_in_", None)
    if fitted is None and names is None:
        return
    if fitted is None:
        warnings.warn(f"X has feature names, but {cls} was fitted without feature names.",
                      UserWarning, stacklevel=3)
        return
    if names is None:
        warnings.warn(f"X has no feature names, but {cls} was fitted with feature names.",
                      UserWarning, stacklevel=3)
        return
    if len(fitted) == len(names) and np.array_equal(fitted, names):
        return
    seen, now = set(fitted.tolist()), set(names.tolist())
    parts = []
    unseen = [n for n in names.tolist() if n not in seen]
    missing = [n for n in fitted.tolist() if n not in now]
    if unseen:
        parts.append(f"feature names unseen at fit time: {_listed(unseen)}")
    if missing:
        parts.append(f"feature names seen at fit time, yet now missing: {_listed(missing)}")
    if not parts:
        k = int(np.flatnonzero(fitted != names)[0])
        parts.append(
            f"the feature names must be in the same order as in fit (feature {k} is "
            f"{names[k]!r}, fit saw {fitted[k]!r})"
        )
    raise ValueError(f"{cls}: the feature names of X differ from those seen in fit; "
                     + "; ".join(parts) + ".")


def _listed(names, limit=5):
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_int(value, name, *, minimum, caller):
    """Return ``value`` as an int ``>= minimum``, or raise a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{caller}: {name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def mean_hits(hits, sample_weight=None):
    """Mean of per-conversation hits, weighted by ``sample_weight`` when given.

    The one weighted-accuracy helper of the ``score`` methods.
    """
    from skafa.utils.sklearn_compat import check_sample_weight

    hits = np.asarray(hits, dtype=float)
    if sample_weight is None:
        return float(np.mean(hits))
    sample_weight = check_sample_weight(sample_weight, np.empty(hits.size))
    return float(np.average(hits, weights=sample_weight))


def reference_cycle(owner):
    """Names of the first parameter value of ``owner`` that contains itself, or None.

    Walks dicts, lists, tuples, sets and nested estimators' parameters iteratively
    (a deep but acyclic value cannot overflow the stack here).

    Parameters
    ----------
    owner : estimator

    Returns
    -------
    cycle : tuple of (str, str) or None
        ``(inner, outer)``: the value at ``inner`` is the value at ``outer`` (or
        ``owner`` itself); None without a cycle.

    Examples
    --------
    >>> from sklearn.linear_model import LogisticRegression
    >>> d = {}
    >>> d["self"] = d
    >>> reference_cycle(LogisticRegression(class_weight=d))
    ("class_weight['self']", 'class_weight')
    >>> reference_cycle(LogisticRegression()) is None
    True
    """
    containers = (dict, list, tuple, set, frozenset)
    params = owner.get_params(deep=False)
    todo = [(False, name, value) for name, value in reversed(list(params.items()))]
    # id -> name, for the values being walked (the current branch)
    open_ids = {id(owner): f"the {type(owner).__name__}"}
    while todo:
        leaving, name, value = todo.pop()
        if leaving:
            open_ids.pop(id(value), None)
            continue
        is_estimator = hasattr(value, "get_params") and not isinstance(value, type)
        if not (isinstance(value, containers) or is_estimator):
            continue
        if id(value) in open_ids:
            return name, open_ids[id(value)]
        open_ids[id(value)] = name
        todo.append((True, name, value))
        if isinstance(value, dict):
            items = [(f"{name}[{k!r}]", v) for k, v in value.items()]
        elif is_estimator:
            items = [(f"{name}.{k}", v) for k, v in value.get_params(deep=False).items()]
        else:
            items = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        todo.extend((False, n, v) for n, v in reversed(items))
    return None
