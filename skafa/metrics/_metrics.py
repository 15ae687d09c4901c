"""Metrics, bootstrap confidence intervals and scorers for failure attribution.

One sample is one conversation: ``y_true[i]`` is the decisive turn (0-based step) of
conversation ``i`` and ``y_pred[i]`` the predicted one.

* Step metrics: :func:`step_accuracy`, :func:`within_k_accuracy`,
  :func:`mean_absolute_step_shift`, :func:`top_k_step_accuracy`.
* Agent metric: :func:`agent_accuracy` with three matching rules (see its table) and
  :func:`normalize_agent`.
* Uncertainty: :func:`bootstrap_ci`, :func:`paired_bootstrap_ci`,
  :func:`bootstrap_ci_from_scores` (percentile bootstrap over conversations, or over
  groups such as task ids).
* Online auditing (AgentForesight's definitions; ``-1`` = safe run / no alarm):
  :func:`exact_f1`, :func:`false_alarm_rate`, :func:`online_step_accuracy`,
  :func:`average_step_shift`, plus :func:`detection_delay`, :func:`early_alarm_share`,
  :func:`miss_rate`.
* Scorers for ``scoring=`` in ``cross_val_score`` / ``GridSearchCV``:
  :data:`step_accuracy_scorer`, :func:`make_step_scorer`, :func:`within_k_scorer`,
  :func:`top_k_step_scorer`, :func:`agent_accuracy_scorer`, the name mapping
  :data:`SCORERS` and :func:`get_step_scorer`.
"""

from __future__ import annotations

import functools
import numbers
import re
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from sklearn.utils import check_random_state

from ..utils.validation import check_steps

__all__ = [
    "BootstrapResult",
    "SCORERS",
    "StepScorer",
    "agent_accuracy",
    "drop_unlabelled",
    "agent_accuracy_scorer",
    "bootstrap_ci",
    "bootstrap_ci_from_scores",
    "get_step_scorer",
    "lenient_step_accuracy",
    "lenient_step_matches",
    "make_step_scorer",
    "mean_absolute_step_shift",
    "normalize_agent",
    "paired_bootstrap_ci",
    "step_accuracy",
    "step_accuracy_scorer",
    "top_k_step_accuracy",
    "top_k_step_scorer",
    "within_k_accuracy",
    "within_k_scorer",
]

AGENT_RULES = ("exact", "normalized", "substring")


# ------------------------------------------------------------------ validation
def _check_lengths(y_true, *others, names=("y_true", "y_pred")):
    n = len(y_true)
    if n == 0:
        raise ValueError(f"{names[0]} is empty; need at least one conversation.")
    for other, name in zip(others, names[1:]):
        if len(other) != n:
            raise ValueError(
                f"{names[0]} and {name} have different lengths ({n} vs {len(other)})."
            )


def _is_unlabelled(step):
    """An unlabelled conversation's step: None (Conversation.mistake_step) or -1 (arrays).

    ``-1.0`` counts too (a float array of steps); ``True`` does not.
    """
    if step is None:
        return True
    try:
        return (isinstance(step, numbers.Real) and not isinstance(step, (bool, np.bool_))
                and step == -1)
    except (TypeError, ValueError):
        return False


def _unlabelled_mask(y_true, agents):
    """Per conversation, whether its label is missing (None; for steps also -1)."""
    if agents:
        return [v is None for v in y_true]
    return [_is_unlabelled(v) for v in y_true]


def _skip_unlabelled(caller, y_true, *others, agents=False, stacklevel=3,
                     names=("y_true", "y_pred")):
    """``y_true`` and ``others`` without the unlabelled conversations, warning with their number.

    The shared first step of every metric that scores against labels. Inputs that
    are not sequences are returned unchanged so the metric's own checks name the
    problem; sequences of different lengths are refused here, naming them.
    """
    if isinstance(y_true, (str, bytes)) or not hasattr(y_true, "__len__"):
        return (y_true, *others)
    if isinstance(y_true, np.ndarray) and y_true.ndim != 1:
        return (y_true, *others)
    n = len(y_true)
    if isinstance(y_true, np.ndarray) and y_true.dtype.kind in "iuf":
        keep = y_true != -1
    else:
        keep = ~np.asarray(_unlabelled_mask(y_true, agents), dtype=bool)
    keep = np.asarray(keep, dtype=bool).reshape(n)
    if keep.all():
        return (y_true, *others)
    if any(isinstance(o, (str, bytes)) or not hasattr(o, "__len__") for o in others):
        return (y_true, *others)
    for i, o in enumerate(others):
        if len(o) != n:
            name = names[i + 1] if i + 1 < len(names) else f"argument {i + 2}"
            raise ValueError(f"{names[0]} and {name} have different lengths ({n} vs "
                             f"{len(o)}).")
    n_skipped = int(n - np.count_nonzero(keep))
    what = "y_true None" if agents else "y_true None or -1"
    if n_skipped == n:
        raise ValueError(f"{caller}: all {n} conversations are unlabelled ({what}): there "
                         "is nothing to score.")
    warnings.warn(f"{caller}: skipped {n_skipped} unlabelled conversation(s) of {n} "
                  f"({what}); scoring the {n - n_skipped} labelled ones.", UserWarning,
                  stacklevel=stacklevel)
    idx = np.flatnonzero(keep)
    return tuple(seq[idx] if isinstance(seq, np.ndarray) else
                 seq.iloc[idx] if hasattr(seq, "iloc") else [seq[i] for i in idx]
                 for seq in (y_true, *others))


def _refuse_unlabelled(caller, y_true):
    """Raise for an unlabelled entry of ``y_true`` (per-conversation outputs cannot skip)."""
    if isinstance(y_true, (str, bytes)) or not hasattr(y_true, "__len__"):
        return
    if isinstance(y_true, np.ndarray) and y_true.ndim != 1:
        return
    for i, v in enumerate(y_true):
        if _is_unlabelled(v):
            raise ValueError(
                f"{caller}: y_true[{i}] is unlabelled ({v!r}); it returns one value per "
                "conversation, so drop unlabelled conversations first: y_true, y_pred = "
                "skafa.metrics.drop_unlabelled(y_true, y_pred).")


# The metrics that score against labels, and whether their labels are agents (None
# marks an unlabelled one) or steps (None or -1). bootstrap_ci and paired_bootstrap_ci
# drop unlabelled conversations once, before resampling, for these only: in the online
# metrics -1 is a safe run, not a missing label.
def _label_kind(metric):
    while isinstance(metric, functools.partial):
        metric = metric.func
    try:
        return _LABEL_METRICS.get(metric)
    except TypeError:  # an unhashable callable: not one of ours
        return None


