"""The main job (``examples/quickstart.py``, run by ``examples/run_main_job.sh``):
white-box failure attribution on Who&When with the recommended configuration, end to end.

:func:`prepare_main_job` loads the records and the model, names the configuration
(:data:`skafa.configurations.RECOMMENDED`, read when called), plans the prompts
(shortened visibly where they exceed the context) and checks the sites;
:func:`run_main_job` extracts every site once into a resumable cache (a plan and an
ETA first), cross-validates the configuration next to position-only, TF-IDF and
dummy baselines on the same outer folds (bootstrap CIs, paired differences), and
explains the attribution of one held-out conversation. Every line goes to ``log``.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import (
    GridSearchCV,
    GroupKFold,
    GroupShuffleSplit,
    cross_val_predict,
)

from .. import configurations
from ..attributor import FailureAttributor
from ..baselines import DummyStepClassifier
from ..compose import make_attribution_pipeline
from ..datasets import load_who_and_when
from ..exceptions import PromptTooLongError
from ..featurizers import TurnPositionTransformer, TurnTextTransformer
from ..metrics import (
    agent_accuracy,
    bootstrap_ci,
    paired_bootstrap_ci,
    step_accuracy,
    within_k_accuracy,
)
from ..probes import GroupedArgmaxLogisticClassifier
from ._who_and_when import _say

__all__ = ["MainJob", "MainJobSettings", "main_job_table", "prepare_main_job", "run_main_job"]

_BASELINES_COMPARED = ("position-only", "TF-IDF", "always step 1")


@dataclasses.dataclass
class MainJobSettings:
    """What the main job reads and how.

    ``data`` is the Who&When folder, ``subset`` ``"Algorithm-Generated"``,
    ``"Hand-Crafted"`` or ``"all"``, ``limit`` the first N records only; ``sites`` the
    sites the probe's site search compares (``"stride:K"``, ``"all"`` or a
    comma-separated list); ``cache_dir`` the activation cache (empty or None: memory
    only); ``batch_size``, ``device``, ``dtype`` go to the extraction; ``n_resamples``
    and ``seed`` to the bootstrap and the splits; ``n_jobs`` to the probe's site
    search and the baselines' C search (processes; the predictions do not depend
    on it).
    """

    data: str
    subset: str = "Algorithm-Generated"
    model: str = "smollm2"
    cache_dir: str | None = None
    sites: str = "stride:3"
    limit: int | None = None
    batch_size: object = 1
    device: str = "cpu"
    dtype: str = "auto"
    n_resamples: int = 2000
    seed: int = 0
    plan_only: bool = False
    n_jobs: int | None = -1


@dataclasses.dataclass
class MainJob:
    """A prepared main job (:func:`prepare_main_job`): records, model, configuration,
    prompt plan and sites; ``times`` collects the wall time of each step, ``started``
    is the ``time.perf_counter()`` at which preparing began."""

    settings: MainJobSettings
    conversations: list
    y: np.ndarray
    groups: np.ndarray
    configuration: str
    read: str
    n_top: int
    features: str
    n_layers: int
    template: object
    plan: object
    sites: list
    times: dict
    started: float


def _fmt_ci(r, digits=3):
    return f"{r.estimate:.{digits}f} [{r.low:.{digits}f}, {r.high:.{digits}f}]"


def prepare_main_job(settings, *, log=None):
    """Load the records and the model, name the configuration, plan the prompts.

    Never cuts silently: the prompts that exceed the model's context are counted and
    shortened deliberately (``PromptTemplate(shorten="middle_first")``: the middles of
    the longest turns first, with a marker), each one named with what it lost. The
    prompt planned is the one of the configuration's read.

    Raises
    ------
    ValueError
        When ``settings.sites`` does not name sites of the model.
    PromptTooLongError
        When a prompt cannot be shortened enough to fit the context.
    """
    from ..llm import PromptTemplate, context_length, load_model, parse_site_spec, plan

    t_start = time.perf_counter()
    times = {}
    subset = None if settings.subset == "all" else settings.subset
    data = load_who_and_when(settings.data, subset=subset, labelled=True)  # it scores them
    convs = list(data.conversations)
    if settings.limit is not None:
        convs = convs[: settings.limit]
    y = np.asarray([c.mistake_step for c in convs], dtype=np.int64)
    groups = np.asarray([c.task_id for c in convs], dtype=object)
    n_tasks = len(set(groups.tolist()))
    _say(log, f"data: {len(convs)} conversations ({settings.subset}) from {data.path}, "
              f"{n_tasks} tasks, {np.mean([len(c) for c in convs]):.1f} turns on average")

    t = time.perf_counter()
    # with a cache dir, a GGUF model is read once and kept converted beside the cache
    convert_dir = str(Path(settings.cache_dir) / "models") if settings.cache_dir else None
    model, tokenizer = load_model(settings.model, device=settings.device,
                                  convert_dir=convert_dir)
    ctx = context_length(model)
    n_layers = model.config.num_hidden_layers
    times["model load"] = time.perf_counter() - t
    _say(log, f"model: {settings.model} ({type(model).__name__}, {n_layers} layers x "
              f"{model.config.hidden_size}, context {ctx} tokens) loaded in "
              f"{times['model load']:.1f} s")
    try:
        sites = list(parse_site_spec(settings.sites, n_layers))
    except ValueError as exc:
        raise ValueError(f"--sites: {exc}") from None

    configuration = configurations.RECOMMENDED
    read, _, _, n_top, features = configurations.parse_configuration(configuration)
    _say(log, f"configuration: {configuration!r} (skafa.configurations.RECOMMENDED, picked "
              f"by the pre-registered rule; docs/benchmarks.md section 3): read={read!r}")

    t = time.perf_counter()
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=ctx)
    raw = plan(convs, tokenizer, PromptTemplate(), max_tokens=ctx, read=read)
    short = plan(convs, tokenizer, template, max_tokens=ctx, read=read)
    times["prompt planning"] = time.perf_counter() - t
    shortened = [r for r in short if r["chars_removed"] > 0]
    total_chars = sum(len(turn.content) for c in convs for turn in c.turns)
    _say(log, f"prompts: {len(raw.too_long)} of {len(convs)} exceed the {ctx}-token context "
              f"(longest {int(raw.n_tokens.max())} tokens). Policy: "
              f"PromptTemplate(shorten='middle_first', max_prompt_tokens={ctx}).")
    _say(log, f"  shortened {len(shortened)} conversations, removing "
              f"{short.total_chars_removed:,} characters "
              f"({100 * short.total_chars_removed / max(total_chars, 1):.2f}% of all turn text)"
              + (":" if shortened else "."))
    for r in shortened:
        before = raw[r["index"]]["n_tokens"]
        n_turns_cut = sum(1 for v in r["turn_chars_removed"] if v > 0)
        _say(log, f"    {r['record_id']}: {before} -> {r['n_tokens']} tokens, "
                  f"{r['chars_removed']:,} characters removed from {n_turns_cut} of "
                  f"{r['n_turns']} turns")
    if not short.all_fit:
        bad = ", ".join(str(r["record_id"]) for r in short.too_long)
        raise PromptTooLongError(f"these prompts cannot be shortened enough to fit: {bad}",
                                 max_tokens=ctx)
    return MainJob(settings=settings, conversations=convs, y=y, groups=groups,
                   configuration=configuration, read=read, n_top=n_top, features=features,
                   n_layers=n_layers, template=template, plan=short, sites=sites, times=times,
                   started=t_start)


def _extract(job, log):
    """Every site of every conversation, once, through the cache (resumable)."""
    from ..llm import TurnActivationTransformer

    s, convs = job.settings, job.conversations
    t = time.perf_counter()
    extractor = TurnActivationTransformer(
        s.model, sites=None, read=job.read, prompt=job.template, device=s.device,
        dtype=s.dtype, cache_dir=s.cache_dir or None, batch_size=s.batch_size, verbose=1,
    ).fit(convs)
    estimate = extractor.estimate_cost(convs)
    _say(log, f"extraction plan: all {len(extractor.sites_)} sites of {len(convs)} "
              f"conversations, one forward pass each; {estimate['summary']}.")
    if s.plan_only:
        return estimate
    if estimate["n_to_extract"] and s.cache_dir:
        _say(log, f"  every finished conversation is cached in {s.cache_dir} at once: "
                  "interrupt (Ctrl-C) and run the same command again to resume.")
    try:
        X_all = extractor.transform(convs)
    except KeyboardInterrupt:
        left = extractor.estimate_cost(convs, calibrate=False)
        _say(log, f"\ninterrupted: {left['n_cached']} of {len(convs)} conversations are cached"
                  + (f" in {s.cache_dir}; run the same command again to resume."
                     if s.cache_dir else
                     " in memory only (no --cache-dir): a rerun starts over."))
        raise
    job.times["extraction"] = time.perf_counter() - t
    stats = extractor.run_stats
    _say(log, f"extraction: {X_all.n_turns_total} turns x {X_all.n_sites} sites x "
              f"{X_all.n_features} features in {job.times['extraction']:.1f} s "
              f"({stats['n_forward_passes']} forward passes; cache: "
              f"{stats['memory_hits']} memory hits, {stats['disk_hits']} disk hits, "
              f"{stats['misses']} misses) [cache dir: {s.cache_dir or 'none'}]")
    return X_all


def _configured(job):
    """The configuration's extractor (sites set to the job's) and site selector."""
    s = job.settings
    extractor, selector = configurations.make_configuration(
        job.configuration, s.model, random_state=s.seed, prompt=job.template,
        device=s.device, dtype=s.dtype, cache_dir=s.cache_dir or None,
        batch_size=s.batch_size)
    extractor.set_params(**{"sites" if job.features == "acts" else "act__sites": job.sites})
    selector.set_params(n_jobs=s.n_jobs)
    return extractor, selector


def main_job_table(y, predictions, speakers, true_agents, groups, *, n_resamples,
                   random_state):
    """Step, agent and within-1 accuracy with 95% task-bootstrap CIs per method.

    ``predictions`` maps a method to its predicted steps; ``speakers(steps)`` gives
    the agent at each predicted step. Returns ``{method: {"step", "agent",
    "within_1"}}`` of :class:`~skafa.metrics.BootstrapResult`.
    """
    boot = dict(n_resamples=n_resamples, random_state=random_state, groups=groups)
    table = {}
    for name, steps in predictions.items():
        agents = list(speakers(steps))
        table[name] = {"step": bootstrap_ci(y, steps, step_accuracy, **boot),
                       "agent": bootstrap_ci(true_agents, agents, agent_accuracy, **boot),
                       "within_1": bootstrap_ci(y, steps, within_k_accuracy, **boot)}
    return table


def _cross_validate(job, X_all, extractor, selector, log):
    s, convs, y, groups = job.settings, job.conversations, job.y, job.groups
    X = X_all.select_sites(job.sites)
    outer = GroupKFold(n_splits=5)
    # The configuration as one pipeline over conversations: every fold reads the
    # activations from the cache filled by the extraction and fits everything else
    # (position features where the configuration has them, C, the site) on its
    # training part only.
    probe = make_attribution_pipeline(extractor, selector)
    what = "one" if job.n_top == 1 else f"the {job.n_top} best (their scores averaged)"
    _say(log, f"cross-validation: outer GroupKFold(5) by task id; inside each training fold "
              f"SiteSelector picks {what} of {len(job.sites)} sites ({', '.join(job.sites)}) "
              f"and {selector.param_grid} jointly by GroupKFold(5)")
    t = time.perf_counter()
    pred = {"probe (skafa)": cross_val_predict(probe, convs, y, groups=groups, cv=outer)}
    job.times["cross-validation (probe)"] = time.perf_counter() - t
    dummies = {"always step 1": DummyStepClassifier(strategy="constant", constant=1),
               "most frequent step": DummyStepClassifier(strategy="most_frequent")}
    for name, est in dummies.items():
        pred[name] = cross_val_predict(est, X, y, groups=groups, cv=outer)
    # The honest baselines, on the same outer folds: what a turn's position and speaker,
    # or its words, already tell (C chosen on inner grouped folds, as for the probe).
    t = time.perf_counter()
    for name, featurizer in (("position-only", TurnPositionTransformer()),
                             ("TF-IDF", TurnTextTransformer())):
        search = GridSearchCV(
            make_attribution_pipeline(featurizer, GroupedArgmaxLogisticClassifier()),
            {"groupedargmaxlogisticclassifier__C": [0.001, 0.01, 0.1]},
            cv=GroupKFold(n_splits=5), n_jobs=s.n_jobs)
        pred[name] = cross_val_predict(search, convs, y, groups=groups, cv=outer,
                                       params={"groups": groups})
    job.times["cross-validation (baselines)"] = time.perf_counter() - t

    true_agents = [c.mistake_agent for c in convs]
    table = main_job_table(y, pred, X.speakers_at, true_agents, groups,
                           n_resamples=s.n_resamples, random_state=s.seed)
    header = (f"{'method':<20} {'step acc [95% CI]':<24} {'agent acc [95% CI]':<24} "
              f"{'within-1 [95% CI]':<24} {'n':>4}")
    _say(log, "")
    _say(log, header)
    _say(log, "-" * len(header))
    for name, row in table.items():
        _say(log, f"{name:<20} {_fmt_ci(row['step']):<24} {_fmt_ci(row['agent']):<24} "
                  f"{_fmt_ci(row['within_1']):<24} {row['step'].n:>4}")
    _say(log, "")
    boot = dict(n_resamples=s.n_resamples, random_state=s.seed, groups=groups)
    diffs = {}
    for other in _BASELINES_COMPARED:
        diffs[other] = d = paired_bootstrap_ci(y, pred["probe (skafa)"], pred[other],
                                               step_accuracy, **boot)
        _say(log, f"probe - {other}, step accuracy: {d.estimate:+.3f} "
                  f"[{d.low:+.3f}, {d.high:+.3f}] (paired bootstrap)")
    _say(log, "agent accuracy: rule 'normalized' (case-folded, trailing parentheticals "
              "dropped) against the annotated mistake_agent; CIs resample whole tasks "
              f"({s.n_resamples} resamples).")
    return pred, table, diffs


def _attribute(job, extractor, selector, log):
    """FailureAttributor on a grouped training split; one held-out attribution."""
    s, convs = job.settings, job.conversations
    t = time.perf_counter()
    split = GroupShuffleSplit(n_splits=1, test_size=0.2, random_state=s.seed)
    train, test = next(split.split(convs, job.y, job.groups))
    attributor = FailureAttributor(extractor, selector)
    attributor.fit([convs[i] for i in train])
    job.times["fit FailureAttributor"] = time.perf_counter() - t
    held_out = [convs[i] for i in test]
    report = attributor.evaluate(held_out, n_resamples=s.n_resamples, random_state=s.seed)
    chosen = attributor.pipeline_[-1]
    score = float(np.max(chosen.candidate_scores_))  # the score C and the sites were chosen by
    _say(log, f"\nFailureAttributor fitted on {len(train)} conversations (chosen by CV on "
              f"them: sites {'+'.join(attributor.best_sites_)}, {chosen.best_params_}; CV "
              f"step accuracy {score:.3f}); {len(test)} held out.")
    _say(log, str(report))
    example = held_out[0]
    attribution = attributor.attribute(example, top_k=3)
    _say(log, f"\nheld-out conversation {example.record_id} (task {example.task_id}, "
              f"{len(example)} turns):")
    _say(log, f"  predicted: step {attribution.step}, agent {attribution.agent!r} "
              f"(p = {attribution.probability:.3f})")
    _say(log, f"  true:      step {example.mistake_step}, agent {example.mistake_agent!r}")
    _say(log, str(attribution))
    return attributor, report, attribution


def run_main_job(job, *, log=None):
    """Extract, cross-validate, attribute: the main job after :func:`prepare_main_job`.

    Every site costs the same single forward pass, so all are read once and cached
    (``job.settings.cache_dir``: every finished conversation at once, so an
    interrupted run resumes); the probe's site search then compares ``job.sites``.
    The configuration is cross-validated with an outer ``GroupKFold(5)`` over task
    ids (every conversation gets one held-out prediction) next to position-only,
    TF-IDF and dummy baselines on the same folds; a :class:`~skafa.FailureAttributor`
    fitted on a grouped 80% split explains one held-out attribution.

    A ``KeyboardInterrupt`` during the extraction is said (how many conversations are
    cached) and raised again.

    Returns
    -------
    result : dict
        ``sites``, ``predictions`` (method -> steps), ``table`` (method -> step /
        agent / within-1 CIs), ``paired`` (probe - always step 1), ``paired_all``
        (probe - each baseline), ``plan``, ``attributor``, ``report``,
        ``attribution`` and ``times`` (seconds per step).
    """
    times = job.times
    X_all = _extract(job, log)
    if job.settings.plan_only:  # the plan and its cost only: nothing extracted
        return {"plan": job.plan, "estimate": X_all, "sites": job.sites}
    extractor, selector = _configured(job)
    pred, table, diffs = _cross_validate(job, X_all, extractor, selector, log)
    attributor, report, attribution = _attribute(job, extractor, selector, log)
    times["total"] = time.perf_counter() - job.started
    _say(log, "\nwall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    return {"sites": job.sites, "predictions": pred, "table": table,
            "paired": diffs["always step 1"], "paired_all": diffs, "plan": job.plan,
            "attributor": attributor, "report": report, "attribution": attribution,
            "times": times}
