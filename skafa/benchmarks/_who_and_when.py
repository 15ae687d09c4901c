"""The Who&When benchmark: probes next to honest baselines, nested CV, bootstrap CIs.

Every method is evaluated on the SAME outer folds
(:func:`skafa.model_selection.outer_splits`); every choice a method makes (site, C,
configuration) is made on inner grouped folds of the outer training part only.
Reported per method: exact step accuracy, Who&When's lenient step accuracy (its own
script's rule, the published papers' metric), agent accuracy (three matching rules),
within-1 accuracy, mean absolute step shift, n, 95% task-clustered bootstrap CIs, and
paired differences against the best baseline.

:func:`run_benchmark` runs either the plain comparison or (``preregistered=True``) the
pre-registered one of docs/benchmarks.md section 3 on one (model, subset) cell and
writes ``<tag>_<subset>.json`` / ``.md`` (``prereg_`` prefixed) to ``settings.out``.
``examples/benchmark_who_and_when.py`` is its command line.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import GroupKFold, cross_val_score

from ..baselines import DummyStepClassifier
from ..compose import SiteConcatenator, make_attribution_pipeline
from ..configurations import (
    LOGISTIC_CS,
    PREREGISTERED_PROBES,
    PREREGISTERED_READS,
    STACK_ID,
    configuration_names,
)
from ..features import TurnFeatures
from ..featurizers import TurnPositionTransformer, TurnTextTransformer
from ..llm import (
    PromptTemplate,
    TurnActivationTransformer,
    context_length,
    cpu_description,
    known_models,
    load_model,
    parse_site_spec,
    plan,
    resolve_dtype,
)
from ..model_selection import (
    PREREGISTERED_HEADLINE,
    FoldResultStore,
    SiteSelector,
    TurnScoreStacker,
    grid_search_C,
    make_probe,
    method_table,
    outer_splits,
    paired_differences,
    preregistered_rule,
    select_single_and_top,
    summarize_predictions,
    write_json,
)
from ..probes import GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier
from ..utils.progress import Timer
from ..utils.signals import stop_requests
from ._peers import (
    JUDGE,
    PLAIN_CHAT_TEMPLATE,
    attention_note,
    judge_from_result,
    judge_predictions,
    mi4afa_activations,
    mi4afa_fold,
    mi4afa_setup,
    peer_cost,
)

__all__ = ["AUTO", "MI4AFA", "BenchmarkSettings", "plain_markdown", "plot_site_curves",
           "preregistered_deviations", "preregistered_markdown", "preregistered_names",
           "run_benchmark"]

#: The pre-registered rule's row (rule step 1 applied in every outer fit).
AUTO = PREREGISTERED_HEADLINE
#: The reference implementation's row.
MI4AFA = "mi4afa ProbeAttributor (ag2 1.2.1)"
_DUMMIES = ("first", "most_frequent", "most_frequent_relative", "uniform")
_LABELS = {"smollm2": "SmolLM2-135M-Instruct"}


@dataclasses.dataclass
class BenchmarkSettings:
    """Every setting of one benchmark cell (the command line's options).

    ``smoke=True`` marks a model registered in this process only (a test's tiny
    model): extraction and stacking then run in this process, the file stem is
    ``smoke`` and every choice's inner curve is kept in the result.
    """

    model: str = "smollm2"
    tag: str | None = None
    subset: str = "Algorithm-Generated"
    limit: int | None = None
    cache_dir: str | None = None
    out: str = "docs/results"
    max_prompt_tokens: int = 8192
    folds: int = 5
    inner_folds: int = 5
    repeats: int = 3
    Cs: list = dataclasses.field(default_factory=lambda: [0.001, 0.01, 0.1])
    sites: str = "all"
    read: str = "last"
    n_jobs: int | None = 1
    n_resamples: int = 2000
    dtype: str = "auto"
    no_judge: bool = False
    preregistered: bool = False
    reads: list = dataclasses.field(default_factory=lambda: list(PREREGISTERED_READS))
    no_stack: bool = False
    no_mi4afa: bool = False
    peer_n: int = 5
    judge_from: str | None = None
    extract_only: bool = False
    resume: bool = False
    smoke: bool = False
    command: str = ""
    #: set by the run: the sites the probes searched, and how a reused judge was checked
    probe_sites: list | None = None
    judge_note: str | None = None


@contextlib.contextmanager
def _timed(times, key):
    """Add the seconds of the ``with`` block to ``times[key]``."""
    with Timer("benchmark", None) as t:
        yield
    times[key] = times.get(key, 0.0) + t.elapsed


def _say(log, message):
    if log is not None:
        log(message)


def _sigterm_as_interrupt():
    """While active, SIGTERM stops the run as Ctrl-C does (``KeyboardInterrupt``).

    A long benchmark started with ``nohup ... &`` ignores Ctrl-C's SIGINT, and
    ``kill``'s SIGTERM would end it without running any ``finally`` block: the
    grafted judge's temporary KV folder in the cache would stay behind. This is
    :func:`skafa.utils.signals.stop_requests`: the signal raises
    :class:`~skafa.utils.signals.StopRequested` (a ``KeyboardInterrupt``) and is
    recorded, so a read it interrupts is not taken for a damaged file. Outside the
    main thread (where no handler can be set) this does nothing.
    """
    return stop_requests()


def _machine():
    import torch

    return (f"{os.cpu_count()} CPU cores, {cpu_description()}, {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def model_tag(model):
    """A model's name in tables and result file names (when no ``--tag`` is given).

    A known short name as is (``"qwen2.5-coder-0.5b"``); a file or folder: its name,
    without ``.gguf``. Dots are kept: cutting at the first one would name every
    Qwen2.5 reader ``qwen2`` and write the 0.5B and 1.5B results into one file.

    Examples
    --------
    >>> model_tag("qwen2.5-coder-1.5b")
    'qwen2.5-coder-1.5b'
    >>> model_tag("/models/qwen2.5-coder-0.5b-instruct.gguf")
    'qwen2.5-coder-0.5b-instruct'
    """
    name = str(model)
    if name.lower() in known_models():
        return name.lower()
    base = Path(name).name
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def _open_cell(settings, conversations):
    """A cell's records, their labels and task ids, the loaded model, its context and
    the prompt budget: ``(convs, tag, y, groups, model, tokenizer, ctx, budget)``."""
    convs = list(conversations)
    tag = settings.tag or model_tag(settings.model)
    y = np.array([c.mistake_step for c in convs])
    groups = np.array([c.task_id for c in convs], dtype=object)
    # "auto" is resolved once, so that tables, result files and cache keys name
    # the dtype that ran (bfloat16 on CUDA and bf16-unit CPUs, else float32).
    settings.dtype = resolve_dtype(settings.dtype, model=settings.model)
    cache_dir = getattr(settings, "cache_dir", None)  # a GGUF model converted once, beside it
    model, tokenizer = load_model(settings.model, dtype=settings.dtype,
                                  convert_dir=os.path.join(cache_dir, "models")
                                  if cache_dir else None)
    ctx = context_length(model)
    return convs, tag, y, groups, model, tokenizer, ctx, min(ctx, settings.max_prompt_tokens)


def prereg_store_signature(model_identity, read, template, budget, sites, settings, convs,
                           y):
    """The signature of §3's per-read fit store ``prereg_<tag>_<subset>.partial-<read>.json``.

    Everything its stored outer fits depend on: the model, the read, the prompt and
    its budget, the searched sites, the configurations, the folds, the dtype and the
    records with their labels (``settings`` gives ``folds``, ``inner_folds`` and
    ``dtype``).
    """
    return {"model": model_identity, "read": read, "prompt": template.fingerprint(),
            "budget": budget, "sites": list(sites),
            "probes": [list(map(str, p)) for p in PREREGISTERED_PROBES],
            "stack": STACK_ID, "folds": settings.folds, "inner_folds": settings.inner_folds,
            "dtype": settings.dtype, "record_ids": [c.record_id for c in convs],
            "y": [int(v) for v in y]}


def _folds(splits, desc):
    from tqdm.auto import tqdm

    return tqdm(splits, desc=desc, unit="outer fit")


# ------------------------------------------------------------------ baselines
def _baseline_fold(convs, y, groups, train, test, settings, judge_pred, Cs):
    """Position-only, TF-IDF (C on inner folds), the dummies and the judge."""
    out = {}
    ctr, cte = [convs[i] for i in train], [convs[i] for i in test]
    ytr, gtr = y[train], groups[train]
    kw = dict(inner=settings.inner_folds, n_jobs=settings.n_jobs, random_state=0)
    pos = TurnPositionTransformer().fit(ctr)
    gs = grid_search_C(pos.transform(ctr), ytr, gtr, Cs=Cs, **kw)
    out["position-only"] = (gs.predict(pos.transform(cte)), {"C": gs.best_params_["C"]})
    txt = TurnTextTransformer().fit(ctr)
    gs = grid_search_C(txt.transform(ctr), ytr, gtr, Cs=Cs, **kw)
    out["TF-IDF"] = (gs.predict(txt.transform(cte)), {"C": gs.best_params_["C"]})
    for strategy in _DUMMIES:
        d = DummyStepClassifier(strategy=strategy, random_state=0).fit(ctr, ytr)
        out[f"dummy: {strategy}"] = (d.predict(cte), {})
    if judge_pred is not None:
        out[JUDGE] = (judge_pred[test], {})
    return out


def _collect(preds, infos, r, k, test, n, out):
    for name, (pred, info) in out.items():
        preds.setdefault(name, {}).setdefault(r, np.full(n, -1))[test] = pred
        infos.append({"repeat": r, "fold": k, "method": name, **info})


def _stack(preds):
    return {name: np.stack([by_r[r] for r in sorted(by_r)]) for name, by_r in preds.items()}


# --------------------------------------------------------------- plain comparison
def _plain_fold(convs, A, y, groups, train, test, settings, judge_pred, multi_sites, times):
    """Fit every method of the plain comparison on ``train``; predict ``test``."""
    out = {}
    ctr, cte = [convs[i] for i in train], [convs[i] for i in test]
    ytr, gtr = y[train], groups[train]
    Atr, Ate = A[train], A[test]

    def select(Xtr):
        return SiteSelector(make_probe("logistic", 1.0), sites=settings.probe_sites,
                            cv=GroupKFold(settings.inner_folds), n_jobs=settings.n_jobs,
                            param_grid={"C": sorted(settings.Cs)}).fit(Xtr, ytr, groups=gtr)

    with _timed(times, "cv_probe"):
        sel = select(Atr)
        out["probe"] = (sel.predict(Ate), {
            "site": sel.best_site_, "C": sel.best_params_["C"],
            "inner_curve": sel.cv_results_["mean_test_score"][sel.cv_results_["param_C"]
                                                              == sel.best_params_["C"]]
            .tolist()})
    with _timed(times, "cv_probe_position"):
        pos = TurnPositionTransformer().fit(ctr)
        Ptr, Pte = pos.transform(ctr), pos.transform(cte)
        sel = select(TurnFeatures.concatenate([Atr, Ptr], prefixes=["act", "pos"]))
        out["probe + position"] = (
            sel.predict(TurnFeatures.concatenate([Ate, Pte], prefixes=["act", "pos"])),
            {"site": sel.best_site_, "C": sel.best_params_["C"]})
    with _timed(times, "cv_multisite"):
        cat = SiteConcatenator(multi_sites).fit(Atr)
        gs = grid_search_C(cat.transform(Atr), ytr, gtr, Cs=settings.Cs,
                           inner=settings.inner_folds, n_jobs=settings.n_jobs, random_state=0)
        out["multi-site probe"] = (gs.predict(cat.transform(Ate)), {"C": gs.best_params_["C"]})
    with _timed(times, "cv_baselines"):
        out.update(_baseline_fold(convs, y, groups, train, test, settings, None, settings.Cs))
    if judge_pred is not None:
        out[JUDGE] = (judge_pred[test], {})
    return out


def _site_curve_oof(A, y, splits, C):
    """Outer-fold accuracy of every single site at fixed C (optimistic if used to choose)."""
    acc = np.zeros(A.n_sites)
    for j, site in enumerate(A.sites):
        As = A.select_sites(site)
        correct = []
        for train, test in splits:
            est = GroupedArgmaxLogisticClassifier(C=C, random_state=0).fit(As[train], y[train])
            correct.append(est.predict(As[test]) == y[test])
        acc[j] = np.mean(np.concatenate(correct))
    return acc


def plain_markdown(result):
    """The plain comparison's tables (markdown)."""
    s = result["summary"]
    lines = [
        f"### {result['model_label']} on Who&When {result['subset']} "
        f"(n = {result['n_conversations']} conversations)", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; {result['date']}.  ",
        f"Outer CV: GroupKFold({result['folds']}) by task id x {result['repeats']} shuffles; "
        f"inner CV: GroupKFold({result['inner_folds']}); C grid {result['Cs']}; "
        f"sites searched: {result.get('site_search', 'all')} "
        f"({len(result.get('probe_sites', result['sites']))}); "
        f"turn vectors read at: {result.get('read', 'last')} (`read=` of the extractor).  ",
        f"Prompt: {result['prompt_note']}", "",
    ]
    order = sorted((k for k in s if not k.startswith("_")),
                   key=lambda k: -s[k]["step_accuracy"]["estimate"])
    lines += method_table(s, [("", order)])
    lines += ["", f"Uniform random guess, expected step accuracy: "
                  f"{100 * s['_uniform_expected']:.1f}%.", ""]
    lines += ["Paired differences in step accuracy (same conversations, same folds; "
              f"best baseline = **{result['best_baseline']}**):", "",
              "| comparison | difference, points [95% CI] |", "|---|---|"]
    lines += _paired_rows(result["paired"])
    lines += ["", "Chosen settings across the outer fits: " + result["choices_note"], "",
              f"Context: {result['context_note']}", "",
              "Wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in result["times"].items()),
              ""]
    return "\n".join(lines)


def _paired_rows(paired):
    return [f"| {k} | {100 * r['estimate']:+.1f} [{100 * r['low']:+.1f}, "
            f"{100 * r['high']:+.1f}] |" for k, r in paired.items()]


def plot_site_curves(result, path, log=None):
    """The per-site accuracy curve as a PNG; None (said through ``log``) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say(log, "matplotlib not installed: no plot (pip install 'skafa[plot]')")
        return None
    sites = result["sites"]
    x = np.arange(len(sites))
    fig, ax = plt.subplots(figsize=(11, 4))
    xi = [sites.index(s) for s in result.get("probe_sites", sites)]
    ax.plot(xi, 100 * np.array(result["site_curve_inner"]), marker=".", label="inner-CV step "
            "accuracy (mean over outer fits; what SiteSelector saw)")
    ax.plot(x, 100 * np.array(result["site_curve_oof"]), label="outer-fold step accuracy "
            "per fixed site (optimistic if used to choose)", alpha=0.8)
    for name, style in (("position-only", ":"), ("dummy: most_frequent", "--")):
        if name in result["summary"]:
            ax.axhline(100 * result["summary"][name]["step_accuracy"]["estimate"],
                       ls=style, color="gray", label=name)
    step = max(1, len(sites) // 20)
    ax.set_xticks(x[::step])
    ax.set_xticklabels([sites[i] for i in x[::step]], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("step accuracy (%)")
    read = result.get("read", "last")
    ax.set_title(f"{result['model_label']} - Who&When {result['subset']}: accuracy per site"
                 + ("" if read == "last" else f" (read={read})"))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _run_plain(settings, convs, y, groups, ctx, budget, template, context_note, tag,
               subset_label, times, log):
    with _timed(times, "extraction"):
        acts = TurnActivationTransformer(
            model=settings.model, read=settings.read, prompt=template, dtype=settings.dtype,
            cache_dir=settings.cache_dir, n_jobs=None if settings.smoke else settings.n_jobs,
            verbose=1).fit(convs)
        A = acts.transform(convs)
    n_fwd = acts.run_stats["n_forward_passes"]
    _say(log, f"extraction: {A} in {times['extraction']:.0f}s, forward passes {n_fwd}")

    judge_pred = None
    if not settings.no_judge:
        with _timed(times, "judge"):
            # The judge appends its answer ("Step: <n>") to the prompt, so it needs a few
            # tokens of room: prompts at the budget are shortened 16 tokens further for it.
            judge_template = PromptTemplate(shorten="middle_first",
                                            max_prompt_tokens=min(budget, ctx - 16))
            judge_pred = judge_predictions(settings, convs, judge_template, settings.cache_dir)
        _say(log, f"judge: {times['judge']:.0f}s")

    L = acts.n_layers_
    settings.probe_sites = list(parse_site_spec(settings.sites, L))  # all sites were read
    multi_sites = list(dict.fromkeys([f"resid_pre.{L // 4}", f"resid_pre.{L // 2}",
                                      f"resid_pre.{3 * L // 4}", "resid_final"]))
    splits = outer_splits(y, groups, n_folds=settings.folds, n_repeats=settings.repeats)
    preds, infos = {}, []
    for r, k, train, test in _folds(splits, "nested CV"):
        out = _plain_fold(convs, A, y, groups, train, test, settings, judge_pred,
                          multi_sites, times)
        _collect(preds, infos, r, k, test, len(y), out)
        _say(log, f"repeat {r} fold {k}: probe site {out['probe'][1]['site']} "
                  f"C={out['probe'][1]['C']}")
    preds = _stack(preds)
    kw = dict(n_resamples=settings.n_resamples, random_state=0)
    summary, per_conv = summarize_predictions(preds, y, convs, groups, **kw)

    probes = ["probe", "probe + position", "multi-site probe"]
    baselines = [k for k in preds if k not in probes]
    best_baseline = max(baselines, key=lambda k: summary[k]["step_accuracy"]["estimate"])
    judge = [k for k in preds if k.startswith("PromptedJudge")]
    pairs = [(p, b) for p in probes
             for b in dict.fromkeys([best_baseline, "position-only", *judge])]
    paired_res = paired_differences(per_conv, pairs, groups, **kw)

    inner = np.mean([i["inner_curve"] for i in infos if i["method"] == "probe"], axis=0)
    chosen_C = [i["C"] for i in infos if i["method"] == "probe"]
    C_mode = max(set(chosen_C), key=chosen_C.count)
    with _timed(times, "site_curve"):
        oof = _site_curve_oof(A, y, [(tr, te) for *_, tr, te in splits[: settings.folds]],
                              C_mode)

    def choices(method, key):
        vals = [str(i[key]) for i in infos if i["method"] == method and key in i]
        return ", ".join(f"{v} x{vals.count(v)}" for v in dict.fromkeys(vals))

    choices_note = "; ".join([
        f"probe site: {choices('probe', 'site')}", f"probe C: {choices('probe', 'C')}",
        f"probe+position site: {choices('probe + position', 'site')}",
        f"multi-site sites {multi_sites}, C: {choices('multi-site probe', 'C')}",
        f"position-only C: {choices('position-only', 'C')}",
        f"TF-IDF C: {choices('TF-IDF', 'C')}",
    ])
    return {
        "model": str(settings.model), "model_label": _LABELS.get(settings.model, tag),
        "tag": tag, "subset": subset_label,
        "n_conversations": len(convs), "folds": settings.folds,
        "inner_folds": settings.inner_folds, "repeats": settings.repeats, "Cs": settings.Cs,
        "site_search": settings.sites, "command": settings.command,
        "read": settings.read, "dtype": settings.dtype, "machine": _machine(),
        "date": time.strftime("%Y-%m-%d"),
        "prompt_note": f"`PromptTemplate(shorten='middle_first', max_prompt_tokens={budget})`, "
                       f"fingerprint {template.fingerprint()[:12]}"
                       + ("" if settings.no_judge or budget <= ctx - 16 else
                          f"; the judge's prompts are capped at {ctx - 16} tokens to leave "
                          "room for its answer"),
        "context_note": context_note, "n_forward_passes": int(n_fwd),
        "sites": list(A.sites), "probe_sites": settings.probe_sites,
        "site_curve_inner": inner.tolist(),
        "site_curve_oof": oof.tolist(), "site_curve_oof_C": C_mode,
        "summary": summary, "best_baseline": best_baseline, "paired": paired_res,
        "choices_note": choices_note, "choices": infos if settings.smoke else [
            {k: v for k, v in i.items() if k != "inner_curve"} for i in infos],
        "times": None,
        # Per-conversation predictions (repeat x conversation), so that two runs on the
        # same records (e.g. --read last vs mean) can be compared pairwise later.
        "record_ids": [c.record_id for c in convs],
        "y_true": [int(v) for v in y], "task_ids": [str(g) for g in groups],
        "predictions": {k: np.asarray(v).astype(int).tolist() for k, v in preds.items()},
    }


# ------------------------------------------------------ pre-registered comparison
# The configurations and the rule are fixed in docs/benchmarks.md, section 3
# ("Beat position: the pre-registered comparison"), committed before any run, and
# defined once in skafa.configurations (also what FailureAttributor's default is built from).
def preregistered_names(reads=PREREGISTERED_READS):
    """The 27 configuration names in the pre-registered order (the tie-break order)."""
    return configuration_names(reads)


def _make_stacker(extractor, probe_sites, inner):
    """Configuration 9: stacking of probe, position and TF-IDF turn scores."""
    probe = make_attribution_pipeline(
        clone(extractor),
        SiteSelector(GroupedSoftmaxClassifier(C=0.1), sites=probe_sites,
                     cv=GroupKFold(min(3, inner))))
    position = make_attribution_pipeline(TurnPositionTransformer(),
                                         GroupedArgmaxLogisticClassifier(C=0.1))
    tfidf = make_attribution_pipeline(TurnTextTransformer(),
                                      GroupedArgmaxLogisticClassifier(C=0.1))
    return TurnScoreStacker([("probe", probe), ("position", position), ("tfidf", tfidf)],
                            final_estimator=GroupedSoftmaxClassifier(C=1.0),
                            cv=GroupKFold(inner))


def _prereg_read_fold(read, convs, A, extractor, y, groups, train, test, settings, times,
                      names):
    """The pre-registered configurations ``names`` of one read on one outer fit.

    Returns ``{name: (test predictions, inner score, info)}``.
    """
    out = {}
    ctr, cte = [convs[i] for i in train], [convs[i] for i in test]
    ytr, gtr = y[train], groups[train]
    kw = dict(inner=settings.inner_folds, n_jobs=settings.n_jobs, random_state=0)
    pos = TurnPositionTransformer().fit(ctr)
    Ptr, Pte = pos.transform(ctr), pos.transform(cte)
    blocks = {"acts": (A[train], A[test])}
    blocks["acts+pos"] = tuple(TurnFeatures.concatenate([a, p], prefixes=["act", "pos"])
                               for a, p in zip(blocks["acts"], (Ptr, Pte)))
    # configurations 1/3, 2/4, 5/7 and 6/8 differ only in n_sites: fitted together
    pairs = {}
    for pid, kind, Cs, n_sites, fset in PREREGISTERED_PROBES:
        pairs.setdefault((kind, tuple(Cs), fset), {})[n_sites] = f"{read}: {pid}"
    for (kind, Cs, fset), by_k in pairs.items():
        if not set(by_k.values()) & set(names):
            continue
        with _timed(times, f"cv {kind}"):
            Xtr, Xte = blocks[fset]
            (k_top,) = set(by_k) - {1}
            got = select_single_and_top(Xtr, ytr, gtr, Xte, Cs=Cs, sites=settings.probe_sites,
                                        n_sites=k_top, estimator=kind, **kw)
            for k, name in by_k.items():
                out[name] = got[k]
    name = f"{read}: {STACK_ID}"
    if not settings.no_stack and name in names:
        with _timed(times, "cv stack"):
            # The inner folds, and the final fit's out-of-fold base fits, run in parallel
            # (each fit is deterministic, so the result does not depend on n_jobs). A
            # model registered in this process (smoke) is not seen by workers: serial.
            n_jobs = None if settings.smoke else settings.n_jobs
            stk = _make_stacker(extractor, settings.probe_sites, settings.inner_folds)
            inner = cross_val_score(stk, ctr, ytr, groups=gtr,
                                    cv=GroupKFold(settings.inner_folds),
                                    params={"groups": gtr}, n_jobs=n_jobs)
            stk.set_params(n_jobs=n_jobs).fit(ctr, ytr, groups=gtr)
            out[name] = (stk.predict(cte), float(np.mean(inner)), {})
    return out


def preregistered_deviations(settings, *, choice_only=False):
    """How a run differs from the comparison fixed in docs/benchmarks.md section 3.

    ``choice_only``: only the deviations that can change rule step 1's choices (the
    configurations run, their sites, folds, records and dtype); a reused judge or a
    missing judge / mi4afa row changes a comparison row, never a choice.
    """
    out = []
    missing = [r for r in PREREGISTERED_READS if r not in settings.reads]
    if missing:
        n = len(preregistered_names(settings.reads)) - (
            len(settings.reads) if settings.no_stack else 0)
        out.append(f"reads {', '.join(missing)} not run: {n} of "
                   f"{len(preregistered_names())} configurations, so the rule chose among "
                   "these only")
    elif settings.no_stack:
        out.append("configuration 9 (stacking) not run (--no-stack)")
    if settings.sites != "stride:3":
        out.append(f"sites {settings.sites!r} instead of 'stride:3'")
    if (settings.folds, settings.inner_folds, settings.repeats) != (5, 5, 3):
        out.append(f"GroupKFold({settings.folds}) x {settings.repeats} shuffles, inner "
                   f"GroupKFold({settings.inner_folds}) instead of 5 x 3, inner 5")
    if settings.limit:
        out.append(f"first {settings.limit} records only (--limit)")
    if settings.dtype != "float32":
        out.append(f"model in {settings.dtype} instead of float32 (every row that reads the "
                   f"model: probes, judge, mi4afa)")
    if choice_only:
        return out
    if settings.judge_from:
        out.append(getattr(settings, "judge_note", None)
                   or f"judge reused from {settings.judge_from}")
    elif settings.no_judge:
        out.append("no PromptedJudge row (--no-judge)")
    if settings.no_mi4afa:
        out.append("no mi4afa row (--no-mi4afa)")
    return out


def preregistered_markdown(result):
    """The pre-registered comparison's tables (markdown)."""
    s = result["summary"]
    devs = result.get("deviations")
    lines = [
        f"### Pre-registered: {result['model_label']} on Who&When {result['subset']} "
        f"(n = {result['n_conversations']})", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; {result['date']}.  ",
        f"Prompt budget {result['budget']} tokens (context {result['context']}); "
        + "; ".join(result["shortening"].values()) + ".  ",
        f"Sites searched: {', '.join(result['probe_sites'])}.", "",
        *([(("**Deviations from section 3 (they can change rule step 1's choices):** "
              if result.get("choice_deviations", devs)
              else "**Deviations from section 3 (no choice of rule step 1 is affected):** ")
             + "; ".join(devs) + "."), ""] if devs else
          ["Complete: every configuration and baseline of section 3.", ""]),
    ]
    # every baseline (position-only, TF-IDF, the dummies, the judge, mi4afa)
    base = [k for k in s if not k.startswith("_") and k != AUTO and k not in result["order"]]
    fixed = [k for k in result["order"] if k in s]
    lines += method_table(s, [("", [AUTO]),
                              ("", sorted(base, key=lambda k: -s[k]["step_accuracy"]
                                          ["estimate"])),
                              ("fixed configuration: ", fixed)])
    lines += ["", f"Best baseline (highest outer accuracy, favours the baseline): "
                  f"**{result['best_baseline']}**.", "",
              "| paired difference in step accuracy | points [95% CI] |", "|---|---|"]
    lines += _paired_rows(result["paired"])
    lines += ["", "Configurations chosen by the rule (outer fits): "
              + ", ".join(f"{k} x{v}" for k, v in result["auto_choices"].items()), ""]
    if result.get("mi4afa"):
        lines += [f"mi4afa: {json.dumps(result['mi4afa'])}", ""]
    lines += ["Wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in result["times"].items()),
              ""]
    return "\n".join(lines)