def drop_unlabelled(y_true, *others):
    """Drop the conversations without a label, with a warning that counts them.

    Unlabelled runs (``load_who_and_when`` reads a record whose labels are null
    or absent as one) can be attributed but not scored. The metrics that return
    one number (:func:`step_accuracy`, :func:`within_k_accuracy`,
    :func:`agent_accuracy`, :func:`bootstrap_ci`, ...) skip them themselves and
    warn with their number; call this to align other per-conversation arrays
    (turn scores, groups, conversations) once, or before a function that
    returns one value per conversation (:func:`lenient_step_matches`), which
    refuses unlabelled ones. It warns with the number skipped.

    Parameters
    ----------
    y_true : sequence
        True steps (``None`` or ``-1`` for an unlabelled conversation) or true
        agents (``None`` for an unlabelled one).
    *others : sequences of the same length
        Predictions, turn scores, groups... filtered the same way.

    Returns
    -------
    tuple
        ``y_true`` and each of ``others``, labelled conversations only (the
        inputs themselves when nothing is unlabelled).

    Raises
    ------
    ValueError
        When every conversation is unlabelled.

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     y, p = drop_unlabelled([0, -1, 2], [0, 1, 1])
    >>> step_accuracy(y, p)
    0.5
    """
    if isinstance(y_true, (str, bytes)) or not hasattr(y_true, "__len__"):
        return (y_true, *others)
    keep = [not u for u in _unlabelled_mask(y_true, agents=False)]
    if all(keep):
        return (y_true, *others)
    n_skipped, n = keep.count(False), len(keep)
    if n_skipped == n:
        raise ValueError(f"all {n} conversations are unlabelled (y_true None or -1): there "
                         "is nothing to score.")
    warnings.warn(f"skipped {n_skipped} unlabelled conversation(s) of {n} (y_true None or "
                  f"-1); scoring the {n - n_skipped} labelled ones.", UserWarning,
                  stacklevel=2)
    idx = np.flatnonzero(keep)
    out = []
    for seq in (y_true, *others):
        if hasattr(seq, "__len__") and len(seq) == n:
            seq = seq[idx] if isinstance(seq, np.ndarray) else [seq[i] for i in idx]
        out.append(seq)
    return tuple(out)


def _check_pair(y_true, y_pred):
    t = check_steps(y_true, name="y_true")
    p = check_steps(y_pred, name="y_pred")
    _check_lengths(t, p)
    return t, p


def _check_k(k, name="k", minimum=0):
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {k!r}.")
    return int(k)


# ------------------------------------------------------------------ step metrics
def step_accuracy(y_true, y_pred):
    """Fraction of conversations whose decisive step is predicted exactly.

    Parameters
    ----------
    y_true : array-like of int, shape (n_conversations,)
        True decisive steps (0-based turn indices).
    y_pred : array-like of int, shape (n_conversations,)
        Predicted steps.

    Returns
    -------
    score : float
        In [0, 1].

    Notes
    -----
    Steps are compared as integers. The official Who&When scorer compares the
    decimal strings with ``in`` (so a true step ``"1"`` also matches a predicted
    ``"12"``); numbers computed here can therefore be slightly lower than ones
    computed with that script, which :func:`lenient_step_accuracy` reproduces.

    Unlabelled conversations (``y_true`` ``None`` or ``-1``, as
    :func:`~skafa.datasets.load_who_and_when` gives for a record without
    ``mistake_step``) are skipped with a ``UserWarning`` that counts them; the
    same holds for every metric here that scores against true steps or agents.

    Examples
    --------
    >>> step_accuracy([0, 2, 5, 1], [0, 3, 5, 1])
    0.75
    """
    y_true, y_pred = _skip_unlabelled("step_accuracy", y_true, y_pred)
    t, p = _check_pair(y_true, y_pred)
    return float(np.mean(t == p))


def lenient_step_matches(y_true, y_pred):
    """Per conversation, whether the true step's digits occur in the predicted step's.

    The per-conversation hits of :func:`lenient_step_accuracy` (a boolean array),
    for bootstrap intervals over conversations.

    Parameters
    ----------
    y_true, y_pred : array-like of int, shape (n_conversations,)
        True and predicted steps (0-based turn indices).

    Returns
    -------
    hits : ndarray of bool, shape (n_conversations,)

    Examples
    --------
    >>> lenient_step_matches([1, 1, 3], [1, 10, 4]).tolist()
    [True, True, False]

    Raises
    ------
    ValueError
        For an unlabelled conversation (``y_true`` ``None`` or ``-1``): the
        hits are one per conversation, so drop those first with
        :func:`drop_unlabelled` (passing whatever else must stay aligned).
    """
    _refuse_unlabelled("lenient_step_matches", y_true)
    t, p = _check_pair(y_true, y_pred)
    return np.array([str(int(a)) in str(int(b)) for a, b in zip(t, p)], dtype=bool)


def lenient_step_accuracy(y_true, y_pred):
    """LENIENT step accuracy: Who&When's own evaluation, as published papers report it.

    A conversation counts as a hit when the decimal digits of the true step occur
    anywhere inside the decimal string of the predicted step
    (``str(true) in str(pred)``), as the Who&When evaluation script compares them.
    So predicting step 10, 11 or 21 when the truth is 1 is a hit. It is never
    lower than :func:`step_accuracy` (exact match), which is skafa's headline
    metric; report this one only beside it, to compare with published figures.

    Steps are 0-based turn indices, as in Who&When's ``mistake_step`` field, so the
    strings compared are those of the 0-based indices.

    Parameters
    ----------
    y_true : array-like of int, shape (n_conversations,)
        True decisive steps (0-based turn indices).
    y_pred : array-like of int, shape (n_conversations,)
        Predicted steps.

    Returns
    -------
    score : float
        In [0, 1], at least :func:`step_accuracy` of the same input.

    See Also
    --------
    step_accuracy : The exact metric.
    lenient_step_matches : The per-conversation hits.

    Examples
    --------
    >>> lenient_step_accuracy([1, 2, 5, 0], [10, 3, 5, 0])
    0.75
    >>> step_accuracy([1, 2, 5, 0], [10, 3, 5, 0])
    0.5
    """
    y_true, y_pred = _skip_unlabelled("lenient_step_accuracy", y_true, y_pred)
    return float(np.mean(lenient_step_matches(y_true, y_pred)))


