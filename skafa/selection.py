"""Choose the activation site by grouped cross-validation.

:class:`SiteSelector` cross-validates one estimator per site block of a
:class:`~skafa.TurnFeatures` and keeps the best site, like a
:class:`~sklearn.model_selection.GridSearchCV` over the site. :func:`site_sweep`
scores every site on a separate test set for analysis curves.
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
from sklearn.model_selection import GroupKFold, check_cv
from sklearn.utils import get_tags
from sklearn.utils.metadata_routing import (
    MetadataRouter,
    MethodMapping,
    process_routing,
)
from sklearn.utils.metaestimators import available_if
from sklearn.utils.parallel import Parallel, delayed
from sklearn.utils.validation import check_is_fitted

from .metrics import SCORERS
from .utils._sklearn_compat import (
    HasMethods,
    StrOptions,
    _fit_context,
    _routing_enabled,
    _safe_indexing,
)
from .utils._validation import check_steps, check_turn_features

__all__ = ["SiteSelector", "site_sweep"]


def _ignores_groups(cv):
    """True for splitters that ignore ``groups`` (KFold, ShuffleSplit, ...)."""
    try:
        from .utils._sklearn_compat import _UnsupportedGroupCVMixin
    except ImportError:  # pragma: no cover - older/newer scikit-learn
        return False
    return isinstance(cv, _UnsupportedGroupCVMixin)


def _check_site_cv(cv):
    """``None`` -> ``GroupKFold(5)``; int ``n`` -> ``GroupKFold(n)``; else check_cv."""
    if cv is None:
        return GroupKFold(n_splits=5)
    if isinstance(cv, Integral) and not isinstance(cv, bool):
        return GroupKFold(n_splits=int(cv))
    return check_cv(cv, classifier=False)


def _grouped_splits(cv, X, y, split_params):
    """``list(cv.split(X, y, **split_params))``, grouping by ``X.task_ids`` by default.

    When no ``groups`` were given and the splitter uses groups, the task ids of
    ``X`` (when every conversation has one) are the groups; a splitter that needs
    groups and gets none raises an error saying how to pass them.
    """
    split_params = dict(split_params)
    if (split_params.get("groups") is None and X.task_ids is not None
            and not _ignores_groups(cv)):
        if all(t is not None for t in X.task_ids):
            split_params["groups"] = X.task_ids
    try:
        return list(cv.split(X, y, **split_params))
    except ValueError as exc:
        if split_params.get("groups") is None and "group" in str(exc).lower():
            raise ValueError(
                f"the splitter {cv!r} needs groups: pass groups=<task ids> to fit "
                "(routed automatically with metadata routing), give X task_ids, "
                "or use an ungrouped splitter such as KFold."
            ) from exc
        raise


def _get_scorer(estimator, scoring):
    """skafa scorer names (``"top3"``, ``"within_1"``, ...) first, then sklearn's."""
    if isinstance(scoring, str) and scoring in SCORERS:
        return SCORERS[scoring]
    return check_scoring(estimator, scoring=scoring)


def _resolve_sites(sites, X):
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


def _index_params(params, indices, n_samples):
    """Slice the sample-aligned entries of ``params`` (like sklearn's CV does)."""
    out = {}
    for key, value in params.items():
        if (
            value is not None
            and not isinstance(value, (str, bytes))
            and hasattr(value, "__len__")
            and len(value) == n_samples
        ):
            out[key] = _safe_indexing(value, indices)
        else:
            out[key] = value
    return out


def _fit_and_score_site(estimator, X, y, train, test, scorer, fit_params,
                        error_score, site, fold):
    """Fit ``estimator`` on ``X[train]`` (one site) and score it on ``X[test]``."""
    fit_params = _index_params(fit_params, train, len(X))
    start = time.perf_counter()
    try:
        estimator.fit(X[train], y[train], **fit_params)
        fit_time = time.perf_counter() - start
        start = time.perf_counter()
        score = float(scorer(estimator, X[test], y[test]))
        score_time = time.perf_counter() - start
    except Exception as exc:
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


def _estimator_has(attr):
    """Check the fitted best estimator, else the unfitted one, for ``attr``."""

    def check(self):
        if hasattr(self, "best_estimator_"):
            getattr(self.best_estimator_, attr)
        else:
            getattr(self.estimator, attr)
        return True

    return check


