"""Nested comparison of decisive-step methods on shared outer folds.

Every method is evaluated on the SAME outer folds (:func:`outer_splits`: grouped
K-fold by task id, repeated over shuffles of the fold assignment); every choice a
method makes (site, C, configuration) is made on inner grouped folds of the outer
training part only (:class:`~skafa.model_selection.SiteSelector` with
``param_grid``, :func:`select_single_and_top`, :func:`grid_search_C`). The
per-conversation predictions of all methods are summarized with task-clustered
bootstrap intervals (:func:`summarize_predictions`) and compared pairwise on the
same conversations (:func:`paired_differences`). :func:`preregistered_rule` and
:func:`tally_rule` are the two steps of the pre-registered rule.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold, cross_val_score

from ..metrics import agent_accuracy, bootstrap_ci_from_scores, lenient_step_matches
from ..probes import GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier
from ..utils.validation import group_labels
from ._selection import SiteEnsemble, SiteSelector, missing_task_ids

__all__ = ["AGENT_MATCH_RULES", "PREREGISTERED_HEADLINE", "format_interval", "grid_search_C",
           "make_probe", "method_table", "outer_splits", "paired_differences", "preregistered_rule",
           "reader_rule", "select_single_and_top", "summarize_predictions", "tally_rule"]

#: Agent-matching rules reported per method (see :func:`skafa.metrics.agent_accuracy`).
AGENT_MATCH_RULES = ("exact", "normalized", "substring")

#: The headline row of pre-registered result files: rule step 1 applied in every outer fit.
PREREGISTERED_HEADLINE = "skafa (pre-registered auto)"


def _check_task_groups(groups, n):
    """``groups`` checked as one task id per conversation, none missing.

    Ids of one type are returned as given (the folds of existing result files
    stay the same); a mix of ``str`` and ``int`` becomes integer codes, ``1`` and
    ``"1"`` two tasks (:func:`~skafa.utils.validation.group_labels`).
    """
    if groups is None:
        raise ValueError("groups is None: the nested comparison groups conversations by "
                         "task; pass one task id per conversation.")
    values = list(np.asarray(groups, dtype=object).ravel()) if not isinstance(
        groups, (list, tuple)) else list(groups)
    if len(values) != n:
        raise ValueError(f"groups has {len(values)} entries for {n} conversations; give "
                         "one group (task id) per conversation.")
    missing = missing_task_ids(values)
    if missing is not None:
        raise ValueError(
            f"groups: {missing}; every conversation needs a task id to be kept on one side of "
            "every split. Give each a task id (a run that shares its task with no other "
            "gets an id of its own).")
    if len({isinstance(t, str) for t in values}) > 1:
        return group_labels(values)
    return groups


def outer_splits(y, groups, *, n_folds=5, n_repeats=3, shuffle=True):
    """The shared outer folds: ``GroupKFold(n_folds, shuffle=True, random_state=r)``.

    Parameters
    ----------
    y : array-like of shape (n_conversations,)
    groups : array-like of shape (n_conversations,)
        Task ids; a task never sits on both sides of a split.
    n_folds, n_repeats : int
    shuffle : bool, default=True
        ``False``: one plain ``GroupKFold(n_folds)`` (``n_repeats`` must be 1).

    Returns
    -------
    splits : list of (repeat, fold, train, test)

    Raises
    ------
    ValueError
        When ``groups`` does not hold one task id per conversation, naming the
        conversations (positions, the first five and a count) without one.

    Examples
    --------
    >>> s = outer_splits([0, 1, 0, 2], ["a", "a", "b", "c"], n_folds=2, n_repeats=1)
    >>> len(s), s[0][:2]
    (2, (0, 0))
    """
    y = np.asarray(y)
    groups = _check_task_groups(groups, len(y))
    if not shuffle and n_repeats != 1:
        raise ValueError(f"n_repeats={n_repeats} without shuffle repeats the same folds; "
                         "use n_repeats=1 or shuffle=True.")
    out = []
    for r in range(n_repeats):
        outer = (GroupKFold(n_folds, shuffle=True, random_state=r) if shuffle
                 else GroupKFold(n_folds))
        for k, (train, test) in enumerate(outer.split(np.zeros((len(y), 1)), y, groups)):
            out.append((r, k, train, test))
    return out


def make_probe(estimator, C, random_state=0):
    """``"logistic"``: GroupedArgmaxLogisticClassifier; ``"softmax"``: GroupedSoftmaxClassifier."""
    if estimator == "logistic":
        return GroupedArgmaxLogisticClassifier(C=C, random_state=random_state)
    return GroupedSoftmaxClassifier(C=C)


def select_single_and_top(X, y, groups, X_test, *, Cs, sites, inner, n_sites, n_jobs,
                          random_state, estimator):
    """C and site(s) on inner folds for one site and for the ``n_sites`` best, sharing fits.

    Equal to two ``SiteSelector(make_probe(estimator, ...), param_grid={"C": Cs},
    n_sites=k)`` fits (``k = 1`` and ``k = n_sites``) on ``GroupKFold(inner)``
    (tested), at about half the cost: both rank the sites by the same per-site
    inner scores and differ only in the score that compares the Cs (the best
    site's, or the cross-validated ``n_sites`` average's) and in the refit.

    Returns
    -------
    out : dict
        ``{1: (pred, score, info), n_sites: (pred, score, info)}``, ``info``
        holding the chosen ``C`` and ``sites``.
    """
    groups = _check_task_groups(groups, len(y))
    best = {}
    for C in sorted(Cs):
        est = make_probe(estimator, C, random_state)
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
    out[1] = (fitted.predict(X_test.select_sites(chosen[0])), score,
              {"C": C, "sites": chosen})
    C, score, chosen, est = best[n_sites]
    fitted = SiteEnsemble(est, sites=chosen, n_jobs=n_jobs).fit(X.select_sites(chosen), y)
    out[n_sites] = (fitted.predict(X_test.select_sites(chosen)), score,
                    {"C": C, "sites": chosen})
    return out


def grid_search_C(X, y, groups, *, Cs, inner, n_jobs, random_state):
    """``GridSearchCV`` over C on inner grouped folds (single-block features)."""
    groups = _check_task_groups(groups, len(y))
    gs = GridSearchCV(GroupedArgmaxLogisticClassifier(random_state=random_state),
                      {"C": sorted(Cs)}, cv=GroupKFold(inner), n_jobs=n_jobs)
    return gs.fit(X, y, groups=groups)


def _interval(r):
    return {"estimate": float(r.estimate), "low": float(r.low), "high": float(r.high)}


def summarize_predictions(predictions, y, conversations, groups, *, n_resamples=2000,
                          random_state=0):
    """Per-method metrics averaged over repeats, with task-clustered bootstrap CIs.

    Parameters
    ----------
    predictions : dict of str to ndarray of shape (n_repeats, n)
        Each method's outer-fold predictions.
    y : ndarray of shape (n,)
        True decisive steps.
    conversations : list of Conversation
        For the agent accuracies (speakers, ``mistake_agent``).
    groups : array-like of shape (n,)
        Task ids: the bootstrap resamples tasks, not conversations.
    n_resamples, random_state : int

    Returns
    -------
    summary : dict
        ``{method: {"step_accuracy", "lenient_step_accuracy", "agent_accuracy_<rule>",
        "within_1", "mean_abs_shift": {"estimate", "low", "high"},
        "step_accuracy_per_repeat", "n"}}`` plus ``"_uniform_expected"``.
        ``lenient_step_accuracy`` is Who&When's own (lenient) scoring, see
        :func:`skafa.metrics.lenient_step_accuracy`.
    per_conversation : dict of str to ndarray of shape (n,)
        Each method's exact step accuracy per conversation (mean over repeats),
        the input of :func:`paired_differences`.
    """
    y = np.asarray(y)
    true_agents = np.array([c.mistake_agent for c in conversations], dtype=object)
    n_turns = np.array([len(c) for c in conversations])
    rows, per_conv = {}, {}

    def ci(v):
        return _interval(bootstrap_ci_from_scores(
            v, n_resamples=n_resamples, random_state=random_state, groups=groups))

    for name, P in predictions.items():  # P: (n_repeats, n)
        P = np.asarray(P)
        correct = (P == y[None, :]).mean(axis=0)
        lenient = np.mean([lenient_step_matches(y, P[r]) for r in range(P.shape[0])], axis=0)
        within1 = (np.abs(P - y[None, :]) <= 1).mean(axis=0)
        shift = np.abs(P - y[None, :]).mean(axis=0)
        agents = {
            rule: np.mean([
                [agent_accuracy([true_agents[i]], [conversations[i].speakers[P[r, i]]],
                                rule=rule) for i in range(len(y))]
                for r in range(P.shape[0])], axis=0)
            for rule in AGENT_MATCH_RULES
        }
        per_conv[name] = correct
        rows[name] = {
            "step_accuracy": ci(correct),
            "step_accuracy_per_repeat": [float(np.mean(P[r] == y)) for r in range(P.shape[0])],
            **{f"agent_accuracy_{rule}": ci(v) for rule, v in agents.items()},
            "within_1": ci(within1),
            "mean_abs_shift": ci(shift),
            "lenient_step_accuracy": ci(lenient),
            "n": int(len(y)),
        }
    rows["_uniform_expected"] = float(np.mean(1.0 / n_turns))
    return rows, per_conv


def paired_differences(per_conversation, pairs, groups, *, n_resamples=2000, random_state=0):
    """Paired differences in step accuracy, task-clustered bootstrap CIs.

    Parameters
    ----------
    per_conversation : dict
        From :func:`summarize_predictions`.
    pairs : iterable of (a, b)
        Method names; each difference is ``a - b`` on the same conversations.
    groups : array-like
        Task ids.

    Returns
    -------
    diffs : dict
        ``{"a - b": {"estimate", "low", "high"}}``.
    """
    out = {}
    for a, b in pairs:
        diff = per_conversation[a] - per_conversation[b]
        out[f"{a} - {b}"] = _interval(bootstrap_ci_from_scores(
            diff, n_resamples=n_resamples, random_state=random_state, groups=groups))
    return out


def format_interval(r, pct=True):
    """``"31.0 [24.0, 38.0]"`` (percent) or ``"1.23 [1.00, 1.50]"``."""
    if pct:
        return f"{100 * r['estimate']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"
    return f"{r['estimate']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def method_table(summary, groups_of_rows):
    """Markdown table lines of per-method metrics.

    ``groups_of_rows``: ``[(prefix, [method, ...]), ...]``, printed in that order.
    The lenient (Who&When script) step accuracy has its own column beside the exact
    one; a summary written before that column existed shows "-" there.
    """
    lines = [
        "| method | step acc % [95% CI] | lenient step acc % (Who&When script) | "
        "agent acc % (exact) | agent (normalized) | agent (substring) | within-1 % | "
        "mean abs shift | n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for prefix, keys in groups_of_rows:
        for k in keys:
            r = summary[k]
            lenient = (format_interval(r["lenient_step_accuracy"])
                       if "lenient_step_accuracy" in r else "-")
            lines.append(
                f"| {prefix}{k} | {format_interval(r['step_accuracy'])} | {lenient} | "
                f"{format_interval(r['agent_accuracy_exact'])} | "
                f"{format_interval(r['agent_accuracy_normalized'])} | "
                f"{format_interval(r['agent_accuracy_substring'])} | "
                f"{format_interval(r['within_1'])} | "
                f"{format_interval(r['mean_abs_shift'], pct=False)} | {r['n']} |")
    return lines


def preregistered_rule(fold_results, order):
    """Rule step 1: the configuration with the highest inner score (ties: ``order``).

    Parameters
    ----------
    fold_results : dict
        ``{name: (test predictions, inner score, info)}`` of one outer fit; only
        names in ``order`` compete.
    order : list of str
        The pre-registered configuration order (the tie-break).

    Returns
    -------
    (pred, None, info) : tuple
        The chosen configuration's predictions; ``info = {"chosen", "inner_score"}``.

    Examples
    --------
    >>> out = {"a": ([1], 0.4, {}), "b": ([2], 0.5, {}), "c": ([3], 0.5, {})}
    >>> preregistered_rule(out, ["a", "b", "c"])[2]
    {'chosen': 'b', 'inner_score': 0.5}
    """
    names = [n for n in order if n in fold_results]
    if not names:
        raise ValueError("no configuration of the pre-registered order was fitted.")
    best = max(names, key=lambda n: (fold_results[n][1], -names.index(n)))
    return (fold_results[best][0], None,
            {"chosen": best, "inner_score": fold_results[best][1]})


def tally_rule(results, *, subset="Algorithm-Generated"):
    """Rule step 2: the configuration chosen most often by step 1 over complete cells.

    Parameters
    ----------
    results : iterable of (label, dict)
        Pre-registered result files (``preregistered: true``), read with
        :func:`~skafa.model_selection.read_result`. A cell is complete when it
        states no deviation that can change step 1's choices
        (``choice_deviations``; older files: ``deviations``); others, and cells of
        another subset, are left out and named.
    subset : str

    Returns
    -------
    out : dict
        ``{"winner", "tally", "complete", "left_out"}``; ties go to the
        pre-registered order; no complete cell: ``winner`` is None.
    """
    tally, order, complete, left_out = {}, None, [], []
    for label, result in results:
        if not result.get("preregistered"):
            raise ValueError(f"{label} is not a pre-registered result.")
        cell = f"{result.get('tag')} / {result.get('subset')}"
        if result.get("subset") != subset:
            left_out.append((cell, f"not {subset}"))
            continue
        deviations = result.get("choice_deviations", result.get("deviations"))
        if deviations:
            left_out.append((cell, "; ".join(deviations)))
            continue
        if order is not None and result["order"] != order:
            raise ValueError(f"{label}: its configuration order differs from the others'.")
        order = result["order"]
        complete.append(cell)
        for name, count in result["auto_choices"].items():
            tally[name] = tally.get(name, 0) + int(count)
    winner = _most_chosen(tally, order, "the complete cells") if tally else None
    return {"winner": winner, "tally": tally, "complete": complete, "left_out": left_out}


def _most_chosen(tally, order, where):
    """Rule step 2's count: the most chosen configuration, ties to the pre-registered order."""
    unknown = sorted(set(tally) - set(order or ()))
    if unknown or not tally:
        raise ValueError(f"{where}: chosen configurations {unknown or 'none'} not in the "
                         "file's configuration order.")
    return max(tally, key=lambda n: (tally[n], -order.index(n)))