def within_k_accuracy(y_true, y_pred, k=1):
    """Fraction of conversations whose predicted step is at most ``k`` turns off.

    Parameters
    ----------
    y_true, y_pred : array-like of int, shape (n_conversations,)
        True and predicted steps.
    k : int, default=1
        Tolerance in turns (``k=0`` is :func:`step_accuracy`).

    Returns
    -------
    score : float

    Examples
    --------
    >>> within_k_accuracy([0, 2, 5, 1], [1, 4, 5, 0], k=1)
    0.75
    """
    k = _check_k(k)
    y_true, y_pred = _skip_unlabelled("within_k_accuracy", y_true, y_pred)
    t, p = _check_pair(y_true, y_pred)
    return float(np.mean(np.abs(t - p) <= k))


def mean_absolute_step_shift(y_true, y_pred):
    """Mean absolute distance, in turns, between predicted and true steps.

    Lower is better; use ``make_step_scorer(mean_absolute_step_shift,
    greater_is_better=False)`` (or ``SCORERS["neg_mean_absolute_step_shift"]``) as a
    scorer.

    Parameters
    ----------
    y_true, y_pred : array-like of int, shape (n_conversations,)

    Returns
    -------
    shift : float

    Examples
    --------
    >>> mean_absolute_step_shift([0, 2, 5, 1], [1, 4, 5, 1])
    0.75
    """
    y_true, y_pred = _skip_unlabelled("mean_absolute_step_shift", y_true, y_pred)
    t, p = _check_pair(y_true, y_pred)
    return float(np.mean(np.abs(t - p)))


def _check_turn_scores(turn_scores, n, name="turn_scores"):
    if isinstance(turn_scores, np.ndarray) and turn_scores.ndim == 2:
        turn_scores = list(turn_scores)
    if isinstance(turn_scores, (str, bytes)) or not isinstance(turn_scores, (Sequence, np.ndarray)):
        raise TypeError(
            f"{name} must be a list of 1-D arrays (one score per turn, per conversation), "
            f"got {type(turn_scores).__name__}."
        )
    if len(turn_scores) != n:
        raise ValueError(f"y_true and {name} have different lengths ({n} vs {len(turn_scores)}).")
    out = []
    for i, s in enumerate(turn_scores):
        s = np.asarray(s, dtype=float)
        if s.ndim != 1 or s.size == 0:
            raise ValueError(
                f"{name}[{i}] must be a non-empty 1-D array of per-turn scores, got shape "
                f"{s.shape}."
            )
        if not np.all(np.isfinite(s)):
            raise ValueError(f"{name}[{i}] contains NaN or infinite scores.")
        out.append(s)
    return out


def _top_k_hits(t, scores, k):
    hits = np.empty(t.size, dtype=bool)
    for i, (step, s) in enumerate(zip(t, scores)):
        if step >= s.size:
            raise ValueError(
                f"y_true[{i}]={step} is outside conversation {i}, which has {s.size} turn "
                "scores."
            )
        # Rank of the true turn, ties broken toward the earlier turn: turns scoring
        # higher, plus earlier turns scoring the same, come before it.
        rank = np.count_nonzero(s > s[step]) + np.count_nonzero(s[:step] == s[step])
        hits[i] = rank < k
    return hits


def top_k_step_accuracy(y_true, turn_scores, k=3):
    """Fraction of conversations whose true step is among the ``k`` best-scored turns.

    Parameters
    ----------
    y_true : array-like of int, shape (n_conversations,)
        True decisive steps.
    turn_scores : list of 1-D arrays
        One array per conversation with one score per turn (higher = more likely
        decisive), e.g. ``estimator.turn_decision_function(X)``. A 2-D array is
        read as one row per conversation.
    k : int, default=3
        How many turns count. With ``k=1`` this is the step accuracy of the argmax
        (ties to the earlier turn).

    Returns
    -------
    score : float

    Notes
    -----
    Ties are broken toward the earlier turn, as ``np.argmax`` does: among turns with
    equal scores the earliest ranks first, so a tie can push a later true turn out of
    the top ``k``.

    Examples
    --------
    >>> top_k_step_accuracy([2, 2], [[0.1, 0.5, 0.4], [0.2, 0.9, 0.2]], k=2)
    0.5
    """
    k = _check_k(k, minimum=1)
    if isinstance(turn_scores, np.ndarray) and turn_scores.ndim == 2:
        turn_scores = list(turn_scores)
    y_true, turn_scores = _skip_unlabelled("top_k_step_accuracy", y_true, turn_scores,
                                           names=("y_true", "turn_scores"))
    t = check_steps(y_true, name="y_true")
    _check_lengths(t)
    scores = _check_turn_scores(turn_scores, t.size)
    return float(np.mean(_top_k_hits(t, scores, k)))


# ------------------------------------------------------------------ agent metric
_TRAILING_PAREN = re.compile(r"\s*\([^()]*\)\s*$")


def normalize_agent(name):
    """Normalise an agent name for the ``"normalized"`` rule of :func:`agent_accuracy`.

    Case-folds, strips surrounding whitespace and drops trailing parentheticals, so
    ``"Orchestrator (thought)"`` and ``"Orchestrator (-> WebSurfer)"`` both become
    ``"orchestrator"``. A name that is only a parenthetical keeps its text.

    Parameters
    ----------
    name : str

    Returns
    -------
    normalized : str

    Examples
    --------
    >>> normalize_agent("  Orchestrator (-> WebSurfer) ")
    'orchestrator'
    >>> normalize_agent("Excel_Expert")
    'excel_expert'
    """
    if not isinstance(name, str):
        raise TypeError(f"an agent name must be a string, got {type(name).__name__}.")
    out = name.strip()
    while True:
        shorter = _TRAILING_PAREN.sub("", out)
        if shorter == out or not shorter:
            break
        out = shorter
    return out.casefold()


