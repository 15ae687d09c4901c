"""Seconds per ``FailureAttributor.attribute`` call: the probe's sites only against every site.

A fitted :class:`~skafa.FailureAttributor` predicts from the sites its selector reads
(``predict_sites_``): its extractor reads only those and stops the forward pass after the
deepest of them (unless it is ``resid_final``). Before, ``attribute`` ran
``pipeline_`` as fitted, reading every site through the whole model. This script fits a
small attributor once (the recommended configuration of ``--model``, ``sites="stride:3"``,
on the first ``--n-train`` labelled Who&When records, no activation cache, prompts
shortened to ``--max-prompt-tokens``), then times ``attribute`` on the next ``--n-runs``
records along both paths: interleaved run by run, the order of the two paths alternating
between repeats, in one process with the same threads. Every attribution of the
restricted path must equal the full path's (checked; the script fails otherwise).

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python examples/benchmark_attribute_sites.py --model smollm2 \\
        --n-train 10 --n-runs 3 --repeats 2 --threads 1
    python examples/benchmark_attribute_sites.py --smoke   # tiny random model: wiring only

Prints a markdown table (seconds per run, both paths, and their ratio) and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get(
        "SKAFA_WHO_AND_WHEN", str(REPO.parent / "shared" / "data" / "who_and_when")))
    p.add_argument("--subset", default="Algorithm-Generated",
                   choices=("Algorithm-Generated", "Hand-Crafted"))
    p.add_argument("--model", default="smollm2", help="short name, .gguf file or folder")
    p.add_argument("--n-train", type=int, default=10,
                   help="labelled records the attributor is fitted on (the first ones)")
    p.add_argument("--n-runs", type=int, default=3,
                   help="records attributed and timed (the ones after the training records)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's default); on a machine shared "
                        "with other jobs, 1 thread avoids OpenMP oversubscription")
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model on synthetic records: checks the wiring only")
    return p.parse_args(argv)


def _data(args):
    if args.smoke:
        from skafa.testing import make_conversations

        return make_conversations(args.n_train + args.n_runs, seed=0)
    from skafa import load_who_and_when

    convs = [c for c in load_who_and_when(args.data, args.subset).conversations
             if c.mistake_step is not None]
    need = args.n_train + args.n_runs
    if len(convs) < need:
        raise SystemExit(f"{args.data} ({args.subset}) has {len(convs)} labelled records; "
                         f"--n-train + --n-runs needs {need}.")
    return convs[:need]


def _attributor(args):
    from skafa import FailureAttributor
    from skafa.configurations import make_configuration
    from skafa.llm import PromptTemplate

    model = args.model
    if args.smoke:
        from skafa.llm import register_model
        from skafa.testing import make_tiny_llama, make_tiny_tokenizer

        model = "benchmark-attribute-sites-tiny"
        register_model(model, make_tiny_llama(n_layers=6), make_tiny_tokenizer(),
                       overwrite=True)
    # memory_cache=False, no cache_dir: every attribute call runs its forward pass
    extractor, selector = make_configuration(
        None, model, dtype=args.dtype, memory_cache=False,
        prompt=PromptTemplate(shorten="middle_first", max_prompt_tokens=args.max_prompt_tokens))
    if args.smoke:
        selector.set_params(cv=type(selector.cv)(3))
    return FailureAttributor(extractor, selector)


def _full_site_input(self, convs):
    """The path before predict_sites_: the fitted pipeline_, every site, whole model."""
    from skafa.compose import final_step_input

    return final_step_input(self.pipeline_, convs)


def run(args):
    import torch

    from skafa import FailureAttributor

    if args.threads:
        torch.set_num_threads(args.threads)
    convs = _data(args)
    train, runs = convs[:args.n_train], convs[args.n_train:]
    fa = _attributor(args)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few training runs: shift and convergence warnings
        fa.fit(train)
    fit_s = time.perf_counter() - t
    acts = fa.pipeline_[0]
    paths = {"probe's sites": None, "every site": _full_site_input}
    seconds = {name: np.zeros((args.repeats, len(runs))) for name in paths}
    passes = dict.fromkeys(paths, 0)
    out = {}
    for r in range(args.repeats):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for i, conv in enumerate(runs):
            for name in order:
                patch = (mock.patch.object(FailureAttributor, "_final_input", paths[name])
                         if paths[name] is not None else contextlib.nullcontext())
                before = acts.run_stats["n_forward_passes"]
                with patch, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t = time.perf_counter()
                    a = fa.attribute(conv)
                    seconds[name][r, i] = time.perf_counter() - t
                passes[name] += acts.run_stats["n_forward_passes"] - before
                out.setdefault(name, {})[(r, i)] = a.to_dict()
    same = out["probe's sites"] == out["every site"]
    if not same:
        raise SystemExit("the two paths gave different attributions")
    return {"fa": fa, "fit_s": fit_s, "seconds": seconds, "passes": passes, "runs": runs,
            "same": same}


def report(args, res, argv):
    fa, seconds, runs = res["fa"], res["seconds"], res["runs"]
    acts = fa.pipeline_[0]
    n_layers = acts.n_layers_
    from skafa.llm import site_depth

    deepest = max(fa.predict_sites_, key=site_depth)
    stop = ("whole model (resid_final)" if deepest == "resid_final"
            else f"after {deepest} of {n_layers} layers")
    new, old = seconds["probe's sites"], seconds["every site"]
    n_new, n_old = res["passes"]["probe's sites"], res["passes"]["every site"]
    import torch
    lines = [
        f"## `FailureAttributor.attribute`: the probe's sites against every site "
        f"({'tiny random model' if args.smoke else args.model})",
        "",
        f"Fitted on {args.n_train} records in {res['fit_s']:.1f} s; extractor sites "
        f"{len(acts.sites_)} (`{acts.sites}`, read=`{acts.read}`), "
        f"`predict_sites_` = {', '.join(fa.predict_sites_)} (selector `best_sites_` "
        f"{', '.join(fa.best_sites_)}); forward pass stops {stop}. Interleaved, "
        f"{args.repeats} repeat(s), torch threads {torch.get_num_threads()}. "
        f"Attributions identical on both paths: {res['same']}. Forward passes: "
        f"{n_new} and {n_old}.",
        "",
        "| run | turns | prompt tokens | probe's sites (s) | every site (s) | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for i, conv in enumerate(runs):
        n_tokens = acts.prompt_.encode(conv, acts._tokenizer, read=acts.read,
                                       max_tokens=acts.context_length_).n_tokens
        a, b = np.median(new[:, i]), np.median(old[:, i])
        lines.append(f"| {conv.record_id} | {len(conv)} | {n_tokens} | {a:.3f} | {b:.3f} "
                     f"| {a / b:.2f} |")
    a, b = float(np.sum(np.median(new, axis=0))), float(np.sum(np.median(old, axis=0)))
    lines.append(f"| **all {len(runs)}** | | | **{a:.3f}** | **{b:.3f}** | **{a / b:.2f}** |")
    lines += ["", "Seconds: median over repeats per run; ratio = probe's sites / every site "
              "(below 1: faster).", "",
              "Command: `" + " ".join(["python examples/benchmark_attribute_sites.py"]
                                      + [shlex.quote(x) for x in argv]) + "`"]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    res = run(args)
    text = report(args, res, argv)
    print(text, flush=True)
    return res


if __name__ == "__main__":
    main()
