"""The online-auditing benchmark on Who&When: first alarms with a calibrated false-alarm
rate, on the shared nested folds of :mod:`skafa.model_selection`.

Who&When holds failed runs only, so two protocols, both from ONE forward pass per run
with ``PromptTemplate.online()`` (turn ``k``'s vector is what an auditor had read after
turn ``k``):

(a) **every failed run, prefix by prefix**: the first alarm is the predicted decisive
    step (``-1``: no alarm). Scored with Step-Acc, ASS, detection delay, early-alarm
    share, miss rate and agent accuracy.
(b) **failed runs + safe runs**: the safe run of failed run ``i`` is its prefix
    ``0..y_i - 1`` (cut just before the decisive step; runs whose decisive step is turn
    0 have none). Scored with FAR (share of safe runs with any alarm) and Exact-F1
    (AgentForesight's definitions, :mod:`skafa.metrics._metrics`).

Nested CV as in ``benchmark_who_and_when.py``: outer ``GroupKFold(5)`` by task id x
``--repeats`` shuffles; every choice (site, C, alarm threshold) on inner
``GroupKFold`` folds of the outer training part. Methods: the auditor on activations
(cumulative and hazard targets), the same auditor on position-only features (online-valid
columns only: index, length, speaker; nothing that needs the run's length), and the
post-hoc probe's argmax turn (sees the whole run, always names a step: an offline upper
bound for Step-Acc, not an online method). 95% CIs: cluster bootstrap over task ids.

:func:`run_online_benchmark` runs one (model, subset) cell and writes
``online_<tag>_<subset>.json`` (a ``.partial.json`` after every outer fit, so a killed
run resumes), ``.md`` and ``_scores.png``; ``examples/benchmark_online.py`` is its
command line.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import GroupKFold

from ..featurizers import TurnPositionTransformer
from ..llm import (
    PromptTemplate,
    TurnActivationTransformer,
    parse_site_spec,
    plan,
)
from ..metrics import (
    average_step_shift,
    bootstrap_ci,
    detection_delay,
    early_alarm_share,
    exact_f1,
    false_alarm_rate,
    miss_rate,
    normalize_agent,
    online_step_accuracy,
)
from ..model_selection import (
    ResultStoreError,
    SiteSelector,
    make_probe,
    outer_splits,
    read_json,
    read_result,
    write_json,
)
from ..online import OnlineAuditor, safe_prefix_protocol
from ..utils.progress import Timer
from ._who_and_when import _folds, _machine, _open_cell, _say, _timed

__all__ = ["POSITION_AUDITOR", "TURN_CHAR_GRID", "OnlineBenchmarkSettings", "choose_online_template", "online_markdown",
           "paired_online", "paired_online_rows", "plot_alarm_scores", "rescore_online",
           "run_online_benchmark", "summarize_online"]


@dataclasses.dataclass
class OnlineBenchmarkSettings:
    """Every setting of one online benchmark cell (the command line's options)."""

    model: str = "smollm2"
    tag: str | None = None
    subset: str = "Algorithm-Generated"
    cache_dir: str | None = None
    out: str = "docs/results"
    max_prompt_tokens: int = 8192
    max_turn_chars: str = "auto"
    far: float = 0.05
    targets: list = dataclasses.field(default_factory=lambda: ["cumulative", "hazard"])
    folds: int = 5
    inner_folds: int = 5
    repeats: int = 3
    Cs: list = dataclasses.field(default_factory=lambda: [0.001, 0.01, 0.1])
    sites: str = "stride:3"
    n_jobs: int | None = 1
    n_resamples: int = 2000
    dtype: str = "auto"
    extract_only: bool = False
    resume: bool = False
    command: str = ""
    #: set by the run: the sites searched
    probe_sites: list | None = None


#: Position columns an online auditor may use: none depends on the run's final length.
ONLINE_POSITION_GROUPS = ("index_onehot", "index", "length", "speaker", "speaker_changed")
#: Per-turn caps tried by ``--max-turn-chars auto`` (largest that makes every prompt fit).
TURN_CHAR_GRID = (None, 8000, 6000, 4000, 3000, 2000, 1500, 1000, 500, 250)

METRICS_A = {  # protocol (a): failed runs only
    "Step-Acc": (online_step_accuracy, True),
    "ASS": (average_step_shift, False),
    "delay": (detection_delay, False),
    "early share": (early_alarm_share, True),
    "miss rate": (miss_rate, True),
}
METRICS_B = {  # protocol (b): failed runs + their safe prefixes
    "Exact-F1": (exact_f1, True),
    "FAR": (false_alarm_rate, True),
}



def _online_fold(convs, A, y, groups, train, test, settings):
    """Fit the auditors and the post-hoc probe on ``train``; first alarms on ``test``."""
    ctr = [convs[i] for i in train]
    cte = [convs[i] for i in test]
    ytr, gtr = y[train], groups[train]
    out = {}
    common = dict(max_false_alarm_rate=settings.far, Cs=settings.Cs, cv=GroupKFold(settings.inner_folds),
                  n_jobs=settings.n_jobs, random_state=0)
    for target in settings.targets:
        with Timer("online", None) as t:
            aud = OnlineAuditor(target=target, sites=settings.probe_sites, **common).fit(
                A[train], ytr, groups=gtr)
        scores = aud.turn_decision_function(A[test])
        out[f"auditor ({target})"] = (aud.predict(A[test]), {
            "site": aud.best_site_, "C": aud.best_C_, "threshold": aud.threshold_,
            "oof_far": aud.oof_false_alarm_rate_,
            "fit_s": round(t.elapsed, 1)},
            [(s - aud.threshold_).tolist() for s in scores])
    pos = TurnPositionTransformer(include=ONLINE_POSITION_GROUPS).fit(ctr)
    Ptr, Pte = pos.transform(ctr), pos.transform(cte)
    aud = OnlineAuditor(target="cumulative", **common).fit(Ptr, ytr, groups=gtr)
    out["position-only auditor (cumulative)"] = (aud.predict(Pte), {
        "C": aud.best_C_, "threshold": aud.threshold_, "oof_far": aud.oof_false_alarm_rate_},
        None)
    with Timer("online", None) as t:
        # site and C on inner folds (ties: the smaller C)
        sel = SiteSelector(make_probe("logistic", 1.0), sites=settings.probe_sites,
                           cv=GroupKFold(settings.inner_folds), n_jobs=settings.n_jobs,
                           param_grid={"C": sorted(settings.Cs)}).fit(A[train], ytr, groups=gtr)
        pred = sel.predict(A[test])
    out["post-hoc probe argmax (offline bound)"] = (pred, {
        "site": sel.best_site_, "C": sel.best_params_["C"], "fit_s": round(t.elapsed, 1)}, None)
    return out


# ---------------------------------------------------------------------- scoring
def _res(r):
    return {"estimate": float(r.estimate), "low": float(r.low), "high": float(r.high)}


def _over_repeats(metric):
    """Metric of (n, R) predictions: the mean over the R repeats' values."""
    def f(t, p):
        p = np.asarray(p)
        return float(np.mean([metric(t, p[:, r]) for r in range(p.shape[1])]))
    return f


def summarize_online(P, y, convs, groups, *, n_resamples, seed):
    """Protocol (a) and (b) metrics of predictions ``P`` (R, n) with cluster-bootstrap CIs."""
    Pn = P.T  # (n, R)
    rows = {}
    for name, (metric, _) in METRICS_A.items():
        r = bootstrap_ci(y, Pn, _over_repeats(metric), n_resamples=n_resamples,
                           random_state=seed, groups=groups)
        rows[name] = _res(r)
    true_agents = [c.mistake_agent for c in convs]

    def agent_acc(idx_t, p):  # t carries run indices here
        hits = []
        for i, pr in zip(idx_t, p):
            spoke = convs[i].speakers[pr] if pr >= 0 else ""
            hits.append(normalize_agent(spoke) == normalize_agent(true_agents[i])
                        if spoke else False)
        return float(np.mean(hits))

    r = bootstrap_ci(np.arange(len(y)), Pn, _over_repeats(agent_acc),
                       n_resamples=n_resamples, random_state=seed, groups=groups)
    rows["Agent-Acc"] = _res(r)
    yb, pb, gb = safe_prefix_protocol(y, Pn, groups)
    for name, (metric, _) in METRICS_B.items():
        r = bootstrap_ci(yb, pb, _over_repeats(metric), n_resamples=n_resamples,
                           random_state=seed, groups=gb)
        rows[name] = _res(r)
    rows["n_failed"] = int(len(y))
    rows["n_safe"] = int(np.sum(y >= 1))
    return rows


#: Online metrics compared pairwise (method minus position-only, same folds and resamples).
PAIRED = {"Exact-F1": ("b", exact_f1), "Step-Acc": ("a", online_step_accuracy),
          "FAR": ("b", false_alarm_rate)}
#: The baseline every auditor is compared with.
POSITION_AUDITOR = "position-only auditor (cumulative)"


def paired_online(PA, PB, y, groups, *, n_resamples, seed):
    """Paired cluster-bootstrap difference ``metric(A) - metric(B)`` on the same resamples.

    ``PA`` and ``PB``: first alarms, shape (R, n), from the same outer folds.
    """
    R = PA.shape[0]
    both = np.concatenate([PA.T, PB.T], axis=1)  # (n, 2R): A's repeats, then B's
    out = {}
    for name, (protocol, metric) in PAIRED.items():
        yt, pt, gt = (y, both, groups) if protocol == "a" else safe_prefix_protocol(
            y, both, groups)
        f = _over_repeats(metric)

        def diff(t, p, f=f):
            p = np.asarray(p)
            return f(t, p[:, :R]) - f(t, p[:, R:])

        out[name] = _res(bootstrap_ci(yt, pt, diff, n_resamples=n_resamples,
                                        random_state=seed, groups=gt))
    return out


def paired_online_rows(preds, y, groups, *, n_resamples, seed):
    """Every online auditor minus the position-only auditor."""
    if POSITION_AUDITOR not in preds:
        return {}
    return {f"{m} - {POSITION_AUDITOR}": paired_online(np.asarray(preds[m]), np.asarray(preds[POSITION_AUDITOR]),
                                        y, groups, n_resamples=n_resamples, seed=seed)
            for m in preds if m != POSITION_AUDITOR and "offline" not in m}


# ---------------------------------------------------------------------- reports
def fmt(r, pct=True):
    if r is None or not np.isfinite(r["estimate"]):
        return "n/a"
    if pct:
        return f"{100 * r['estimate']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"
    return f"{r['estimate']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def online_markdown(result):
    """The online comparison's tables (markdown)."""
    s = result["summary"]
    lines = [
        f"### Online auditing: {result['model_label']} on Who&When {result['subset']} "
        f"(n = {result['n_conversations']} failed runs, "
        f"{result['n_safe']} safe prefixes)", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; {result['date']}.  ",
        f"Outer CV: GroupKFold({result['folds']}) by task id x {result['repeats']} "
        f"shuffles{' (partial: ' + str(result['outer_fits_done']) + ' outer fits)' if result.get('partial') else ''}; "
        f"inner: GroupKFold({result['inner_folds']}) for site, C and threshold; "
        f"FAR target (max_false_alarm_rate) **{result['far_target']}**; C grid "
        f"{result['Cs']}; sites searched: {result['site_search']} "
        f"({len(result['probe_sites'])}).  ",
        f"Prompt: {result['prompt_note']}", "",
        "| method | Exact-F1 % (b) | FAR % (b) | Step-Acc % (a) | ASS (a) | delay (a) | "
        "early-alarm share % (a) | miss rate % (a) | Agent-Acc % (a) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in s.items():
        far = r["FAR"] if "offline" not in k else None
        f1 = r["Exact-F1"] if "offline" not in k else None
        lines.append(
            f"| {k} | {fmt(f1)} | {fmt(far)} | {fmt(r['Step-Acc'])} | "
            f"{fmt(r['ASS'], pct=False)} | {fmt(r['delay'], pct=False)} | "
            f"{fmt(r['early share'])} | {fmt(r['miss rate'])} | {fmt(r['Agent-Acc'])} |")
    if result.get("paired"):
        lines += ["", "| paired difference (same folds, same resamples) | Exact-F1 points (b) | "
                  "Step-Acc points (a) | FAR points (b) |", "|---|---|---|---|"]
        for k, r in result["paired"].items():
            lines.append("| " + k + " | " + " | ".join(
                f"{100 * r[m]['estimate']:+.1f} [{100 * r[m]['low']:+.1f}, "
                f"{100 * r[m]['high']:+.1f}]" for m in PAIRED) + " |")
    lines += ["", "(a) failed runs audited prefix by prefix; (b) the same runs plus, for "
              "each, the safe run made by cutting it just before its decisive step. The "
              "offline bound sees the whole run and always names a step, so it has no FAR "
              "/ Exact-F1 of its own (on a safe prefix it would always alarm).", "",
              "Chosen settings across the outer fits: " + result["choices_note"], "",
              f"Context: {result['context_note']}", "",
              "Wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in result["times"].items()),
              ""]
    return "\n".join(lines)


def plot_alarm_scores(result, path, n_runs=4, log=None):
    """A few runs' per-turn alarm scores as a PNG (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if log is not None:
            log("matplotlib not installed: no plot")
        return None
    traces = result["score_traces"]
    if not traces:
        return None
    # A few runs with several turns: an on-time alarm, an early one, a late one, a miss.
    picked = []
    for want in ("on time", "early", "late", "missed"):
        for tr in traces:
            if tr["kind"] == want and tr not in picked and len(tr["scores"]) >= 4:
                picked.append(tr)
                break
    for tr in traces:
        if len(picked) >= n_runs:
            break
        if tr not in picked and len(tr["scores"]) >= 4:
            picked.append(tr)
    fig, axes = plt.subplots(1, len(picked), figsize=(3.4 * len(picked), 3.0), squeeze=False)
    for ax, tr in zip(axes[0], picked):
        s = np.asarray(tr["scores"])
        ax.plot(np.arange(s.size), s, marker="o", ms=3)
        ax.axhline(0.0, color="gray", ls="--", lw=1, label="alarm threshold")
        ax.axvline(tr["y"], color="red", lw=1.5, alpha=0.7, label="decisive step")
        if tr["pred"] >= 0:
            ax.plot([tr["pred"]], [s[tr["pred"]]], "k*", ms=11, label="first alarm")
        ax.set_title(f"{tr['record_id']}\n{tr['kind']}", fontsize=8)
        ax.set_xlabel("turn")
    axes[0][0].set_ylabel("alarm score - threshold")
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle(f"{result['model_label']}, {result['subset']}: per-turn alarm scores "
                 "(auditor, cumulative target, outer test folds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kind(y, p):
    if p < 0:
        return "missed"
    return "on time" if p == y else ("early" if p < y else "late")


def choose_online_template(convs, tokenizer, budget, max_turn_chars):
    """The online template; ``auto``: the largest per-turn cap with which every prompt fits."""
    grid = TURN_CHAR_GRID if max_turn_chars == "auto" else (
        None if max_turn_chars == "none" else int(max_turn_chars),)
    for K in grid:
        tpl = (PromptTemplate.online() if K is None else
               PromptTemplate.online(shorten="head_tail", max_turn_chars=K))
        p = plan(convs, tokenizer, tpl, max_tokens=budget)
        if p.all_fit:
            return tpl, p
    raise ValueError(f"no per-turn cap in {grid} makes every prompt fit {budget} tokens; "
                     "the task or headers alone are too long: drop those runs explicitly.")


def run_online_benchmark(settings, conversations, *, subset_label=None, log=None):
    """Run one online benchmark cell and write its result files.

    Parameters
    ----------
    settings : OnlineBenchmarkSettings
    conversations : list of Conversation
        Labelled failed runs.
    subset_label : str, default=None
        Name in tables and file names (default ``settings.subset``).
    log : callable, default=None
        Called with each progress line; None: silent.

    Returns
    -------
    result : dict
        What ``online_<tag>_<subset>.json`` holds (``{"n_forward_passes"}`` with
        ``settings.extract_only``).
    """
    t_all = time.perf_counter()
    times = {}
    subset = subset_label or settings.subset
    convs, tag, y, groups, model, tokenizer, ctx, budget = _open_cell(settings, conversations)
    template, shortened = choose_online_template(convs, tokenizer, budget,
                                                 settings.max_turn_chars)
    total_chars = sum(sum(len(t.content) for t in c.turns) for c in convs)
    removed = shortened.total_chars_removed
    n_turns_cut = int(sum(np.count_nonzero(r["turn_chars_removed"]) for r in shortened))
    how = ("no shortening needed" if template.shorten == "none" else
           f"`head_tail` shortening with max_turn_chars={template.max_turn_chars} (each turn "
           "on its own, so every prefix's prompt is a prefix)")
    context_note = (
        f"model context {ctx} tokens, budget {budget}; {how}: {n_turns_cut} turns in "
        f"{sum(r['chars_removed'] > 0 for r in shortened)} runs shortened, {removed:,} of "
        f"{total_chars:,} turn characters removed ({100 * removed / max(total_chars, 1):.1f}%); "
        "longest "
        f"prompt {int(shortened.n_tokens.max())} tokens. Nothing was dropped.")
    _say(log, context_note)

    with _timed(times, "extraction"):
        ext = TurnActivationTransformer(model=settings.model, prompt=template,
                                        dtype=settings.dtype, cache_dir=settings.cache_dir,
                                        verbose=1).fit(convs)
        A = ext.transform(convs)
    _say(log, f"extraction: {A} in {times['extraction']:.0f}s, forward passes "
              f"{ext.run_stats['n_forward_passes']}")
    if settings.extract_only:
        return {"n_forward_passes": ext.run_stats["n_forward_passes"]}

    L = ext.n_layers_
    probe_sites = list(parse_site_spec(settings.sites, L))  # the extraction read all sites
    settings.probe_sites = probe_sites

    label = {"smollm2": "SmolLM2-135M-Instruct"}.get(settings.model, tag)
    result = {
        "model": str(settings.model), "model_label": label, "tag": tag, "subset": subset,
        "n_conversations": len(convs), "n_safe": int(np.sum(y >= 1)), "folds": settings.folds,
        "inner_folds": settings.inner_folds, "repeats": settings.repeats, "Cs": settings.Cs,
        "far_target": settings.far, "site_search": settings.sites, "probe_sites": probe_sites,
        "command": settings.command, "machine": _machine(),
        "date": time.strftime("%Y-%m-%d"),
        "prompt_note": f"`PromptTemplate.online(shorten={template.shorten!r}, max_turn_chars="
                       f"{template.max_turn_chars})`, fingerprint {template.fingerprint()[:12]}",
        "context_note": context_note, "n_forward_passes": int(ext.run_stats["n_forward_passes"]),
        "record_ids": [c.record_id for c in convs], "y_true": [int(v) for v in y],
        "task_ids": [str(g) for g in groups],
    }
    out_dir = Path(settings.out)
    stem = f"online_{tag}_{subset}"

    preds, infos, traces, done = {}, [], [], []
    partial_path = out_dir / f"{stem}.partial.json"
    if settings.resume and partial_path.exists():
        old = read_json(partial_path)
        same = ("far_target", "Cs", "probe_sites", "folds", "inner_folds", "repeats",
                "record_ids", "prompt_note")
        if any(old.get(key) != result[key] for key in same):
            raise ResultStoreError(f"{partial_path} was written with other settings; "
                                   "remove it.")
        preds = {n: np.asarray(P, dtype=np.int64) for n, P in old["predictions"].items()}
        infos, traces = old["choices"], old.get("score_traces", [])
        done = [tuple(d) for d in old.get("done", [])]
        times["cv_resumed"] = old.get("times", {}).get("cv", 0.0)
        _say(log, f"resuming: {len(done)} outer fits read from {partial_path}")
    n_fits = len(done)
    splits = outer_splits(y, groups, n_folds=settings.folds, n_repeats=settings.repeats)
    for r, k, train, test in _folds(splits, "online nested CV"):
        if True:  # (one outer fit)
            if (r, k) in done:
                continue
            with _timed(times, "cv"):
                out = _online_fold(convs, A, y, groups, train, test, settings)
            for name, (pred, info, scores) in out.items():
                preds.setdefault(name, np.full((settings.repeats, len(y)), -2))[r, test] = pred
                infos.append({"repeat": r, "fold": k, "method": name, **info})
                if r == 0 and scores is not None and name == "auditor (cumulative)":
                    for i, s, pr in zip(test, scores, pred):
                        traces.append({"record_id": convs[i].record_id, "y": int(y[i]),
                                       "pred": int(pr), "kind": _kind(y[i], pr), "scores": s})
            n_fits += 1
            done.append((r, k))
            _say(log, f"repeat {r} fold {k}: " + "; ".join(
                f"{n}: {i.get('site', '')} C={i.get('C')} thr={i.get('threshold', 0):.3g}"
                for n, (_, i, _) in out.items()))
            # partial results after every outer fit (only completed repeats are scored)
            result.update(partial=True, outer_fits_done=n_fits, done=done,
                          predictions={n: P.tolist() for n, P in preds.items()},
                          choices=infos, score_traces=traces,
                          times={k2: round(v, 1) for k2, v in times.items()})
            write_json(partial_path, result)

    summary = {name: summarize_online(P, y, convs, groups, n_resamples=settings.n_resamples, seed=0)
               for name, P in preds.items()}

    def choices(method, key):
        vals = [str(i[key]) for i in infos if i["method"] == method and key in i]
        return ", ".join(f"{v} x{vals.count(v)}" for v in dict.fromkeys(vals))

    choices_note = "; ".join(
        f"{m}: site {choices(m, 'site')}, C {choices(m, 'C')}"
        for m in preds if "position" not in m) + "; position-only C: " + choices(
        "position-only auditor (cumulative)", "C")
    oof = {m: float(np.mean([i["oof_far"] for i in infos if i["method"] == m]))
           for m in preds if any("oof_far" in i for i in infos if i["method"] == m)}
    choices_note += "; mean inner (out-of-fold) FAR at the chosen threshold: " + ", ".join(
        f"{m} {100 * v:.1f}%" for m, v in oof.items())
    times["total"] = time.perf_counter() - t_all
    result.pop("done", None)
    result.pop("outer_fits_done", None)
    result["paired"] = paired_online_rows({n: np.asarray(P) for n, P in preds.items()}, y, groups,
                                   n_resamples=settings.n_resamples, seed=0)
    result.update(partial=False, summary=summary, choices_note=choices_note,
                  score_traces=traces, times={k: round(v, 1) for k, v in times.items()},
                  predictions={n: P.tolist() for n, P in preds.items()}, choices=infos)
    write_json(out_dir / f"{stem}.json", result, indent=1)
    if partial_path.exists():
        partial_path.unlink()
    md = online_markdown(result)
    png = plot_alarm_scores(result, out_dir / f"{stem}_scores.png", log=log)
    if png:
        md += f"\n![per-turn alarm scores]({Path(png).name})\n"
    (out_dir / f"{stem}.md").write_text(md)
    _say(log, md)
    return result



def rescore_online(path, conversations, *, n_resamples, log=None):
    """Recompute the summary and paired differences of ``path`` from its predictions.

    ``conversations``: the records of the run (their speakers and agents, for
    Agent-Acc), matched by record id. Rewrites ``path`` and its ``.md``.
    """
    path = Path(path)
    result = read_json(path)
    if result.get("partial"):
        raise ResultStoreError(f"{path} is a partial result; finish the run (--resume) first.")
    y = np.asarray(result["y_true"], dtype=np.int64)
    groups = np.asarray(result["task_ids"], dtype=object)
    preds = {n: np.asarray(P, dtype=np.int64) for n, P in result["predictions"].items()}
    if any(P.shape != (result["repeats"], len(y)) for P in preds.values()):
        raise ResultStoreError(f"{path}: predictions do not match y_true and repeats.")
    result = read_result(path)
    by_id = {c.record_id: c for c in conversations}
    convs = [by_id[r] for r in result["record_ids"]]
    result["summary"] = {n: summarize_online(P, y, convs, groups, n_resamples=n_resamples, seed=0)
                         for n, P in preds.items()}
    result["paired"] = paired_online_rows(preds, y, groups, n_resamples=n_resamples, seed=0)
    write_json(path, result, indent=1)
    md = online_markdown(result)
    png = path.with_name(path.stem + "_scores.png")
    if png.exists():
        md += f"\n![per-turn alarm scores]({png.name})\n"
    path.with_suffix(".md").write_text(md)
    _say(log, md)
    return result