def _check_agents(agents, name):
    if isinstance(agents, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of agent names, got a single string.")
    agents = list(np.asarray(agents, dtype=object).ravel()) if isinstance(
        agents, np.ndarray) else list(agents)
    for i, a in enumerate(agents):
        if not isinstance(a, str):
            raise TypeError(
                f"{name}[{i}]={a!r} is not a string agent name (use '' for 'no prediction')."
            )
    return agents


def _agent_hits(true_agents, pred_agents, rule):
    if rule == "exact":
        return np.array([t == p for t, p in zip(true_agents, pred_agents)], dtype=bool)
    if rule == "normalized":
        return np.array(
            [normalize_agent(t) == normalize_agent(p) for t, p in zip(true_agents, pred_agents)],
            dtype=bool,
        )
    if rule == "substring":
        for i, t in enumerate(true_agents):
            if not t:
                raise ValueError(
                    f"y_true_agents[{i}] is empty; with rule='substring' it would match "
                    "every prediction."
                )
        return np.array([t in p for t, p in zip(true_agents, pred_agents)], dtype=bool)
    raise ValueError(f"unknown rule {rule!r}; use one of {AGENT_RULES}.")


def _agent_pair(y_true_agents, y_pred_agents, rule):
    if rule not in AGENT_RULES:
        raise ValueError(f"unknown rule {rule!r}; use one of {AGENT_RULES}.")
    t = _check_agents(y_true_agents, "y_true_agents")
    p = _check_agents(y_pred_agents, "y_pred_agents")
    _check_lengths(t, p, names=("y_true_agents", "y_pred_agents"))
    return t, p


def agent_accuracy(y_true_agents, y_pred_agents, *, rule="normalized"):
    """Fraction of conversations whose responsible agent is predicted correctly.

    Published Who&When numbers use different matching rules, so the rule is explicit:

    ================  ===================================================  ====  ====
    rule              counted correct when                                 (a)   (b)
    ================  ===================================================  ====  ====
    ``"exact"``       ``true == pred``                                     no    no
    ``"normalized"``  ``normalize_agent(true) == normalize_agent(pred)``   yes   yes
    ``"substring"``   ``true in pred`` (case-sensitive)                    yes   no
    ================  ===================================================  ====  ====

    (a) true ``"Orchestrator"``, predicted ``"Orchestrator (thought)"``;
    (b) true ``"Orchestrator (thought)"``, predicted ``"Orchestrator"``.

    ``"substring"`` is the rule of the official scorer, ``Automated_FA/evaluate.py``
    (function ``evaluate_accuracy``) of https://github.com/mingyin1/Agents_Failure_Attribution:
    a prediction counts as correct when the annotated ``mistake_agent`` occurs inside
    the predicted agent string (the true name is the needle, the prediction the
    haystack), without case folding. That script first extracts the predicted name
    from the judge's text with a word-character pattern, so a predicted
    ``"Orchestrator (thought)"`` reaches the comparison as ``"Orchestrator"``; this
    function takes the predicted strings as given. Some forks changed the rule to
    ``==`` (our ``"exact"``).

    Parameters
    ----------
    y_true_agents : sequence of str, shape (n_conversations,)
        True responsible agents (e.g. Who&When's ``mistake_agent``, or the speaker of
        the true decisive turn).
    y_pred_agents : sequence of str, shape (n_conversations,)
        Predicted agents (e.g. ``estimator.predict_agent(X)``). Use ``""`` for "no
        prediction".
    rule : {"normalized", "exact", "substring"}, default="normalized"
        The matching rule (table above).

    Returns
    -------
    score : float

    Examples
    --------
    >>> true = ["Orchestrator", "WebSurfer", "Excel_Expert"]
    >>> pred = ["Orchestrator (thought)", "websurfer", "Excel_Expert"]
    >>> [agent_accuracy(true, pred, rule=r) for r in ("exact", "normalized", "substring")]
    [0.3333333333333333, 1.0, 0.6666666666666666]

    A conversation whose true agent is ``None`` (an unlabelled record) is
    skipped with a ``UserWarning`` that counts the skipped ones.
    """
    y_true_agents, y_pred_agents = _skip_unlabelled(
        "agent_accuracy", y_true_agents, y_pred_agents, agents=True,
        names=("y_true_agents", "y_pred_agents"))
    t, p = _agent_pair(y_true_agents, y_pred_agents, rule)
    return float(np.mean(_agent_hits(t, p, rule)))


_LABEL_METRICS = {step_accuracy: False, lenient_step_accuracy: False,
                  within_k_accuracy: False, mean_absolute_step_shift: False,
                  top_k_step_accuracy: False, agent_accuracy: True}


# ------------------------------------------------------------------ bootstrap
class BootstrapResult(NamedTuple):
    """A point estimate with a percentile-bootstrap confidence interval.

    Attributes
    ----------
    estimate : float
        The metric on the full data.
    low, high : float
        The interval's bounds (percentiles ``(1 - confidence) / 2`` and
        ``(1 + confidence) / 2`` of the bootstrap distribution).
    n : int
        Number of conversations (samples) the estimate is computed on.
    confidence : float
        The nominal coverage, e.g. 0.95.
    """

    estimate: float
    low: float
    high: float
    n: int
    confidence: float


def _check_bootstrap_params(n_resamples, confidence):
    _check_k(n_resamples, "n_resamples", minimum=1)
    if (isinstance(confidence, bool) or not isinstance(confidence, numbers.Real)
            or not 0 < confidence < 1):
        raise ValueError(f"confidence must be a float in (0, 1), got {confidence!r}.")


def _resample_units(n, groups, n_resamples, random_state):
    """Return (unit_of_sample, n_units, draws) where draws is (n_resamples, n_units)."""
    if groups is None:
        units, n_units = np.arange(n), n
    else:
        if isinstance(groups, (str, bytes)):
            raise TypeError("groups must be a sequence with one label per conversation.")
        labels = list(np.asarray(groups, dtype=object).ravel()) if isinstance(
            groups, np.ndarray) else list(groups)
        if len(labels) != n:
            raise ValueError(
                f"groups must have one entry per conversation ({n}), got {len(labels)}."
            )
        codes = {}
        try:
            units = np.array([codes.setdefault(g, len(codes)) for g in labels], dtype=np.int64)
        except TypeError as exc:
            raise TypeError(f"group labels must be hashable ({exc}).") from exc
        if None in codes:
            raise ValueError("groups contains None; every conversation needs a group.")
        n_units = len(codes)
    rng = check_random_state(random_state)
    draws = rng.randint(0, n_units, size=(n_resamples, n_units))
    return units, n_units, draws


def _indices_of(draw, members):
    return np.concatenate([members[u] for u in draw])


def _percentile_interval(stats, confidence):
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(np.asarray(stats, dtype=float), [alpha, 1.0 - alpha])
    return float(low), float(high)


def bootstrap_ci_from_scores(per_sample_scores, *, n_resamples=2000, confidence=0.95,
                             random_state=None, groups=None):
    """Percentile-bootstrap CI of the mean of per-conversation scores.

    Use it for any metric that is a mean over conversations (e.g. 0/1 correctness).
    With ``groups``, whole groups are resampled (cluster bootstrap) and the statistic
    is the mean over every conversation of the drawn groups.

    Parameters
    ----------
    per_sample_scores : array-like of float, shape (n_conversations,)
        E.g. ``y_pred == y_true``.
    n_resamples : int, default=2000
    confidence : float, default=0.95
    random_state : int, RandomState instance or None, default=None
        Seed of the resampling; an int makes the interval reproducible.
    groups : array-like, shape (n_conversations,), optional
        Cluster labels (e.g. task ids): resample groups instead of conversations.

    Returns
    -------
    result : BootstrapResult

    Examples
    --------
    >>> res = bootstrap_ci_from_scores([1, 0, 1, 1], random_state=0)
    >>> res.estimate, res.n
    (0.75, 4)
    """
    _check_bootstrap_params(n_resamples, confidence)
    scores = np.asarray(per_sample_scores, dtype=float)
    if scores.ndim != 1:
        raise ValueError(f"per_sample_scores must be 1-D, got shape {scores.shape}.")
    if scores.size == 0:
        raise ValueError("per_sample_scores is empty; need at least one conversation.")
    if not np.all(np.isfinite(scores)):
        raise ValueError("per_sample_scores contains NaN or infinite values.")
    stats = _mean_stats(scores, groups, n_resamples, random_state)
    low, high = _percentile_interval(stats, confidence)
    return BootstrapResult(float(scores.mean()), low, high, int(scores.size), float(confidence))


def _mean_stats(scores, groups, n_resamples, random_state):
    units, n_units, draws = _resample_units(scores.size, groups, n_resamples, random_state)
    sums = np.bincount(units, weights=scores, minlength=n_units)
    sizes = np.bincount(units, minlength=n_units).astype(float)
    return sums[draws].sum(axis=1) / sizes[draws].sum(axis=1)


def _per_sample_function(metric):
    """Per-conversation scores whose mean is ``metric(y_true, y_pred)`` (None if unknown)."""
    if metric is step_accuracy:
        def exact(t, p):
            t, p = _check_pair(t, p)
            return (t == p).astype(float)
        return exact
    if metric is within_k_accuracy:  # called with its default k=1
        def within_1(t, p):
            t, p = _check_pair(t, p)
            return (np.abs(t - p) <= 1).astype(float)
        return within_1
    if metric is mean_absolute_step_shift:
        def shift(t, p):
            t, p = _check_pair(t, p)
            return np.abs(t - p).astype(float)
        return shift
    if metric is agent_accuracy:  # called with its default rule
        def agents(t, p):
            t, p = _agent_pair(t, p, "normalized")
            return _agent_hits(t, p, "normalized").astype(float)
        return agents
    return None


def _take(seq, idx):
    if isinstance(seq, np.ndarray) or hasattr(seq, "shape"):  # arrays, TurnFeatures
        return seq[idx]
    return [seq[i] for i in idx]


def _as_indexable(y):
    return y if isinstance(y, np.ndarray) else list(y)


def _generic_stats(y_true, preds, metric, groups, n_resamples, random_state, combine):
    n = len(y_true)
    for p in preds:
        if len(p) != n:
            raise ValueError(f"y_true and a prediction have different lengths ({n} vs {len(p)}).")
    units, n_units, draws = _resample_units(n, groups, n_resamples, random_state)
    members = [np.flatnonzero(units == u) for u in range(n_units)]
    stats = np.empty(n_resamples)
    for r, draw in enumerate(draws):
        idx = _indices_of(draw, members)
        t = _take(y_true, idx)
        stats[r] = combine(*[metric(t, _take(p, idx)) for p in preds])
    return stats


def _skip_before_resampling(caller, metric, y_true, preds, groups):
    """``(y_true, *preds, groups)`` without unlabelled conversations, for label metrics.

    One warning counts them (not one per resample), and no resample can be
    left with nothing to score. Other metrics get their input unchanged.
    """
    kind = _label_kind(metric)
    if kind is None:
        return (y_true, *preds, groups)
    names = ("y_true",) + (("y_pred",) if len(preds) == 1 else ("y_pred_a", "y_pred_b"))
    if groups is None:
        return (*_skip_unlabelled(caller, y_true, *preds, agents=kind, stacklevel=4,
                                  names=names), None)
    return _skip_unlabelled(caller, y_true, *preds, groups, agents=kind, stacklevel=4,
                            names=names + ("groups",))


def bootstrap_ci(y_true, y_pred, metric=step_accuracy, *, n_resamples=2000, confidence=0.95,
                 random_state=None, groups=None):
    """Percentile-bootstrap confidence interval of a metric over conversations.

    Each resample draws ``n_conversations`` conversations with replacement (or, with
    ``groups``, ``n_groups`` groups with replacement, keeping every conversation of a
    drawn group: a cluster bootstrap, which is what a benchmark whose tasks recur
    across runs needs) and recomputes ``metric``. The interval is the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles of the resampled
    values; the estimate is the metric on the full data.

    Parameters
    ----------
    y_true : array-like, shape (n_conversations,)
        True steps (or agents, for an agent metric).
    y_pred : array-like or list, shape (n_conversations,)
        Predictions; for :func:`top_k_step_accuracy` the list of per-turn scores.
    metric : callable, default=step_accuracy
        ``metric(y_true, y_pred) -> float``. Use :func:`functools.partial` to fix
        keyword arguments (e.g. ``partial(within_k_accuracy, k=2)``). The built-in
        mean metrics (``step_accuracy``, ``within_k_accuracy`` with ``k=1``,
        ``mean_absolute_step_shift``, ``agent_accuracy`` with its default rule) are
        resampled with a vectorised path that gives the same numbers.
    n_resamples : int, default=2000
    confidence : float, default=0.95
    random_state : int, RandomState instance or None, default=None
        An int makes the interval reproducible.
    groups : array-like, shape (n_conversations,), optional
        Cluster labels such as task ids.

    Returns
    -------
    result : BootstrapResult
        ``(estimate, low, high, n, confidence)``. With a metric of this module
        that scores against labels (a :func:`functools.partial` of one
        included), unlabelled conversations (``y_true`` ``None`` or ``-1``;
        ``None`` for an agent metric) are dropped once, with a ``UserWarning``
        that counts them, before resampling, and ``n`` counts the labelled
        ones.

    Examples
    --------
    >>> res = bootstrap_ci([0, 1, 2, 3], [0, 1, 2, 0], random_state=0)
    >>> res.estimate, res.low <= res.estimate <= res.high
    (0.75, True)
    """
    _check_bootstrap_params(n_resamples, confidence)
    y_true, y_pred, groups = _skip_before_resampling("bootstrap_ci", metric, y_true,
                                                     [y_pred], groups)
    estimate = float(metric(y_true, y_pred))
    n = len(y_true)
    per_sample = _per_sample_function(metric)
    if per_sample is not None:
        stats = _mean_stats(per_sample(y_true, y_pred), groups, n_resamples, random_state)
    else:
        stats = _generic_stats(_as_indexable(y_true), [_as_indexable(y_pred)], metric, groups,
                               n_resamples, random_state, lambda v: v)
    low, high = _percentile_interval(stats, confidence)
    return BootstrapResult(estimate, low, high, int(n), float(confidence))


def paired_bootstrap_ci(y_true, y_pred_a, y_pred_b, metric=step_accuracy, *, n_resamples=2000,
                        confidence=0.95, random_state=None, groups=None):
    """Bootstrap CI of the difference ``metric(a) - metric(b)`` of two systems.

    Both systems are scored on the same resampled conversations (or groups), so the
    interval accounts for their correlation; an interval excluding 0 suggests a real
    difference at the given confidence.

    Parameters
    ----------
    y_true : array-like, shape (n_conversations,)
    y_pred_a, y_pred_b : array-like or list, shape (n_conversations,)
        Predictions of system A and system B.
    metric : callable, default=step_accuracy
    n_resamples : int, default=2000
    confidence : float, default=0.95
    random_state : int, RandomState instance or None, default=None
    groups : array-like, shape (n_conversations,), optional
        Cluster labels (cluster bootstrap).

    Returns
    -------
    result : BootstrapResult
        ``estimate`` is ``metric(y_true, y_pred_a) - metric(y_true, y_pred_b)``.
        Unlabelled conversations are dropped first, as in :func:`bootstrap_ci`.

    Examples
    --------
    >>> res = paired_bootstrap_ci([0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0], random_state=0)
    >>> res.estimate
    0.75
    """
    _check_bootstrap_params(n_resamples, confidence)
    y_true, y_pred_a, y_pred_b, groups = _skip_before_resampling(
        "paired_bootstrap_ci", metric, y_true, [y_pred_a, y_pred_b], groups)
    estimate = float(metric(y_true, y_pred_a)) - float(metric(y_true, y_pred_b))
    n = len(y_true)
    per_sample = _per_sample_function(metric)
    if per_sample is not None:
        diff = per_sample(y_true, y_pred_a) - per_sample(y_true, y_pred_b)
        stats = _mean_stats(diff, groups, n_resamples, random_state)
    else:
        stats = _generic_stats(_as_indexable(y_true),
                               [_as_indexable(y_pred_a), _as_indexable(y_pred_b)], metric,
                               groups, n_resamples, random_state, lambda a, b: a - b)
    low, high = _percentile_interval(stats, confidence)
    return BootstrapResult(estimate, low, high, int(n), float(confidence))


# ------------------------------------------------------------------ scorers
def _true_speakers(X, y):
    """Speaker of the true decisive turn of every conversation of ``X``.

    ``None`` for an unlabelled conversation (``y`` ``None`` or ``-1``), which
    :func:`agent_accuracy` then skips.
    """
    unlabelled = None
    if isinstance(y, (list, tuple)) or (isinstance(y, np.ndarray) and y.ndim == 1):
        mask = _unlabelled_mask(y, agents=False)
        if any(mask):
            unlabelled = np.flatnonzero(mask)
            y = [0 if u else v for v, u in zip(y, mask)]  # turn 0 exists; reset below
    out = _labelled_speakers(X, y)
    if unlabelled is not None:
        for i in unlabelled:
            out[i] = None
    return out


def _labelled_speakers(X, y):
    steps = check_steps(y, name="y")
    if hasattr(X, "speakers_at"):
        if getattr(X, "speakers", None) is None:
            raise ValueError(
                "agent_accuracy_scorer needs the speaker of every turn, but this "
                "TurnFeatures carries no speakers (build it with speakers=...)."
            )
        return list(X.speakers_at(steps))
    if isinstance(X, (str, bytes)) or not isinstance(X, (Sequence, np.ndarray)):
        raise TypeError(
            "agent_accuracy_scorer reads speakers from X: pass a TurnFeatures with "
            f"speakers or a list of Conversations, not {type(X).__name__}."
        )
    if len(X) != steps.size:
        raise ValueError(f"X and y have different lengths ({len(X)} vs {steps.size}).")
    out = []
    for i, (conv, step) in enumerate(zip(X, steps)):
        speakers = getattr(conv, "speakers", None)
        if speakers is None:
            raise TypeError(
                f"X[{i}] is a {type(conv).__name__}, not a Conversation; cannot read speakers."
            )
        if step >= len(speakers):
            raise ValueError(
                f"y[{i}]={step} is outside conversation {i}, which has {len(speakers)} turns."
            )
        out.append(speakers[step])
    return out


class StepScorer:
    """A scorer ``scorer(estimator, X, y) -> float`` for conversation-level estimators.

    Usable as ``scoring=`` in :func:`~sklearn.model_selection.cross_val_score`,
    :class:`~sklearn.model_selection.GridSearchCV` and friends. Build one with
    :func:`make_step_scorer`, :func:`within_k_scorer`, :func:`top_k_step_scorer` or
    :func:`agent_accuracy_scorer` rather than directly.

    Parameters
    ----------
    metric : callable
        ``metric(y_true, y_pred, **kwargs) -> float``.
    response_method : {"predict", "turn_decision_function", "predict_agent"}
        Which estimator method produces ``y_pred``. With ``"predict_agent"``, the true
        agents are the speakers of the true turns, read from ``X``.
    sign : {1, -1}
        -1 for metrics where lower is better (scorers are maximised).
    kwargs : dict
        Extra keyword arguments of ``metric``.
    """

    def __init__(self, metric, response_method="predict", sign=1, kwargs=None):
        self.metric = metric
        self.response_method = response_method
        self.sign = sign
        self.kwargs = kwargs

    def __call__(self, estimator, X, y, **params):
        if params:
            raise TypeError(
                f"{self!r} does not accept extra scoring parameters {sorted(params)} "
                "(sample weights are not supported for step metrics)."
            )
        if y is None:
            raise ValueError(f"{self!r} needs the true steps y.")
        method = getattr(estimator, self.response_method, None)
        if method is None:
            raise AttributeError(
                f"{type(estimator).__name__} has no method {self.response_method!r}, "
                f"which {self!r} needs."
            )
        kwargs = self.kwargs or {}
        if self.response_method == "predict_agent":
            y_true = _true_speakers(X, y)
            return self.sign * float(self.metric(y_true, method(X), **kwargs))
        y_pred = method(X)
        if self.response_method == "turn_decision_function" and hasattr(X, "n_turns"):
            y_pred = _check_turn_scores(y_pred, len(X))
            bad = [i for i, (s, n) in enumerate(zip(y_pred, X.n_turns)) if s.size != n]
            if bad:
                i = bad[0]
                raise ValueError(
                    f"turn_decision_function returned {y_pred[i].size} scores for conversation "
                    f"{i}, which has {int(X.n_turns[i])} turns."
                )
        return self.sign * float(self.metric(y, y_pred, **kwargs))

    def __repr__(self):
        name = getattr(self.metric, "__name__", repr(self.metric))
        extra = "".join(f", {k}={v!r}" for k, v in (self.kwargs or {}).items())
        sign = ", greater_is_better=False" if self.sign < 0 else ""
        return f"make_step_scorer({name}{extra}{sign}, response_method={self.response_method!r})"


def make_step_scorer(metric, *, greater_is_better=True, response_method="predict", **kwargs):
    """Make a scorer from a step metric, calling ``estimator.predict(X)``.

    Parameters
    ----------
    metric : callable
        ``metric(y_true, y_pred, **kwargs) -> float``, e.g. :func:`within_k_accuracy`.
    greater_is_better : bool, default=True
        If False the scorer returns ``-metric`` (sklearn maximises scores).
    response_method : {"predict", "turn_decision_function", "predict_agent"}, \
            default="predict"
        Estimator method giving the predictions passed to ``metric``.
    **kwargs
        Passed to ``metric``.

    Returns
    -------
    scorer : StepScorer
        Callable ``scorer(estimator, X, y) -> float``.

    Examples
    --------
    >>> from skafa.metrics import make_step_scorer, within_k_accuracy
    >>> scorer = make_step_scorer(within_k_accuracy, k=2)
    """
    if not callable(metric):
        raise TypeError(f"metric must be callable, got {type(metric).__name__}.")
    methods = ("predict", "turn_decision_function", "predict_agent")
    if response_method not in methods:
        raise ValueError(f"response_method must be one of {methods}, got {response_method!r}.")
    return StepScorer(metric, response_method, 1 if greater_is_better else -1, dict(kwargs))


def within_k_scorer(k=1):
    """Scorer for :func:`within_k_accuracy` (calls ``estimator.predict``)."""
    return make_step_scorer(within_k_accuracy, k=_check_k(k))


def top_k_step_scorer(k=3):
    """Scorer for :func:`top_k_step_accuracy` (calls ``estimator.turn_decision_function``).

    With a :class:`~skafa.TurnFeatures` ``X``, the number of scores of every
    conversation is checked against its number of turns.
    """
    return make_step_scorer(top_k_step_accuracy, response_method="turn_decision_function",
                            k=_check_k(k, minimum=1))


def agent_accuracy_scorer(rule="normalized"):
    """Scorer for agent accuracy (calls ``estimator.predict_agent``).

    Cross-validation passes only the steps ``y``, so the true agent of conversation
    ``i`` is defined as the **speaker of its true decisive turn** ``y[i]``, read from
    ``X`` (``X.speakers_at(y)`` for a :class:`~skafa.TurnFeatures`,
    ``X[i].speakers[y[i]]`` for a list of :class:`~skafa.Conversation`). That can
    differ from the annotated ``mistake_agent``: on a 110-record Who&When subset the
    speaker of the true turn equals the annotation in 95.5% of records under
    ``"exact"``, 96.4% under ``"normalized"`` and 97.3% under ``"substring"``. To score
    against the annotation call
    ``agent_accuracy(data.mistake_agents, est.predict_agent(X), rule=...)`` directly.

    Parameters
    ----------
    rule : {"normalized", "exact", "substring"}, default="normalized"
        See :func:`agent_accuracy`.
    """
    if rule not in AGENT_RULES:
        raise ValueError(f"unknown rule {rule!r}; use one of {AGENT_RULES}.")
    return make_step_scorer(agent_accuracy, response_method="predict_agent", rule=rule)


#: Scorer for :func:`step_accuracy` (calls ``estimator.predict``).
step_accuracy_scorer = make_step_scorer(step_accuracy)

#: Named scorers; :func:`get_step_scorer` looks names up here.
SCORERS = {
    "step_accuracy": step_accuracy_scorer,
    "within_1": within_k_scorer(1),
    "within_2": within_k_scorer(2),
    "within_3": within_k_scorer(3),
    "top1": top_k_step_scorer(1),
    "top3": top_k_step_scorer(3),
    "top5": top_k_step_scorer(5),
    "neg_mean_absolute_step_shift": make_step_scorer(mean_absolute_step_shift,
                                                     greater_is_better=False),
    "agent_accuracy": agent_accuracy_scorer("normalized"),
    "agent_accuracy_exact": agent_accuracy_scorer("exact"),
    "agent_accuracy_substring": agent_accuracy_scorer("substring"),
}


def get_step_scorer(scoring):
    """Return a scorer from a name in :data:`SCORERS` (a callable is returned as is).

    Parameters
    ----------
    scoring : str or callable

    Returns
    -------
    scorer : callable
    """
    if callable(scoring):
        return scoring
    try:
        return SCORERS[scoring]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown scorer {scoring!r}; available: {sorted(SCORERS)}."
        ) from None


