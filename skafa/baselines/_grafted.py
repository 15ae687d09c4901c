"""Grafted judge: route what locator heads found into the heads that write the answer.

The prompted judge (:class:`~skafa.baselines.PromptedJudge`) often answers wrong
although the decisive step is linearly decodable from the same model's
activations: the model "knows but won't say". One mechanistic reading of that gap
splits the attention heads at the position where the answer is written into

*locators*
    heads whose attention, from the answer position, concentrates on the
    decisive turn: ranked by their mean attention mass on the true decisive turn
    over the training conversations;
*writers*
    heads whose output pushes the answer's step-number token up: ranked by their
    *direct effect* on the logits of the candidate step tokens at the answer
    position (the head's output slice through ``o_proj``, then the final norm
    taken as a fixed per-position scale, then the unembedding), as the contrast
    between the true step's token and the other candidate steps' tokens;

and *grafts* them at inference time: the writers' attention at the answer
position is replaced by the mean attention of the locators (or a ``mix`` of both),
so the writers read the turn the locators point at. :class:`GraftedJudge` ranks
the heads in ``fit``, picks how many locators and writers to use on inner folds,
and scores the candidate step tokens exactly as the prompted judge does, with the
graft active during the prompt's forward pass.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from sklearn.model_selection import GroupKFold, KFold
from sklearn.utils import Bunch

from ..llm import (
    banded_sliding_window_attention,
    conversation_content,
    decoder_layout,
    forward_flops,
    has_sliding_window,
    head_attention_rows,
    turn_attention_mass,
)
from ..model_selection import ResultStoreError, grouped_splits, read_json, write_json
from ..utils.claims import create_claim, wait_while_claimed
from ..utils.progress import log
from ..utils.signals import raise_if_stop_requested, stop_requests
from ..utils.sklearn_compat import Interval, fit_context
from ..utils.validation import group_labels
from ._judge import (
    _output_cache,
    _score_packed,
    _StepJudge,
    packed_queries,
    score_candidates,
)

__all__ = ["GraftedJudge", "grafted_split_predictions", "head_direct_effects",
           "recheck_graft_store"]


# ----------------------------------------------------------------------------- helpers
def _check_grid(value, name):
    """A non-empty tuple of distinct non-negative ints."""
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of non-negative ints, got "
                         f"{value!r}.") from None
    if not items:
        raise ValueError(f"{name} is empty: give at least one number of heads.")
    out = []
    for v in items:
        if (isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral)
                or int(v) < 0):
            raise ValueError(f"{name} must hold non-negative ints, got {v!r}.")
        if int(v) not in out:
            out.append(int(v))
    return tuple(out)


def _linear_norm(norm, c, ref):
    """``norm`` applied to ``c`` as a linear map: ``ref``'s scale instead of ``c``'s own.

    An RMS norm computes ``w * x / rms(x)``; with the scale of the residual
    ``ref`` that actually passed through it held fixed, a component ``c`` of that
    residual contributes ``w * c / rms(ref)``. Computed through the module itself
    (``norm(c) * rms(c) / rms(ref)``, both with its epsilon), so Gemma's
    ``1 + w`` weights are handled alike.
    """
    import torch

    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    c = c.float()
    rms_c = torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    rms_ref = torch.sqrt(ref.float().pow(2).mean() + eps)
    return norm(c).float() * (rms_c / rms_ref)


class _DirectCapture:
    """Hooks keeping, at query ``row`` of each call, what direct effects need."""

    def __init__(self, layout, active, row=-1):
        self.layout, self.active, self.row = layout, active, row
        self.captured, self.handles = {}, []

    def __enter__(self):
        if not self.active:
            return self

        def keep(key):
            def hook(module, args, output=None):
                value = args[0] if output is None else output
                self.captured[key] = value[0, self.row].detach().float()
            return hook

        for layer_index, layer in enumerate(self.layout.layers):
            o_proj = layer.self_attn.o_proj
            self.handles.append(o_proj.register_forward_pre_hook(keep(("z", layer_index))))
            self.handles.append(o_proj.register_forward_hook(keep(("o", layer_index))))
        self.handles.append(self.layout.final_norm.register_forward_pre_hook(keep(("x", None))))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return False


def _answer_pass(lm, prefix, *, direct_tokens=None):
    """One clean forward pass over ``prefix``; attention rows at its last token.

    Returns ``(rows, direct)``: ``rows`` float32 ``(n_layers, n_heads, n_keys)``,
    every head's attention from the last token; ``direct`` float32
    ``(n_layers, n_heads, len(direct_tokens))``, every head's direct effect on
    those tokens' logits there (``None`` without ``direct_tokens``).
    """
    import torch

    layout = decoder_layout(lm)
    device = layout.embedding.weight.device
    ids = torch.as_tensor(np.asarray(prefix, dtype=np.int64)[None], device=device)
    with _DirectCapture(layout, direct_tokens is not None) as capture, \
            torch.inference_mode(), banded_sliding_window_attention(lm), \
            head_attention_rows(lm, [ids.shape[1] - 1]) as recorded:
        lm(input_ids=ids, use_cache=False, logits_to_keep=1)
    rows = recorded.stacked()[:, 0, :, 0, :]
    if direct_tokens is None:
        return rows, None
    with torch.inference_mode():
        direct = _direct_from_captured(lm, layout, capture.captured, direct_tokens)
    return rows, direct


def _rollback(cache, length):
    """Cut a KV cache back to its first ``length`` tokens, layer by layer.

    ``crop(-n)`` removes the last ``n`` tokens in transformers 4 (``max_length``
    below 0) and 5 (``tokens_to_remove``) alike. A pass that resumed at a later
    layer (:class:`_LayerResume`) appended to that layer and the ones above only,
    so a cache with per-layer entries is cut by each layer's own excess.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for index, layer in enumerate(layers):
            extra = int(cache.get_seq_length(index)) - length
            if extra > 0:
                layer.crop(-extra)
        held = sorted({int(cache.get_seq_length(index)) for index in range(len(layers))})
    else:
        now = int(cache.get_seq_length())
        if now > length:
            cache.crop(-(now - length))
        held = [int(cache.get_seq_length())]
    if held != [length]:
        raise RuntimeError(f"could not roll the KV cache back to {length} tokens "
                           f"(its layers hold {held}).")


class _LayerResume:
    """Run a packed pass from decoder layer ``first`` on, with the layers below it known.

    A graft at the answer position changes nothing below the lowest grafted
    layer: every earlier layer sees the same tokens, cache and mask as in the
    clean pass. So the clean pass keeps each layer's output
    (:meth:`keep`), and a grafted pass replaces layers ``0 .. first - 1`` by
    stand-ins returning layer ``first - 1``'s kept output (:meth:`resume`): the
    layers from ``first`` on compute exactly what the full pass computes, in
    the same order and shapes. Used only where a decoder layer returns a plain
    tensor and the cache has per-layer entries (transformers 5); elsewhere every
    layer runs.
    """

    def __init__(self, layout):
        self.layout = layout
        self.outputs = None  # the clean pass's layer outputs, or None

    @contextlib.contextmanager
    def keep(self):
        import torch

        outputs = [None] * len(self.layout.layers)

        def hook(index):
            def keep_output(module, args, output):
                outputs[index] = output.detach().clone() if torch.is_tensor(output) else None
            return keep_output

        handles = [layer.register_forward_hook(hook(i))
                   for i, layer in enumerate(self.layout.layers)]
        self.outputs = None
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        if all(o is not None for o in outputs):
            self.outputs = outputs

    def first_layer(self, override):
        """The layer a pass with ``override`` can start from (0: every layer runs)."""
        if not override or self.outputs is None:
            return 0
        return min(int(layer) for layer, _ in override)

    @contextlib.contextmanager
    def resume(self, first):
        if first <= 0:
            yield
            return
        hidden = self.outputs[first - 1].clone()

        def known(*args, **kwargs):
            return hidden

        saved = []
        try:
            for layer in self.layout.layers[:first]:
                saved.append((layer, layer.__dict__.get("forward")))
                layer.forward = known
            yield
        finally:
            for layer, previous in saved:
                if previous is None:
                    del layer.forward
                else:
                    layer.forward = previous


