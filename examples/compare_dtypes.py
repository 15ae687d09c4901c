"""How far turn vectors move between two compute dtypes, on real records.

Extracts (or reads from the activation cache) the turn vectors of the chosen Who&When
records twice, once with the model in ``--reference`` dtype (float32 by default) and
once in ``--dtype``, and prints, per site, the relative L2 error
``||a - b|| / ||a||`` of each turn vector (median and maximum over turns, per record).
Everything goes through the public :class:`skafa.TurnActivationTransformer`, with the
prompt policy of ``examples/benchmark_who_and_when.py`` (``PromptTemplate(shorten=
"middle_first", max_prompt_tokens=B)``), so a benchmark run's cache is reused and the
records compared are the ones that benchmark read.

Example (Qwen2.5-Coder-0.5B, two Hand-Crafted records at the 32,768-token budget)::

    python examples/compare_dtypes.py --model DIR/qwen2.5-coder-0.5b-instruct.gguf \\
        --subset Hand-Crafted --records Hand-Crafted/8 Hand-Crafted/20 \\
        --max-prompt-tokens 32768 --dtype bfloat16 --data DATA/who_and_when \\
        --cache-dir ~/.cache/skafa
"""
import argparse
import os
import sys

import numpy as np

import skafa
from skafa import PromptTemplate, TurnActivationTransformer
from skafa.llm import parse_site_spec


def relative_errors(reference, other):
    """Per turn and site, ``||reference - other|| / ||reference||``.

    Parameters
    ----------
    reference, other : ndarray of shape (n_turns, n_sites, hidden_size)

    Returns
    -------
    errors : ndarray of shape (n_turns, n_sites)
    """
    reference = np.asarray(reference, dtype=np.float64)
    other = np.asarray(other, dtype=np.float64)
    if reference.shape != other.shape:
        raise ValueError(f"shapes differ: {reference.shape} and {other.shape}")
    num = np.linalg.norm(reference - other, axis=-1)
    den = np.linalg.norm(reference, axis=-1)
    return num / np.maximum(den, np.finfo(np.float64).tiny)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", default=None, help="Who&When folder (default: "
                   "skafa.datasets.who_and_when_path(): $SKAFA_WHO_AND_WHEN or the data home)")
    p.add_argument("--subset", default="Algorithm-Generated")
    p.add_argument("--records", nargs="+", required=True, help="record ids, e.g. Hand-Crafted/8")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--read", default="last", choices=["last", "mean", "recap", "echo"])
    p.add_argument("--reference", default="float32", help="reference dtype")
    p.add_argument("--reference-model", default=None,
                   help="model of the reference run (default: --model); needed for a "
                        "registered model, which is used in the dtype it was registered in")
    p.add_argument("--dtype", default="bfloat16", help="dtype compared with the reference")
    p.add_argument("--sites", default="stride:3",
                   help="sites summarised ('all', 'stride:K' or a comma-separated list)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/skafa"))
    args = p.parse_args(argv)

    data = skafa.load_who_and_when(args.data, subset=args.subset)
    by_id = {c.record_id: c for c in data.conversations}
    missing = [r for r in args.records if r not in by_id]
    if missing:
        raise SystemExit(f"records not in {args.data or skafa.datasets.who_and_when_path()} "
                         f"({args.subset}): {', '.join(missing)}")
    convs = [by_id[r] for r in args.records]
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=args.max_prompt_tokens)
    feats = {}
    runs = ((args.reference_model or args.model, args.reference), (args.model, args.dtype))
    for model, dtype in runs:
        ext = TurnActivationTransformer(model=model, read=args.read, prompt=template,
                                        dtype=dtype, cache_dir=args.cache_dir, verbose=1)
        feats[dtype] = ext.fit(convs).transform(convs)
    sites = list(parse_site_spec(args.sites, ext.n_layers_))
    ref = feats[args.reference].select_sites(sites)
    other = feats[args.dtype].select_sites(sites)
    off = ref.offsets

    print(f"relative L2 error of {args.dtype} turn vectors against {args.reference} "
          f"(model {args.model}, read={args.read}, budget {args.max_prompt_tokens}):\n")
    print("| record | turns | " + " | ".join(sites) + " |")
    print("|---|---|" + "---|" * len(sites))
    medians = []
    for i, conv in enumerate(convs):
        rows = slice(off[i], off[i + 1])
        err = relative_errors(ref.values[rows], other.values[rows])
        med, worst = np.median(err, axis=0), err.max(axis=0)
        medians.append(med)
        cells = [f"{100 * m:.1f}% (max {100 * w:.1f}%)" for m, w in zip(med, worst)]
        print(f"| {conv.record_id} | {err.shape[0]} | " + " | ".join(cells) + " |")
    print(f"\nmedian over records and sites of the per-turn median: "
          f"{100 * float(np.median(np.stack(medians))):.1f}%")
    return {"sites": sites, "median": np.stack(medians).tolist()}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
