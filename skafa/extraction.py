"""Read a language model's hidden states at every turn: :class:`TurnActivationTransformer`.

For each conversation skafa renders one prompt (:mod:`skafa.prompt`), runs ONE
forward pass of the model's base decoder (never the LM head) and reads every
requested site (:mod:`skafa.sites`) at the token that holds each turn's last
character. Sites are read with forward hooks that gather only those positions
into a preallocated ``(n_turns, n_sites, hidden_size)`` buffer, so memory does not
grow with ``n_layers x n_tokens`` the way ``output_hidden_states=True`` does. When
no requested site is deeper than layer ``k``, the forward pass stops after
layer ``k``.

Results are cached per conversation (:mod:`skafa.cache`): in memory by default
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
from collections.abc import Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.utils.validation import check_is_fitted

from .cache import ActivationCache, activation_key
from .conversation import Conversation
from .features import TurnFeatures
from .sites import decoder_layout, parse_site, site_depth, validate_sites

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
        From :func:`skafa.sites.decoder_layout`.
    sites : sequence of str
        Valid site names (see :func:`skafa.sites.validate_sites`); the output has
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
                with torch.inference_mode():
                    try:
                        cache = ({"use_cache": False} if past_key_values is None else
                                 {"use_cache": True,
                                  _cache_kwarg(self.layout.decoder): past_key_values})
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


def _cache_kwarg(decoder):
    """Name of the decoder's KV-cache argument: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (earlier, deprecated later)."""
    import inspect

    params = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _batches(lengths, batch_size):
    """Indices sorted by decreasing length, cut into batches."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


def extract_activations(model, input_ids, positions, sites, *, starts=None, batch_size=1,
                        pad_token_id=0, early_stop=True, on_done=None):
    """Read ``sites`` at ``positions`` of each sequence, one forward pass per batch.

    The building block of :class:`TurnActivationTransformer`, usable on any
    loaded model (no prompt rendering, no caching).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A supported causal LM or its base decoder (see
        :func:`skafa.sites.decoder_layout`).
    input_ids : sequence of 1-D int arrays
        Token ids of each sequence.
    positions : sequence of 1-D int arrays
        Token positions to read in each sequence.
    sites : sequence of str
        Valid site names.
    starts : sequence of 1-D int arrays, optional
        With ``starts``, row ``k`` of sequence ``i`` is the *mean* of the sites over
        tokens ``starts[i][k] .. positions[i][k]`` (inclusive) instead of the value
        at ``positions[i][k]``. Spans may overlap; each needs
        ``0 <= starts[i][k] <= positions[i][k]``.
    batch_size : int, default=1
        Sequences per forward pass. Batches are formed by decreasing length and
        right-padded; with causal attention a real token never attends to the
        padding that follows it.
    pad_token_id : int, default=0
        Id written into padded slots (masked out; any valid id works).
    early_stop : bool, default=True
        See :class:`SiteReader`.
    on_done : callable, optional
        Called as ``on_done(i, values)`` when sequence ``i`` is finished.

    Returns
    -------
    values : list of ndarray of float32, shape (len(positions[i]), n_sites, hidden_size)
        In input order.
    """
    import torch

    layout = decoder_layout(model)
    reader = SiteReader(layout, sites, early_stop=early_stop)
    device = layout.embedding.weight.device
    lengths = [int(np.asarray(ids).shape[0]) for ids in input_ids]
    results = [None] * len(lengths)
    for batch in _batches(lengths, max(1, int(batch_size))):
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
        out = reader.run(torch.from_numpy(ids).to(device), rows,
                         attention_mask=None if mask is None else torch.from_numpy(mask).to(device),
                         segments=seg, n_out=sum(counts))
        out = out.cpu().numpy()
        start = 0
        for i, n in zip(batch, counts):
            results[i] = out[start:start + n]
            start += n
            if on_done is not None:
                on_done(i, results[i])
    return results


# ------------------------------------------------------------------ estimator
def _check_conversations(X, what="X"):
    if isinstance(X, Conversation):
        raise TypeError(
            f"{what} must be a list of Conversation objects, got a single Conversation; "
            "wrap it in a list."
        )
    if isinstance(X, (str, bytes, Mapping)) or not isinstance(X, (Sequence, np.ndarray)):
        raise TypeError(
            f"{what} must be a list (or other sequence) of skafa.Conversation objects, got "
            f"{type(X).__name__}."
        )
    X = list(X)
    if not X:
        raise ValueError(f"{what} is empty: pass at least one Conversation.")
    for i, conv in enumerate(X):
        if not isinstance(conv, Conversation):
            raise TypeError(
                f"{what}[{i}] is a {type(conv).__name__}, not a skafa.Conversation "
                "(build one with Conversation.from_who_and_when or from_messages)."
            )
    return X


def _today():
    """Today's date (ISO); part of the cache key when a chat template's date is unpinned."""
    return datetime.date.today().isoformat()


_READ = ("last", "mean")


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
    rid = "" if conversation.record_id is None else f", record {conversation.record_id!r}"
    return f"conversation {index} (task id {conversation.task_id!r}{rid})"


class TurnActivationTransformer(TransformerMixin, BaseEstimator):
    """Turn conversations into per-turn hidden states of a language model.

    For every conversation: render the prompt, run one forward pass of the base
    decoder, and read each requested site at the token holding each turn's last
    character (``read="last"``) or averaged over the turn's line (``read="mean"``).
    The result is a :class:`~skafa.features.TurnFeatures` with values of shape
    ``(n_turns_total, n_sites, hidden_size)`` (float32).

    Parameters
    ----------
    model : str or ModelHandle, default="smollm2"
        Which model: a registered name (:func:`skafa.models.register_model`), a
        local folder, a ``.gguf`` file or a hub id, loaded lazily by
        :func:`skafa.models.load_model` (process-level cache). A *name*, never a
        loaded model: cloning and pickling then never copy weights.
    sites : None, "all", str or list of str, default=None
        Sites to read (see :mod:`skafa.sites`); ``None`` reads all ``2L + 1``.
        Reading every site costs the same single forward pass, so keep the default
        and select sites downstream unless memory is tight.
    read : {"last", "mean"}, default="last"
        Where a turn's vector comes from. ``"last"``: the token holding the turn's
        last character (:attr:`skafa.prompt.Encoding.turn_positions`), which in a
        causal model has seen the whole turn and everything before it. ``"mean"``:
        the average over the tokens of the turn's line, from its first token
        (:attr:`skafa.prompt.Encoding.turn_start_positions`) to that last token.
        Same single forward pass either way; part of the cache key.
    prompt : PromptTemplate, default=None
        How a conversation becomes a prompt; ``None`` uses ``PromptTemplate()``.
    chat_template_kwargs : dict, default=None
        Extra variables for the chat template, e.g. ``{"date_string": "26 Jul 2024"}``
        to pin a template that would otherwise insert today's date.
    device : str, default="cpu"
        Torch device. Not part of the cache key.
    dtype : str, default="float32"
        Compute dtype of the model. Activations are returned as float32.
    cache_dir : str or path-like, default=None
        Directory of an on-disk activation cache shared across processes.
    memory_cache : bool, default=True
        Use the process-wide in-memory LRU cache
        (:func:`skafa.cache.shared_memory_cache`).
    batch_size : int, default=1
        Conversations per forward pass (sorted by length, right-padded).
    verbose : int, default=0
        ``> 0`` shows a progress bar (conversations/s).

    Attributes
    ----------
    sites_ : tuple of str
        The sites read, in output order.
    n_layers_ : int
        Number of decoder layers.
    hidden_size_ : int
        Width of the residual stream.
    n_features_out_ : int
        Features per site (``hidden_size_``).
    model_fingerprint_ : dict
        Architecture fingerprint (:func:`skafa.models.model_fingerprint`).
    model_identity_ : dict
        Identity of the weights (:func:`skafa.models.model_identity`): file digest
        for GGUF files, weights digest for registered models, ...
    context_length_ : int
        Longest prompt accepted (tokens).
    prompt_ : PromptTemplate
        The prompt template used.
    tokenizer_fingerprint_ : str
        sha256 of the tokenizer and its chat template (part of the cache key).
    n_forward_passes_ : int
        Forward passes run by :meth:`transform` since :meth:`fit` (cache hits run
        none).
    cache_stats_ : dict
        Hit/miss counters of this estimator's cache since :meth:`fit`.

    Examples
    --------
    >>> from skafa.extraction import TurnActivationTransformer
    >>> extractor = TurnActivationTransformer("smollm2", sites=["resid_pre.12"])  # doctest: +SKIP
    >>> X = extractor.fit_transform(conversations)  # doctest: +SKIP
    >>> X.values.shape  # doctest: +SKIP
    (n_turns_total, 1, 576)
    """

    def __init__(self, model="smollm2", *, sites=None, read="last", prompt=None,
                 chat_template_kwargs=None, device="cpu", dtype="float32", cache_dir=None,
                 memory_cache=True, batch_size=1, verbose=0):
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
        self.verbose = verbose

    # -------------------------------------------------------------- sklearn
    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False
        tags.requires_fit = True
        tags.target_tags.required = False
        tags.non_deterministic = False
        return tags

    def __getstate__(self):
        state = dict(super().__getstate__())  # a copy: never strip the live object
        for name in ("_model", "_tokenizer", "_layout", "_cache"):
            state.pop(name, None)
        return state

    # -------------------------------------------------------------- helpers
    def _validate_params(self):
        from .models import ModelHandle
        from .prompt import PromptTemplate

        if not isinstance(self.model, (str, os.PathLike, ModelHandle)):
            raise TypeError(
                "model must be a model name or path (str), not a loaded "
                f"{type(self.model).__name__}: skafa loads and caches models itself so "
                "that cloning an estimator never copies weights. Register a model you "
                "loaded yourself with skafa.models.register_model(name, model, tokenizer) "
                "and pass the name."
            )
        if not isinstance(self.read, str) or self.read not in _READ:
            raise ValueError(f"read must be one of {_READ}, got {self.read!r}.")
        if self.prompt is not None and not isinstance(self.prompt, PromptTemplate):
            raise TypeError(
                f"prompt must be a skafa.prompt.PromptTemplate or None, got "
                f"{type(self.prompt).__name__}."
            )
        if self.chat_template_kwargs is not None and not isinstance(
                self.chat_template_kwargs, Mapping):
            raise TypeError(
                "chat_template_kwargs must be a dict or None, got "
                f"{type(self.chat_template_kwargs).__name__}."
            )
        if (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, numbers.Integral)
                or self.batch_size < 1):
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}.")
        if not isinstance(self.verbose, numbers.Integral):
            raise ValueError(f"verbose must be an int, got {self.verbose!r}.")
        if not isinstance(self.memory_cache, (bool, np.bool_)):
            raise ValueError(f"memory_cache must be True or False, got {self.memory_cache!r}.")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a path or None, got {type(self.cache_dir).__name__}.")
        if not isinstance(self.dtype, str):
            raise TypeError(f"dtype must be a string such as 'float32', got {self.dtype!r}.")

    def _load(self):
        from .models import load_model

        model, tokenizer = load_model(self.model, device=self.device, dtype=self.dtype)
        self._model = model
        self._tokenizer = tokenizer
        self._layout = decoder_layout(model)
        return model

    def _ensure_loaded(self):
        if getattr(self, "_model", None) is None:
            from .models import model_fingerprint

            model = self._load()
            if model_fingerprint(model) != self.model_fingerprint_:
                raise RuntimeError(
                    f"The model {self.model!r} loaded now differs from the one this "
                    "transformer was fitted with (architecture fingerprint changed); refit it."
                )
        if getattr(self, "_cache", None) is None:
            self._cache = ActivationCache(self.cache_dir, memory=bool(self.memory_cache))

    # ------------------------------------------------------------------ API
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
        from .models import context_length, model_fingerprint, model_identity
        from .prompt import PromptTemplate

        self._validate_params()
        _check_conversations(X)
        model = self._load()
        layout = self._layout
        self.n_layers_ = layout.n_layers
        self.hidden_size_ = int(layout.embedding.weight.shape[-1])
        self.n_features_out_ = self.hidden_size_
        self.sites_ = validate_sites(self.sites, self.n_layers_)
        self.model_fingerprint_ = model_fingerprint(model)
        self.model_identity_ = model_identity(self.model)
        self.context_length_ = int(context_length(model))
        self.prompt_ = self.prompt if self.prompt is not None else PromptTemplate()
        self._prompt_fingerprint = self.prompt_.fingerprint()
        self.tokenizer_fingerprint_ = _tokenizer_fingerprint(self._tokenizer)
        self._cache = ActivationCache(self.cache_dir, memory=bool(self.memory_cache))
        self.cache_stats_ = self._cache.stats
        self.n_forward_passes_ = 0
        return self

    def _key(self, conversation, template_date=None):
        return activation_key(
            model_identity=self.model_identity_,
            model_fingerprint=self.model_fingerprint_,
            dtype=self.dtype,
            prompt_fingerprint=self._prompt_fingerprint,
            chat_template_kwargs=self.chat_template_kwargs,
            conversation=conversation,
            tokenizer_fingerprint=self.tokenizer_fingerprint_,
            template_date=template_date,
            read=self.read,
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
        X = _check_conversations(X)
        self._ensure_loaded()
        cache = self._cache
        self.cache_stats_ = cache.stats
        sites, hidden = self.sites_, self.hidden_size_
        n_turns = np.array([len(c) for c in X], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(n_turns)]).astype(np.int64)
        values = np.empty((int(offsets[-1]), len(sites), hidden), dtype=np.float32)

        from .prompt import template_uses_date

        kwargs = self.chat_template_kwargs or {}
        date = (_today() if template_uses_date(self._tokenizer) and "date_string" not in kwargs
                else None)
        keys = [self._key(c, date) for c in X]
        todo = []
        for i, (conv, key) in enumerate(zip(X, keys)):
            hit = cache.get(key, sites, n_turns=len(conv), hidden_size=hidden)
            if hit is None:
                todo.append(i)
            else:
                values[offsets[i]:offsets[i + 1]] = hit

        if todo:
            self._compute(X, todo, keys, values, offsets)
        speakers = [s for c in X for s in c.speakers]
        return TurnFeatures(values, offsets, sites=sites, speakers=speakers,
                            task_ids=[c.task_id for c in X])

    def _compute(self, X, todo, keys, values, offsets):
        from .prompt import check_fits

        # Render and check every prompt before spending any compute.
        input_ids, positions, starts = [], [], []
        for i in todo:
            conv = X[i]
            enc = self.prompt_.encode(conv, self._tokenizer,
                                      chat_template_kwargs=self.chat_template_kwargs, index=i)
            check_fits(enc, self.context_length_, i, conv)
            pos = np.asarray(enc.turn_positions, dtype=np.int64)
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
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), unit="conv", desc="skafa: extracting activations")

        def done(j, acts):
            i = todo[j]
            conv = X[i]
            finite = np.isfinite(acts)
            if not finite.all():
                turn, site = (int(v) for v in np.argwhere(~finite.all(axis=2))[0])
                raise ValueError(
                    f"{_where(i, conv)}: non-finite activation at turn {turn} "
                    f"(speaker {conv.turns[turn].speaker!r}), site {sites[site]!r}. "
                    "Try dtype='float32' or check the model weights."
                )
            values[offsets[i]:offsets[i + 1]] = acts
            self._cache.put(keys[i], sites, acts)
            if bar is not None:
                bar.update(1)

        pad = getattr(self._tokenizer, "pad_token_id", None)
        n_batches = -(-len(todo) // int(self.batch_size))
        try:
            extract_activations(self._model, input_ids, positions, sites,
                                starts=starts if self.read == "mean" else None,
                                batch_size=int(self.batch_size),
                                pad_token_id=0 if pad is None else int(pad),
                                on_done=done)
        finally:
            if bar is not None:
                bar.close()
        self.n_forward_passes_ += n_batches