class _AnswerSession:
    """One judge prompt, read once, answered many times with different grafts.

    The forward pass over every prompt token but the last (the *answer position*)
    runs once and its KV cache is kept; each :meth:`step` then runs only the
    answer position (with an optional override of some heads' attention there)
    and the candidate step tokens, and rolls the cache back. Causal attention
    makes this exact: a graft at the answer position cannot change any earlier
    position. Models with sliding-window layers (whose caches cannot be rolled
    back) rerun the whole prompt at each step instead — the same numbers, slower.
    """

    def __init__(self, lm, prefix, continuations, number_mask, pad_id, cache=None):
        import torch

        self.lm, self.continuations = lm, continuations
        self.number_mask, self.pad_id = number_mask, pad_id
        self.prefix = np.asarray(prefix, dtype=np.int64)
        self.layout = decoder_layout(lm)
        self.device = self.layout.embedding.weight.device
        self.resume = _LayerResume(self.layout)
        self.cache = None
        if cache is not None:  # the prompt's KV cache, kept from an earlier read
            self.cache = cache
            self.base = int(cache.get_seq_length())
        elif not has_sliding_window(lm) and len(self.prefix) > 1:
            ids = torch.as_tensor(self.prefix[None, :-1], device=self.device)
            with torch.inference_mode():
                out = lm(input_ids=ids, use_cache=True, logits_to_keep=1)
            self.cache = _output_cache(out)
            self.base = int(self.cache.get_seq_length())

    def step(self, override=None, direct_tokens=None, rows=True):
        """Candidate scores with ``override`` active at the answer position.

        Returns ``(scores, rows, direct)``: float64 scores of the candidates,
        the model's own attention rows at the answer position (float32
        ``(n_layers, n_heads, n_keys)``) and the heads' direct effects on
        ``direct_tokens`` there (or ``None``). ``rows=False`` says the caller
        does not need the rows: a sliding-window model then skips the clean pass
        that would give them, and a grafted step after a clean one starts at the
        lowest grafted layer (:class:`_LayerResume`; the same scores bit for
        bit); its rows are then ``None``.
        """
        import torch

        if self.cache is None:
            return self._full_step(override, direct_tokens, rows)
        # one pass: the answer position (query 0) and the candidates packed behind it
        n = len(self.prefix)
        width = n + packed_queries([self.continuations], lead=True) - 1  # keys of the pass
        first = 0
        if not rows and direct_tokens is None and hasattr(self.cache, "layers"):
            first = self.resume.first_layer(override)
        if override:
            padded = {}
            for head, w in override.items():
                w = np.asarray(w, dtype=np.float32)
                padded[head] = np.concatenate(
                    [w, np.zeros(w.shape[:-1] + (width - w.shape[-1],), np.float32)], -1)
            override = padded
        mask2d = torch.ones((1, self.base), dtype=torch.long)
        layers = self.resume.keep() if not override else self.resume.resume(first)
        try:
            with _DirectCapture(self.layout, direct_tokens is not None, row=0) as capture, \
                    torch.inference_mode(), \
                    head_attention_rows(self.lm, [0], override=override) as recorded, layers:
                scores = _score_packed(self.lm, self.cache, None, mask2d, [self.base],
                                       [self.continuations], self.number_mask, self.pad_id,
                                       self.device, lead=[int(self.prefix[-1])])[0]
        finally:
            _rollback(self.cache, self.base)
        rows = None if first else recorded.stacked()[:, 0, :, 0, :n]
        direct = None
        if direct_tokens is not None:
            with torch.inference_mode():
                direct = _direct_from_captured(self.lm, self.layout, capture.captured,
                                               direct_tokens)
        return scores, rows, direct

    def _full_step(self, override, direct_tokens, need_rows):
        rows = direct = None
        if need_rows or direct_tokens is not None:  # a clean pass of its own
            rows, direct = _answer_pass(self.lm, self.prefix, direct_tokens=direct_tokens)
        context = None
        if override:
            def context(batch_rows, width):
                return head_attention_rows(self.lm, [width - 1], override=override)
        scores = score_candidates(self.lm, [self.prefix], [self.continuations],
                                  self.number_mask, pad_id=self.pad_id,
                                  prefix_context=context)[0]
        return scores, rows, direct


def _cache_tensors(cache):
    """``[(keys, values), ...]`` of a dynamic KV cache, one pair per layer."""
    if hasattr(cache, "layers"):  # transformers 5
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers 4