# ------------------------------------------------------------------ online auditing
# An online auditor reads a run prefix by prefix and either raises an alarm naming a
# step or stays silent. Labels follow AgentForesight's released evaluation code: the
# decisive step of an unsafe run (a 0-based turn index, >= 0) or -1 for a safe run;
# a prediction is the alarmed step or -1 for "no alarm" ("SAFE").
def _check_online(y, name):
    if isinstance(y, (str, bytes)):
        raise ValueError(f"{name} must be a 1-D sequence of int steps (-1 = safe / no "
                         "alarm), got a string.")
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one step per run), got shape {arr.shape}.")
    if arr.dtype.kind == "b" or (arr.size and arr.dtype.kind not in "iuf"):
        raise ValueError(f"{name} must hold integer steps (-1 = safe / no alarm), got "
                         f"dtype {arr.dtype}.")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}]={arr[i].item()!r} is not an integer step.")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < -1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}]={int(arr[i])}: steps are 0-based turn indices, or -1 "
                         "for a safe run (y_true) / no alarm (y_pred).")
    return arr


def _online_pair(y_true, y_pred):
    t = _check_online(y_true, "y_true")
    p = _check_online(y_pred, "y_pred")
    _check_lengths(t, p)
    return t, p


def _online_counts(t, p):
    unsafe = t >= 0
    tp = int(np.count_nonzero(unsafe & (p == t)))
    fp = int(np.count_nonzero((p >= 0) & (p != t)))
    fn = int(np.count_nonzero(unsafe & (p != t)))
    return tp, fp, fn


