"""Online auditing: raise an alarm on the prefix of a running multi-agent system.

Post-hoc attribution names the decisive step after a run has failed. An *online*
auditor reads the run as it happens and, after every turn, answers *continue* or
*alarm (step, agent)* before the next turn runs. skafa does it white-box:

- :meth:`skafa.llm.PromptTemplate.online` renders the task and the turns so far
  (no expected answer, nothing that depends on later turns, turn boundaries are token
  boundaries). With a causal decoder the vector read at turn ``k`` of a finished run
  is then exactly what an auditor would have read after turn ``k`` of the live run,
  so ONE forward pass over a finished run gives every prefix's features, and
  training and evaluation need no per-prefix passes.
- :class:`OnlineAuditor` (an estimator on :class:`~skafa.TurnFeatures`) learns a
  per-turn score and an alarm threshold whose false-alarm rate on safe prefixes is
  calibrated on inner folds; :meth:`OnlineAuditor.predict` gives the first alarmed
  turn of every run (``-1``: no alarm).
- :class:`AuditSession` audits a live run: it takes the task, then one turn at a
  time, keeps the model's KV cache, so an appended turn costs a forward pass over its
  own tokens only, and returns a :class:`Verdict` per turn.

Labels: ``y[i]`` is the decisive step of failed run ``i`` (or ``-1`` for a run known
to be safe). Metrics for the predictions are in :mod:`skafa.metrics` (``exact_f1``,
``false_alarm_rate``, ``online_step_accuracy``, ``average_step_shift``,
``detection_delay``, ``early_alarm_share``, ``miss_rate``).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils import metadata_routing
from sklearn.utils.parallel import Parallel, delayed
from sklearn.utils.validation import check_is_fitted

from ..base import DecisiveStepMixin
from ..conversation import Conversation, Turn
from ..features import TurnFeatures, check_turn_features
from ..metrics import exact_f1, online_step_accuracy
from ..model_selection import check_site_cv, grouped_splits, resolve_sites
from ..probes import GroupedArgmaxLogisticClassifier
from ..utils.grouped import grouped_argmax
from ..utils.sklearn_compat import Interval, StrOptions, fit_context
from ..utils.validation import check_finite_rows, describe

__all__ = [
    "OnlineAuditor",
    "AuditSession",
    "Verdict",
    "conversation_prefix",
    "safe_prefix_protocol",
]

_TARGETS = ("cumulative", "hazard")
_SCORING = ("exact_f1", "step_accuracy")


# --------------------------------------------------------------------------- helpers
def conversation_prefix(conversation, n_turns):
    """The first ``n_turns`` turns of a conversation, as a new unlabelled Conversation.

    Task, task id and record id are kept; the labels (``mistake_step``,
    ``mistake_agent``) are dropped, since the decisive step may lie beyond the prefix.

    Parameters
    ----------
    conversation : Conversation
    n_turns : int
        ``1 <= n_turns <= len(conversation)``.

    Returns
    -------
    Conversation

    Examples
    --------
    >>> from skafa.testing import make_conversations
    >>> conv = make_conversations(1, min_turns=4, max_turns=4)[0]
    >>> len(conversation_prefix(conv, 2)), conversation_prefix(conv, 2).mistake_step
    (2, None)
    """
    if not isinstance(conversation, Conversation):
        raise TypeError(f"conversation must be a Conversation, got "
                        f"{type(conversation).__name__}.")
    if isinstance(n_turns, bool) or not isinstance(n_turns, Integral) or not (
            1 <= n_turns <= len(conversation)):
        raise ValueError(f"n_turns must be an int in 1..{len(conversation)}, got {n_turns!r}.")
    return Conversation(conversation.turns[: int(n_turns)], task=conversation.task,
                        expected_answer=conversation.expected_answer,
                        task_id=conversation.task_id, record_id=conversation.record_id)


def safe_prefix_protocol(y, first_alarms, groups=None):
    """Protocol (b): add a safe run made of every failed run cut before its decisive step.

    Who&When holds failed runs only, so a false-alarm rate needs safe runs. The prefix
    ``0..y[i] - 1`` of failed run ``i`` is a run in which nothing has gone wrong yet:
    it is the safe run of ``i`` (runs with ``y[i] == 0`` have none). The auditor's
    answer on it follows from its answer on the full run: an alarm before ``y[i]``
    is an alarm on the safe run, anything later is no alarm.

    Parameters
    ----------
    y : array-like of int, shape (n_runs,)
        Decisive step of every failed run (``-1`` entries, runs already safe, are
        kept as they are and get no extra copy).
    first_alarms : array-like of int, shape (n_runs,) or (n_runs, n_repeats)
        First alarmed turn on every full run (``-1``: none), e.g.
        ``OnlineAuditor.predict``; columns for repeated cross-validation.
    groups : array-like, shape (n_runs,), optional
        Cluster labels (task ids); the safe copy keeps its run's label.

    Returns
    -------
    y_true : ndarray of int
        ``y`` followed by ``-1`` for every failed run with ``y[i] >= 1``.
    y_pred : ndarray of int
        ``first_alarms`` followed by the answers on the safe runs.
    groups : ndarray or None
        Labels of the rows of ``y_true``.

    Examples
    --------
    >>> yt, yp, _ = safe_prefix_protocol([2, 0, 3], [1, 0, 4])
    >>> yt.tolist(), yp.tolist()
    ([2, 0, 3, -1, -1], [1, 0, 4, 1, -1])
    """
    y = np.asarray(y, dtype=np.int64)
    pred = np.asarray(first_alarms, dtype=np.int64)
    if pred.shape[0] != y.shape[0]:
        raise ValueError(f"y and first_alarms have different lengths ({y.shape[0]} vs "
                         f"{pred.shape[0]}).")
    cut = y >= 1
    yc = y[cut] if pred.ndim == 1 else y[cut][:, None]
    safe_pred = np.where((pred[cut] >= 0) & (pred[cut] < yc), pred[cut], -1)
    y_true = np.concatenate([y, np.full(int(cut.sum()), -1, dtype=np.int64)])
    y_pred = np.concatenate([pred, safe_pred])
    if groups is not None:
        groups = np.asarray(groups, dtype=object)
        groups = np.concatenate([groups, groups[cut]])
    return y_true, y_pred, groups


def _check_online_y(y, X):
    """Steps per run (``-1`` = safe run), each inside its conversation."""
    if y is None:
        raise ValueError("y is required: the decisive step of every run (-1 for a run "
                         "known to be safe).")
    arr = np.asarray(y)
    if arr.ndim != 1 or arr.shape[0] != len(X):
        raise ValueError(f"y must have one step per conversation ({len(X)}), got shape "
                         f"{arr.shape}.")
    if arr.dtype.kind not in "iuf" or arr.dtype.kind == "b":
        raise ValueError(f"y must hold integer steps (-1 = safe run), got dtype {arr.dtype}.")
    if arr.dtype.kind == "f" and np.any(~np.isfinite(arr) | (arr != np.round(arr))):
        i = int(np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))[0])
        raise ValueError(f"y[{i}]={arr[i]!r} is not an integer step ({describe(X, i)}).")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < -1) | (arr >= X.n_turns))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"y[{i}]={int(arr[i])} is outside {describe(X, i)}, which has "
                         f"{int(X.n_turns[i])} turns (use -1 for a safe run).")
    return arr


def _row_targets(y, offsets, target):
    """Binary label of every turn row and the rows that take part in fitting."""
    n_turns = np.diff(offsets)
    t = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], n_turns)
    step = np.repeat(y, n_turns)
    if target == "cumulative":  # "the decisive error has happened by turn t"
        return ((step >= 0) & (t >= step)).astype(np.int64), np.ones(t.shape, dtype=bool)
    # hazard: "turn t is the decisive one, given it has not happened before t"
    return (t == step).astype(np.int64), (step < 0) | (t <= step)


def _rows_of(offsets, convs):
    """Global turn rows of the conversations ``convs`` (in order)."""
    starts, ends = offsets[:-1][convs], offsets[1:][convs]
    if not len(convs):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]).astype(np.int64)


def _first_alarm(scores, offsets, threshold):
    """First turn of every run whose score reaches ``threshold``; -1 when none does."""
    above = (scores >= threshold).astype(np.float64)
    first = grouped_argmax(above, offsets)
    hit = np.maximum.reduceat(above, offsets[:-1]) > 0
    return np.where(hit, first, -1).astype(np.int64)


def _safe_maxima(scores, offsets, y):
    """Highest score of every safe prefix: turns before the decisive step (whole safe runs)."""
    out = []
    for i, step in enumerate(y):
        a, b = int(offsets[i]), int(offsets[i + 1])
        end = b if step < 0 else a + int(step)
        if end > a:
            out.append(float(np.max(scores[a:end])))
    return np.asarray(out, dtype=np.float64)


def _far_threshold(maxima, alpha):
    """Smallest threshold whose false-alarm rate is at most ``alpha`` (split-conformal rank).

    With ``n`` safe-prefix maxima, the threshold lies just above the
    ``k = ceil((1 - alpha) (n + 1))``-th smallest; for exchangeable safe prefixes a
    new one then alarms with probability at most ``alpha``. ``+inf`` (never alarm)
    when ``k > n``.
    """
    n = maxima.size
    k = math.ceil((1.0 - alpha) * (n + 1) - 1e-9)
    if k > n:
        return math.inf
    return float(np.nextafter(np.sort(maxima)[k - 1], np.inf))


def _criterion(scoring, y, pred):
    if scoring == "step_accuracy":
        unsafe = y >= 0
        return online_step_accuracy(y[unsafe], pred[unsafe]) if unsafe.any() else 0.0
    y_true, y_pred, _ = safe_prefix_protocol(y, pred)
    return exact_f1(y_true, y_pred)


def _fit_fold(make, M, labels, rows, test_rows):
    est = make(M)
    if np.unique(labels[rows]).size < 2:
        raise ValueError("an inner training fold has turn rows of a single class; use "
                         "fewer folds or more runs.")
    est.fit(M[rows], labels[rows])
    return np.asarray(est.decision_function(M[test_rows]), dtype=np.float64)


# --------------------------------------------------------------------------- estimator
class OnlineAuditor(DecisiveStepMixin, BaseEstimator):
    """Alarm on the first turn of a run at which the decisive error has happened.

    A linear model scores every turn of a run from that turn's features alone (for
    activations read with :meth:`~skafa.llm.PromptTemplate.online`, what the
    model had read up to the end of the turn). An alarm is raised at the first turn
    whose score reaches ``threshold_``; that turn is the predicted decisive step
    and its speaker the responsible agent. The threshold is calibrated so that the
    false-alarm rate on *safe prefixes* (turns ``0..y-1`` of a failed run, whole
    runs labelled ``-1``) is at most ``max_false_alarm_rate`` on out-of-fold scores
    of inner grouped folds; the site and ``C`` are chosen on the same folds.

    Parameters
    ----------
    target : {"cumulative", "hazard"}, default="cumulative"
        What the turn model learns. ``"cumulative"``: every turn row labelled
        ``1`` when ``k >= y`` ("the decisive error has happened by turn ``k``"),
        ``0`` before; all rows are used and the score should rise and stay up after
        the error, so later turns keep evidence that an earlier one was wrong.
        ``"hazard"``: the discrete-time hazard "turn ``k`` is the decisive one,
        given it was not before": rows ``k < y`` labelled 0, row ``y`` labelled 1,
        rows after ``y`` left out (for a safe run every row is a 0).
    max_false_alarm_rate : float, default=0.05
        Target false-alarm rate on safe prefixes, in (0, 1).
    sites : list of str, default=None
        Sites to choose from (``None``: every site of ``X``), as in
        :class:`~skafa.SiteSelector`; ties go to the earliest.
    Cs : sequence of float, default=(0.001, 0.01, 0.1)
        Inverse L2 strengths tried for the turn model (ties go to the smaller).
    cv : int, cross-validation generator or iterable, default=None
        Inner folds for the site, ``C`` and threshold: ``None`` means
        ``GroupKFold(5)``, an int ``GroupKFold(n)``. Groups are ``groups`` or,
        failing that, ``X.task_ids``. The test folds must cover every run once.
    scoring : {"exact_f1", "step_accuracy"}, default="exact_f1"
        What the site and ``C`` maximise on the inner folds, at the calibrated
        threshold: Exact-F1 on the failed runs plus their safe prefixes
        (:func:`safe_prefix_protocol`), or online step accuracy on the failed runs.
    class_weight : dict, "balanced" or None, default="balanced"
        Class weights of the logistic turn model.
    max_iter : int, default=1000
        Solver iterations of the logistic turn model.
    n_jobs : int, default=None
        Parallel jobs over (site, C, fold) fits.
    random_state : int, RandomState instance or None, default=None
        Passed to the logistic regression.
    verbose : int, default=0
        joblib verbosity.

    Attributes
    ----------
    best_site_ : str
        The chosen site.
    best_C_ : float
        The chosen ``C``.
    threshold_ : float
        Alarm threshold on the turn score (``inf``: never alarm).
    estimator_ : Pipeline
        Turn model (standardization + logistic regression, as in
        :class:`~skafa.GroupedArgmaxLogisticClassifier`) refitted on all runs.
    cv_results_ : dict of ndarray
        Per (site, C): ``site``, ``C``, ``mean_test_score`` (the criterion on
        out-of-fold scores), ``threshold``, ``false_alarm_rate`` (out-of-fold,
        on safe prefixes), ``rank_test_score``.
    best_score_ : float
        Criterion at the chosen (site, C).
    oof_false_alarm_rate_ : float
        Out-of-fold false-alarm rate on safe prefixes at ``threshold_``.
    n_safe_prefixes_ : int
        Safe prefixes used to calibrate the threshold.
    sites_ : tuple of str
        Sites compared.
    n_splits_ : int
        Inner folds.
    n_features_in_ : int
        Features per turn.

    See Also
    --------
    AuditSession : Audit a live run turn by turn with the fitted auditor.
    skafa.SiteSelector : The post-hoc equivalent of the site choice.

    Notes
    -----
    **Why the cumulative target is the default.** Online, the question after turn
    ``k`` is "has it gone wrong yet?", which is the cumulative label; it uses every
    turn row, and evidence that shows up only a few turns after the error (a wrong
    result being used) still counts. Its weakness is that the first crossing can
    come late. The hazard form asks the sharper question "is this the turn?" and
    learns from fewer rows; which works better is an empirical question
    (``examples/benchmark_online.py`` compares them). On Who&When
    Algorithm-Generated with SmolLM2 the hazard form did better (Exact-F1 19.3 vs
    11.1 at a 0.2 target, 11.0 vs 8.7 at 0.05; ``docs/benchmarks.md``), so try both.

    **Calibration.** The threshold is chosen on out-of-fold scores of the inner
    folds and then applied to the model refitted on all runs, whose scores can be
    a little sharper; the false-alarm rate on new runs is therefore near, not
    guaranteed below, the target. The rank rule (split-conformal, ``k = ceil((1 -
    alpha)(n + 1))``) never allows more than ``alpha`` of the calibration
    prefixes to alarm; with too few safe prefixes (``n < 1 / alpha - 1``) it
    gives ``threshold_ = inf`` and warns.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> from skafa.online import OnlineAuditor
    >>> rng = np.random.default_rng(0)
    >>> n, T = 40, 6
    >>> y = rng.integers(1, T, size=n)
    >>> values = rng.normal(size=(n * T, 2, 3))
    >>> t = np.tile(np.arange(T), n)
    >>> values[:, 1, 0] += 3.0 * (t >= np.repeat(y, T))   # site "b" sees the error
    >>> X = TurnFeatures(values, np.arange(0, n * T + 1, T), sites=["a", "b"],
    ...                  task_ids=[str(i // 2) for i in range(n)])
    >>> auditor = OnlineAuditor(Cs=[1.0], max_false_alarm_rate=0.1).fit(X, y)
    >>> auditor.best_site_
    'b'
    >>> float(np.mean(auditor.predict(X) == y)) > 0.5
    True
    """

    #: score is Exact-F1, not a mean over runs: no sample_weight
    _score_takes_sample_weight = False
    __metadata_request__score = {"sample_weight": metadata_routing.UNUSED}

    _parameter_constraints: dict = {
        "target": [StrOptions(set(_TARGETS))],
        "max_false_alarm_rate": [Interval(Real, 0, 1, closed="neither")],
        "sites": ["array-like", None],
        "Cs": ["array-like"],
        "cv": ["cv_object"],
        "scoring": [StrOptions(set(_SCORING))],
        "class_weight": [dict, StrOptions({"balanced"}), None],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "n_jobs": [Integral, None],
        "random_state": ["random_state"],
        "verbose": ["verbose"],
    }

    def __init__(self, *, target="cumulative", max_false_alarm_rate=0.05, sites=None,
                 Cs=(0.001, 0.01, 0.1), cv=None, scoring="exact_f1",
                 class_weight="balanced", max_iter=1000, n_jobs=None, random_state=None,
                 verbose=0):
        self.target = target
        self.max_false_alarm_rate = max_false_alarm_rate
        self.sites = sites
        self.Cs = Cs
        self.cv = cv
        self.scoring = scoring
        self.class_weight = class_weight
        self.max_iter = max_iter
        self.n_jobs = n_jobs
        self.random_state = random_state
        self.verbose = verbose

    # ------------------------------------------------------------------ helpers
    def _Cs(self):
        Cs = np.asarray(self.Cs, dtype=float).ravel()
        if Cs.size == 0 or not np.all(np.isfinite(Cs)) or np.any(Cs <= 0):
            raise ValueError(f"Cs must be a non-empty list of positive floats, got {self.Cs!r}.")
        return sorted(dict.fromkeys(float(c) for c in Cs))

    def _maker(self, C):
        probe = GroupedArgmaxLogisticClassifier(
            C=C, class_weight=self.class_weight, max_iter=self.max_iter,
            random_state=self.random_state)
        return probe._make_turn_estimator  # same standardized logistic turn model

    def _matrix(self, X, site):
        M = X.turn_matrix(site)
        check_finite_rows(X, M, site)
        return M

    # ------------------------------------------------------------------ fitting
    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, groups=None):
        """Choose site and ``C``, calibrate the threshold on inner folds, refit.

        Parameters
        ----------
        X : TurnFeatures
            Per-turn features of the training runs (e.g. activations read with
            ``PromptTemplate.online()``).
        y : array-like of int, shape (n_runs,)
            Decisive step of every failed run; ``-1`` for a run known to be safe.
        groups : array-like of shape (n_runs,), default=None
            Groups (task ids) of the inner splitter; default ``X.task_ids``.

        Returns
        -------
        self : OnlineAuditor
        """
        X = check_turn_features(X, self)
        y = _check_online_y(y, X)
        sites = resolve_sites(self.sites, X)
        Cs = self._Cs()
        cv = check_site_cv(self.cv)
        splits = grouped_splits(cv, X, y, {} if groups is None else {"groups": groups},
                                 X.task_ids)
        tested = np.zeros(len(X), dtype=np.int64)
        for _, test in splits:
            tested[test] += 1
        if np.any(tested != 1):
            i = int(np.flatnonzero(tested != 1)[0])
            raise ValueError(
                f"OnlineAuditor calibrates on out-of-fold scores, so the test folds of cv "
                f"must cover every run exactly once ({describe(X, i)} is tested "
                f"{int(tested[i])} times); use a KFold-like splitter such as GroupKFold.")
        maxima_count = _safe_maxima(np.zeros(X.n_turns_total), X.offsets, y).size
        if maxima_count == 0:
            raise ValueError("OnlineAuditor needs safe prefixes to calibrate its threshold: "
                             "every run's decisive step is its first turn and no run is "
                             "labelled safe (-1).")
        labels, keep = _row_targets(y, X.offsets, self.target)
        if np.unique(labels[keep]).size < 2:
            raise ValueError(f"OnlineAuditor(target={self.target!r}) needs turn rows of "
                             "both classes: give failed runs whose decisive step is not "
                             "their only turn.")
        folds = [(_rows_of(X.offsets, tr), _rows_of(X.offsets, te)) for tr, te in splits]
        folds = [(rows[keep[rows]], test) for rows, test in folds]

        matrices = {site: self._matrix(X, site) for site in sites}
        jobs = [(site, C, f) for site in sites for C in Cs for f in range(len(folds))]
        out = Parallel(n_jobs=self.n_jobs, verbose=self.verbose)(
            delayed(_fit_fold)(self._maker(C), matrices[site], labels, *folds[f])
            for site, C, f in jobs)
        oof = {}
        for (site, C, f), scores in zip(jobs, out):
            s = oof.setdefault((site, C), np.full(X.n_turns_total, np.nan))
            s[folds[f][1]] = scores
        alpha = float(self.max_false_alarm_rate)
        rows = []
        for site in sites:
            for C in Cs:
                s = oof[(site, C)]
                maxima = _safe_maxima(s, X.offsets, y)
                thr = _far_threshold(maxima, alpha)
                pred = _first_alarm(s, X.offsets, thr)
                rows.append((site, C, _criterion(self.scoring, y, pred), thr,
                             float(np.mean(maxima >= thr))))
        scores = np.array([r[2] for r in rows])
        best = int(np.flatnonzero(scores == scores.max())[0])  # earliest site, smaller C
        order = np.argsort(-scores, kind="stable")
        ranks = np.empty(len(rows), dtype=np.int32)
        ranks[order] = np.arange(1, len(rows) + 1)
        self.cv_results_ = {
            "site": np.asarray([r[0] for r in rows], dtype=object),
            "C": np.asarray([r[1] for r in rows], dtype=float),
            "mean_test_score": scores,
            "threshold": np.asarray([r[3] for r in rows], dtype=float),
            "false_alarm_rate": np.asarray([r[4] for r in rows], dtype=float),
            "rank_test_score": ranks,
        }
        site, C, score, thr, far = rows[best]
        if math.isinf(thr):
            warnings.warn(
                f"OnlineAuditor: with {maxima_count} safe prefixes a false-alarm rate of at "
                f"most {alpha} cannot be certified, so the auditor will never alarm "
                "(threshold_=inf); raise max_false_alarm_rate or add safe runs.",
                UserWarning, stacklevel=2)
        M = matrices[site]
        estimator = self._maker(C)(M)
        estimator.fit(M[keep], labels[keep])
        self.estimator_ = estimator
        self.best_site_ = site
        self.best_C_ = float(C)
        self.best_score_ = float(score)
        self.threshold_ = float(thr)
        self.oof_false_alarm_rate_ = float(far)
        self.n_safe_prefixes_ = int(maxima_count)
        self.sites_ = sites
        self.n_splits_ = len(splits)
        self.n_features_in_ = int(M.shape[1])
        return self

    # --------------------------------------------------------------- prediction
    def _score_rows(self, M):
        scores = np.asarray(self.estimator_.decision_function(M), dtype=np.float64)
        if not np.all(np.isfinite(scores)):
            raise ValueError("the turn model produced a non-finite score.")
        return scores

    def _scores(self, X):
        check_is_fitted(self)
        X = check_turn_features(X, self)
        if self.best_site_ not in X.sites:
            raise ValueError(f"OnlineAuditor was fitted on site {self.best_site_!r}, which X "
                             f"does not hold (X has {list(X.sites)}).")
        M = self._matrix(X, self.best_site_)
        if M.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {M.shape[1]} features per turn at site "
                             f"{self.best_site_!r}; the auditor was fitted with "
                             f"{self.n_features_in_}.")
        return X, self._score_rows(M)

    def _turn_scores(self, X):
        """Alarm score of every turn row (alarm where ``score >= threshold_``)."""
        return self._scores(X)

    def _has_decisive_method(self, name):
        # alarm scores are not a distribution over turns
        return name != "turn_predict_proba"

    def predict(self, X):
        """First alarmed turn of every run, ``-1`` when no turn reaches the threshold.

        Parameters
        ----------
        X : TurnFeatures
            Full runs or prefixes: turn ``k``'s answer uses turns ``0..k`` only.

        Returns
        -------
        steps : ndarray of int, shape (n_runs,)
        """
        X, scores = self._scores(X)
        return _first_alarm(scores, X.offsets, self.threshold_)

    def _score(self, X, y, sample_weight):
        """Exact-F1 of the first alarms against ``y`` (``-1`` = safe run).

        Like :meth:`fit`, it takes no ``sample_weight`` (Exact-F1 is not a mean
        over runs); ``predict_agent`` gives ``None`` for a run without alarm.
        """
        X = check_turn_features(X, self)
        return exact_f1(_check_online_y(y, X), self.predict(X))

    def session(self, extractor, task="", *, task_id=None):
        """Start auditing a live run: see :class:`AuditSession`.

        Parameters
        ----------
        extractor : TurnActivationTransformer
            How the training features were read (model, online prompt, ``read``).
        task : str, default=""
            The task given to the agents.
        task_id : str, optional

        Returns
        -------
        AuditSession
        """
        return AuditSession(self, extractor, task, task_id=task_id)


# --------------------------------------------------------------------------- streaming
@dataclass(frozen=True)
class Verdict:
    """The auditor's answer after one turn of a live run.

    Attributes
    ----------
    step : int
        Index of the turn just audited.
    alarm : bool
        ``score >= threshold``: the decisive error has happened, at ``step``.
    agent : str or None
        The turn's speaker when ``alarm`` (the responsible agent), else None.
    score : float
        The turn's alarm score.
    threshold : float
        The auditor's threshold.
    n_tokens : int
        Tokens the model had read after this turn (prompt so far).
    """

    step: int
    alarm: bool
    agent: str | None
    score: float
    threshold: float
    n_tokens: int


class AuditSession:
    """Audit a live run turn by turn, keeping the model's KV cache between turns.

    The session renders the online prompt exactly as the extractor would for the
    run so far, runs the model only over the tokens of the new turn (the keys and
    values of everything before are cached), reads the auditor's site at the turn's
    last token (or averages its line, ``read="mean"``) with the same hooks as
    :class:`~skafa.TurnActivationTransformer` (:class:`~skafa.llm.SiteReader`),
    and scores it. The vectors equal those of a one-pass extraction of the whole
    run with the same extractor (up to float rounding).

    Parameters
    ----------
    auditor : OnlineAuditor
        Fitted on features from ``extractor``'s settings.
    extractor : TurnActivationTransformer
        Model, prompt (must have ``segment_turns=True``, e.g.
        ``PromptTemplate.online()``), ``read`` and chat-template variables. Fitted
        here on a placeholder if it is not fitted yet.
    task : str, default=""
        The task given to the agents.
    task_id : str, optional
        Named in messages and kept in :meth:`features`.

    Attributes
    ----------
    verdicts : list of Verdict
        One per appended turn.
    first_alarm : Verdict or None
        The first verdict with ``alarm``.
    n_tokens : int
        Tokens read (and cached) so far.
    turns : list of Turn

    Notes
    -----
    **Context.** Before running a turn the session checks that the prompt so far
    plus the new turn fits the model's context; if not it raises
    :class:`~skafa.exceptions.PromptTooLongError` naming the turn, and the session is
    unchanged (nothing is cut silently). To keep long runs inside the context use
    a per-turn shortening, ``PromptTemplate.online(shorten="head_tail",
    max_turn_chars=...)``, which shortens each turn on its own and so keeps the
    prompt of every prefix a prefix.

    **Tokens.** The prompt is tokenized in segments cut at turn boundaries
    (``segment_turns``); before running a turn the session checks that the
    rendered prompt still begins with the text already read, so a template whose
    earlier text changed when a turn is added raises instead of silently
    diverging from the cache.

    Examples
    --------
    >>> session = auditor.session(extractor, task="Find the sum.")  # doctest: +SKIP
    >>> v = session.append("planner", "I computed 2 + 2 = 5.")       # doctest: +SKIP
    >>> v.alarm, v.step, v.agent                                     # doctest: +SKIP
    (True, 0, 'planner')
    """

    def __init__(self, auditor, extractor, task="", *, task_id=None):
        from ..llm import TurnActivationTransformer

        check_is_fitted(auditor)
        if not isinstance(extractor, TurnActivationTransformer):
            raise TypeError("extractor must be a skafa.TurnActivationTransformer (the one "
                            f"whose settings produced the training features), got "
                            f"{type(extractor).__name__}.")
        if not isinstance(task, str):
            raise TypeError(f"task must be a string, got {type(task).__name__}.")
        if not hasattr(extractor, "sites_"):
            extractor.fit([Conversation([Turn("agent", "")], task=task)])
        if extractor.hidden_size_ != auditor.n_features_in_:
            raise ValueError(f"the auditor was fitted on {auditor.n_features_in_} features "
                             f"per turn, but {extractor.model!r} reads {extractor.hidden_size_} "
                             "at a site; fit the auditor on this extractor's activations.")
        # The stream checks the prompt, the site and the context, and reads the text
        # before the first turn now, so that the first turn costs its own tokens only.
        stream = extractor.stream(auditor.best_site_, task=task, task_id=task_id,
                                  label="AuditSession")
        self.auditor = auditor
        self.extractor = extractor
        self.task = task
        self.task_id = task_id
        self.site = stream.site
        self.verdicts = []
        self.first_alarm = None
        self._values = []
        self._stream = stream

    @property
    def turns(self):
        """The turns appended so far (list of Turn)."""
        return self._stream.turns

    @property
    def n_tokens(self):
        """Tokens read (and cached) so far (int)."""
        return self._stream.n_tokens

    def _where(self, k=None):
        return self._stream.where(k)

    # ------------------------------------------------------------------ API
    def append(self, speaker, content=None, *, role=None):
        """Audit one more turn and return the verdict.

        Parameters
        ----------
        speaker : str or Turn
            The agent that spoke, or a whole :class:`~skafa.Turn`.
        content : str, optional
            What it said (required unless ``speaker`` is a Turn).
        role : str, optional
            The source's role field.

        Returns
        -------
        Verdict
        """
        if isinstance(speaker, Turn):
            if content is not None or role is not None:
                raise TypeError("pass either a Turn or speaker and content, not both.")
            turn = speaker
        else:
            if content is None:
                raise TypeError("append(speaker, content): content is required.")
            turn = Turn(speaker, content, role)
        k = len(self.turns)
        vec = self._stream.append(turn)
        self._values.append(vec)
        score = float(self.auditor._score_rows(vec[None, :])[0])
        alarm = bool(score >= self.auditor.threshold_)
        verdict = Verdict(step=k, alarm=alarm, agent=turn.speaker if alarm else None,
                          score=score, threshold=float(self.auditor.threshold_),
                          n_tokens=self.n_tokens)
        self.verdicts.append(verdict)
        if alarm and self.first_alarm is None:
            self.first_alarm = verdict
        return verdict

    def extend(self, turns):
        """Append several turns; returns their verdicts."""
        return [self.append(t) for t in turns]

    def features(self):
        """The vectors read so far, as a one-run :class:`~skafa.TurnFeatures`."""
        if not self._values:
            raise ValueError(f"{self._where()}: no turn appended yet.")
        values = np.stack(self._values)[:, None, :]
        return TurnFeatures(values, [0, values.shape[0]], sites=[self.site],
                            speakers=[t.speaker for t in self.turns], task_ids=[self.task_id])

    def close(self):
        """Free the KV cache (the session cannot be used afterwards)."""
        self._stream.close()

    def __repr__(self):
        alarm = "none" if self.first_alarm is None else f"turn {self.first_alarm.step}"
        return (f"AuditSession(turns={len(self.turns)}, tokens={self.n_tokens}, "
                f"site={self.site!r}, first_alarm={alarm})")
