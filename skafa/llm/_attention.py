"""Sliding-window attention computed on its band only.

Models such as Gemma-2/3 and Mistral attend within a sliding window of ``W``
tokens in most layers. transformers' ``"sdpa"`` implementation runs those layers
as dense attention under a ``(n, n)`` mask, so a long prompt pays for all ``n**2``
query-key pairs although only about ``n * W`` of them can be attended to. At
32,768 tokens and ``W = 512`` that is most of a Gemma-3 forward pass.

:func:`banded_sliding_window_attention` switches a model's ``"sdpa"`` layers to
:func:`banded_sdpa_attention_forward` for the duration of a ``with`` block: a
sliding-window layer splits the queries into chunks of ``W`` and gives each chunk
only the keys its window can reach, with the matching slice of transformers' own
mask. Before it does, it checks on that mask that every query-key pair it leaves
out is masked; if any is not (a bidirectional window, a custom mask) the layer
runs as plain ``"sdpa"``. A left-out pair has weight exactly zero in the dense
computation, so the two agree up to floating-point summation order
(``tests/test_attention.py`` checks them against each other and against
``"eager"``). Global layers, short inputs (``n <= 2 W``), continuations that
read earlier tokens from a KV cache (a first pass into an empty cache is banded),
and models on any other implementation are untouched.

skafa's own forward passes (extraction, the prompted judge, the cost
calibration) run inside it; wrap other code that shares the model object the
same way.
"""

from __future__ import annotations

import contextlib

__all__ = ["BANDED_SDPA", "banded_sdpa_attention_forward",
           "banded_sliding_window_attention", "has_sliding_window"]

#: Name under which the banded implementation is registered with transformers.
BANDED_SDPA = "skafa_banded_sdpa"

_REGISTERED = None  # None: not tried yet; True/False: whether registration worked


def has_sliding_window(model):
    """Whether any attention layer of the model attends within a sliding window.

    Parameters
    ----------
    model : transformers model
        Its ``config`` is read: ``layer_types`` where present (transformers 5),
        else ``sliding_window`` with ``use_sliding_window`` (older configs).

    Returns
    -------
    bool
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if not getattr(config, "sliding_window", None):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return "sliding_attention" in types
    return bool(getattr(config, "use_sliding_window", True))


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _blocked(mask):
    """Whether every entry of a (bool or additive float) mask slice is masked."""
    import torch

    if mask.numel() == 0:
        return True
    if mask.dtype == torch.bool:
        return not bool(mask.any())
    return bool((mask <= torch.finfo(mask.dtype).min).all())


def _band_chunks(mask, n_query, window):
    """``[(start, stop, first_key)]`` covering the queries, or ``None`` when the mask
    lets some query see a key outside ``first_key .. stop - 1``."""
    chunks = []
    for start in range(0, n_query, window):
        stop = min(n_query, start + window)
        first = max(0, start - window + 1)
        rows = mask[..., start:stop, :]
        if not (_blocked(rows[..., :first]) and _blocked(rows[..., stop:])):
            return None
        chunks.append((start, stop, first))
    return chunks


def banded_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``"sdpa"`` attention, on the band only for sliding-window layers.

    Same signature and result as
    ``transformers.integrations.sdpa_attention.sdpa_attention_forward``. A layer
    called with ``sliding_window=W``, a 4D mask covering all of ``key`` and more
    than ``2 W`` queries runs chunk by chunk: queries ``s .. s+W-1`` against keys
    ``max(0, s-W+1) .. s+W-1``, after checking on the mask that no other key is
    visible to those queries. Any other call is passed to ``sdpa`` unchanged.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (``num_key_value_groups``, ``is_causal`` are read).
    query, key, value : torch.Tensor of shape (batch, heads, seq, head_dim)
    attention_mask : torch.Tensor of shape (batch, 1 or heads, n_query, n_key) or None
        transformers' mask: bool (True attends) or additive float.
    **kwargs
        Passed to ``sdpa`` (``scaling``, ``dropout``, ``sliding_window``, ...).

    Returns
    -------
    attn_output : torch.Tensor of shape (batch, n_query, heads, head_dim)
    attn_weights : None
    """
    import torch

    sdpa = _sdpa()
    window = kwargs.get("sliding_window")
    n_query = query.shape[2]
    if (not window or attention_mask is None or attention_mask.ndim != 4
            or n_query <= 2 * int(window) or attention_mask.shape[-2] != n_query
            or attention_mask.shape[-1] != key.shape[2] or key.shape[2] != n_query):
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    chunks = _band_chunks(attention_mask, n_query, int(window))
    if chunks is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for start, stop, first in chunks:
        out, _ = sdpa(module, query[:, :, start:stop], key[:, :, first:stop],
                      value[:, :, first:stop], attention_mask[..., start:stop, first:stop],
                      **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _register():
    """Register :data:`BANDED_SDPA` with transformers once; whether it is available."""
    global _REGISTERED
    if _REGISTERED is None:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        except ImportError:  # transformers without pluggable attention and masks
            _REGISTERED = False
        else:
            AttentionInterface.register(BANDED_SDPA, banded_sdpa_attention_forward)
            AttentionMaskInterface.register(BANDED_SDPA, sdpa_mask)
            _REGISTERED = True
    return _REGISTERED


def _configs(model):
    """Distinct config objects of ``model`` and its submodules."""
    seen = {}
    modules = model.modules() if hasattr(model, "modules") else [model]
    for module in modules:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextlib.contextmanager
def banded_sliding_window_attention(model):
    """Run ``model``'s sliding-window ``"sdpa"`` layers on their band only.

    Inside the block, every config of ``model`` whose attention implementation is
    ``"sdpa"`` names :data:`BANDED_SDPA` instead (see
    :func:`banded_sdpa_attention_forward`); on exit the previous names come back.
    A model without sliding-window layers, on another implementation, or a
    transformers version without pluggable attention is left as it is. Not
    re-entrant across threads: hold the model's lock around it, as skafa does.

    Parameters
    ----------
    model : transformers model

    Yields
    ------
    bool
        Whether the banded implementation is in use.

    Examples
    --------
    >>> from skafa.llm import banded_sliding_window_attention
    >>> with banded_sliding_window_attention(model) as banded:  # doctest: +SKIP
    ...     out = model(input_ids=ids, use_cache=False)
    """
    changed, active = [], False
    if has_sliding_window(model) and _register():
        for config in _configs(model):
            if config._attn_implementation == "sdpa":
                changed.append(config)
            active = active or config._attn_implementation == BANDED_SDPA
    try:
        for config in changed:
            config._attn_implementation = BANDED_SDPA
        yield bool(changed) or active
    finally:
        for config in changed:
            config._attn_implementation = "sdpa"