class SiteSelector(MetaEstimatorMixin, BaseEstimator):
    """Choose the activation site by grouped cross-validation, then refit there.

    For every site (default: all sites of ``X``) a clone of ``estimator`` is
    cross-validated on ``X.select_sites(site)`` with the same splits; the site
    with the best mean test score wins and a clone is refitted on all the
    training conversations at that site. Prediction methods read that site of
    their input.

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

    Attributes
    ----------
    best_site_ : str
        The chosen site.
    best_index_ : int
        Index of ``best_site_`` in ``cv_results_``.
    best_score_ : float
        Mean cross-validated score at ``best_site_``.
    best_estimator_ : estimator object
        Estimator refitted on all the data at ``best_site_`` (``refit=True``).
    cv_results_ : dict of ndarray
        One entry per site, like :class:`~sklearn.model_selection.GridSearchCV`:
        ``site``, ``params`` (``{"site": name}``), ``split{k}_test_score``,
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
    >>> from skafa.selection import SiteSelector
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
    }

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
    ):
        self.estimator = estimator
        self.sites = sites
        self.cv = cv
        self.scoring = scoring
        self.n_jobs = n_jobs
        self.refit = refit
        self.verbose = verbose
        self.error_score = error_score

    # ------------------------------------------------------------------ fitting
    def _split_and_fit_params(self, groups, params):
        if _routing_enabled():
            routed = process_routing(self, "fit", groups=groups, **params)
            return dict(routed.splitter.split), dict(routed.estimator.fit)
        split_params = {} if groups is None else {"groups": groups}
        return split_params, dict(params)

    @_fit_context(
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
        """
        X = check_turn_features(X, self)
        y = check_steps(y, X)
        sites = _resolve_sites(self.sites, X)
        _check_no_fixed_site(self.estimator, type(self).__name__)
        cv = _check_site_cv(self.cv)
        scorer = _get_scorer(self.estimator, self.scoring)
        split_params, fit_params = self._split_and_fit_params(groups, params)

        splits = _grouped_splits(cv, X, y, split_params)
        n_splits = len(splits)
        if self.verbose > 0:
            print(
                f"Fitting {n_splits} folds for each of {len(sites)} sites, totalling "
                f"{n_splits * len(sites)} fits"
            )

        def tasks():
            for site in sites:
                X_site = X.select_sites(site)
                for fold, (train, test) in enumerate(splits):
                    yield delayed(_fit_and_score_site)(
                        clone(self.estimator), X_site, y, train, test, scorer,
                        fit_params, self.error_score, site, fold,
                    )

        out = Parallel(n_jobs=self.n_jobs, verbose=self.verbose)(tasks())
        scores = np.array([o["score"] for o in out], dtype=float).reshape(
            len(sites), n_splits
        )
        fit_times = np.array([o["fit_time"] for o in out]).reshape(len(sites), n_splits)
        score_times = np.array([o["score_time"] for o in out]).reshape(
            len(sites), n_splits
        )
        means = scores.mean(axis=1)
        if np.all(np.isnan(means)):
            raise ValueError(
                "no site has a finite mean cross-validation score (every site failed "
                "in at least one fold); see the FitFailedWarnings above, or set "
                "error_score='raise' to see the first error."
            )

        stds = scores.std(axis=1)
        # NaN means rank last; equal means share the lowest rank ("min").
        filled = np.where(np.isnan(means), np.nanmin(means) - 1.0, means)
        ranks = rankdata(-filled, method="min").astype(np.int32)
        best_index = int(np.flatnonzero(ranks == 1)[0])  # earliest site on ties

        results = {
            "site": np.asarray(sites, dtype=object),
            "params": [{"site": s} for s in sites],
        }
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
        self.best_site_ = sites[best_index]
        self.best_score_ = float(means[best_index])
        if self.refit:
            start = time.perf_counter()
            self.best_estimator_ = clone(self.estimator).fit(
                X.select_sites(self.best_site_), y, **fit_params
            )
            self.refit_time_ = time.perf_counter() - start
        return self

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
        if self.best_site_ not in X.sites:
            raise ValueError(
                f"SiteSelector chose site {self.best_site_!r}, which X does not hold "
                f"(X has {list(X.sites)})."
            )
        return X.select_sites(self.best_site_)

    @property
    def n_features_in_(self):
        """Number of features per turn seen by the best estimator."""
        return self.best_estimator_.n_features_in_

    @available_if(_estimator_has("predict"))
    def predict(self, X):
        """Decisive step of every conversation, read at ``best_site_``.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        steps : ndarray of int, shape (n_conversations,)
        """
        self._check_refitted("predict")
        return self.best_estimator_.predict(self._at_best_site(X))

    @available_if(_estimator_has("predict_agent"))
    def predict_agent(self, X):
        """Speaker of the predicted decisive turn, read at ``best_site_``.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        agents : ndarray of object, shape (n_conversations,)
        """
        self._check_refitted("predict_agent")
        return self.best_estimator_.predict_agent(self._at_best_site(X))

    @available_if(_estimator_has("turn_decision_function"))
    def turn_decision_function(self, X):
        """Per-turn scores at ``best_site_`` (list of 1-D arrays).

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        scores : list of ndarray of shape (n_turns_i,)
        """
        self._check_refitted("turn_decision_function")
        return self.best_estimator_.turn_decision_function(self._at_best_site(X))

    @available_if(_estimator_has("turn_predict_proba"))
    def turn_predict_proba(self, X):
        """Per-turn probabilities at ``best_site_`` (list of 1-D arrays).

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        proba : list of ndarray of shape (n_turns_i,)
        """
        self._check_refitted("turn_predict_proba")
        return self.best_estimator_.turn_predict_proba(self._at_best_site(X))

    def score(self, X, y, sample_weight=None):
        """Score at ``best_site_`` with ``scoring`` (the estimator's score if None).

        Parameters
        ----------
        X : TurnFeatures
        y : array-like of int, shape (n_conversations,)
        sample_weight : array-like of shape (n_conversations,), default=None
            Passed on to the scorer when given (skafa's step scorers take none).

        Returns
        -------
        score : float
        """
        self._check_refitted("score")
        kwargs = {} if sample_weight is None else {"sample_weight": sample_weight}
        return float(self.scorer_(self.best_estimator_, self._at_best_site(X), y, **kwargs))

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
            splitter=_check_site_cv(self.cv),
            method_mapping=MethodMapping().add(caller="fit", callee="split"),
        )
        return router

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # Not a classifier: see skafa.estimators; estimator_type stays None.
        tags.target_tags.required = True
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
    >>> from skafa.selection import site_sweep
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
    sites = _resolve_sites(sites, X_train)
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
