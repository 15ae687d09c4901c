"""Compare the activation probe with baselines on the same grouped folds, with CIs.

Methods (each one sklearn estimator on a list of conversations):
probe (activations -> SiteSelector(GroupedArgmaxLogisticClassifier)), probe + position
(TurnFeatureUnion of activations and position features), position-only, TF-IDF, and
two DummyStepClassifier rules. Every method is cross-validated with ``cross_val_predict``
on the SAME ``GroupKFold`` split by task id; the table gives step and agent accuracy with
95% cluster-bootstrap CIs (whole tasks resampled) and the probe's paired difference with
each baseline.

    python examples/compare_with_baselines.py                      # tiny random model, seconds
    python examples/compare_with_baselines.py --model smollm2 \\
        --data ../shared/data/who_and_when --cache-dir ~/.cache/skafa

The default model is a *random* two-layer Llama on synthetic conversations: it checks the
plumbing, and its numbers mean nothing.
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.model_selection import GroupKFold, cross_val_predict
from sklearn.pipeline import make_pipeline

from skafa import (
    DummyStepClassifier,
    GroupedArgmaxLogisticClassifier,
    PromptTemplate,
    SiteSelector,
    TurnActivationTransformer,
    TurnFeatureUnion,
    TurnPositionTransformer,
    TurnTextTransformer,
)
from skafa.llm import context_length, load_model, register_model
from skafa.metrics import agent_accuracy, bootstrap_ci, paired_bootstrap_ci, step_accuracy

TINY = "compare-with-baselines-tiny"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TINY, help="model name or path; default: tiny random Llama")
    p.add_argument("--data", default=None, help="Who&When folder; default: synthetic data")
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--n", type=int, default=60, help="synthetic conversations (no --data)")
    p.add_argument("--site-stride", type=int, default=None,
                   help="compare resid_pre.{0,k,2k,...} + resid_final (default: L // 10)")
    p.add_argument("--folds", type=int, default=5, help="outer and inner GroupKFold splits")
    p.add_argument("--cache-dir", default=None, help="on-disk activation cache")
    p.add_argument("--n-resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.model == TINY:  # a random model registered under a name: estimators take names
        from skafa.testing import make_tiny_llama, make_tiny_tokenizer
        register_model(TINY, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    if args.data is None:
        from skafa.testing import make_conversations
        convs = make_conversations(args.n, min_turns=3, max_turns=8, seed=args.seed)
    else:
        from skafa.datasets import load_who_and_when
        convs = load_who_and_when(args.data, subset=args.subset).conversations
    y = np.array([c.mistake_step for c in convs])
    groups = np.array([c.task_id for c in convs], dtype=object)

    model, _ = load_model(args.model)
    n_layers, ctx = model.config.num_hidden_layers, context_length(model)
    stride = args.site_stride or max(1, n_layers // 10)
    sites = [f"resid_pre.{k}" for k in range(0, n_layers, stride)] + ["resid_final"]
    # Prompts longer than the context are shortened visibly (never silently cut).
    prompt = PromptTemplate(shorten="middle_first", max_prompt_tokens=ctx)

    def acts():
        return TurnActivationTransformer(args.model, sites=sites, prompt=prompt,
                                         cache_dir=args.cache_dir)

    def probe():
        return SiteSelector(GroupedArgmaxLogisticClassifier(random_state=args.seed),
                            cv=GroupKFold(args.folds))

    methods = {
        "probe": make_pipeline(acts(), probe()),
        "probe + position": make_pipeline(
            TurnFeatureUnion([("acts", acts()), ("pos", TurnPositionTransformer())]), probe()),
        "position-only": make_pipeline(TurnPositionTransformer(),
                                       GroupedArgmaxLogisticClassifier(random_state=args.seed)),
        "TF-IDF": make_pipeline(TurnTextTransformer(),
                                GroupedArgmaxLogisticClassifier(random_state=args.seed)),
        "dummy: most_frequent": DummyStepClassifier(strategy="most_frequent"),
        "dummy: first": DummyStepClassifier(strategy="first"),
    }
    cv = GroupKFold(n_splits=args.folds)  # one splitter, so every method sees the same folds
    pred = {name: cross_val_predict(est, convs, y, groups=groups, cv=cv)
            for name, est in methods.items()}

    boot = dict(n_resamples=args.n_resamples, random_state=args.seed, groups=groups)
    true_agents = [c.mistake_agent for c in convs]
    rows = {}
    for name, steps in pred.items():
        agents = [c.speakers[s] for c, s in zip(convs, steps)]
        rows[name] = {"step": bootstrap_ci(y, steps, step_accuracy, **boot),
                      "agent": bootstrap_ci(true_agents, agents, agent_accuracy, **boot)}
    diffs = {name: paired_bootstrap_ci(y, pred["probe"], pred[name], step_accuracy, **boot)
             for name in pred if name != "probe"}

    def ci(r, sign=""):
        return f"{r.estimate:{sign}.3f} [{r.low:{sign}.3f}, {r.high:{sign}.3f}]"

    print(f"{len(convs)} conversations, {len(set(groups))} tasks; model {args.model!r} "
          f"({n_layers} layers); sites compared: {', '.join(sites)}")
    print(f"GroupKFold({args.folds}) by task id; 95% CIs resample whole tasks "
          f"({args.n_resamples} resamples); agent rule 'normalized'.\n")
    print(f"{'method':<22} {'step accuracy':<24} {'agent accuracy':<24} {'probe - method':<24}")
    for name, r in rows.items():
        paired = ci(diffs[name], "+") if name in diffs else ""
        print(f"{name:<22} {ci(r['step']):<24} {ci(r['agent']):<24} {paired}")
    return {"predictions": pred, "rows": rows, "paired": diffs, "sites": sites}


if __name__ == "__main__":
    main()
