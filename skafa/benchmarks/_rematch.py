"""The two fixed candidates of the 1.5B rematch (docs/benchmarks.md §7): C28 and C29.

Both rows are scored on the outer folds of §3 (:func:`skafa.model_selection.outer_splits`
on each subset's own labels and task ids), with fixed hyper-parameters (no grid
beyond the recommended configuration's own inner search):

``C28 reader ensemble``
    A :class:`~skafa.model_selection.TurnScoreStacker` whose base estimators are the
    recommended configuration (:data:`~skafa.configurations.RECOMMENDED`) on each
    reader of ``ensemble_readers``, each at its own prompt budget of §3, composed with
    :func:`~skafa.compose.make_attribution_pipeline`; out-of-fold turn scores from
    ``GroupKFold(inner_folds)`` inside the outer training part, final
    ``GroupedSoftmaxClassifier(C=1.0)``.
``C29 pooled training``
    The recommended configuration on ``reader``, its selector fitted on the row-union
    (:meth:`~skafa.TurnFeatures.vstack`) of every subset's training part of the same
    outer fit (fold k of repeat r of each subset, each subset read with its own prompt
    template), scored on each subset's test part separately.

Where the headline's result file of §7 (``<prereg_dir>/prereg_<tag>_<subset>.json``,
written by :func:`~skafa.benchmarks.run_benchmark`) exists and describes the same
records, labels, task ids, folds and repeats, each candidate is compared with its
``skafa (pre-registered auto)`` row and every baseline row on the same conversations
(paired, task-cluster bootstrap), and rule step 3 of §7 is applied: a candidate replaces
the recommendation only if its paired difference over the headline has a 95% CI above 0
on both subsets.
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
from sklearn.model_selection import GroupKFold

from ..compose import make_attribution_pipeline
from ..configurations import RECOMMENDED, make_configuration
from ..features import TurnFeatures
from ..llm import PromptTemplate, conversation_content, model_identity, plan
from ..model_selection import (
    FoldResultStore,
    ResultStoreError,
    TurnScoreStacker,
    format_interval,
    method_table,
    outer_splits,
    paired_differences,
    read_json,
    summarize_predictions,
    write_json,
)
from ..probes import GroupedSoftmaxClassifier
from ._who_and_when import (
    AUTO,
    BenchmarkSettings,
    _folds,
    _machine,
    _open_cell,
    _say,
    model_tag,
)

__all__ = ["REMATCH_CANDIDATES", "REMATCH_SUBSETS", "RematchSettings", "rematch_markdown",
           "run_rematch_candidates"]

#: The candidates of §7 and their rows' names.
REMATCH_CANDIDATES = {"C28": "C28 reader ensemble", "C29": "C29 pooled training"}
#: The subsets of §7 with their prompt budgets of §3 (capped at each reader's context).
REMATCH_SUBSETS = {"Algorithm-Generated": 8192, "Hand-Crafted": 32768}
_DEFAULT_ENSEMBLE = ("smollm2", "qwen2.5-coder-0.5b", "gemma-3-270m", "qwen2.5-coder-1.5b")
_DEFAULT_READER = "qwen2.5-coder-1.5b"
_FINAL = "GroupedSoftmaxClassifier(C=1.0)"


@dataclasses.dataclass
class RematchSettings:
    """Every setting of the C28 / C29 run (the command line's options).

    ``max_prompt_tokens`` maps each subset to its budget of §3; each reader reads a
    subset at ``min(its context, budget)`` (as :func:`run_benchmark` computes it).
    ``prereg_dir`` (default ``out``) holds the headline's result files
    ``prereg_<tag>_<subset>.json``; ``tag`` (default: the reader's short name, or its
    file name without ``.gguf``; ``"smoke"`` with ``smoke=True``) names them and this
    run's files ``rematch_<tag>.json`` / ``.md``. ``resume=True`` keeps each finished
    (candidate, subset, outer fit) in ``<out>/rematch_<tag>_<subset>.partial-<candidate>
    .json`` and reuses it. ``smoke=True`` marks models registered in this process only
    (a test's tiny models): fits then run in this process.
    """

    reader: str = _DEFAULT_READER
    ensemble_readers: list = dataclasses.field(default_factory=lambda: list(_DEFAULT_ENSEMBLE))
    subsets: list = dataclasses.field(default_factory=lambda: list(REMATCH_SUBSETS))
    candidates: list = dataclasses.field(default_factory=lambda: list(REMATCH_CANDIDATES))
    tag: str | None = None
    cache_dir: str | None = None
    out: str = "docs/results"
    prereg_dir: str | None = None
    max_prompt_tokens: dict = dataclasses.field(
        default_factory=lambda: dict(REMATCH_SUBSETS))
    folds: int = 5
    inner_folds: int = 5
    repeats: int = 3
    dtype: str = "auto"
    n_resamples: int = 2000
    resume: bool = False
    smoke: bool = False
    command: str = ""
    n_jobs: int | None = 1


def _deviations(settings):
    out = []
    if settings.reader != _DEFAULT_READER:
        out.append(f"reader {settings.reader!r} instead of {_DEFAULT_READER!r}")
    if list(settings.ensemble_readers) != list(_DEFAULT_ENSEMBLE):
        out.append(f"C28 readers {list(settings.ensemble_readers)} instead of "
                   f"{list(_DEFAULT_ENSEMBLE)}")
    if list(settings.subsets) != list(REMATCH_SUBSETS):
        out.append(f"subsets {list(settings.subsets)} instead of {list(REMATCH_SUBSETS)}")
    budgets = {s: settings.max_prompt_tokens.get(s) for s in settings.subsets}
    if any(REMATCH_SUBSETS.get(s) != b for s, b in budgets.items()):
        out.append(f"prompt budgets {budgets} instead of {REMATCH_SUBSETS}")
    if (settings.folds, settings.inner_folds, settings.repeats) != (5, 5, 3):
        out.append(f"GroupKFold({settings.folds}) x {settings.repeats} shuffles, inner "
                   f"GroupKFold({settings.inner_folds}) instead of 5 x 3, inner 5")
    return out


def _check_settings(settings, conversations_by_subset):
    unknown = [c for c in settings.candidates if c not in REMATCH_CANDIDATES]
    if unknown or not settings.candidates:
        raise ValueError(f"unknown candidates {unknown or settings.candidates}; the "
                         f"candidates of §7 are {list(REMATCH_CANDIDATES)}.")
    if not settings.subsets or len(set(settings.subsets)) != len(settings.subsets):
        raise ValueError(f"subsets must be distinct and non-empty, got {settings.subsets}.")
    missing = [s for s in settings.subsets if s not in conversations_by_subset]
    if missing:
        raise ValueError(f"no conversations given for subsets {missing} "
                         f"(given: {sorted(conversations_by_subset)}).")
    no_budget = [s for s in settings.subsets if s not in settings.max_prompt_tokens]
    if no_budget:
        raise ValueError(f"max_prompt_tokens names no budget for subsets {no_budget}.")
    if "C29" in settings.candidates and len(settings.subsets) < 2:
        raise ValueError("C29 pools the training parts of several subsets; it needs at "
                         f"least two, got {settings.subsets}.")
    tags = [model_tag(r) for r in settings.ensemble_readers]
    if "C28" in settings.candidates and (not tags or len(set(tags)) != len(tags)):
        raise ValueError(f"C28 needs distinct readers, got {list(settings.ensemble_readers)}.")


@dataclasses.dataclass
class _Reading:
    """One reader on one subset: its budget, template and recommended configuration."""

    reader: str
    subset: str
    budget: int
    context: int
    dtype: str
    template: PromptTemplate
    extractor: object
    selector: object
    shortening: str
    features: TurnFeatures | None = None

    def signature(self):
        return {"reader": str(self.reader), "model_identity": model_identity(self.reader),
                "subset": self.subset, "dtype": self.dtype, "budget": int(self.budget),
                "prompt": self.template.fingerprint(), "configuration": RECOMMENDED}


def _open_reading(settings, reader, subset, convs):
    """The recommended configuration of ``reader`` on ``subset``, at §3's budget."""
    cell = BenchmarkSettings(model=reader, dtype=settings.dtype, cache_dir=settings.cache_dir,
                             max_prompt_tokens=int(settings.max_prompt_tokens[subset]))
    _, _, _, _, _, tokenizer, ctx, budget = _open_cell(cell, convs)  # resolves cell.dtype
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    extractor, selector = make_configuration(RECOMMENDED, reader, prompt=template,
                                             cache_dir=settings.cache_dir, dtype=cell.dtype)
    selector.set_params(cv=GroupKFold(settings.inner_folds), n_jobs=settings.n_jobs)
    read = extractor.read
    shortened = plan(convs, tokenizer, template, max_tokens=budget, read=read)
    total = sum(sum(len(t.content) for t in c.turns) for c in convs)
    removed = int(shortened.total_chars_removed)
    note = (f"read={read} at {budget} tokens: {int(sum(r['chars_removed'] > 0 for r in shortened))}"
            f" of {len(convs)} conversations shortened, {removed:,} of {total:,} turn "
            f"characters removed ({100 * removed / max(total, 1):.1f}%)")
    return _Reading(reader, subset, budget, ctx, cell.dtype, template, extractor, selector,
                    note)


def _cell_signature(subset, convs, y, groups):
    contents = json.dumps([conversation_content(c) for c in convs], sort_keys=True,
                          default=str)
    return {"subset": subset, "record_ids": [str(c.record_id) for c in convs],
            "y": [int(v) for v in y], "task_ids": [str(g) for g in groups],
            "contents_sha256": hashlib.sha256(contents.encode("utf-8")).hexdigest()}


def _json_ready(obj):
    return json.loads(json.dumps(obj, default=str))


def _c28_stacker(readings, settings):
    """C28: the recommended configuration of every reader, stacked (unfitted)."""
    return TurnScoreStacker(
        [(model_tag(r.reader), make_attribution_pipeline(clone(r.extractor),
                                                           clone(r.selector)))
         for r in readings],
        final_estimator=GroupedSoftmaxClassifier(C=1.0),
        cv=GroupKFold(settings.inner_folds))


def _fit_c28(readings, convs, y, groups, train, test, settings):
    """C28 on one outer fit: (test predictions, choices)."""
    stk = _c28_stacker(readings, settings)
    stk.fit([convs[i] for i in train], y[train], groups=groups[train])
    pred = stk.predict([convs[i] for i in test])
    weights = np.ravel(stk.final_estimator_.coef_)
    info = {"weights": {n: float(w) for n, w in zip(stk.feature_names_, weights)},
            "sites": {n: list(est[-1].best_sites_)
                      for n, est in stk.named_estimators_.items()},
            "C": {n: est[-1].best_params_["C"] for n, est in stk.named_estimators_.items()}}
    return pred, info


def _fit_c29(readings, ys, groups, parts, settings):
    """C29 on one outer fit: the selector fitted on the union of the training parts.

    ``readings``, ``ys``, ``groups``: per subset; ``parts``: ``{subset: (train, test)}``.
    Who&When's subsets share task ids (the same task run by different systems), and
    each subset's outer folds are drawn on its own: a training record whose task id
    is in *any* subset's test part of this fit is left out of the pooled training
    (amendment of §7, committed before C29 ran), and counted in the choices
    (``n_excluded``). Task ids stay the groups, so a task's records of both subsets
    share the inner folds' sides.

    Returns ``({subset: test predictions}, choices)``.
    """
    subsets = list(parts)
    held = {str(g) for s in subsets for g in np.asarray(groups[s], dtype=object)[parts[s][1]]}
    train = {}
    for s in subsets:
        tr = np.asarray(parts[s][0], dtype=np.int64)
        keep = np.array([str(g) not in held for g in np.asarray(groups[s], dtype=object)[tr]],
                        dtype=bool)
        train[s] = (tr[keep], int((~keep).sum()))
    X = TurnFeatures.vstack([readings[s].features[train[s][0]] for s in subsets])
    yy = np.concatenate([ys[s][train[s][0]] for s in subsets])
    gg = np.concatenate([np.asarray(groups[s], dtype=object)[train[s][0]] for s in subsets])
    sel = clone(readings[subsets[0]].selector).fit(X, yy, groups=gg)
    preds = {s: sel.predict(readings[s].features[parts[s][1]]) for s in subsets}
    return preds, {"sites": list(sel.best_sites_), "C": sel.best_params_["C"],
                   "n_train": {s: int(len(train[s][0])) for s in subsets},
                   "n_excluded": {s: train[s][1] for s in subsets}}


# --------------------------------------------------------------- the headline file
def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_headline_baseline(name):
    return name in ("position-only", "TF-IDF") or name.startswith(
        ("dummy: ", "PromptedJudge", "mi4afa"))


def _read_headline(path, subset, convs, y, groups, settings):
    """The headline's §7 result file of one subset, checked against this run.

    Returns ``{row: ndarray (repeats, n)}`` of the headline row and every baseline row,
    and the file's ``dtype`` / ``model``. Raises :class:`ResultStoreError` naming the
    file and the first mismatch (records, labels, task ids, folds, repeats, shapes,
    types).
    """
    def bad(message):
        raise ResultStoreError(f"{path}: {message}; this is not the headline of this run "
                               "(rerun the headline, or point --prereg-dir elsewhere).")

    data = read_json(path)
    if not isinstance(data, dict):
        bad(f"not a JSON object but {type(data).__name__}")
    n = len(convs)
    want = {"record_ids": [str(c.record_id) for c in convs], "y_true": [int(v) for v in y],
            "task_ids": [str(g) for g in groups]}
    for key, expected in want.items():
        got = data.get(key)
        kind = _is_int if key == "y_true" else (lambda v: isinstance(v, str))
        if not isinstance(got, list) or not all(kind(v) for v in got):
            bad(f"{key!r} is not a list of {'ints' if key == 'y_true' else 'strings'}")
        if len(got) != n:
            bad(f"{key!r} has {len(got)} entries, this run {n}")
        if got != expected:
            i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            bad(f"{key!r} differs at conversation {i}: {got[i]!r} in the file, "
                f"{expected[i]!r} here")
    for key in ("folds", "repeats"):
        if not _is_int(data.get(key)) or data[key] != getattr(settings, key):
            bad(f"{key} is {data.get(key)!r}, this run {getattr(settings, key)}")
    if "subset" in data and data["subset"] != subset:
        bad(f"subset is {data['subset']!r}, not {subset!r}")
    preds = data.get("predictions")
    if not isinstance(preds, dict):
        bad("'predictions' is not an object of rows")
    n_turns = np.array([len(c) for c in convs])
    out = {}
    for name, P in preds.items():
        if not (isinstance(P, list) and len(P) == settings.repeats
                and all(isinstance(p, list) and len(p) == n and all(_is_int(v) for v in p)
                        for p in P)):
            bad(f"predictions of {name!r} are not {settings.repeats} lists of {n} ints")
        P = np.asarray(P, dtype=np.int64)
        wrong = np.argwhere((P < 0) | (P >= n_turns[None, :]))
        if wrong.size:
            r, i = (int(v) for v in wrong[0])
            bad(f"predictions of {name!r} name step {int(P[r, i])} of conversation {i} "
                f"(repeat {r}), which has {int(n_turns[i])} turns")
        if name == AUTO or _is_headline_baseline(name):
            out[name] = P
    if AUTO not in out:
        bad(f"no {AUTO!r} row")
    return out, {"dtype": str(data.get("dtype", "")), "model": str(data.get("model", "")),
                 "inner_folds": data.get("inner_folds") if _is_int(data.get("inner_folds"))
                 else None}


# --------------------------------------------------------------------------- run
def run_rematch_candidates(settings, conversations_by_subset, *, log=None):
    """Run C28 and C29 of §7 and write ``rematch_<tag>.json`` and ``.md``.

    Parameters
    ----------
    settings : RematchSettings
    conversations_by_subset : dict of str to list of Conversation
        Labelled records of every subset of ``settings.subsets``.
    log : callable, default=None
        Called with each progress line; None: silent.

    Returns
    -------
    result : dict
        What the JSON file holds: per subset the summary (exact and lenient step
        accuracy, agent accuracy, within-1, n), the paired differences against the
        headline file's rows (or why there are none), the predictions and the choices
        per outer fit; ``rule_step_3`` per candidate.

    Raises
    ------
    ValueError
        An unknown candidate, a subset without records or budget, C28 readers not
        distinct, or (with C29) a task id shared by two subsets.
    ResultStoreError
        With ``resume``, a partial store written with other settings; a headline
        file that does not describe this run's records, labels, folds or repeats.
    """
    t_all = time.perf_counter()
    _check_settings(settings, conversations_by_subset)
    subsets = list(settings.subsets)
    tag = "smoke" if settings.smoke else (settings.tag or model_tag(settings.reader))
    out, prereg_dir = Path(settings.out), Path(settings.prereg_dir or settings.out)
    convs = {s: list(conversations_by_subset[s]) for s in subsets}
    ys = {s: np.array([c.mistake_step for c in convs[s]]) for s in subsets}
    groups = {s: np.array([c.task_id for c in convs[s]], dtype=object) for s in subsets}
    splits = {s: outer_splits(ys[s], groups[s], n_folds=settings.folds,
                              n_repeats=settings.repeats) for s in subsets}
    keys = [(r, k) for r, k, _, _ in splits[subsets[0]]]
    # the headline's files are checked first: a mismatch is known before any fit
    headlines = {}
    for s in subsets:
        path = prereg_dir / f"prereg_{tag}_{s}.json"
        headlines[s] = (path, _read_headline(path, s, convs[s], ys[s], groups[s], settings)
                        if path.exists() or path.is_symlink() else None)

    # ---- every (reader, subset) a candidate reads: budget, template, configuration
    readers = {"C28": list(settings.ensemble_readers), "C29": [settings.reader]}
    readings = {}
    for cand in settings.candidates:
        for reader in readers[cand]:
            for s in subsets:
                if (reader, s) not in readings:
                    readings[reader, s] = _open_reading(settings, reader, s, convs[s])
                    _say(log, f"{model_tag(reader)} on {s}: "
                              f"{readings[reader, s].shortening}")

    # ---- stores (resume): opened and checked before any extraction
    cells = {s: _cell_signature(s, convs[s], ys[s], groups[s]) for s in subsets}
    base = {"benchmark": "rematch candidates C28/C29 (docs/benchmarks.md §7)",
            "folds": settings.folds, "inner_folds": settings.inner_folds,
            "repeats": settings.repeats, "configuration": RECOMMENDED}
    stores, done = {}, {}  # done[cand, s][(r, k)] = (pred, info, seconds)
    for cand in settings.candidates:
        for s in subsets:
            done[cand, s] = {}
            if not settings.resume:
                continue
            if cand == "C28":
                sig = {**base, "candidate": cand, "subset": s, "cell": cells[s],
                       "final_estimator": _FINAL,
                       "readers": [readings[r, s].signature() for r in readers[cand]]}
            else:  # the pooled fit depends on every subset
                sig = {**base, "candidate": cand, "subset": s,
                       "cells": [cells[t] for t in subsets],
                       "readers": [readings[settings.reader, t].signature() for t in subsets]}
            path = out / f"rematch_{tag}_{s}.partial-{cand}.json"
            stores[cand, s] = store = FoldResultStore(path, sig)
            for r, k, _, test in splits[s]:
                store.check(r, k, len(test))
                got = store.get(r, k).get(cand)
                if got is None:
                    continue
                if not isinstance(got[2], dict) or {"choice", "seconds"} - set(got[2]):
                    raise ResultStoreError(f"{path}: the stored fit of repeat {r} fold {k} "
                                           "lacks its choice or seconds; remove the file.")
                done[cand, s][r, k] = (got[0], got[2]["choice"], float(got[2]["seconds"]))
    reused = {f"{c} {s}": len(v) for (c, s), v in done.items() if v}
    todo = {c: [key for key in keys if any(key not in done[c, s] for s in subsets)]
            for c in settings.candidates}

    # ---- whole-subset extraction, once, into the cache (fits then only read it)
    times = {}
    def needs(reader, s):
        return ((reader in readers["C29"] and bool(todo.get("C29")))
                or ("C28" in todo and reader in readers["C28"]
                    and any(key not in done["C28", s] for key in keys)))

    for (reader, s), reading in readings.items():
        if not needs(reader, s):
            continue
        t = time.perf_counter()
        ext = clone(reading.extractor).set_params(
            verbose=1 if log else 0, n_jobs=None if settings.smoke else settings.n_jobs)
        reading.features = ext.fit_transform(convs[s])
        times[f"extraction {model_tag(reader)} {s}"] = time.perf_counter() - t
        _say(log, f"extraction {model_tag(reader)} on {s}: {reading.features} in "
                  f"{times[f'extraction {model_tag(reader)} {s}']:.1f}s")

    def finish(cand, s, r, k, pred, info, seconds):
        info = _json_ready(info)
        done[cand, s][r, k] = (np.asarray(pred, dtype=np.int64), info, seconds)
        if (cand, s) in stores:
            stores[cand, s].put(r, k, {cand: (pred, None, {"choice": info,
                                                           "seconds": seconds})})

    # ---- C28: per subset, per outer fit
    if "C28" in settings.candidates:
        for s in subsets:
            rs = [readings[r, s] for r in readers["C28"]]
            for r, k, train, test in _folds(
                    [sp for sp in splits[s] if (sp[0], sp[1]) not in done["C28", s]],
                    f"C28 {s}"):
                t = time.perf_counter()
                pred, info = _fit_c28(rs, convs[s], ys[s], groups[s], train, test, settings)
                finish("C28", s, r, k, pred, info, time.perf_counter() - t)
                _say(log, f"C28 {s}: repeat {r} fold {k} in {time.perf_counter() - t:.1f}s, "
                          f"weights {info['weights']}")

    # ---- C29: one pooled fit per outer fit, scored on each subset
    if "C29" in settings.candidates:
        rs = {s: readings[settings.reader, s] for s in subsets}
        by_key = {s: {(r, k): (tr, te) for r, k, tr, te in splits[s]} for s in subsets}
        for r, k in _folds(todo["C29"], "C29 pooled"):
            t = time.perf_counter()
            preds, info = _fit_c29(rs, ys, groups, {s: by_key[s][r, k] for s in subsets},
                                   settings)
            seconds = time.perf_counter() - t
            for s in subsets:
                finish("C29", s, r, k, preds[s], info, seconds)
            _say(log, f"C29: repeat {r} fold {k} in {seconds:.1f}s, sites {info['sites']}")

    # ---- per subset: predictions, summary, the headline, paired differences
    per_subset = {}
    for s in subsets:
        n = len(convs[s])
        P, choices = {}, {}
        for cand in settings.candidates:
            row = REMATCH_CANDIDATES[cand]
            P[row] = np.full((settings.repeats, n), -1, dtype=np.int64)
            choices[row] = []
            for r, k, _, test in splits[s]:
                pred, info, seconds = done[cand, s][r, k]
                P[row][r, test] = pred
                choices[row].append({"repeat": r, "fold": k, **info})
                key = f"{cand} fits" if cand == "C29" else f"{cand} fits {s}"
                if cand != "C29" or s == subsets[0]:  # C29: one fit serves every subset
                    times[key] = times.get(key, 0.0) + seconds
        headline_path, got = headlines[s]
        paired, rows = {}, dict(P)
        if got is not None:
            file_rows, meta = got
            rows.update(file_rows)
            headline = {"file": headline_path.name, "present": True, **meta,
                        "baselines": [k for k in file_rows if k != AUTO]}
        else:
            headline = {"file": headline_path.name, "present": False,
                        "note": "headline not run: no paired differences"}
        kw = dict(n_resamples=settings.n_resamples, random_state=0)
        summary, per_conv = summarize_predictions(rows, ys[s], convs[s], groups[s], **kw)
        if headline["present"]:
            pairs = [(REMATCH_CANDIDATES[c], b) for c in settings.candidates
                     for b in [AUTO, *headline["baselines"]]]
            paired = paired_differences(per_conv, pairs, groups[s], **kw)
        per_subset[s] = {
            "n": n, "summary": summary, "headline": headline, "paired": paired,
            "readers": {model_tag(rd.reader): {
                "budget": rd.budget, "context": rd.context, "dtype": rd.dtype,
                "prompt": rd.template.fingerprint(), "shortening": rd.shortening}
                for (reader, t), rd in readings.items() if t == s},
            "choices": choices, "record_ids": [str(c.record_id) for c in convs[s]],
            "y_true": [int(v) for v in ys[s]], "task_ids": [str(g) for g in groups[s]],
            "predictions": {k: v.tolist() for k, v in P.items()},
        }

    result = {
        "benchmark": "rematch candidates C28/C29 (docs/benchmarks.md §7)",
        "tag": tag, "reader": str(settings.reader),
        "ensemble_readers": [str(r) for r in settings.ensemble_readers],
        "candidates": {c: REMATCH_CANDIDATES[c] for c in settings.candidates},
        "configuration": RECOMMENDED, "final_estimator": _FINAL,
        "folds": settings.folds, "inner_folds": settings.inner_folds,
        "repeats": settings.repeats, "n_resamples": settings.n_resamples,
        "deviations": _deviations(settings),
        "subsets": per_subset,
        "rule_step_3": _rule_step_3(per_subset, settings.candidates),
        "times": {k: round(v, 1) for k, v in times.items()},
        "total_s": round(time.perf_counter() - t_all, 1),
        "machine": _machine(), "date": time.strftime("%Y-%m-%d"),
        "command": settings.command,
    }
    if settings.resume:
        result["resumed"] = {"fits_reused": reused}
    write_json(out / f"rematch_{tag}.json", result, indent=1)
    md = rematch_markdown(result)
    (out / f"rematch_{tag}.md").write_text(md)
    _say(log, md)
    return result


def _rule_step_3(per_subset, candidates):
    """Rule step 3 of §7, computed: does a candidate replace the recommendation?

    A candidate replaces it iff its paired difference over the headline has a 95% CI
    strictly above 0 on both Algorithm-Generated and Hand-Crafted.

    Parameters
    ----------
    per_subset : dict
        ``result["subsets"]`` of :func:`run_rematch_candidates`.
    candidates : list of str

    Returns
    -------
    dict
        ``{candidate: {"replaces": True / False / None (not decided), "reason",
        "difference": {subset: interval or None}}}``.
    """
    out = {}
    for cand in candidates:
        row = REMATCH_CANDIDATES[cand]
        diffs, missing, failed = {}, [], []
        for s in REMATCH_SUBSETS:
            entry = per_subset.get(s)
            if entry is None:
                diffs[s] = None
                missing.append(f"{s} not run")
                continue
            d = entry["paired"].get(f"{row} - {AUTO}")
            diffs[s] = d
            if d is None:
                missing.append(f"headline missing on {s} ({entry['headline']['file']})")
            elif not d["low"] > 0:
                failed.append(s)
        if missing:
            verdict, reason = None, "not decided: " + "; ".join(missing)
        elif failed:
            verdict = False
            reason = ("does not replace the recommendation: the paired 95% CI over the "
                      f"headline is not above 0 on {' and '.join(failed)}")
        else:
            verdict = True
            reason = ("replaces the recommendation: the paired 95% CI over the headline "
                      "is above 0 on both subsets")
        out[cand] = {"replaces": verdict, "reason": reason, "difference": diffs}
    return out


def rematch_markdown(result):
    """The C28 / C29 tables, paired differences and rule step 3, as markdown.

    Parameters
    ----------
    result : dict
        What :func:`run_rematch_candidates` returns (or its JSON file holds).

    Returns
    -------
    str
    """
    rows = list(result["candidates"].values())
    lines = [f"# The rematch's fixed candidates (§7): {', '.join(rows)}", "",
             f"Reader of C29 and of the headline: {result['reader']}; C28 readers: "
             f"{', '.join(result['ensemble_readers'])}; configuration {result['configuration']}"
             f" (C28 final estimator {result['final_estimator']}). Outer GroupKFold("
             f"{result['folds']}) x {result['repeats']} shuffles, inner GroupKFold("
             f"{result['inner_folds']}); {result['n_resamples']} task-cluster bootstrap "
             "resamples (seed 0).", ""]
    if result.get("deviations"):
        lines += ["**Deviations from §7:** " + "; ".join(result["deviations"]) + ".", ""]
    for s, entry in result["subsets"].items():
        lines += [f"## {s} (n = {entry['n']})", ""]
        for name, rd in entry["readers"].items():
            lines.append(f"- {name}: budget {rd['budget']} tokens (context {rd['context']}), "
                         f"{rd['dtype']}; {rd['shortening']}.")
        lines.append("")
        head = entry["headline"]
        base = [k for k in entry["summary"] if not k.startswith("_") and k not in rows]
        lines += method_table(entry["summary"], [("", rows), ("headline file: ", base)])
        lines.append("")
        if head["present"]:
            lines += [f"Headline and baselines from `{head['file']}` (same records, labels, "
                      "task ids, folds and repeats; checked).", "",
                      "| paired difference in step accuracy | points [95% CI] |", "|---|---|"]
            lines += [f"| {k} | {format_interval(v)} |" for k, v in entry["paired"].items()]
        else:
            lines.append(f"`{head['file']}`: {head['note']}.")
        lines.append("")
        for row, fits in entry["choices"].items():
            if fits and "weights" in fits[0]:
                mean = {n: np.mean([f["weights"][n] for f in fits]) for n in fits[0]["weights"]}
                lines.append(f"{row}: mean stacker weight per reader "
                             + ", ".join(f"{n} {w:+.2f}" for n, w in mean.items()) + ".")
            elif fits:
                sites = [",".join(f["sites"]) for f in fits]
                lines.append(f"{row}: sites chosen " + ", ".join(
                    f"{v} x{sites.count(v)}" for v in dict.fromkeys(sites)) + ".")
                if "n_excluded" in fits[0]:
                    out = {t: sum(f["n_excluded"][t] for f in fits) for t in fits[0]["n_excluded"]}
                    lines.append(f"{row}: training records left out because their task is in a "
                                 "test part of the same outer fit (summed over the fits): "
                                 + ", ".join(f"{t} {n}" for t, n in out.items()) + ".")
        lines.append("")
    lines += ["## Rule step 3", ""]
    for cand, v in result["rule_step_3"].items():
        lines.append(f"- {result['candidates'][cand]}: {v['reason']}.")
    lines += ["", "Wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in result["times"].items())
              + f"; total {result['total_s']:.0f}s. Machine: {result['machine']}; "
              f"{result['date']}.", ""]
    resumed = (result.get("resumed") or {}).get("fits_reused")
    if resumed:
        lines += ["Resumed (--resume): outer fits read from the stores ("
                  + ", ".join(f"{k} {v}" for k, v in resumed.items())
                  + "); a stored fit's seconds are those measured when it ran.", ""]
    if result.get("command"):
        lines += [f"Command: `{result['command']}`", ""]
    return "\n".join(lines)