class _KVSpill:
    """Prompt KV caches kept on disk between the statistics and the graft pass.

    The statistics pass reads every prompt once; the graft pass needs each
    prompt's KV cache again, after the statistics of *all* conversations have
    chosen the heads. Keeping every cache in memory would cost about 46 KB per
    prompt token on SmolLM2 (15 GB for a Who&When subset), reading every prompt
    again costs a second forward pass. This keeps each cache in a safetensors file
    and restores it bit for bit; each file is deleted once its conversation's
    grafts are done.

    By default the files go to a private temporary folder under ``parent``
    (created by this object, removed by :meth:`close`); only files this object
    wrote are read, each checked against the layer count, shapes and dtypes it
    recorded. With ``resumable`` (a digest of the graft store's signature) and
    ``prompts`` (each conversation's prompt token ids), the folder is
    ``parent/skafa-grafted-kv-<digest>`` and outlives the call, so a run resumed
    after an interruption restores the caches an earlier run kept instead of
    reading those prompts again. Such a file may come from another process, so it
    is read only after a full check: its metadata names this store's digest, the
    conversation and the SHA-256 of its prompt's tokens; it holds exactly one key
    and one value tensor per layer, of the model's dtype, each shaped
    ``(1, n_kv_heads, n_tokens, head_dim)`` with ``n_kv_heads * head_dim`` the width
    of that layer's ``k_proj`` / ``v_proj`` and ``n_tokens`` the prompt length less the
    answer position; and the SHA-256 of
    its tensors' bytes matches the one it records. A file that fails any check is
    deleted and its prompt read again (counted in ``refused``, with a warning), unless
    a stop was requested (:func:`skafa.utils.signals.stop_requested`): a read that
    fails then may have been broken by the signal itself, so the file stays, nothing
    is counted and :class:`~skafa.utils.signals.StopRequested` is raised.
    """

    def __init__(self, parent, resumable=None, prompts=None):
        parent = Path(parent)
        parent.mkdir(parents=True, exist_ok=True)
        self.resumable = resumable
        self.prompts = prompts
        self.refused = 0
        if resumable is None:
            self.dir = Path(tempfile.mkdtemp(prefix="skafa-grafted-kv-", dir=parent))
        else:
            self.dir = parent / f"skafa-grafted-kv-{resumable[:16]}"
            if self.dir.is_symlink() or (self.dir.exists() and not self.dir.is_dir()):
                raise ValueError(f"{self.dir} is not a folder (a link or a file): the "
                                 "grafted judge keeps its KV caches only in a folder of its own.")
            self.dir.mkdir(exist_ok=True)
            self._remove_dead_partials()
        self.kept = {}  # i -> (path, [(shape, dtype) per tensor name])

    @staticmethod
    def _writer_tag(pid=None):
        """``<host digest>-<pid>-<start>``: names the process writing a partial file."""
        import socket

        from ..utils.claims import process_start

        pid = os.getpid() if pid is None else int(pid)
        host = hashlib.sha256(socket.gethostname().encode("utf-8")).hexdigest()[:8]
        return f"{host}-{pid}-{process_start(pid)}"

    def _remove_dead_partials(self):
        """Delete the half-written files of killed processes of this host.

        A file is written as ``.<i>.<writer>.partial`` and renamed when complete; a
        process killed meanwhile leaves it. One whose writer (host, pid and start
        time) is of this host and no longer runs is removed; others are left alone.
        """
        from ..utils.claims import process_start

        host, _, start = self._writer_tag().split("-")
        if start == "None":  # no /proc: liveness cannot be told
            return
        for path in self.dir.glob(".*.partial"):
            parts = path.name.split(".")
            writer = parts[2].split("-") if len(parts) == 4 else []
            if len(writer) != 3 or writer[0] != host or not writer[1].isdigit():
                continue
            if str(process_start(int(writer[1]))) != writer[2]:  # that process is gone
                path.unlink(missing_ok=True)

    def _prompt_digest(self, i):
        tokens = np.asarray(self.prompts[int(i)], dtype=np.int64)[:-1]
        return hashlib.sha256(tokens.astype("<i8").tobytes()).hexdigest()

    @staticmethod
    def _tensor_digest(tensors):
        import torch

        h = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy())  # no copy
        return h.hexdigest()

    def put(self, i, cache):
        from safetensors.torch import save_file

        tensors = {}
        for layer, (k, v) in enumerate(_cache_tensors(cache)):
            tensors[f"k{layer}"], tensors[f"v{layer}"] = k.contiguous(), v.contiguous()
        path = self.dir / f"{int(i)}.safetensors"
        metadata = None
        if self.resumable is not None:
            metadata = {"format": "skafa.grafted-kv", "version": "1",
                        "store": self.resumable, "conversation": str(int(i)),
                        "prompt_sha256": self._prompt_digest(i),
                        "sha256": self._tensor_digest(tensors)}
        partial = self.dir / f".{int(i)}.{self._writer_tag()}.partial"
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, path)  # another process never sees half a file
        self.kept[int(i)] = (path, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()})

    def holds(self, i):
        """Whether a cache of conversation ``i`` waits here (kept now or by an earlier run)."""
        return int(i) in self.kept or (self.resumable is not None and
                                       (self.dir / f"{int(i)}.safetensors").is_file())

    def take(self, i, lm):
        """The cache kept for conversation ``i`` (its file removed), or ``None``."""
        from safetensors.torch import load_file

        entry = self.kept.pop(int(i), None)
        if entry is None:
            if self.resumable is None:
                return None
            tensors = self._take_resumed(int(i), lm)
            if tensors is None:
                return None
            n_layers = len(tensors) // 2
        else:
            path, expected = entry
            if self.resumable is not None and not path.is_file():
                return None  # another process sharing the folder took it: read the prompt
            try:
                tensors = load_file(str(path))
            except BaseException as exc:
                if self.resumable is not None:  # an interrupt or a stop is no damage:
                    if not isinstance(exc, Exception):  # the file stays for the resumed run
                        raise
                    raise_if_stop_requested(f"reading the KV cache kept in {path}", cause=exc)
                path.unlink(missing_ok=True)
                raise
            path.unlink(missing_ok=True)
            got = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
            if got != expected:
                raise RuntimeError(f"the KV cache kept in {path} changed on disk (shapes or "
                                   "dtypes differ from what was written); rerun the call.")
            n_layers = len(expected) // 2
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=lm.config)
        except TypeError:  # transformers 4 takes no config
            cache = DynamicCache()
        device = decoder_layout(lm).embedding.weight.device
        for layer in range(n_layers):
            cache.update(tensors[f"k{layer}"].to(device), tensors[f"v{layer}"].to(device),
                         layer)
        return cache

    def _take_resumed(self, i, lm):
        """An earlier run's cache of conversation ``i``, fully checked, or ``None``."""
        from safetensors import safe_open

        path = self.dir / f"{i}.safetensors"
        if not os.path.lexists(path):
            return None
        tensors, why = None, "it is not a plain file (a link or a folder)"
        if not path.is_symlink() and path.is_file():
            try:
                got = self._check_resumed(i, path, lm, safe_open)
                tensors, why = (got, None) if isinstance(got, dict) else (None, got)
            except Exception as exc:  # unreadable: a damaged or foreign file
                # ...unless a stop request surfaced as this error: the file stays
                raise_if_stop_requested(f"reading the kept KV cache {path}", cause=exc)
                why = f"it is unreadable ({type(exc).__name__}: {exc})"
        if tensors is None:
            raise_if_stop_requested(f"checking the kept KV cache {path}")
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)  # a link itself, never what it names
        if tensors is None:
            self.refused += 1
            warnings.warn(f"KV cache {path} of conversation {i} refused: {why}; its prompt "
                          "is read again.", RuntimeWarning, stacklevel=3)
        return tensors

    def _check_resumed(self, i, path, lm, safe_open):
        layout = decoder_layout(lm)
        dtype = layout.embedding.weight.dtype
        n_tokens = len(self.prompts[i]) - 1
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            want = {"format": "skafa.grafted-kv", "version": "1", "store": self.resumable,
                    "conversation": str(i), "prompt_sha256": self._prompt_digest(i)}
            for key, value in want.items():
                if meta.get(key) != value:
                    return f"its metadata's {key!r} is {meta.get(key)!r}, not {value!r}"
            names = sorted(f.keys())
            expected = sorted(f"{kv}{layer}" for layer in range(layout.n_layers)
                              for kv in "kv")
            if names != expected:
                return (f"it holds {len(names)} tensors, not the key and value of each of "
                        f"{layout.n_layers} layers")
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                layer = layout.layers[int(name[1:])]
                width = getattr(getattr(layer.self_attn, f"{name[0]}_proj", None),
                                "out_features", None)
                if (len(shape) != 4 or shape[0] != 1 or shape[2] != n_tokens
                        or (width is not None and shape[1] * shape[3] != width)):
                    return (f"tensor {name} is shaped {shape}, not (1, heads, {n_tokens}, "
                            f"head_dim) with heads x head_dim = {width}")
            tensors = {name: f.get_tensor(name) for name in names}
        for name, t in tensors.items():
            if t.dtype != dtype:
                return f"tensor {name} is {t.dtype}, the model computes in {dtype}"
        if self._tensor_digest(tensors) != meta.get("sha256"):
            return "its tensors' SHA-256 differs from the one it records"
        return tensors

    def close(self):
        self.kept.clear()
        if self.resumable is None:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        for partial in self.dir.glob(f".*.{self._writer_tag()}.partial"):
            partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # only once every prompt's grafts are done


def _direct_from_captured(lm, layout, captured, tokens):
    import torch

    unembed = lm.get_output_embeddings().weight
    u = unembed[torch.as_tensor(list(tokens), device=unembed.device)].float()  # (T, hidden)
    x_final = captured[("x", None)]
    out = []
    for layer_index, layer in enumerate(layout.layers):
        o_proj = layer.self_attn.o_proj
        weight = o_proj.weight.float()                     # (hidden, n_heads * head_dim)
        z = captured[("z", layer_index)]                    # (n_heads * head_dim,)
        n_heads = int(lm.config.get_text_config().num_attention_heads)
        head_dim = weight.shape[1] // n_heads
        per_head = torch.einsum("ohd,hd->ho", weight.view(weight.shape[0], n_heads, head_dim),
                                z.view(n_heads, head_dim))  # (n_heads, hidden)
        if layout.family == "sandwich-norm":  # the attention output is normed before the add
            per_head = _linear_norm(layer.post_attention_layernorm, per_head,
                                    captured[("o", layer_index)])
        final = _linear_norm(layout.final_norm, per_head, x_final)
        out.append((final @ u.T).cpu().numpy())
    return np.stack(out).astype(np.float32)


def head_direct_effects(lm, prefix, tokens):
    """Direct effect of every attention head on some token logits at the last position.

    For head ``h`` of layer ``l``: its output at the last token of ``prefix``
    (its slice of ``o_proj``'s input times the matching columns of ``o_proj``;
    in sandwich-norm models, Gemma 2/3, through the post-attention norm at its
    actual scale), added to nothing else, through the final norm at the scale
    the final residual actually had, and the unembedding. Biases are left out
    (no head owns them); Gemma-2's final logit soft-capping is not applied.

    Parameters
    ----------
    lm : transformers causal LM
    prefix : sequence of int
        Token ids; the effect is read at the last one.
    tokens : sequence of int
        Vocabulary ids whose logits are read.

    Returns
    -------
    effects : ndarray of float32, shape (n_layers, n_heads, len(tokens))
    """
    return _answer_pass(lm, prefix, direct_tokens=list(tokens))[1]


