"""The pre-registered locator-head / grafting comparison (docs/benchmarks.md §8).

One cell is one reader on one subset. Every row is scored on the same outer folds
(:func:`skafa.model_selection.outer_splits`); every choice a row makes is made on
inner grouped folds of the outer training part:

``locator_probe``
    Per-turn head-attention features (sites ``head_attn.<layer>``, read ``last``):
    the best single layer (``SiteSelector``) or all layers joined
    (``SiteConcatenator``), each with a logistic probe and its C grid; the policy
    with the higher inner step accuracy predicts (ties: single layer).
``top_locator_head``
    The head with the highest mean attention to the true decisive turn on the
    training part; it predicts the turn it attends to most.
``grafted_judge`` / ``judge``
    :class:`~skafa.baselines.GraftedJudge` (its head counts chosen on inner folds
    by its own ``fit``) and the plain :class:`~skafa.baselines.PromptedJudge` on
    the same model and prompt.
``recommended``
    :func:`~skafa.configurations.make_configuration` ``(RECOMMENDED)``.
``position``, ``tfidf``, ``most_frequent``
    The honest baselines of §3.

The answers to §8's questions (paired differences, the fraction of the
judge–probe gap closed) and the cost of each row relative to one bare forward
pass are written beside the table.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold
from sklearn.pipeline import make_pipeline

from ..baselines import DummyStepClassifier, GraftedJudge, PromptedJudge
from ..compose import SiteConcatenator
from ..configurations import RECOMMENDED, make_configuration
from ..featurizers import TurnPositionTransformer, TurnTextTransformer
from ..llm import PromptTemplate, TurnActivationTransformer, measure_throughput, plan
from ..model_selection import (
    SiteSelector,
    format_interval,
    grid_search_C,
    method_table,
    outer_splits,
    paired_differences,
    summarize_predictions,
    write_json,
)
from ..probes import GroupedArgmaxLogisticClassifier
from ..utils.grouped import grouped_argmax
from ._who_and_when import _folds, _machine, _open_cell, _say

__all__ = ["LOCATOR_ROWS", "LocatorBenchmarkSettings", "gap_closed", "locator_markdown",
           "run_locator_benchmark", "top_locator_head"]

#: The rows of §8, in table order.
LOCATOR_ROWS = ("locator_probe", "top_locator_head", "grafted_judge", "judge",
                "recommended", "position", "tfidf", "most_frequent")

#: The paired differences §8 answers its questions with (a - b).
_PAIRS = (("grafted_judge", "judge"), ("locator_probe", "position"),
          ("locator_probe", "recommended"), ("recommended", "judge"),
          ("grafted_judge", "recommended"), ("top_locator_head", "position"))


@dataclasses.dataclass
class LocatorBenchmarkSettings:
    """Every setting of one §8 cell (the command line's options).

    ``smoke=True`` marks a model registered in this process only (a test's tiny
    model): the file stem is ``locators_smoke``. ``rows`` may leave rows out (a
    deviation, named in the result).
    """

    model: str = "smollm2"
    tag: str | None = None
    subset: str = "Algorithm-Generated"
    cache_dir: str | None = None
    out: str = "docs/results"
    max_prompt_tokens: int = 8192
    folds: int = 5
    inner_folds: int = 5
    repeats: int = 3
    locator_Cs: list = dataclasses.field(default_factory=lambda: [0.01, 0.1, 1.0])
    baseline_Cs: list = dataclasses.field(default_factory=lambda: [0.001, 0.01, 0.1])
    locator_grid: list = dataclasses.field(default_factory=lambda: [1, 2, 4])
    writer_grid: list = dataclasses.field(default_factory=lambda: [1, 2, 4])
    rows: list = dataclasses.field(default_factory=lambda: list(LOCATOR_ROWS))
    dtype: str = "auto"
    n_resamples: int = 2000
    smoke: bool = False
    command: str = ""


def top_locator_head(X, y):
    """The (site, head) whose attention on the true decisive turn is highest on average.

    Parameters
    ----------
    X : TurnFeatures
        Head-attention features (one block per ``head_attn.<layer>`` site, one
        column per head).
    y : array-like of int, shape (n_conversations,)

    Returns
    -------
    site : str
    head : int
    mean_mass : float
        Its mean attention mass on the decisive turn.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> values = np.array([[.1, .9], [.8, .1], [.2, .7], [.6, .2]])[:, None, :]
    >>> X = TurnFeatures(values, [0, 2, 4], sites=["head_attn.0"])
    >>> top_locator_head(X, [0, 0])[:2]
    ('head_attn.0', 1)
    """
    y = np.asarray(y, dtype=np.int64)
    rows = X.offsets[:-1] + y
    best = None
    for site in X.sites:
        M = np.asarray(X.turn_matrix(site), dtype=np.float64)
        means = M[rows].mean(axis=0)
        h = int(np.argmax(means))
        if best is None or means[h] > best[2]:
            best = (site, h, float(means[h]))
    return best


def _predict_with_head(X, site, head):
    return grouped_argmax(np.asarray(X.turn_matrix(site), dtype=np.float64)[:, head],
                          X.offsets)


def _locator_probe(A, y, groups, train, test, settings):
    """The locator-head probe of one outer fit: (test predictions, info)."""
    inner = GroupKFold(settings.inner_folds)
    Xtr, Xte = A[train], A[test]
    probe = GroupedArgmaxLogisticClassifier(random_state=0)
    single = SiteSelector(probe, cv=inner, param_grid={"C": sorted(settings.locator_Cs)})
    single.fit(Xtr, y[train], groups=groups[train])
    joined = GridSearchCV(make_pipeline(SiteConcatenator(list(A.sites)), probe),
                          {"groupedargmaxlogisticclassifier__C": sorted(settings.locator_Cs)},
                          cv=inner)
    joined.fit(Xtr, y[train], groups=groups[train])
    if joined.best_score_ > single.best_score_:
        return joined.predict(Xte), {"policy": "all layers",
                                     "C": joined.best_params_[
                                         "groupedargmaxlogisticclassifier__C"],
                                     "inner": float(joined.best_score_)}
    return single.predict(Xte), {"policy": "single layer", "site": single.best_site_,
                                 "C": single.best_params_["C"],
                                 "inner": float(single.best_score_)}


def gap_closed(per_conversation, groups, *, n_resamples=2000, random_state=0):
    """Fraction of the judge-probe gap the grafted judge closes, with a bootstrap CI.

    ``(grafted - judge) / (recommended - judge)`` on task-cluster resamples; ``None``
    when the gap itself (recommended - judge) has a 95% CI not above 0 (§8: "no gap
    to close on this cell").

    Parameters
    ----------
    per_conversation : dict
        Per-conversation step accuracy of ``grafted_judge``, ``judge`` and
        ``recommended`` (from :func:`skafa.model_selection.summarize_predictions`).
    groups : array-like
        Task ids.
    n_resamples, random_state : int

    Returns
    -------
    dict or None
        ``{"estimate", "low", "high"}``.
    """
    g, j, p = (np.asarray(per_conversation[k], dtype=np.float64)
               for k in ("grafted_judge", "judge", "recommended"))
    groups = np.asarray(groups, dtype=object)
    tasks, inverse = np.unique(groups.astype(str), return_inverse=True)
    rng = np.random.default_rng(random_state)

    def sums(v):
        return np.bincount(inverse, weights=v, minlength=len(tasks))

    G, J, P, n = sums(g), sums(j), sums(p), np.bincount(inverse, minlength=len(tasks))
    gaps, ratios = [], []
    for _ in range(int(n_resamples)):
        w = np.bincount(rng.integers(0, len(tasks), len(tasks)), minlength=len(tasks))
        m = max(float(w @ n), 1.0)
        gap = (w @ P - w @ J) / m
        gaps.append(gap)
        ratios.append((w @ G - w @ J) / m / gap if gap != 0 else np.nan)
    if np.quantile(gaps, 0.025) <= 0:
        return None
    ratios = np.asarray(ratios)
    ratios = ratios[np.isfinite(ratios)]
    return {"estimate": float((g.mean() - j.mean()) / (p.mean() - j.mean())),
            "low": float(np.quantile(ratios, 0.025)),
            "high": float(np.quantile(ratios, 0.975))}


def run_locator_benchmark(settings, conversations, *, subset_label=None, log=None):
    """Run one §8 cell and write ``locators_<tag>_<subset>.json`` and ``.md``.

    Parameters
    ----------
    settings : LocatorBenchmarkSettings
    conversations : list of Conversation
        Labelled records.
    subset_label : str, default=None
        Name in tables and file names (default ``settings.subset``).
    log : callable, default=None
        Called with each progress line; None: silent.

    Returns
    -------
    result : dict
    """
    t_all = time.perf_counter()
    subset = subset_label or settings.subset
    convs, tag, y, groups, model, tokenizer, ctx, budget = _open_cell(settings, conversations)
    tag = "smoke" if settings.smoke else tag
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    shortened = plan(convs, tokenizer, template, max_tokens=budget, read="last")
    n_tokens = int(sum(r["n_tokens"] for r in shortened))
    rows = [r for r in LOCATOR_ROWS if r in settings.rows]
    times, infos = {}, {r: [] for r in rows}
    splits = outer_splits(y, groups, n_folds=settings.folds, n_repeats=settings.repeats)
    P = {r: np.full((settings.repeats, len(convs)), -1, dtype=np.int64) for r in rows}

    def timed(key, fn):
        t = time.perf_counter()
        out = fn()
        times[key] = times.get(key, 0.0) + time.perf_counter() - t
        return out

    common = dict(prompt=template, dtype=settings.dtype)
    # ---- whole-set passes (unsupervised: features and the judge's scores)
    A = H = None
    if {"locator_probe", "top_locator_head"} & set(rows):
        ext = TurnActivationTransformer(settings.model, read="last", sites="head_attn",
                                        cache_dir=settings.cache_dir, verbose=1, **common)
        _say(log, f"head-attention features of {len(convs)} conversations ({n_tokens:,} "
                  "prompt tokens, read 'last')")
        H = timed("features head_attn", lambda: ext.fit_transform(convs))
    if "recommended" in rows:
        acts, selector = make_configuration(RECOMMENDED, settings.model, verbose=1,
                                            cache_dir=settings.cache_dir, **common)
        _say(log, f"activations of the recommended configuration ({RECOMMENDED})")
        A = timed("features recommended", lambda: acts.fit_transform(convs))
    if "judge" in rows:
        judge = PromptedJudge(settings.model, verbose=1, **common)
        P_judge = timed("judge", lambda: judge.fit(convs, y).predict(convs))
        P["judge"][:] = P_judge[None, :]

    for r, f, train, test in _folds(splits, "outer fits"):
        if "locator_probe" in rows:
            pred, info = timed("locator_probe",
                               lambda: _locator_probe(H, y, groups, train, test, settings))
            P["locator_probe"][r, test] = pred
            infos["locator_probe"].append(info)
        if "top_locator_head" in rows:
            site, head, mass = top_locator_head(H[train], y[train])
            P["top_locator_head"][r, test] = _predict_with_head(H[test], site, head)
            infos["top_locator_head"].append({"site": site, "head": head, "mass": mass})
        if "grafted_judge" in rows:
            gj = GraftedJudge(settings.model, locator_grid=list(settings.locator_grid),
                              writer_grid=list(settings.writer_grid),
                              cv=GroupKFold(settings.inner_folds), **common)
            convs_tr = [convs[i] for i in train]
            timed("grafted_judge", lambda: gj.fit(convs_tr, y[train], groups=groups[train]))
            P["grafted_judge"][r, test] = timed(
                "grafted_judge", lambda: gj.predict([convs[i] for i in test]))
            infos["grafted_judge"].append({"n_locators": len(gj.locator_heads_),
                                           "n_writers": len(gj.writer_heads_)})
        if "recommended" in rows:
            sel = clone(selector)
            timed("recommended", lambda: sel.fit(A[train], y[train],
                                                 groups=groups[train]))
            P["recommended"][r, test] = sel.predict(A[test])
            infos["recommended"].append({"sites": list(sel.best_sites_),
                                         "C": sel.best_params_["C"]})
        ctr, cte = [convs[i] for i in train], [convs[i] for i in test]
        for name, featurizer in (("position", TurnPositionTransformer()),
                                 ("tfidf", TurnTextTransformer())):
            if name in rows:  # the featurizer is fitted on the training part only
                featurizer.fit(ctr)
                gs = grid_search_C(featurizer.transform(ctr), y[train], groups[train],
                                   Cs=settings.baseline_Cs, inner=settings.inner_folds,
                                   n_jobs=1, random_state=0)
                P[name][r, test] = gs.predict(featurizer.transform(cte))
                infos[name].append({"C": gs.best_params_["C"]})
        if "most_frequent" in rows:
            d = DummyStepClassifier(strategy="most_frequent").fit(ctr, y[train])
            P["most_frequent"][r, test] = d.predict(cte)

    summary, per_conv = summarize_predictions(P, y, convs, groups,
                                              n_resamples=settings.n_resamples)
    pairs = [(a, b) for a, b in _PAIRS if a in rows and b in rows]
    diffs = paired_differences(per_conv, pairs, groups, n_resamples=settings.n_resamples)
    gap = (gap_closed(per_conv, groups, n_resamples=settings.n_resamples)
           if {"grafted_judge", "judge", "recommended"} <= set(rows) else None)
    # ---- cost relative to one bare forward pass of the same prompt tokens
    rate = measure_throughput(model)["tokens_per_s"]
    bare = n_tokens / rate
    result = {
        "model": str(settings.model), "tag": tag, "subset": subset, "n": len(convs),
        "rows": rows, "missing_rows": [r for r in LOCATOR_ROWS if r not in rows],
        "summary": summary, "paired": diffs, "gap_closed": gap, "choices": infos,
        "dtype": settings.dtype, "prompt_budget": budget, "n_prompt_tokens_last": n_tokens,
        "bare_forward_s": round(bare, 2),
        "cost_vs_bare_forward": {k: round(v / bare, 2) for k, v in times.items()},
        "times": {k: round(v, 1) for k, v in times.items()},
        "total_s": round(time.perf_counter() - t_all, 1),
        "machine": _machine(), "command": settings.command,
        "predictions": {k: v.tolist() for k, v in P.items()},
    }
    out = Path(settings.out)
    stem = f"locators_{tag}_{subset}"
    write_json(out / f"{stem}.json", result, indent=1)
    md = locator_markdown(result)
    (out / f"{stem}.md").write_text(md)
    _say(log, md)
    return result


def locator_markdown(result):
    """The §8 table, the answers to its questions and the costs, as markdown.

    Parameters
    ----------
    result : dict
        What :func:`run_locator_benchmark` returns (or its JSON file holds).

    Returns
    -------
    str
    """
    s = result["summary"]
    lines = [f"# Locator heads and grafting: {result['tag']} on {result['subset']} "
             f"(n = {result['n']})", ""]
    if result.get("missing_rows"):
        lines += [f"Rows not run (a deviation from §8): {', '.join(result['missing_rows'])}.",
                  ""]
    lines += method_table(s, [("", list(result["rows"]))])
    lines += ["", "| paired difference (step accuracy, points) | estimate [95% CI] |",
              "|---|---|"]
    for k, v in result["paired"].items():
        lines.append(f"| {k} | {format_interval(v)} |")
    gap = result.get("gap_closed")
    lines += ["", "Gap closed by grafting, (grafted − judge) / (recommended − judge): "
              + (format_interval(gap, pct=False) if gap else "no gap to close on this cell "
                 "(or a row missing)") + ".", ""]
    lines += ["| row | seconds | × one bare forward pass of the same prompts |", "|---|---|---|"]
    for k, v in result["times"].items():
        lines.append(f"| {k} | {v} | {result['cost_vs_bare_forward'][k]} |")
    lines += ["", f"Bare forward pass of the {result['n_prompt_tokens_last']:,} prompt tokens: "
              f"{result['bare_forward_s']} s (calibrated rate). Machine: {result['machine']}; "
              f"dtype {result['dtype']}; total {result['total_s']} s.", ""]
    if result.get("command"):
        lines += [f"Command: `{result['command']}`", ""]
    return "\n".join(lines)
