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
import hashlib
import json
import time
from pathlib import Path

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold
from sklearn.pipeline import make_pipeline

from ..baselines import (
    DummyStepClassifier,
    GraftedJudge,
    grafted_split_predictions,
    recheck_graft_store,
)
from ..compose import SiteConcatenator
from ..configurations import (
    PREREGISTERED_SITES,
    RECOMMENDED,
    make_configuration,
    parse_configuration,
)
from ..featurizers import TurnPositionTransformer, TurnTextTransformer
from ..llm import (
    PromptTemplate,
    TurnActivationTransformer,
    calibrate_seconds,
    conversation_content,
    decoder_layout,
    identity_matches,
    model_identity,
    parse_site_spec,
    plan,
)
from ..metrics import locator_head_accuracy
from ..model_selection import (
    FoldResultStore,
    ResultStoreError,
    SiteSelector,
    format_interval,
    grid_search_C,
    method_table,
    outer_splits,
    paired_differences,
    read_json,
    summarize_predictions,
    write_json,
)
from ..probes import GroupedArgmaxLogisticClassifier
from ..report import plot_locator_heads
from ..utils.grouped import grouped_argmax
from ._peers import judge_predictions
from ._who_and_when import (
    _folds,
    _machine,
    _open_cell,
    _say,
    _sigterm_as_interrupt,
    prereg_store_signature,
)

__all__ = ["LOCATOR_ROWS", "LocatorBenchmarkSettings", "gap_closed", "locator_heads_summary",
           "locator_markdown", "recommended_fits_from_store", "run_locator_benchmark",
           "top_locator_head"]

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
    deviation, named in the result). ``resume=True`` keeps each row's finished outer
    fits in ``<out>/locators_<tag>_<subset>.partial-<row>.json`` and reuses them;
    ``extract_only=True`` fills ``cache_dir`` with the whole-set features and stops;
    ``recheck_grafts=N`` computes N stored graft scorings of the cell's store again
    and compares them, and stops (see :func:`run_locator_benchmark`).
    ``keep_kv=True`` (with ``resume`` and ``cache_dir``) keeps the grafted judge's
    prompt KV caches in ``cache_dir`` until their grafts are done, beyond the run
    (``keep_kv`` of :func:`skafa.baselines.grafted_split_predictions`), so a run
    interrupted between its head statistics and its grafts reads no prompt again.
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
    extract_only: bool = False
    recheck_grafts: int = 0
    keep_kv: bool = False
    recommended_from: str | None = None
    judge_scores_from: str | None = None
    resume: bool = False
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


def _json_ready(obj):
    """``obj`` as it reads back from a JSON file (numpy numbers become plain ones)."""
    return json.loads(json.dumps(obj, default=str))


@dataclasses.dataclass
class _Cell:
    """What the rows of one cell share: records, labels, settings, whole-set features."""

    settings: LocatorBenchmarkSettings
    convs: list
    y: np.ndarray
    groups: np.ndarray
    common: dict
    judge_common: dict  # the judges' prompt leaves room for the answer tokens
    H: object = None  # head-attention features (locator_probe, top_locator_head)
    A: object = None  # the recommended configuration's activations
    selector: object = None  # the recommended configuration's unfitted SiteSelector
    graft_store: object = None  # with resume: the grafted judge's per-conversation store
    recommended_fits: dict = None  # recommended_from: §3's stored fits of the same cell


# Each row's outer fits: ``fits(cell, todo)`` yields ``(repeat, fold, test predictions,
# info)`` for every ``(repeat, fold, train, test)`` of ``todo`` (the fits not stored
# yet), in any order and as soon as each is known. A row may compute all its fits in
# one call and then yield them; the runner stores, times and logs what it yields.
def _fits_locator_probe(cell, todo):
    for r, f, train, test in todo:
        pred, info = _locator_probe(cell.H, cell.y, cell.groups, train, test, cell.settings)
        yield r, f, pred, info


def _fits_top_locator_head(cell, todo):
    for r, f, train, test in todo:
        site, head, mass = top_locator_head(cell.H[train], cell.y[train])
        yield r, f, _predict_with_head(cell.H[test], site, head), {
            "site": site, "head": head, "mass": mass}


def _grafted_judge(cell):
    """The cell's unfitted grafted judge (§8's grids and inner folds)."""
    s = cell.settings
    return GraftedJudge(s.model, locator_grid=list(s.locator_grid),
                        writer_grid=list(s.writer_grid), cv=GroupKFold(s.inner_folds),
                        verbose=1, **cell.judge_common)