def _rank(scores):
    """``(layer, head)`` pairs by decreasing score (ties: lower layer, then head)."""
    scores = np.asarray(scores, dtype=np.float64)
    order = np.argsort(-scores.ravel(), kind="stable")
    n_heads = scores.shape[1]
    return [(int(i // n_heads), int(i % n_heads)) for i in order]


def _mean_scores(stats, index):
    """Mean over the conversations ``index`` of per-conversation head scores (NaN-aware)."""
    block = stats[np.asarray(index)]
    with np.errstate(invalid="ignore"):
        counts = np.isfinite(block).sum(0)
        total = np.where(np.isfinite(block), block, 0.0).sum(0)
    return np.where(counts > 0, total / np.maximum(counts, 1), 0.0)


def _graft_rows(rows, locators, writers, mix):
    """The attention each writer gets at the answer position: ``{head: (n_keys,)}``."""
    if not locators or not writers:
        return {}
    located = np.mean([rows[layer, head] for layer, head in locators], axis=0)
    return {(layer, head): (mix * located + (1.0 - mix) * rows[layer, head]).astype(np.float32)
            for layer, head in writers}


def _active(config, mix):
    """Whether a ``(locators, writers)`` graft changes anything."""
    return bool(config[0] and config[1] and mix > 0)


def _pair_configs(locator_stats, writer_stats, index, pairs):
    """The graft of every ``(n_locators, n_writers)`` pair, heads ranked on ``index``."""
    n_loc = max(p[0] for p in pairs)
    n_wri = max(p[1] for p in pairs)
    locators = _rank(_mean_scores(locator_stats, index))[:n_loc]
    writers = _rank(_mean_scores(writer_stats, index))[:n_wri]
    return [(tuple(locators[:a]), tuple(writers[:b])) for a, b in pairs]


def _request(requests, index, configs):
    """Add ``configs`` to the grafts conversations ``index`` must be scored with."""
    for i in index:
        wanted = requests.setdefault(int(i), [])
        wanted.extend(c for c in configs if c not in wanted)


def _split_scores(scores, steps, splits, configs):
    """Step accuracy of every pair on every split: shape ``(n_pairs, n_splits)``."""
    out = np.zeros((len(configs[0]), len(splits)))
    for fold, ((_, test), pair_configs) in enumerate(zip(splits, configs)):
        for k, config in enumerate(pair_configs):
            out[k, fold] = np.mean([int(np.argmax(scores[int(i), config])) == int(steps[i])
                                    for i in test])
    return out


def _choose_pair(pairs, split_scores, splits):
    """The pair with the best pooled inner accuracy (ties: fewer heads, fewer locators)."""
    sizes = np.array([len(test) for _, test in splits], dtype=np.float64)
    mean = split_scores @ sizes / sizes.sum()
    best = max(range(len(pairs)), key=lambda k: (mean[k], -sum(pairs[k]), -pairs[k][0]))
    return best, mean


def _shared_order(items, store, phase, stored):
    """The items of a pass to compute here, in order, sharing the work through ``store``.

    ``stored(i)`` says (and takes up) what the store already holds, also what another
    process sharing the store finished meanwhile. Without a store every item is
    computed. With one, an item another process has claimed is deferred; once the
    others are done, each deferred item is waited for while a live process of this
    host holds its claim (computing it again here would only make this process
    start the next pass later), then computed here unless stored by then (a claim
    left by a killed process, or by another host, only delays its item). Each
    yielded item is claimed, and its claim released when the caller comes back (or
    stops).
    """
    deferred = []
    for i in items:
        if stored(i):
            continue
        if store is not None and not store.claim(phase, i):
            deferred.append(i)
            continue
        try:
            yield i
        finally:
            if store is not None:
                store.release(phase, i)
    for i in deferred:
        store.wait_for_claimant(phase, i, lambda: stored(i))
        if stored(i):
            continue
        try:
            yield i
        finally:
            store.release(phase, i)


@contextlib.contextmanager
def _folder_lock(folder):
    """Hold an exclusive ``flock`` on ``folder`` itself (no lock file is created).

    Serialises the read-merge-write of processes sharing a store in that folder, so
    one's write cannot replace another's between its read and its write. Where
    there is no ``flock`` (Windows) or the folder cannot be locked, nothing is held:
    a lost write then only makes a later run compute that entry again.
    """
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


class _GraftStore:
    """Head statistics and graft scores of :func:`grafted_split_predictions` on disk.

    One JSON file, rewritten atomically after every conversation, so a killed run
    resumes where it stopped and gives the same numbers (floats round-trip
    exactly). A file is read as untrusted: its ``signature`` (model, dtype,
    prompt, answer prefix, mix, the conversations' contents and labels) must equal
    this run's, and every entry is checked against the conversations (index
    range, head grid, number of candidates) before use.

    It also lists the torch thread counts it was written with (``threads``, outside
    the signature: files written before it existed have none). Floating-point sums
    depend on the thread count, so a write at a count not listed warns once: the
    store then mixes scores that a single run would give only in their last bits.
    """

    FORMAT = "skafa.grafted-split-store"
    VERSION = 1

    def __init__(self, path, signature, n_layers, n_heads, n_candidates):
        self.path = Path(path)
        self.signature = json.loads(json.dumps(signature, sort_keys=True, default=str))
        self.shape = (int(n_layers), int(n_heads))
        self.n_candidates = list(n_candidates)
        self.stats, self.scores, self.threads = {}, {}, set()
        self._warned = False
        self._seen = None  # the file as last read here (see _stat)
        if self.path.exists():
            seen = self._stat()
            self.stats, self.scores, self.threads = self._read(read_json(self.path))
            self._seen = seen

    def _stat(self):
        """``(inode, size, mtime_ns)`` of the file, or ``None`` when there is none.

        A write replaces the file (a new inode), so a file with the tuple last seen
        here holds nothing new.
        """
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def refresh(self):
        """Read the file again: what another process stored meanwhile is added.

        Entries this store holds are kept (for an entry both hold, computed with the
        same code, settings and thread count, the values are the same). A file
        unchanged since this store last read it is not read again.
        """
        seen = self._stat()
        if seen is not None and seen != self._seen:
            stats, scores, threads = self._read(read_json(self.path))
            self._seen = seen
            for key, value in stats.items():
                self.stats.setdefault(key, value)
            for key, value in scores.items():
                self.scores.setdefault(key, value)
            self.threads |= threads
        return self

    def _claim_path(self, phase, i):
        return self.path.with_name(f"{self.path.name}.{phase}-{int(i)}.claim")

    def claim(self, phase, i):
        """Mark conversation ``i`` of ``phase`` ("stats" or "grafts") as taken here.

        Advisory, as :meth:`skafa.llm.ActivationCache.claim`: a file
        ``<store>.<phase>-<i>.claim`` beside the store, created atomically. ``False``
        when another process holds it (the caller does other conversations first and
        comes back); ``True`` when the claim is this process's, or when it could not
        be written (nobody to share with, then).
        """
        return create_claim(self._claim_path(phase, i)) is not False

    def wait_for_claimant(self, phase, i, done):
        """Wait while a running process of this host holds the claim on ``i``.

        :func:`skafa.utils.claims.wait_while_claimed` on its claim file (read as
        untrusted; a stale claim, a reused pid or another host's claim: no wait);
        ``done()`` true ends the wait.
        """
        return wait_while_claimed(self._claim_path(phase, i), done)

    def release(self, phase, i):
        """Remove the claim on conversation ``i`` of ``phase``, whoever made it."""
        try:
            os.remove(self._claim_path(phase, i))
        except OSError:
            pass

    def _bad(self, what):
        raise ResultStoreError(f"{self.path}: {what}; remove the file (it was not written "
                               "by this run's settings or is damaged).")

    def _matrix(self, value, where, nan_ok):
        L, H = self.shape
        if (not isinstance(value, list) or len(value) != L
                or any(not isinstance(row, list) or len(row) != H for row in value)):
            self._bad(f"{where} is not a {L} x {H} list")
        out = np.empty((L, H), dtype=np.float64)
        for a, row in enumerate(value):
            for b, v in enumerate(row):
                if v is None and nan_ok:
                    out[a, b] = np.nan
                elif isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
                    out[a, b] = v
                else:
                    self._bad(f"{where}[{a}][{b}] is {v!r}, not a finite number")
        return out

    def _head(self, value, where):
        L, H = self.shape
        if (not isinstance(value, list) or len(value) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
                or not (0 <= value[0] < L and 0 <= value[1] < H)):
            self._bad(f"{where} is {value!r}, not a head [layer, head] of the {L} x {H} grid")
        return (int(value[0]), int(value[1]))

    def _read(self, data):
        if not isinstance(data, dict) or data.get("format") != self.FORMAT:
            self._bad(f"not a {self.FORMAT} file")
        if data.get("version") != self.VERSION:
            self._bad(f"version {data.get('version')!r}, this skafa writes {self.VERSION}")
        if data.get("signature") != self.signature:
            self._bad("written for other conversations, labels, model or settings")
        threads = data.get("threads", [])
        if (not isinstance(threads, list) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in threads)):
            self._bad(f"'threads' is {threads!r}, not a list of thread counts")
        got_stats, got_scores = {}, {}
        n = len(self.n_candidates)
        stats, scores = data.get("stats"), data.get("scores")
        if not isinstance(stats, list) or not isinstance(scores, list):
            self._bad("'stats' and 'scores' must be lists")
        for k, entry in enumerate(stats):
            if not isinstance(entry, list) or len(entry) != 3:
                self._bad(f"stats[{k}] is not [conversation, locator, writer]")
            i = entry[0]
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                self._bad(f"stats[{k}] names conversation {i!r} (there are {n})")
            got_stats[i] = (self._matrix(entry[1], f"stats[{k}] locator", False),
                            self._matrix(entry[2], f"stats[{k}] writer", True))
        for k, entry in enumerate(scores):
            if not isinstance(entry, list) or len(entry) != 4:
                self._bad(f"scores[{k}] is not [conversation, locators, writers, scores]")
            i, locs, wris, values = entry
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                self._bad(f"scores[{k}] names conversation {i!r} (there are {n})")
            if not isinstance(locs, list) or not isinstance(wris, list):
                self._bad(f"scores[{k}]: locators and writers must be lists of heads")
            config = (tuple(self._head(h, f"scores[{k}] locator") for h in locs),
                      tuple(self._head(h, f"scores[{k}] writer") for h in wris))
            if (not isinstance(values, list) or len(values) != self.n_candidates[i]
                    or any(isinstance(v, bool) or not isinstance(v, (int, float))
                           or not np.isfinite(v) for v in values)):
                self._bad(f"scores[{k}] does not hold {self.n_candidates[i]} finite scores "
                          f"for conversation {i}")
            got_scores[i, config] = np.asarray(values, dtype=np.float64)
        return got_stats, got_scores, set(threads)

    def save(self):
        import torch

        def matrix(m):
            return [[None if not np.isfinite(v) else float(v) for v in row] for row in m]

        with _folder_lock(self.path.parent):
            self._save(matrix, int(torch.get_num_threads()))

    def _save(self, matrix, now):
        self.refresh()  # another process's entries are kept, not overwritten
        if self.threads and now not in self.threads and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.path} was written with {sorted(self.threads)} torch thread(s) and "
                f"is now continued with {now}: floating-point sums depend on the thread "
                "count, so its scores may differ in their last bits from one run's (set "
                "torch.set_num_threads, or OMP_NUM_THREADS, to the store's count for "
                "exact results).", RuntimeWarning, stacklevel=5)
        self.threads.add(now)
        write_json(self.path, {
            "format": self.FORMAT, "version": self.VERSION, "signature": self.signature,
            "threads": sorted(self.threads),
            "stats": [[i, matrix(a), matrix(b)] for i, (a, b) in sorted(self.stats.items())],
            "scores": [[i, [list(h) for h in c[0]], [list(h) for h in c[1]],
                        [float(v) for v in values]]
                       for (i, c), values in sorted(self.scores.items())]})
        # _seen stays the file last read: another process may replace the file right
        # after this write, so the next refresh reads it again once


