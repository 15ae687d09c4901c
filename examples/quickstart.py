"""Quickstart: white-box failure attribution on Who&When with SmolLM2.

What it does, end to end:

1. loads the Who&When records (one :class:`skafa.Conversation` each);
2. renders every conversation as one prompt. Records longer than the model's
   context are shortened *visibly* (``PromptTemplate(shorten="middle_first")``:
   the longest turns lose their middles first, a marker says how many characters
   went); the script prints how many conversations were shortened and how many
   characters were removed;
3. reads the model's hidden states at every turn (the read of the recommended
   configuration, :data:`skafa.configurations.RECOMMENDED`), at every site, once
   (one forward pass per conversation; cached on disk);
4. cross-validates the recommended configuration (its probe, with C and the site
   chosen jointly by an inner grouped CV) with an outer
   ``GroupKFold(5)`` over task ids, so every conversation gets one held-out
   prediction, and prints step / agent / within-1 accuracy with 95% bootstrap
   confidence intervals next to position-only and TF-IDF probes on the same folds
   (paired differences) and two rules of thumb;
5. fits :class:`skafa.FailureAttributor` on a training split and explains its
   attribution of one held-out conversation.

Before extracting it prints what it will extract and an ETA (a cost model
calibrated by one timed pass, :meth:`TurnActivationTransformer.estimate_cost`),
then a progress bar per conversation. Every finished conversation is in the disk
cache at once, so an interrupted run (Ctrl-C) resumes where it stopped when the
same command is run again.

Run it with ``examples/run_main_job.sh`` (sets up the environment) or directly::

    python examples/quickstart.py --limit 20          # smoke run
    python examples/quickstart.py --cache-dir /tmp/skafa-cache
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import (
    GridSearchCV,
    GroupKFold,
    GroupShuffleSplit,
    cross_val_predict,
)

from skafa.attributor import FailureAttributor
from skafa.baselines import DummyStepClassifier
from skafa.compose import make_attribution_pipeline
from skafa.configurations import RECOMMENDED, make_configuration, parse_configuration
from skafa.datasets import load_who_and_when
from skafa.featurizers import TurnPositionTransformer, TurnTextTransformer
from skafa.llm import (
    PromptTemplate,
    TurnActivationTransformer,
    context_length,
    load_model,
    parse_site_spec,
    plan,
)
from skafa.metrics import (
    agent_accuracy,
    bootstrap_ci,
    paired_bootstrap_ci,
    step_accuracy,
    within_k_accuracy,
)
from skafa.probes import GroupedArgmaxLogisticClassifier

REPO = Path(__file__).resolve().parents[1]


def default_data_path() -> str:
    env = os.environ.get("SKAFA_WHO_AND_WHEN")
    return env if env else str(REPO.parent / "shared" / "data" / "who_and_when")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Cross-validate skafa's activation probe on Who&When and attribute "
                    "one held-out failure.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", default=default_data_path(),
                   help="Who&When folder (env SKAFA_WHO_AND_WHEN overrides the default)")
    p.add_argument("--subset", default="Algorithm-Generated",
                   help="Algorithm-Generated, Hand-Crafted or 'all'")
    p.add_argument("--model", default="smollm2", help="model name or path (skafa.llm._models)")
    p.add_argument("--cache-dir", default=str(Path("~/.cache/skafa").expanduser()),
                   help="on-disk activation cache ('' for memory only)")
    p.add_argument("--sites", default="stride:3",
                   help="sites the probe's site search compares: 'stride:K' (every K-th "
                        "resid_pre layer, from 0, plus resid_final), 'all', or a "
                        "comma-separated list such as resid_pre.9,resid_final (the "
                        "recommended configuration searches stride:3)")
    p.add_argument("--limit", type=int, default=None,
                   help="use only the first N records (smoke runs)")
    p.add_argument("--batch-size", type=lambda v: v if v == "auto" else int(v), default=1,
                   help="conversations per forward pass, or 'auto' (from free device memory)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto",
                   help="compute dtype; auto: bfloat16 on a GPU or a CPU with bf16 units")
    p.add_argument("--n-resamples", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="seed of splits and bootstrap")
    return p.parse_args(argv)


def choose_sites(spec: str, n_layers: int) -> list:
    try:
        return list(parse_site_spec(spec, n_layers))
    except ValueError as exc:
        raise SystemExit(f"--sites: {exc}") from None


def fmt_ci(r, digits=3):
    return f"{r.estimate:.{digits}f} [{r.low:.{digits}f}, {r.high:.{digits}f}]"


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    times = {}

    # ------------------------------------------------------------------ data
    subset = None if args.subset == "all" else args.subset
    data = load_who_and_when(args.data, subset=subset)
    convs = list(data.conversations)
    if args.limit is not None:
        convs = convs[: args.limit]
    y = np.asarray([c.mistake_step for c in convs], dtype=np.int64)
    groups = np.asarray([c.task_id for c in convs], dtype=object)
    true_agents = [c.mistake_agent for c in convs]
    n_tasks = len(set(groups.tolist()))
    print(f"data: {len(convs)} conversations ({args.subset}) from {data.path}, "
          f"{n_tasks} tasks, {np.mean([len(c) for c in convs]):.1f} turns on average")

    # ----------------------------------------------------------------- model
    t = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device)
    ctx = context_length(model)
    n_layers = model.config.num_hidden_layers
    times["model load"] = time.perf_counter() - t
    print(f"model: {args.model} ({type(model).__name__}, {n_layers} layers x "
          f"{model.config.hidden_size}, context {ctx} tokens) loaded in "
          f"{times['model load']:.1f} s")

    read, _, _, n_top, features = parse_configuration(RECOMMENDED)
    print(f"configuration: {RECOMMENDED!r} (skafa.configurations.RECOMMENDED, picked by "
          f"the pre-registered rule; docs/benchmarks.md section 3): read={read!r}")

    # ---------------------------------------------------------------- prompts
    # Never cut silently: report which prompts exceed the context and shorten
    # those deliberately, middle of the longest turns first, with a marker. The
    # prompt planned is the one of the configuration's read (echo: the transcript twice).
    t = time.perf_counter()
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=ctx)
    raw = plan(convs, tokenizer, PromptTemplate(), max_tokens=ctx, read=read)
    short = plan(convs, tokenizer, template, max_tokens=ctx, read=read)
    times["prompt planning"] = time.perf_counter() - t
    shortened = [r for r in short if r["chars_removed"] > 0]
    total_chars = sum(len(turn.content) for c in convs for turn in c.turns)
    print(f"prompts: {len(raw.too_long)} of {len(convs)} exceed the {ctx}-token context "
          f"(longest {int(raw.n_tokens.max())} tokens). Policy: "
          f"PromptTemplate(shorten='middle_first', max_prompt_tokens={ctx}).")
    print(f"  shortened {len(shortened)} conversations, removing "
          f"{short.total_chars_removed:,} characters "
          f"({100 * short.total_chars_removed / max(total_chars, 1):.2f}% of all turn text)"
          + (":" if shortened else "."))
    for r in shortened:
        before = raw[r["index"]]["n_tokens"]
        n_turns_cut = sum(1 for v in r["turn_chars_removed"] if v > 0)
        print(f"    {r['record_id']}: {before} -> {r['n_tokens']} tokens, "
              f"{r['chars_removed']:,} characters removed from {n_turns_cut} of "
              f"{r['n_turns']} turns")
    if not short.all_fit:
        bad = ", ".join(str(r["record_id"]) for r in short.too_long)
        raise SystemExit(f"these prompts cannot be shortened enough to fit: {bad}")

    # ------------------------------------------------------------- extraction
    # Every site costs the same single forward pass, so read them all once and
    # cache them; the probe's site search then compares a subset.
    t = time.perf_counter()
    extractor = TurnActivationTransformer(
        args.model, sites=None, read=read, prompt=template, device=args.device,
        dtype=args.dtype,
        cache_dir=args.cache_dir or None, batch_size=args.batch_size, verbose=1,
    ).fit(convs)
    estimate = extractor.estimate_cost(convs)
    print(f"extraction plan: all {len(extractor.sites_)} sites of {len(convs)} "
          f"conversations, one forward pass each; {estimate['summary']}.")
    if estimate["n_to_extract"] and args.cache_dir:
        print(f"  every finished conversation is cached in {args.cache_dir} at once: "
              "interrupt (Ctrl-C) and run the same command again to resume.", flush=True)
    try:
        X_all = extractor.transform(convs)
    except KeyboardInterrupt:
        left = extractor.estimate_cost(convs, calibrate=False)
        print(f"\ninterrupted: {left['n_cached']} of {len(convs)} conversations are cached"
              + (f" in {args.cache_dir}; run the same command again to resume."
                 if args.cache_dir else " in memory only (no --cache-dir): a rerun starts over."))
        raise SystemExit(130) from None
    times["extraction"] = time.perf_counter() - t
    stats = extractor.run_stats
    print(f"extraction: {X_all.n_turns_total} turns x {X_all.n_sites} sites x "
          f"{X_all.n_features} features in {times['extraction']:.1f} s "
          f"({stats['n_forward_passes']} forward passes; cache: "
          f"{stats['memory_hits']} memory hits, {stats['disk_hits']} disk hits, "
          f"{stats['misses']} misses) [cache dir: {args.cache_dir or 'none'}]")

    # ---------------------------------------------------- cross-validation
    sites = choose_sites(args.sites, n_layers)
    X = X_all.select_sites(sites)
    outer = GroupKFold(n_splits=5)
    # The recommended configuration as one pipeline over conversations: every fold
    # reads the activations from the cache filled above and fits everything else
    # (position features where the configuration has them, C, the site) on its
    # training part only.
    config_extractor, selector = make_configuration(
        RECOMMENDED, args.model, random_state=args.seed, prompt=template,
        device=args.device, dtype=args.dtype, cache_dir=args.cache_dir or None,
        batch_size=args.batch_size)
    config_extractor.set_params(**{"sites" if features == "acts" else "act__sites": sites})
    probe = make_attribution_pipeline(config_extractor, selector)
    grid = selector.param_grid
    what = "one" if n_top == 1 else f"the {n_top} best (their scores averaged)"
    print(f"cross-validation: outer GroupKFold(5) by task id; inside each training fold "
          f"SiteSelector picks {what} of {len(sites)} sites ({', '.join(sites)}) and "
          f"{grid} jointly by GroupKFold(5)")
    t = time.perf_counter()
    pred = {"probe (skafa)": cross_val_predict(probe, convs, y, groups=groups, cv=outer)}
    times["cross-validation (probe)"] = time.perf_counter() - t
    baselines = {
        "always step 1": DummyStepClassifier(strategy="constant", constant=1),
        "most frequent step": DummyStepClassifier(strategy="most_frequent"),
    }
    for name, est in baselines.items():
        pred[name] = cross_val_predict(est, X, y, groups=groups, cv=outer)
    # The honest baselines, on the same outer folds: what a turn's position and speaker,
    # or its words, already tell (C chosen on inner grouped folds, as for the probe).
    t = time.perf_counter()
    for name, featurizer in (("position-only", TurnPositionTransformer()),
                             ("TF-IDF", TurnTextTransformer())):
        search = GridSearchCV(
            make_attribution_pipeline(featurizer, GroupedArgmaxLogisticClassifier()),
            {"groupedargmaxlogisticclassifier__C": [0.001, 0.01, 0.1]},
            cv=GroupKFold(n_splits=5))
        pred[name] = cross_val_predict(search, convs, y, groups=groups, cv=outer,
                                       params={"groups": groups})
    times["cross-validation (baselines)"] = time.perf_counter() - t

    boot = dict(n_resamples=args.n_resamples, random_state=args.seed, groups=groups)
    table = {}
    header = (f"{'method':<20} {'step acc [95% CI]':<24} {'agent acc [95% CI]':<24} "
              f"{'within-1 [95% CI]':<24} {'n':>4}")
    print()
    print(header)
    print("-" * len(header))
    for name, steps in pred.items():
        agents = list(X.speakers_at(steps))
        s = bootstrap_ci(y, steps, step_accuracy, **boot)
        a = bootstrap_ci(true_agents, agents, agent_accuracy, **boot)
        w = bootstrap_ci(y, steps, within_k_accuracy, **boot)
        table[name] = {"step": s, "agent": a, "within_1": w}
        print(f"{name:<20} {fmt_ci(s):<24} {fmt_ci(a):<24} {fmt_ci(w):<24} {s.n:>4}")
    print()
    diffs = {}
    for other in ("position-only", "TF-IDF", "always step 1"):
        diffs[other] = d = paired_bootstrap_ci(y, pred["probe (skafa)"], pred[other],
                                               step_accuracy, **boot)
        print(f"probe - {other}, step accuracy: {d.estimate:+.3f} "
              f"[{d.low:+.3f}, {d.high:+.3f}] (paired bootstrap)")
    diff = diffs["always step 1"]
    print("agent accuracy: rule 'normalized' (case-folded, trailing parentheticals "
          "dropped) against the annotated mistake_agent; CIs resample whole tasks "
          f"({args.n_resamples} resamples).")

    # ------------------------------------------------- one attribution, explained
    t = time.perf_counter()
    split = GroupShuffleSplit(n_splits=1, test_size=0.2, random_state=args.seed)
    train, test = next(split.split(convs, y, groups))
    attributor = FailureAttributor(config_extractor, selector)
    attributor.fit([convs[i] for i in train])
    times["fit FailureAttributor"] = time.perf_counter() - t
    held_out = [convs[i] for i in test]
    report = attributor.evaluate(held_out, n_resamples=args.n_resamples,
                                 random_state=args.seed)
    chosen = attributor.pipeline_[-1]
    score = float(np.max(chosen.candidate_scores_))  # the score C and the sites were chosen by
    chosen_sites = "+".join(attributor.best_sites_)
    print(f"\nFailureAttributor fitted on {len(train)} conversations (chosen by CV on "
          f"them: sites {chosen_sites}, {chosen.best_params_}; CV step accuracy "
          f"{score:.3f}); {len(test)} held out.")
    print(report)
    example = held_out[0]
    attribution = attributor.attribute(example, top_k=3)
    print(f"\nheld-out conversation {example.record_id} (task {example.task_id}, "
          f"{len(example)} turns):")
    print(f"  predicted: step {attribution.step}, agent {attribution.agent!r} "
          f"(p = {attribution.probability:.3f})")
    print(f"  true:      step {example.mistake_step}, agent {example.mistake_agent!r}")
    print(attribution)

    times["total"] = time.perf_counter() - t_start
    print("\nwall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    return {
        "sites": sites,
        "predictions": pred,
        "table": table,
        "paired": diff,
        "paired_all": diffs,
        "plan": short,
        "attributor": attributor,
        "report": report,
        "attribution": attribution,
        "times": times,
    }


if __name__ == "__main__":
    main()
    sys.exit(0)
