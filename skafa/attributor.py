"""One-object failure attribution: :class:`FailureAttributor`.

A small facade over the pieces skafa is made of, for users who want an answer
rather than a pipeline::

    AttributionPipeline([
        ("acts", TurnActivationTransformer(model, sites=sites, prompt=prompt, ...)),
        ("select", SiteSelector(GroupedArgmaxLogisticClassifier(C=C), cv=cv)),
    ])

It adds what a user otherwise writes by hand: labels and groups read from the
conversations, an :meth:`~FailureAttributor.evaluate` with bootstrap confidence
intervals, a per-conversation :meth:`~FailureAttributor.attribute` that returns
a readable :class:`Attribution`, and :meth:`~FailureAttributor.save` /
:meth:`~FailureAttributor.load` without pickle (:mod:`skafa.persistence`).
Everything it computes comes from the fitted :attr:`~FailureAttributor.pipeline_`;
predicting extracts only the sites its selector reads
(:attr:`~FailureAttributor.predict_sites_`), with the same results.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import numpy as np
from sklearn.base import BaseEstimator, clone
from sklearn.utils import metadata_routing
from sklearn.utils.validation import check_is_fitted

from .base import DecisiveStepMixin
from .compose import AttributionPipeline, final_step_input
from .conversation import Conversation, check_conversations
from .features import TurnFeatures
from .metrics import (
    AGENT_RULES,
    BootstrapResult,
    agent_accuracy,
    bootstrap_ci,
    mean_absolute_step_shift,
    step_accuracy,
    within_k_accuracy,
)
from .persistence import PersistenceMixin
from .utils.sklearn_compat import HasMethods, StrOptions, fit_context
from .utils.validation import describe, group_labels, labels_from_conversations

__all__ = ["FailureAttributor", "Attribution", "TurnRank", "AttributionReport"]


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


def _preview(text, width=80):
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass(frozen=True)
class TurnRank:
    """One of the highest-scoring turns of an :class:`Attribution`.

    Attributes
    ----------
    step : int
        Turn index (0-based, like ``Conversation.mistake_step``).
    agent : str
        Speaker of the turn.
    score : float
        The probe's score (decision function) of the turn.
    probability : float
        Softmax of the scores over the conversation's turns.
    preview : str
        The turn's content, whitespace-collapsed and cut to 80 characters.
    """

    step: int
    agent: str
    score: float
    probability: float
    preview: str

    def to_dict(self) -> dict:
        """Return the fields as a JSON-serialisable dict."""
        return {"step": self.step, "agent": self.agent, "score": self.score,
                "probability": self.probability, "preview": self.preview}


@dataclass(frozen=True, repr=False, eq=False)
class Attribution:
    """Which turn of one conversation the attributor blames, and how surely.

    Attributes
    ----------
    step : int
        Predicted decisive turn (highest score; earliest on ties).
    agent : str
        Speaker of that turn.
    turn_scores : ndarray of shape (n_turns,)
        The probe's score of every turn.
    turn_probabilities : ndarray of shape (n_turns,)
        Softmax of ``turn_scores`` (sums to 1).
    site : str
        Activation site the probe reads.
    top_k : tuple of TurnRank
        The highest-scoring turns, best first.
    speakers : tuple of str
        Speaker of every turn.
    true_step, true_agent : int or str or None
        The conversation's labels, when it has them.
    task_id, record_id : str or None
        The conversation's identifiers.
    conversation : Conversation or None
        The conversation attributed (for :meth:`to_html`); not in :meth:`to_dict`.
    shifted : bool or None
        Whether the run looks unlike the training runs
        (:class:`~skafa.domain.ShiftDetector`); None when the attributor has no
        shift detector.
    shift_score : float or None
        The detector's score of the run (its thresholds: the central 95% of
        held-out training runs' scores).
    """

    step: int
    agent: str
    turn_scores: np.ndarray
    turn_probabilities: np.ndarray
    site: str
    top_k: tuple = field(default_factory=tuple)
    speakers: tuple = field(default_factory=tuple)
    true_step: int | None = None
    true_agent: str | None = None
    task_id: str | None = None
    record_id: str | None = None
    conversation: Conversation | None = None
    shifted: bool | None = None
    shift_score: float | None = None

    @property
    def n_turns(self) -> int:
        """Number of turns of the conversation."""
        return int(self.turn_scores.shape[0])

    @property
    def probability(self) -> float:
        """Probability of the predicted step."""
        return float(self.turn_probabilities[self.step])

    def to_dict(self) -> dict:
        """Return a JSON-serialisable dict (arrays as lists)."""
        return {
            "step": self.step,
            "agent": self.agent,
            "probability": self.probability,
            "site": self.site,
            "turn_scores": [float(v) for v in self.turn_scores],
            "turn_probabilities": [float(v) for v in self.turn_probabilities],
            "top_k": [r.to_dict() for r in self.top_k],
            "speakers": list(self.speakers),
            "true_step": self.true_step,
            "true_agent": self.true_agent,
            "task_id": self.task_id,
            "record_id": self.record_id,
            "shifted": self.shifted,
            "shift_score": self.shift_score,
        }

    def to_html(self, path=None, *, conversation=None, title=None):
        """A self-contained HTML report (see :func:`skafa.report.attribution_html`).

        Parameters
        ----------
        path : str or path-like, default=None
            File to write; ``None`` returns the page as a string.
        conversation : Conversation, default=None
            For the transcript; defaults to :attr:`conversation`.
        title : str, default=None

        Returns
        -------
        page_or_path : str or pathlib.Path
        """
        from .report import attribution_html, save_html

        if path is None:
            return attribution_html(self, conversation, title=title)
        return save_html(self, path, conversation, title=title)

    def to_png(self, path):
        """Save a bar chart of the per-turn scores (see :func:`skafa.report.plot_turn_scores`).

        Returns
        -------
        path : pathlib.Path
        """
        import pathlib

        from .report import close_figure, plot_turn_scores

        close_figure(plot_turn_scores(self, path))
        return pathlib.Path(path)

    def __repr__(self):
        head = (f"Attribution(step={self.step}, agent={self.agent!r}, "
                f"p={self.probability:.3f}, site={self.site!r}, n_turns={self.n_turns}")
        if self.record_id is not None:
            head += f", record_id={self.record_id!r}"
        if self.true_step is not None:
            head += f"; true step={self.true_step}, agent={self.true_agent!r}"
        lines = [head + ")"]
        if self.shifted:
            lines.append("  warning: this run looks unlike the training runs (shift score "
                         f"{self.shift_score:.3g}); the blame may be near chance")
        if self.top_k:
            lines.append(f"  top {len(self.top_k)} turns:")
            width = max(len(r.agent) for r in self.top_k)
            for r in self.top_k:
                mark = "*" if self.true_step is not None and r.step == self.true_step else " "
                lines.append(
                    f"  {mark}{r.step:>3}  {r.agent:<{width}}  score {r.score:+8.3f}  "
                    f"p {r.probability:.3f}  {r.preview!r}"
                )
        return "\n".join(lines)


@dataclass(frozen=True, repr=False, eq=False)
class AttributionReport:
    """Held-out quality of a :class:`FailureAttributor` (from ``evaluate``).

    Every metric is a :class:`~skafa.metrics.BootstrapResult`
    ``(estimate, low, high, n, confidence)``.

    Attributes
    ----------
    step_accuracy : BootstrapResult
        Fraction of conversations whose decisive step is found exactly.
    agent_accuracy : dict of str -> BootstrapResult
        Fraction whose responsible agent is found, under each matching rule of
        :func:`skafa.metrics.agent_accuracy` (``"exact"``, ``"normalized"``,
        ``"substring"``), side by side.
    within_1 : BootstrapResult
        Fraction whose predicted step is at most one turn off.
    mean_absolute_shift : BootstrapResult
        Mean ``|predicted step - true step|`` (lower is better).
    n : int
        Number of conversations.
    site : str
        Site of the probe.
    cluster_bootstrap : bool
        True when whole tasks were resampled (every conversation had a task id).
    steps, agents : ndarray
        The predictions.
    """

    step_accuracy: BootstrapResult
    agent_accuracy: dict
    within_1: BootstrapResult
    mean_absolute_shift: BootstrapResult
    n: int
    site: str
    cluster_bootstrap: bool
    steps: np.ndarray
    agents: np.ndarray

    def to_dict(self) -> dict:
        """Return a JSON-serialisable dict (predictions as lists)."""

        def res(r):
            return r._asdict()

        return {
            "step_accuracy": res(self.step_accuracy),
            "agent_accuracy": {k: res(v) for k, v in self.agent_accuracy.items()},
            "within_1": res(self.within_1),
            "mean_absolute_shift": res(self.mean_absolute_shift),
            "n": self.n,
            "site": self.site,
            "cluster_bootstrap": self.cluster_bootstrap,
            "steps": [int(s) for s in self.steps],
            "agents": [str(a) for a in self.agents],
        }

    def __repr__(self):
        conf = int(round(self.step_accuracy.confidence * 100))

        def fmt(r, digits=3):
            return f"{r.estimate:.{digits}f} [{r.low:.{digits}f}, {r.high:.{digits}f}]"

        unit = "task-clustered" if self.cluster_bootstrap else "conversation"
        lines = [
            f"AttributionReport(n={self.n}, site={self.site!r}, {conf}% {unit} bootstrap CIs)",
            f"  step accuracy               {fmt(self.step_accuracy)}",
        ]
        for rule, r in self.agent_accuracy.items():
            lines.append(f"  {'agent accuracy (' + rule + ')':<27} {fmt(r)}")
        lines.append(f"  within-1 step accuracy      {fmt(self.within_1)}")
        lines.append(f"  mean absolute shift         {fmt(self.mean_absolute_shift, 2)}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Labels from conversations
# ---------------------------------------------------------------------------


def _groups_from(convs):
    """Task ids as splitter groups when every conversation has one, else None.

    Through :func:`~skafa.utils.validation.group_labels`, so task ids ``1`` and
    ``"1"`` stay two groups and a splitter never has to sort mixed types.
    """
    ids = [c.task_id for c in convs]
    if any(t is None for t in ids):
        return None
    return group_labels(ids)


def _true_agents(convs, y, defaulted):
    """Annotated agent where ``y`` is the annotation, else the speaker of turn ``y``."""
    out = []
    for conv, step in zip(convs, y):
        if conv.mistake_agent is not None and (defaulted or conv.mistake_step == step):
            out.append(conv.mistake_agent)
        else:
            out.append(conv.turns[int(step)].speaker)
    return out


# ---------------------------------------------------------------------------
# The facade
# ---------------------------------------------------------------------------


def _plain(value):
    """Tuples as lists (a loaded tuple of sites may come back as either), else as is."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _sites_read_by(estimator):
    """The sites a fitted final step reads when it predicts, or None when unknown.

    A :class:`~skafa.model_selection.SiteSelector` reads its ``best_sites_``, a
    :class:`~skafa.model_selection.SiteEnsemble` its ``sites_``, a skafa probe its
    ``site_``; each selects them from the features by name, so features holding
    only those sites give the same predictions. Any other estimator: None.
    """
    from .model_selection import SiteEnsemble, SiteSelector
    from .probes import (
        GroupedArgmaxClassifier,
        GroupedArgmaxLogisticClassifier,
        GroupedSoftmaxClassifier,
    )

    state = vars(estimator)
    if isinstance(estimator, SiteSelector):
        if "best_estimator_" not in state:  # refit=False: it cannot predict at all
            return None
        sites = state.get("best_sites_") or (state.get("best_site_"),)
    elif isinstance(estimator, SiteEnsemble):
        sites = state.get("sites_")
    elif isinstance(estimator, (GroupedArgmaxClassifier, GroupedArgmaxLogisticClassifier,
                                GroupedSoftmaxClassifier)):
        sites = (state.get("site_"),)
    else:
        return None
    if not sites or any(not isinstance(s, str) for s in sites):
        return None
    return tuple(sites)


