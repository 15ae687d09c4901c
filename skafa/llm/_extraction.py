"""Read a language model's hidden states at every turn: :class:`TurnActivationTransformer`.

For each conversation skafa renders one prompt (:mod:`skafa.llm`), runs ONE
forward pass of the model's base decoder (never the LM head) and reads every
requested site (:mod:`skafa.llm`) at the token that holds each turn's last
character (or, with ``read=``, averaged over the turn's line, at the turn's recap
line after the transcript, or at the turn in a second copy of it). Sites are read with forward hooks that gather only those positions
into a preallocated ``(n_turns, n_sites, hidden_size)`` buffer, so memory does not
grow with ``n_layers x n_tokens`` the way ``output_hidden_states=True`` does. When
no requested site is deeper than layer ``k``, the forward pass stops after
layer ``k``.

Results are cached per conversation (:mod:`skafa.llm`): in memory by default
and on disk with ``cache_dir``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import numbers
import os
import threading
import weakref
from collections.abc import Mapping

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.utils.validation import check_is_fitted

from ..conversation import check_conversations
from ..features import TurnFeatures
from ..persistence import PersistenceMixin
from ..utils.claims import wait_while_claimed
from ..utils.progress import say
from ..utils.signals import stop_requests
from ..utils.sklearn_compat import Interval, StrOptions, fit_context
from ..utils.validation import describe_conversation
from ._attention import banded_sliding_window_attention
from ._batching import SequenceTooLarge, length_batches
from ._cache import ActivationCache, activation_key
from ._head_attention import head_attention_rows, turn_attention_mass
from ._models import (
    ModelHandle,
    _converted_dir,
    kv_cache_argument,
    load_checked_model,
    resolve_dtype,
    verify_saved_model,
)
from ._prompt import PromptTemplate
from ._reads import READS
from ._sites import (
    decoder_layout,
    is_head_attention_site,
    parse_site,
    site_depth,
    validate_sites,
)

__all__ = ["TurnActivationTransformer", "extract_activations", "SiteReader"]


_LOCKS = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _model_lock(module):
    """One lock per decoder: hooks are per module, so two threads must not share a pass."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.Lock()
        return lock


class _StopForward(Exception):
    """Raised from the deepest needed hook to end a forward pass early."""


# ------------------------------------------------------------------ core reader
class SiteReader:
    """Forward hooks that read sites at chosen token positions.

    Parameters
    ----------
    layout : DecoderLayout
        From :func:`skafa.llm.decoder_layout`.
    sites : sequence of str
        Valid site names (see :func:`skafa.llm.validate_sites`); the output has
        them in this order.
    early_stop : bool, default=True
        Stop the forward pass right after the deepest requested site when it is
        not ``resid_final``.

    Notes
    -----
    Hooks live on the model's modules, so forward passes through one model are
    serialised by a per-model lock (threads sharing a model wait for each other).

    ``resid_pre.l`` is read by a forward pre-hook on decoder layer ``l`` (its
    input hidden states), ``mlp_in.l`` by a forward hook on the layer's MLP-input
    norm, ``resid_final`` by a forward hook on the final norm. Each hook gathers
    only the requested rows (``index_select``) and copies them into the buffer.
    """

    def __init__(self, layout, sites, *, early_stop=True):
        self.layout = layout
        self.sites = tuple(sites)
        heads = [s for s in self.sites if is_head_attention_site(s)]
        if heads:
            raise ValueError(f"SiteReader reads hidden states; {heads} are head-attention "
                             "sites (read them with extract_activations or "
                             "TurnActivationTransformer).")
        deepest = max(self.sites, key=site_depth)
        self.stop_site = None if (deepest == "resid_final" or not early_stop) else deepest
        self._buffer = None
        self._rows = None
        self._segments = None
        self._counts = None

    def _gather(self, column, site, hidden):
        import torch

        flat = hidden.reshape(-1, hidden.shape[-1])
        picked = flat.index_select(0, self._rows)
        if self._segments is None:
            self._buffer[:, column, :].copy_(picked)
        else:
            sums = torch.zeros((self._buffer.shape[0], flat.shape[-1]), dtype=torch.float32,
                               device=picked.device)
            sums.index_add_(0, self._segments, picked.to(torch.float32))
            self._buffer[:, column, :].copy_(sums / self._counts)
        if site == self.stop_site:
            raise _StopForward

    def _register(self):
        handles = []
        layout = self.layout
        for column, site in enumerate(self.sites):
            kind, layer = parse_site(site)
            if kind == "resid_pre":
                def pre_hook(module, args, kwargs, _c=column, _s=site):
                    hidden = args[0] if args else kwargs["hidden_states"]
                    self._gather(_c, _s, hidden)
                handles.append(layout.layers[layer].register_forward_pre_hook(
                    pre_hook, with_kwargs=True))
            else:
                module = (layout.final_norm if kind == "resid_final"
                          else layout.mlp_in_norms[layer])

                def hook(module, args, output, _c=column, _s=site):
                    hidden = output[0] if isinstance(output, tuple) else output
                    self._gather(_c, _s, hidden)
                handles.append(module.register_forward_hook(hook))
        return handles

    def run(self, input_ids, rows, *, attention_mask=None, segments=None, n_out=None,
            past_key_values=None):
        """Run one forward pass and return the sites at the given rows.

        Parameters
        ----------
        input_ids : torch.LongTensor of shape (batch, seq_len)
            On the model's device.
        rows : torch.LongTensor of shape (n_rows,)
            Indices into the flattened ``(batch * seq_len)`` token axis.
        attention_mask : torch.Tensor of shape (batch, seq_len), optional
            1 for real tokens, 0 for (right) padding.
        segments : torch.LongTensor of shape (n_rows,), optional
            Output row of every read row: rows sharing a segment are averaged
            (summed in float32, divided by their count). ``None`` returns every row.
        n_out : int, optional
            Number of segments; required with ``segments``.
        past_key_values : transformers Cache, optional
            Keys and values of the tokens before ``input_ids`` (e.g. a
            ``DynamicCache(config=model.config)``, empty at first), extended in
            place with those of ``input_ids``; ``rows`` index the new tokens only.
            With ``early_stop`` the layers past the deepest site neither run nor
            get cached, so use readers of the same sites on one cache
            (:class:`skafa.online.AuditSession` does). ``None``: no cache.

        Returns
        -------
        values : torch.Tensor of float32, shape (n_rows or n_out, n_sites, hidden_size)
        """
        import torch

        hidden = self.layout.embedding.weight.shape[-1]
        with _model_lock(self.layout.decoder):
            n = rows.shape[0] if segments is None else int(n_out)
            self._buffer = torch.empty((n, len(self.sites), hidden),
                                       dtype=torch.float32, device=rows.device)
            self._rows = rows
            self._segments = segments
            if segments is not None:
                counts = torch.bincount(segments, minlength=n).to(torch.float32)
                if bool((counts == 0).any()):
                    raise ValueError("every segment must contain at least one row.")
                self._counts = counts[:, None]
            handles = self._register()
            try:
                with torch.inference_mode(), banded_sliding_window_attention(
                        self.layout.decoder):
                    try:
                        cache = ({"use_cache": False} if past_key_values is None else
                                 {"use_cache": True,
                                  kv_cache_argument(self.layout.decoder): past_key_values})
                        self.layout.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                            **cache)
                    except _StopForward:
                        pass
                return self._buffer
            finally:
                for h in handles:
                    h.remove()
                self._buffer = None
                self._rows = None
                self._segments = None
                self._counts = None