def _fits_grafted_judge(cell, todo):
    # every outer fit at once: the head statistics do not depend on the fit, and each
    # prompt is read twice in all (grafted_split_predictions equals fitting per fit);
    # with a cache dir, once: the prompts' KV caches wait there between the two passes
    s = cell.settings
    predictions, fits = grafted_split_predictions(
        _grafted_judge(cell), cell.convs, cell.y, [(train, test) for _, _, train, test in todo],
        groups=cell.groups, store=cell.graft_store, kv_dir=s.cache_dir,
        keep_kv=bool(s.keep_kv))
    for (r, f, _, _), pred, info in zip(todo, predictions, fits):
        yield r, f, pred, info


def _fits_recommended(cell, todo):
    y, groups = cell.y, cell.groups
    for r, f, train, test in todo:
        if cell.recommended_fits is not None:  # §3's store of the same cell (checked)
            pred, info = cell.recommended_fits[r, f]
            yield r, f, pred, info
            continue
        sel = clone(cell.selector).fit(cell.A[train], y[train], groups=groups[train])
        yield r, f, sel.predict(cell.A[test]), {"sites": list(sel.best_sites_),
                                                "C": sel.best_params_["C"]}


def _fits_featurized(featurizer):
    def fits(cell, todo):
        s, convs, y, groups = cell.settings, cell.convs, cell.y, cell.groups
        for r, f, train, test in todo:
            ctr, cte = [convs[i] for i in train], [convs[i] for i in test]
            fitted = clone(featurizer).fit(ctr)  # on the training part only
            gs = grid_search_C(fitted.transform(ctr), y[train], groups[train],
                               Cs=s.baseline_Cs, inner=s.inner_folds, n_jobs=1,
                               random_state=0)
            yield r, f, gs.predict(fitted.transform(cte)), {"C": gs.best_params_["C"]}
    return fits


def _fits_most_frequent(cell, todo):
    convs, y = cell.convs, cell.y
    for r, f, train, test in todo:
        d = DummyStepClassifier(strategy="most_frequent").fit([convs[i] for i in train],
                                                              y[train])
        yield r, f, d.predict([convs[i] for i in test]), {}


_FITS = {"locator_probe": _fits_locator_probe, "top_locator_head": _fits_top_locator_head,
         "grafted_judge": _fits_grafted_judge, "recommended": _fits_recommended,
         "position": _fits_featurized(TurnPositionTransformer()),
         "tfidf": _fits_featurized(TurnTextTransformer()),
         "most_frequent": _fits_most_frequent}