# ----------------------------------------------------------------------------- estimator
class GraftedJudge(_StepJudge):
    """Prompted judge whose writer heads read where its locator heads look.

    ``fit`` runs the judge's prompt (the probes' :class:`~skafa.llm.PromptTemplate`
    and ``answer_prefix``, as :class:`~skafa.baselines.PromptedJudge`) over the
    training conversations once, without intervention, and ranks every attention
    head at the *answer position* (the last prompt token, where the first token
    of the step number is predicted):

    - **locator score**: the mean, over conversations, of the head's attention
      mass on the true decisive turn's tokens
      (:func:`skafa.llm.head_attention_rows`, :func:`skafa.llm.turn_attention_mass`);
    - **writer score**: the mean of the head's direct effect on the logit of the
      true step's first answer token minus its mean direct effect on the other
      candidate steps' first tokens (:func:`head_direct_effects`; conversations
      whose candidates all start with the same token are skipped).

    It then picks ``n_locators_`` from ``locator_grid`` and ``n_writers_`` from
    ``writer_grid`` by step accuracy on inner folds (heads re-ranked on each
    fold's training part; ties go to fewer heads) and keeps the top heads of the
    ranking on all training conversations.

    ``predict`` scores the candidate step numbers exactly as
    :class:`~skafa.baselines.PromptedJudge` in ``mode="logprob"`` does, with the
    graft active during the prompt's forward pass: at the answer position each
    writer head's attention probabilities are replaced by ::

        mix * mean(locator heads' attention) + (1 - mix) * (its own attention)

    (both from a clean pass over the same prompt) and its output there
    recomputed as those weights times its values. Everything else — other heads,
    other positions, the candidate tokens' own pass — is the model's own. With
    ``mix=0``, no locators or no writers, the scores are the prompted judge's,
    bit for bit (the same code path runs).

    Parameters
    ----------
    model : str, default="smollm2"
        Name or path understood by :func:`skafa.llm.load_model`.
    prompt : PromptTemplate or None, default=None
        ``None`` means ``PromptTemplate()``.
    chat_template_kwargs : dict or None, default=None
        Extra variables for the tokenizer's chat template.
    answer_prefix : str, default="Step: "
        Start of the assistant's answer.
    locator_grid : sequence of int, default=(1, 2, 4)
        Numbers of locator heads to try (0: no graft).
    writer_grid : sequence of int, default=(1, 2, 4)
        Numbers of writer heads to try (0: no graft).
    mix : float in [0, 1], default=1.0
        Weight of the locators' attention in the writers' new attention.
    cv : int or cross-validation splitter, default=3
        Inner folds choosing the numbers of heads (skipped when the grids hold
        one pair). An int ``n``: ``GroupKFold(n)`` over ``groups`` (or the
        conversations' task ids when every conversation has one), else
        ``KFold(n, shuffle=True)``; ``n`` is capped at the number of groups.
    random_state : int, RandomState or None, default=None
        Shuffling of the ungrouped ``KFold``.
    device : str, default="cpu"
    dtype : str, default="auto"
    batch_size : int, default=1
        Conversations per forward pass of the ungrafted candidate scoring (the
        prompted judge's path); grafted scoring reads one conversation at a time.
    verbose : int, default=0

    Attributes
    ----------
    locator_heads_ : list of (int, int)
        The chosen locator heads ``(layer, head)``, best first.
    writer_heads_ : list of (int, int)
        The chosen writer heads, best first.
    head_locator_scores_ : ndarray of shape (n_layers, n_heads)
        Mean attention mass on the decisive turn, on all training conversations.
    head_writer_scores_ : ndarray of shape (n_layers, n_heads)
        Mean direct-effect contrast of the true step's token.
    n_locators_, n_writers_ : int
        The chosen numbers of heads.
    cv_results_ : dict or None
        ``params`` (list of ``(n_locators, n_writers)``), ``mean_test_score``
        (pooled inner step accuracy) and ``split_test_scores`` (one row per
        pair); ``None`` when the grids hold one pair.
    n_layers_, n_heads_ : int
        Shape of the head grid.
    prompt_, context_length_, dtype_, model_identity_, model_fingerprint_, \
n_conversations_fit_
        As for :class:`~skafa.baselines.PromptedJudge`.

    See Also
    --------
    skafa.baselines.PromptedJudge : The same judge without the graft.
    skafa.llm.head_attention_rows : The attention rows and the override.
    grafted_split_predictions : The judge fitted on many splits at the cost of two reads.

    Notes
    -----
    Cost: every prompt but its last token (the answer position) is read once
    and its KV cache kept while that conversation is scored; a graft then
    reruns only the answer position and the candidate step tokens, and the
    cache is rolled back. Causal attention makes this exact (a graft at the
    answer position cannot change an earlier position); models with
    sliding-window layers, whose caches cannot be rolled back, rerun the whole
    prompt per graft. ``fit`` reads each training prompt once for the head
    statistics and once more for all the grafts its inner folds ask of it;
    ``predict`` once. :func:`grafted_split_predictions` gives the test
    predictions of many splits (a repeated cross-validation) with two reads per
    conversation in all. The writer score is a direct-effect (first-order)
    reading: a head that writes through later layers is not seen. The
    locators' attention is taken from the clean pass, so a locator downstream
    of a writer does not see the graft.

    Examples
    --------
    >>> from skafa.baselines import GraftedJudge
    >>> judge = GraftedJudge("smollm2", locator_grid=(1, 2), writer_grid=(1, 2))  # doctest: +SKIP
    >>> judge.fit(train, groups=[c.task_id for c in train]).predict(test)     # doctest: +SKIP
    """

    _parameter_constraints: dict = {
        **_StepJudge._parameter_constraints,
        "locator_grid": ["array-like"],
        "writer_grid": ["array-like"],
        "mix": [Interval(numbers.Real, 0, 1, closed="both")],
        "cv": ["cv_object"],
        "random_state": ["random_state"],
    }

    def __init__(
        self,
        model="smollm2",
        *,
        prompt=None,
        chat_template_kwargs=None,
        answer_prefix="Step: ",
        locator_grid=(1, 2, 4),
        writer_grid=(1, 2, 4),
        mix=1.0,
        cv=3,
        random_state=None,
        device="cpu",
        dtype="auto",
        batch_size=1,
        verbose=0,
    ):
        self.model = model
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs
        self.answer_prefix = answer_prefix
        self.locator_grid = locator_grid
        self.writer_grid = writer_grid
        self.mix = mix
        self.cv = cv
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        self.batch_size = batch_size
        self.verbose = verbose

    # ------------------------------------------------------------------ fit
    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None, groups=None):
        """Rank the heads and choose how many locators and writers to graft.

        Parameters
        ----------
        X : list of Conversation
            Training conversations.
        y : array-like of int, shape (n_conversations,), default=None
            Decisive steps; ``None`` reads each conversation's ``mistake_step``.
        groups : array-like of shape (n_conversations,), default=None
            Groups of the inner folds (e.g. task ids).

        Returns
        -------
        self : GraftedJudge
        """
        pairs = self._pairs()
        convs, lm, tokenizer = self._fit_model(X, None)
        steps = self._check_decisive_steps(y, convs)
        plan = self._candidate_plan(convs, lm, tokenizer)
        locator_stats, writer_stats = self._head_statistics(lm, convs, plan, steps)
        everyone = np.arange(len(convs))
        inner = None if len(pairs) == 1 else self._inner_splits(convs, steps, groups)
        requests, configs = {}, []
        for train, test in inner or ():
            configs.append(_pair_configs(locator_stats, writer_stats, train, pairs))
            _request(requests, test, configs[-1])
        scores = self._graft_scores(lm, convs, plan, requests)
        self._set_choice(pairs, locator_stats, writer_stats, everyone, inner, configs,
                         scores, steps)
        return self

    def _pairs(self):
        locator_grid = _check_grid(self.locator_grid, "locator_grid")
        writer_grid = _check_grid(self.writer_grid, "writer_grid")
        return [(a, b) for a in locator_grid for b in writer_grid]

    def _set_choice(self, pairs, locator_stats, writer_stats, train, inner, configs,
                    scores, steps):
        """Fitted attributes from the statistics of ``train`` and the inner scores."""
        self.n_layers_, self.n_heads_ = (int(n) for n in locator_stats.shape[1:])
        self.head_locator_scores_ = _mean_scores(locator_stats, train)
        self.head_writer_scores_ = _mean_scores(writer_stats, train)
        if inner is None:
            self.cv_results_ = None
            self.n_locators_, self.n_writers_ = pairs[0]
        else:
            split_scores = _split_scores(scores, steps, inner, configs)
            best, mean = _choose_pair(pairs, split_scores, inner)
            self.cv_results_ = {"params": [tuple(p) for p in pairs],
                                "mean_test_score": mean,
                                "split_test_scores": split_scores}
            self.n_locators_, self.n_writers_ = pairs[best]
            log(self, 1, "inner folds: " + ", ".join(
                f"{p}: {m:.3f}" for p, m in zip(pairs, mean)))
        self.locator_heads_ = _rank(self.head_locator_scores_)[:self.n_locators_]
        self.writer_heads_ = _rank(self.head_writer_scores_)[:self.n_writers_]
        log(self, 1, f"locators {self.locator_heads_}, writers {self.writer_heads_}")

    def _session(self, lm, plan, i, kv=None):
        cache = None if kv is None else kv.take(i, lm)
        return _AnswerSession(lm, plan.prefixes[i], plan.continuations[i], plan.number_mask,
                              plan.pad_id, cache=cache)

    def _head_statistics(self, lm, convs, plan, steps, store=None, kv=None):
        """Per conversation and head: mass on the decisive turn, direct-effect contrast.

        With ``verbose``, a bar weighted by each prompt's forward FLOPs shows this
        process's pace and ETA (a conversation stored earlier or by another process
        sharing ``store`` leaves its total).
        """
        locator, writer = {}, {}
        bar, counted = None, set()
        if self.verbose and self.verbose > 0:
            from ..utils.progress import WorkBar

            bar = WorkBar(forward_flops(lm, [len(p) for p in plan.prefixes]),
                          "skafa: grafted judge head statistics")

        def compute(i, enc):
            firsts = [int(c[0]) for c in plan.continuations[i]]
            tokens = sorted(set(firsts))
            session = self._session(lm, plan, i)
            _, rows, direct = session.step(direct_tokens=tokens)
            if kv is not None and session.cache is not None:
                kv.put(i, session.cache)  # the graft pass restores it instead of rereading
            del session
            spans = list(zip(np.asarray(enc.turn_start_positions).tolist(),
                             (np.asarray(enc.turn_positions) + 1).tolist()))
            step = int(steps[i])
            locator[i] = turn_attention_mass(rows, spans[step:step + 1])[..., 0]
            true = tokens.index(firsts[step])
            others = [k for k in range(len(tokens)) if k != true]
            if others:
                writer[i] = direct[..., true] - direct[..., others].mean(-1)
            else:  # every candidate starts with the same token: no contrast
                writer[i] = np.full(direct.shape[:2], np.nan)
            if store is not None:
                store.stats[i] = (np.asarray(locator[i], dtype=np.float64),
                                  np.asarray(writer[i], dtype=np.float64))
                store.save()
            if bar is not None:
                counted.add(i)
                bar.done(i)

        def stored(i):  # also what another process sharing the store has finished
            if store is not None and i not in store.stats:
                store.refresh()
            if store is not None and i in store.stats:
                locator[i], writer[i] = store.stats[i]
                if bar is not None and i not in counted:  # not this process's work
                    counted.add(i)
                    bar.elsewhere(i)
                    bar.done(i)
                return True
            return False

        try:
            for i in _shared_order(range(len(plan.encodings)), store, "stats", stored):
                compute(i, plan.encodings[i])
        finally:
            if bar is not None:
                bar.close()
        order = range(len(plan.encodings))
        return (np.stack([locator[i] for i in order]).astype(np.float64),
                np.stack([writer[i] for i in order]).astype(np.float64))

    def _inner_splits(self, convs, steps, groups):
        task_ids = [c.task_id for c in convs]
        if groups is None and all(t is not None for t in task_ids):
            groups = group_labels(task_ids)
        if isinstance(self.cv, numbers.Integral):
            n_units = len(convs) if groups is None else len(np.unique(np.asarray(groups)))
            n_splits = min(int(self.cv), n_units)
            if n_splits < 2:
                raise ValueError(
                    f"GraftedJudge needs at least 2 {'groups' if groups is not None else 'conversations'} "
                    f"to choose the numbers of heads on inner folds, got {n_units}; give one "
                    "pair in locator_grid x writer_grid to skip the inner folds.")
            cv = (GroupKFold(n_splits) if groups is not None
                  else KFold(n_splits, shuffle=True, random_state=self.random_state))
            return list(cv.split(convs, steps, groups))
        return grouped_splits(self.cv, convs, steps, {"groups": groups}, task_ids)

    def _graft_scores(self, lm, convs, plan, requests, store=None, kv=None):
        """Candidate scores of conversation ``i`` under each graft ``requests[i]`` asks for.

        A graft that changes nothing is scored by the prompted judge's own path
        (bit for bit, batched by ``batch_size``); every other conversation's
        prompt is read once (:class:`_AnswerSession`) and each of its grafts costs
        only the answer position and the candidate tokens.

        Returns
        -------
        dict
            ``{(i, (locators, writers)): scores}``.
        """
        mix = float(self.mix)
        out = {} if store is None else {key: store.scores[key] for key in
                                        ((i, c) for i, configs in requests.items()
                                         for c in configs) if key in store.scores}
        requests = {i: [c for c in configs if (i, c) not in out]
                    for i, configs in requests.items()}
        plain = sorted(i for i, configs in requests.items()
                       if any(not _active(c, mix) for c in configs))
        if plain:
            sub = Bunch(**plan)
            for key in ("prefixes", "continuations", "encodings"):
                sub[key] = [plan[key][i] for i in plain]
            for i, scores in zip(plain, self._score_plan(lm, [convs[i] for i in plain], sub)):
                for config in requests[i]:
                    if not _active(config, mix):
                        out[i, config] = scores
                        if store is not None:
                            store.scores[i, config] = np.asarray(scores, dtype=np.float64)
            if store is not None:
                store.save()
        grafted = sorted(i for i, configs in requests.items()
                         if any(_active(c, mix) for c in configs))
        if kv is not None:  # the prompts whose KV cache waits on disk first: no reread
            grafted.sort(key=lambda i: (int(i) not in kv.kept, not kv.holds(i)))
        start = time.perf_counter()
        total = sum(sum(_active(c, mix) for c in requests[i]) for i in grafted)
        scored, done = 0, 0

        def stored(i):  # also what another process sharing the store has finished
            if store is None:
                return False
            if any((i, c) not in store.scores for c in requests[i]):
                store.refresh()
            if all((i, c) in store.scores for c in requests[i]):
                out.update({(i, c): store.scores[i, c] for c in requests[i]})
                return True
            return False

        for i in _shared_order(grafted, store, "grafts", stored):
            done += 1
            session = self._session(lm, plan, i, kv)
            _, rows, _ = session.step()
            for config in requests[i]:
                if _active(config, mix):
                    grafts = _graft_rows(rows, list(config[0]), list(config[1]), mix)
                    override = {head: w[None, :] for head, w in grafts.items()}
                    out[i, config] = session.step(override=override, rows=False)[0]
                    scored += 1
                    if store is not None:
                        store.scores[i, config] = np.asarray(out[i, config], dtype=np.float64)
            del session
            if store is not None:
                store.save()
            elapsed = time.perf_counter() - start
            left = f"about {elapsed / scored * (total - scored):.0f} s left" if scored else ""
            log(self, 1, f"grafts {done}/{len(grafted)} conversations "
                         f"({convs[i].record_id or i}): {scored}/{total} scorings, "
                         f"{elapsed:.2f} s{', ' if left else ''}{left}")
        return out

    # ------------------------------------------------------------------ prediction
    def _grafting(self):
        """Whether the fitted graft changes anything (locators, writers and ``mix > 0``)."""
        return bool(self.locator_heads_ and self.writer_heads_ and float(self.mix) > 0)

    def _judge_scores(self, convs):
        if not self._grafting():
            return self._logprob_scores(convs)
        lm, tokenizer = self._load_checked()
        plan = self._candidate_plan(convs, lm, tokenizer)
        config = (tuple(tuple(h) for h in self.locator_heads_),
                  tuple(tuple(h) for h in self.writer_heads_))
        scores = self._graft_scores(lm, convs, plan, {i: [config] for i in range(len(convs))})
        return [scores[i, config] for i in range(len(convs))]

    @fit_context(prefer_skip_nested_validation=True)
    def _split_predictions(self, X, y, splits, groups, store, kv_dir=None, keep_kv=False):
        """:func:`grafted_split_predictions` on this (unfitted copy of the) judge."""
        if not isinstance(keep_kv, bool):
            raise TypeError(f"keep_kv must be a bool, got {keep_kv!r}.")
        if keep_kv and (store is None or kv_dir is None):
            raise ValueError("keep_kv=True needs both store and kv_dir: the kept KV caches "
                             "belong to the store's run.")
        pairs = self._pairs()
        convs, lm, tokenizer = self._fit_model(X, None)
        steps = self._check_decisive_steps(y, convs)
        groups = None if groups is None else np.asarray(groups)
        plan = self._candidate_plan(convs, lm, tokenizer)
        if store is not None:
            store = self._open_store(store, convs, steps, plan, lm)
            log(self, 1, f"store {store.path}: head statistics of {len(store.stats)} and "
                         f"{len(store.scores)} graft scorings kept from an earlier run")
        kv = None
        with stop_requests():  # SIGTERM stops the loops below; a kept KV file it hits stays
            if kv_dir is not None and keep_kv:
                digest = hashlib.sha256(json.dumps(store.signature, sort_keys=True)
                                        .encode("utf-8")).hexdigest()
                kv = _KVSpill(kv_dir, resumable=digest, prompts=plan.prefixes)
            elif kv_dir is not None:
                kv = _KVSpill(kv_dir)
            try:
                return self._split_predictions_with(convs, lm, plan, steps, splits, groups,
                                                    pairs, store, kv)
            finally:
                if kv is not None:
                    kv.close()

    def _split_predictions_with(self, convs, lm, plan, steps, splits, groups, pairs, store,
                                kv):
        log(self, 1, f"head statistics of {len(convs)} conversations (one pass each)")
        locator_stats, writer_stats = self._head_statistics(lm, convs, plan, steps, store, kv)
        requests, fits = {}, []
        for train, test in splits:
            train, test = np.asarray(train, dtype=np.int64), np.asarray(test, dtype=np.int64)
            inner, configs = None, []
            if len(pairs) > 1:
                local = self._inner_splits([convs[i] for i in train], steps[train],
                                           None if groups is None else groups[train])
                inner = [(train[a], train[b]) for a, b in local]
                for inner_train, inner_test in inner:
                    configs.append(_pair_configs(locator_stats, writer_stats, inner_train,
                                                 pairs))
                    _request(requests, inner_test, configs[-1])
            final = _pair_configs(locator_stats, writer_stats, train, pairs)
            _request(requests, test, final)  # every pair: the choice is made afterwards
            fits.append((train, test, inner, configs, final))
        n_grafts = sum(len(v) for v in requests.values())
        log(self, 1, f"{n_grafts} (conversation, graft) scorings over {len(requests)} "
                     f"conversations (one prompt pass each)")
        scores = self._graft_scores(lm, convs, plan, requests, store, kv)
        predictions, infos = [], []
        for train, test, inner, configs, final in fits:
            self._set_choice(pairs, locator_stats, writer_stats, train, inner, configs,
                             scores, steps)
            config = final[pairs.index((self.n_locators_, self.n_writers_))]
            predictions.append(np.array([int(np.argmax(scores[int(i), config])) for i in test],
                                        dtype=np.int64))
            infos.append({"n_locators": int(self.n_locators_), "n_writers": int(self.n_writers_),
                          "locator_heads": [list(h) for h in self.locator_heads_],
                          "writer_heads": [list(h) for h in self.writer_heads_],
                          "inner_mean_score": (None if self.cv_results_ is None else
                                               [float(v) for v in
                                                self.cv_results_["mean_test_score"]])})
        return predictions, infos

    def _open_store(self, path, convs, steps, plan, lm):
        contents = json.dumps([conversation_content(c) for c in convs], sort_keys=True,
                              ensure_ascii=False, default=str)
        signature = {
            "model_identity": self.model_identity_, "model_fingerprint": self.model_fingerprint_,
            "dtype": str(self.dtype_), "prompt": self.prompt_.fingerprint(),
            "answer_prefix": self.answer_prefix, "mix": float(self.mix),
            "chat_template_kwargs": self.chat_template_kwargs,
            "conversations": hashlib.sha256(contents.encode("utf-8")).hexdigest(),
            "steps": [int(v) for v in steps]}
        layout = decoder_layout(lm)
        n_heads = int(lm.config.get_text_config().num_attention_heads)
        return _GraftStore(path, signature, layout.n_layers, n_heads,
                           [len(c) for c in plan.continuations])


    @fit_context(prefer_skip_nested_validation=True)
    def _recheck_store(self, X, y, path, n_scorings):
        """:func:`recheck_graft_store` on this (unfitted copy of the) judge."""
        import torch

        if not Path(path).is_file():
            raise FileNotFoundError(f"no graft store at {path}")
        convs, lm, tokenizer = self._fit_model(X, None)
        steps = self._check_decisive_steps(y, convs)
        plan = self._candidate_plan(convs, lm, tokenizer)
        store = self._open_store(path, convs, steps, plan, lm)
        mix = float(self.mix)
        stored = {}
        for i, config in sorted(store.scores):
            if _active(config, mix):
                stored.setdefault(i, []).append(config)
        # the shortest prompts first: the cheapest to read again
        requests, n = {}, 0
        for i in sorted(stored, key=lambda k: (len(plan.prefixes[k]), k)):
            if n >= n_scorings:
                break
            requests[i] = stored[i][:n_scorings - n]
            n += len(requests[i])
        log(self, 1, f"recheck: {n} stored graft scorings of {len(requests)} conversations "
                     f"of {store.path}")
        start = time.perf_counter()
        fresh = self._graft_scores(lm, convs, plan, requests)  # no store: all computed
        seconds = time.perf_counter() - start
        differ, worst = [], 0.0
        for i, configs in requests.items():
            for config in configs:
                new = np.asarray(fresh[i, config], dtype=np.float64)
                old = store.scores[i, config]
                if not np.array_equal(new, old):
                    gap = float(np.max(np.abs(new - old)))
                    worst = max(worst, gap)
                    differ.append({"conversation": convs[i].record_id or str(i),
                                   "locators": [list(h) for h in config[0]],
                                   "writers": [list(h) for h in config[1]],
                                   "max_abs_difference": gap})
        return {"n_checked": n, "n_equal": n - len(differ), "max_abs_difference": worst,
                "differ": differ,
                "conversations": [convs[i].record_id or str(i) for i in requests],
                "n_prompt_tokens": int(sum(len(plan.prefixes[i]) for i in requests)),
                "seconds": round(seconds, 2), "threads": int(torch.get_num_threads()),
                "store_threads": sorted(store.threads) or None}