def _is_out_of_memory(exc):
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(exc, oom) or (isinstance(exc, RuntimeError)
                                    and "out of memory" in str(exc).lower())


def _check_batch_size(batch_size):
    if batch_size == "auto":
        return "auto"
    if (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
            or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or 'auto', got {batch_size!r}.")
    return int(batch_size)


def extract_activations(model, input_ids, positions, sites, *, starts=None, batch_size=1,
                        pad_token_id=0, early_stop=True, on_done=None):
    """Read ``sites`` at ``positions`` of each sequence, one forward pass per batch.

    The building block of :class:`TurnActivationTransformer`, usable on any
    loaded model (no prompt rendering, no caching).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A supported causal LM or its base decoder (see
        :func:`skafa.llm.decoder_layout`).
    input_ids : sequence of 1-D int arrays
        Token ids of each sequence.
    positions : sequence of 1-D int arrays
        Token positions to read in each sequence.
    sites : sequence of str
        Valid site names: hidden-state sites, or only head-attention sites
        (``head_attn.<l>``, see below).
    starts : sequence of 1-D int arrays, optional
        With ``starts``, row ``k`` of sequence ``i`` is the *mean* of the sites over
        tokens ``starts[i][k] .. positions[i][k]`` (inclusive) instead of the value
        at ``positions[i][k]``. Spans may overlap; each needs
        ``0 <= starts[i][k] <= positions[i][k]``. With head-attention sites,
        required: row ``k`` of site ``head_attn.l`` is, per head of layer ``l``,
        the attention mass from the sequence's last token to tokens
        ``starts[i][k] .. positions[i][k]`` (one forward pass per sequence, the
        rows computed alone: :func:`skafa.llm.head_attention_rows`).
    batch_size : int or "auto", default=1
        Sequences per forward pass. Batches are formed by decreasing length and
        right-padded (with an attention mask); with causal attention a real
        token never attends to the padding that follows it. ``"auto"``: as many
        sequences per batch as fit 80% of the device's free memory (CUDA:
        ``torch.cuda.mem_get_info``; CPU: ``MemAvailable``) by a generous
        per-token estimate, so short sequences share large batches and long ones
        run alone; a batch that still runs out of CUDA memory is split in two
        and retried. A sequence that alone does not fit raises ``MemoryError``.
    pad_token_id : int, default=0
        Id written into padded slots (masked out; any valid id works).
    early_stop : bool, default=True
        See :class:`SiteReader`.
    on_done : callable, optional
        Called as ``on_done(i, values)`` when sequence ``i`` is finished.

    Returns
    -------
    values : list of ndarray of float32, shape (len(positions[i]), n_sites, hidden_size)
        In input order (``n_heads`` in place of ``hidden_size`` for head-attention
        sites).
    """
    return _extract(model, input_ids, positions, sites, starts=starts,
                    batch_size=batch_size, pad_token_id=pad_token_id,
                    early_stop=early_stop, on_done=on_done)[0]


def _extract(model, input_ids, positions, sites, *, starts=None, batch_size=1,
             pad_token_id=0, early_stop=True, on_done=None, select=None):
    """:func:`extract_activations`, returning ``(values, n_forward_passes)``.

    ``select(batch) -> batch``, called right before each batch runs, may leave
    sequences out (done elsewhere meanwhile, or to come back to); their values stay
    ``None`` and ``on_done`` is not called for them.
    """
    import torch

    heads = [is_head_attention_site(s) for s in sites]
    if any(heads):
        if not all(heads):
            raise ValueError(
                "head-attention sites (head_attn.<l>) cannot be read together with "
                f"hidden-state sites (got {list(sites)}): their rows have another width. "
                "Use two extractors (e.g. in a TurnFeatureUnion).")
        if starts is None:
            raise ValueError("head-attention sites need starts: the first token of each "
                             "turn's span.")
        return _extract_heads(model, input_ids, positions, starts, sites, early_stop=early_stop,
                              on_done=on_done, select=select)
    layout = decoder_layout(model)
    reader = SiteReader(layout, sites, early_stop=early_stop)
    device = layout.embedding.weight.device
    lengths = [int(np.asarray(ids).shape[0]) for ids in input_ids]
    results = [None] * len(lengths)
    auto = _check_batch_size(batch_size) == "auto"
    queue = length_batches(lengths, "auto" if auto else int(batch_size), layout=layout,
                           device=device)
    queue.reverse()  # a stack: pop() takes the next batch, halves go back on top
    n_passes = 0
    while queue:
        batch = queue.pop()
        if select is not None:
            batch = list(select(batch))
            if not batch:
                continue
        width = max(lengths[i] for i in batch)
        padded = any(lengths[i] != width for i in batch)
        ids = np.full((len(batch), width), int(pad_token_id), dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64) if padded else None
        rows, segments, counts = [], [], []
        for b, i in enumerate(batch):
            ids[b, : lengths[i]] = np.asarray(input_ids[i], dtype=np.int64)
            if mask is not None:
                mask[b, : lengths[i]] = 1
            pos = np.asarray(positions[i], dtype=np.int64)
            if pos.size and (pos.min() < 0 or pos.max() >= lengths[i]):
                raise ValueError(
                    f"sequence {i}: positions must lie in 0..{lengths[i] - 1}, got "
                    f"{pos.min()}..{pos.max()}."
                )
            if starts is None:
                rows.append(pos + b * width)
            else:
                first = np.asarray(starts[i], dtype=np.int64)
                if first.shape != pos.shape or (pos.size and (
                        first.min() < 0 or np.any(first > pos))):
                    raise ValueError(
                        f"sequence {i}: starts must have the shape of positions and satisfy "
                        "0 <= starts <= positions.")
                span = pos - first + 1
                # Token rows first..pos of every span, and the output row of each.
                within = np.arange(int(span.sum()), dtype=np.int64) - np.repeat(
                    np.cumsum(span) - span, span)
                rows.append(np.repeat(first, span) + within + b * width)
                segments.append(np.repeat(np.arange(pos.size, dtype=np.int64) + sum(counts),
                                          span))
            counts.append(pos.size)
        rows = torch.from_numpy(np.concatenate(rows)).to(device)
        seg = (None if starts is None
               else torch.from_numpy(np.concatenate(segments)).to(device))
        try:
            out = reader.run(torch.from_numpy(ids).to(device), rows,
                             attention_mask=(None if mask is None
                                             else torch.from_numpy(mask).to(device)),
                             segments=seg, n_out=sum(counts))
        except Exception as exc:
            if not (auto and _is_out_of_memory(exc)):
                raise
            del rows, seg
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if len(batch) == 1:
                raise SequenceTooLarge(batch[0], (
                    f"sequence {batch[0]} ({lengths[batch[0]]} tokens) alone ran out of "
                    f"memory on {device}. Shorten the prompt (PromptTemplate("
                    "max_prompt_tokens=...)), use dtype='bfloat16', or extract on another "
                    "device.")) from exc
            half = len(batch) // 2
            queue.extend([batch[half:], batch[:half]])
            continue
        n_passes += 1
        out = out.cpu().numpy()  # to the host after every batch
        start = 0
        for i, n in zip(batch, counts):
            results[i] = out[start:start + n]
            start += n
            if on_done is not None:
                on_done(i, results[i])
    return results, n_passes


def _extract_heads(model, input_ids, positions, starts, sites, *, early_stop=True,
                   on_done=None, select=None):
    """:func:`_extract` for head-attention sites: one sequence per forward pass.

    Row ``k`` of sequence ``i``, site ``head_attn.l``: per head of layer ``l``, the
    attention mass from the sequence's last token (where a judge writes its answer)
    to tokens ``starts[i][k] .. positions[i][k]``. Only that one query row of each
    layer is computed (:func:`skafa.llm.head_attention_rows`); with ``early_stop``
    the pass ends after the deepest requested layer's attention.
    """
    import torch

    layout = decoder_layout(model)
    decoder = layout.decoder
    layers = [parse_site(s)[1] for s in sites]
    deepest = max(layers)
    stop_module = (getattr(layout.layers[deepest], "self_attn", None)
                   if early_stop and deepest < layout.n_layers - 1 else None)
    device = layout.embedding.weight.device
    lengths = [int(np.asarray(ids).shape[0]) for ids in input_ids]
    results = [None] * len(lengths)
    n_passes = 0

    def stop(module, args, output):
        raise _StopForward

    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):  # longest first
        batch = [i]
        if select is not None:
            batch = list(select(batch))
            if not batch:
                continue
        [i] = batch
        pos = np.asarray(positions[i], dtype=np.int64)
        first = np.asarray(starts[i], dtype=np.int64)
        if first.shape != pos.shape or (pos.size and (
                first.min() < 0 or np.any(first > pos) or pos.max() >= lengths[i])):
            raise ValueError(
                f"sequence {i}: starts and positions must have one shape and satisfy "
                f"0 <= starts <= positions <= {lengths[i] - 1}.")
        ids = torch.from_numpy(np.asarray(input_ids[i], dtype=np.int64)[None]).to(device)
        with _model_lock(decoder):
            handle = None if stop_module is None else stop_module.register_forward_hook(stop)
            try:
                with torch.inference_mode(), banded_sliding_window_attention(decoder), \
                        head_attention_rows(decoder, [-1]) as rows:
                    try:
                        decoder(input_ids=ids, use_cache=False)
                    except _StopForward:
                        pass
            finally:
                if handle is not None:
                    handle.remove()
        spans = list(zip(first.tolist(), (pos + 1).tolist()))
        out = np.empty((pos.size, len(sites), rows.n_heads), dtype=np.float32)
        for column, layer in enumerate(layers):
            # (n_heads, n_keys) at the one query row -> (n_turns, n_heads)
            out[:, column, :] = turn_attention_mass(rows.weights[layer][0, :, 0], spans).T
        n_passes += 1
        results[i] = out
        if on_done is not None:
            on_done(i, out)
    return results, n_passes