def recommended_fits_from_store(path, settings, model, convs, y, template, budget, splits):
    """The recommended row's outer fits, read from §3's fit store of the same cell.

    §8's recommended row is §3's recommended configuration (:data:`RECOMMENDED`) on
    the same outer folds, so where §3 ran the same cell (model, dtype, records,
    labels, prompt and budget, searched sites, folds) its store
    ``prereg_<tag>_<subset>.partial-echo.json`` already holds exactly these fits
    (checked: the two SmolLM2 cells of §8 computed them again and got the same
    predictions and choices in all 30 outer fits). Reusing them saves the
    recommended configuration's feature pass (an ``echo`` read, twice the prompt).

    Parameters
    ----------
    path : str or path-like
        §3's store of the ``echo`` read.
    settings : LocatorBenchmarkSettings
        The cell's settings (``dtype`` resolved, ``folds``, ``inner_folds``).
    model : torch.nn.Module
        The loaded model (for its number of layers).
    convs, y : list of Conversation, ndarray
        The cell's records and decisive steps.
    template : PromptTemplate
        The features' prompt (its fingerprint must match).
    budget : int
        The prompt budget.
    splits : list of (repeat, fold, train, test)
        The cell's outer fits; every one must be stored.

    Returns
    -------
    fits : dict
        ``(repeat, fold) -> (test predictions, {"sites": [...], "C": float})``.

    Raises
    ------
    ResultStoreError
        Naming the file and every difference: another model, dtype, prompt, budget,
        sites, configuration definitions, folds or records, or a missing, malformed
        or out-of-grid fit.
    """
    path = Path(path)
    read, kind, Cs, n_sites, features = parse_configuration(RECOMMENDED)
    old = read_json(path)
    if not (isinstance(old, dict) and isinstance(old.get("signature"), dict)
            and isinstance(old.get("entries"), dict)):
        raise ResultStoreError(f"--recommended-from {path}: not a fit store (no signature "
                               "and entries).")
    sig = old["signature"]
    sites = list(parse_site_spec(PREREGISTERED_SITES, decoder_layout(model).n_layers))
    want = prereg_store_signature(None, read, template, budget, sites, settings, convs, y)
    problems = [f"{k} {json.dumps(sig.get(k))[:80]}, not {json.dumps(v)[:80]}"
                for k, v in want.items() if k != "model"
                and json.dumps(sig.get(k), sort_keys=True) != json.dumps(v, sort_keys=True)]
    if set(sig) != set(want):
        problems.append(f"signature fields {sorted(sig)}, not {sorted(want)}")
    if not identity_matches(sig.get("model"), settings.model):
        problems.append(f"model {sig.get('model')!r}, not {model_identity(settings.model)!r}")
    if problems:
        raise ResultStoreError(f"--recommended-from {path}: not this cell's §3 store of "
                               f"the {read!r} read: {'; '.join(problems)}.")
    store = FoldResultStore(path, sig)  # the entries' structure, checked
    fits = {}
    for r, f, _, test in splits:
        store.check(r, f, len(test))
        got = store.get(r, f).get(RECOMMENDED)
        if got is None:
            raise ResultStoreError(f"--recommended-from {path}: no fit of {RECOMMENDED!r} "
                                   f"for repeat {r} fold {f}.")
        pred, _, info = got
        chosen = info.get("sites") if isinstance(info, dict) else None
        C = info.get("C") if isinstance(info, dict) else None
        if (not isinstance(chosen, list) or len(chosen) != n_sites
                or len(set(map(str, chosen))) != n_sites or not set(map(str, chosen)) <= set(sites)
                or C not in Cs
                or any(p >= len(convs[i].turns) for p, i in zip(pred.tolist(), test))):
            raise ResultStoreError(f"--recommended-from {path}: the fit of repeat {r} fold "
                                   f"{f} has choices {info!r}, not {n_sites} of the searched "
                                   f"sites and a C of {list(Cs)}, or steps beyond "
                                   "its test records' turns.")
        fits[r, f] = pred, {"sites": [str(x) for x in chosen], "C": float(C)}
    return fits


def _cell_signature(settings, tag, subset, convs, y, template, budget):
    """What every row's stored fits depend on: model, records, labels, prompt."""
    contents = json.dumps([conversation_content(c) for c in convs], sort_keys=True,
                          default=str)
    return {"benchmark": "locators (docs/benchmarks.md §8)",
            "model": str(settings.model), "tag": tag,
            "model_identity": model_identity(settings.model), "subset": subset,
            "record_ids": [str(c.record_id) for c in convs], "y": [int(v) for v in y],
            "contents_sha256": hashlib.sha256(contents.encode("utf-8")).hexdigest(),
            "dtype": settings.dtype, "prompt": template.fingerprint(),
            "prompt_budget": budget}


def _store_signature(cell_signature, settings, row, judge_template):
    """Everything the stored fits of ``row`` depend on (a store with another is refused)."""
    sig = {**cell_signature, "row": row}
    if row in ("judge", "grafted_judge"):
        sig["judge_prompt"] = judge_template.fingerprint()
    if row != "judge":  # the judge is fitted once on the whole set: no folds
        sig.update(folds=settings.folds, inner_folds=settings.inner_folds,
                   repeats=settings.repeats)
    sig.update({"locator_probe": {"locator_Cs": sorted(settings.locator_Cs)},
                "grafted_judge": {"locator_grid": list(settings.locator_grid),
                                  "writer_grid": list(settings.writer_grid)},
                "recommended": {"configuration": RECOMMENDED},
                "position": {"baseline_Cs": list(settings.baseline_Cs)},
                "tfidf": {"baseline_Cs": list(settings.baseline_Cs)}}.get(row, {}))
    return sig


def _extraction_counts(extractor, n_conversations):
    """``(extracted, cached)`` conversations of the extractor's transform since ``fit``.

    ``cached`` includes those another process sharing the cache wrote while this
    one ran (a miss at the first look, then found): counting cache misses as
    extracted would count those twice.
    """
    extracted = int(extractor.run_stats["n_extracted"])
    return extracted, int(n_conversations) - extracted


