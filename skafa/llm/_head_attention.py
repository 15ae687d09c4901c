"""Per-head attention probabilities for a few query rows, in the ordinary forward pass.

A judge writes its answer at the last tokens of a prompt; *where* each head looks
from there is one row of that head's attention matrix. transformers hands those
rows out only through ``output_attentions=True``, which needs the ``"eager"``
implementation and materialises every layer's full ``(heads, n, n)`` matrix.
:func:`head_attention_rows` computes the rows it is asked for and nothing else:
for the duration of a ``with`` block every decoder attention layer runs a
registered attention function that calls the implementation the model uses
(``"sdpa"``, ``"eager"``, skafa's banded sliding-window kernel) for its output,
then, for the selected query positions only,

    ``softmax(softcap(q_rows . K^T * scaling) + mask_rows)``

per head, in float32 (grouped-query attention: each query head against its key
head, without copying the keys; sliding-window layers: the mask rows carry the
window, or, when transformers skipped the mask, the causal rows are built from
positions with the layer's ``sliding_window``; Gemma-2 logit soft-capping when the
layer passes ``softcap``). That is ``n_rows x n_keys`` per head, never ``n x n``.

With ``override`` the block also *writes*: for chosen ``(layer, head)`` pairs the
attention probabilities at the selected rows are replaced by given ones, and the
layer's output at those rows and heads is recomputed as ``weights @ V`` (before
the output projection). Everything else is the implementation's own output, so
without an override the forward pass is the plain one.

Restores every changed attention implementation on exit, exceptions included.
Not re-entrant across threads for one model: hold the model's lock around it,
as skafa's own passes do.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import contextlib
import numbers
import sys
from collections.abc import Mapping

import numpy as np

__all__ = ["HEAD_ROWS_PREFIX", "HeadAttentionRows", "head_attention_rows",
           "turn_attention_mass"]

#: Prefix of the names under which the recording wrappers are registered with
#: transformers (one per wrapped implementation: ``"skafa_head_rows|sdpa"``, ...).
HEAD_ROWS_PREFIX = "skafa_head_rows|"

_REGISTERED = {}   # wrapped implementation name -> registered name
_ACTIVE = {}       # id(config) -> _Recorder


class HeadAttentionRows:
    """What :func:`head_attention_rows` yields: the recorded attention rows.

    Attributes
    ----------
    weights : dict of int to torch.Tensor
        Layer index -> float32 tensor of shape ``(batch, n_heads, n_queries,
        n_keys)`` on the CPU, detached: the model's own attention probabilities
        of every head at the selected query positions (before any override), from
        the latest forward pass through that layer inside the block.
    positions : dict of int to tuple of int
        Layer index -> the non-negative query positions of those rows in that
        pass (negative positions resolved against its query length).
    n_layers : int
        Number of decoder layers of the model.
    n_heads : int
        Attention (query) heads per layer.
    query_positions : tuple of int
        The positions as given.
    """

    def __init__(self, n_layers, n_heads, query_positions):
        self.weights = {}
        self.positions = {}
        self.n_layers = int(n_layers)
        self.n_heads = int(n_heads)
        self.query_positions = tuple(query_positions)

    def stacked(self):
        """All layers as one array.

        Returns
        -------
        weights : numpy.ndarray of float32, shape (n_layers, batch, n_heads, n_queries, n_keys)

        Raises
        ------
        ValueError
            If some layer recorded nothing (no forward pass ran through it, or the
            pass stopped early) or the layers disagree on the shape.
        """
        missing = [layer for layer in range(self.n_layers) if layer not in self.weights]
        if missing:
            raise ValueError(f"no attention rows were recorded for layer(s) {missing}: "
                             "run a full forward pass inside the block.")
        shapes = {tuple(self.weights[layer].shape) for layer in range(self.n_layers)}
        if len(shapes) != 1:
            raise ValueError(f"the layers recorded different shapes {sorted(shapes)}.")
        return np.stack([self.weights[layer].numpy() for layer in range(self.n_layers)])

    def __repr__(self):
        return (f"HeadAttentionRows(n_layers={self.n_layers}, n_heads={self.n_heads}, "
                f"query_positions={self.query_positions}, recorded={sorted(self.weights)})")


class _Recorder:
    def __init__(self, rows, positions, override):
        self.rows = rows
        self.positions = positions
        self.override = override  # layer -> {head: tensor (batch or 1, n_q, n_keys)}


def _text_config(model):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def _check_positions(query_positions):
    try:
        positions = [p for p in np.atleast_1d(np.asarray(query_positions)).ravel()]
    except Exception as exc:  # noqa: BLE001 - reported as a ValueError
        raise ValueError(f"query_positions must be a list of int, got {query_positions!r}."
                         ) from exc
    if not positions:
        raise ValueError("query_positions is empty: give at least one token position.")
    out = []
    for p in positions:
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Integral):
            raise ValueError(f"query_positions must hold ints, got {p!r}.")
        out.append(int(p))
    return tuple(out)


def _check_override(override, n_layers, n_heads, n_queries):
    import torch

    if override is None:
        return {}
    if not isinstance(override, Mapping):
        raise TypeError("override must be a mapping {(layer, head): weights}, got "
                        f"{type(override).__name__}.")
    by_layer = {}
    for key, value in override.items():
        if (not isinstance(key, tuple) or len(key) != 2
                or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool)
                           for k in key)):
            raise ValueError(f"override keys are (layer, head) pairs of ints, got {key!r}.")
        layer, head = int(key[0]), int(key[1])
        if not 0 <= layer < n_layers:
            raise ValueError(f"override {key!r}: layer {layer} out of range 0..{n_layers - 1}.")
        if not 0 <= head < n_heads:
            raise ValueError(f"override {key!r}: head {head} out of range 0..{n_heads - 1}.")
        weights = torch.as_tensor(np.asarray(value) if not torch.is_tensor(value) else value)
        if not torch.is_floating_point(weights):
            weights = weights.to(torch.float32)
        if weights.ndim == 2:
            weights = weights[None]
        if weights.ndim != 3 or weights.shape[1] != n_queries:
            raise ValueError(
                f"override {key!r}: weights must have shape (batch, {n_queries}, n_keys) or "
                f"({n_queries}, n_keys) for {n_queries} query position(s), got "
                f"{tuple(torch.as_tensor(value).shape)}.")
        if not bool(torch.isfinite(weights).all()):
            raise ValueError(f"override {key!r}: weights hold NaN or infinite values.")
        by_layer.setdefault(layer, {})[head] = weights.detach()
    return by_layer


def _resolve_rows(positions, n_query, n_key, layer):
    """Non-negative query indices of this call, or ``None`` to skip it."""
    resolved = [p + n_query if p < 0 else p for p in positions]
    if all(0 <= p < n_query for p in resolved):
        return resolved
    if n_key > n_query:  # a continuation from a KV cache (e.g. a decoding step)
        return None
    raise ValueError(
        f"query_positions {list(positions)} out of range for layer {layer}'s "
        f"{n_query} query token(s).")


def _mask_rows(module, attention_mask, rows, n_query, n_key, device, kwargs):
    """Additive float32 mask of shape (batch or 1, heads or 1, n_rows, n_key)."""
    import torch

    index = torch.as_tensor(rows, device=device)
    if attention_mask is not None and attention_mask.ndim == 4:
        mask = attention_mask[..., :n_key].index_select(-2, index.to(attention_mask.device))
        if mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=torch.float32, device=mask.device)
            neg = torch.full((), torch.finfo(torch.float32).min, device=mask.device)
            return torch.where(mask, zero, neg)
        return mask.to(torch.float32)
    if attention_mask is not None:
        raise ValueError(
            f"head_attention_rows: layer {getattr(module, 'layer_idx', '?')} got a "
            f"{attention_mask.ndim}-D attention mask; only 4-D masks (sdpa, eager) or none "
            "are supported (use attn_implementation='sdpa' or 'eager').")
    # transformers skipped the mask (causal, no padding): build the rows from positions.
    query_pos = index + (n_key - n_query)
    keys = torch.arange(n_key, device=device)
    allowed = torch.ones((len(rows), n_key), dtype=torch.bool, device=device)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if causal and n_query > 1:
        allowed &= keys[None, :] <= query_pos[:, None]
    window = kwargs.get("sliding_window")
    if window:
        allowed &= keys[None, :] > query_pos[:, None] - int(window)
    neg = torch.finfo(torch.float32).min
    return torch.where(allowed, 0.0, neg).to(torch.float32)[None, None]


def _row_probabilities(module, query, key, attention_mask, rows, kwargs):
    """float32 ``(batch, heads, n_rows, n_key)`` attention probabilities at ``rows``."""
    import torch

    if kwargs.get("s_aux") is not None:
        raise ValueError("head_attention_rows: attention sinks (s_aux) are not supported.")
    batch, n_heads, n_query, head_dim = query.shape
    n_kv, n_key = key.shape[1], key.shape[2]
    if n_heads % n_kv:
        raise ValueError(f"head_attention_rows: {n_heads} query heads are not a multiple "
                         f"of {n_kv} key heads.")
    groups = n_heads // n_kv
    index = torch.as_tensor(rows, device=query.device)
    q = query.index_select(2, index).to(torch.float32)             # (b, h, r, d)
    q = q.reshape(batch, n_kv, groups * len(rows), head_dim)      # grouped by key head
    scores = torch.matmul(q, key.to(torch.float32).transpose(-1, -2))  # (b, kv, g*r, n)
    scores = scores.reshape(batch, n_heads, len(rows), n_key)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", head_dim ** -0.5)
    scores = scores * float(scaling)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        scores = torch.tanh(scores / float(softcap)) * float(softcap)
    mask = _mask_rows(module, attention_mask, rows, n_query, n_key, query.device, kwargs)
    scores = scores + mask.to(scores.device)
    return torch.softmax(scores, dim=-1)


def _apply_override(module, attn_output, value, rows, heads, layer):
    """``attn_output`` (batch, n_query, heads, d) with ``heads``' rows set to ``w @ V``."""
    import torch

    batch, n_kv, n_key = value.shape[0], value.shape[1], value.shape[2]
    n_heads = attn_output.shape[2]
    groups = n_heads // n_kv
    out = attn_output.clone()
    index = torch.as_tensor(rows, device=attn_output.device)
    for head, weights in heads.items():
        if weights.shape[-1] != n_key:
            raise ValueError(
                f"override ({layer}, {head}): weights cover {weights.shape[-1]} keys but the "
                f"layer attends to {n_key}.")
        if weights.shape[0] not in (1, batch):
            raise ValueError(
                f"override ({layer}, {head}): weights have batch {weights.shape[0]}, the "
                f"input has {batch}.")
        w = weights.to(device=value.device, dtype=torch.float32).expand(batch, -1, -1)
        v = value[:, head // groups].to(torch.float32)                # (b, n_key, d)
        new = torch.matmul(w, v).to(out.dtype)                         # (b, r, d)
        out[:, index, head, :] = new
    return out


def _inner_function(implementation, module):
    """The attention function ``implementation`` names, for ``module``."""
    if implementation == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward",
                        None)
        if eager is None:
            raise ValueError(
                f"head_attention_rows: cannot find the eager attention of "
                f"{type(module).__name__}; use attn_implementation='sdpa'.")
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]