# ------------------------------------------------------------------ dispatch
_VERIFIED = {}


def _is_torch_dtype(dtype):
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(dtype, torch.dtype)


def _task_model(job):
    """The job's model in this process: loaded once (process-level cache), then checked.

    Checked once per process and spec: the architecture fingerprint and the
    identity (file digest, ...) must be those the parent fitted with, so a
    worker with other model files under the same path fails loudly.
    """
    from ._models import registered_models

    if (job["identity"].get("kind") == "registered"
            and str(job["model"]) not in registered_models()):
        raise RuntimeError(
            f"model {str(job['model'])!r} is registered (skafa.llm.register_model) only in "
            f"the process that registered it, so worker process {os.getpid()} cannot load "
            "it. With n_jobs != 1 on a process or Dask backend, pass a path or name every "
            "worker can load (a saved folder, a .gguf file, 'smollm2', a hub id), or use "
            "joblib.parallel_config(backend='threading').")
    check = json.dumps([str(job["model"]), job["device"], job["dtype"], job["identity"],
                        job["fingerprint"]], sort_keys=True, default=str)
    convert_dir = _converted_dir(job["cache_dir"])
    model, _ = load_checked_model(job["model"], device=job["device"], dtype=job["dtype"],
                                  convert_dir=convert_dir)
    if _VERIFIED.get(id(model)) != check:
        load_checked_model(job["model"], device=job["device"], dtype=job["dtype"],
                           fingerprint=job["fingerprint"], identity=job["identity"],
                           owner="TurnActivationTransformer (worker process)",
                           convert_dir=convert_dir)
        _VERIFIED[id(model)] = check
    return model


