"""The main job (``examples/quickstart.py``, run by ``examples/run_main_job.sh``):
white-box failure attribution on Who&When with the recommended configuration, end to end.

:func:`prepare_main_job` loads the records and the model, names the configuration
(:data:`skafa.configurations.RECOMMENDED`, read when called), plans the prompts
(shortened visibly where they exceed the context) and checks the sites;
:func:`run_main_job` extracts every site once into a resumable cache (a plan and an
ETA first) in a seeded random order, printing a cross-validated *interim* estimate on
the conversations extracted so far as it goes (the anytime estimate), then
cross-validates the configuration next to position-only, TF-IDF and dummy baselines
on the same outer folds (bootstrap CIs, paired differences), and explains the
attribution of one held-out conversation. Every line goes to ``log``.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import dataclasses
import json
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

    The anytime estimate (:func:`run_main_job`): ``anytime_first`` conversations
    extracted before the first interim estimate (0: none), then one every
    ``anytime_every`` more, as long as the interim estimates take at most
    ``anytime_budget`` of the run (a share of the wall time, 0 to 1; 1: every one);
    ``anytime_out`` the folder of ``anytime.json`` and ``anytime.png`` (None:
    ``<cache_dir>/main-job``; neither: not written).
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
    anytime_first: int = 16
    anytime_every: int = 10
    anytime_budget: float = 0.2
    anytime_out: str | None = None


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
        When ``settings.sites`` does not name sites of the model, or the anytime
        settings are out of range.
    PromptTooLongError
        When a prompt cannot be shortened enough to fit the context.
    """
    from ..llm import PromptTemplate, context_length, load_model, parse_site_spec, plan

    _check_anytime_settings(settings)
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


_OUTER_SPLITS = 5  # the final cross-validation's outer GroupKFold
_INNER_SPLITS = 5  # the inner GroupKFold of SiteSelector's and the baselines' C search
_PROBE = "probe (skafa)"
_ANYTIME_METHODS = (_PROBE, "position-only", "TF-IDF")