def grafted_split_predictions(judge, X, y=None, splits=(), *, groups=None, store=None,
                              kv_dir=None, keep_kv=False):
    """Test predictions of a :class:`GraftedJudge` fitted on each split's training part.

    The result equals, split by split, ::

        clone(judge).fit(X[train], y[train], groups=groups[train]).predict(X[test])

    but every conversation's prompt is read twice in all (once for the head
    statistics, once for all the grafts any split asks of it; once with
    ``kv_dir``) instead of several
    times per split: the statistics do not depend on the split, and a graft at the
    answer position costs only that position and the candidate tokens
    (:class:`GraftedJudge`'s own ``fit`` and ``predict`` share this code). For the
    repeated cross-validation of a benchmark this is what makes the grafted judge
    affordable.

    Parameters
    ----------
    judge : GraftedJudge
        Unfitted template (cloned; its parameters are validated as ``fit`` does).
    X : list of Conversation
    y : array-like of int, shape (n_conversations,), default=None
        Decisive steps; ``None`` reads each conversation's ``mistake_step``.
    splits : iterable of (train, test)
        Index arrays into ``X``.
    groups : array-like of shape (n_conversations,), default=None
        Groups of the inner folds, as ``fit``'s ``groups``.
    store : str or path-like, default=None
        A JSON file that keeps every conversation's head statistics and graft
        scores as soon as they are computed: run the same call again after an
        interruption and only the missing ones are computed (the predictions
        are the same). A file written for other conversations, labels, model,
        prompt or ``mix`` is refused (:class:`~skafa.model_selection.ResultStoreError`),
        as is a damaged one. ``None``: nothing is kept. Several processes may
        fill one store at the same time (same call, same thread count): each
        claims the conversation it works on (a ``<store>.<pass>-<i>.claim`` file
        beside the store, removed when done), skips what another has claimed or
        stored, and reads the store again before each write, so the work is
        split and nothing is lost; a claim left by a killed process only defers
        its conversation.
    kv_dir : str or path-like, default=None
        A folder in which each prompt's KV cache is kept on disk between the
        statistics pass and the graft pass, so every prompt is read once instead
        of twice (same predictions, bit for bit). The caches go to a private
        temporary subfolder, each file is deleted once its conversation's grafts
        are done and the subfolder when the call returns; at most every prompt's
        cache is there at once (float32 keys and values of every layer: about
        46 KB per prompt token for SmolLM2-135M). Models with sliding-window
        layers keep nothing (their prompts are reread at each graft anyway).
        With ``store`` shared by several processes, each process's graft pass
        takes the conversations whose caches it kept first, so a prompt is reread
        only where another process (or an earlier run) read it for the statistics.
        The subfolder is also removed after an error, a ``KeyboardInterrupt`` or a
        SIGTERM (in the main thread the call records SIGTERM and Ctrl-C with
        :func:`skafa.utils.signals.stop_requests` and stops with
        :class:`~skafa.utils.signals.StopRequested`, a ``KeyboardInterrupt``; a
        handler of your own is still called); a process killed outright (SIGKILL)
        leaves its ``skafa-grafted-kv-*`` folder, to be removed by hand.
        ``None``: prompts are read twice and nothing is written.
    keep_kv : bool, default=False
        With ``store`` and ``kv_dir``: keep the caches in
        ``kv_dir/skafa-grafted-kv-<digest of the store's signature>`` beyond the
        call, so a run resumed after an interruption (or one sharing the store)
        restores the caches an earlier run kept and reads none of those prompts
        again (same predictions, bit for bit). Each file is deleted once its
        conversation's grafts are done, the folder once it is empty. A file there is
        read only after it passes every check (its store digest, conversation and
        prompt-token SHA-256; one key and value per layer of the model's dtype and
        the prompt's length; the SHA-256 of its tensors); one that fails is deleted
        and its prompt read again, with a ``RuntimeWarning``; a read that fails after a
        stop request (SIGTERM, Ctrl-C: the error may be the signal itself, surfaced
        inside torch or safetensors) deletes nothing and counts nothing: the call
        stops with :class:`~skafa.utils.signals.StopRequested` and the file waits for
        the resumed run. A file half written by a
        killed process of this host is removed when a later run opens the folder.

    Returns
    -------
    predictions : list of ndarray of int64
        The predicted step of each test conversation, in the order of ``test``.
    fits : list of dict
        Per split: ``n_locators``, ``n_writers``, ``locator_heads``,
        ``writer_heads`` and ``inner_mean_score`` (per pair of the grids, or
        ``None`` when they hold one pair).

    Examples
    --------
    >>> from sklearn.model_selection import GroupKFold
    >>> from skafa.baselines import GraftedJudge, grafted_split_predictions
    >>> splits = list(GroupKFold(5).split(convs, groups=task_ids))   # doctest: +SKIP
    >>> preds, fits = grafted_split_predictions(
    ...     GraftedJudge("smollm2", cv=GroupKFold(5)), convs, splits=splits,
    ...     groups=task_ids)                                          # doctest: +SKIP
    """
    if not isinstance(judge, GraftedJudge):
        raise TypeError(f"grafted_split_predictions needs a GraftedJudge, got "
                        f"{type(judge).__name__}.")
    from sklearn.base import clone

    return clone(judge)._split_predictions(X, y, list(splits), groups, store, kv_dir, keep_kv)


