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

__all__ = ["forward_flops", "layer_parameters", "measure_throughput"]


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


def forward_flops(model, n_tokens, *, n_layers=None) -> float:
    """Floating-point operations of one decoder pass over ``n_tokens`` tokens.

    Parameters
    ----------
    model : transformers model
        A model :func:`skafa.llm.decoder_layout` understands.
    n_tokens : int or array-like of int
        Prompt length(s); an array gives one value per prompt.
    n_layers : int, optional
        Layers actually run (early stopping); default all.

    Returns
    -------
    flops : float or ndarray of float
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
    flops = run * 2.0 * n * per_layer + 4.0 * pairs * d_attn
    return float(flops) if flops.ndim == 0 else flops


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