def _check_anytime_settings(settings):
    first, every, budget = settings.anytime_first, settings.anytime_every, settings.anytime_budget

    def is_int(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    if not is_int(first) or first < 0:
        raise ValueError(f"--anytime-first: a number of conversations >= 0 (0: no interim "
                         f"estimates), got {first!r}")
    if not is_int(every) or every < 1:
        raise ValueError(f"--anytime-every: a number of conversations >= 1, got {every!r}")
    if (isinstance(budget, bool) or not isinstance(budget, (int, float, np.floating))
            or not 0 <= budget <= 1):
        raise ValueError(f"--anytime-budget: a share of the run from 0 to 1, got {budget!r}")


def _outer_n_splits(groups):
    """Outer folds for conversations of these task ids: the most, up to 5, by which
    every training part keeps at least 5 tasks (the inner ``GroupKFold(5)`` of the
    site and C search needs them); None when no number of folds does."""
    groups = np.asarray(groups, dtype=object)
    idx = np.arange(len(groups))
    for k in range(min(_OUTER_SPLITS, len(set(groups.tolist()))), 1, -1):
        splits = GroupKFold(n_splits=k).split(idx, groups=groups)
        if all(len(set(groups[train].tolist())) >= _INNER_SPLITS for train, _ in splits):
            return k
    return None


def _interim_points(groups, order, first, every, n_cached=0):
    """How many conversations (of ``order``) are extracted at each interim point.

    The first at ``max(first, n_cached)`` conversations (a resumed run starts with an
    estimate on what is cached), moved on until the conversations so far span
    enough tasks for the folds (:func:`_outer_n_splits`), then one every ``every``;
    none at or after the last conversation (the final figure comes then), none at
    all with ``first == 0``.
    """
    n = len(order)
    if first <= 0:
        return []
    m = max(first, n_cached)
    while m < n and _outer_n_splits(groups[np.sort(order[:m])]) is None:
        m += 1
    return list(range(m, n, every))


def _interim_due(n, *, interim_s, extraction_s, last, budget):
    """The cadence rule: whether the interim estimate at ``n`` conversations is made.

    The first (``last`` None) always is. A later one is made when the interim
    estimates, this one included, stay within ``budget`` of the run so far:
    ``interim_s + c <= budget * (extraction_s + interim_s + c)``, with ``c`` this
    one's cost predicted from the last one's (``last = (n_last, seconds)``) as
    ``seconds * n / n_last`` (the cross-validation grows about linearly with the
    conversations).
    """
    if last is None:
        return True
    n_last, seconds = last
    c = seconds * n / max(n_last, 1)
    return interim_s + c <= budget * (extraction_s + interim_s + c)


def _ci_dict(r):
    return {"estimate": float(r.estimate), "low": float(r.low), "high": float(r.high),
            "n": int(r.n)}


def _fmt_s(seconds):
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _fmt_d(r, sign=""):
    return f"{r['estimate']:{sign}.3f} [{r['low']:{sign}.3f}, {r['high']:{sign}.3f}]"


class _Anytime:
    """The extraction in a seeded random order, chunk by chunk, with an interim
    estimate (the final cross-validation on the conversations extracted so far) at
    the points of :func:`_interim_points` that :func:`_interim_due` allows; the
    running estimate goes to ``anytime.json`` and ``anytime.png``."""

    def __init__(self, job, n_cached, log):
        s = job.settings
        self.job, self.log = job, log
        n = len(job.conversations)
        self.order = np.random.default_rng(s.seed).permutation(n)
        self.points = _interim_points(job.groups, self.order, s.anytime_first,
                                      s.anytime_every, n_cached)
        self.n_cached_at_start = n_cached
        folder = s.anytime_out or (str(Path(s.cache_dir) / "main-job") if s.cache_dir else None)
        self.folder = None if folder is None else Path(folder).expanduser()
        self.json_path = None if folder is None else self.folder / "anytime.json"
        self.png_path = None if folder is None else self.folder / "anytime.png"
        self.estimates, self.skipped, self.final = [], [], None
        self.extraction_s = self.interim_s = 0.0
        self.n_done, self.status, self.eta = 0, "running", None
        self.stats = dict.fromkeys(("n_forward_passes", "memory_hits", "disk_hits", "misses"), 0)
        self._last_cost = None  # (n, seconds) of the last interim estimate, files included
        self._configured = None
        self.earlier = self._earlier_points()

    def _identity(self):
        s, job = self.job.settings, self.job
        return {"model": s.model, "subset": s.subset, "configuration": job.configuration,
                "sites": list(job.sites), "seed": s.seed, "n_resamples": s.n_resamples,
                "order": [str(job.conversations[i].record_id) for i in self.order]}

    def _earlier_points(self):
        """The interim estimates an earlier run of the same job wrote (an interrupted
        run being resumed, or the cold run before a warm one) before this run's
        first: the running estimate goes on rather than starting over."""
        if self.json_path is None or not self.json_path.is_file():
            return []
        try:
            doc = json.loads(self.json_path.read_text())
            if any(doc.get(k) != v for k, v in self._identity().items()):
                return []
            start = self.points[0] if self.points else len(self.job.conversations)
            return [p for p in doc["points"] if not p["final"] and p["n_extracted"] < start]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []  # unreadable or another format: start over

    # ------------------------------------------------------------------ running
    def announce(self):
        s, n = self.job.settings, len(self.job.conversations)
        if not self.points:
            why = ("--anytime-first 0" if s.anytime_first <= 0 else
                   "too few conversations to extract before the final figure")
            _say(self.log, f"anytime: extraction in a seeded random order (seed {s.seed}); "
                           f"no interim estimates ({why}).")
            return
        head = ", ".join(str(p) for p in self.points[:4]) + (", ..." if len(self.points) > 4
                                                             else "")
        _say(self.log, f"anytime: extraction in a seeded random order (seed {s.seed}); an "
                       f"interim estimate (the final cross-validation on the conversations "
                       f"extracted so far) after {head} of {n} conversations, whenever the "
                       f"interim estimates stay within {s.anytime_budget:.0%} of the run")
        _say(self.log, "  running estimate: " + (
            f"{self.json_path} and {self.png_path}" if self.json_path is not None else
            "not written (no --cache-dir and no --anytime-out)"))

    def run(self, extractor):
        convs, n = self.job.conversations, len(self.job.conversations)
        stops = [*self.points, n]
        for stop in stops:
            chunk = [convs[i] for i in self.order[self.n_done:stop]]
            if len(stops) > 1:
                _say(self.log, f"extracting conversations {self.n_done + 1}-{stop} of {n} "
                               "(seeded order)")
            before = extractor.run_stats
            t = time.perf_counter()
            extractor.transform(chunk)  # each one cached as soon as it is done
            self.extraction_s += time.perf_counter() - t
            after = extractor.run_stats
            for key in self.stats:
                self.stats[key] += after.get(key, 0) - before.get(key, 0)
            self.n_done = stop
            if stop < n:
                self._interim()

    def _interim(self):
        s, n = self.job.settings, self.n_done
        if not _interim_due(n, interim_s=self.interim_s, extraction_s=self.extraction_s,
                            last=self._last_cost, budget=s.anytime_budget):
            self.skipped.append(n)
            _say(self.log, f"(no interim estimate at {n} of {len(self.job.conversations)}: "
                           f"interim estimates would take more than {s.anytime_budget:.0%} "
                           "of the run so far)")
            return
        t = time.perf_counter()
        try:
            point = self._estimate(n)
        except Exception as exc:  # noqa: BLE001 - an interim estimate never stops the run
            self.interim_s += time.perf_counter() - t
            _say(self.log, f"interim estimate on {n} conversations failed "
                           f"({type(exc).__name__}: {exc}); the extraction goes on")
            return
        point["seconds"] = time.perf_counter() - t
        self.estimates.append(point)
        self.say_point(point)
        self.write(plot=True)
        cost = time.perf_counter() - t
        self.interim_s += cost
        self._last_cost = (n, cost)

    def _estimate(self, n):
        """The final cross-validation (:func:`_cv_predictions`, :func:`main_job_table`)
        on the first ``n`` conversations of the order, taken in input order."""
        job, s = self.job, self.job.settings
        idx = np.sort(self.order[:n])  # input order: nothing depends on the extraction order
        sub = [job.conversations[i] for i in idx]
        y, groups = job.y[idx], job.groups[idx]
        k = _outer_n_splits(groups)
        if self._configured is None:
            self._configured = _configured(job)
        pred, _ = _cv_predictions(job, idx, *self._configured, k)
        table = main_job_table(y, pred, _speakers_at(sub), [c.mistake_agent for c in sub],
                               groups, n_resamples=s.n_resamples, random_state=s.seed)
        diff = paired_bootstrap_ci(y, pred[_PROBE], pred["position-only"], step_accuracy,
                                   n_resamples=s.n_resamples, random_state=s.seed,
                                   groups=groups)
        return {"n_extracted": int(n), "n_total": len(job.conversations), "final": False,
                "n_tasks": len(set(groups.tolist())), "n_splits": int(k),
                "step_accuracy": {m: _ci_dict(table[m]["step"]) for m in _ANYTIME_METHODS},
                "probe - position-only": _ci_dict(diff),
                "extraction_s": self.extraction_s,
                "elapsed_s": time.perf_counter() - job.started}

    def say_point(self, p):
        n, total, k = p["n_extracted"], p["n_total"], p["n_splits"]
        folds = f"outer GroupKFold({k}) by task id"
        if k < _OUTER_SPLITS:
            folds += (f", fewer folds than the final's {_OUTER_SPLITS}: with these "
                      f"{p['n_tasks']} tasks {_OUTER_SPLITS} folds would leave a training "
                      f"part fewer than {_INNER_SPLITS} tasks for the inner search")
        _say(self.log, f"interim estimate on {n} of {total} conversations extracted so far "
                       f"({p['n_tasks']} tasks; the final cross-validation on them: {folds}, "
                       f"the site and C search inside; {p['seconds']:.1f} s):")
        acc = p["step_accuracy"]
        _say(self.log, "  step accuracy [95% CI]: " + " | ".join(
            f"{m} {_fmt_d(acc[m])}" for m in _ANYTIME_METHODS))
        extracted = n - self.n_cached_at_start
        rate = (f", about {_fmt_s((total - n) * self.extraction_s / extracted)} of "
                "extraction at the rate so far" if extracted > 0 and n < total else "")
        _say(self.log, f"  probe - position-only: {_fmt_d(p['probe - position-only'], '+')} "
                       f"(paired bootstrap over tasks). Interim, not the final figure: "
                       f"{total - n} conversations to go{rate}.")

    # ------------------------------------------------------------------ endings
    def interrupted(self):
        self.status = "interrupted"
        done = self.earlier + self.estimates
        if done:
            _say(self.log, "last interim estimate (interim, not the final figure):")
            self.say_point(done[-1])
        elif self.points:
            _say(self.log, f"no interim estimate yet (the first comes after {self.points[0]} "
                           "conversations).")
        self.write(plot=False)

    def finish(self, table, diffs):
        job = self.job
        n = len(job.conversations)
        self.status = "done"
        self.final = {"n_extracted": n, "n_total": n, "final": True,
                      "n_tasks": len(set(job.groups.tolist())), "n_splits": _OUTER_SPLITS,
                      "step_accuracy": {m: _ci_dict(table[m]["step"])
                                        for m in _ANYTIME_METHODS},
                      "probe - position-only": _ci_dict(diffs["position-only"]),
                      "extraction_s": self.extraction_s,
                      "elapsed_s": time.perf_counter() - job.started}
        self.write(plot=True)
        if self.estimates or self.skipped:
            share = self.interim_s / max(self.interim_s + self.extraction_s, 1e-9)
            _say(self.log, f"anytime: {len(self.estimates)} interim estimate(s) in "
                           f"{self.interim_s:.1f} s ({share:.0%} of extraction and interim "
                           f"estimates together), {len(self.skipped)} skipped by the budget")
        if self.json_path is not None:
            _say(self.log, f"running estimate: {self.json_path}"
                           + (f", {self.png_path}" if self.png_path.exists() else "")
                           + (f" (with {len(self.earlier)} interim estimate(s) of an earlier "
                              "run of this job, before this one's)" if self.earlier else ""))

    def document(self):
        s, job = self.job.settings, self.job
        return {
            "what": "the main job's anytime estimate: step accuracy cross-validated on the "
                    "conversations extracted so far (interim), then on all (final)",
            "status": self.status, **self._identity(),
            "n_conversations": len(job.conversations),
            "n_cached_at_start": self.n_cached_at_start,
            "rule": {"first": s.anytime_first, "every": s.anytime_every,
                     "budget": s.anytime_budget, "points": self.points},
            "points": self.earlier + self.estimates + ([self.final] if self.final else []),
            "skipped": self.skipped, "extraction_s": self.extraction_s,
            "interim_s": self.interim_s, "eta": self.eta,
        }

    def write(self, *, plot):
        if self.json_path is None:
            return
        doc = self.document()
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(self.json_path)
        if plot and doc["points"]:
            _plot_anytime(doc, self.png_path, self.log)


def _speakers_at(conversations):
    """``speakers(steps)``: the agent at each conversation's step (as ``speakers_at``)."""
    def speakers(steps):
        return np.asarray([c.speakers[int(k)] for c, k in zip(conversations, steps)],
                          dtype=object)
    return speakers


def _plot_anytime(doc, path, log):
    """Step accuracy with its CI band against the conversations extracted (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say(log, "matplotlib not installed: no anytime plot (pip install 'skafa[plot]')")
        return None
    points = doc["points"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    dodge = 0.006 * doc["n_conversations"]  # the two methods' error bars side by side
    for (method, color), shift in zip(((_PROBE, "C0"), ("position-only", "C1")),
                                      (-dodge, dodge)):
        x = np.array([p["n_extracted"] for p in points], dtype=float) + shift
        r = [p["step_accuracy"][method] for p in points]
        est = np.array([v["estimate"] for v in r])
        low, high = np.array([v["low"] for v in r]), np.array([v["high"] for v in r])
        ax.fill_between(x, low, high, color=color, alpha=0.18, lw=0)
        ax.errorbar(x, est, yerr=[est - low, high - est], color=color, marker="o", ms=4,
                    capsize=3, label=f"{method} (95% task-bootstrap CI)")
        final = [i for i, p in enumerate(points) if p["final"]]
        if final:
            ax.plot(x[final], est[final], marker="*", ms=14, color=color, ls="none")
    ax.set_xlim(0, doc["n_conversations"] * 1.03)
    ax.set_ylim(0, 1)
    ax.set_xlabel("conversations extracted (the star: final, all of them)")
    ax.set_ylabel("step accuracy (cross-validated)")
    ax.set_title(f"main job, anytime estimate: {doc['model']}, {doc['subset']}, "
                 f"{doc['n_conversations']} conversations", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main_job_extractor(job, *, verbose=1):
    """The main job's extractor, fitted: every site, its read, prompt and cache.

    Studies that read the main job's cached activations (``examples/benchmark_transfer.py``,
    ``examples/shift_tails.py``) build it here, so their cache keys are the main job's.

    Parameters
    ----------
    job : MainJob
        From :func:`prepare_main_job`.
    verbose : int, default=1

    Returns
    -------
    TurnActivationTransformer
    """
    from ..llm import TurnActivationTransformer

    s = job.settings
    return TurnActivationTransformer(
        s.model, sites=None, read=job.read, prompt=job.template, device=s.device,
        dtype=s.dtype, cache_dir=s.cache_dir or None, batch_size=s.batch_size,
        verbose=verbose).fit(job.conversations)


def _extract(job, log):
    """Every site of every conversation, once, through the cache (resumable), in a
    seeded random order with interim estimates (:class:`_Anytime`).

    Returns the activations of all conversations in input order and the anytime
    state (the plan's cost estimate alone with ``plan_only``).
    """
    s, convs = job.settings, job.conversations
    t = time.perf_counter()
    extractor = main_job_extractor(job)
    estimate = extractor.estimate_cost(convs)
    _say(log, f"extraction plan: all {len(extractor.sites_)} sites of {len(convs)} "
              f"conversations, one forward pass each; {estimate['summary']}.")
    if s.plan_only:
        return estimate, None
    if estimate["n_to_extract"] and s.cache_dir:
        _say(log, f"  every finished conversation is cached in {s.cache_dir} at once: "
                  "interrupt (Ctrl-C) and run the same command again to resume.")
    anytime = _Anytime(job, estimate["n_cached"], log)
    anytime.announce()
    try:
        anytime.run(extractor)
        X_all = extractor.transform(convs)  # in input order; every one a cache hit
    except KeyboardInterrupt:
        left = extractor.estimate_cost(convs, calibrate=False)
        _say(log, f"\ninterrupted: {left['n_cached']} of {len(convs)} conversations are cached"
                  + (f" in {s.cache_dir}; run the same command again to resume (the cached "
                     "ones are read back, not extracted again; the same seeded order goes on)."
                     if s.cache_dir else
                     " in memory only (no --cache-dir): a rerun starts over."))
        anytime.interrupted()
        if anytime.json_path is not None:
            _say(log, f"running estimate so far: {anytime.json_path}")
        raise
    job.times["extraction"] = time.perf_counter() - t - anytime.interim_s
    if anytime.estimates or anytime.skipped:
        job.times["interim estimates"] = anytime.interim_s
    anytime.eta = {"predicted_s": estimate["eta_s"], "measured_s": anytime.extraction_s,
                   "n_extracted": int(estimate["n_to_extract"])}
    stats = anytime.stats
    _say(log, f"extraction: {X_all.n_turns_total} turns x {X_all.n_sites} sites x "
              f"{X_all.n_features} features in {job.times['extraction']:.1f} s "
              f"({stats['n_forward_passes']} forward passes; cache: "
              f"{stats['memory_hits']} memory hits, {stats['disk_hits']} disk hits, "
              f"{stats['misses']} misses) [cache dir: {s.cache_dir or 'none'}]")
    return X_all, anytime


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


def _cv_predictions(job, idx, extractor, selector, n_splits, X=None):
    """Out-of-fold predictions of the probe and the baselines on ``job.conversations[idx]``.

    The one cross-validation of the main job, final (all conversations, 5 folds)
    and interim (those extracted so far, in input order): an outer
    ``GroupKFold(n_splits)`` over their task ids; the configuration as one pipeline
    over conversations, so every fold reads the activations from the cache filled
    by the extraction and fits everything else (position features where the
    configuration has them, C, the site) on its training part only; position-only
    and TF-IDF probes on the same folds with C chosen on inner grouped folds; the
    dummies too when ``X`` (the activations, for their shape) is given. Returns the
    predictions (method -> steps) and the wall times of the probe and baselines.
    """
    s = job.settings
    convs = [job.conversations[i] for i in idx]
    y, groups = job.y[idx], job.groups[idx]
    outer = GroupKFold(n_splits=n_splits)
    probe = make_attribution_pipeline(extractor, selector)
    times = {}
    t = time.perf_counter()
    pred = {_PROBE: cross_val_predict(probe, convs, y, groups=groups, cv=outer)}
    times["cross-validation (probe)"] = time.perf_counter() - t
    if X is not None:
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
            cv=GroupKFold(n_splits=_INNER_SPLITS), n_jobs=s.n_jobs)
        pred[name] = cross_val_predict(search, convs, y, groups=groups, cv=outer,
                                       params={"groups": groups})
    times["cross-validation (baselines)"] = time.perf_counter() - t
    return pred, times


def _cross_validate(job, X_all, extractor, selector, log):
    s, convs, y, groups = job.settings, job.conversations, job.y, job.groups
    X = X_all.select_sites(job.sites)
    what = "one" if job.n_top == 1 else f"the {job.n_top} best (their scores averaged)"
    _say(log, f"cross-validation: outer GroupKFold({_OUTER_SPLITS}) by task id; inside each "
              f"training fold SiteSelector picks {what} of {len(job.sites)} sites "
              f"({', '.join(job.sites)}) and {selector.param_grid} jointly by GroupKFold(5)")
    pred, times = _cv_predictions(job, np.arange(len(convs)), extractor, selector,
                                  _OUTER_SPLITS, X=X)
    job.times.update(times)

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

    **Anytime.** The conversations are extracted in a seeded random order
    (``numpy.random.default_rng(settings.seed).permutation``), chunk by chunk. After
    the first ``settings.anytime_first`` (16; or as many as are cached when a run
    resumes, and on until they span enough tasks for every outer training part to
    keep 5 tasks for the inner search) and then every ``settings.anytime_every``
    (10) more, an *interim estimate* is printed: the final cross-validation (the
    same function, outer ``GroupKFold`` by task id with the site and C search
    inside; fewer outer folds, said, when there are too few tasks for 5) on the
    conversations extracted so far, taken in input order: step accuracy with 95%
    task-bootstrap CIs for the probe, position-only and TF-IDF on the same folds and
    the paired difference probe - position-only. Cadence rule: the first interim
    estimate is always made; a later one only when the interim estimates, this one
    included (its cost predicted from the last one's, scaled by the number of
    conversations), stay within ``settings.anytime_budget`` (20%) of the wall time
    of extraction and interim estimates so far: otherwise it is skipped (said) and
    the next point is tried. The running estimate (each point's n, estimates and CI
    bounds, the final figure last) goes to ``anytime.json`` and ``anytime.png`` in
    ``settings.anytime_out`` or ``<cache_dir>/main-job``. The final figure does not
    depend on any of this: it is computed on the activations of all conversations
    assembled in input order, as before.

    A ``KeyboardInterrupt`` during the extraction or an interim estimate is said
    (how many conversations are cached, the last interim estimate, how to resume)
    and raised again. The final summary line sets the ETA printed before the run
    (:meth:`~skafa.TurnActivationTransformer.estimate_cost`) beside the extraction
    time measured (the chunks' ``transform`` calls, interim estimates excluded).

    Returns
    -------
    result : dict
        ``sites``, ``predictions`` (method -> steps), ``table`` (method -> step /
        agent / within-1 CIs), ``paired`` (probe - always step 1), ``paired_all``
        (probe - each baseline), ``plan``, ``attributor``, ``report``,
        ``attribution``, ``times`` (seconds per step), ``anytime`` (the running
        estimate's document, as written to ``anytime.json``, and its ``json`` and
        ``png`` paths or None) and ``eta`` (``predicted_s``, ``measured_s``,
        ``n_extracted``).
    """
    times = job.times
    X_all, anytime = _extract(job, log)
    if job.settings.plan_only:  # the plan and its cost only: nothing extracted
        return {"plan": job.plan, "estimate": X_all, "sites": job.sites}
    extractor, selector = _configured(job)
    pred, table, diffs = _cross_validate(job, X_all, extractor, selector, log)
    anytime.finish(table, diffs)
    attributor, report, attribution = _attribute(job, extractor, selector, log)
    times["total"] = time.perf_counter() - job.started
    eta = anytime.eta
    line = "\nwall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
    if eta["predicted_s"] is not None:
        ratio = eta["measured_s"] / max(eta["predicted_s"], 1e-9)
        line += (f"; extraction of {eta['n_extracted']} conversations: ETA "
                 f"{_fmt_s(eta['predicted_s'])} predicted before the run, "
                 f"{_fmt_s(eta['measured_s'])} measured (measured/predicted {ratio:.2f})")
    _say(log, line)
    doc = anytime.document()
    doc.update(json=None if anytime.json_path is None else str(anytime.json_path),
               png=None if anytime.png_path is None or not anytime.png_path.exists()
               else str(anytime.png_path))
    return {"sites": job.sites, "predictions": pred, "table": table,
            "paired": diffs["always step 1"], "paired_all": diffs, "plan": job.plan,
            "attributor": attributor, "report": report, "attribution": attribution,
            "times": times, "anytime": doc, "eta": eta}