def run_locator_benchmark(settings, conversations, *, subset_label=None, log=None):
    """Run one §8 cell and write ``locators_<tag>_<subset>.json`` and ``.md``.

    With ``settings.resume``, each row's finished outer fits go at once to
    ``<out>/locators_<tag>_<subset>.partial-<row>.json`` (a
    :class:`~skafa.model_selection.FoldResultStore` whose signature names the
    model, records, labels, prompt, folds and the row's grid; the judge, fitted
    once on the whole set, is one entry), and a rerun computes only the fits not
    stored there: a killed run loses at most the fits in progress, and the
    whole-set passes (features, judge) run only for rows with fits missing. The
    result is the uninterrupted run's; its ``times`` add each stored fit's own
    seconds, and a pass not rerun is named under ``resumed``.

    With ``settings.extract_only``, only the whole-set feature passes run (the
    head-attention features and the recommended configuration's activations, as
    far as ``settings.rows`` needs them), into ``settings.cache_dir``; no fit, no
    result file.

    With ``settings.recheck_grafts = N`` (> 0), only
    :func:`skafa.baselines.recheck_graft_store` runs: N graft scorings of the
    cell's store (``<out>/locators_<tag>_<subset>.partial-grafted_judge-scores.json``)
    are computed again with this code and compared with the stored ones, bit for
    bit; nothing is written.

    Parameters
    ----------
    settings : LocatorBenchmarkSettings
    conversations : list of Conversation
        Labelled records.
    subset_label : str, default=None
        Name in tables and file names (default ``settings.subset``).
    log : callable, default=None
        Called with each progress line (one per finished outer fit and row);
        None: silent.

    Returns
    -------
    result : dict
        What the JSON file holds; with ``extract_only``:
        ``{"extract_only": True, "extracted": {...}, "times": {...}}``; with
        ``recheck_grafts``: ``{"recheck_grafts": <recheck_graft_store's result>}``.

    Raises
    ------
    ValueError
        An unknown row, or ``extract_only`` without ``cache_dir``.
    ResultStoreError
        A partial store written with other settings (with ``resume``), before
        any pass runs.

    Notes
    -----
    In the main thread, SIGTERM (``kill``) stops the run as Ctrl-C does: the
    stores keep what finished and the grafted judge's temporary KV folder
    under ``cache_dir`` is removed. Only SIGKILL leaves that folder
    (``skafa-grafted-kv-*``) behind.
    """
    with _sigterm_as_interrupt():  # kill (SIGTERM) stops it as Ctrl-C: temp KV folder removed
        return _run_locator_benchmark(settings, conversations, subset_label, log)


def _stored_fits(store, row, splits, n):
    """``{(repeat, fold): (predictions, choice, seconds)}`` of ``row`` in ``store``, checked."""
    keys = [(0, 0, n)] if row == "judge" else [(r, f, len(test)) for r, f, _, test in splits]
    fits = {}
    for r, f, n_test in keys:
        store.check(r, f, n_test)
        got = store.get(r, f).get(row)
        if got is None:
            continue
        if not isinstance(got[2], dict) or {"choice", "seconds"} - set(got[2]):
            raise ResultStoreError(f"{store.path}: the stored fit {row!r} of repeat "
                                   f"{r} fold {f} lacks its choice or seconds; "
                                   "remove the file.")
        fits[r, f] = (got[0], got[2]["choice"], float(got[2]["seconds"]))
    return fits