#: The baseline section 7's rule step 2 asks the headline to beat.
_POSITION = "position-only"


def reader_rule(result):
    """Rule step 2 of the 1.5B rematch (``docs/benchmarks.md`` §7), on one cell.

    The configuration chosen most often by step 1 over the cell's outer fits (ties:
    the pre-registered order) becomes the recommended configuration *for that
    reader* only if the headline beats position-only with a paired 95% CI above 0.
    Unlike :func:`tally_rule` (§3), the dtype the file records is the plan's
    (``dtype="auto"``), so it is not a deviation; any other deviation that can
    change step 1's choices is refused.

    Parameters
    ----------
    result : dict
        A pre-registered Algorithm-Generated result file, read with
        :func:`~skafa.model_selection.read_result`.

    Returns
    -------
    out : dict
        ``{"winner", "most_chosen", "tally", "paired"}``: ``most_chosen`` the
        configuration chosen most often, ``paired`` the headline minus
        position-only (estimate and CI), ``winner`` = ``most_chosen`` when the
        CI is above 0, else None.

    Raises
    ------
    ValueError
        Not a pre-registered Algorithm-Generated result, another deviation, or no
        paired difference against position-only.
    """
    if not result.get("preregistered"):
        raise ValueError("not a pre-registered result.")
    cell = f"{result.get('tag')} / {result.get('subset')}"
    if result.get("subset") != "Algorithm-Generated":
        raise ValueError(f"{cell}: rule step 2 of section 7 reads the Algorithm-Generated cell.")
    planned = f"model in {result.get('dtype')} instead of float32"
    other = [d for d in result.get("choice_deviations", result.get("deviations", ["unknown"]))
             if not str(d).startswith(planned)]
    if other:
        raise ValueError(f"{cell}: deviations that can change the choices: {'; '.join(other)}.")
    name = f"{PREREGISTERED_HEADLINE} - {_POSITION}"
    paired = (result.get("paired") or {}).get(name)
    if not paired or not {"estimate", "low", "high"} <= set(paired):
        raise ValueError(f"{cell}: no paired difference {name}.")
    choices, order = result.get("auto_choices"), result.get("order")
    if not isinstance(choices, dict) or not isinstance(order, list):
        raise ValueError(f"{cell}: no auto_choices (a mapping) and order (a list).")
    tally = {str(k): int(v) for k, v in choices.items()}
    most = _most_chosen(tally, order, cell)
    return {"winner": most if float(paired["low"]) > 0 else None, "most_chosen": most,
            "tally": tally, "paired": dict(paired)}
