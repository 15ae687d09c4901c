"""Stacking of per-turn scores: combine several decisive-step estimators.

:class:`TurnScoreStacker` takes several conversation-level estimators (each a full
``conversations -> decisive step`` pipeline with ``turn_decision_function``: an
activation probe, a position model, a TF-IDF model, ...) and learns how to weigh
their turn scores with a final conversation-level estimator — by default the
listwise :class:`~skafa.GroupedSoftmaxClassifier`. The final estimator is trained
on *out-of-fold* turn scores only (grouped cross-validation inside the training
data), so a base estimator that fits its training runs well but generalises
badly gets no credit for it.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import time
from numbers import Integral

import numpy as np
from sklearn.base import MetaEstimatorMixin, clone
from sklearn.utils import Bunch, metadata_routing
from sklearn.utils.metadata_routing import (
    MetadataRouter,
    MethodMapping,
    process_routing,
)
from sklearn.utils.parallel import Parallel, delayed
from sklearn.utils.validation import check_is_fitted

from ..base import DecisiveStepMixin
from ..compose import final_step_call
from ..conversation import check_conversations
from ..features import TurnFeatures, check_turn_features
from ..utils.progress import log
from ..utils.sklearn_compat import (
    BaseComposition,
    HasMethods,
    fit_context,
    routing_enabled,
    safe_indexing,
)
from ..utils.validation import check_steps, task_ids_of
from ._selection import check_site_cv, grouped_splits, index_params

__all__ = ["TurnScoreStacker"]


def _check_input(X, owner):
    """``X`` as TurnFeatures or a list of Conversation, with its turn counts."""
    if isinstance(X, TurnFeatures):
        X = check_turn_features(X, owner)
        return X, np.asarray(X.n_turns, dtype=np.int64)
    X = check_conversations(X, type(owner).__name__)
    return X, np.asarray([len(c) for c in X], dtype=np.int64)


def _take(X, indices):
    return X[indices] if isinstance(X, TurnFeatures) else safe_indexing(X, indices)


def _speakers_and_task_ids(X):
    if isinstance(X, TurnFeatures):
        return X.speakers, X.task_ids
    return [s for c in X for s in c.speakers], task_ids_of(X)


def _rows_of(offsets, indices):
    """Global turn rows of the conversations ``indices`` (in that order)."""
    starts = offsets[:-1][indices]
    sizes = np.diff(offsets)[indices]
    return np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + \
        np.arange(sizes.sum())


def _turn_scores(estimator, X, n_turns, name):
    """Concatenated turn scores of a fitted base estimator, checked."""
    try:
        scores = final_step_call(estimator, "turn_decision_function", X)
    except AttributeError as exc:
        raise TypeError(
            f"TurnScoreStacker: base estimator {name!r} has no turn_decision_function "
            f"({exc}); use a skafa estimator or an AttributionPipeline / Pipeline ending "
            "in one."
        ) from None
    scores = list(scores)
    if len(scores) != len(n_turns) or any(
            np.shape(s) != (n,) for s, n in zip(scores, n_turns)):
        raise ValueError(
            f"TurnScoreStacker: base estimator {name!r} did not return one score per "
            "turn of every conversation."
        )
    out = np.concatenate([np.asarray(s, dtype=np.float64) for s in scores])
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        raise ValueError(
            f"TurnScoreStacker: base estimator {name!r} returned a non-finite turn "
            f"score ({out[bad[0]]})."
        )
    return out


def _fit_one(estimator, X, y, params):
    return estimator.fit(X, y, **params)


def _fit_and_score_fold(estimator, X, y, train, test, params, n_turns, name):
    """Fit on the training conversations, return turn scores of the held-out ones."""
    estimator.fit(_take(X, train), y[train], **index_params(params, train, len(y)))
    return _turn_scores(estimator, _take(X, test), n_turns[test], name)


class TurnScoreStacker(DecisiveStepMixin, MetaEstimatorMixin, BaseComposition):
    """Stack the turn scores of several estimators with a final turn-level model.

    Every base estimator maps conversations (or :class:`~skafa.TurnFeatures`) to
    per-turn scores through ``turn_decision_function``. :meth:`fit`

    1. splits the training conversations with ``cv`` (grouped by task);
    2. for every base estimator and split, fits a clone on the training part
       and scores the turns of the held-out part, so that every training turn
       gets one *out-of-fold* score per base estimator;
    3. fits ``final_estimator`` on those scores, one feature column per base
       estimator (a :class:`~skafa.TurnFeatures` with the base names as
       ``feature_names``);
    4. refits every base estimator on all the training conversations.

    Prediction runs the refitted bases and passes their turn scores to the
    final estimator. The final estimator therefore only ever learns from
    scores of conversations the producing model did not see, as in
    :class:`sklearn.ensemble.StackingClassifier`.

    Parameters
    ----------
    estimators : list of (str, estimator)
        Named base estimators. Each must implement ``fit(X, y)`` and
        ``turn_decision_function`` (directly, or as the last step of a
        :class:`~sklearn.pipeline.Pipeline`). An estimator may be ``"drop"``.
        Names must be unique and must not contain ``"__"``.
    final_estimator : estimator, default=None
        Conversation-level estimator fitted on the stacked scores.
        ``None`` means :class:`~skafa.GroupedSoftmaxClassifier()` (standardized
        listwise model: one weight per base estimator).
    cv : int, cross-validation generator or iterable, default=None
        Splits for the out-of-fold scores. ``None`` means ``GroupKFold(5)``;
        an int ``n`` means ``GroupKFold(n)``. The splits must partition the
        conversations (every one held out exactly once), as in
        :func:`sklearn.model_selection.cross_val_predict`.
    n_jobs : int, default=None
        Number of (estimator, fold) fits run in parallel (joblib). ``None``
        means 1. Keep 1 when a base estimator runs a language model.
    verbose : int, default=0
        Verbosity: with a positive value, one line per stage and joblib's
        progress messages.

    Attributes
    ----------
    estimators_ : list of estimator
        The base estimators (not ``"drop"``) refitted on all the training data.
    named_estimators_ : Bunch
        The same, by name.
    final_estimator_ : estimator
        The final estimator fitted on the out-of-fold turn scores.
    feature_names_ : tuple of str
        Names of the stacked score columns (the base names).
    n_splits_ : int
        Number of cross-validation splits.

    See Also
    --------
    skafa.SiteEnsemble : Average (rather than learn to weigh) the scores of one
        probe over several sites.

    Notes
    -----
    **Groups.** The splitter gets the ``groups`` passed to ``fit`` (or routed
    with metadata routing), else the task ids of the conversations when every
    conversation has one, as in :class:`~skafa.SiteSelector`.

    **Scales.** The out-of-fold scores of one base come from several fold
    models, the prediction-time scores from the refitted one; their scales
    differ a little. The default final estimator standardizes its inputs and
    ignores per-conversation offsets, which keeps this harmless for linear
    bases.

    Examples
    --------
    >>> from sklearn.model_selection import GroupKFold
    >>> from skafa import (GroupedSoftmaxClassifier, TurnPositionTransformer,
    ...                    TurnTextTransformer, make_attribution_pipeline)
    >>> from skafa.model_selection import TurnScoreStacker
    >>> from skafa.testing import make_conversations
    >>> convs = make_conversations(40, seed=0)
    >>> y = [c.mistake_step for c in convs]
    >>> stack = TurnScoreStacker(
    ...     [("position", make_attribution_pipeline(TurnPositionTransformer(),
    ...                                             GroupedSoftmaxClassifier())),
    ...      ("tfidf", make_attribution_pipeline(TurnTextTransformer(),
    ...                                          GroupedSoftmaxClassifier()))],
    ...     cv=GroupKFold(4),
    ... ).fit(convs[:30], y[:30])
    >>> stack.feature_names_, stack.final_estimator_.coef_.shape
    (('position', 'tfidf'), (1, 2))
    >>> stack.predict(convs[30:]).shape
    (10,)
    """

    #: like fit, score takes no sample_weight
    _score_takes_sample_weight = False
    __metadata_request__score = {"sample_weight": metadata_routing.UNUSED}

    _parameter_constraints: dict = {
        "estimators": [list],
        "final_estimator": [HasMethods(["fit", "predict"]), None],
        "cv": ["cv_object"],
        "n_jobs": [Integral, None],
        "verbose": ["verbose"],
    }

    def __init__(self, estimators, *, final_estimator=None, cv=None, n_jobs=None,
                 verbose=0):
        self.estimators = estimators
        self.final_estimator = final_estimator
        self.cv = cv
        self.n_jobs = n_jobs
        self.verbose = verbose

    # ------------------------------------------------------------- parameters
    def get_params(self, deep=True):
        """Get parameters, including those of the named estimators (``name__param``).

        Parameters
        ----------
        deep : bool, default=True
            Include the base estimators and their parameters.

        Returns
        -------
        params : dict
        """
        return self._get_params("estimators", deep=deep)

    def set_params(self, **params):
        """Set parameters; ``name=estimator`` replaces one, ``name__param=v`` sets one.

        Parameters
        ----------
        **params : dict
            Parameters of this stacker or of its base estimators.

        Returns
        -------
        self : TurnScoreStacker
        """
        self._set_params("estimators", **params)
        return self

    @property
    def named_estimators(self):
        """The (unfitted) base estimators given as parameters, by name."""
        return Bunch(**dict(self.estimators))

    def _active_estimators(self):
        items = self.estimators
        if not items:
            raise ValueError("TurnScoreStacker: estimators must name at least one estimator.")
        for k, item in enumerate(items):
            if not (isinstance(item, (tuple, list)) and len(item) == 2
                    and isinstance(item[0], str)):
                raise ValueError(
                    f"TurnScoreStacker: estimators[{k}] must be a (name, estimator) pair, "
                    f"got {item!r}."
                )
        self._validate_names([name for name, _ in items])
        active = []
        for name, est in items:
            if isinstance(est, str):
                if est != "drop":
                    raise ValueError(
                        f"TurnScoreStacker: estimator {name!r} is the string {est!r}; "
                        "only 'drop' is supported."
                    )
                continue
            if not hasattr(est, "fit"):
                raise TypeError(
                    f"TurnScoreStacker: estimator {name!r} ({type(est).__name__}) does "
                    "not implement fit."
                )
            active.append((name, est))
        if not active:
            raise ValueError("TurnScoreStacker: every estimator is 'drop'; nothing to stack.")
        return active

    def _final(self):
        if self.final_estimator is None:
            from ..probes import GroupedSoftmaxClassifier

            return GroupedSoftmaxClassifier()
        return clone(self.final_estimator)

    # ---------------------------------------------------------------- fitting
    def _routed_params(self, groups, names):
        if routing_enabled():
            routed = process_routing(self, "fit", groups=groups)
            return (dict(routed.splitter.split),
                    {name: dict(routed[name].fit) for name in names})
        split_params = {} if groups is None else {"groups": groups}
        return split_params, {name: {} for name in names}

    def _stack(self, X, n_turns, columns):
        offsets = np.concatenate([[0], np.cumsum(n_turns)])
        speakers, task_ids = _speakers_and_task_ids(X)
        return TurnFeatures(np.column_stack(columns), offsets,
                            feature_names=self.feature_names_, speakers=speakers,
                            task_ids=task_ids)

    @fit_context(
        # the base and final estimators are validated when they are fitted
        prefer_skip_nested_validation=False
    )
    def fit(self, X, y, groups=None):
        """Fit the final estimator on out-of-fold scores, then refit the bases.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
            Training conversations, as the base estimators take them.
        y : array-like of int, shape (n_conversations,)
            Decisive step of each conversation.
        groups : array-like of shape (n_conversations,), default=None
            Group labels (task ids) for the splitter; ``None`` falls back to the
            conversations' task ids (see Notes).

        Returns
        -------
        self : object
            Fitted stacker.
        """
        X, n_turns = _check_input(X, self)
        y = check_steps(y, X)
        active = self._active_estimators()
        names = [name for name, _ in active]
        cv = check_site_cv(self.cv)
        split_params, fit_params = self._routed_params(groups, names)
        _, task_ids = _speakers_and_task_ids(X)
        splits = grouped_splits(cv, X, y, split_params, task_ids)
        held_out = np.zeros(len(y), dtype=np.int64)
        for _, test in splits:
            np.add.at(held_out, np.asarray(test), 1)
        if np.any(held_out != 1):
            bad = int(np.flatnonzero(held_out != 1)[0])
            raise ValueError(
                f"TurnScoreStacker: cv must partition the conversations (each held out "
                f"exactly once) but conversation {bad} is held out {held_out[bad]} "
                f"times by {cv!r}; use a KFold-like splitter such as GroupKFold."
            )
        offsets = np.concatenate([[0], np.cumsum(n_turns)])
        if self.verbose:
            log(self, 1, f"{len(active)} estimators x {len(splits)} folds "
                         f"+ {len(active)} refits")

        start = time.perf_counter()
        jobs = [
            delayed(_fit_and_score_fold)(clone(est), X, y, train, test, fit_params[name],
                                         n_turns, name)
            for name, est in active for train, test in splits
        ] + [delayed(_fit_one)(clone(est), X, y, fit_params[name]) for name, est in active]
        out = Parallel(n_jobs=self.n_jobs, verbose=self.verbose)(jobs)
        n_oof = len(active) * len(splits)
        columns = []
        for k, (name, _) in enumerate(active):
            column = np.empty(offsets[-1], dtype=np.float64)
            for f, (_, test) in enumerate(splits):
                column[_rows_of(offsets, np.asarray(test))] = out[k * len(splits) + f]
            columns.append(column)

        self.feature_names_ = tuple(names)
        self.n_splits_ = len(splits)
        self.estimators_ = list(out[n_oof:])
        self.named_estimators_ = Bunch(**dict(zip(names, self.estimators_)))
        self.final_estimator_ = self._final().fit(self._stack(X, n_turns, columns), y)
        if self.verbose:
            log(self, 1, f"fitted in {time.perf_counter() - start:.1f}s")
        return self

    # ------------------------------------------------------------- prediction
    def _stacked(self, X):
        check_is_fitted(self)
        X, n_turns = _check_input(X, self)
        columns = [_turn_scores(est, X, n_turns, name)
                   for name, est in zip(self.feature_names_, self.estimators_)]
        return self._stack(X, n_turns, columns)

    def _decisive_delegate(self, X, method):
        # DecisiveStepMixin hook: predict, predict_agent and turn_* are the final
        # estimator's, on the stacked scores
        Z = self._stacked(X)  # checks that the stacker is fitted first
        return self.final_estimator_, Z

    def _score(self, X, y, sample_weight):
        """Final estimator's score (step accuracy for skafa estimators); no sample_weight."""
        check_is_fitted(self)
        return self.final_estimator_.score(self._stacked(X), y)

    # ---------------------------------------------------------------- routing
    def get_metadata_routing(self):
        """Get metadata routing of this object.

        ``fit`` routes to the splitter's ``split`` (``groups``) and to every base
        estimator's ``fit``.

        Returns
        -------
        routing : MetadataRouter
            A :class:`~sklearn.utils.metadata_routing.MetadataRouter` encapsulating
            routing information.
        """
        router = MetadataRouter(owner=self)
        for name, est in self.estimators:
            if not isinstance(est, str):
                router.add(**{name: est},
                           method_mapping=MethodMapping().add(caller="fit", callee="fit"))
        router.add(splitter=check_site_cv(self.cv),
                   method_mapping=MethodMapping().add(caller="fit", callee="split"))
        return router
