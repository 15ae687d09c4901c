"""The cost of §8's rows against one bare forward pass (docs/benchmarks.md §8, question 4).

The §8 runner (:func:`~skafa.benchmarks.run_locator_benchmark`) runs over several
sessions with resumable stores, so its own timings do not cover whole passes. This
benchmark measures, on the first ``n`` records of a subset and in one process with the
same threads, methods interleaved record by record in rotating order within each
repeat (as :func:`~skafa.benchmarks.run_extraction_benchmark` does):

(a) ``bare``: one decoder forward over the §8 ``read="last"`` prompt's token ids (no
    hooks, no LM head);
(b) ``head_features``: ``TurnActivationTransformer(read="last", sites="head_attn")``
    on one conversation, no cache (each call runs a forward pass, checked through its
    ``run_stats``);
(c) ``judge``: :class:`~skafa.baselines.PromptedJudge` (logprob) ``predict`` on one
    conversation, fitted once up front;
(d) ``grafted_judge``: :class:`~skafa.baselines.GraftedJudge` with one locator and
    one writer head, fitted once up front on the ``n`` records, ``predict`` on one
    conversation (one prompt read and one graft);

and, outside the interleaving, once: (e)
:func:`~skafa.baselines.grafted_split_predictions` over two splits of the records
(the two halves, each the other's test part), with and without ``kv_dir``, reported
per conversation and relative to the sum of the bare passes of the same records.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import statistics
import tempfile
import time

import numpy as np

from ..baselines import GraftedJudge, PromptedJudge, grafted_split_predictions
from ..llm import (
    CPU_FLAGS,
    PromptTemplate,
    TurnActivationTransformer,
    cpu_description,
    decoder_layout,
    plan,
)
from ._extraction import _bare_forward
from ._who_and_when import _open_cell, _say

__all__ = ["LOCATOR_COST_METHODS", "LocatorCostSettings", "run_locator_cost_benchmark"]

#: The interleaved methods, in the order of the first record of the first repeat.
LOCATOR_COST_METHODS = ("bare", "head_features", "judge", "grafted_judge")

_LABELS = {
    "bare": "(a) bare decoder forward over the 'last' prompt, no hooks, no LM head",
    "head_features": "(b) head features: `TurnActivationTransformer(read='last', "
                     "sites='head_attn')`, no cache (incl. prompt rendering)",
    "judge": "(c) prompted judge (logprob) `predict`, fitted once up front",
    "grafted_judge": "(d) grafted judge `predict` (1 locator, 1 writer), fitted once up front",
}

@dataclasses.dataclass
class LocatorCostSettings:
    """What one §8 cost run reads and how often (the command line's options).

    The first ``n`` records of the conversations given (for Who&When: the subset in
    file order, as :func:`skafa.load_who_and_when` reads it) are timed ``repeats``
    times. ``model``, ``dtype`` (``"auto"`` resolved as §8 does) and
    ``max_prompt_tokens`` (the §8 prompt budget, capped at the model's context)
    are those of the §8 cell. ``split_grid`` (numbers of locator and of writer heads)
    and ``split_cv`` (inner folds) are those of the grafted judge in (e); with one
    number in the grid there are no inner folds. ``smoke=True`` marks a model
    registered in this process only (tag ``smoke``). ``command`` is the command line
    the report names.
    """

    model: str = "smollm2"
    tag: str | None = None
    subset: str = "Algorithm-Generated"
    n: int = 6
    repeats: int = 2
    max_prompt_tokens: int = 8192
    dtype: str = "auto"
    split_grid: tuple = (1,)
    split_cv: int = 2
    smoke: bool = False
    command: str = ""


def _check_settings(settings):
    for name in ("n", "repeats", "max_prompt_tokens", "split_cv"):
        value = getattr(settings, name)
        low = 2 if name == "split_cv" else 1
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"LocatorCostSettings.{name} must be an int >= {low}, "
                             f"got {value!r}.")


@contextlib.contextmanager
def _counting_tokens(embedding, counter):
    """Count the token positions the model embeds inside the block (``counter[0]``)."""
    def hook(module, args):
        counter[0] += int(args[0].numel())

    handle = embedding.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _rotated(names, k):
    k %= len(names)
    return list(names[k:]) + list(names[:k])


def _fmt_tokens(values):
    values = [v for v in values if v]
    if not values:
        return "n/a"
    return f"{int(np.median(values)):,} ({min(values):,}..{max(values):,})"


def run_locator_cost_benchmark(settings, conversations, *, log=None):
    """Time §8's feature pass and judges against a bare forward pass of the same prompt.

    Parameters
    ----------
    settings : LocatorCostSettings
    conversations : list of Conversation
        Labelled records; the first ``settings.n`` are timed (the grafted judge is
        fitted on them, so they need ``mistake_step``).
    log : callable, default=None
        Called with each progress line (one per repeat, and one per phase);
        None: silent.

    Returns
    -------
    result : dict
        ``"markdown"`` (the report), ``"records"`` (the record ids timed),
        ``"seconds"`` (per method, the per-record medians over repeats),
        ``"median_s"`` and ``"ratio_to_bare"`` (per method: median over records of
        the seconds, and of the per-record ratio to (a)), ``"tokens_last"`` (the
        'last' prompt's tokens per record), ``"tokens_through_model"`` (per method
        and record, the token positions the model embedded in one call: prompt,
        answer prefix and candidate tokens for the judges), ``"order"`` (per repeat
        and record, the order the methods ran in), ``"forward_passes"`` (the
        head-feature transformer's forward passes per timed call, all 1),
        ``"head_features"`` (the last timed call's features, per record), ``"fits"``
        (seconds of the up-front fits) and ``"splits"`` ((e), or ``None`` with
        fewer than 2 records).

    Raises
    ------
    ValueError
        ``n``, ``repeats``, ``max_prompt_tokens`` below 1 (``split_cv`` below 2), or
        fewer conversations than ``n``.
    RuntimeError
        The head-feature transformer did not run exactly one forward pass in a
        timed call (a cache answered it: the timing would be wrong).
    """
    import torch

    _check_settings(settings)
    convs = list(conversations)
    if len(convs) < settings.n:
        raise ValueError(f"LocatorCostSettings.n={settings.n} records asked for, but only "
                         f"{len(convs)} conversations were given.")
    convs = convs[:settings.n]
    started = datetime.datetime.now()
    load0 = os.getloadavg()
    t_all = time.perf_counter()
    convs, tag, _, groups, model, tokenizer, ctx, budget = _open_cell(settings, convs)
    load_s = time.perf_counter() - t_all
    tag = "smoke" if settings.smoke else tag
    dtype = settings.dtype
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    shortened = plan(convs, tokenizer, template, max_tokens=budget, read="last")
    n_shortened = sum(1 for r in shortened if r["chars_removed"])
    encs = [template.encode(c, tokenizer, index=i, read="last", max_tokens=ctx)
            for i, c in enumerate(convs)]
    ids = [torch.as_tensor(np.asarray(e.input_ids, dtype=np.int64))[None] for e in encs]
    tokens_last = [int(e.n_tokens) for e in encs]
    layout = decoder_layout(model)
    decoder, embedding = layout.decoder, layout.embedding
    rids = [c.record_id if c.record_id is not None else f"#{i}" for i, c in enumerate(convs)]
    _say(log, f"model loaded in {load_s:.1f}s; {len(convs)} records ({', '.join(map(str, rids))}), "
              f"{sum(tokens_last):,} 'last' prompt tokens")

    # ---- the up-front fits (the judge and the extractor learn nothing; timed anyway)
    fits = {}

    def fitted(key, fn):
        s = time.perf_counter()
        value = fn()
        fits[key] = time.perf_counter() - s
        return value

    common = dict(prompt=template, dtype=dtype)
    # the judges append answer tokens: their prompts leave 16 tokens, as the §8 runner's
    judging = dict(prompt=PromptTemplate(shorten="middle_first",
                                         max_prompt_tokens=min(budget, ctx - 16)), dtype=dtype)
    extractor = fitted("head_features", lambda: TurnActivationTransformer(
        settings.model, read="last", sites="head_attn", memory_cache=False,
        **common).fit(convs))
    judge = fitted("judge", lambda: PromptedJudge(settings.model, mode="logprob",
                                                  **judging).fit(convs))
    grafted = fitted("grafted_judge", lambda: GraftedJudge(
        settings.model, locator_grid=(1,), writer_grid=(1,), **judging).fit(convs))
    _say(log, "fitted up front: " + ", ".join(f"{k} {v:.2f}s" for k, v in fits.items()))

    head_features = [None] * len(convs)
    passes = []

    def run_features(i):
        before = extractor.run_stats["n_forward_passes"]
        s = time.perf_counter()
        X = extractor.transform([convs[i]])
        elapsed = time.perf_counter() - s
        ran = extractor.run_stats["n_forward_passes"] - before
        if ran != 1:
            raise RuntimeError(f"record {rids[i]}: the head-feature transformer ran {ran} "
                               "forward passes in one call instead of 1 (a cache answered "
                               "it); the timing would not be a pass.")
        head_features[i] = X
        return elapsed, ran

    def timed_call(fn):
        s = time.perf_counter()
        fn()
        return time.perf_counter() - s

    def call(name, i, counter=None):
        """Seconds of one call of method ``name`` on record ``i``."""
        if name == "bare":
            return timed_call(lambda: _bare_forward(decoder, ids[i]))
        with _counting_tokens(embedding, counter):
            if name == "head_features":
                elapsed, ran = run_features(i)
                passes.append(ran)
                return elapsed
            est = judge if name == "judge" else grafted
            return timed_call(lambda: est.predict([convs[i]]))

    # Warm up every method on the shortest record (lazy state, allocator, kernels).
    k = int(np.argmin(tokens_last))
    for name in LOCATOR_COST_METHODS:
        call(name, k, [0])
    passes.clear()

    names = list(LOCATOR_COST_METHODS)
    times = {m: [[] for _ in convs] for m in names}
    through = {m: [None] * len(convs) for m in names}
    order = []
    for rep in range(settings.repeats):
        for i in range(len(convs)):
            ran_order = _rotated(names, rep + i)
            order.append({"repeat": rep, "record": i, "order": ran_order})
            for name in ran_order:
                counter = [0]
                times[name][i].append(call(name, i, counter))
                through[name][i] = tokens_last[i] if name == "bare" else counter[0]
        done = {m: sum(statistics.median(x) for x in times[m]) for m in names}
        _say(log, f"repeat {rep + 1}/{settings.repeats}: " +
             ", ".join(f"{m} {v:.2f}s" for m, v in done.items()))

    med = {m: [statistics.median(x) for x in times[m]] for m in names}
    median_s = {m: statistics.median(v) for m, v in med.items()}
    ratio = {m: statistics.median(a / b for a, b in zip(med[m], med["bare"])) for m in names}
    bare_sum = sum(med["bare"])

    # ---- (e) grafted_split_predictions over the two halves, with and without kv_dir
    splits_result = None
    if len(convs) >= 2:
        halves = np.array_split(np.arange(len(convs)), 2)
        splits = [(halves[0], halves[1]), (halves[1], halves[0])]
        grid = tuple(int(g) for g in settings.split_grid)
        template_judge = GraftedJudge(settings.model, locator_grid=grid, writer_grid=grid,
                                      cv=int(settings.split_cv), **judging)
        runs = {}
        for with_kv in (False, True):
            counter = [0]
            with contextlib.ExitStack() as stack:
                kv_dir = (stack.enter_context(tempfile.TemporaryDirectory(prefix="skafa-kv-"))
                          if with_kv else None)
                stack.enter_context(_counting_tokens(embedding, counter))
                s = time.perf_counter()
                preds, _ = grafted_split_predictions(template_judge, convs, splits=splits,
                                                     groups=groups, kv_dir=kv_dir)
                seconds = time.perf_counter() - s
            runs["kv_dir" if with_kv else "no kv_dir"] = {
                "seconds": seconds, "per_conversation": seconds / len(convs),
                "vs_bare_sum": seconds / bare_sum, "tokens_through_model": counter[0],
                "predictions": [p.tolist() for p in preds]}
            _say(log, f"(e) grafted_split_predictions, {'with' if with_kv else 'without'} "
                      f"kv_dir: {seconds:.2f}s")
        splits_result = {"grid": list(grid), "cv": int(settings.split_cv),
                         "sizes": [[len(a), len(b)] for a, b in splits], "runs": runs,
                         "same_predictions": runs["kv_dir"]["predictions"]
                         == runs["no kv_dir"]["predictions"]}

    load1 = os.getloadavg()
    result = {
        "tag": tag, "subset": settings.subset, "model": str(settings.model), "dtype": dtype,
        "records": rids, "prompt_budget": budget, "n_shortened": n_shortened,
        "seconds": med, "median_s": median_s, "ratio_to_bare": ratio,
        "tokens_last": tokens_last, "tokens_through_model": through, "order": order,
        "forward_passes": passes, "head_features": head_features,
        "fits": fits, "bare_sum_s": bare_sum, "splits": splits_result,
        "torch_threads": torch.get_num_threads(), "cpu": cpu_description(),
        "started": started, "load_s": load_s, "loadavg": (load0, load1),
        "total_s": time.perf_counter() - t_all, "command": settings.command,
        "attention": getattr(model.config, "_attn_implementation", None),
    }
    result["markdown"] = _markdown(result, settings)
    return result


def _markdown(r, settings):
    import torch

    (a0, b0, c0), (a1, b1, c1) = r["loadavg"]
    tl = r["tokens_last"]
    n = len(r["records"])
    lines = [
        f"# §8 costs (question 4): {r['tag']} on {r['subset']}",
        "",
        f"- Command: `{r['command'] or 'run_locator_cost_benchmark'}` (run from the "
        "repository root)",
        f"- Date: {r['started']:%Y-%m-%d %H:%M}; total run time {r['total_s'] / 60:.1f} min",
        f"- Machine: {r['cpu']} (CPU flags present among {', '.join(CPU_FLAGS)}); "
        f"os.cpu_count()={os.cpu_count()}; "
        f"{platform.platform()}; torch {torch.__version__}, {r['torch_threads']} threads; "
        f"attention `{r['attention']}`",
        f"- Load average (1/5/15 min) at start {a0:.1f}/{b0:.1f}/{c0:.1f}, at end "
        f"{a1:.1f}/{b1:.1f}/{c1:.1f} (interleaving keeps the ratios fair; absolute times "
        "vary with the load)",
        f"- Model: {r['model']}, dtype {r['dtype']}, loaded in {r['load_s']:.1f} s",
        f"- Data: the first {n} records of {r['subset']} in file order "
        f"({', '.join(map(str, r['records']))}); §8 prompt "
        f"(`PromptTemplate(shorten='middle_first', max_prompt_tokens={r['prompt_budget']})`, "
        f"read 'last'), {r['n_shortened']} of {n} shortened; 'last' prompt tokens "
        f"{sum(tl):,} in all (min {min(tl):,}, median {int(np.median(tl)):,}, "
        f"max {max(tl):,})",
        f"- Timing: {settings.repeats} repeats; within each, record by record, the four "
        "methods in rotating order (same process, same threads), after one warm-up call of "
        "each on the shortest record. Per record the median over repeats; below, the "
        "median over records of those seconds and of the per-record ratio to (a). "
        "(b) ran one forward pass per call (checked through its `run_stats`).",
        "- Tokens through the model: the token positions the decoder embedded in one "
        "call (for the judges: the prompt, the answer prefix and the candidate step "
        "tokens; the grafted judge also reruns the answer position under the graft), "
        "counted by a hook on the embedding (not on (a)).",
        "",
        "| method | median s / conversation | median ratio to (a), per record | "
        "'last' prompt tokens, median (min..max) | tokens through the model per call, "
        "median (min..max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in LOCATOR_COST_METHODS:
        lines.append(f"| {_LABELS[m]} | {r['median_s'][m]:.3f} | {r['ratio_to_bare'][m]:.2f} "
                     f"| {_fmt_tokens(tl)} | {_fmt_tokens(r['tokens_through_model'][m])} |")
    bare_sum = r["bare_sum_s"]
    lines += [
        "",
        f"Up-front fits on the {n} records (once, not interleaved; relative to the sum of "
        f"the {n} bare passes' per-record medians, {bare_sum:.2f} s):",
        "",
        "| fit | seconds | s / conversation | vs sum of bare passes |",
        "|---|---:|---:|---:|",
        f"| (b) `TurnActivationTransformer.fit` (loads, no pass) | {r['fits']['head_features']:.2f} "
        f"| {r['fits']['head_features'] / n:.3f} | {r['fits']['head_features'] / bare_sum:.2f} |",
        f"| (c) `PromptedJudge.fit` (zero-shot: validates, loads) | {r['fits']['judge']:.2f} | "
        f"{r['fits']['judge'] / n:.3f} | {r['fits']['judge'] / bare_sum:.2f} |",
        f"| (d) `GraftedJudge(locator_grid=(1,), writer_grid=(1,)).fit` (head statistics, "
        f"one pass per prompt) | {r['fits']['grafted_judge']:.2f} | "
        f"{r['fits']['grafted_judge'] / n:.3f} | {r['fits']['grafted_judge'] / bare_sum:.2f} |",
        "",
    ]
    sp = r["splits"]
    if sp is None:
        lines.append("(e) not run: two splits need at least 2 records.")
    else:
        grid = tuple(sp["grid"])
        lines += [
            f"(e) `grafted_split_predictions` over 2 splits (the two halves, sizes "
            f"{sp['sizes'][0][0]} and {sp['sizes'][0][1]}, each the other's test part; "
            f"`GraftedJudge(locator_grid={grid}, writer_grid={grid}, cv={sp['cv']})`), once "
            "each, not interleaved; relative to the sum of the bare passes of the same "
            f"records ({bare_sum:.2f} s, {sum(tl):,} 'last' prompt tokens):",
            "",
            "| variant | seconds | s / conversation | vs sum of bare passes | tokens through "
            "the model |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, label in (("no kv_dir", "without `kv_dir` (each prompt read twice)"),
                           ("kv_dir", "with `kv_dir` in a temporary folder (each prompt "
                                      "read once)")):
            run = sp["runs"][key]
            lines.append(f"| {label} | {run['seconds']:.2f} | {run['per_conversation']:.3f} | "
                         f"{run['vs_bare_sum']:.2f} | {run['tokens_through_model']:,} |")
        lines += ["", "Same predictions with and without `kv_dir`: "
                  f"{'yes' if sp['same_predictions'] else 'NO'}."]
    lines.append("")
    return "\n".join(lines)
