"""Length batching: which prompts share one padded forward pass.

Prompts are taken in decreasing length (ties by index), so a batch pads little; a
fixed ``batch_size`` cuts that order into equal batches, ``"auto"`` fills each batch
while its estimated activation memory fits a fraction of the device's free memory.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numbers
import os

from ._bf16 import uses_bf16_matmul_via_float32

__all__ = ["SequenceTooLarge", "length_batches"]


class SequenceTooLarge(MemoryError):
    """One sequence alone does not fit the device memory (``index`` says which)."""

    def __init__(self, index, message):
        super().__init__(message)
        self.index = index


def _free_memory(device):
    """Bytes free for activations on ``device``: CUDA free memory, else MemAvailable."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _activation_bytes(layout):
    """``(per_token, per_token_squared)`` bytes a forward pass holds at its peak.

    A deliberately generous estimate of the live tensors inside one decoder layer
    (inference mode frees the previous layer's): residual stream, normed input,
    q/k/v, attention output and the MLP's gate/up/product (``6 d + 4 i`` values
    per token, in the compute dtype), plus the float32 gather buffer; and per
    token *pair* the attention mask, and with eager attention the float32
    scores and probabilities of every head.
    """
    decoder = layout.decoder
    config = getattr(decoder, "config", None)
    weight = layout.embedding.weight
    d = int(weight.shape[-1])
    inter = int(getattr(config, "intermediate_size", None) or 4 * d)
    heads = int(getattr(config, "num_attention_heads", None) or 1)
    size = weight.element_size()
    if uses_bf16_matmul_via_float32(decoder):  # products made in float32, then rounded
        size = max(size, 4)
    per_token = size * (6 * d + 4 * inter) + 4 * d
    attn = getattr(config, "_attn_implementation", "eager") or "eager"
    per_pair = size + (8 * heads if attn == "eager" else 0)
    return per_token, per_pair


def _length_order(lengths):
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def length_batches(lengths, batch_size, *, layout=None, device=None, fraction=0.8):
    """Cut prompts into batches, longest first.

    Parameters
    ----------
    lengths : sequence of int
        Tokens of each prompt.
    batch_size : int >= 1 or "auto"
        Prompts per batch; ``"auto"``: as many as fit ``fraction`` of the free memory
        of ``device`` (a batch of ``b`` prompts padded to ``w`` tokens is estimated to
        need ``b * (w * per_token + w**2 * per_pair)`` bytes for the decoder
        ``layout``).
    layout : DecoderLayout, optional
        The model's decoder (:func:`skafa.llm.decoder_layout`); required for ``"auto"``.
    device : str or torch.device, optional
        Where the forward pass runs; default the device of ``layout``'s embedding.
    fraction : float, default=0.8
        Share of the free memory ``"auto"`` may fill.

    Returns
    -------
    batches : list of list of int
        Indices into ``lengths``; every index once, in decreasing length.

    Raises
    ------
    SequenceTooLarge
        With ``"auto"``, when one prompt alone is estimated not to fit.
    """
    lengths = [int(n) for n in lengths]
    if batch_size != "auto":
        if (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
                or batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1 or 'auto', got {batch_size!r}.")
        order = _length_order(lengths)
        return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    if layout is None:
        raise ValueError("batch_size='auto' needs the decoder layout (skafa.llm.decoder_layout).")
    if device is None:
        device = layout.embedding.weight.device
    per_token, per_pair = _activation_bytes(layout)
    budget = fraction * _free_memory(device)
    batches = []
    for i in _length_order(lengths):
        need = lengths[i] * per_token + lengths[i] ** 2 * per_pair
        if need > budget:
            raise SequenceTooLarge(i, (
                f"sequence {i} ({lengths[i]} tokens) needs about {need / 2**30:.2f} GiB of "
                f"activation memory, but only {budget / 2**30:.2f} GiB ({fraction:.0%} of the "
                f"free memory) is available on {device}. Shorten the prompt "
                "(PromptTemplate(max_prompt_tokens=...)), use dtype='bfloat16', free memory, "
                "or extract on another device."))
        if batches:
            width = lengths[batches[-1][0]]
            if (len(batches[-1]) + 1) * (width * per_token + width ** 2 * per_pair) <= budget:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches
