"""Choose the activation site by grouped cross-validation.

:class:`SiteSelector` cross-validates one estimator per site block of a
:class:`~skafa.TurnFeatures` and keeps the best site, like a
:class:`~sklearn.model_selection.GridSearchCV` over the site (or, with
``n_sites=k``, the ``k`` best sites, averaged by a :class:`SiteEnsemble`).
:class:`SiteEnsemble` averages standardized turn scores of one estimator fitted
at each of several given sites. :func:`site_sweep` scores every site on a
separate test set for analysis curves.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import time
import warnings
from numbers import Integral, Real

import numpy as np
from scipy.stats import rankdata
from sklearn.base import BaseEstimator, MetaEstimatorMixin, clone
from sklearn.exceptions import FitFailedWarning
from sklearn.metrics import check_scoring, get_scorer_names
from sklearn.model_selection import GroupKFold, ParameterGrid, check_cv
from sklearn.utils import get_tags
from sklearn.utils.metadata_routing import (
    MetadataRouter,
    MethodMapping,
    process_routing,
)
from sklearn.utils.parallel import Parallel, delayed
from sklearn.utils.validation import check_is_fitted

from ..base import DecisiveStepMixin
from ..compose import final_step_call
from ..exceptions import ConfigurationError
from ..features import check_turn_features
from ..metrics import SCORERS
from ..persistence import PersistenceMixin
from ..utils.grouped import grouped_center
from ..utils.progress import log
from ..utils.signals import raise_if_stop_requested, stop_requests
from ..utils.sklearn_compat import (
    HasMethods,
    Interval,
    StrOptions,
    fit_context,
    routing_enabled,
    safe_indexing,
)
from ..utils.validation import check_groups, check_steps, group_labels

__all__ = ["SiteSelector", "SiteEnsemble", "site_sweep"]


def _ignores_groups(cv):
    """True for splitters that ignore ``groups`` (KFold, ShuffleSplit, ...)."""
    try:
        from ..utils.sklearn_compat import UnsupportedGroupCVMixin
    except ImportError:  # pragma: no cover - older/newer scikit-learn
        return False
    return isinstance(cv, UnsupportedGroupCVMixin)


def check_site_cv(cv):
    """``None`` -> ``GroupKFold(5)``; int ``n`` -> ``GroupKFold(n)``; else check_cv."""
    if cv is None:
        return GroupKFold(n_splits=5)
    if isinstance(cv, Integral) and not isinstance(cv, bool):
        return GroupKFold(n_splits=int(cv))
    return check_cv(cv, classifier=False)


def _get_scorer(estimator, scoring):
    """skafa scorer names (``"top3"``, ``"within_1"``, ...) first, then sklearn's."""
    if isinstance(scoring, str) and scoring in SCORERS:
        return SCORERS[scoring]
    return check_scoring(estimator, scoring=scoring)


def resolve_sites(sites, X):
    """The sites to compare: ``sites`` checked against ``X.sites``, or all of them.

    Parameters
    ----------
    sites : sequence of str or None
        ``None`` means every site of ``X``.
    X : TurnFeatures

    Returns
    -------
    sites : tuple of str

    Raises
    ------
    ValueError
        ``sites`` is empty, holds duplicates, or names a site ``X`` lacks (the
        message lists the available sites).

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> X = TurnFeatures(np.zeros((3, 2, 1)), np.array([0, 3]), sites=("a", "b"))
    >>> resolve_sites(None, X), resolve_sites(["b"], X)
    (('a', 'b'), ('b',))
    """
    if sites is None:
        return tuple(X.sites)
    names = [s for s in sites]
    if not names:
        raise ValueError("sites must name at least one site.")
    if len(set(names)) != len(names):
        raise ValueError(f"sites contains duplicates: {names}.")
    missing = [s for s in names if s not in X.sites]
    if missing:
        raise ValueError(
            f"site(s) {missing} are not in X; available sites: {list(X.sites)}."
        )
    return tuple(str(s) for s in names)


def _check_no_fixed_site(estimator, owner):
    """The selector feeds one-site containers; a fixed ``site`` would conflict."""
    if not hasattr(estimator, "get_params"):
        return
    fixed = {
        k: v
        for k, v in estimator.get_params(deep=True).items()
        if (k == "site" or k.endswith("__site")) and v is not None
    }
    if fixed:
        raise ValueError(
            f"{owner} chooses the site itself, but the estimator fixes {fixed}; "
            "leave site=None inside the selector."
        )


def _conversation_list(indices, X=None, limit=5):
    """``"4, 9 (record 'a/9'), 11 and 2 more"``: the first ``limit`` of ``indices``.

    Record ids are shown when ``X`` is a list of conversations (a
    :class:`~skafa.TurnFeatures` carries none: its conversations are named by
    position).
    """
    indices = [int(i) for i in indices]
    record_ids = None
    if isinstance(X, (list, tuple)):
        record_ids = [getattr(c, "record_id", None) for c in X]

    def name(i):
        record = None if record_ids is None else record_ids[i]
        return str(i) if record is None else f"{i} (record {record!r})"

    shown = ", ".join(name(i) for i in indices[:limit])
    more = len(indices) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def missing_task_ids(task_ids, X=None):
    """``"2 of 8 conversations have no task id (conversations 1, 5)"``, or None.

    Parameters
    ----------
    task_ids : sequence or None
        One task id per conversation; ``None`` (or NaN) marks a missing one.
    X : list of Conversation, optional
        When given, the conversations are also named by ``record_id``.

    Returns
    -------
    str or None
        None when no id is missing.
    """
    if task_ids is None:
        return None
    ids = list(task_ids)
    missing = [i for i, t in enumerate(ids) if t is None or (isinstance(t, float) and t != t)]
    if not missing:
        return None
    return (f"{len(missing)} of {len(ids)} conversations have no task id "
            f"(conversations {_conversation_list(missing, X)})")


