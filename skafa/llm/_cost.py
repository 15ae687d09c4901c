"""What an extraction costs: a FLOP model of one forward pass, and a measured rate.

One conversation of ``n`` prompt tokens costs one pass of the base decoder (no LM
head). Its floating-point operations are

.. math::

    F(n) = 2 \\, n \\, P_\\text{layers} + 2 \\, L \\, n^2 \\, d_\\text{attn}

where :math:`P_\\text{layers}` is the number of weights inside the ``L`` decoder
layers (each is used in one multiply-add per token; roughly
``L x (4 d^2 + 3 d i)`` for a model of width ``d`` and MLP width ``i``, less with
grouped-query attention) and :math:`d_\\text{attn}` is the width of the attention
heads (``n_heads x head_dim``): the causal half of the ``n x n`` scores and of the
weighted sum of the values (``2 n^2 d`` each for the full matrices; fused causal
kernels skip the masked half, eager attention does not and costs up to twice this
term). Reading sites adds copies of a few rows, nothing that scales with ``n``.

So the cost is *tokens x layers x width* (times width again for the weights), plus
a term in ``n^2`` that matters once prompts reach a few thousand tokens. A rate in
FLOP/s measured on the machine (:func:`measure_throughput`) turns it into time.

Examples
--------
>>> from skafa.llm import forward_flops
>>> from skafa.testing import make_tiny_llama
>>> model = make_tiny_llama(n_layers=2, hidden=32)
>>> forward_flops(model, 100) > forward_flops(model, 50) * 2   # the n^2 term
True
"""

from __future__ import annotations

import time

import numpy as np

from ._attention import banded_sliding_window_attention

__all__ = ["calibrate_seconds", "forward_flops", "layer_parameters", "measure_throughput"]


def _layout(model):
    from ._sites import decoder_layout

    return decoder_layout(model)


def layer_parameters(model) -> int:
    """Number of weights inside the decoder layers (no embedding, no final norm)."""
    layout = _layout(model)
    return int(sum(p.numel() for layer in layout.layers for p in layer.parameters()))