def exact_f1(y_true, y_pred):
    """Exact-F1 of an online auditor (AgentForesight's headline metric).

    TP: an unsafe run whose predicted step equals its decisive step. FP: any alarm
    whose step is not the decisive one, on safe and unsafe runs alike. FN: an
    unsafe run whose predicted step is not the decisive one (a miss or a
    mislocated alarm). A mislocated alarm therefore counts as both FP and FN.
    ``F1 = 2 TP / (2 TP + FP + FN)``.

    Parameters
    ----------
    y_true : array-like of int, shape (n_runs,)
        Decisive step of every unsafe run, ``-1`` for a safe run.
    y_pred : array-like of int, shape (n_runs,)
        Alarmed step, ``-1`` for no alarm.

    Returns
    -------
    f1 : float
        In [0, 1]; 0.0 when there is nothing to find and nothing was alarmed
        (``2 TP + FP + FN == 0``, scikit-learn's ``zero_division=0`` convention).

    Examples
    --------
    >>> exact_f1([2, 3, -1, -1], [2, 1, -1, 0])  # TP=1, FP=2, FN=1
    0.4
    """
    t, p = _online_pair(y_true, y_pred)
    tp, fp, fn = _online_counts(t, p)
    denom = 2 * tp + fp + fn
    return float(2 * tp / denom) if denom else 0.0


