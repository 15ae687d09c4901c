"""Who&When benchmark: probes next to honest baselines, nested CV, bootstrap CIs.

Every method is evaluated on the SAME outer folds: ``GroupKFold(5)`` by task id,
repeated over ``--repeats`` shuffles of the fold assignment. Every choice a method
makes (site, C, ...) is made on inner ``GroupKFold`` folds of the outer training
part only. Reported per method: step accuracy, agent accuracy (three matching
rules), within-1 accuracy, mean absolute step shift, n, 95% cluster-bootstrap CIs
(resampling task ids), and the paired difference of each probe against the best
baseline.

Usage (from the repository root)::

    python examples/benchmark_who_and_when.py --model smollm2 --subset Algorithm-Generated
    python examples/benchmark_who_and_when.py --model /path/qwen2.5-coder-0.5b-instruct.gguf \\
        --tag qwen-coder-0.5b --subset Algorithm-Generated
    python examples/benchmark_who_and_when.py --smoke        # tiny random model, seconds
    python examples/benchmark_who_and_when.py --smoke --scheduler local:2   # fits on Dask

With ``--scheduler`` (a Dask scheduler address, or ``local:N`` for a
``distributed.LocalCluster`` of N single-threaded worker processes) every fit of
the nested CV (``SiteSelector``, ``GridSearchCV``) and the extraction run through
joblib's Dask backend; the numbers are the same as a serial run's.

Results go to ``--out`` (default ``docs/results``): ``<tag>_<subset>.json``,
``<tag>_<subset>.md`` (tables) and ``<tag>_<subset>_sites.png`` (per-site curve).
Activations go through skafa's disk cache (``--cache-dir``), so a re-run does no
forward pass; the PromptedJudge's scores are cached next to them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import GridSearchCV, GroupKFold

import skafa
from skafa import (
    DummyStepClassifier,
    GroupedArgmaxLogisticClassifier,
    GroupedSoftmaxClassifier,
    PromptedJudge,
    PromptTemplate,
    SiteConcatenator,
    SiteSelector,
    TurnActivationTransformer,
    TurnFeatures,
    TurnPositionTransformer,
    TurnTextTransformer,
)
from skafa.metrics import _metrics as M
from skafa.llm import banded_sliding_window_attention
from skafa.configurations import (
    LOGISTIC_CS,
    PREREGISTERED_PROBES,
    PREREGISTERED_READS,
    STACK_ID,
    configuration_names,
)
from skafa.llm import context_length, load_model
from skafa.llm import plan
from skafa.llm import parse_site_spec

REPO = Path(__file__).resolve().parents[1]
RULES = ("exact", "normalized", "substring")


# --------------------------------------------------------------------- methods
class Timer:
    def __init__(self):
        self.t = {}

    def add(self, key, seconds):
        self.t[key] = self.t.get(key, 0.0) + seconds


def _probe(estimator, C, random_state):
    return (GroupedArgmaxLogisticClassifier(C=C, random_state=random_state)
            if estimator == "logistic" else GroupedSoftmaxClassifier(C=C))


def select_C_and_site(X, y, groups, *, Cs, sites, inner, n_jobs, random_state,
                      estimator="logistic", n_sites=1):
    """SiteSelector per C on the same inner folds; keep the best (ties: smaller C).

    With ``n_sites=k > 1`` the k best sites are averaged (``SiteEnsemble``); the
    score that compares Cs, and that the pre-registered rule compares with the
    other configurations, is then the inner-CV accuracy of that average over the
    same inner folds, not the best single site's. Returns ``(C, selector, score)``.
    """
    from sklearn.model_selection import cross_val_score

    from skafa import SiteEnsemble

    best = None
    for C in sorted(Cs):
        est = _probe(estimator, C, random_state)
        kw = {} if n_sites == 1 else {"n_sites": n_sites}
        sel = SiteSelector(est, sites=sites, cv=GroupKFold(inner), n_jobs=n_jobs,
                           **kw).fit(X, y, groups=groups)
        score = float(sel.best_score_)
        if n_sites > 1:
            ens = SiteEnsemble(est, sites=list(sel.best_sites_))
            score = float(np.mean(cross_val_score(
                ens, X, y, groups=groups, cv=GroupKFold(inner), n_jobs=n_jobs)))
        if best is None or score > best[2]:
            best = (C, sel, score)
    return best


def select_single_and_top(X, y, groups, Xte, *, Cs, sites, inner, n_sites, n_jobs,
                          random_state, estimator):
    """``select_C_and_site`` with ``n_sites=1`` and with ``n_sites``, sharing the fits.

    Both rank the sites by the same per-site inner-CV scores (one
    ``SiteSelector(refit=False)`` per C); they differ only in the score that compares
    the Cs and in the refit. The result equals two separate ``select_C_and_site``
    calls (tested), at about half the cost. Returns
    ``{1: (pred, score, info), n_sites: (pred, score, info)}``.
    """
    from sklearn.base import clone
    from sklearn.model_selection import cross_val_score

    from skafa import SiteEnsemble

    best = {}
    for C in sorted(Cs):
        est = _probe(estimator, C, random_state)
        sel = SiteSelector(est, sites=sites, cv=GroupKFold(inner), n_jobs=n_jobs,
                           n_sites=n_sites, refit=False).fit(X, y, groups=groups)
        top = list(sel.best_sites_)
        ens_score = float(np.mean(cross_val_score(
            SiteEnsemble(est, sites=top), X, y, groups=groups, cv=GroupKFold(inner),
            n_jobs=n_jobs)))
        for k, score, chosen in ((1, float(sel.best_score_), [sel.best_site_]),
                                 (n_sites, ens_score, top)):
            if k not in best or score > best[k][1]:
                best[k] = (C, score, chosen, est)
    out = {}
    C, score, chosen, est = best[1]
    fitted = clone(est).fit(X.select_sites(chosen[0]), y)
    out[1] = (fitted.predict(Xte.select_sites(chosen[0])), score,
              {"C": C, "sites": chosen})
    C, score, chosen, est = best[n_sites]
    fitted = SiteEnsemble(est, sites=chosen, n_jobs=n_jobs).fit(X.select_sites(chosen), y)
    out[n_sites] = (fitted.predict(Xte.select_sites(chosen)), score,
                    {"C": C, "sites": chosen})
    return out


def grid_C(X, y, groups, *, Cs, inner, n_jobs, random_state):
    """GridSearchCV over C on inner grouped folds (single-block features)."""
    gs = GridSearchCV(
        GroupedArgmaxLogisticClassifier(random_state=random_state),
        {"C": sorted(Cs)}, cv=GroupKFold(inner), n_jobs=n_jobs,
    )
    return gs.fit(X, y, groups=groups)


def run_outer_fold(convs, A, y, groups, train, test, args, judge_pred, multi_sites, timer):
    """Fit every method on ``train`` and predict ``test``. Returns {method: (pred, info)}."""
    out = {}
    ctr = [convs[i] for i in train]
    cte = [convs[i] for i in test]
    ytr, gtr = y[train], groups[train]
    Atr, Ate = A[train], A[test]
    kw = dict(inner=args.inner_folds, n_jobs=args.n_jobs, random_state=0)

    t = time.perf_counter()
    C, sel, _ = select_C_and_site(Atr, ytr, gtr, Cs=args.Cs, sites=args.probe_sites, **kw)
    out["probe"] = (sel.predict(Ate), {"site": sel.best_site_, "C": C,
                                       "inner_curve": sel.cv_results_["mean_test_score"].tolist()})
    timer.add("cv_probe", time.perf_counter() - t)

    t = time.perf_counter()
    pos = TurnPositionTransformer().fit(ctr)
    Ptr, Pte = pos.transform(ctr), pos.transform(cte)
    AP_tr = TurnFeatures.concatenate([Atr, Ptr], prefixes=["act", "pos"])
    AP_te = TurnFeatures.concatenate([Ate, Pte], prefixes=["act", "pos"])
    C, sel, _ = select_C_and_site(AP_tr, ytr, gtr, Cs=args.Cs, sites=args.probe_sites, **kw)
    out["probe + position"] = (sel.predict(AP_te), {"site": sel.best_site_, "C": C})
    timer.add("cv_probe_position", time.perf_counter() - t)

    t = time.perf_counter()
    cat = SiteConcatenator(multi_sites).fit(Atr)
    gs = grid_C(cat.transform(Atr), ytr, gtr, Cs=args.Cs, **kw)
    out["multi-site probe"] = (gs.predict(cat.transform(Ate)), {"C": gs.best_params_["C"]})
    timer.add("cv_multisite", time.perf_counter() - t)

    t = time.perf_counter()
    gs = grid_C(Ptr, ytr, gtr, Cs=args.Cs, **kw)
    out["position-only"] = (gs.predict(Pte), {"C": gs.best_params_["C"]})
    txt = TurnTextTransformer().fit(ctr)
    gs = grid_C(txt.transform(ctr), ytr, gtr, Cs=args.Cs, **kw)
    out["TF-IDF"] = (gs.predict(txt.transform(cte)), {"C": gs.best_params_["C"]})
    for strategy in ("first", "most_frequent", "most_frequent_relative", "uniform"):
        d = DummyStepClassifier(strategy=strategy, random_state=0).fit(ctr, ytr)
        out[f"dummy: {strategy}"] = (d.predict(cte), {})
    timer.add("cv_baselines", time.perf_counter() - t)
    if judge_pred is not None:
        out["PromptedJudge (logprob)"] = (judge_pred[test], {})
    return out


def site_curve_oof(A, y, groups, splits, C):
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


# ---------------------------------------------------------------------- scoring
def summarise(preds, y, convs, groups, *, n_resamples, seed):
    """Per-method metrics averaged over repeats, with cluster-bootstrap CIs."""
    true_agents = np.array([c.mistake_agent for c in convs], dtype=object)
    n_turns = np.array([len(c) for c in convs])
    rows = {}
    per_conv = {}
    for name, P in preds.items():  # P: (n_repeats, n)
        correct = (P == y[None, :]).mean(axis=0)
        within1 = (np.abs(P - y[None, :]) <= 1).mean(axis=0)
        shift = np.abs(P - y[None, :]).mean(axis=0)
        agents = {
            rule: np.mean([
                [M.agent_accuracy([true_agents[i]], [convs[i].speakers[P[r, i]]], rule=rule)
                 for i in range(len(y))]
                for r in range(P.shape[0])
            ], axis=0)
            for rule in RULES
        }
        per_conv[name] = correct
        ci = lambda v: M.bootstrap_ci_from_scores(  # noqa: E731
            v, n_resamples=n_resamples, random_state=seed, groups=groups)
        rows[name] = {
            "step_accuracy": _res(ci(correct)),
            "step_accuracy_per_repeat": [float(np.mean(P[r] == y)) for r in range(P.shape[0])],
            **{f"agent_accuracy_{rule}": _res(ci(v)) for rule, v in agents.items()},
            "within_1": _res(ci(within1)),
            "mean_abs_shift": _res(ci(shift)),
            "n": int(len(y)),
        }
    rows["_uniform_expected"] = float(np.mean(1.0 / n_turns))
    return rows, per_conv


def _res(r):
    return {"estimate": float(r.estimate), "low": float(r.low), "high": float(r.high)}


def paired(per_conv, a, b, groups, *, n_resamples, seed):
    diff = per_conv[a] - per_conv[b]
    r = M.bootstrap_ci_from_scores(diff, n_resamples=n_resamples, random_state=seed, groups=groups)
    return _res(r)


# ---------------------------------------------------------------------- reports
def fmt(r, pct=True):
    if pct:
        return f"{100 * r['estimate']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"
    return f"{r['estimate']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def markdown(result):
    s = result["summary"]
    lines = [
        f"### {result['model_label']} on Who&When {result['subset']} "
        f"(n = {result['n_conversations']} conversations)",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; {result['date']}.  ",
        f"Outer CV: GroupKFold({result['folds']}) by task id x {result['repeats']} shuffles; "
        f"inner CV: GroupKFold({result['inner_folds']}); C grid {result['Cs']}; "
        f"sites searched: {result.get('site_search', 'all')} "
        f"({len(result.get('probe_sites', result['sites']))}); "
        f"turn vectors read at: {result.get('read', 'last')} (`read=` of the extractor).  ",
        f"Prompt: {result['prompt_note']}",
        "",
        "| method | step acc % [95% CI] | agent acc % (exact) | agent (normalized) | "
        "agent (substring) | within-1 % | mean abs shift | n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = sorted((k for k in s if not k.startswith("_")),
                   key=lambda k: -s[k]["step_accuracy"]["estimate"])
    for k in order:
        r = s[k]
        lines.append(
            f"| {k} | {fmt(r['step_accuracy'])} | {fmt(r['agent_accuracy_exact'])} | "
            f"{fmt(r['agent_accuracy_normalized'])} | {fmt(r['agent_accuracy_substring'])} | "
            f"{fmt(r['within_1'])} | {fmt(r['mean_abs_shift'], pct=False)} | {r['n']} |"
        )
    lines += ["", f"Uniform random guess, expected step accuracy: "
                  f"{100 * s['_uniform_expected']:.1f}%.", ""]
    lines += ["Paired differences in step accuracy (same conversations, same folds; "
              f"best baseline = **{result['best_baseline']}**):", "",
              "| comparison | difference, points [95% CI] |", "|---|---|"]
    for k, r in result["paired"].items():
        lines.append(f"| {k} | {100 * r['estimate']:+.1f} [{100 * r['low']:+.1f}, "
                     f"{100 * r['high']:+.1f}] |")
    lines += ["", "Chosen settings across the outer fits: " + result["choices_note"], "",
              f"Context: {result['context_note']}", "",
              "Wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in result["times"].items()),
              ""]
    return "\n".join(lines)


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'skafa[plot]')")
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


# ------------------------------------------------------ pre-registered comparison
# The configurations and the rule are fixed in docs/benchmarks.md, section 3
# ("Beat position: the pre-registered comparison"), committed before any run.
# One definition, in skafa.configurations (also what FailureAttributor's default is built from).
PREREG_READS = PREREGISTERED_READS
PREREG_PROBES = PREREGISTERED_PROBES
AUTO = "skafa (pre-registered auto)"


def prereg_names(reads=PREREG_READS):
    """The 27 configuration names in the pre-registered order (the tie-break order)."""
    return configuration_names(reads)


def make_stacker(extractor, probe_sites, inner):
    """Configuration 9: stacking of probe, position and TF-IDF turn scores."""
    from sklearn.base import clone

    from skafa import TurnScoreStacker, make_attribution_pipeline

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


def prereg_read_fold(read, convs, A, extractor, y, groups, train, test, args, timer,
                     names=None):
    """The pre-registered configurations of one read on one outer fit.

    ``names``: the configuration names to compute (default: all of this read's).
    Returns {name: (test predictions, inner score, info)}.
    """
    from sklearn.model_selection import cross_val_score

    out = {}
    ctr = [convs[i] for i in train]
    cte = [convs[i] for i in test]
    ytr, gtr = y[train], groups[train]
    kw = dict(inner=args.inner_folds, n_jobs=args.n_jobs, random_state=0)
    pos = TurnPositionTransformer().fit(ctr)
    Ptr, Pte = pos.transform(ctr), pos.transform(cte)
    blocks = {"acts": (A[train], A[test])}
    blocks["acts+pos"] = tuple(TurnFeatures.concatenate([a, p], prefixes=["act", "pos"])
                               for a, p in zip(blocks["acts"], (Ptr, Pte)))
    # configurations 1/3, 2/4, 5/7 and 6/8 differ only in n_sites: fitted together
    pairs = {}
    for pid, kind, Cs, n_sites, fset in PREREG_PROBES:
        pairs.setdefault((kind, tuple(Cs), fset), {})[n_sites] = f"{read}: {pid}"
    for (kind, Cs, fset), by_k in pairs.items():
        if names is not None and not set(by_k.values()) & set(names):
            continue
        t = time.perf_counter()
        Xtr, Xte = blocks[fset]
        (k_top,) = set(by_k) - {1}
        got = select_single_and_top(Xtr, ytr, gtr, Xte, Cs=Cs, sites=args.probe_sites,
                                    n_sites=k_top, estimator=kind, **kw)
        for k, name in by_k.items():
            out[name] = got[k]
        timer.add(f"cv {kind}", time.perf_counter() - t)
    name = f"{read}: {STACK_ID}"
    if not args.no_stack and (names is None or name in names):
        t = time.perf_counter()
        # The inner folds, and the final fit's out-of-fold base fits, run in parallel
        # (each fit is deterministic, so the result does not depend on n_jobs). A
        # registered model (--smoke) exists only in this process: serial there.
        n_jobs = None if args.smoke else args.n_jobs
        stk = make_stacker(extractor, args.probe_sites, args.inner_folds)
        inner = cross_val_score(stk, ctr, ytr, groups=gtr, cv=GroupKFold(args.inner_folds),
                                params={"groups": gtr}, n_jobs=n_jobs)
        stk.set_params(n_jobs=n_jobs).fit(ctr, ytr, groups=gtr)
        out[name] = (stk.predict(cte), float(np.mean(inner)), {})
        timer.add("cv stack", time.perf_counter() - t)
    return out


def prereg_auto(out, reads):
    """Rule step 1: the configuration with the highest inner score (ties: the order)."""
    order = [n for n in prereg_names(reads) if n in out]
    best = max(order, key=lambda n: (out[n][1], -order.index(n)))
    return (out[best][0], None, {"chosen": best, "inner_score": out[best][1]})


class PartialStore:
    """Finished (read, repeat, fold) results on disk, so a killed run resumes.

    One JSON file per read next to the results; each holds a signature of every
    setting the results depend on and is rewritten atomically after each outer fit.
    Several processes may fill different reads at the same time.
    """

    def __init__(self, path, signature):
        self.path, self.signature = Path(path), signature
        self.entries = {}
        if self.path.exists():
            old = json.loads(self.path.read_text())
            if old.get("signature") != signature:
                raise SystemExit(f"{self.path} was written with other settings "
                                 "(model, prompt, sites, folds or records); remove it.")
            self.entries = old["entries"]

    def get(self, r, k):
        got = self.entries.get(f"{r}|{k}", {})
        return {n: (np.asarray(v["pred"], dtype=np.int64), v["score"], v["info"])
                for n, v in got.items()}

    def put(self, r, k, out):
        entry = self.entries.setdefault(f"{r}|{k}", {})
        for n, (pred, score, info) in out.items():
            entry[n] = {"pred": np.asarray(pred).astype(int).tolist(), "score": score,
                        "info": info}
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"signature": self.signature, "entries": self.entries},
                                  default=str))
        os.replace(tmp, self.path)


def _shortened_for_peer(conv, tokenizer, template):
    enc = template.encode(conv, tokenizer)
    return list(enc.shortened_contents or [t.content for t in conv.turns])


# skafa's plain-text rendering for base models (skafa.llm._prompt: BOS, the messages joined
# by a blank line, a newline) as a chat template, for mi4afa on a tokenizer without one.
# (newlines as expressions: chat templates render with trim_blocks, which would eat a
# literal newline after a block tag)
PLAIN_CHAT_TEMPLATE = ("{% if bos_token %}{{ bos_token }}{% endif %}{% for m in messages %}"
                       "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}{{ m['content'] }}"
                       "{% endfor %}{{ '\\n' }}")


def mi4afa_setup(model, tokenizer, convs, template, layers, n_layers):
    """mi4afa's extractor on the same model object, and its conversations.

    Conversations come from skafa's loader (speakers kept) with the turn contents
    skafa's shortening policy produced at the same budget; a prompt still longer than
    the context for mi4afa's own (longer) wording is shortened further, by 5% of the
    budget at a time, and counted. A tokenizer without a chat template (a base model)
    gets :data:`PLAIN_CHAT_TEMPLATE` in mi4afa's copy only.
    """
    from ag2.extensions import mi4afa

    if not getattr(tokenizer, "chat_template", None):
        # mi4afa renders its prompt through the tokenizer's chat template, which a base
        # model (Gemma-3-270M) lacks: give mi4afa alone a copy whose template is skafa's
        # plain-text rendering, with mi4afa's own wording inside (said in the result).
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    sites = [mi4afa.ActivationSite(int(layer), "resid_pre") for layer in layers]
    sites.append(mi4afa.ActivationSite(int(n_layers), "resid_final"))
    extractor = mi4afa.ActivationExtractor(model, tokenizer, sites=sites)
    ctx = context_length(model)
    peer_convs, n_extra = [], 0
    for conv in convs:
        budget = template.max_prompt_tokens
        while True:  # noqa: B007
            contents = _shortened_for_peer(conv, tokenizer, PromptTemplate(
                shorten="middle_first", max_prompt_tokens=budget))
            pc = mi4afa.Conversation(
                question=conv.task, ground_truth=conv.expected_answer,
                history=tuple(mi4afa.Turn(name=t.speaker, content=c)
                              for t, c in zip(conv.turns, contents)),
                mistake_step=conv.mistake_step, mistake_agent=conv.mistake_agent)
            if len(extractor.encode(pc).input_ids) <= ctx:
                break
            budget = int(budget * 0.95)
        n_extra += budget < template.max_prompt_tokens
        peer_convs.append(pc)
    return extractor, peer_convs, n_extra


def mi4afa_activations(extractor, peer_convs, cache_dir, model_key, dtype="float32"):
    """mi4afa's activations for every conversation, cached as safetensors by content.

    mi4afa's forward passes run on the shared model object inside
    :func:`skafa.llm.banded_sliding_window_attention`, like skafa's own (a
    no-op unless the model has sliding-window layers on ``"sdpa"``).

    The cache key holds ``dtype`` unless it is float32 (so float32 entries written
    before the key had it stay valid). Activations are float32 whether they come from
    the cache or from a forward pass in another dtype, so a warm and a cold cache give
    the same probes.

    Returns ``(activations, seconds spent now, seconds of every record's first
    extraction)``: each cache file records how long its forward pass took.
    """
    import torch
    from ag2.extensions.mi4afa.activations import ConversationActivations
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    out, seconds, recorded = [], 0.0, 0.0
    folder = Path(cache_dir) / "mi4afa" if cache_dir else None
    for pc in tqdm(peer_convs, desc="mi4afa: extracting activations", unit="conv"):
        spec = {"model": model_key, "sites": [str(s) for s in extractor.sites],
                "conv": [pc.question, pc.ground_truth,
                         [[t.name, t.content] for t in pc.history]]}
        if extractor.tokenizer.chat_template == PLAIN_CHAT_TEMPLATE:  # not the model's own
            spec["chat_template"] = PLAIN_CHAT_TEMPLATE
        if str(dtype) != "float32":
            spec["dtype"] = str(dtype)
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]
        path = folder / f"{key}.safetensors" if folder else None
        if path is not None and path.exists():
            values = load_file(str(path))["values"]
            with safe_open(str(path), framework="pt") as f:  # seconds of the first run
                recorded += float((f.metadata() or {}).get("seconds", "nan"))
            out.append(ConversationActivations(pc, tuple(extractor.sites), values))
            continue
        t = time.perf_counter()
        with banded_sliding_window_attention(extractor.model):  # as skafa's own passes
            acts = extractor.extract(pc)
        took = time.perf_counter() - t
        seconds += took
        recorded += took
        values = acts.values.to(torch.float32).contiguous()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"values": values}, str(path), metadata={"seconds": f"{took:.3f}"})
        out.append(ConversationActivations(pc, tuple(extractor.sites), values))
    return out, seconds, recorded


def mi4afa_fold(extractor, acts, train, test):
    from ag2.extensions import mi4afa

    att = mi4afa.ProbeAttributor(extractor)
    report = att.fit([acts[i] for i in train])
    pred = np.array([int(att.score_turns(acts[i]).argmax()) for i in test])
    return pred, {"site": str(report.site)}


def peak_rss_during(fn):
    """Run ``fn()``; return (result, seconds, peak RSS above the start, MiB)."""
    import threading

    import psutil

    proc = psutil.Process()
    start = proc.memory_info().rss
    peak = [start]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    try:
        result = fn()
    finally:
        seconds = time.perf_counter() - t
        stop.set()
        th.join()
    return result, seconds, (peak[0] - start) / 2**20


def peer_cost(args, convs, template, extractor_m, peer_convs):
    """skafa vs mi4afa extraction on the first records, interleaved, no cache."""
    rows = {"skafa": [0.0, 0.0], "mi4afa": [0.0, 0.0]}
    n = min(args.peer_n, len(convs))
    cold = TurnActivationTransformer(model=args.model, read="last", prompt=template,
                                     dtype=args.dtype, cache_dir=None, memory_cache=False)
    cold.fit(convs[:1])
    for i in range(n):
        _, s, mem = peak_rss_during(lambda: cold.transform([convs[i]]))
        rows["skafa"][0] += s
        rows["skafa"][1] = max(rows["skafa"][1], mem)
        with banded_sliding_window_attention(extractor_m.model):
            _, s, mem = peak_rss_during(lambda: extractor_m.extract(peer_convs[i]))
        rows["mi4afa"][0] += s
        rows["mi4afa"][1] = max(rows["mi4afa"][1], mem)
    return {k: {"seconds": round(v[0], 1), "peak_extra_rss_mib": round(v[1], 1), "n": n}
            for k, v in rows.items()}


def baseline_fold(convs, y, groups, train, test, args, judge_pred):
    """Position-only, TF-IDF, dummies and the judge on one outer fit."""
    out = {}
    ctr = [convs[i] for i in train]
    cte = [convs[i] for i in test]
    ytr, gtr = y[train], groups[train]
    kw = dict(inner=args.inner_folds, n_jobs=args.n_jobs, random_state=0)
    pos = TurnPositionTransformer().fit(ctr)
    gs = grid_C(pos.transform(ctr), ytr, gtr, Cs=LOGISTIC_CS, **kw)
    out["position-only"] = (gs.predict(pos.transform(cte)), {"C": gs.best_params_["C"]})
    txt = TurnTextTransformer().fit(ctr)
    gs = grid_C(txt.transform(ctr), ytr, gtr, Cs=LOGISTIC_CS, **kw)
    out["TF-IDF"] = (gs.predict(txt.transform(cte)), {"C": gs.best_params_["C"]})
    for strategy in ("first", "most_frequent", "most_frequent_relative", "uniform"):
        d = DummyStepClassifier(strategy=strategy, random_state=0).fit(ctr, ytr)
        out[f"dummy: {strategy}"] = (d.predict(cte), {})
    if judge_pred is not None:
        out["PromptedJudge (logprob)"] = (judge_pred[test], {})
    return out


def attention_note(model):
    """The attention implementation forward passes of this run use, in words."""
    from skafa.llm import has_sliding_window

    name = getattr(model.config, "_attn_implementation", None) or "eager"
    if name == "sdpa" and has_sliding_window(model):
        return ("sdpa; sliding-window layers on their band "
                "(skafa.llm.banded_sliding_window_attention)")
    return name


def run_preregistered(args, convs, y, groups, model, tokenizer, ctx, budget, command, tag,
                      subset_label, timer, t_all):
    """The pre-registered comparison of docs/benchmarks.md section 3, on one cell."""
    total_chars = sum(sum(len(t.content) for t in c.turns) for c in convs)
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    feats, extractors, notes = {}, {}, {}
    for read in args.reads:
        shortened = plan(convs, tokenizer, template, max_tokens=budget, read=read)
        removed = int(shortened.total_chars_removed)
        notes[read] = (f"read={read}: {int(sum(r['chars_removed'] > 0 for r in shortened))} "
                       f"of {len(convs)} conversations shortened, {removed:,} of "
                       f"{total_chars:,} turn characters removed "
                       f"({100 * removed / max(total_chars, 1):.1f}%)")
        print(notes[read], flush=True)
        extractors[read] = TurnActivationTransformer(
            model=args.model, read=read, prompt=template, dtype=args.dtype,
            cache_dir=args.cache_dir, n_jobs=None if args.smoke else args.n_jobs,
            verbose=1).fit(convs)

    def features(read):
        """The read's turn vectors, extracted (or read from the cache) on first use."""
        if read not in feats:
            t = time.perf_counter()
            feats[read] = extractors[read].transform(convs)
            timer.add(f"extraction {read}", time.perf_counter() - t)
        return feats[read]

    if args.extract_only or not args.resume:  # --resume: fully stored reads are not extracted
        for read in args.reads:
            features(read)
    L = extractors[args.reads[0]].n_layers_
    probe_sites = list(parse_site_spec(args.sites, L))  # the extraction read all sites
    args.probe_sites = probe_sites

    judge_pred = None
    if args.judge_from:
        judge_pred = judge_from_result(args, convs, template)
    elif not args.no_judge:
        t = time.perf_counter()
        judge_template = PromptTemplate(shorten="middle_first",
                                        max_prompt_tokens=min(budget, ctx - 16))
        judge_store = (Path(args.out) / f"prereg_{tag}_{subset_label}.partial-judge.json"
                       if args.resume else None)
        if judge_store is not None:
            judge_store.parent.mkdir(parents=True, exist_ok=True)
        judge_pred = judge_predictions(args, convs, judge_template, args.cache_dir,
                                       store=judge_store)
        timer.add("judge", time.perf_counter() - t)

    peer = None
    if not args.no_mi4afa:
        t = time.perf_counter()
        layers = [int(s.split(".")[1]) for s in probe_sites if s.startswith("resid_pre.")]
        ext_m, peer_convs, n_extra = mi4afa_setup(model, tokenizer, convs, template, layers, L)
        model_key = json.dumps(extractors[args.reads[0]].model_identity_, sort_keys=True,
                               default=str)
        m_acts, m_seconds, m_recorded = mi4afa_activations(ext_m, peer_convs, args.cache_dir,
                                                           model_key, dtype=args.dtype)
        timer.add("extraction mi4afa", time.perf_counter() - t)
        peer = {"n_shortened_further": int(n_extra), "extraction_seconds_uncached": m_seconds,
                "prompt_rendering": ("skafa's plain-text rendering as mi4afa's chat template "
                                     "(the tokenizer has none)"
                                     if ext_m.tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
                                     else "chat template"),
                "extraction_seconds_all_records": round(m_recorded, 1)}
    if args.extract_only:
        print(f"extract-only: activations cached ({', '.join(args.reads)}"
              f"{'' if args.no_mi4afa else ', mi4afa'}); times {timer.t}", flush=True)
        return {"extract_only": True, "times": dict(timer.t)}
    if peer is not None:
        if args.peer_n:
            peer["cost"] = peer_cost(args, convs, template, ext_m, peer_convs)

    names = prereg_names(args.reads)
    stores = {}
    if args.resume:
        stem = f"prereg_{tag}_{subset_label}"
        for read in args.reads:
            sig = {"model": extractors[read].model_identity_, "read": read,
                   "prompt": template.fingerprint(), "budget": budget,
                   "sites": probe_sites, "probes": [list(map(str, p)) for p in PREREG_PROBES],
                   "stack": STACK_ID, "folds": args.folds, "inner_folds": args.inner_folds,
                   "dtype": args.dtype, "record_ids": [c.record_id for c in convs],
                   "y": [int(v) for v in y]}
            Path(args.out).mkdir(parents=True, exist_ok=True)
            stores[read] = PartialStore(Path(args.out) / f"{stem}.partial-{read}.json",
                                        json.loads(json.dumps(sig, default=str)))
    preds, infos = {}, []
    for r in range(args.repeats):
        outer = GroupKFold(args.folds, shuffle=True, random_state=r)
        rep = {}
        for k, (train, test) in enumerate(outer.split(np.zeros((len(convs), 1)), y, groups)):
            t0 = time.perf_counter()
            fold = {}
            for read in args.reads:
                want = [n for n in names if n.startswith(f"{read}: ")
                        and not (args.no_stack and n.endswith(STACK_ID))]
                done = stores[read].get(r, k) if read in stores else {}
                for n, (p, *_) in done.items():
                    if p.shape != (len(test),) or p.min(initial=0) < 0:
                        raise SystemExit(f"{stores[read].path}: the stored fit {n!r} of repeat "
                                         f"{r} fold {k} has {p.shape} predictions for "
                                         f"{len(test)} test runs; remove the file.")
                todo = [n for n in want if n not in done]
                new = (prereg_read_fold(read, convs, features(read), extractors[read], y, groups,
                                        train, test, args, timer, names=todo)
                       if todo else {})
                if new and read in stores:
                    stores[read].put(r, k, new)
                fold.update({n: (done.get(n) or new[n]) for n in want})
            fold[AUTO] = prereg_auto(fold, args.reads)
            out = {n: (p, {**info, "inner_score": s}) for n, (p, s, info) in fold.items()}
            out.update(baseline_fold(convs, y, groups, train, test, args, judge_pred))
            if peer is not None:
                out["mi4afa ProbeAttributor (ag2 1.2.1)"] = mi4afa_fold(ext_m, m_acts,
                                                                       train, test)
            for name, (pred, info) in out.items():
                rep.setdefault(name, np.full(len(y), -1))[test] = pred
                infos.append({"repeat": r, "fold": k, "method": name, **info})
            print(f"repeat {r} fold {k}: auto chose {out[AUTO][1]['chosen']} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
        for name, P in rep.items():
            preds.setdefault(name, []).append(P)
    preds = {k: np.stack(v) for k, v in preds.items()}
    summary, per_conv = summarise(preds, y, convs, groups, n_resamples=args.n_resamples, seed=0)

    baselines = ["position-only", "TF-IDF", *[k for k in preds if k.startswith("dummy: ")],
                 *[k for k in preds if k.startswith("PromptedJudge")]]
    best_baseline = max(baselines, key=lambda k: summary[k]["step_accuracy"]["estimate"])
    others = [k for k in preds if k.startswith("PromptedJudge") or k.startswith("mi4afa")]
    paired_res = {f"{AUTO} - {b}": paired(per_conv, AUTO, b, groups,
                                          n_resamples=args.n_resamples, seed=0)
                  for b in dict.fromkeys([best_baseline, "position-only", "TF-IDF", *others])}
    chosen = [i["chosen"] for i in infos if i["method"] == AUTO]
    tally = {n: chosen.count(n) for n in names if n in chosen}
    timer.add("total", time.perf_counter() - t_all)
    result = {
        "preregistered": True, "model": str(args.model), "tag": tag, "subset": subset_label,
        "model_label": {"smollm2": "SmolLM2-135M-Instruct"}.get(args.model, tag),
        "n_conversations": len(convs), "folds": args.folds, "inner_folds": args.inner_folds,
        "repeats": args.repeats, "command": command, "reads": list(args.reads),
        "probe_sites": probe_sites, "budget": budget, "context": ctx,
        "shortening": notes, "mi4afa": peer, "deviations": prereg_deviations(args),
        "attention": attention_note(model), "dtype": args.dtype,
        "choice_deviations": prereg_deviations(args, choice_only=True),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python "
                   f"{platform.python_version()}, torch {__import__('torch').__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "summary": summary, "best_baseline": best_baseline, "paired": paired_res,
        "auto_choices": tally, "order": names,
        "choices": [{k: v for k, v in i.items()} for i in infos],
        "times": {k: round(v, 1) for k, v in timer.t.items()},
        "record_ids": [c.record_id for c in convs],
        "y_true": [int(v) for v in y], "task_ids": [str(g) for g in groups],
        "predictions": {k: np.asarray(v).astype(int).tolist() for k, v in preds.items()},
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"prereg_{tag}_{subset_label}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    md = prereg_markdown(result)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    return result


def prereg_deviations(args, *, choice_only=False):
    """How this run differs from the comparison fixed in docs/benchmarks.md section 3.

    ``choice_only``: only the deviations that can change rule step 1's choices (the
    configurations run, their sites, folds and records); a reused judge or a missing
    judge / mi4afa row changes a comparison row, never a choice.
    """
    out = []
    missing = [r for r in PREREG_READS if r not in args.reads]
    if missing:
        n = len(prereg_names(args.reads)) - (len(args.reads) if args.no_stack else 0)
        out.append(f"reads {', '.join(missing)} not run: {n} of "
                   f"{len(prereg_names())} configurations, so the rule chose among these only")
    elif args.no_stack:
        out.append("configuration 9 (stacking) not run (--no-stack)")
    if args.sites != "stride:3":
        out.append(f"sites {args.sites!r} instead of 'stride:3'")
    if (args.folds, args.inner_folds, args.repeats) != (5, 5, 3):
        out.append(f"GroupKFold({args.folds}) x {args.repeats} shuffles, inner "
                   f"GroupKFold({args.inner_folds}) instead of 5 x 3, inner 5")
    if args.limit:
        out.append(f"first {args.limit} records only (--limit)")
    if args.dtype != "float32":
        out.append(f"model in {args.dtype} instead of float32 (every row that reads the "
                   f"model: probes, judge, mi4afa)")
    if choice_only:
        return out
    if args.judge_from:
        out.append(getattr(args, "judge_note", f"judge reused from {args.judge_from}"))
    elif args.no_judge:
        out.append("no PromptedJudge row (--no-judge)")
    if args.no_mi4afa:
        out.append("no mi4afa row (--no-mi4afa)")
    return out


def prereg_markdown(result):
    s = result["summary"]
    lines = [
        f"### Pre-registered: {result['model_label']} on Who&When {result['subset']} "
        f"(n = {result['n_conversations']})", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; {result['date']}.  ",
        f"Prompt budget {result['budget']} tokens (context {result['context']}); "
        + "; ".join(result["shortening"].values()) + ".  ",
        f"Sites searched: {', '.join(result['probe_sites'])}.", "",
        *([(("**Deviations from section 3 (they can change rule step 1's choices):** "
              if result.get("choice_deviations", result["deviations"])
              else "**Deviations from section 3 (no choice of rule step 1 is affected):** ")
             + "; ".join(result["deviations"]) + "."), ""] if result.get("deviations") else
          ["Complete: every configuration and baseline of section 3.", ""]),
        "| method | step acc % [95% CI] | agent acc % (exact) | agent (normalized) | "
        "agent (substring) | within-1 % | mean abs shift | n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    head = [AUTO]
    # every baseline (position-only, TF-IDF, the dummies, the judge, mi4afa)
    base = [k for k in s if not k.startswith("_") and k != AUTO and k not in result["order"]]
    fixed = [k for k in result["order"] if k in s]
    for group, keys in (("", head), ("", sorted(base, key=lambda k: -s[k]["step_accuracy"]
                                                ["estimate"])),
                        ("fixed configuration: ", fixed)):
        for k in keys:
            r = s[k]
            lines.append(
                f"| {group}{k} | {fmt(r['step_accuracy'])} | {fmt(r['agent_accuracy_exact'])} | "
                f"{fmt(r['agent_accuracy_normalized'])} | {fmt(r['agent_accuracy_substring'])} | "
                f"{fmt(r['within_1'])} | {fmt(r['mean_abs_shift'], pct=False)} | {r['n']} |")
    lines += ["", f"Best baseline (highest outer accuracy, favours the baseline): "
                  f"**{result['best_baseline']}**.", "",
              "| paired difference in step accuracy | points [95% CI] |", "|---|---|"]
    for k, r in result["paired"].items():
        lines.append(f"| {k} | {100 * r['estimate']:+.1f} [{100 * r['low']:+.1f}, "
                     f"{100 * r['high']:+.1f}] |")
    lines += ["", "Configurations chosen by the rule (outer fits): "
              + ", ".join(f"{k} x{v}" for k, v in result["auto_choices"].items()), ""]
    if result.get("mi4afa"):
        lines += [f"mi4afa: {json.dumps(result['mi4afa'])}", ""]
    lines += ["Wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in result["times"].items()),
              ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------- main
def result_dtype(result):
    """The model dtype of a result file: its ``dtype``, else its command's ``--dtype``.

    Files written before results named the dtype hold it only in their command
    line, where its absence means the default, float32.
    """
    if "dtype" in result:
        return str(result["dtype"])
    found = re.search(r"--dtype[ =](\S+)", str(result.get("command", "")))
    return found.group(1) if found else "float32"


def judge_from_result(args, convs, template):
    """The PromptedJudge's predictions of an earlier result file of this script.

    The judge fits nothing, so its predictions depend only on the model, the prompt
    and the records. They are reused only when the earlier file names the same model
    and dtype, the same records in the same order and the same prompt fingerprint, and
    predicted the same steps in every repeat; anything else is refused.
    """
    path = Path(args.judge_from)
    old = json.loads(path.read_text())
    name = "PromptedJudge (logprob)"
    problems = []
    if str(old.get("model")) != str(args.model):
        problems.append(f"model {old.get('model')!r}, not {args.model!r}")
    if old.get("record_ids") != [c.record_id for c in convs]:
        problems.append("other records or another order")
    old_dtype = result_dtype(old)
    if old_dtype != args.dtype:
        problems.append(f"dtype {old_dtype}, not {args.dtype}")
    fp = template.fingerprint()[:12]
    if f"fingerprint {fp}" not in str(old.get("prompt_note", "")):
        problems.append(f"not prompt fingerprint {fp}")
    P = np.asarray(old.get("predictions", {}).get(name, []), dtype=np.int64)
    if P.ndim != 2 or P.shape[1] != len(convs) or (P != P[:1]).any():
        problems.append(f"no {name} predictions equal across repeats")
    if problems:
        raise SystemExit(f"--judge-from {path}: cannot reuse its judge: {'; '.join(problems)}.")
    args.judge_note = (f"PromptedJudge predictions reused from {path.name} ({old.get('date')}): "
                       f"same model, records and prompt fingerprint {fp}; not re-run")
    return P[0]


def judge_cache_head(judge, args, template):
    """What every judge cache key names besides the conversation(s).

    The model's identity, its dtype (unless float32: keys written before the dtype
    entry stay valid), the prompt's fingerprint and the answer prefix.
    """
    head = {"model": judge.model_identity_ if hasattr(judge, "model_identity_") else args.model,
            "prompt": template.fingerprint(), "answer_prefix": judge.answer_prefix}
    if args.dtype != "float32":
        head["dtype"] = args.dtype
    return head


class JudgeStore:
    """The judge's per-turn scores of finished conversations, in one small JSON file.

    The counterpart of :class:`PartialStore` for the judge: the activation cache may not
    outlive a machine, this file sits with the results (``--resume``) and can be kept
    with them, so a judge run that one session could not finish goes on in the next.
    Its signature is :func:`judge_cache_head` (model, dtype, prompt, answer prefix);
    each record's entry names the digest of the conversation it scored, and a record
    whose content changed is refused rather than reused. Rewritten atomically after each
    conversation.
    """

    def __init__(self, path, signature):
        self.path = Path(path)
        self.signature = json.loads(json.dumps(signature, sort_keys=True, default=str))
        self.entries = {}
        if self.path.exists():
            old = json.loads(self.path.read_text())
            if old.get("signature") != self.signature:
                raise SystemExit(f"{self.path} holds judge scores of other settings "
                                 "(model, dtype, prompt or answer prefix); remove it.")
            self.entries = old["entries"]

    def get(self, record_id, digest, n_turns):
        """The stored scores of ``record_id``, or None; refused if they do not fit it."""
        entry = self.entries.get(str(record_id))
        if entry is None:
            return None
        if entry.get("digest") != digest or len(entry.get("scores", ())) != n_turns:
            raise SystemExit(f"{self.path}: the stored judge scores of {record_id} are of "
                             f"another conversation (digest {entry.get('digest')}, "
                             f"{len(entry.get('scores', ()))} turns; now {digest}, "
                             f"{n_turns} turns); remove the file.")
        return np.asarray(entry["scores"], dtype=np.float64)

    def put(self, record_id, digest, scores):
        self.entries[str(record_id)] = {"digest": digest,
                                        "scores": np.asarray(scores, dtype=float).tolist()}
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"signature": self.signature, "entries": self.entries}))
        os.replace(tmp, self.path)


def judge_predictions(args, convs, template, cache_dir, store=None):
    """Zero-shot judge scores for every conversation, cached as JSON next to activations.

    Each conversation's scores are written as soon as they exist
    (``judge/<key>.json``, the key naming the model, its dtype unless float32, the
    prompt, answer prefix and the conversation), so an interrupted run resumes where it
    stopped; a file of the whole set written by earlier versions (``judge-<key>.json``)
    is still read. With ``store`` (a path), they also go to a :class:`JudgeStore` kept
    with the results, which is read first.
    """
    from tqdm.auto import tqdm

    judge = PromptedJudge(model=args.model, prompt=template, dtype=args.dtype)
    judge.fit(convs)
    head = judge_cache_head(judge, args, template)
    keep = JudgeStore(store, head) if store is not None else None

    def digest(extra):
        return hashlib.sha256(json.dumps({**head, **extra}, sort_keys=True,
                                         default=str).encode()).hexdigest()[:24]

    contents = [skafa.llm.conversation_content(c) for c in convs]
    whole = Path(cache_dir) / f"judge-{digest({'convs': contents})}.json" if cache_dir else None
    if whole is not None and whole.exists():
        scores = [np.array(s) for s in json.loads(whole.read_text())]
        return np.array([int(np.argmax(s)) for s in scores])
    scores = []
    for i, (conv, content) in enumerate(zip(tqdm(convs, desc="judge", unit="conv"), contents)):
        key = digest({"conv": content})
        rid = conv.record_id if conv.record_id is not None else f"#{i}"
        s = keep.get(rid, key, len(conv.turns)) if keep is not None else None
        path = Path(cache_dir) / "judge" / f"{key}.json" if cache_dir else None
        if s is None and path is not None and path.exists():
            s = np.array(json.loads(path.read_text()))
        if s is None:
            s = np.asarray(judge.turn_decision_function([conv])[0])
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(s.tolist()))
        if keep is not None and str(rid) not in keep.entries:
            keep.put(rid, key, s)
        scores.append(np.asarray(s))
    return np.array([int(np.argmax(s)) for s in scores])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a .gguf path, folder or hub id")
    p.add_argument("--tag", default=None, help="label used in file names and tables")
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--limit", type=int, default=None, help="first N records only")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/skafa"))
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--max-prompt-tokens", type=int, default=8192,
                   help="prompt budget; longer prompts are shortened (middle of the longest "
                        "turns first) and counted. Capped at the model's context.")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--inner-folds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--Cs", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    p.add_argument("--sites", default=None,
                   help="sites the probes search: 'all' (2L+1), 'stride:K' (every K-th "
                        "resid_pre layer + resid_final) or a comma-separated list; default "
                        "'all', and 'stride:3' with --preregistered (section 3)")
    p.add_argument("--read", choices=["last", "mean", "recap", "echo"], default="last",
                   help="turn vector: last token of the turn, mean over the turn's line, "
                        "the turn's recap line after the transcript, or the turn in a "
                        "second copy of the transcript")
    p.add_argument("--n-jobs", type=int, default=None,
                   help="joblib n_jobs of the fits and the extraction (default 1; -1 with "
                        "--scheduler)")
    p.add_argument("--scheduler", default=None,
                   help="run fits and extraction on Dask: a scheduler address "
                        "(tcp://host:8786) or local:N for a LocalCluster of N processes")
    p.add_argument("--n-resamples", type=int, default=2000)
    p.add_argument("--dtype", default="float32",
                   choices=("float32", "bfloat16", "float16", "float64"),
                   help="the model's dtype for every row that reads it (default float32; "
                        "another one is a deviation of section 3)")
    p.add_argument("--no-judge", action="store_true", help="skip the PromptedJudge baseline")
    p.add_argument("--preregistered", action="store_true",
                   help="run the pre-registered comparison of docs/benchmarks.md section 3 "
                        "(27 configurations, baselines, mi4afa, the auto rule)")
    p.add_argument("--reads", nargs="+", default=list(PREREG_READS),
                   help="with --preregistered: reads to include (default: all three)")
    p.add_argument("--no-stack", action="store_true", help="with --preregistered: skip "
                   "configuration 9 (stacking)")
    p.add_argument("--no-mi4afa", action="store_true", help="with --preregistered: skip the "
                   "reference implementation (ag2.extensions.mi4afa)")
    p.add_argument("--peer-n", type=int, default=5, help="with --preregistered: records on "
                   "which skafa's and mi4afa's extraction time and memory are measured, "
                   "interleaved and uncached (0: skip)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random model + synthetic conversations (seconds; for CI)")
    p.add_argument("--judge-from", metavar="JSON", default=None,
                   help="with --preregistered: reuse the PromptedJudge predictions of an "
                        "earlier result file (same model, records and prompt fingerprint; "
                        "checked) instead of running the judge again")
    p.add_argument("--extract-only", action="store_true",
                   help="with --preregistered: fill the activation caches (the reads, "
                        "the judge, mi4afa) and stop")
    p.add_argument("--resume", action="store_true",
                   help="with --preregistered: keep each finished (read, outer fit) in "
                        "<out>/prereg_<tag>_<subset>.partial-<read>.json and reuse it")
    args = p.parse_args(argv)
    if args.sites is None:
        # the tiny --smoke model has too few layers for stride:3 and top-3 sites
        args.sites = "stride:3" if args.preregistered and not args.smoke else "all"
    if args.n_jobs is None:
        args.n_jobs = -1 if args.scheduler else 1
    with dask_backend(args.scheduler):
        return run(args, argv)