def _make_forward(implementation):
    def forward(module, query, key, value, attention_mask, **kwargs):
        inner = _inner_function(implementation, module)
        attn_output, attn_weights = inner(module, query, key, value, attention_mask, **kwargs)
        recorder = _ACTIVE.get(id(getattr(module, "config", None)))
        layer = getattr(module, "layer_idx", None)
        if recorder is None or layer is None:
            return attn_output, attn_weights
        rows = _resolve_rows(recorder.positions, query.shape[2], key.shape[2], layer)
        if rows is None:
            return attn_output, attn_weights
        probs = _row_probabilities(module, query, key, attention_mask, rows, kwargs)
        recorder.rows.weights[int(layer)] = probs.detach().to("cpu", copy=True)
        recorder.rows.positions[int(layer)] = tuple(rows)
        heads = recorder.override.get(int(layer))
        if heads:
            attn_output = _apply_override(module, attn_output, value, rows, heads, layer)
        return attn_output, attn_weights

    forward.__name__ = f"head_rows_{implementation}_attention_forward"
    forward.__doc__ = (f"``{implementation!r}`` attention that also records the selected "
                       "rows' probabilities (see :func:`head_attention_rows`).")
    return forward


def _register(implementation):
    """Register the recording wrapper of ``implementation``; its registered name."""
    name = _REGISTERED.get(implementation)
    if name is not None:
        return name
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as exc:
        raise RuntimeError("head_attention_rows needs a transformers version with pluggable "
                           "attention (AttentionInterface), 4.48 or later.") from exc
    if implementation != "eager" and implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"head_attention_rows: unknown attention implementation "
                         f"{implementation!r}.")
    if implementation.startswith(("flash", "flex", "paged")):
        raise ValueError(
            f"head_attention_rows: attention implementation {implementation!r} is not "
            "supported (its masks are not 4-D); load the model with "
            "attn_implementation='sdpa' or 'eager'.")
    try:
        mask_function = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    except KeyError:  # e.g. skafa's banded kernel: sdpa masks
        from transformers.masking_utils import sdpa_mask

        mask_function = sdpa_mask
    name = HEAD_ROWS_PREFIX + implementation
    AttentionInterface.register(name, _make_forward(implementation))
    AttentionMaskInterface.register(name, mask_function)
    _REGISTERED[implementation] = name
    return name