def false_alarm_rate(y_true, y_pred):
    """FAR: share of safe runs (``y_true == -1``) with any alarm.

    Parameters
    ----------
    y_true, y_pred : array-like of int, shape (n_runs,)
        As in :func:`exact_f1`.

    Returns
    -------
    far : float

    Raises
    ------
    ValueError
        When ``y_true`` holds no safe run.

    Examples
    --------
    >>> false_alarm_rate([2, -1, -1, -1], [2, -1, 0, -1])
    0.3333333333333333
    """
    t, p = _online_pair(y_true, y_pred)
    safe = t == -1
    if not safe.any():
        raise ValueError("false_alarm_rate needs at least one safe run (y_true == -1); "
                         "Who&When has failed runs only: cut each run before its decisive "
                         "step to make safe ones (skafa.online.safe_prefix_protocol).")
    return float(np.mean(p[safe] != -1))


def _unsafe(t, what):
    unsafe = t >= 0
    if not unsafe.any():
        raise ValueError(f"{what} needs at least one unsafe run (y_true >= 0).")
    return unsafe


def online_step_accuracy(y_true, y_pred):
    """Step-Acc: TP / number of unsafe runs (see :func:`exact_f1` for TP).

    On unsafe runs only this is :func:`step_accuracy` with "no alarm" counted wrong.

    Examples
    --------
    >>> online_step_accuracy([2, 3, -1], [2, -1, 0])
    0.5
    """
    t, p = _online_pair(y_true, y_pred)
    unsafe = _unsafe(t, "online_step_accuracy")
    return float(np.mean(p[unsafe] == t[unsafe]))