def _predict_sites(pipeline, detector):
    """The sites predicting with ``pipeline`` (and ``detector``) reads, in the
    extractor's order; None when the extractor is not a TurnActivationTransformer
    or what the pieces read is not known (then predicting extracts every site)."""
    from .domain import CoralAdapter
    from .llm import TurnActivationTransformer

    steps = getattr(pipeline, "steps", None)
    if not isinstance(steps, list) or len(steps) < 2:
        return None
    # steps between extractor and selector must work on any subset of the sites
    if not all(isinstance(step, CoralAdapter) for _, step in steps[1:-1]):
        return None
    extractor, final = steps[0][1], steps[-1][1]
    produced = vars(extractor).get("sites_") if isinstance(
        extractor, TurnActivationTransformer) else None
    read = _sites_read_by(final)
    if produced is None or read is None:
        return None
    if detector is not None:  # the shift check reads the features too
        extra = getattr(detector, "sites_", None)
        if extra is None:
            return None
        read = read + tuple(str(s) for s in extra)
    produced = tuple(str(s) for s in produced)
    if not set(read) <= set(produced):
        return None
    return tuple(s for s in produced if s in set(read))


def _warn_if_not_recommended(given, recommended):
    """Warn when an extractor passed with the recommended selector reads otherwise.

    ``FailureAttributor(TurnActivationTransformer(model, prompt=...))`` keeps the
    recommended selector but the given extractor's ``read`` and ``sites``; a user
    who only meant to change the prompt would leave the recommended
    configuration without knowing it.
    """
    if type(given) is not type(recommended):
        return  # another kind of features (e.g. a union): a deliberate choice
    theirs, ours = given.get_params(deep=False), recommended.get_params(deep=False)
    differ = [k for k in ("read", "sites") if theirs.get(k) != ours.get(k)]
    if differ:
        detail = ", ".join(f"{k}={theirs.get(k)!r} (recommended {ours.get(k)!r})"
                           for k in differ)
        warnings.warn(
            f"FailureAttributor: the extractor passed in has {detail}, so this is "
            "not the recommended configuration although the recommended selector is "
            "used. To change only the prompt, cache, dtype or device, build both "
            "pieces with FailureAttributor(*make_configuration(model=model, "
            "prompt=..., cache_dir=...)).",
            UserWarning, stacklevel=4,
        )