@contextlib.contextmanager
def dask_backend(scheduler):
    """joblib's Dask backend on ``scheduler`` (address or ``local:N``); no-op for None."""
    if not scheduler:
        yield
        return
    import joblib
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        if scheduler.startswith("local:"):
            cluster = stack.enter_context(LocalCluster(
                n_workers=int(scheduler.split(":", 1)[1]), threads_per_worker=1,
                processes=True, dashboard_address=None))
            scheduler = cluster.scheduler_address
        client = stack.enter_context(Client(scheduler))
        print(f"dask: {client}", flush=True)
        stack.enter_context(joblib.parallel_config(backend="dask"))
        yield


def run(args, argv):
    t_all = time.perf_counter()
    timer = Timer()

    if args.smoke:
        from skafa.llm import register_model
        from skafa.testing import (
            make_conversations,
            make_tiny_llama,
            make_tiny_tokenizer,
        )

        register_model("tiny-llama-benchmark", make_tiny_llama(n_layers=2),
                       make_tiny_tokenizer(), overwrite=True)
        args.model, args.tag, subset_label = "tiny-llama-benchmark", args.tag or "smoke", "synthetic"
        convs = make_conversations(40, min_turns=3, max_turns=6, seed=0)
        args.folds, args.inner_folds, args.repeats = 2, 2, 1
        args.Cs, args.n_resamples, args.max_prompt_tokens = [0.1], 200, 512
        args.peer_n = min(args.peer_n, 2)
        command = "python examples/benchmark_who_and_when.py --smoke"
    else:
        data = skafa.load_who_and_when(args.data, subset=args.subset)
        convs = data.conversations[: args.limit] if args.limit else data.conversations
        subset_label = args.subset
        command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]) \
            if argv is None else "python examples/benchmark_who_and_when.py " + " ".join(argv)
    tag = args.tag or Path(str(args.model)).stem.split(".")[0]
    y = np.array([c.mistake_step for c in convs])
    groups = np.array([c.task_id for c in convs], dtype=object)

    # ---- prompt budget and the conversations that do not fit
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ctx = context_length(model)
    budget = min(ctx, args.max_prompt_tokens)
    raw = plan(convs, tokenizer, PromptTemplate(), max_tokens=ctx, read=args.read)
    over_ctx = int(sum(not r["fits"] for r in raw))
    over_budget = int(sum(r["n_tokens"] > budget for r in raw))
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    shortened = plan(convs, tokenizer, template, max_tokens=budget, read=args.read)
    n_short = int(sum(r["chars_removed"] > 0 for r in shortened))
    total_chars = sum(sum(len(t.content) for t in c.turns) for c in convs)
    removed = int(shortened.total_chars_removed)
    context_note = (
        f"model context {ctx} tokens, prompt budget {budget}. Unshortened, {over_ctx} of "
        f"{len(convs)} prompts exceed the context and {over_budget} exceed the budget; "
        f"policy `PromptTemplate(shorten='middle_first', max_prompt_tokens={budget})` shortened "
        f"{n_short} conversations, removing {removed:,} of {total_chars:,} turn characters "
        f"({100 * removed / max(total_chars, 1):.1f}%). Nothing was dropped.")
    print(context_note, flush=True)
    if args.preregistered:
        return run_preregistered(args, convs, y, groups, model, tokenizer, ctx, budget,
                                 command, tag if not args.smoke else "smoke", subset_label,
                                 timer, t_all)

    # ---- extraction (all sites, one pass per conversation, disk cache)
    t = time.perf_counter()
    # A registered model (--smoke) exists only in this process: extract here.
    acts = TurnActivationTransformer(model=args.model, read=args.read, prompt=template,
                                     dtype=args.dtype, cache_dir=args.cache_dir,
                                     n_jobs=None if args.smoke else args.n_jobs,
                                     verbose=1).fit(convs)
    A = acts.transform(convs)
    timer.add("extraction", time.perf_counter() - t)
    n_fwd = acts.run_stats["n_forward_passes"]
    print(f"extraction: {A} in {timer.t['extraction']:.0f}s, forward passes {n_fwd}", flush=True)

    judge_pred = None
    if not args.no_judge:
        t = time.perf_counter()
        # The judge appends its answer ("Step: <n>") to the prompt, so it needs a few
        # tokens of room: prompts at the budget are shortened 16 tokens further for it.
        judge_template = PromptTemplate(shorten="middle_first",
                                        max_prompt_tokens=min(budget, ctx - 16))
        judge_pred = judge_predictions(args, convs, judge_template, args.cache_dir)
        timer.add("judge", time.perf_counter() - t)
        print(f"judge: {timer.t['judge']:.0f}s", flush=True)

    L = acts.n_layers_
    probe_sites = list(parse_site_spec(args.sites, L))  # the extraction read all sites
    args.probe_sites = probe_sites
    multi_sites = [f"resid_pre.{L // 4}", f"resid_pre.{L // 2}", f"resid_pre.{3 * L // 4}",
                   "resid_final"]
    multi_sites = list(dict.fromkeys(multi_sites))

    # ---- nested CV on shared outer folds
    preds, infos, all_splits = {}, [], []
    for r in range(args.repeats):
        outer = GroupKFold(args.folds, shuffle=True, random_state=r)
        rep = {}
        for k, (train, test) in enumerate(outer.split(A, y, groups)):
            all_splits.append((train, test))
            out = run_outer_fold(convs, A, y, groups, train, test, args, judge_pred,
                                 multi_sites, timer)
            for name, (pred, info) in out.items():
                rep.setdefault(name, np.full(len(y), -1))[test] = pred
                infos.append({"repeat": r, "fold": k, "method": name, **info})
            print(f"repeat {r} fold {k}: probe site {out['probe'][1]['site']} "
                  f"C={out['probe'][1]['C']}", flush=True)
        for name, P in rep.items():
            preds.setdefault(name, []).append(P)
    preds = {k: np.stack(v) for k, v in preds.items()}
    summary, per_conv = summarise(preds, y, convs, groups, n_resamples=args.n_resamples, seed=0)

    probes = ["probe", "probe + position", "multi-site probe"]
    baselines = [k for k in preds if k not in probes]
    best_baseline = max(baselines, key=lambda k: summary[k]["step_accuracy"]["estimate"])
    paired_res = {}
    for pr in probes:
        # The judge is the behavioural baseline on the same model: always compared.
        judge = [k for k in preds if k.startswith("PromptedJudge")]
        for b in dict.fromkeys([best_baseline, "position-only", *judge]):
            paired_res[f"{pr} - {b}"] = paired(per_conv, pr, b, groups,
                                               n_resamples=args.n_resamples, seed=0)

    # ---- per-site curves
    inner = np.mean([i["inner_curve"] for i in infos if i["method"] == "probe"], axis=0)
    chosen_C = [i["C"] for i in infos if i["method"] == "probe"]
    C_mode = max(set(chosen_C), key=chosen_C.count)
    t = time.perf_counter()
    oof = site_curve_oof(A, y, groups, all_splits[: args.folds], C_mode)
    timer.add("site_curve", time.perf_counter() - t)

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
    timer.add("total", time.perf_counter() - t_all)
    label = {"smollm2": "SmolLM2-135M-Instruct"}.get(args.model, tag)
    result = {
        "model": str(args.model), "model_label": label, "tag": tag, "subset": subset_label,
        "n_conversations": len(convs), "folds": args.folds, "inner_folds": args.inner_folds,
        "repeats": args.repeats, "Cs": args.Cs, "site_search": args.sites, "command": command,
        "read": args.read, "dtype": args.dtype,
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python "
                   f"{platform.python_version()}, torch {__import__('torch').__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "prompt_note": f"`PromptTemplate(shorten='middle_first', max_prompt_tokens={budget})`, "
                       f"fingerprint {template.fingerprint()[:12]}"
                       + ("" if args.no_judge or budget <= ctx - 16 else
                          f"; the judge's prompts are capped at {ctx - 16} tokens to leave "
                          "room for its answer"),
        "context_note": context_note, "n_forward_passes": int(n_fwd),
        "sites": list(A.sites), "probe_sites": probe_sites,
        "site_curve_inner": inner.tolist(),
        "site_curve_oof": oof.tolist(), "site_curve_oof_C": C_mode,
        "summary": summary, "best_baseline": best_baseline, "paired": paired_res,
        "choices_note": choices_note, "choices": infos if args.smoke else [
            {k: v for k, v in i.items() if k != "inner_curve"} for i in infos],
        "times": {k: round(v, 1) for k, v in timer.t.items()},
        # Per-conversation predictions (repeat x conversation), so that two runs on the
        # same records (e.g. --read last vs mean) can be compared pairwise later.
        "record_ids": [c.record_id for c in convs],
        "y_true": [int(v) for v in y], "task_ids": [str(g) for g in groups],
        "predictions": {k: np.asarray(v).astype(int).tolist() for k, v in preds.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{tag}_{subset_label}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    png = plot(result, out / f"{stem}_sites.png")
    if png:
        md += f"\n![per-site accuracy]({Path(png).name})\n"
    (out / f"{stem}.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