def _attention_width(model):
    config = getattr(_layout(model).decoder, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if heads and head_dim:
        return int(heads * head_dim)
    return int(hidden or _layout(model).embedding.weight.shape[-1])


def forward_flops(model, n_tokens, *, n_layers=None, split=False):
    """Floating-point operations of one decoder pass over ``n_tokens`` tokens.

    Parameters
    ----------
    model : transformers model
        A model :func:`skafa.llm.decoder_layout` understands.
    n_tokens : int or array-like of int
        Prompt length(s); an array gives one value per prompt.
    n_layers : int, optional
        Layers actually run (early stopping); default all.
    split : bool, default=False
        Return the two terms apart: ``(weights, attention)``, the ``2 n P`` term
        and the ``n^2`` term (their sum is the total).

    Returns
    -------
    flops : float or ndarray of float, or a tuple of two of them with ``split``
    """
    layout = _layout(model)
    total = len(layout.layers)
    run = total if n_layers is None else int(n_layers)
    per_layer = layer_parameters(model) / total
    d_attn = _attention_width(model)
    n = np.asarray(n_tokens, dtype=np.float64)
    n_sliding, window = _sliding_layers(model, run)
    # 4 d_attn flops per attended (query, key) pair: n**2 / 2 pairs in a causal
    # layer, about n * W in a sliding-window one (skafa.llm runs it on the band).
    pairs = (run - n_sliding) * n * n / 2.0
    if n_sliding:
        pairs = pairs + n_sliding * n * np.minimum(n / 2.0, float(window))
    weights, attention = run * 2.0 * n * per_layer, 4.0 * pairs * d_attn

    def out(v):
        return float(v) if np.ndim(v) == 0 else v

    return (out(weights), out(attention)) if split else out(weights + attention)


def _sliding_layers(model, run):
    """``(number of sliding-window layers among the first run, window)``."""
    from ._attention import has_sliding_window

    if not has_sliding_window(model):
        return 0, 0
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    types = getattr(config, "layer_types", None)
    if types is None:
        return int(run), int(config.sliding_window)
    return sum(t == "sliding_attention" for t in list(types)[:run]), int(config.sliding_window)


def measure_throughput(model, *, n_tokens=512, repeats=2, seed=0):
    """Time decoder passes over a random sequence and return the rate.

    Parameters
    ----------
    model : transformers model
    n_tokens : int, default=512
        Length of the calibration sequence (capped at the model's context).
    repeats : int, default=2
        Passes timed; the fastest is kept (the first also warms up lazy state).
    seed : int, default=0

    Returns
    -------
    dict
        ``n_tokens``, ``seconds`` (fastest pass), ``tokens_per_s`` and
        ``flops_per_s`` (:func:`forward_flops` / ``seconds``).
    """
    import torch

    layout = _layout(model)
    device = layout.embedding.weight.device
    config = getattr(layout.decoder, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or n_tokens
    n = int(min(n_tokens, limit))
    vocab = int(layout.embedding.weight.shape[0])
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, size=(1, n)))
    ids = ids.to(device)
    best = float("inf")
    for _ in range(max(1, int(repeats))):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode(), banded_sliding_window_attention(layout.decoder):
            layout.decoder(input_ids=ids, use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return {"n_tokens": n, "seconds": best, "tokens_per_s": n / best,
            "flops_per_s": forward_flops(model, n) / best}


def calibrate_seconds(model, n_tokens, *, short=512, long=4096, repeats=2, seed=0):
    """Projected seconds of one pass per prompt, from timed passes at two lengths.

    The rate of a single short pass (:func:`measure_throughput`) prices every FLOP
    alike, but on a CPU the ``n^2`` attention term runs at a lower rate than the
    weights' matrix products, so an ETA from it is too short for long prompts. Here the seconds of a pass are
    modelled as ``a x weight FLOPs + b x attention FLOPs``
    (:func:`forward_flops` with ``split=True``), ``a`` and ``b`` solved from one
    timed pass of ``short`` and one of ``long`` tokens (capped at the longest
    prompt and at the model's context). Where the longest prompt is under twice
    ``short`` or the two timings give no positive solution, one rate is used: the
    longer pass's, which is the lower.

    Parameters
    ----------
    model : transformers model
    n_tokens : array-like of int
        The prompt lengths to price.
    short, long : int, default=512, 4096
        Calibration lengths. How close the projection came to two measured
        extractions is in docs/benchmarks.md §6 (``examples/benchmark_eta.py``).
    repeats : int, default=2
        Short passes timed; the fastest is kept (the long pass is timed once).
    seed : int, default=0

    Returns
    -------
    dict
        ``seconds`` (one per prompt, ndarray), ``passes`` (the timed passes:
        ``n_tokens``, ``seconds``, ``tokens_per_s`` and ``flops_per_s`` each) and
        ``per_flop`` (``(a, b)``, seconds per weight and per attention FLOP).

    Examples
    --------
    >>> from skafa.llm import calibrate_seconds
    >>> from skafa.testing import make_tiny_llama
    >>> cal = calibrate_seconds(make_tiny_llama(n_layers=2, hidden=32), [100, 3000])
    >>> [p["n_tokens"] for p in cal["passes"]], cal["seconds"].shape
    ([512], (2,))
    """
    n = np.asarray(n_tokens, dtype=np.int64).reshape(-1)
    longest = int(n.max()) if n.size else 0
    passes = [measure_throughput(model, n_tokens=short, repeats=repeats, seed=seed)]
    if longest >= 2 * passes[0]["n_tokens"]:
        # timed once: the short passes warmed the model up, and a long pass is
        # the costly one (minutes for a 1.5B model on one CPU thread)
        second = measure_throughput(model, n_tokens=min(int(long), longest), repeats=1,
                                    seed=seed)
        if second["n_tokens"] > passes[0]["n_tokens"]:  # not capped by the context
            passes.append(second)
    w, att = forward_flops(model, [p["n_tokens"] for p in passes], split=True)
    t = np.array([p["seconds"] for p in passes])
    per_flop = None
    if len(passes) == 2:
        try:
            a, b = np.linalg.solve(np.stack([w, att], axis=1), t)
        except np.linalg.LinAlgError:
            a = b = -1.0
        if a > 0 and b > 0:
            per_flop = (float(a), float(b))
    if per_flop is None:  # one rate: the slowest measured (the longest pass's)
        rate = min(p["flops_per_s"] for p in passes)
        per_flop = (1.0 / rate, 1.0 / rate)
    nw, na = forward_flops(model, n, split=True)
    seconds = per_flop[0] * np.asarray(nw, dtype=np.float64) + per_flop[1] * np.asarray(
        na, dtype=np.float64)
    return {"seconds": seconds, "passes": passes, "per_flop": per_flop}