def recheck_graft_store(judge, X, y=None, *, store, n_scorings=20):
    """Compute stored graft scorings again and compare them with the store, bit for bit.

    A store of :func:`grafted_split_predictions` may be resumed by other code than
    the one that began it (a speed-up of the graft step, another library version).
    This reads the store (checked as ``grafted_split_predictions`` checks it),
    takes ``n_scorings`` of its graft scorings, those of the conversations with the
    shortest prompts first, computes them again with this code and compares.
    Nothing is written. Floating-point results depend on the number of threads
    (``torch.get_num_threads()``): run it with the number the store was written
    with for an exact comparison.

    Parameters
    ----------
    judge : GraftedJudge
        Unfitted template with the settings the store was written with.
    X : list of Conversation
    y : array-like of int, shape (n_conversations,), default=None
        Decisive steps; ``None`` reads each conversation's ``mistake_step``.
    store : str or path-like
        The store's file (it must exist).
    n_scorings : int, default=20
        How many stored graft scorings to compute again (fewer when the store
        holds fewer).

    Returns
    -------
    result : dict
        ``n_checked``, ``n_equal`` (equal bit for bit), ``max_abs_difference``,
        ``differ`` (per differing scoring: conversation, heads, difference),
        ``conversations`` (record ids read), ``n_prompt_tokens``, ``seconds``,
        ``threads`` (torch's now) and ``store_threads`` (the counts the store was
        written with; ``None`` for a store older than that record).

    Raises
    ------
    FileNotFoundError
        When ``store`` does not exist.
    ResultStoreError
        When the store was written for other conversations, labels or settings,
        or is damaged.
    """
    if not isinstance(judge, GraftedJudge):
        raise TypeError(f"recheck_graft_store needs a GraftedJudge, got "
                        f"{type(judge).__name__}.")
    if (isinstance(n_scorings, bool) or not isinstance(n_scorings, numbers.Integral)
            or n_scorings < 1):
        raise ValueError(f"n_scorings must be a positive integer, got {n_scorings!r}.")
    from sklearn.base import clone

    return clone(judge)._recheck_store(X, y, store, int(n_scorings))