def _n_heads(model):
    """Attention heads per layer of ``model``."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return int(config.num_attention_heads)


def _check_finite(acts, item, sites):
    finite = np.isfinite(acts)
    if not finite.all():
        turn, site = (int(v) for v in np.argwhere(~finite.all(axis=2))[0])
        raise ValueError(
            f"{item['where']}: non-finite activation at turn {turn} "
            f"(speaker {item['speakers'][turn]!r}), site {sites[site]!r}. "
            "Try dtype='float32' or check the model weights."
        )


def _extract_task(job, items, cache=None, progress=None, elsewhere=None):
    """Extract ``items`` (dicts of ``key``, ``input_ids``, ``positions``, ``starts``, ...).

    Runs in the calling process (``cache`` and ``progress`` given) or in a joblib
    worker (the job's ``cache_dir`` is opened here, disk only). Every conversation
    is written to the cache as soon as its batch is done, so a worker that dies
    loses at most the batch in flight; a worker first re-reads the disk cache, so
    a retried task (or another process that got there first) skips what is done.

    With a disk cache, each conversation is looked up again right before its batch
    runs (another process may have written it meanwhile) and claimed
    (:meth:`skafa.llm.ActivationCache.claim`); one claimed by another process is
    put off until everything else is done; then, holding no claim, this process
    waits while a running process of this host holds that claim
    (:func:`skafa.utils.claims.wait_while_claimed`), and takes the conversation
    from the cache or, if it is still missing (its claimant died, or runs on
    another host), extracts it here. Once written, a conversation's claim is
    removed, whoever made it.

    ``elsewhere(k, flag)``, when given, hears that item ``k`` is put off for
    another process (``True``) or, after all, extracted here (``False``).

    Returns
    -------
    values : list of ndarray, in the order of ``items``
    n_passes : int
        Forward passes run.
    n_hits : int
        Items found in the disk cache on the worker's re-checks.
    """
    sites = job["sites"]
    model = _task_model(job)
    hidden = job.get("width") or int(decoder_layout(model).embedding.weight.shape[-1])
    recheck = cache is None
    if cache is None and job["cache_dir"] is not None:  # a worker: the parent's folder and key
        cache = (job["cache"].disk_only() if job.get("cache") is not None
                 else ActivationCache(job["cache_dir"], memory=False))
    shared = cache is not None and cache.directory is not None
    out = [None] * len(items)
    todo = list(range(len(items)))
    if recheck and cache is not None:
        todo = []
        for k, item in enumerate(items):
            hit = cache.get(item["key"], sites, n_turns=len(item["positions"]),
                            hidden_size=hidden)
            if hit is None:
                todo.append(k)
            else:
                out[k] = np.array(hit)
    n_hits = len(items) - len(todo)
    mine, deferred = set(), []
    # What the disk held at the first look: a file is read again only once it changes
    # (a corrupt entry is reported once, then overwritten by this extraction).
    seen = {k: cache.stat(items[k]["key"]) for k in todo} if shared else {}

    def deliver(k, acts):
        out[k] = acts
        if progress is not None:
            progress(k, acts)

    def take(k, honour_claims):
        """Whether to run item ``k`` now (else it was found, or is put off)."""
        nonlocal n_hits
        item = items[k]
        if k in mine:
            return True
        now = cache.stat(item["key"])
        if now is not None and now != seen.get(k):
            seen[k] = now
            hit = cache.get(item["key"], sites, n_turns=len(item["positions"]),
                            hidden_size=hidden)
            if hit is not None:
                n_hits += 1
                deliver(k, np.array(hit))
                return False
        if cache.claim(item["key"]):
            mine.add(k)
        elif honour_claims:
            deferred.append(k)
            if elsewhere is not None:
                elsewhere(k, True)
            return False
        if not honour_claims and elsewhere is not None:
            elsewhere(k, False)  # put off, then not found: extracted here after all
        return True

    def done(k, acts):
        item = items[k]
        _check_finite(acts, item, sites)
        if cache is not None:
            cache.put(item["key"], sites, acts)
        if shared:  # the entry exists: no claim on it means anything now, stale ones too
            cache.release(item["key"])
            mine.discard(k)
        deliver(k, acts)

    def run(ks, honour_claims):
        select = None
        if shared:
            def select(batch):
                return [b for b in batch if take(ks[b], honour_claims)]
        try:
            return _extract(
                model, [items[k]["input_ids"] for k in ks], [items[k]["positions"] for k in ks],
                sites, starts=(None if not (job["mean"] or job.get("heads"))
                               else [items[k]["starts"] for k in ks]),
                batch_size=job["batch_size"], pad_token_id=job["pad"],
                on_done=lambda b, acts: done(ks[b], acts), select=select)[1]
        except SequenceTooLarge as exc:
            raise MemoryError(f"{items[ks[exc.index]]['where']}: {exc}") from None

    n_passes = 0
    try:
        if todo:
            n_passes += run(todo, honour_claims=True)
        if deferred:  # claimed elsewhere: by now in the cache, or extracted here
            for k in sorted(deferred):  # holding no claim: a running claimant is waited for
                key = items[k]["key"]
                if job.get("verbose") and cache.claimed_by_live_process(key):
                    say("TurnActivationTransformer",
                        f"waiting for {items[k]['where']}: a running process of this "
                        "machine is extracting it (its claim file: "
                        f"{os.path.basename(cache.claim_path(key))})")
                wait_while_claimed(cache.claim_path(key),
                                   lambda key=key, k=k: cache.stat(key) not in (None, seen.get(k)))
            n_passes += run(sorted(deferred), honour_claims=False)
    finally:
        for k in mine:
            cache.release(items[k]["key"])
    return out, n_passes, n_hits


_LOCAL_BACKENDS = ("SequentialBackend", "ThreadingBackend", "LokyBackend",
                   "MultiprocessingBackend")


def _n_workers(n_jobs):
    """Workers joblib would use; 1 means "extract in this process".

    ``n_jobs=1`` always runs here (scikit-learn's convention). Under a cluster
    backend (Dask, ...) the cluster decides even when it reports one worker
    right now (e.g. while a lost worker restarts): the work still goes there.
    """
    from joblib import effective_n_jobs
    from joblib.parallel import get_active_backend

    if n_jobs == 1:
        return 1
    n = effective_n_jobs(n_jobs)
    if n == 1 and type(get_active_backend()[0]).__name__ not in _LOCAL_BACKENDS:
        return 2
    return n


def _worker_threads(n_workers):
    """Torch threads one extraction worker will run with (what its ETA is timed at).

    joblib's loky workers get ``cpu_count() // n_workers`` threads each (its inner
    thread limit); in this process, or under another backend, this process's count.
    """
    import torch
    from joblib import cpu_count
    from joblib.parallel import get_active_backend

    here = torch.get_num_threads()
    if n_workers > 1 and type(get_active_backend()[0]).__name__ == "LokyBackend":
        # joblib's own count (CPU affinity and cgroup limits), as its worker limit uses
        return max(1, min(here, cpu_count() // n_workers))
    return here


def _chunks(lengths, batch_size, n_workers):
    """Tasks for the workers: the serial run's batches, or length-sorted slices ("auto")."""
    if batch_size != "auto":
        return length_batches(lengths, batch_size)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n_tasks = min(len(order), 4 * max(1, n_workers))
    return [order[t::n_tasks] for t in range(n_tasks)]


# ------------------------------------------------------------------ estimator
def _today():
    """Today's date (ISO); part of the cache key when a chat template's date is unpinned."""
    return datetime.date.today().isoformat()


def _tokenizer_fingerprint(tokenizer):
    """sha256 of what makes a tokenizer render and split text the way it does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = {
        "class": type(tokenizer).__name__,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "backend": backend.to_str() if backend is not None else None,
        "special_tokens": {k: str(v) for k, v in
                           sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())},
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def _where(index, conversation):
    return describe_conversation(index, task_id=conversation.task_id,
                                 record_id=conversation.record_id)


class TurnActivationTransformer(PersistenceMixin, TransformerMixin, BaseEstimator):
    """Turn conversations into per-turn hidden states of a language model.

    For every conversation: render the prompt, run one forward pass of the base
    decoder, and read each requested site at the token holding each turn's last
    character (``read="last"``), averaged over the turn's line (``read="mean"``),
    at the turn's recap line after the transcript (``read="recap"``) or at the
    turn's line in a second copy of the transcript (``read="echo"``).
    The result is a :class:`~skafa.features.TurnFeatures` with values of shape
    ``(n_turns_total, n_sites, hidden_size)`` (float32).

    Parameters
    ----------
    model : str or ModelHandle, default="smollm2"
        Which model: a registered name (:func:`skafa.llm.register_model`), a
        local folder, a ``.gguf`` file or a hub id, loaded lazily by
        :func:`skafa.llm.load_model` (process-level cache). A *name*, never a
        loaded model: cloning and pickling then never copy weights.
    sites : None, "all", str or list of str, default=None
        Sites to read (see :mod:`skafa.llm`); ``None`` reads all ``2L + 1``;
        ``"stride:K"`` reads every K-th ``resid_pre`` layer and ``resid_final``
        (:func:`skafa.llm.stride_sites`).
        Reading every site costs the same single forward pass, so keep the default
        and select sites downstream unless memory is tight.
        Head-attention sites ``head_attn.<l>`` (``"head_attn"``: every layer) are
        read instead of hidden states, never mixed with them: per turn, one
        feature per head of layer ``l``, the attention mass from the prompt's
        *answer position* to the turn's tokens. The answer position is the
        prompt's last token (after the instruction and, with a chat template,
        the assistant header), where a judge writes the first token of its
        answer; the turn's tokens are its line in the transcript
        (:attr:`skafa.llm.Encoding.turn_start_positions` to
        :attr:`~skafa.llm.Encoding.turn_positions`), whatever ``read`` (which
        still decides the prompt). Only that query row of each layer is computed
        (:func:`skafa.llm.head_attention_rows`), one conversation per forward
        pass; keyed apart in the cache. Probes over them are *locator-head
        probes*; :func:`skafa.metrics.locator_head_accuracy` scores each head.
    read : {"last", "mean", "recap", "echo"}, default="last"
        Where a turn's vector comes from. ``"last"``: the token holding the turn's
        last character (:attr:`skafa.llm.Encoding.turn_positions`), which in a
        causal model has seen the whole turn and everything before it. ``"mean"``:
        the average over the tokens of the turn's line, from its first token
        (:attr:`skafa.llm.Encoding.turn_start_positions`) to that last token.
        ``"recap"``: the prompt continues after the transcript with the
        instruction and one short recap line per turn (``recap_format`` of the
        template, e.g. ``Step 3 (WebSurfer)``); the turn is read at the last token
        of its recap line (:attr:`skafa.llm.Encoding.recap_positions`), which
        has seen the whole run. A few tokens per turn. ``"echo"``: the prompt
        continues with the instruction and the whole transcript again; the turn is
        read at its last token in the copy
        (:attr:`skafa.llm.Encoding.echo_positions`). About twice the tokens;
        shortening and the context check count the copy. One forward pass per
        conversation in every case; part of the cache key.
    prompt : PromptTemplate, default=None
        How a conversation becomes a prompt; ``None`` uses ``PromptTemplate()``.
    chat_template_kwargs : dict, default=None
        Extra variables for the chat template, e.g. ``{"date_string": "26 Jul 2024"}``
        to pin a template that would otherwise insert today's date.
    device : str, default="cpu"
        Torch device, e.g. ``"cuda"`` (first GPU) or ``"cuda:1"``. Not part of the
        cache key. With ``n_jobs``, every worker loads the model on this device.
    dtype : str or torch.dtype, default="auto"
        Compute dtype of the model: ``"auto"`` (bfloat16 on CUDA and on CPUs with
        native bfloat16 units, else float32; :func:`skafa.llm.resolve_dtype`),
        ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"`` or the torch
        dtype. Activations are gathered and returned as float32 whatever the
        compute dtype. The resolved dtype (``dtype_``) is part of the cache key
        (``"auto"`` resolved to float32 and ``"float32"`` share entries; ``"bfloat16"``
        and ``torch.bfloat16`` share entries).
    cache_dir : str or path-like, default=None
        Directory of an on-disk activation cache shared across processes. A GGUF
        model is also kept there, converted to safetensors, in
        ``<cache_dir>/models`` (``load_model(convert_dir=...)``), so later
        processes load it in seconds instead of re-parsing the GGUF file.
    memory_cache : bool, default=True
        Use the process-wide in-memory LRU cache
        (:func:`skafa.llm.shared_memory_cache`).
    batch_size : int or "auto", default=1
        Conversations per forward pass (sorted by length, right-padded, with an
        attention mask). ``"auto"`` fills each batch up to 80% of the device's free
        memory by a per-token estimate (see :func:`extract_activations`) and raises
        ``MemoryError`` naming the conversation when one alone does not fit.
    n_jobs : int, default=None
        Workers for the conversations that miss the cache, through joblib
        (:class:`sklearn.utils.parallel.Parallel`). ``None`` means 1 unless in a
        :func:`joblib.parallel_config` context; ``-1`` means all processors. Under
        ``joblib.parallel_config(backend="dask")`` the workers are those of a Dask
        cluster. Each worker loads ``model`` by name or path once per process (so
        a name from :func:`skafa.llm.register_model` works only with the
        threading backend), re-checks and writes the shared ``cache_dir`` as it
        goes, and the parent assembles the results in input order. Workers get
        the same batches as a serial run, so results are bitwise equal to it.
    verbose : int, default=0
        ``> 0`` shows a progress bar: forward FLOPs done and per second (each
        prompt weighted by :func:`skafa.llm.forward_flops`, so its ETA holds when
        prompt lengths differ), with conversations done.

    Attributes
    ----------
    sites_ : tuple of str
        The sites read, in output order.
    n_layers_ : int
        Number of decoder layers.
    hidden_size_ : int
        Width of the residual stream.
    n_features_out_ : int
        Features per site (``hidden_size_``; the number of attention heads for
        head-attention sites).
    model_fingerprint_ : dict
        Architecture fingerprint (:func:`skafa.llm.model_fingerprint`).
    dtype_ : str
        The compute dtype ``dtype`` resolved to (:func:`skafa.llm.resolve_dtype`),
        used from then on, also after :func:`skafa.load` on another machine.
    model_identity_ : dict
        Identity of the weights (:func:`skafa.llm.model_identity`): file digest
        for GGUF files, weights digest for registered models, ...
    context_length_ : int
        Longest prompt accepted (tokens).
    prompt_ : PromptTemplate
        The prompt template used.
    rendering_ : {"chat", "plain"}
        Whether prompts go through the tokenizer's chat template or are plain text
        (:meth:`skafa.llm.PromptTemplate.rendering`; part of the cache key).
    tokenizer_fingerprint_ : str
        sha256 of the tokenizer and its chat template (part of the cache key).

    Notes
    -----
    :meth:`transform` changes no fitted attribute. What it did (forward passes run,
    cache hits and misses) is reported by :attr:`run_stats`, which is run-time
    state: reset by :meth:`fit`, not saved by :func:`skafa.save`, not pickled.

    Notes
    -----
    Conversations with identical content (same cache key) are extracted once per
    :meth:`transform`, whatever their ids. Across processes that do not share a
    :meth:`transform` call (two jobs on one ``cache_dir``), a conversation is
    looked up in the disk cache again right before its batch runs and claimed
    while it is extracted (:meth:`skafa.llm.ActivationCache.claim`): a process
    that meets another's claim does the rest first, then takes that conversation
    from the cache, so two jobs started on the same data split the work instead
    of repeating it. A conversation still being extracted at the end by a running
    process of the same host is waited for; one whose claim a killed process left
    behind, or that a process of another host claims, is extracted again, which is
    harmless: the results are identical and entries are written atomically.

    Examples
    --------
    >>> from skafa.llm import TurnActivationTransformer
    >>> extractor = TurnActivationTransformer("smollm2", sites=["resid_pre.12"])  # doctest: +SKIP
    >>> X = extractor.fit_transform(conversations)  # doctest: +SKIP
    >>> X.values.shape  # doctest: +SKIP
    (n_turns_total, 1, 576)
    """

    _parameter_constraints: dict = {
        "model": "no_validation",  # checked in fit, with a hint on registering models
        "sites": [None, str, "array-like"],
        "read": [StrOptions(set(READS))],
        "prompt": [PromptTemplate, None],
        "chat_template_kwargs": [Mapping, None],
        "device": [str],
        # a name ("bfloat16") or a torch dtype: checked in fit (skafa.llm.load_model)
        "dtype": "no_validation",
        "cache_dir": [str, os.PathLike, None],
        "memory_cache": ["boolean"],
        "batch_size": [Interval(numbers.Integral, 1, None, closed="left"),
                       StrOptions({"auto"})],
        "n_jobs": [numbers.Integral, None],
        "verbose": ["verbose"],
    }

    # skafa.persistence: never saved (rebuilt lazily or below); load(model=, device=)
    # replace those parameters; summarised in skafa.json and checked on load.
    _runtime_attributes = frozenset({"_model", "_tokenizer", "_layout", "_cache",
                                     "_run_stats", "_deferred_model_check"})
    _load_overrides = frozenset({"model", "device"})
    _reads_model = True

    def _restore_after_load(self, context):
        """Check the model this extractor will use (see skafa.persistence)."""
        if hasattr(self, "model_fingerprint_"):
            checked = verify_saved_model(self, context)
            if checked is None:  # verify_model=False: the first transform checks, as load would
                self._deferred_model_check = {
                    "allow_mismatch": bool(context.model_named
                                           and context.allow_model_mismatch),
                    "saved_at": context.saved_model_location}
            elif checked[2]:  # another model: its tokenizer keys the cache
                self.tokenizer_fingerprint_ = _tokenizer_fingerprint(checked[1])

    def __init__(self, model="smollm2", *, sites=None, read="last", prompt=None,
                 chat_template_kwargs=None, device="cpu", dtype="auto", cache_dir=None,
                 memory_cache=True, batch_size=1, n_jobs=None, verbose=0):
        self.model = model
        self.sites = sites
        self.read = read
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs
        self.device = device
        self.dtype = dtype
        self.cache_dir = cache_dir
        self.memory_cache = memory_cache
        self.batch_size = batch_size
        self.n_jobs = n_jobs
        self.verbose = verbose

    # -------------------------------------------------------------- sklearn
    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False
        tags.requires_fit = True
        tags.transformer_tags.preserves_dtype = []  # the input has no dtype
        tags.target_tags.required = False
        tags.non_deterministic = False
        return tags

    def __getstate__(self):
        state = dict(super().__getstate__())  # a copy: never strip the live object
        for name in self._runtime_attributes:
            state.pop(name, None)
        return state

    # -------------------------------------------------------------- helpers
    @property
    def run_stats(self):
        """What :meth:`transform` did since :meth:`fit` (run-time state, not fitted).

        Returns
        -------
        stats : dict
            ``n_forward_passes`` (forward passes run; cache hits run none),
            ``n_extracted`` (conversations those passes extracted; one that missed
            the cache at first but was written meanwhile by another process sharing
            ``cache_dir`` counts as a disk hit, not here) and the
            counters of this estimator's activation cache (``memory_hits``,
            ``disk_hits``, ``misses``, ``corrupt``, ``writes``, ...). A copy: later
            calls of :meth:`transform` do not change it. Counting restarts at
            :meth:`fit`, and at zero after unpickling or :func:`skafa.load`.
        """
        check_is_fitted(self, "sites_")
        cache = getattr(self, "_cache", None)
        run = getattr(self, "_run_stats", {})
        stats = {"n_forward_passes": int(run.get("n_forward_passes", 0)),
                 "n_extracted": int(run.get("n_extracted", 0))}
        if cache is not None:
            stats.update(cache.stats)
        return stats

    def _load(self, fingerprint=None, identity=None):
        """Load the model; with ``fingerprint`` and ``identity`` (a fitted extractor),
        check it is the one fitted with: other weights are refused as by
        :func:`skafa.load`, unless the load that deferred the check
        (``verify_model=False``) named the model and allowed the mismatch."""
        deferred = getattr(self, "_deferred_model_check", None) or {}
        model, tokenizer = load_checked_model(
            self.model, device=self.device, dtype=getattr(self, "dtype_", self.dtype),
            fingerprint=fingerprint, identity=identity, owner=type(self).__name__,
            convert_dir=_converted_dir(self.cache_dir),
            allow_mismatch=bool(deferred.get("allow_mismatch")),
            saved_at=deferred.get("saved_at"))
        if identity is not None:
            from ._models import identity_matches, model_identity

            now = model_identity(self.model)
            if now != identity:  # went on (allowed, or the same weights elsewhere)
                if not identity_matches(identity, self.model):
                    # another model: its identity and tokenizer key the cache
                    self.tokenizer_fingerprint_ = _tokenizer_fingerprint(tokenizer)
                self.model_identity_ = now
        self._deferred_model_check = None
        self._model = model
        self._tokenizer = tokenizer
        self._layout = decoder_layout(model)
        return model

    def _ensure_loaded(self):
        if getattr(self, "_model", None) is None:
            self._load(fingerprint=self.model_fingerprint_,
                       identity=getattr(self, "model_identity_", None))
        if getattr(self, "_cache", None) is None:
            self._cache = ActivationCache(self.cache_dir, memory=bool(self.memory_cache))
        if getattr(self, "_run_stats", None) is None:
            self._run_stats = {"n_forward_passes": 0, "n_extracted": 0}

    def _restricted(self, sites):
        """A fitted view of this extractor that reads only ``sites`` (for predicting).

        The view's :attr:`sites_` are ``sites`` in the order of this extractor's
        :attr:`sites_`, so its forward passes stop right after the deepest of them
        unless it is ``resid_final`` (:class:`SiteReader`), and cache entries
        written with more sites serve it (:meth:`ActivationCache.get` slices
        them). It shares this extractor's loaded model, tokenizer, activation
        cache and :attr:`run_stats` counters (nothing is loaded twice) and changes
        none of its fitted attributes; its other parameters are this extractor's
        as they are now. Built per call: cheap (no copy of any array).

        Parameters
        ----------
        sites : sequence of str
            Some of :attr:`sites_` (at least one).

        Returns
        -------
        view : TurnActivationTransformer
            ``self`` when ``sites`` are all of :attr:`sites_`.

        Raises
        ------
        ValueError
            If ``sites`` is empty or names a site this extractor does not read.
        """
        check_is_fitted(self, "sites_")
        own = tuple(str(s) for s in self.sites_)
        wanted = [str(s) for s in sites]
        missing = [s for s in wanted if s not in own]
        if not wanted or missing:
            raise ValueError(
                f"cannot restrict {type(self).__name__} to the sites {wanted}: "
                + (f"it does not read {missing} " if missing else "no site given ")
                + f"(its sites_ are {list(own)}).")
        chosen = tuple(s for s in own if s in set(wanted))
        if chosen == own:
            return self
        self._ensure_loaded()  # the view shares the loaded model, cache and counters
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)  # not copy.copy: __getstate__ drops the model
        view.sites = list(chosen)
        view.sites_ = chosen
        return view

    # ------------------------------------------------------------------ API
    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None):
        """Load the model and fix the sites; no forward pass.

        Parameters
        ----------
        X : list of Conversation
            Checked for type only (extraction needs no training).
        y : None
            Ignored.

        Returns
        -------
        self : TurnActivationTransformer
        """
        from ._models import context_length, model_fingerprint, model_identity

        if not isinstance(self.model, (str, os.PathLike, ModelHandle)):
            raise TypeError(
                "model must be a model name or path (str), not a loaded "
                f"{type(self.model).__name__}: skafa loads and caches models itself so "
                "that cloning an estimator never copies weights. Register a model you "
                "loaded yourself with skafa.llm.register_model(name, model, tokenizer) "
                "and pass the name."
            )
        check_conversations(X, "TurnActivationTransformer")
        self.dtype_ = resolve_dtype(self.dtype, self.device, model=self.model)
        model = self._load()
        layout = self._layout
        self.n_layers_ = layout.n_layers
        self.hidden_size_ = int(layout.embedding.weight.shape[-1])
        self.sites_ = validate_sites(self.sites, self.n_layers_)
        heads = [is_head_attention_site(s) for s in self.sites_]
        if any(heads) and not all(heads):
            raise ValueError(
                f"sites={list(self.sites_)} mixes head-attention sites (head_attn.<l>) with "
                "hidden-state sites; their rows have different widths. Use one "
                "TurnActivationTransformer for each (e.g. in a TurnFeatureUnion).")
        self.n_features_out_ = _n_heads(model) if all(heads) else self.hidden_size_
        self.model_fingerprint_ = model_fingerprint(model)
        self.model_identity_ = model_identity(self.model)
        self.context_length_ = int(context_length(model))
        self.prompt_ = self.prompt if self.prompt is not None else PromptTemplate()
        self.rendering_ = self.prompt_.rendering(self._tokenizer)
        self.tokenizer_fingerprint_ = _tokenizer_fingerprint(self._tokenizer)
        self._cache = ActivationCache(self.cache_dir, memory=bool(self.memory_cache))
        self._run_stats = {"n_forward_passes": 0, "n_extracted": 0}
        return self

    def get_feature_names_out(self, input_features=None):
        """Names of the features of every site: ``x0`` ... ``x{n_features_out_ - 1}``.

        The same names :meth:`TurnFeatures.concatenate
        <skafa.TurnFeatures.concatenate>` gives unnamed features, so
        ``TurnFeatureUnion([("acts", extractor), ...]).get_feature_names_out()``
        matches the ``feature_names`` of its output.

        Parameters
        ----------
        input_features : None
            Ignored (the input is conversations).

        Returns
        -------
        feature_names_out : ndarray of str, shape (n_features_out_,)
            For head-attention sites ``x{h}`` is head ``h``.
        """
        check_is_fitted(self, "sites_")
        return np.asarray([f"x{k}" for k in range(self.n_features_out_)], dtype=object)

    def _heads(self):
        """Whether this extractor reads head-attention sites."""
        return is_head_attention_site(self.sites_[0])

    def _key(self, conversation, template_date=None):
        return activation_key(
            model_identity=self.model_identity_,
            model_fingerprint=self.model_fingerprint_,
            dtype=resolve_dtype(getattr(self, "dtype_", self.dtype), self.device),
            # The prompt of this read and rendering; for read="last"/"mean" through a
            # chat template this is prompt_.fingerprint() (keys written before
            # "recap", "echo" and plain rendering existed stay valid).
            prompt_fingerprint=self.prompt_.fingerprint(
                read=self.read, rendering=self.prompt_.rendering(self._tokenizer)),
            chat_template_kwargs=self.chat_template_kwargs,
            conversation=conversation,
            tokenizer_fingerprint=self.tokenizer_fingerprint_,
            template_date=template_date,
            read=self.read,
            site_kind="head_attn" if self._heads() else None,
        )

    def transform(self, X):
        """Read the fitted sites at every turn of every conversation.

        Parameters
        ----------
        X : list of Conversation

        Returns
        -------
        features : TurnFeatures
            ``values`` float32 ``(n_turns_total, n_sites, hidden_size)``, ``sites``
            = :attr:`sites_`, ``speakers`` per turn, ``task_ids`` per conversation.

        Raises
        ------
        ValueError
            If a prompt is longer than :attr:`context_length_` (naming the
            conversation, its task id and token count), or an activation is not
            finite (naming conversation, turn and site), or ``X`` is empty.
        """
        check_is_fitted(self, "sites_")
        X = check_conversations(X, "TurnActivationTransformer")
        self._ensure_loaded()
        cache = self._cache
        sites, hidden = self.sites_, self.n_features_out_
        n_turns = np.array([len(c) for c in X], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(n_turns)]).astype(np.int64)
        values = np.empty((int(offsets[-1]), len(sites), hidden), dtype=np.float32)

        from ._prompt import template_uses_date

        kwargs = self.chat_template_kwargs or {}
        date = (_today() if template_uses_date(self._tokenizer) and "date_string" not in kwargs
                else None)
        keys = [self._key(c, date) for c in X]
        todo, first = [], {}
        # SIGTERM or Ctrl-C during the cache reads or the extraction stops: an entry
        # being read is left alone, not counted as corrupt (a no-op off the main thread)
        with stop_requests():
            for i, (conv, key) in enumerate(zip(X, keys)):
                if key in first:  # the same content twice: extracted once, copied below
                    todo.append(i)
                    continue
                hit = cache.get(key, sites, n_turns=len(conv), hidden_size=hidden)
                if hit is None:
                    todo.append(i)
                    first[key] = i
                else:
                    values[offsets[i]:offsets[i + 1]] = hit
            if todo:
                self._compute(X, list(first.values()), keys, values, offsets)

        if todo:
            for i in todo:
                j = first[keys[i]]
                if j != i:
                    values[offsets[i]:offsets[i + 1]] = values[offsets[j]:offsets[j + 1]]
        speakers = [s for c in X for s in c.speakers]
        return TurnFeatures(values, offsets, sites=sites, speakers=speakers,
                            task_ids=[c.task_id for c in X])

    def stream(self, site, *, task, task_id=None, label="TurnStream"):
        """Start reading a live run at one site, one turn at a time.

        The returned :class:`~skafa.llm.TurnStream` renders the prompt as this
        extractor does, keeps the model's KV cache between turns (an appended turn
        costs a forward pass over its own tokens only) and gives one vector per
        turn, equal to the one :meth:`transform` reads on the whole run (up to
        float rounding). Used by :class:`skafa.online.AuditSession`.

        Parameters
        ----------
        site : str
            One of the sites this extractor can read (``validate_sites``).
        task : str
            The task given to the agents.
        task_id : str, optional
            Named in messages.
        label : str, default="TurnStream"
            Names the stream in messages.

        Returns
        -------
        TurnStream
            The text before the first turn (system message, task) is already read.

        Raises
        ------
        ValueError
            The prompt is not streamable (``segment_turns=False``, an expected
            answer, or a read that needs the whole run).
        """
        from ._streaming import TurnStream

        check_is_fitted(self, "sites_")
        self._ensure_loaded()
        template = self.prompt_
        [site] = validate_sites([site], self.n_layers_)
        if is_head_attention_site(site):
            raise ValueError(f"site {site!r}: head-attention sites are read on the whole run "
                             "(from the prompt's answer position), not streamed.")
        return TurnStream(self._model, self._tokenizer, SiteReader(self._layout, [site]),
                          template=template,
                          read=self.read, chat_template_kwargs=self.chat_template_kwargs,
                          context_length=self.context_length_, task=task, task_id=task_id,
                          label=label)

    def estimate_cost(self, X, *, calibrate=True):
        """What :meth:`transform` would do on ``X``, and how long it would take.

        Nothing is extracted and no fitted attribute changes. The time is a
        projection: :func:`skafa.llm.forward_flops` of every prompt that misses
        the cache, its weight and attention terms priced apart from one timed pass
        of 512 tokens and one of up to 4,096 on this model and device
        (:func:`skafa.llm.calibrate_seconds`; attention runs at a lower rate, so
        one short pass alone would promise too little time for long prompts),
        timed with the torch threads one worker will have (joblib's process
        workers of ``n_jobs`` get ``cpu_count() // n_jobs``) and divided by the
        number of workers.

        Parameters
        ----------
        X : list of Conversation
        calibrate : bool, default=True
            Time the calibration pass (a few seconds on a CPU); ``False`` leaves
            the rate and the ETA as ``None``.

        Returns
        -------
        dict
            ``n_conversations``, ``n_cached``, ``n_to_extract``,
            ``n_tokens_to_extract``, ``flops_to_extract``, ``tokens_per_s`` and
            ``flops_per_s`` (the short calibration pass), ``calibration`` (every
            timed pass), ``eta_s``, ``workers`` (joblib's count for
            ``n_jobs``; the ETA divides by it) and ``summary`` (one line to print,
            naming the resolved compute dtype).
        """
        from ._cost import calibrate_seconds, forward_flops

        check_is_fitted(self, "sites_")
        X = check_conversations(X, "TurnActivationTransformer")
        self._ensure_loaded()
        from ._prompt import template_uses_date

        kwargs = self.chat_template_kwargs or {}
        date = (_today() if template_uses_date(self._tokenizer) and "date_string" not in kwargs
                else None)
        todo, seen = [], set()
        for i, conv in enumerate(X):
            key = self._key(conv, date)
            if key in seen or self._cache.contains(key, self.sites_, n_turns=len(conv),
                                                   hidden_size=self.n_features_out_):
                continue
            seen.add(key)
            todo.append(i)
        n_tokens = [int(self.prompt_.encode(X[i], self._tokenizer,
                                            chat_template_kwargs=self.chat_template_kwargs,
                                            index=i, read=self.read,
                                            max_tokens=self.context_length_).n_tokens)
                    for i in todo]
        flops = float(np.sum(forward_flops(self._model, n_tokens))) if todo else 0.0
        workers = max(1, _n_workers(self.n_jobs))
        cal = None
        if calibrate and todo:
            import torch

            # timed at a worker's threads: loky workers of n_jobs run with fewer
            here = torch.get_num_threads()
            torch.set_num_threads(_worker_threads(workers))
            try:
                cal = calibrate_seconds(self._model, n_tokens)
            finally:
                torch.set_num_threads(here)
        rate = None if cal is None else cal["passes"][0]
        eta = None if cal is None else float(np.sum(cal["seconds"])) / workers
        summary = (f"{len(todo)} of {len(X)} conversations to extract "
                   f"({len(X) - len(todo)} cached), {sum(n_tokens):,} prompt tokens, "
                   f"{flops / 1e12:.2f} TFLOP, model in "
                   f"{resolve_dtype(getattr(self, 'dtype_', self.dtype), self.device)}")
        if rate is not None:
            timed = " and ".join(f"{p['tokens_per_s']:.0f} tokens/s at {p['n_tokens']}"
                                 for p in cal["passes"])
            summary += (f"; calibration {timed} tokens on {self.device}, {workers} "
                        f"worker(s): ETA {eta / 60:.1f} min")
        return {"n_conversations": len(X), "n_cached": len(X) - len(todo),
                "n_to_extract": len(todo), "n_tokens_to_extract": int(sum(n_tokens)),
                "flops_to_extract": flops,
                "tokens_per_s": None if rate is None else rate["tokens_per_s"],
                "flops_per_s": None if rate is None else rate["flops_per_s"],
                "calibration": None if cal is None else cal["passes"],
                "eta_s": eta, "workers": workers, "summary": summary}

    def _compute(self, X, todo, keys, values, offsets):
        from ._prompt import check_fits

        # Render and check every prompt before spending any compute.
        input_ids, positions, starts = [], [], []
        for i in todo:
            conv = X[i]
            enc = self.prompt_.encode(conv, self._tokenizer,
                                      chat_template_kwargs=self.chat_template_kwargs, index=i,
                                      read=self.read, max_tokens=self.context_length_)
            check_fits(enc, self.context_length_, i, conv)
            pos = np.asarray(enc.turn_positions if self._heads() else enc.read_positions,
                             dtype=np.int64)
            if pos.shape != (len(conv),):
                raise RuntimeError(
                    f"{_where(i, conv)}: the prompt gave {pos.shape[0]} turn positions for "
                    f"{len(conv)} turns."
                )
            input_ids.append(np.asarray(enc.input_ids, dtype=np.int64))
            positions.append(pos)
            starts.append(np.asarray(enc.turn_start_positions, dtype=np.int64))

        sites = self.sites_
        bar = None
        if self.verbose and self.verbose > 0:
            from ..utils.progress import WorkBar
            from ._cost import forward_flops

            bar = WorkBar(forward_flops(self._model, [len(ids) for ids in input_ids]),
                          "skafa: extracting activations")

        pad = getattr(self._tokenizer, "pad_token_id", None)
        job = {
            "model": self.model, "device": self.device,
            "dtype": getattr(self, "dtype_", self.dtype),
            "identity": self.model_identity_, "fingerprint": self.model_fingerprint_,
            "sites": sites, "mean": READS[self.read].rows == "line", "pad": 0 if pad is None else int(pad),
            "heads": self._heads(), "width": int(self.n_features_out_),
            "batch_size": _check_batch_size(self.batch_size),
            "verbose": int(self.verbose or 0),
            "cache_dir": (None if self.cache_dir is None
                          else os.path.expanduser(os.fspath(self.cache_dir))),
            # workers open the same folder with the same cache key (SKAFA_CACHE_KEY...)
            "cache": None if self.cache_dir is None else self._cache.disk_only(),
        }
        items = [{"key": keys[i], "input_ids": ids, "positions": pos, "starts": first,
                  "where": _where(i, X[i]), "speakers": list(X[i].speakers)}
                 for i, ids, pos, first in zip(todo, input_ids, positions, starts)]

        def store(j, acts):
            i = todo[j]
            values[offsets[i]:offsets[i + 1]] = acts
            if bar is not None:
                bar.done(j)

        def elsewhere(j, flag):  # another process extracts it: not this one's work
            if bar is not None:
                bar.elsewhere(j, flag)

        n_workers = _n_workers(self.n_jobs)
        try:
            if n_workers == 1 or len(items) == 1:
                # In this process: the model is already loaded, the cache is ours.
                _, n_passes, n_hits = _extract_task(job, items, cache=self._cache,
                                                    progress=store, elsewhere=elsewhere)
            else:
                n_passes, n_hits = self._compute_parallel(job, items, store, n_workers)
        finally:
            if bar is not None:
                bar.close()
        self._run_stats["n_forward_passes"] += n_passes
        # found on disk at a re-check (another process wrote them meanwhile): not extracted
        self._run_stats["n_extracted"] += len(items) - n_hits

    def _compute_parallel(self, job, items, store, n_workers):
        """Dispatch the batches over joblib workers (any backend, e.g. Dask)."""
        from sklearn.utils.parallel import Parallel, delayed

        lengths = [int(item["input_ids"].shape[0]) for item in items]
        tasks = _chunks(lengths, job["batch_size"], n_workers)
        results = Parallel(n_jobs=self.n_jobs, return_as="generator")(
            delayed(_extract_task)(job, [items[j] for j in task]) for task in tasks)
        n_passes = n_hits = 0
        for task, (out, passes, hits) in zip(tasks, results):
            n_passes += passes
            n_hits += hits
            for j, acts in zip(task, out):
                # The worker wrote the disk cache; keep a copy in this process's memory.
                self._cache.put(items[j]["key"], job["sites"], acts, disk=False)
                store(j, acts)
        return n_passes, n_hits