def _run_preregistered(settings, convs, y, groups, model, tokenizer, ctx, budget, tag,
                       subset_label, times, log):
    """The pre-registered comparison of docs/benchmarks.md section 3, on one cell."""
    total_chars = sum(sum(len(t.content) for t in c.turns) for c in convs)
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    feats, extractors, notes = {}, {}, {}
    for read in settings.reads:
        shortened = plan(convs, tokenizer, template, max_tokens=budget, read=read)
        removed = int(shortened.total_chars_removed)
        notes[read] = (f"read={read}: {int(sum(r['chars_removed'] > 0 for r in shortened))} "
                       f"of {len(convs)} conversations shortened, {removed:,} of "
                       f"{total_chars:,} turn characters removed "
                       f"({100 * removed / max(total_chars, 1):.1f}%)")
        _say(log, notes[read])
        extractors[read] = TurnActivationTransformer(
            model=settings.model, read=read, prompt=template, dtype=settings.dtype,
            cache_dir=settings.cache_dir, n_jobs=None if settings.smoke else settings.n_jobs,
            verbose=1).fit(convs)

    def features(read):
        """The read's turn vectors, extracted (or read from the cache) on first use."""
        if read not in feats:
            plan_ = extractors[read].estimate_cost(convs)  # the ETA first: hours on 1.5B
            _say(log, f"extraction plan, read={read}: {plan_['summary']}")
            with _timed(times, f"extraction {read}"):
                feats[read] = extractors[read].transform(convs)
        return feats[read]

    if settings.extract_only or not settings.resume:  # resume: stored reads not extracted
        for read in settings.reads:
            features(read)
    L = extractors[settings.reads[0]].n_layers_
    probe_sites = list(parse_site_spec(settings.sites, L))  # the extraction read all sites
    settings.probe_sites = probe_sites
    stem = f"prereg_{tag}_{subset_label}"

    judge_pred = None
    if settings.judge_from:
        judge_pred, settings.judge_note = judge_from_result(settings, convs, template)
    elif not settings.no_judge:
        with _timed(times, "judge"):
            judge_template = PromptTemplate(shorten="middle_first",
                                            max_prompt_tokens=min(budget, ctx - 16))
            judge_store = (Path(settings.out) / f"{stem}.partial-judge.json"
                           if settings.resume else None)
            judge_pred = judge_predictions(settings, convs, judge_template,
                                           settings.cache_dir, store=judge_store)

    peer = None
    if not settings.no_mi4afa:
        with _timed(times, "extraction mi4afa"):
            layers = [int(s.split(".")[1]) for s in probe_sites if s.startswith("resid_pre.")]
            ext_m, peer_convs, n_extra = mi4afa_setup(model, tokenizer, convs, template,
                                                      layers, L)
            model_key = json.dumps(extractors[settings.reads[0]].model_identity_,
                                   sort_keys=True, default=str)
            m_acts, m_seconds, m_recorded = mi4afa_activations(
                ext_m, peer_convs, settings.cache_dir, model_key, dtype=settings.dtype)
        peer = {"n_shortened_further": int(n_extra), "extraction_seconds_uncached": m_seconds,
                "prompt_rendering": ("skafa's plain-text rendering as mi4afa's chat template "
                                     "(the tokenizer has none)"
                                     if ext_m.tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
                                     else "chat template"),
                "extraction_seconds_all_records": round(m_recorded, 1)}
    if settings.extract_only:
        _say(log, f"extract-only: activations cached ({', '.join(settings.reads)}"
                  f"{'' if settings.no_mi4afa else ', mi4afa'}); times {times}")
        return {"extract_only": True, "times": dict(times)}
    if peer is not None and settings.peer_n:
        peer["cost"] = peer_cost(settings, convs, template, ext_m, peer_convs)

    names = preregistered_names(settings.reads)
    stores = {}
    if settings.resume:
        for read in settings.reads:
            sig = prereg_store_signature(extractors[read].model_identity_, read, template,
                                         budget, probe_sites, settings, convs, y)
            stores[read] = FoldResultStore(Path(settings.out) / f"{stem}.partial-{read}.json",
                                           sig)
    preds, infos = {}, []
    splits = outer_splits(y, groups, n_folds=settings.folds, n_repeats=settings.repeats)
    for r, k, train, test in _folds(splits, "pre-registered nested CV"):
        with Timer("benchmark", None) as fold_time:
            fold = {}
            for read in settings.reads:
                want = [n for n in names if n.startswith(f"{read}: ")
                        and not (settings.no_stack and n.endswith(STACK_ID))]
                done = {}
                if read in stores:
                    stores[read].check(r, k, len(test))
                    done = stores[read].get(r, k)
                todo = [n for n in want if n not in done]
                new = (_prereg_read_fold(read, convs, features(read), extractors[read], y,
                                         groups, train, test, settings, times, todo)
                       if todo else {})
                if new and read in stores:
                    stores[read].put(r, k, new)
                fold.update({n: (done.get(n) or new[n]) for n in want})
            fold[AUTO] = preregistered_rule(fold, names)
            out = {n: (p, {**info, "inner_score": s}) for n, (p, s, info) in fold.items()}
            out.update(_baseline_fold(convs, y, groups, train, test, settings, judge_pred,
                                      LOGISTIC_CS))
            if peer is not None:
                out[MI4AFA] = mi4afa_fold(ext_m, m_acts, train, test)
            _collect(preds, infos, r, k, test, len(y), out)
        _say(log, f"repeat {r} fold {k}: auto chose {out[AUTO][1]['chosen']} "
                  f"({fold_time.elapsed:.0f}s)")
    preds = _stack(preds)
    kw = dict(n_resamples=settings.n_resamples, random_state=0)
    summary, per_conv = summarize_predictions(preds, y, convs, groups, **kw)

    baselines = ["position-only", "TF-IDF", *[k for k in preds if k.startswith("dummy: ")],
                 *[k for k in preds if k.startswith("PromptedJudge")]]
    best_baseline = max(baselines, key=lambda k: summary[k]["step_accuracy"]["estimate"])
    others = [k for k in preds if k.startswith("PromptedJudge") or k.startswith("mi4afa")]
    pairs = [(AUTO, b) for b in dict.fromkeys([best_baseline, "position-only", "TF-IDF",
                                               *others])]
    paired_res = paired_differences(per_conv, pairs, groups, **kw)
    chosen = [i["chosen"] for i in infos if i["method"] == AUTO]
    return {
        "preregistered": True, "model": str(settings.model), "tag": tag,
        "subset": subset_label, "model_label": _LABELS.get(settings.model, tag),
        "n_conversations": len(convs), "folds": settings.folds,
        "inner_folds": settings.inner_folds, "repeats": settings.repeats,
        "command": settings.command, "reads": list(settings.reads),
        "probe_sites": probe_sites, "budget": budget, "context": ctx,
        "shortening": notes, "mi4afa": peer,
        "deviations": preregistered_deviations(settings),
        "attention": attention_note(model), "dtype": settings.dtype,
        "choice_deviations": preregistered_deviations(settings, choice_only=True),
        "machine": _machine(), "date": time.strftime("%Y-%m-%d"),
        "summary": summary, "best_baseline": best_baseline, "paired": paired_res,
        "auto_choices": {n: chosen.count(n) for n in names if n in chosen}, "order": names,
        "choices": infos, "times": None,
        "record_ids": [c.record_id for c in convs],
        "y_true": [int(v) for v in y], "task_ids": [str(g) for g in groups],
        "predictions": {k: np.asarray(v).astype(int).tolist() for k, v in preds.items()},
    }