def average_step_shift(y_true, y_pred):
    """ASS: mean ``|predicted - decisive|`` over unsafe runs that raised an alarm.

    Misses are excluded (as in AgentForesight), so report it next to
    :func:`online_step_accuracy` and the miss rate. Lower is better.

    Returns
    -------
    shift : float
        NaN when no unsafe run raised an alarm.

    Examples
    --------
    >>> average_step_shift([2, 3, 4, -1], [2, 5, -1, 0])
    1.0
    """
    t, p = _online_pair(y_true, y_pred)
    hit = _unsafe(t, "average_step_shift") & (p >= 0)
    return float(np.mean(np.abs(p[hit] - t[hit]))) if hit.any() else float("nan")


def detection_delay(y_true, y_pred):
    """Mean turns between the decisive step and the alarm, over timely-or-late alarms.

    Only unsafe runs alarmed at or after their decisive step count (``0`` = the
    alarm came right after the decisive turn, which is what an online auditor
    aims for); early alarms are measured by :func:`early_alarm_share` and misses by
    :func:`miss_rate`. AgentForesight reports no latency metric.

    Returns
    -------
    delay : float
        NaN when no unsafe run was alarmed at or after its decisive step.

    Examples
    --------
    >>> detection_delay([2, 3, 4, 5], [2, 5, 1, -1])
    1.0
    """
    t, p = _online_pair(y_true, y_pred)
    late = _unsafe(t, "detection_delay") & (p >= 0) & (p >= t)
    return float(np.mean(p[late] - t[late])) if late.any() else float("nan")


def early_alarm_share(y_true, y_pred):
    """Share of the alarms on unsafe runs raised *before* the decisive step.

    Such an alarm stops the run before anything went wrong (a false alarm in
    time, though the run would have failed later).

    Returns
    -------
    share : float
        NaN when no unsafe run raised an alarm.

    Examples
    --------
    >>> early_alarm_share([2, 3, 4, 5], [2, 5, 1, -1])
    0.3333333333333333
    """
    t, p = _online_pair(y_true, y_pred)
    alarmed = _unsafe(t, "early_alarm_share") & (p >= 0)
    return float(np.mean(p[alarmed] < t[alarmed])) if alarmed.any() else float("nan")


def miss_rate(y_true, y_pred):
    """Share of unsafe runs with no alarm at all.

    Examples
    --------
    >>> miss_rate([2, 3, -1], [-1, 3, -1])
    0.5
    """
    t, p = _online_pair(y_true, y_pred)
    unsafe = _unsafe(t, "miss_rate")
    return float(np.mean(p[unsafe] == -1))


__all__ += ["exact_f1", "false_alarm_rate", "online_step_accuracy", "average_step_shift",
            "detection_delay", "early_alarm_share", "miss_rate"]

# Scorers (call ``estimator.predict``, e.g. skafa.online.OnlineAuditor's first alarms).
# Named ones work on any labels; FAR needs safe runs and ASS can be NaN (no alarm), so
# their scorers are module attributes rather than names in SCORERS.
SCORERS.update({
    "online_exact_f1": make_step_scorer(exact_f1),
    "online_step_accuracy": make_step_scorer(online_step_accuracy),
})
#: Scorer of ``-false_alarm_rate`` (needs safe runs, ``y == -1``, in every test fold).
neg_false_alarm_rate_scorer = make_step_scorer(false_alarm_rate, greater_is_better=False)
#: Scorer of ``-average_step_shift`` (NaN when a fold has no alarm on an unsafe run).
neg_average_step_shift_scorer = make_step_scorer(average_step_shift, greater_is_better=False)
__all__ += ["neg_false_alarm_rate_scorer", "neg_average_step_shift_scorer"]