def _attention_configs(model):
    """Distinct configs of the decoder attention modules (those with a ``layer_idx``)."""
    seen = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if (config is not None and hasattr(config, "_attn_implementation")
                and hasattr(module, "layer_idx") and hasattr(module, "o_proj")):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextlib.contextmanager
def head_attention_rows(model, query_positions, *, override=None):
    """Record every head's attention at chosen query rows, in the ordinary forward pass.

    Within the block, every decoder attention layer records, for the given query
    positions, the attention probabilities of each head over all keys; the rows
    are computed on their own (``n_rows x n_keys`` per head), never by
    materialising the ``(n, n)`` matrix, whatever implementation the model runs
    (``"sdpa"``, ``"eager"``, the banded sliding-window kernel).

    Parameters
    ----------
    model : transformers model
        A decoder-only causal LM or its base decoder, on ``"sdpa"`` or ``"eager"``
        attention (or :data:`skafa.llm.BANDED_SDPA`).
    query_positions : sequence of int
        Token positions of the query rows, the same for every batch row; negative
        positions count from the end (``-1`` is the last token). In a continuation
        from a KV cache (e.g. a decoding step) they are resolved against that call's
        query tokens, and a call where they fall outside is not recorded.
    override : mapping or None, default=None
        ``{(layer, head): weights}`` with weights of shape ``(batch, n_queries,
        n_keys)`` or ``(n_queries, n_keys)`` (tensor or array, rows in the order of
        ``query_positions``): attention probabilities that replace those heads'
        probabilities at those query rows. The layer's output at those rows for
        those heads is recomputed as ``weights @ V`` (before ``o_proj``); every
        other row and head is unchanged. The recorded weights stay the model's own.
        ``None``: the model's output equals the plain forward pass (to float
        tolerance).

    Yields
    ------
    rows : HeadAttentionRows
        ``rows.weights[layer]``: float32 ``(batch, n_heads, n_queries, n_keys)``
        on the CPU, filled as the forward pass runs; ``rows.n_layers``,
        ``rows.n_heads``.

    Raises
    ------
    ValueError
        For empty or non-integer positions, positions out of range of a fresh
        forward pass, a malformed override, an unsupported attention
        implementation (flash, flex, paged) or attention sinks.

    Notes
    -----
    The probabilities are ``softmax(q . K^T * scaling + mask)`` in float32 with
    the layer's own ``scaling``, mask rows (sliding windows included) and logit
    soft-capping (``softcap``, Gemma-2); in float32 models they equal the eager
    implementation's to rounding. On exit the previous attention implementation
    names come back, also after an exception. Not re-entrant across threads for one
    model.

    Examples
    --------
    >>> from skafa.llm import head_attention_rows, turn_attention_mass
    >>> with head_attention_rows(model, [-1]) as rows:  # doctest: +SKIP
    ...     model(input_ids=ids, use_cache=False)
    >>> mass = turn_attention_mass(rows.weights[0][0, :, 0], [(0, 5), (5, 9)])  # doctest: +SKIP
    """
    positions = _check_positions(query_positions)
    config = _text_config(model)
    n_layers = int(getattr(config, "num_hidden_layers"))
    n_heads = int(getattr(config, "num_attention_heads"))
    by_layer = _check_override(override, n_layers, n_heads, len(positions))
    configs = _attention_configs(model)
    if not configs:
        raise ValueError(f"head_attention_rows: {type(model).__name__} has no decoder "
                         "attention module (with layer_idx and o_proj).")
    for cfg in configs:
        if id(cfg) in _ACTIVE:
            raise RuntimeError("head_attention_rows is already active on this model; "
                               "blocks do not nest.")
    rows = HeadAttentionRows(n_layers, n_heads, positions)
    recorder = _Recorder(rows, positions, by_layer)
    previous = [(cfg, cfg._attn_implementation) for cfg in configs]
    names = [_register(impl or "eager") for _, impl in previous]
    try:
        for (cfg, _), name in zip(previous, names):
            cfg._attn_implementation = name
            _ACTIVE[id(cfg)] = recorder
        yield rows
    finally:
        for cfg, impl in previous:
            cfg._attn_implementation = impl
            _ACTIVE.pop(id(cfg), None)