# ------------------------------------------------------------------------- entry
def run_benchmark(settings, conversations, *, subset_label=None, log=None):
    """Run one benchmark cell and write its result files.

    Parameters
    ----------
    settings : BenchmarkSettings
        (``settings.preregistered`` picks the pre-registered comparison.)
    conversations : list of Conversation
        Labelled records (``mistake_step``, ``mistake_agent``, ``task_id``).
    subset_label : str, default=None
        Name in tables and file names (default ``settings.subset``).
    log : callable, default=None
        Called with each progress line (e.g. ``print``); None: silent. Long loops
        also show a tqdm bar with its ETA.

    Returns
    -------
    result : dict
        What ``<out>/<stem>.json`` holds (``{"extract_only": True, "times"}``
        with ``settings.extract_only``).
    """
    times = {}
    with Timer("benchmark", None) as total:
        subset_label = subset_label or settings.subset
        # ---- prompt budget and the conversations that do not fit
        convs, tag, y, groups, model, tokenizer, ctx, budget = _open_cell(settings,
                                                                          conversations)
        raw = plan(convs, tokenizer, PromptTemplate(), max_tokens=ctx, read=settings.read)
        over_ctx = int(sum(not r["fits"] for r in raw))
        over_budget = int(sum(r["n_tokens"] > budget for r in raw))
        template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
        shortened = plan(convs, tokenizer, template, max_tokens=budget, read=settings.read)
        n_short = int(sum(r["chars_removed"] > 0 for r in shortened))
        total_chars = sum(sum(len(t.content) for t in c.turns) for c in convs)
        removed = int(shortened.total_chars_removed)
        context_note = (
            f"model context {ctx} tokens, prompt budget {budget}. Unshortened, {over_ctx} of "
            f"{len(convs)} prompts exceed the context and {over_budget} exceed the budget; "
            f"policy `PromptTemplate(shorten='middle_first', max_prompt_tokens={budget})` "
            f"shortened {n_short} conversations, removing {removed:,} of {total_chars:,} turn "
            f"characters ({100 * removed / max(total_chars, 1):.1f}%). Nothing was dropped.")
        _say(log, context_note)
        if settings.preregistered:
            tag = "smoke" if settings.smoke else tag
            result = _run_preregistered(settings, convs, y, groups, model, tokenizer, ctx,
                                        budget, tag, subset_label, times, log)
            if result.get("extract_only"):
                return result
            stem, render = f"prereg_{tag}_{subset_label}", preregistered_markdown
        else:
            result = _run_plain(settings, convs, y, groups, ctx, budget, template,
                                context_note, tag, subset_label, times, log)
            stem, render = f"{tag}_{subset_label}", plain_markdown
    times["total"] = total.elapsed
    result["times"] = {k: round(v, 1) for k, v in times.items()}
    out = Path(settings.out)
    write_json(out / f"{stem}.json", result, indent=1)
    md = render(result)
    if not settings.preregistered:
        png = plot_site_curves(result, out / f"{stem}_sites.png", log=log)
        if png:
            md += f"\n![per-site accuracy]({Path(png).name})\n"
    (out / f"{stem}.md").write_text(md)
    _say(log, md)
    return result