def _needs_groups(cv, X, task_ids):
    """The error for a group splitter that got no groups, saying why and how to fix it."""
    missing = missing_task_ids(task_ids, X)
    if missing is None or all(t is None for t in task_ids):
        return (f"the splitter {cv!r} needs groups: pass groups=<one task id per "
                "conversation> to fit (routed automatically with metadata routing), or "
                "use an ungrouped splitter such as KFold. X carries no task ids to stand "
                "in for them (give the conversations task ids: Conversation(task_id=...) "
                "or TurnFeatures(task_ids=...)).")
    return (f"the splitter {cv!r} needs groups, and the task ids cannot stand in for "
            f"them: {missing}. Either pass groups=<one task id per conversation> to fit "
            "(routed automatically with metadata routing), give those conversations a "
            "task id (Conversation(task_id=...) or TurnFeatures(task_ids=...); a run "
            "that shares its task with no other gets an id of its own), or use an "
            "ungrouped splitter such as KFold.")


def grouped_splits(cv, X, y, split_params, task_ids):
    """``list(cv.split(X, y, **split_params))``, grouping by task ids by default.

    Without ``groups`` in ``split_params``, complete ``task_ids`` (one per
    conversation, none missing) become the groups, unless ``cv`` ignores groups;
    a splitter that still lacks groups gets an error saying how to give them
    and, when only some task ids are missing, naming the conversations that
    lack one (by position, and by ``record_id`` when ``X`` is a list of
    conversations; the first five and a count).
    """
    split_params = dict(split_params)
    if split_params.get("groups") is not None:
        split_params["groups"] = check_groups(split_params["groups"], len(y))
    if (split_params.get("groups") is None and task_ids is not None
            and not _ignores_groups(cv) and all(t is not None for t in task_ids)):
        split_params["groups"] = group_labels(task_ids)
    try:
        return list(cv.split(X, y, **split_params))
    except ValueError as exc:
        if split_params.get("groups") is None and "group" in str(exc).lower():
            raise ValueError(_needs_groups(cv, X, task_ids)) from exc
        raise


def _single_turn_folds(X, splits):
    """Why every site failed, when some training parts hold single-turn conversations only.

    Returns ``""`` when every training part holds a conversation with several
    turns, else a clause naming those folds and the multi-turn conversations.
    """
    n_turns = np.asarray(X.n_turns)
    multi = np.flatnonzero(n_turns > 1)
    folds = [k for k, (train, _) in enumerate(splits) if not np.any(n_turns[train] > 1)]
    if not folds:
        return ""
    which = (f"the training part of fold {folds[0]} holds" if len(folds) == 1 else
             f"the training parts of folds {', '.join(map(str, folds))} hold")
    return (f": {which} only single-turn conversations, because only {multi.size} of the "
            f"{len(n_turns)} conversations have more than one turn (conversations "
            f"{_conversation_list(multi)}), all held out there. With one turn per "
            "conversation there is no turn to tell apart, so the estimator cannot be "
            "fitted there. Use fewer folds or a splitter that keeps conversations with "
            "several turns in every training part, or add such conversations")


def index_params(params, indices, n_samples):
    """Slice the sample-aligned entries of ``params`` (like sklearn's CV does)."""
    out = {}
    for key, value in params.items():
        if (
            value is not None
            and not isinstance(value, (str, bytes))
            and hasattr(value, "__len__")
            and len(value) == n_samples
        ):
            out[key] = safe_indexing(value, indices)
        else:
            out[key] = value
    return out


def _fit_and_score_site(estimator, X, y, train, test, scorer, fit_params,
                        error_score, site, fold):
    """Fit ``estimator`` on ``X[train]`` (one site) and score it on ``X[test]``."""
    fit_params = index_params(fit_params, train, len(X))
    start = time.perf_counter()
    try:
        estimator.fit(X[train], y[train], **fit_params)
        fit_time = time.perf_counter() - start
        start = time.perf_counter()
        score = float(scorer(estimator, X[test], y[test]))
        score_time = time.perf_counter() - start
    except Exception as exc:
        # a stop request (SIGTERM, Ctrl-C) that surfaced as this error is no failed fit
        raise_if_stop_requested(f"fitting at site {site!r}, fold {fold}", cause=exc)
        if error_score == "raise":
            raise
        warnings.warn(
            f"fitting or scoring failed at site {site!r}, fold {fold}; its score is set "
            f"to {error_score}. Details: {type(exc).__name__}: {exc}",
            FitFailedWarning,
        )
        return {"score": float(error_score), "fit_time": np.nan, "score_time": np.nan}
    return {"score": score, "fit_time": fit_time, "score_time": score_time}