def turn_attention_mass(weights, spans):
    """Attention mass on each turn's tokens.

    Parameters
    ----------
    weights : torch.Tensor or array-like of shape (..., n_keys)
        Attention probabilities over the keys (e.g. ``rows.weights[layer]``).
    spans : sequence of (int, int)
        ``(start, stop)`` token range of each turn (``stop`` exclusive), within
        ``0 .. n_keys``.

    Returns
    -------
    mass : numpy.ndarray of float64, shape (..., n_turns)
        The summed probability on each span.

    Raises
    ------
    ValueError
        For a span outside ``0 .. n_keys`` or with ``stop < start``.

    Examples
    --------
    >>> import numpy as np
    >>> turn_attention_mass(np.array([0.1, 0.2, 0.3, 0.4]), [(0, 2), (2, 4)])
    array([0.3, 0.7])
    """
    try:
        import torch

        if torch.is_tensor(weights):
            weights = weights.detach().to("cpu", torch.float64).numpy()
    except ImportError:  # pragma: no cover - numpy input without torch
        pass
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim < 1:
        raise ValueError("weights must have a key axis (shape (..., n_keys)).")
    n_keys = weights.shape[-1]
    spans = [tuple(span) for span in spans]
    starts, stops = [], []
    for i, span in enumerate(spans):
        if len(span) != 2:
            raise ValueError(f"span {i} must be (start, stop), got {span!r}.")
        start, stop = int(span[0]), int(span[1])
        if not 0 <= start <= stop <= n_keys:
            raise ValueError(f"span {i} ({start}, {stop}) is outside the {n_keys} keys "
                             "or has stop < start.")
        starts.append(start)
        stops.append(stop)
    cumulative = np.concatenate([np.zeros(weights.shape[:-1] + (1,)),
                                 np.cumsum(weights, axis=-1)], axis=-1)
    if not spans:
        return np.zeros(weights.shape[:-1] + (0,))
    return cumulative[..., stops] - cumulative[..., starts]
