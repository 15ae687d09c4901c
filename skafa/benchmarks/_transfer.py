"""Transfer between two frameworks, learning curves, adaptation and the shift warning.

The study pre-registered in ``docs/your-own-framework.md``. Each direction treats one
framework as the *source* (all its labelled runs) and the other as the *target* (a
user's own framework): transfer at k = 0 beside honest baselines, learning curves
against k labelled target runs (target-only, pooled, pooled with the margin order),
the unsupervised adaptation candidates and their pre-registered rule, and the shift
warning's rates. ``examples/benchmark_transfer.py`` is its command line.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import time

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold

from .. import configurations
from ..baselines import DummyStepClassifier
from ..compose import make_attribution_pipeline
from ..domain import ShiftDetector, coral, label_priority, standardize_per_framework
from ..featurizers import TurnPositionTransformer, TurnTextTransformer
from ..metrics import bootstrap_ci_from_scores
from ..model_selection import SiteEnsemble, grouped_learning_curve
from ..probes import GroupedArgmaxLogisticClassifier
from ..utils.grouped import grouped_softmax

__all__ = ["ADAPTATIONS", "adaptation_rule", "run_transfer_study"]

#: The pre-registered unsupervised adaptation candidates, in tie-breaking order.
ADAPTATIONS = ("A1 per-framework standardisation", "A2 CORAL")


def _say(log, msg):
    if log is not None:
        log(msg)


def _ci(hits, groups, n_resamples, seed):
    r = bootstrap_ci_from_scores(np.asarray(hits, dtype=float), n_resamples=n_resamples,
                                 random_state=seed, groups=groups)
    return {"mean": r.estimate, "low": r.low, "high": r.high, "n": r.n}


def _baseline(featurizer, convs, y, groups, n_jobs):
    search = GridSearchCV(
        make_attribution_pipeline(featurizer, GroupedArgmaxLogisticClassifier()),
        {"groupedargmaxlogisticclassifier__C": [0.001, 0.01, 0.1]},
        cv=GroupKFold(n_splits=5), n_jobs=n_jobs)
    return search.fit(convs, y, groups=groups)


def _take(convs, idx):
    return [convs[i] for i in idx]


def _adapted(name, Xs, Xt):
    if name == ADAPTATIONS[0]:
        return standardize_per_framework(Xs), standardize_per_framework(Xt)
    return coral(Xs, Xt)


def adaptation_rule(paired_hits, groups, *, n_resamples=2000, seed=0):
    """Apply the pre-registered adaptation rule.

    Parameters
    ----------
    paired_hits : dict
        ``{candidate: ndarray of (hit_candidate - hit_A0)}`` per target run, every
        cell's runs concatenated.
    groups : ndarray
        Cluster of every run (cell and task).

    Returns
    -------
    dict
        ``{"differences": {candidate: {mean, low, high, n}}, "winner": name or None}``:
        the candidate with the highest mean whose paired 95% CI lies above 0
        (earlier candidates win ties); None when none does.
    """
    diffs = {name: _ci(d, groups, n_resamples, seed) for name, d in paired_hits.items()}
    passing = [name for name in ADAPTATIONS if name in diffs and diffs[name]["low"] > 0]
    winner = max(passing, key=lambda n: (diffs[n]["mean"], -ADAPTATIONS.index(n)),
                 default=None)
    return {"differences": diffs, "winner": winner}


def _direction(convs, X, y, groups, src, tgt, *, selector, n_jobs, n_resamples, seed, log):
    """k = 0 rows, adaptation rows, shift rates and the fixed probe of one direction."""
    Xs, Xt = X[src], X[tgt]
    ys, yt, gs, gt = y[src], y[tgt], groups[src], groups[tgt]
    cs, ct = _take(convs, src), _take(convs, tgt)
    t = time.perf_counter()
    sel = clone(selector).fit(Xs, ys, groups=gs)
    fixed = clone(sel.best_estimator_)
    if not isinstance(fixed, SiteEnsemble):  # one site: read it, as the selector does
        fixed = SiteEnsemble(fixed, sites=list(sel.best_sites_))
    _say(log, f"  site search on the source: sites {'+'.join(sel.best_sites_)}, "
              f"{sel.best_params_} ({time.perf_counter() - t:.0f} s)")
    pred = {"probe (A0, no adaptation)": sel.predict(Xt)}
    for name in ADAPTATIONS:
        As, At = _adapted(name, Xs, Xt)
        pred[f"probe + {name}"] = clone(fixed).fit(As, ys).predict(At)
    pred["position-only"] = _baseline(TurnPositionTransformer(), cs, ys, gs, n_jobs).predict(ct)
    pred["TF-IDF"] = _baseline(TurnTextTransformer(), cs, ys, gs, n_jobs).predict(ct)
    pred["most frequent (relative)"] = DummyStepClassifier(
        strategy="most_frequent_relative").fit(cs, ys).predict(ct)
    hits = {name: (np.asarray(p) == yt).astype(float) for name, p in pred.items()}
    hits["uniform (expected)"] = 1.0 / np.asarray([len(c) for c in ct], dtype=float)
    rows = {name: _ci(h, gt, n_resamples, seed) for name, h in hits.items()}
    a0 = hits["probe (A0, no adaptation)"]
    paired = {name: _ci(a0 - hits[name], gt, n_resamples, seed)
              for name in ("position-only", "TF-IDF", "most frequent (relative)")}

    # the shift warning: fitted on source runs, calibrated on held-out source folds
    sites = list(sel.best_sites_)
    held = np.zeros(len(src), dtype=bool)
    for train, test in GroupKFold(n_splits=5).split(np.zeros(len(src)), groups=gs.astype(str)):
        det = ShiftDetector(sites=sites).fit(Xs[train], groups=gs[train])
        held[test] = det.predict(Xs[test])
    det = ShiftDetector(sites=sites).fit(Xs, groups=gs)
    shift = {"held-out source runs": float(held.mean()), "n_source": int(held.size),
             "target runs": float(det.predict(Xt).mean()), "n_target": int(len(tgt)),
             "threshold": det.threshold_}

    # the margin order of the target runs under the source-trained probe
    scores = np.concatenate([np.asarray(r, dtype=float)
                             for r in sel.turn_decision_function(Xt)])
    margin = label_priority(grouped_softmax(scores, np.asarray(Xt.offsets)), Xt.offsets)
    return dict(rows=rows, paired=paired, hits=hits, shift=shift, fixed=fixed,
                best_sites=list(sel.best_sites_), best_params=dict(sel.best_params_),
                margin=margin)


def run_transfer_study(convs, X, frameworks, *, model="smollm2", selector=None,
                       train_sizes=(0, 5, 10, 20, 1.0), n_draws=20, n_jobs=None,
                       n_resamples=2000, seed=0, curves=True, log=None):
    """Both directions between two frameworks: transfer, curves, adaptation, shift.

    Parameters
    ----------
    convs : list of Conversation
        Labelled runs of both frameworks.
    X : TurnFeatures
        Their turn features (the sites the selector compares), in the same order.
    frameworks : array-like of str, shape (n_conversations,)
        The framework of every run (exactly two values).
    model : str, default="smollm2"
        Names the reader (for the recommended configuration's selector).
    selector : SiteSelector, optional
        Default: the recommended configuration's selector.
    train_sizes, n_draws
        Passed to :func:`~skafa.model_selection.grouped_learning_curve`.
    n_jobs : int, optional
        For the site search and the baselines' C search.
    n_resamples, seed : int
        Bootstrap resamples; seed of the folds, draws and bootstrap.
    curves : bool, default=True
        Whether to compute the learning curves (the costly part).
    log : callable, optional
        Progress lines.

    Returns
    -------
    result : dict
        JSON-serialisable: per direction its k = 0 table, paired differences,
        shift rates, chosen sites, curves (per method: one row per size); the
        adaptation rule's result.
    """
    frameworks = np.asarray(frameworks).astype(str)
    names = sorted(set(frameworks.tolist()))
    if len(names) != 2:
        raise ValueError(f"frameworks holds {len(names)} distinct value(s) ({names}); "
                         "the study compares exactly two.")
    y = np.asarray([c.mistake_step for c in convs], dtype=np.int64)
    groups = np.asarray([str(c.task_id) for c in convs], dtype=object)
    if selector is None:
        _, selector = configurations.make_configuration(
            configurations.RECOMMENDED, model, random_state=seed)
        selector.set_params(n_jobs=n_jobs)
    result = {"directions": {}, "frameworks": names}
    cells = {}
    for a, b in (names, names[::-1]):
        key = f"{a} -> {b}"
        _say(log, f"direction {key}")
        src, tgt = np.flatnonzero(frameworks == a), np.flatnonzero(frameworks == b)
        cells[key] = d = _direction(convs, X, y, groups, src, tgt, selector=selector,
                                    n_jobs=n_jobs, n_resamples=n_resamples, seed=seed,
                                    log=log)
        d["src"], d["tgt"] = src, tgt
        for name, row in d["rows"].items():
            _say(log, f"  {name:<42} {row['mean']:.3f} [{row['low']:.3f}, {row['high']:.3f}] "
                      f"n={row['n']}")
        _say(log, f"  shift warning: {d['shift']['held-out source runs']:.1%} of held-out "
                  f"source runs, {d['shift']['target runs']:.1%} of target runs")
        result["directions"][key] = {k: d[k] for k in ("rows", "paired", "shift",
                                                       "best_sites", "best_params")}
    # the pre-registered adaptation rule, pooled over the cells
    a0 = "probe (A0, no adaptation)"
    paired = {name: np.concatenate([c["hits"][f"probe + {name}"] - c["hits"][a0]
                                    for c in cells.values()]) for name in ADAPTATIONS}
    cell_groups = np.concatenate([np.asarray([f"{key}|{g}" for g in groups[c["tgt"]]])
                                  for key, c in cells.items()])
    rule = adaptation_rule(paired, cell_groups, n_resamples=n_resamples, seed=seed)
    result["adaptation_rule"] = rule
    _say(log, f"adaptation rule: winner {rule['winner']!r}; differences to A0: "
              + "; ".join(f"{n}: {r['mean']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]"
                          for n, r in rule["differences"].items()))
    if not curves:
        return result
    for key, c in cells.items():
        Xs, Xt = X[c["src"]], X[c["tgt"]]
        ys, yt = y[c["src"]], y[c["tgt"]]
        gs, gt = groups[c["src"]], groups[c["tgt"]]
        common = dict(train_sizes=list(train_sizes), n_draws=n_draws, random_state=seed,
                      groups=gt, n_jobs=n_jobs)
        runs = {
            "target-only": dict(X=Xt, sizes=[s for s in train_sizes if s != 0]),
            "pooled": dict(X=Xt, X_source=Xs),
            "pooled, margin order": dict(X=Xt, X_source=Xs, label_order=c["margin"],
                                         sizes=[s for s in train_sizes
                                                if isinstance(s, int) and s > 0]),
        }
        if rule["winner"] is not None:
            As, At = _adapted(rule["winner"], Xs, Xt)
            runs[f"pooled + {rule['winner']}"] = dict(X=At, X_source=As)
        curves_out = {}
        for method, spec in runs.items():
            t = time.perf_counter()
            params = dict(common)
            if "sizes" in spec:
                params["train_sizes"] = spec["sizes"]
            res = grouped_learning_curve(
                c["fixed"], spec["X"], yt, X_source=spec.get("X_source"),
                y_source=ys if "X_source" in spec else None,
                groups_source=gs if "X_source" in spec else None,
                label_order=spec.get("label_order"), **params)
            rows = res.summary(n_resamples=n_resamples, random_state=seed)
            curves_out[method] = {"rows": rows, "draw_scores": res.draw_scores.tolist(),
                                  "hits_mean_per_run": np.nanmean(res.hits, axis=1).tolist()}
            curves_out[method]["_result"] = res
            _say(log, f"  {key} {method}: " + ", ".join(
                f"k={r['n_labelled']:.0f}: {r['mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"
                for r in rows) + f" ({time.perf_counter() - t:.0f} s)")
        result["directions"][key]["curves"] = curves_out
    return result