def _nan_mean(a):
    """Row means ignoring NaN (failed fits); NaN where a row is all NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=1)


def _nan_std(a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanstd(a, axis=1)


def _top_sites(sites, filled_means, failed, k):
    """The ``k`` best sites by mean score, best first; earliest first on ties.

    Sites whose mean is NaN (``failed``) are never kept; if fewer than ``k``
    remain, a warning says so and the remaining ones are returned.
    """
    order = np.argsort(-filled_means, kind="stable")
    keep = [int(i) for i in order if not failed[i]][:k]
    if len(keep) < k:
        warnings.warn(
            f"n_sites={k} but only {len(keep)} site(s) have a finite mean "
            f"cross-validation score; averaging over {[sites[i] for i in keep]}.",
            UserWarning,
        )
    return tuple(sites[i] for i in keep)


def _site_names(state, name):
    """``state[name]`` as a list of site names, refused unless a list or tuple of unique
    strings (a fitted attribute checked after :func:`skafa.persistence.load`)."""
    value = state[name]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a tuple of site names, got {value!r:.80}")
    names = list(value)
    repeated = sorted({v for v in names if names.count(v) > 1})
    if repeated:
        raise ValueError(f"{name} names site {repeated[0]!r:.80} more than once: {names!r:.200}")
    return names


def _estimator_has(attr):
    """Check the fitted best estimator, else the unfitted one, for ``attr``."""

    def check(self):
        if hasattr(self, "best_estimator_"):
            getattr(self.best_estimator_, attr)
        else:
            getattr(self.estimator, attr)
        return True

    return check


class SiteSelector(DecisiveStepMixin, PersistenceMixin, MetaEstimatorMixin, BaseEstimator):
    """Choose the activation site by grouped cross-validation, then refit there.

    For every site (default: all sites of ``X``) a clone of ``estimator`` is
    cross-validated on ``X.select_sites(site)`` with the same splits; the site
    with the best mean test score wins and a clone is refitted on all the
    training conversations at that site. Prediction methods read that site of
    their input. With ``n_sites=k > 1`` the ``k`` best sites are kept and their
    standardized turn scores averaged (see :class:`SiteEnsemble`).

    Parameters
    ----------
    estimator : estimator object
        Conversation-level estimator taking a single-site ``TurnFeatures``
        (e.g. :class:`~skafa.GroupedArgmaxLogisticClassifier`, possibly in a
        Pipeline). Its ``site`` parameter(s) must be left to ``None``.
    sites : list of str, default=None
        Sites to compare, in order. ``None`` means every site of ``X`` in its
        order (depth order for activations).
    cv : int, cross-validation generator or iterable, default=None
        ``None`` means ``GroupKFold(n_splits=5)``; an int ``n`` means
        ``GroupKFold(n_splits=n)`` (grouped, unlike scikit-learn's int
        convention, because runs of one task must not straddle folds). Any
        splitter or iterable of splits is used as given.
    scoring : str, callable or None, default=None
        Metric to maximise. ``None`` uses the estimator's ``score`` (step
        accuracy for skafa probes). A string names a skafa scorer from
        :data:`skafa.metrics.SCORERS` (``"step_accuracy"``, ``"within_1"``,
        ``"top3"``, ``"agent_accuracy"``, ...) or else a scikit-learn scorer;
        a callable ``scorer(estimator, X, y)`` is used as is.
    n_jobs : int, default=None
        Number of jobs over (site, fold) fits. ``None`` means 1 unless in a
        :func:`joblib.parallel_backend` context; ``-1`` means all processors.
    refit : bool, default=True
        Refit the estimator on all the data at the best site. With
        ``refit=False`` only the selection is made and prediction methods are
        unavailable.
    verbose : int, default=0
        Verbosity (progress messages from joblib when positive).
    error_score : "raise" or float, default=np.nan
        Score recorded when a fit or score fails at some (site, fold); a
        :class:`~sklearn.exceptions.FitFailedWarning` is issued. ``"raise"``
        re-raises the error. Sites whose mean is NaN rank last.
    n_sites : int, default=1
        Number of best-ranked sites to keep. ``1`` is the plain selection.
        With ``k > 1`` the refitted ``best_estimator_`` is a
        :class:`SiteEnsemble` over the ``k`` sites with the highest mean
        cross-validated score (earliest in ``sites`` order on ties; sites
        whose mean is NaN are never kept); it fits a clone at each of them
        and predicts from the mean of their standardized turn scores. The
        ranking is the same inner cross-validation as for ``k=1`` (training
        data only). With one candidate (no ``param_grid``) the averaged model
        itself is not cross-validated, so tune ``n_sites`` in an outer search
        if needed; with several candidates it is (see ``param_grid``).
    param_grid : dict or list of dicts, default=None
        Parameters of ``estimator`` searched *jointly* with the site, on the
        same splits (e.g. ``{"C": [0.001, 0.01, 0.1]}``), in
        :class:`~sklearn.model_selection.ParameterGrid` order. Every
        (candidate, site) pair is cross-validated. With ``n_sites=1`` the
        pair with the best mean score wins (ties: the earliest candidate, then
        the earliest site). With ``n_sites=k > 1`` each candidate keeps its
        own ``k`` best sites, the ``k``-site average of each candidate is
        cross-validated on the same splits, and the candidate whose average
        scores best wins (ties: the earliest). ``None`` means the estimator as
        given (one candidate), exactly the site-only selection. This is the
        selection of configurations 1-8 of the pre-registered comparison
        (docs/benchmarks.md, section 3).

    Attributes
    ----------
    best_site_ : str
        The chosen site (with ``n_sites > 1``, the best-ranked of
        ``best_sites_``).
    best_sites_ : tuple of str
        The ``n_sites`` kept sites, best first (``(best_site_,)`` when
        ``n_sites=1``).
    best_index_ : int
        Index of ``best_site_`` in ``cv_results_``.
    best_score_ : float
        Mean cross-validated score at ``best_site_`` (of the chosen candidate).
    best_params_ : dict
        The chosen candidate of ``param_grid`` (``{}`` without one).
    candidate_scores_ : ndarray of shape (n_candidates,)
        The score that compared the candidates: with ``n_sites > 1`` and
        several candidates, the mean cross-validated score of each
        candidate's ``k``-site average; otherwise the mean score of each
        candidate's best site.
    best_estimator_ : estimator object
        Estimator (with ``best_params_``) refitted on all the data at
        ``best_site_`` (``refit=True``);
        with ``n_sites > 1``, a fitted :class:`SiteEnsemble` over
        ``best_sites_`` (its ``estimators_`` holds one refitted estimator per
        site).
    cv_results_ : dict of ndarray
        One entry per (candidate, site), candidate-major, like
        :class:`~sklearn.model_selection.GridSearchCV`: ``site``, ``params``
        (``{"site": name, **candidate}``), ``param_<name>`` for every
        parameter of ``param_grid`` (object arrays; ``None`` where a candidate
        lacks it), ``split{k}_test_score``,
        ``mean_test_score``, ``std_test_score``, ``rank_test_score``,
        ``mean_fit_time``, ``std_fit_time``, ``mean_score_time``,
        ``std_score_time``. Convertible with ``pandas.DataFrame``.
    sites_ : tuple of str
        The sites compared.
    n_splits_ : int
        Number of cross-validation splits.
    scorer_ : callable
        The scorer used.
    refit_time_ : float
        Seconds to refit the best estimator (``refit=True``).
    n_features_in_ : int
        Features per turn of the best estimator.

    See Also
    --------
    SiteEnsemble : Average standardized turn scores over given sites.
    site_sweep : Train-on-one-set, score-on-another per site (analysis only).

    Notes
    -----
    **Groups.** The splits are shared by all sites (paired comparison). The
    groups given to the splitter are, in order of precedence, the ``groups``
    passed to ``fit`` (directly, or routed when metadata routing is enabled),
    else ``X.task_ids`` when ``X`` carries task ids for every conversation.
    The fallback keeps runs of one task on one side of every inner split even
    where scikit-learn does not forward ``groups`` (e.g. inside a
    ``GridSearchCV`` or ``cross_validate`` without metadata routing). With
    neither, a group splitter raises an error asking for groups.

    With some conversations lacking a task id and no ``groups``, a group
    splitter's error names them (position, first five and a count) and says how
    to fix it: pass ``groups``, give them task ids, or use an ungrouped
    splitter. Task ids are never guessed, and the complete ones are not used
    for part of the data only.

    **Single-turn conversations.** A conversation with one turn has only one
    possible decisive step, so it cannot tell sites apart. When every training
    conversation has a single turn, ``fit`` raises a ``ValueError`` before
    fitting anything: every candidate predicts turn 0 at every site and scores
    the same, so there is nothing to choose between, and picking a site
    anyway (say the first, with a warning) would pass off an arbitrary choice
    as a selection and leave a refitted estimator that learned nothing (the
    skafa probes refuse such data themselves). When only a few conversations
    have several turns, a fold may hold them all out of its training part;
    the estimator then fails there at every site, and the resulting error
    names those folds and the multi-turn conversations.

    **Ties.** Sites with the same mean score share a rank; the earliest of
    them in ``sites`` order is chosen (so shallower sites win ties when the
    sites are in depth order).

    **Metadata routing.** ``get_metadata_routing`` maps ``fit`` to the
    splitter's ``split`` (for ``groups``), the estimator's ``fit`` and the
    scorer, as ``GridSearchCV`` does, so nested cross-validation can group
    both loops under ``sklearn.set_config(enable_metadata_routing=True)``.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.model_selection import GroupKFold
    >>> from skafa import TurnFeatures
    >>> from skafa.probes import GroupedArgmaxLogisticClassifier
    >>> from skafa.model_selection import SiteSelector
    >>> rng = np.random.default_rng(0)
    >>> offsets = np.arange(0, 161, 4)                  # 40 conversations x 4 turns
    >>> values = rng.normal(size=(160, 3, 2))           # 3 sites, 2 features
    >>> y = rng.integers(0, 4, size=40)
    >>> values[offsets[:-1] + y, 1, 0] += 4.0           # signal at site "b"
    >>> X = TurnFeatures(values, offsets, sites=["a", "b", "c"])
    >>> groups = np.arange(40) // 2                     # two runs per task
    >>> sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(4))
    >>> sel.fit(X, y, groups=groups).best_site_
    'b'
    >>> top2 = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(4), n_sites=2)
    >>> top2.fit(X, y, groups=groups).best_sites_[0], len(top2.best_sites_)
    ('b', 2)
    """

    _parameter_constraints: dict = {
        "estimator": [HasMethods(["fit"])],
        "sites": ["array-like", None],
        "cv": ["cv_object"],
        "scoring": [StrOptions(set(get_scorer_names()) | set(SCORERS)), callable, None],
        "n_jobs": [Integral, None],
        "refit": ["boolean"],
        "verbose": ["verbose"],
        "error_score": [StrOptions({"raise"}), Real],
        "n_sites": [Interval(Integral, 1, None, closed="left")],
        "param_grid": [dict, list, None],
    }

    # skafa.persistence: the scorer is a function, never saved; rebuilt from `scoring`.
    _runtime_attributes = frozenset({"scorer_"})

    def _check_fitted_consistency(self):
        """Check that a loaded selector's results agree (see :mod:`skafa.persistence`).

        ``best_site_`` and every one of ``best_sites_`` must be among the sites
        compared (``sites_``), ``best_site_`` among ``best_sites_`` and the site of
        row ``best_index_`` of ``cv_results_`` (which holds one row per candidate
        and site), at most ``n_sites`` sites kept, and a refitted
        :class:`SiteEnsemble` must average exactly ``best_sites_``. A file edited
        otherwise is refused at load instead of reading another site at predict.

        Raises
        ------
        ValueError
            Naming the attributes that disagree and their values.
        """
        state = vars(self)
        if "sites_" not in state:
            return
        compared = _site_names(state, "sites_")
        best = state.get("best_site_")
        if best is not None and best not in compared:
            raise ValueError(f"best_site_ is {best!r:.80} but sites_ (the sites compared) "
                             f"are {compared!r:.200}")
        kept = None
        if state.get("best_sites_") is not None:
            kept = _site_names(state, "best_sites_")
            outside = [site for site in kept if site not in compared]
            if outside:
                raise ValueError(f"best_sites_ holds {outside[0]!r:.80}, which is not among "
                                 f"sites_ (the sites compared): {compared!r:.200}")
            if best is not None and best not in kept:
                raise ValueError(f"best_site_ is {best!r:.80} but best_sites_ (the kept "
                                 f"sites) are {kept!r:.200}")
            n_sites = getattr(self, "n_sites", None)
            if isinstance(n_sites, Integral) and len(kept) > n_sites:
                raise ValueError(f"best_sites_ holds {len(kept)} sites but n_sites is "
                                 f"{n_sites}")
        results, index = state.get("cv_results_"), state.get("best_index_")
        column = results.get("site") if isinstance(results, dict) else None
        if isinstance(column, (np.ndarray, list)):
            scores = state.get("candidate_scores_")
            if isinstance(scores, np.ndarray) and scores.ndim == 1 \
                    and len(column) != scores.shape[0] * len(compared):
                raise ValueError(
                    f"cv_results_ has {len(column)} rows but candidate_scores_ has shape "
                    f"{scores.shape} and sites_ names {len(compared)} sites: one row per "
                    "candidate and site is needed")
            if best is not None and isinstance(index, Integral) \
                    and 0 <= index < len(column) and column[index] != best:
                raise ValueError(f"best_site_ is {best!r:.80} but row best_index_ {index} "
                                 f"of cv_results_ is site {column[index]!r:.80}")
        refitted = state.get("best_estimator_")
        if kept is not None and refitted is not None:
            if isinstance(refitted, SiteEnsemble) and "sites_" in vars(refitted):
                averaged = list(vars(refitted)["sites_"])
                if averaged != kept:
                    raise ValueError(f"best_estimator_ (SiteEnsemble) averages sites_ "
                                     f"{averaged!r:.200} but best_sites_ is {kept!r:.200}")
            elif len(kept) > 1 and not isinstance(refitted, SiteEnsemble):
                raise ValueError(f"best_sites_ holds {len(kept)} sites but best_estimator_ "
                                 f"is a {type(refitted).__name__}, not the SiteEnsemble "
                                 "that averages them")

    def _restore_after_load(self, context):
        """Rebuild :attr:`scorer_` from ``scoring`` (see skafa.persistence)."""
        if hasattr(self, "cv_results_"):
            self.scorer_ = _get_scorer(self.estimator, self.scoring)

    def __init__(
        self,
        estimator,
        *,
        sites=None,
        cv=None,
        scoring=None,
        n_jobs=None,
        refit=True,
        verbose=0,
        error_score=np.nan,
        n_sites=1,
        param_grid=None,
    ):
        self.estimator = estimator
        self.sites = sites
        self.cv = cv
        self.scoring = scoring
        self.n_jobs = n_jobs
        self.refit = refit
        self.verbose = verbose
        self.error_score = error_score
        self.n_sites = n_sites
        self.param_grid = param_grid

    # ------------------------------------------------------------------ fitting
    def _split_and_fit_params(self, groups, params):
        if routing_enabled():
            routed = process_routing(self, "fit", groups=groups, **params)
            return dict(routed.splitter.split), dict(routed.estimator.fit)
        split_params = {} if groups is None else {"groups": groups}
        return split_params, dict(params)

    @fit_context(
        # SiteSelector.estimator is validated when it is fitted
        prefer_skip_nested_validation=False
    )
    def fit(self, X, y, groups=None, **params):
        """Cross-validate every site, pick the best, refit there.

        Parameters
        ----------
        X : TurnFeatures
            Per-turn features with one or more site blocks.
        y : array-like of int, shape (n_conversations,)
            Decisive step of each conversation.
        groups : array-like of shape (n_conversations,), default=None
            Group labels (task ids) for the splitter. ``None`` falls back to
            ``X.task_ids`` when present (see Notes).
        **params : dict
            Parameters for the estimator's ``fit`` (and, with metadata routing
            enabled, for the splitter and scorer). Sample-aligned entries are
            sliced with the folds.

        Returns
        -------
        self : object
            Fitted selector.

        Raises
        ------
        ValueError
            When every conversation of ``X`` has a single turn (nothing to
            choose between, see Notes); when a group splitter gets no groups
            (naming the conversations without a task id, if only some lack
            one); when no site has a finite mean score (naming the folds whose
            training part holds single-turn conversations only, if any).
        """
        X = check_turn_features(X, self)
        y = check_steps(y, X)
        if np.all(np.asarray(X.n_turns) == 1):
            raise ValueError(
                f"{type(self).__name__}: every one of the {len(X)} training conversations "
                "has a single turn, so every candidate predicts turn 0 at every site and "
                "scores the same: there is nothing to choose between. Fit on "
                "conversations with at least two turns (a single-turn conversation says "
                "nothing about which turn is decisive)."
            )
        sites = resolve_sites(self.sites, X)
        if self.n_sites > len(sites):
            raise ConfigurationError(
                f"{type(self).__name__}(n_sites={self.n_sites}) averages the "
                f"{self.n_sites} best sites, but X holds only {len(sites)} to compare "
                f"({', '.join(sites)}); lower n_sites, or read more sites "
                "(e.g. sites='all' or a smaller stride).")
        _check_no_fixed_site(self.estimator, type(self).__name__)
        grid, candidates = self._candidates()
        cv = check_site_cv(self.cv)
        scorer = _get_scorer(self.estimator, self.scoring)
        split_params, fit_params = self._split_and_fit_params(groups, params)
        splits = grouped_splits(cv, X, y, split_params, X.task_ids)
        n_splits, n_sites, n_cand = len(splits), len(sites), len(candidates)
        if self.verbose > 0:
            per = f"{n_sites} sites" if n_cand == 1 else \
                f"{n_cand} candidates x {n_sites} sites"
            log(self, 1, f"Fitting {n_splits} folds for each of {per}, totalling "
                         f"{n_splits * n_sites * n_cand} fits")

        def tasks():
            for est in candidates:
                for site in sites:
                    X_site = X.select_sites(site)
                    for fold, (train, test) in enumerate(splits):
                        yield delayed(_fit_and_score_site)(
                            clone(est), X_site, y, train, test, scorer,
                            fit_params, self.error_score, site, fold,
                        )

        with stop_requests():  # SIGTERM or Ctrl-C in a fold stops the search (not a failed fit)
            out = Parallel(n_jobs=self.n_jobs, verbose=self.verbose)(tasks())
        shape = (n_cand * n_sites, n_splits)
        scores = np.array([o["score"] for o in out], dtype=float).reshape(shape)
        fit_times = np.array([o["fit_time"] for o in out]).reshape(shape)
        score_times = np.array([o["score_time"] for o in out]).reshape(shape)
        means = scores.mean(axis=1)
        if np.all(np.isnan(means)):
            raise ValueError(
                "no site has a finite mean cross-validation score (every site failed "
                f"in at least one fold){_single_turn_folds(X, splits)}; see the "
                "FitFailedWarnings above, or set error_score='raise' to see the first "
                "error."
            )

        stds = scores.std(axis=1)
        # NaN means rank last; equal means share the lowest rank ("min").
        filled = np.where(np.isnan(means), np.nanmin(means) - 1.0, means)
        ranks = rankdata(-filled, method="min").astype(np.int32)
        # each candidate's best site (earliest on ties) and its k best sites
        block = [slice(c * n_sites, (c + 1) * n_sites) for c in range(n_cand)]
        best_site_of = [int(np.argmax(filled[b])) for b in block]
        top_of = [_top_sites(sites, filled[b], np.isnan(means[b]), self.n_sites)
                  if np.any(np.isfinite(means[b])) else () for b in block]
        cand_scores = np.array([means[b][i] for b, i in zip(block, best_site_of)])
        if self.n_sites > 1 and n_cand > 1:
            cand_scores = np.array([
                self._ensemble_cv_score(est, top, X, y, splits, scorer, fit_params)
                if top else np.nan for est, top in zip(candidates, top_of)])
            if np.all(np.isnan(cand_scores)):
                raise ValueError(
                    "no candidate's site average has a finite mean cross-validation "
                    f"score{_single_turn_folds(X, splits)}; see the FitFailedWarnings "
                    "above, or set error_score='raise'."
                )
        best_cand = int(np.argmax(np.where(np.isnan(cand_scores), -np.inf, cand_scores)))
        best_index = best_cand * n_sites + best_site_of[best_cand]

        results = {
            "site": np.asarray(sites * n_cand, dtype=object),
            "params": [{"site": s, **p} for p in grid for s in sites],
        }
        for name in sorted({k for p in grid for k in p}):
            column = np.empty(n_cand * n_sites, dtype=object)
            column[:] = [p.get(name) for p in grid for _ in sites]
            results[f"param_{name}"] = column
        for k in range(n_splits):
            results[f"split{k}_test_score"] = scores[:, k]
        results.update(
            mean_test_score=means,
            std_test_score=stds,
            rank_test_score=ranks,
            mean_fit_time=_nan_mean(fit_times),
            std_fit_time=_nan_std(fit_times),
            mean_score_time=_nan_mean(score_times),
            std_score_time=_nan_std(score_times),
        )

        self.cv_results_ = results
        self.sites_ = sites
        self.n_splits_ = n_splits
        self.scorer_ = scorer
        self.best_index_ = best_index
        self.best_site_ = sites[best_site_of[best_cand]]
        self.best_score_ = float(means[best_index])
        self.best_params_ = dict(grid[best_cand])
        self.candidate_scores_ = np.asarray(cand_scores, dtype=np.float64)
        self.best_sites_ = top_of[best_cand]
        best = candidates[best_cand]
        if self.refit:
            start = time.perf_counter()
            if self.n_sites == 1:
                self.best_estimator_ = clone(best).fit(
                    X.select_sites(self.best_site_), y, **fit_params
                )
            else:
                self.best_estimator_ = SiteEnsemble(
                    best, sites=list(self.best_sites_), n_jobs=self.n_jobs
                ).fit(X.select_sites(list(self.best_sites_)), y, **fit_params)
            self.refit_time_ = time.perf_counter() - start
        else:  # a previous fit's refitted estimator is not this fit's
            for name in ("best_estimator_", "refit_time_"):
                self.__dict__.pop(name, None)
        return self

    def _candidates(self):
        """``(candidates, estimators)``: ``param_grid``'s dicts and one unfitted
        estimator each (``([{}], [estimator])`` without a grid)."""
        if self.param_grid is None:
            return [{}], [self.estimator]
        grid = list(ParameterGrid(self.param_grid))
        if not grid:
            raise ValueError("param_grid is empty: give at least one candidate, or None.")
        out = []
        for candidate in grid:
            if any(k == "site" or k.endswith("__site") for k in candidate):
                raise ValueError(
                    f"param_grid sets a site parameter ({sorted(candidate)}); "
                    "SiteSelector chooses the site itself (use its sites parameter)."
                )
            try:
                out.append(clone(self.estimator).set_params(**candidate))
            except ValueError as exc:
                raise ValueError(f"param_grid candidate {candidate}: {exc}") from None
        return grid, out

    def _ensemble_cv_score(self, estimator, top, X, y, splits, scorer, fit_params):
        """Mean score of the ``top``-site average of ``estimator`` over ``splits``."""
        X_top = X.select_sites(list(top))
        with stop_requests():  # a stop in a fold stops the search (not a failed fit)
            folds = Parallel(n_jobs=self.n_jobs)(
                delayed(_fit_and_score_site)(
                    SiteEnsemble(estimator, sites=list(top)), X_top, y, train, test,
                    scorer, fit_params, self.error_score, f"average of {list(top)}", fold)
                for fold, (train, test) in enumerate(splits))
        return float(np.mean([f["score"] for f in folds]))

    # --------------------------------------------------------------- delegation
    def _check_refitted(self, method):
        check_is_fitted(self)
        if not self.refit:
            raise AttributeError(
                f"SiteSelector was fitted with refit=False; {method} needs the "
                "refitted best_estimator_."
            )

    def _at_best_site(self, X):
        X = check_turn_features(X, self)
        best_sites = getattr(self, "best_sites_", (self.best_site_,))  # older saves
        if len(best_sites) > 1:
            missing = [s for s in best_sites if s not in X.sites]
            if missing:
                raise ValueError(
                    f"SiteSelector averages sites {list(best_sites)}; X lacks "
                    f"{missing} (X has {list(X.sites)})."
                )
            return X.select_sites(list(best_sites))
        if self.best_site_ not in X.sites:
            raise ValueError(
                f"SiteSelector chose site {self.best_site_!r}, which X does not hold "
                f"(X has {list(X.sites)})."
            )
        return X.select_sites(self.best_site_)

    @property
    def n_features_in_(self):
        """Number of features per turn seen by the best estimator (``refit=True``)."""
        if "best_estimator_" not in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__} has no n_features_in_: it is not fitted, or was "
                "fitted with refit=False (no best_estimator_)."
            )
        return self.best_estimator_.n_features_in_

    # ------------------------------------------- DecisiveStepMixin hooks
    def _has_decisive_method(self, name):
        return _estimator_has(name)(self)

    def _decisive_delegate(self, X, method):
        # predict, predict_agent, turn_decision_function and turn_predict_proba
        # are the refitted best estimator's, read at ``best_sites_``.
        self._check_refitted(method)
        return self.best_estimator_, self._at_best_site(X)

    def _score(self, X, y, sample_weight):
        # ``scoring`` (the estimator's own score when None) at ``best_sites_``.
        self._check_refitted("score")
        kwargs = {} if sample_weight is None else {"sample_weight": sample_weight}
        return self.scorer_(self.best_estimator_, self._at_best_site(X), y, **kwargs)

    # ------------------------------------------------------------------ routing
    def get_metadata_routing(self):
        """Get metadata routing of this object.

        ``fit`` routes to the estimator's ``fit``, the scorer and the splitter's
        ``split`` (``groups``), as in ``GridSearchCV``.

        Returns
        -------
        routing : MetadataRouter
            A :class:`~sklearn.utils.metadata_routing.MetadataRouter` encapsulating
            routing information.
        """
        router = MetadataRouter(owner=self)
        router.add(
            estimator=self.estimator,
            method_mapping=MethodMapping().add(caller="fit", callee="fit"),
        )
        router.add(
            scorer=_get_scorer(self.estimator, self.scoring),
            method_mapping=MethodMapping()
            .add(caller="fit", callee="score")
            .add(caller="score", callee="score"),
        )
        router.add(
            splitter=check_site_cv(self.cv),
            method_mapping=MethodMapping().add(caller="fit", callee="split"),
        )
        return router

def _fit_member(estimator, X, y, params):
    return estimator.fit(X, y, **params)


def _member_scores(estimator, X, site):
    """Concatenated turn scores of a fitted member at ``site`` of ``X``."""
    try:
        scores = final_step_call(estimator, "turn_decision_function", X.select_sites(site))
    except AttributeError as exc:
        raise TypeError(
            f"SiteEnsemble needs per-turn scores, but {estimator!r} has no "
            f"turn_decision_function ({exc}); use a skafa probe (or an "
            "AttributionPipeline / Pipeline ending in one)."
        ) from None
    scores = np.concatenate([np.asarray(s, dtype=np.float64).ravel() for s in scores])
    if scores.shape != (X.n_turns_total,):
        raise ValueError(
            f"the estimator at site {site!r} returned {scores.shape[0]} turn scores for "
            f"{X.n_turns_total} turns."
        )
    return scores


class SiteEnsemble(DecisiveStepMixin, MetaEstimatorMixin, BaseEstimator):
    """Average the standardized turn scores of one estimator fitted at several sites.

    A clone of ``estimator`` is fitted on ``X.select_sites(site)`` for every site
    in ``sites``. At prediction time each member scores every turn at its own
    site; the scores are standardized per site and averaged, and the decisive
    step of a conversation is its turn with the highest average.

    Standardization: a member's turn scores are centred within each
    conversation (its mean over the conversation's turns is subtracted) and
    divided by ``score_scale_[j]``, the root mean square of those centred
    scores over the *training* turns (``1`` if it is zero). Only differences
    between turns of one conversation decide the step, so this puts every site
    on the same within-conversation scale before averaging; the scale is
    learned on the training data only (the centring of a test conversation
    uses that conversation's own scores and no label).

    :class:`SiteSelector` with ``n_sites=k`` chooses the ``k`` sites by inner
    cross-validation and refits one of these; use it directly when the sites
    are fixed in advance. It is a separate estimator (rather than a mode of
    :class:`SiteSelector`) because averaging over *given* sites involves no
    selection, and because it takes a multi-site ``X`` while every selected
    single-site estimator takes one site.

    Parameters
    ----------
    estimator : estimator object
        Conversation-level estimator taking a single-site ``TurnFeatures`` and
        implementing ``turn_decision_function`` (e.g. a skafa probe, or an
        :class:`~skafa.AttributionPipeline` / Pipeline ending in one). Its
        ``site`` parameter(s) must be left to ``None``.
    sites : list of str, default=None
        Sites to average over; ``None`` means every site of ``X``.
    n_jobs : int, default=None
        Number of members fitted in parallel (joblib). ``None`` means 1.

    Attributes
    ----------
    estimators_ : list of estimator
        One fitted clone per site, in ``sites_`` order.
    sites_ : tuple of str
        The sites averaged over.
    score_scale_ : ndarray of shape (n_sites,)
        Root mean square of each member's within-conversation centred training
        turn scores.
    n_features_in_ : int
        Number of features per turn.

    See Also
    --------
    SiteSelector : Choose the site (or, with ``n_sites``, the sites) by
        grouped cross-validation.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> from skafa.probes import GroupedArgmaxLogisticClassifier
    >>> from skafa.model_selection import SiteEnsemble
    >>> rng = np.random.default_rng(0)
    >>> offsets = np.arange(0, 161, 4)                  # 40 conversations x 4 turns
    >>> values = rng.normal(size=(160, 3, 2))           # 3 sites, 2 features
    >>> y = rng.integers(0, 4, size=40)
    >>> values[offsets[:-1] + y, :, 0] += 1.5           # weak signal at every site
    >>> X = TurnFeatures(values, offsets, sites=["a", "b", "c"])
    >>> ens = SiteEnsemble(GroupedArgmaxLogisticClassifier()).fit(X[:20], y[:20])
    >>> ens.sites_, ens.score_scale_.shape
    (('a', 'b', 'c'), (3,))
    >>> ens.predict(X[20:]).shape
    (20,)
    """

    _parameter_constraints: dict = {
        "estimator": [HasMethods(["fit"])],
        "sites": ["array-like", None],
        "n_jobs": [Integral, None],
    }

    def __init__(self, estimator, *, sites=None, n_jobs=None):
        self.estimator = estimator
        self.sites = sites
        self.n_jobs = n_jobs

    @fit_context(
        # SiteEnsemble.estimator is validated when it is fitted
        prefer_skip_nested_validation=False
    )
    def fit(self, X, y, **params):
        """Fit one clone of the estimator per site and learn the score scales.

        Parameters
        ----------
        X : TurnFeatures
            Per-turn features holding every site in ``sites``.
        y : array-like of int, shape (n_conversations,)
            Decisive step of each conversation.
        **params : dict
            Parameters for every member's ``fit`` (routed when metadata routing
            is enabled).

        Returns
        -------
        self : object
            Fitted ensemble.
        """
        X = check_turn_features(X, self)
        y = check_steps(y, X)
        sites = resolve_sites(self.sites, X)
        _check_no_fixed_site(self.estimator, type(self).__name__)
        if routing_enabled():
            params = dict(process_routing(self, "fit", **params).estimator.fit)
        estimators = Parallel(n_jobs=self.n_jobs)(
            delayed(_fit_member)(clone(self.estimator), X.select_sites(site), y, params)
            for site in sites
        )
        scales = []
        for estimator, site in zip(estimators, sites):
            deviation = grouped_center(_member_scores(estimator, X, site), X.offsets)
            scale = float(np.sqrt(np.mean(deviation**2)))
            scales.append(scale if np.isfinite(scale) and scale > 0 else 1.0)
        self.estimators_ = list(estimators)
        self.sites_ = sites
        self.score_scale_ = np.asarray(scales, dtype=np.float64)
        self.n_features_in_ = int(X.n_features)
        return self

    def _check_fitted_consistency(self):
        """Check that a loaded ensemble's pieces agree (see :mod:`skafa.persistence`).

        One fitted estimator in ``estimators_`` and one finite, positive scale in
        ``score_scale_`` (shape ``(n_sites,)``) per site of ``sites_``, whose names
        are unique. A file edited otherwise is refused at load instead of
        silently averaging fewer sites (``zip``) at predict.

        Raises
        ------
        ValueError
            Naming the attributes that disagree and their shapes.
        """
        state = vars(self)
        if "sites_" not in state:
            return
        sites = _site_names(state, "sites_")
        members = state.get("estimators_")
        if members is not None:
            if not isinstance(members, (list, tuple)):
                raise ValueError(f"estimators_ must be a list of fitted estimators, got "
                                 f"{type(members).__name__}")
            if len(members) != len(sites):
                raise ValueError(f"estimators_ holds {len(members)} fitted estimators but "
                                 f"sites_ names {len(sites)} sites ({sites!r:.200}): one "
                                 "per site is needed")
        scale = state.get("score_scale_")
        if scale is not None:
            if not isinstance(scale, np.ndarray) or scale.shape != (len(sites),):
                shape = scale.shape if isinstance(scale, np.ndarray) else type(scale).__name__
                raise ValueError(f"score_scale_ has shape {shape} but sites_ names "
                                 f"{len(sites)} sites: one scale per site is needed")
            if scale.dtype.kind not in "fiu":
                raise ValueError(f"score_scale_ must hold numbers, got dtype {scale.dtype}")
            bad = np.flatnonzero(~(np.isfinite(scale) & (scale > 0)))
            if bad.size:
                raise ValueError(f"score_scale_[{int(bad[0])}] is {scale[bad[0]]!r}: every "
                                 "scale must be finite and positive")

    def _average(self, X):
        check_is_fitted(self)
        X = check_turn_features(X, self)
        missing = [s for s in self.sites_ if s not in X.sites]
        if missing:
            raise ValueError(
                f"SiteEnsemble was fitted on sites {list(self.sites_)}; X lacks "
                f"{missing} (X has {list(X.sites)})."
            )
        total = np.zeros(X.n_turns_total, dtype=np.float64)
        for estimator, site, scale in zip(self.estimators_, self.sites_, self.score_scale_):
            total += grouped_center(_member_scores(estimator, X, site), X.offsets) / scale
        return X, total / len(self.sites_)

    def _turn_scores(self, X):
        """Mean standardized turn score over the sites (the DecisiveStepMixin hook).

        Centred within each conversation; ``turn_predict_proba`` is its softmax,
        a ranking device rather than calibrated probabilities.
        """
        return self._average(X)

    def get_metadata_routing(self):
        """Get metadata routing of this object.

        ``fit`` routes to every member's ``fit``.

        Returns
        -------
        routing : MetadataRouter
            A :class:`~sklearn.utils.metadata_routing.MetadataRouter` encapsulating
            routing information.
        """
        return MetadataRouter(owner=self).add(
            estimator=self.estimator,
            method_mapping=MethodMapping().add(caller="fit", callee="fit"),
        )

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = get_tags(self.estimator).input_tags.sparse
        return tags


def site_sweep(estimator, X_train, y_train, X_test, y_test, *, sites=None,
               scoring=None, n_jobs=None):
    """Fit on one set and score on another, separately at every site.

    Meant for analysis curves (score versus depth). Choosing a site from
    these test scores and reporting the same scores is optimistic, because
    the test set then took part in the choice; select with
    :class:`SiteSelector` (cross-validation on training data only) and report
    on held-out data instead.

    Parameters
    ----------
    estimator : estimator object
        Conversation-level estimator; cloned for every site.
    X_train, X_test : TurnFeatures
        Training and test features; ``X_test`` must hold every swept site.
    y_train, y_test : array-like of int
        Decisive steps.
    sites : list of str, default=None
        Sites to sweep, in order; ``None`` means every site of ``X_train``.
    scoring : str, callable or None, default=None
        As in :class:`SiteSelector`.
    n_jobs : int, default=None
        Number of jobs over sites.

    Returns
    -------
    results : dict of ndarray
        ``site`` (object array), ``train_score``, ``test_score``, ``fit_time``.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> from skafa.probes import GroupedArgmaxLogisticClassifier
    >>> from skafa.model_selection import site_sweep
    >>> rng = np.random.default_rng(0)
    >>> offsets = np.arange(0, 81, 4)
    >>> values = rng.normal(size=(80, 2, 2))
    >>> y = rng.integers(0, 4, size=20)
    >>> values[offsets[:-1] + y, 1, 0] += 4.0
    >>> X = TurnFeatures(values, offsets, sites=["a", "b"])
    >>> res = site_sweep(GroupedArgmaxLogisticClassifier(), X[:10], y[:10], X[10:], y[10:])
    >>> res["site"].tolist(), bool(res["test_score"][1] > res["test_score"][0])
    (['a', 'b'], True)
    """
    X_train = check_turn_features(X_train, estimator)
    X_test = check_turn_features(X_test, estimator)
    y_train = check_steps(y_train, X_train)
    y_test = check_steps(y_test, X_test)
    sites = resolve_sites(sites, X_train)
    missing = [s for s in sites if s not in X_test.sites]
    if missing:
        raise ValueError(f"X_test lacks site(s) {missing}.")
    _check_no_fixed_site(estimator, "site_sweep")
    scorer = _get_scorer(estimator, scoring)

    def one(site):
        est = clone(estimator)
        start = time.perf_counter()
        est.fit(X_train.select_sites(site), y_train)
        fit_time = time.perf_counter() - start
        return (
            float(scorer(est, X_train.select_sites(site), y_train)),
            float(scorer(est, X_test.select_sites(site), y_test)),
            fit_time,
        )

    out = Parallel(n_jobs=n_jobs)(delayed(one)(site) for site in sites)
    return {
        "site": np.asarray(sites, dtype=object),
        "train_score": np.array([o[0] for o in out]),
        "test_score": np.array([o[1] for o in out]),
        "fit_time": np.array([o[2] for o in out]),
    }