class FailureAttributor(DecisiveStepMixin, PersistenceMixin, BaseEstimator):
    """Find the decisive step and agent of failed multi-agent runs, in one object.

    A thin composite of two pieces, each configured through its own parameters
    (nothing is re-listed here): an ``extractor`` that turns conversations into
    per-turn features — by default a
    :class:`~skafa.llm.TurnActivationTransformer`, which reads a language
    model's hidden states at every turn — and a ``selector`` fitted on those
    features — by default a :class:`~skafa.model_selection.SiteSelector` that picks the
    activation sites and C by grouped cross-validation on the training data and
    fits the probe there. Both defaults are the recommended configuration of the
    pre-registered comparison (:mod:`skafa.configurations`). Internally it is
    exactly::

        AttributionPipeline([("acts", clone(extractor)), ("select", clone(selector))])

    fitted, as :attr:`pipeline_`, plus attribution-specific methods
    (:meth:`attribute`, :meth:`evaluate`, :meth:`report`, :meth:`save`).
    Nested parameters work as usual: ``extractor__read``, ``selector__estimator__C``.

    Parameters
    ----------
    extractor : str or transformer, default="smollm2"
        A model name or path: shorthand for the extractor of the recommended
        configuration, :data:`skafa.configurations.RECOMMENDED` (the one the
        pre-registered comparison's rule picked; today
        ``TurnActivationTransformer(extractor, read="echo", sites="stride:3")``,
        see :func:`skafa.configurations.make_configuration`), or the reader's own
        when the rule gave it one
        (:func:`skafa.configurations.recommended_configuration`:
        ``"qwen2.5-coder-1.5b"`` gets ``echo: logistic/top3/acts``). Its default
        ``prompt`` refuses conversations that do not fit the model's context
        (with ``read="echo"`` the transcript is given twice); pass an
        extractor with a shortening ``prompt`` to shorten them visibly. Or any
        transformer mapping a list of :class:`~skafa.Conversation` to
        :class:`~skafa.TurnFeatures` (a ``TurnActivationTransformer`` with its
        ``read``, ``sites``, ``prompt``, ``cache_dir``, ``device``... or a
        :class:`~skafa.TurnFeatureUnion` with position features).
        **To change one knob and keep the recommended configuration** (prompt
        budget, dtype, cache, device), build both pieces with
        ``FailureAttributor(*make_configuration(model=model, prompt=...,
        cache_dir=...))``; an extractor passed with ``selector=None`` whose
        ``read`` or ``sites`` differ from the recommended ones gets a warning.
    shift_detector : "auto", ShiftDetector or None, default="auto"
        Fitted on the training features at the probe's sites
        (:class:`~skafa.domain.ShiftDetector`, threshold calibrated on held-out
        training runs); ``predict``, ``attribute`` and ``evaluate`` then warn with
        :class:`~skafa.DistributionShiftWarning` when runs look unlike the
        training runs, and :class:`Attribution` carries ``shifted``. ``"auto"``:
        ``ShiftDetector()`` (with fewer task groups than its folds, as many folds
        as groups; with fewer than two groups, or sparse features, no detector).
        None: no detector.
    selector : estimator, default=None
        The estimator fitted on the features: anything with ``fit(X, y,
        groups=)``, ``predict``, ``turn_decision_function`` and
        ``turn_predict_proba`` on TurnFeatures (a ``SiteSelector``, a probe, a
        ``SiteEnsemble``). ``None`` means the recommended configuration's
        selector for the extractor's model (for most readers
        ``SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(5), n_sites=3,
        param_grid={"C": [0.01, 0.1, 1.0]})``: C and the three sites averaged
        chosen jointly on the training data).

    Attributes
    ----------
    pipeline_ : AttributionPipeline
        The fitted ``acts -> select`` pipeline.
    best_site_ : str
        Site chosen by cross-validation on the training conversations (when the
        selector chooses one; with several averaged sites, the best-ranked).
    best_sites_ : tuple of str
        All the sites the selector kept (``(best_site_,)`` for one site; the
        averaged sites with ``n_sites > 1``). Attributions and reports name them
        joined by ``"+"``.
    best_index_ : int
        Row of the chosen (candidate, site) in ``cv_results_`` (idem).
    best_params_ : dict
        The selector's chosen ``param_grid`` candidate (idem).
    best_score_ : float
        Its mean cross-validated step accuracy (idem).
    cv_results_ : dict of ndarray
        Per-site cross-validation results (idem; see :class:`~skafa.SiteSelector`).
    n_conversations_fit_ : int
        Number of training conversations.
    shift_detector_ : ShiftDetector or None
        Fitted on the training features at ``best_sites_`` (None: none).
    predict_sites_ : tuple of str or None
        The sites ``predict``, ``attribute``, ``evaluate`` (and the other
        predicting methods) extract, in the extractor's order: those the selector
        reads (``best_sites_``) and those the shift detector reads. The forward
        pass stops after the deepest of them unless it is ``resid_final``, and
        cached activations with more sites serve them; the predictions are those
        of :attr:`pipeline_`, whose extractor still reads every site. None when
        the extractor is not a :class:`~skafa.llm.TurnActivationTransformer` or
        the selector is of a kind whose sites are not known (every site is then
        extracted).

    See Also
    --------
    skafa.llm.TurnActivationTransformer, skafa.model_selection.SiteSelector,
    skafa.probes.GroupedArgmaxLogisticClassifier : The pieces.

    Notes
    -----
    Not a scikit-learn classifier (the "class" is a turn position): it sets no
    ``classes_`` and its ``estimator_type`` tag is ``None``. It clones and
    cross-validates like any estimator (``cross_val_predict(FailureAttributor(...),
    conversations, y, groups=task_ids, cv=GroupKFold(5))``); activations are
    cached, so the language model runs once per conversation.

    Examples
    --------
    >>> from skafa import FailureAttributor, TurnActivationTransformer
    >>> fa = FailureAttributor(TurnActivationTransformer(  # doctest: +SKIP
    ...     "smollm2", sites=["resid_pre.9", "resid_final"], cache_dir="~/.cache/skafa"))
    >>> fa.fit(train_conversations)                                # doctest: +SKIP
    >>> fa.evaluate(test_conversations)                            # doctest: +SKIP
    >>> fa.attribute(test_conversations[0])                        # doctest: +SKIP
    """

    _parameter_constraints: dict = {
        "extractor": [str, HasMethods(["fit", "transform"])],
        "selector": [HasMethods(["fit", "predict", "turn_decision_function"]), None],
        "shift_detector": [StrOptions({"auto"}), HasMethods(["fit", "predict"]), None],
    }

    def __init__(self, extractor="smollm2", selector=None, *, shift_detector="auto"):
        self.extractor = extractor
        self.selector = selector
        self.shift_detector = shift_detector

    #: ``fit`` and ``score`` read the conversations' labels when ``y`` is None.
    _decisive_requires_y = False
    _score_takes_sample_weight = False
    __metadata_request__score = {"sample_weight": metadata_routing.UNUSED}

    # ------------------------------------------------------------------ build
    def _make_pipeline(self):
        from .configurations import make_configuration

        # an extractor object's own model picks the recommended selector (a reader may
        # have a recommendation of its own, skafa.configurations.RECOMMENDED_FOR_READER)
        model = (self.extractor if isinstance(self.extractor, str)
                 else getattr(self.extractor, "model", None))
        model = model if isinstance(model, str) else "smollm2"
        extractor, selector = make_configuration(None, model)
        if not isinstance(self.extractor, str):
            if self.selector is None:
                _warn_if_not_recommended(self.extractor, extractor)
            extractor = clone(self.extractor)
        if self.selector is not None:
            selector = clone(self.selector)
        return AttributionPipeline([("acts", extractor), ("select", selector)])

    # -------------------------------------------------------------------- fit
    @fit_context(
        # the pieces are validated when they are fitted
        prefer_skip_nested_validation=False
    )
    def fit(self, X, y=None, groups=None, *, target_runs=None):
        """Extract the features, then fit the selector on them (site by grouped CV).

        Parameters
        ----------
        X : list of Conversation
            Training conversations.
        y : array-like of int, shape (n_conversations,), default=None
            Decisive step of each conversation; ``None`` reads every
            conversation's ``mistake_step`` (an error lists unlabelled ones).
        groups : array-like of shape (n_conversations,), default=None
            Groups of the selector's splitter; ``None`` uses the task ids when
            every conversation has one.
        target_runs : list of Conversation, default=None
            Unlabelled runs of the framework the attributor will be asked about,
            when it is not the training runs' (``docs/your-own-framework.md``).
            Then a :class:`~skafa.domain.CoralAdapter` (the pre-registered rule's
            winner) is fitted between the extractor and the selector: the
            selector is fitted on the training features re-coloured with the
            target runs' covariance, and runs to attribute are standardised with
            the target runs' statistics. Measured on Who&When, it lifts a probe
            from below chance to chance, not beyond: label some of your runs.

        Returns
        -------
        self : FailureAttributor
            Fitted attributor.
        """
        convs = check_conversations(X, "FailureAttributor")
        if y is None:
            y = labels_from_conversations(convs, "FailureAttributor.fit")
        if groups is None:
            groups = _groups_from(convs)
        pipeline = self._make_pipeline()
        # Same as pipeline.fit(convs, y, select__groups=groups), but also valid
        # when scikit-learn's metadata routing is enabled.
        Xt = pipeline[:-1].fit_transform(convs, y)
        if target_runs is not None:
            from .domain import CoralAdapter

            targets = check_conversations(target_runs, "FailureAttributor.fit(target_runs)")
            adapter = CoralAdapter()
            Xt = adapter.fit_transform(Xt, target_X=pipeline[:-1].transform(targets))
            pipeline = AttributionPipeline([pipeline.steps[0], ("adapt", adapter),
                                            pipeline.steps[-1]])
        pipeline[-1].fit(Xt, y, groups=groups)
        selector = pipeline[-1]
        self.pipeline_ = pipeline
        for name in ("best_site_", "best_sites_", "best_index_", "best_params_",
                     "best_score_", "cv_results_"):
            if hasattr(selector, name):
                setattr(self, name, getattr(selector, name))
        self.n_conversations_fit_ = len(convs)
        self.shift_detector_ = self._fit_shift_detector(Xt, groups)
        # predicting extracts only these sites (and stops the forward pass after
        # the deepest); pipeline_ keeps the extractor of every site
        self.predict_sites_ = _predict_sites(pipeline, self.shift_detector_)
        return self

    def _fit_shift_detector(self, Xt, groups):
        """The shift detector on the training features at the probe's sites, or None."""
        from .domain import ShiftDetector

        if self.shift_detector is None:
            return None
        dense = isinstance(Xt, TurnFeatures) and not Xt.is_sparse
        if self.shift_detector == "auto":
            if not dense:
                return None
            detector = ShiftDetector()
            n_groups = (len(set(map(str, groups))) if groups is not None
                        else Xt.n_conversations)
            if n_groups < 2:
                return None
            detector.set_params(cv=min(detector.cv, n_groups))
        else:
            detector = clone(self.shift_detector)
        # the sites the selector reads (best_sites_, a SiteEnsemble's sites_, a probe's site_)
        sites = getattr(self, "best_sites_", None) or _sites_read_by(self.pipeline_[-1])
        if detector.get_params().get("sites", "absent") is None and sites:
            detector.set_params(sites=list(sites))
        return detector.fit(Xt, groups=groups)

    def _check_shift(self, Xt, convs, *, stacklevel=4):
        """Shift scores and flags of ``Xt`` (None, None without a detector); warns."""
        detector = getattr(self, "shift_detector_", None)
        if detector is None:
            return None, None
        names = [describe(convs, i) for i in range(len(convs))]
        flagged, scores = detector.check(Xt, names=names, stacklevel=stacklevel,
                                         return_scores=True)
        return scores, flagged

    #: The selector's results that :meth:`fit` copies onto the attributor.
    _SELECTOR_RESULTS = ("best_site_", "best_sites_", "best_index_", "best_params_",
                         "best_score_")

    def _check_fitted_consistency(self):
        """Check that a loaded attributor's pieces agree (see :mod:`skafa.persistence`).

        The results copied from the selector (``best_site_``, ``best_sites_``, ...)
        must be the selector's own, and every site the selector reads or compares
        must be one of the feature blocks the extractor produces (its ``sites_``),
        so a file edited to read elsewhere is refused at load instead of failing
        at the first prediction.

        Raises
        ------
        ValueError
            Naming the attribute, the place and both values.
        """
        from .llm import TurnActivationTransformer

        pipeline = vars(self).get("pipeline_")
        if pipeline is None:
            return
        steps = getattr(pipeline, "steps", None)
        if not isinstance(steps, list) or len(steps) < 2:
            raise ValueError(f"pipeline_ must hold the extractor and the selector, got "
                             f"{type(pipeline).__name__} with steps {steps!r:.80}")
        extractor, selector = steps[0][1], steps[-1][1]
        own, theirs = vars(self), vars(selector)
        for name in self._SELECTOR_RESULTS:
            if name in own and name in theirs:
                mine, its = own[name], theirs[name]
                same = (mine is its
                        or (np.array_equal(mine, its, equal_nan=True)
                            if isinstance(mine, np.ndarray) and isinstance(its, np.ndarray)
                            else _plain(mine) == _plain(its))
                        or (isinstance(mine, float) and isinstance(its, float)
                            and np.isnan(mine) and np.isnan(its)))
                if not same:
                    raise ValueError(
                        f"{name} is {mine!r:.80} but the selector's (pipeline_.steps[-1]) "
                        f"is {its!r:.80}; they are one result, copied at fit")
        produced = vars(extractor).get("sites_")
        if not isinstance(extractor, TurnActivationTransformer) or produced is None:
            return
        produced = [str(s) for s in produced]
        for name in ("best_sites_", "best_site_", "site_", "sites_"):
            if name not in theirs:
                continue
            value = theirs[name]
            read = [value] if isinstance(value, str) else list(value)
            missing = [s for s in read if s not in produced]
            if missing:
                raise ValueError(
                    f"the selector's {name} ({type(selector).__name__}) names "
                    f"{', '.join(repr(s) for s in missing[:5])}, but the extractor "
                    f"produces only the sites {', '.join(produced)} (its sites_)")
        chosen = own.get("predict_sites_")
        if chosen is not None:
            chosen = [str(s) for s in chosen]
            missing = [s for s in chosen if s not in produced]
            needed = _sites_read_by(selector) or ()
            lacking = [s for s in needed if s not in chosen]
            if missing or lacking:
                raise ValueError(
                    f"predict_sites_ is {chosen!r:.200}, but "
                    + (f"the extractor produces only the sites {', '.join(produced)} "
                       "(its sites_)" if missing else
                       f"the selector ({type(selector).__name__}) reads "
                       f"{', '.join(repr(s) for s in lacking[:5])}"))

    def _site_label(self):
        """The site(s) predictions are read at, for reports: ``"a"`` or ``"a+b+c"``."""
        sites = getattr(self, "best_sites_", None)
        if sites and len(sites) > 1:
            return "+".join(sites)
        return getattr(self, "best_site_", None)

    # ---------------------------------------------------------------- predict
    def _convs(self, X):
        check_is_fitted(self)
        return check_conversations(X, "FailureAttributor")

    def _final_input(self, convs):
        """The selector and its features of ``convs``, extracted at the sites it reads.

        What ``final_step_input(self.pipeline_, convs)`` gives, but the
        extractor reads only :attr:`predict_sites_` (a view of ``pipeline_``'s
        extractor: :meth:`TurnActivationTransformer._restricted`), so its forward
        passes stop after the deepest of them; the selector picks its sites by
        name, so the predictions are the same. An attributor saved before
        ``predict_sites_`` existed gets them from its pieces here (nothing fitted
        is set).
        """
        pipeline = self.pipeline_
        if "predict_sites_" in vars(self):
            sites = self.predict_sites_
        else:  # saved by an older skafa
            sites = _predict_sites(pipeline, getattr(self, "shift_detector_", None))
        if not sites:
            return final_step_input(pipeline, convs)
        Xt = pipeline.steps[0][1]._restricted(sites).transform(convs)
        for _, step in pipeline.steps[1:-1]:  # an adapter (CoralAdapter: any sites)
            Xt = step.transform(Xt)
        return pipeline.steps[-1][1], Xt

    # ------------------------------------------- DecisiveStepMixin hooks
    # predict, predict_agent, turn_decision_function and turn_predict_proba are
    # the fitted pipeline's, on the validated conversations.
    def _decisive_delegate(self, X, method):
        convs = self._convs(X)  # checks that it is fitted first
        final, Xt = self._final_input(convs)
        self._check_shift(Xt, convs, stacklevel=5)  # the user's predict(...) line
        return final, Xt

    def _score(self, X, y, sample_weight):
        # Step accuracy; ``y=None`` reads the conversations' ``mistake_step``.
        convs = self._convs(X)
        if y is None:
            y = labels_from_conversations(convs, "FailureAttributor.score")
        final, Xt = self._final_input(convs)  # as pipeline_.score(convs, y)
        return final.score(Xt, y)

    # --------------------------------------------------------------- evaluate
    def evaluate(self, X, y=None, *, agents=None, n_resamples=2000, confidence=0.95,
                 random_state=None):
        """Held-out metrics with bootstrap confidence intervals.

        Parameters
        ----------
        X : list of Conversation
            Held-out conversations (not used in ``fit``).
        y : array-like of int, default=None
            True steps; ``None`` reads the conversations' ``mistake_step``.
        agents : array-like of str, default=None
            True responsible agents. ``None`` takes each conversation's
            ``mistake_agent`` where ``y`` is its annotated step, else the
            speaker of turn ``y[i]``.
        n_resamples : int, default=2000
            Bootstrap resamples.
        confidence : float, default=0.95
            Coverage of the intervals.
        random_state : int, RandomState instance or None, default=None
            Seed of the resampling (an int makes the intervals reproducible).

        Returns
        -------
        report : AttributionReport
            Step accuracy, agent accuracy under every matching rule, within-1
            accuracy and mean absolute shift, each with its interval and ``n``.
            When every conversation has a task id, whole tasks are resampled.
        """
        convs = self._convs(X)
        defaulted = y is None
        if defaulted:
            y = labels_from_conversations(convs, "FailureAttributor.evaluate")
        final, Xt = self._final_input(convs)
        self._check_shift(Xt, convs)
        y = np.asarray(y)
        steps = np.asarray(final.predict(Xt), dtype=np.int64)
        if y.shape != steps.shape:
            raise ValueError(f"y has shape {y.shape}; expected one step per conversation "
                             f"({steps.shape[0]}).")
        y = y.astype(np.int64)
        pred_agents = np.asarray(Xt.speakers_at(steps), dtype=object)
        if agents is None:
            true_agents = _true_agents(convs, y, defaulted)
        else:
            true_agents = list(agents)
        groups = _groups_from(convs)
        kw = dict(n_resamples=n_resamples, confidence=confidence, random_state=random_state,
                  groups=groups)
        agent_results = {}
        for rule in AGENT_RULES:
            metric = (agent_accuracy if rule == "normalized"
                      else functools.partial(agent_accuracy, rule=rule))
            agent_results[rule] = bootstrap_ci(true_agents, list(pred_agents), metric, **kw)
        return AttributionReport(
            step_accuracy=bootstrap_ci(y, steps, step_accuracy, **kw),
            agent_accuracy=agent_results,
            within_1=bootstrap_ci(y, steps, within_k_accuracy, **kw),
            mean_absolute_shift=bootstrap_ci(y, steps, mean_absolute_step_shift, **kw),
            n=len(convs),
            site=self._site_label(),
            cluster_bootstrap=groups is not None,
            steps=steps,
            agents=pred_agents,
        )

    # -------------------------------------------------------------- attribute
    def attribute(self, conversation, *, top_k=3):
        """Blame one turn of one conversation, with the evidence.

        Parameters
        ----------
        conversation : Conversation
        top_k : int, default=3
            How many of the highest-scoring turns to list.

        Returns
        -------
        attribution : Attribution
            Predicted step and agent, every turn's score and probability, the
            site, and the ``top_k`` turns with a preview of their text.
        """
        check_is_fitted(self)
        if not isinstance(conversation, Conversation):
            raise TypeError(
                "attribute takes one skafa.Conversation, got "
                f"{type(conversation).__name__}; for several, call it once per "
                "conversation or use predict / turn_predict_proba."
            )
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}.")
        final, Xt = self._final_input([conversation])
        shift_scores, flagged = self._check_shift(Xt, [conversation])
        scores = np.asarray(final.turn_decision_function(Xt)[0], dtype=np.float64)
        proba = np.asarray(final.turn_predict_proba(Xt)[0], dtype=np.float64)
        step = int(final.predict(Xt)[0])
        speakers = conversation.speakers
        order = np.argsort(-scores, kind="stable")[: int(top_k)]
        ranks = tuple(
            TurnRank(int(i), speakers[i], float(scores[i]), float(proba[i]),
                     _preview(conversation.turns[i].content))
            for i in order
        )
        return Attribution(
            step=step,
            agent=speakers[step],
            turn_scores=scores,
            turn_probabilities=proba,
            site=self._site_label(),
            top_k=ranks,
            speakers=tuple(speakers),
            true_step=conversation.mistake_step,
            true_agent=conversation.mistake_agent,
            task_id=conversation.task_id,
            record_id=conversation.record_id,
            conversation=conversation,
            shifted=None if flagged is None else bool(flagged[0]),
            shift_score=None if shift_scores is None else float(shift_scores[0]),
        )

    # ------------------------------------------------------------ persistence
    def save(self, path, *, overwrite=False):
        """Save the fitted attributor without pickle (see :mod:`skafa.persistence`).

        Parameters
        ----------
        path : str or path-like
            Directory to create (``arrays.safetensors`` + ``skafa.json``).
        overwrite : bool, default=False
            Replace an existing save at ``path``.

        Returns
        -------
        path : pathlib.Path
        """
        from .persistence import save

        check_is_fitted(self)
        return save(self, path, overwrite=overwrite)

    @classmethod
    def load(cls, path, *, model=None, device=None, trust=(), cache_dir=None, n_jobs=None,
             verbose=None, allow_model_mismatch=False):
        """Load an attributor saved with :meth:`save`.

        Parameters
        ----------
        path : str or path-like
        model : str, default=None
            Use this model instead of the saved one. Its architecture must match;
            the same weights under another name or file warn
            (:class:`~skafa.exceptions.ModelMismatchWarning`); other weights are
            refused unless ``allow_model_mismatch=True``.
        device : str, default=None
            Torch device (runtime settings never come from the file).
        trust : iterable of str, default=()
            See :func:`skafa.persistence.load`.
        cache_dir, n_jobs, verbose : default=None
            Runtime settings of the loaded steps (never read from the file; ``None``
            keeps each step's constructor default).
        allow_model_mismatch : bool, default=False
            Score with ``model`` even though its weights differ from the saved
            model's (same architecture), with a
            :class:`~skafa.exceptions.ModelMismatchWarning`. Needs ``model``.
            Without it, a model whose weights differ from the saved ones (e.g. a
            relative path resolved from another folder) raises a
            :class:`ValueError` naming both places and both weights digests.

        Returns
        -------
        attributor : FailureAttributor

        Raises
        ------
        ValueError
            For a file :func:`skafa.persistence.load` refuses (see there),
            including another model's weights without ``allow_model_mismatch``.
        """
        from .persistence import load

        obj = load(path, model=model, device=device, trust=trust, cache_dir=cache_dir,
                   n_jobs=n_jobs, verbose=verbose, allow_model_mismatch=allow_model_mismatch)
        if not isinstance(obj, cls):
            raise TypeError(
                f"{path} holds a {type(obj).__name__}, not a {cls.__name__}; load it with "
                "skafa.persistence.load."
            )
        return obj