def _run_locator_benchmark(settings, conversations, subset_label, log):
    unknown = [r for r in settings.rows if r not in LOCATOR_ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; the rows of §8 are {list(LOCATOR_ROWS)}.")
    if settings.extract_only and not settings.cache_dir:
        raise ValueError("extract_only (--extract-only) needs cache_dir (--cache-dir): "
                         "without a cache the extracted features would not be kept.")
    if settings.keep_kv and not (settings.resume and settings.cache_dir):
        raise ValueError("keep_kv (--keep-kv) needs resume (--resume) and cache_dir "
                         "(--cache-dir): the KV caches are kept for the grafted judge's "
                         "store, in the cache folder.")
    t_all = time.perf_counter()
    subset = subset_label or settings.subset
    convs, tag, y, groups, model, tokenizer, ctx, budget = _open_cell(settings, conversations)
    tag = "smoke" if settings.smoke else tag
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    # the judges append answer tokens after the prompt: 16 tokens of room, as §3's runner
    judge_budget = min(budget, ctx - 16)
    judge_template = PromptTemplate(shorten="middle_first", max_prompt_tokens=judge_budget)
    shortened = plan(convs, tokenizer, template, max_tokens=budget, read="last")
    n_tokens = int(sum(r["n_tokens"] for r in shortened))
    rows = [r for r in LOCATOR_ROWS if r in settings.rows]
    splits = outer_splits(y, groups, n_folds=settings.folds, n_repeats=settings.repeats)
    out = Path(settings.out)
    stem = f"locators_{tag}_{subset}"
    common = dict(prompt=template, dtype=settings.dtype)
    cell = _Cell(settings, convs, y, groups, common,
                 dict(prompt=judge_template, dtype=settings.dtype))
    if settings.resume:  # head statistics and graft scores, kept conversation by conversation
        cell.graft_store = out / f"{stem}.partial-grafted_judge-scores.json"
    if settings.recheck_grafts:
        import torch

        path = out / f"{stem}.partial-grafted_judge-scores.json"
        _say(log, f"recheck: {settings.recheck_grafts} stored graft scorings of {path} "
                  f"computed again ({torch.get_num_threads()} threads)")
        got = recheck_graft_store(_grafted_judge(cell), convs, y, store=path,
                                  n_scorings=settings.recheck_grafts)
        written = got["store_threads"] or "not recorded"
        _say(log, f"recheck: {got['n_equal']} of {got['n_checked']} equal bit for bit "
                  f"(max |difference| {got['max_abs_difference']:.3g}; conversations "
                  f"{', '.join(got['conversations'])}; {got['n_prompt_tokens']:,} prompt "
                  f"tokens; {got['seconds']:.1f} s; store written with threads: {written})")
        return {"recheck_grafts": got}

    # ---- stored fits (resume): each row's store is opened, and checked, before any pass
    stores, done = {}, {r: {} for r in rows}  # done[row][(r, f)] = (pred, info, seconds)
    heads_file = stored_heads = None  # with resume: the heatmap's summary, kept
    if settings.resume and not settings.extract_only:
        base = _cell_signature(settings, tag, subset, convs, y, template, budget)
        if any(r in rows for r in ("locator_probe", "top_locator_head")):
            heads_file = (out / f"{stem}.partial-locator_heads.json",
                          {**base, "row": "locator_heads"})
            stored_heads = _read_locator_heads(*heads_file)
        for row in rows:
            stores[row] = store = FoldResultStore(out / f"{stem}.partial-{row}.json",
                                                  _store_signature(base, settings, row,
                                                                   judge_template))
            done[row] = _stored_fits(store, row, splits, len(convs))
    reused = {row: len(done[row]) for row in rows if done[row]}
    todo = {row: [s for s in splits if (s[0], s[1]) not in done[row]] for row in rows}
    if "judge" in rows and done["judge"]:
        todo["judge"] = []
    from_store = None
    if settings.recommended_from and "recommended" in rows and not settings.extract_only:
        # checked even when this cell's own store already holds every fit read from it
        cell.recommended_fits = recommended_fits_from_store(
            settings.recommended_from, settings, model, convs, y, template, budget, splits)
        path = Path(settings.recommended_from)
        from_store = {"file": path.name, "sha256": hashlib.sha256(
            path.read_bytes()).hexdigest(), "fits": len(todo["recommended"])}
        _say(log, f"recommended: {len(todo['recommended'])} outer fits read from §3's store "
                  f"{path.name} (same cell; checked), its feature pass not run")

    # ---- whole-set passes (unsupervised), only for rows with fits to compute
    times, skipped, extracted = {}, [], {}

    def timed(key, fn):
        t = time.perf_counter()
        value = fn()
        times[key] = times.get(key, 0.0) + time.perf_counter() - t
        return value

    head_rows = [r for r in ("locator_probe", "top_locator_head") if r in rows]
    if head_rows and (settings.extract_only or any(todo[r] for r in head_rows)):
        ext = TurnActivationTransformer(settings.model, read="last", sites="head_attn",
                                        cache_dir=settings.cache_dir, verbose=1, **common)
        _say(log, f"head-attention features of {len(convs)} conversations ({n_tokens:,} "
                  "prompt tokens, read 'last')")
        cell.H = timed("features head_attn", lambda: ext.fit_transform(convs))
        extracted["features head_attn"] = _extraction_counts(ext, len(convs))
    elif head_rows:
        skipped.append("features head_attn")
        if stored_heads is not None:
            _say(log, f"per-head heatmap: summary read from {heads_file[0].name}")
        elif settings.cache_dir:  # only the per-head heatmap needs them: cached, not timed
            ext = TurnActivationTransformer(settings.model, read="last", sites="head_attn",
                                            cache_dir=settings.cache_dir, verbose=1, **common)
            cell.H = ext.fit_transform(convs)
            n_new, _ = _extraction_counts(ext, len(convs))
            _say(log, f"head-attention features for the heatmap read from the cache "
                      f"({n_new} of {len(convs)} conversations not cached, extracted)")
    if "recommended" in rows and not settings.recommended_from and (
            settings.extract_only or todo["recommended"]):
        acts, selector = make_configuration(RECOMMENDED, settings.model, verbose=1,
                                            cache_dir=settings.cache_dir, **common)
        # the cell's inner folds, as every other row (and §3) chooses on: GroupKFold(5) in
        # the plan, fewer in a smoke run
        cell.selector = selector.set_params(cv=GroupKFold(settings.inner_folds))
        _say(log, f"activations of the recommended configuration ({RECOMMENDED})")
        cell.A = timed("features recommended", lambda: acts.fit_transform(convs))
        extracted["features recommended"] = _extraction_counts(acts, len(convs))
    elif "recommended" in rows:
        skipped.append("features recommended")
    if settings.extract_only:
        for key, (n_new, n_cached) in extracted.items():
            _say(log, f"extract-only, {key}: {n_new} conversations extracted, {n_cached} "
                      f"already cached, of {len(convs)} (cache {settings.cache_dir})")
        if not extracted:
            _say(log, f"extract-only: rows {rows} read no whole-set features; nothing done")
        return {"extract_only": True,
                "extracted": {k: {"extracted": a, "cached": b}
                              for k, (a, b) in extracted.items()},
                "times": {k: round(v, 1) for k, v in times.items()}}

    # ---- the rows' outer fits: stored at once, logged one line each
    def finish(row, r, f, pred, info, seconds):
        info = _json_ready(info)
        done[row][r, f] = (np.asarray(pred, dtype=np.int64), info, seconds)
        if row in stores:
            stores[row].put(r, f, {row: (pred, None, {"choice": info, "seconds": seconds})})

    n_fits = len(splits)
    for row in rows:
        if row == "judge":
            if todo["judge"]:
                t = time.perf_counter()
                # per conversation into the cache (and, with resume, a score store), so
                # an interrupted judge pass goes on where it stopped
                pred = judge_predictions(
                    settings, convs, judge_template, settings.cache_dir,
                    store=out / f"{stem}.partial-judge-scores.json" if settings.resume else None,
                    earlier=settings.judge_scores_from)
                finish("judge", 0, 0, pred, {}, time.perf_counter() - t)
                _say(log, f"judge: {len(convs)} conversations in "
                          f"{done['judge'][0, 0][2]:.1f}s (fitted once, all outer fits)")
            continue
        if row in stores and todo[row]:
            # another process (e.g. a second runner with --rows) may have stored fits of
            # this row since the start: read them, fit only the rest
            done[row].update(_stored_fits(stores[row].refresh(), row, splits, len(convs)))
            found = [s for s in todo[row] if (s[0], s[1]) in done[row]]
            if found:
                reused[row] = reused.get(row, 0) + len(found)
                todo[row] = [s for s in todo[row] if (s[0], s[1]) not in done[row]]
                _say(log, f"{row}: {len(found)} outer fits found in {stores[row].path.name}, "
                          "stored since this run started")
        if not todo[row]:
            continue
        t = time.perf_counter()
        for r, f, pred, info in _FITS[row](cell, _folds(todo[row], f"{row} outer fits")):
            finish(row, r, f, pred, info, time.perf_counter() - t)
            _say(log, f"{row}: repeat {r} fold {f} done in {done[row][r, f][2]:.1f}s "
                      f"({len(done[row])}/{n_fits} outer fits, {time.perf_counter() - t_all:.0f}s "
                      "elapsed)")
            t = time.perf_counter()

    P = {row: np.full((settings.repeats, len(convs)), -1, dtype=np.int64) for row in rows}
    infos = {row: [] for row in rows}
    for row in rows:
        if row == "judge":
            pred, _, seconds = done["judge"][0, 0]
            P["judge"][:] = pred[None, :]
            times["judge"] = seconds
            continue
        for r, f, _, test in splits:
            pred, info, seconds = done[row][r, f]
            P[row][r, test] = pred
            if info:  # most_frequent chooses nothing
                infos[row].append(info)
            times[row] = times.get(row, 0.0) + seconds

    summary, per_conv = summarize_predictions(P, y, convs, groups,
                                              n_resamples=settings.n_resamples)

    pairs = [(a, b) for a, b in _PAIRS if a in rows and b in rows]
    diffs = paired_differences(per_conv, pairs, groups, n_resamples=settings.n_resamples)
    gap = (gap_closed(per_conv, groups, n_resamples=settings.n_resamples)
           if {"grafted_judge", "judge", "recommended"} <= set(rows) else None)
    # ---- cost relative to one bare forward pass of the same prompt tokens
    # priced per prompt, attention apart (one 512-token rate ignores the n^2 term: far
    # too little time for Hand-Crafted's 32k-token prompts)
    bare = float(np.sum(calibrate_seconds(model, [r["n_tokens"] for r in shortened])
                        ["seconds"]))
    result = {
        "model": str(settings.model), "tag": tag, "subset": subset, "n": len(convs),
        "rows": rows, "missing_rows": [r for r in LOCATOR_ROWS if r not in rows],
        "summary": summary, "paired": diffs, "gap_closed": gap, "choices": infos,
        "dtype": settings.dtype, "prompt_budget": budget, "judge_prompt_budget": judge_budget,
        "n_prompt_tokens_last": n_tokens,
        "bare_forward_s": round(bare, 2),
        "bare_forward_method": ("calibrate_seconds: a 512-token and a longer timed pass, "
                                "attention priced apart"),
        "cost_vs_bare_forward": {k: round(v / bare, 2) for k, v in times.items()},
        "times": {k: round(v, 1) for k, v in times.items()},
        "total_s": round(time.perf_counter() - t_all, 1),
        "machine": _machine(), "command": settings.command,
        "predictions": {k: v.tolist() for k, v in P.items()},
    }
    if settings.resume:
        result["resumed"] = {"fits_reused": reused, "passes_not_rerun": skipped}
    if from_store is not None:
        result["recommended_from"] = from_store
    if settings.judge_scores_from and todo.get("judge"):
        path = Path(settings.judge_scores_from)
        result["judge_scores_from"] = {"file": path.name, "sha256": hashlib.sha256(
            path.read_bytes()).hexdigest()}
    heads = locator_heads_summary(cell.H, y) if cell.H is not None else stored_heads
    if heads is not None and heads_file is not None and heads != stored_heads:
        write_json(heads_file[0], {"signature": heads_file[1], "locator_heads": heads})
    if heads is not None:
        result["locator_heads"] = dict(heads)
        png = _plot_heads(result["locator_heads"], out / f"{stem}_heads.png", log)
        result["locator_heads"]["figure"] = None if png is None else Path(png).name
    write_json(out / f"{stem}.json", result, indent=1)
    md = locator_markdown(result)
    (out / f"{stem}.md").write_text(md)
    _say(log, md)
    return result


def locator_heads_summary(H, y, *, top=5):
    """Per-head locator accuracy on every record of a cell (descriptive, no fit).

    Parameters
    ----------
    H : TurnFeatures
        Head-attention features (one site per layer, one column per head).
    y : array-like of int
        Decisive steps.
    top : int, default=5
        How many of the best heads to list.

    Returns
    -------
    dict
        ``accuracy`` (layers x heads), ``chance``, ``sites`` and ``top``: the best
        heads as ``[site, head, accuracy]``, best first (ties: earlier site, head).
        In-sample by construction: every record is both ranked and scored, so the
        best head's accuracy is optimistic; the held-out version is the
        ``top_locator_head`` row.
    """
    acc, chance = locator_head_accuracy(H, y)
    return _heads_summary(acc, chance, list(H.sites), top)


def _heads_summary(acc, chance, sites, top=5):
    order = sorted(np.ndindex(*acc.shape), key=lambda lh: (-acc[lh], lh))[:top]
    return {"accuracy": np.round(acc, 4).tolist(), "chance": round(float(chance), 4),
            "sites": list(sites),
            "top": [[sites[l], int(h), round(float(acc[l, h]), 4)] for l, h in order]}


def _read_locator_heads(path, signature):
    """The per-head heatmap summary a resumed run kept, or None where there is none.

    With ``--resume`` the §8 runner keeps :func:`locator_heads_summary` of the cell in
    ``<out>/locators_<tag>_<subset>.partial-locator_heads.json``, so a later run
    writes the heatmap without the head-attention features (an activation cache
    does not always outlive a session). The file is checked in full: its signature
    must be ``signature`` (the cell's), the accuracy a layers x heads matrix of
    shares in [0, 1], one unique site name per layer, the chance a share; ``top``
    is computed again from the matrix, not read.

    Parameters
    ----------
    path : path-like
    signature : dict

    Returns
    -------
    dict or None

    Raises
    ------
    ResultStoreError
        For another signature or a malformed summary (naming the file).
    """
    path = Path(path)
    if not path.exists():
        return None
    doc = read_json(path)
    canon = json.loads(json.dumps(signature, sort_keys=True, default=str))
    if not isinstance(doc, dict) or doc.get("signature") != canon:
        raise ResultStoreError(f"{path} was written with other settings (model, prompt, "
                               "records) or is not a heatmap summary; remove it.")
    heads = doc.get("locator_heads")
    try:
        acc = np.asarray(heads["accuracy"], dtype=np.float64)
        sites, chance = heads["sites"], float(heads["chance"])
        ok = (acc.ndim == 2 and acc.size and np.all((acc >= 0) & (acc <= 1))
              and isinstance(sites, list) and len(sites) == acc.shape[0]
              and all(isinstance(x, str) for x in sites) and len(set(sites)) == len(sites)
              and 0 <= chance <= 1)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ResultStoreError(f"{path}: not a per-head summary (a layers x heads matrix "
                               "of shares, one site per layer, a chance share); remove it.")
    return _heads_summary(acc, chance, sites)


def _plot_heads(heads, path, log):
    """The per-head heatmap as a PNG; None (said through ``log``) without matplotlib."""
    try:
        fig = plot_locator_heads(np.asarray(heads["accuracy"]), path, chance=heads["chance"],
                                 layer_labels=heads["sites"])
    except ImportError:
        _say(log, "matplotlib not installed: no heatmap (pip install 'skafa[plot]')")
        return None
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


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
    # rows read from another run's store cost this run only the reading: not a cost
    elsewhere = {row: (result.get(key) or {}).get("file") for row, key in
                 (("recommended", "recommended_from"), ("judge", "judge_scores_from"))}
    for k, v in result["times"].items():
        if elsewhere.get(k):
            lines.append(f"| {k} | {v} (read from `{elsewhere[k]}`, not computed here) | — |")
        else:
            lines.append(f"| {k} | {v} | {result['cost_vs_bare_forward'][k]} |")
    lines += ["", f"Bare forward pass of the {result['n_prompt_tokens_last']:,} prompt tokens: "
              f"{result['bare_forward_s']} s "
              f"({result.get('bare_forward_method', 'one 512-token rate')}). Prompt budget "
              f"{result['prompt_budget']} tokens, the judges' "
              f"{result.get('judge_prompt_budget', result['prompt_budget'])} (room for the "
              f"answer tokens). Machine: {result['machine']}; "
              f"dtype {result['dtype']}; total {result['total_s']} s.", ""]
    resumed = result.get("resumed") or {}
    if resumed.get("fits_reused"):
        lines += ["Resumed (--resume): outer fits read from the per-row stores ("
                  + ", ".join(f"{k} {v}" for k, v in resumed["fits_reused"].items())
                  + "); a stored fit's seconds are those measured when it ran, under that "
                  "run's threads and load, so their ratios to this run's bare pass are not a "
                  "cost measurement (an interleaved one: examples/benchmark_locator_cost.py)"
                  + (f"; not rerun, so not timed: {', '.join(resumed['passes_not_rerun'])}"
                     if resumed.get("passes_not_rerun") else "") + ".", ""]
    src = result.get("recommended_from")
    if src:
        lines += ["The recommended row's outer fits come from §3's fit store of the same "
                  f"cell, `{src['file']}` (sha256 {src['sha256'][:12]}; same model, dtype, "
                  "records, prompt, budget, sites and folds, checked; `--recommended-from`; "
                  f"{src['fits']} read from it in this run, the others from this cell's own "
                  "store of them), not computed again.", ""]
    src = result.get("judge_scores_from")
    if src:
        lines += [f"The prompted judge's scores were read, where it held them, from another "
                  f"run's judge score store of the same judge, `{src['file']}` (sha256 "
                  f"{src['sha256'][:12]}; same model, dtype, prompt and answer prefix, and "
                  "each conversation's digest, checked; `--judge-scores-from`).", ""]
    heads = result.get("locator_heads")
    if heads:
        best = ", ".join(f"{site} head {h} {100 * a:.1f}%" for site, h, a in heads["top"])
        lines += [f"Per-head locator accuracy on all {result['n']} records (descriptive and "
                  "in-sample: each head's most-attended turn against the decisive step, no "
                  f"fit; the held-out version is the top_locator_head row): chance "
                  f"{100 * heads['chance']:.1f}%; best heads {best}."
                  + (f" Heatmap: [{heads['figure']}]({heads['figure']})."
                     if heads.get("figure") else ""), ""]
    if result.get("command"):
        lines += [f"Command: `{result['command']}`", ""]
    return "\n".join(lines)
