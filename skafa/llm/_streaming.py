"""Incremental reading of a growing conversation: one forward pass per appended turn.

:class:`TurnStream` is what :meth:`TurnActivationTransformer.stream
<skafa.llm.TurnActivationTransformer.stream>` returns. It owns everything that
touches the model for a live run (rendering, tokenization, the KV cache, the
check that the prompt so far is still a prefix, the site hooks), so that callers
such as :class:`skafa.online.AuditSession` only see one vector per turn.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numpy as np

from ..conversation import Conversation, Turn
from ..exceptions import PromptTooLongError
from ._reads import READS

__all__ = ["TurnStream"]


class TurnStream:
    """Read a live run turn by turn at one site, keeping the model's KV cache.

    Created by :meth:`TurnActivationTransformer.stream
    <skafa.llm.TurnActivationTransformer.stream>`; not meant to be built directly.
    The prompt so far is rendered exactly as the extractor renders the whole run,
    the model runs only over the tokens of each new turn (the keys and values of
    everything before are cached), and the site is read with the extractor's
    hooks (:class:`~skafa.llm.SiteReader`) at the turn's last token, or averaged
    over the turn's line (``read="mean"``). The vectors equal those of a one-pass
    extraction of the whole run (up to float rounding).

    Parameters
    ----------
    model : transformers model
        The loaded, checked model.
    tokenizer : transformers tokenizer
    reader : SiteReader
        Reader of the one site.
    template : PromptTemplate
        Must have ``segment_turns=True`` and ``answer_header=None``
        (``PromptTemplate.online()``).
    read : str
        A streamable read of :data:`skafa.llm.READS` (``"last"`` or ``"mean"``).
    chat_template_kwargs : dict or None
    context_length : int
        The model's context; a turn that would exceed it raises.
    task : str
    task_id : str or None
    label : str, default="TurnStream"
        Names the stream in messages (e.g. ``"AuditSession"``).

    Attributes
    ----------
    site : str
    turns : list of Turn
        The turns appended so far.
    n_tokens : int
        Tokens read (and cached) so far, the head included.
    """

    def __init__(self, model, tokenizer, reader, *, template, read, chat_template_kwargs,
                 context_length, task, task_id=None, label="TurnStream"):
        if not isinstance(task, str):
            raise TypeError(f"task must be a string, got {type(task).__name__}.")
        if not template.segment_turns:
            raise ValueError(
                f"{label} needs a prompt whose turn boundaries are token boundaries "
                "(PromptTemplate(segment_turns=True), e.g. PromptTemplate.online()); the "
                "extractor's prompt would make earlier tokens depend on later turns.")
        if template.answer_header is not None:
            raise ValueError(f"{label}: a live run has no expected answer; use a prompt "
                             "with answer_header=None (PromptTemplate.online()).")
        if not READS[read].streamable:
            raise ValueError(f"{label}: read={read!r} reads text after the whole run and "
                             "cannot be streamed; use one of "
                             f"{[r for r, spec in READS.items() if spec.streamable]}.")
        self._model = model
        self._tokenizer = tokenizer
        self._reader = reader
        self._template = template
        self._read = READS[read]
        self._kwargs = dict(chat_template_kwargs or {})
        self._limit = int(context_length)
        self._label = label
        self.task = task
        self.task_id = task_id
        self.site = reader.sites[0]
        self.turns = []
        self.n_tokens = 0
        self._device = reader.layout.embedding.weight.device
        self._cache = self._new_cache()
        # Read the text before the first turn (system message, task) now, so that
        # the first turn costs its own tokens only.
        text, spans, _ = self._render([Turn("agent", "")])
        self._text = text[: int(spans[0, 0])]
        self._feed(self._text, None, None, what="the system message and task")

    # ------------------------------------------------------------------ internals
    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self._model.config)

    def where(self, k=None):
        """How messages name this stream (and turn ``k``)."""
        tid = "" if self.task_id is None else f" (task {self.task_id!r})"
        return f"{self._label}{tid}" + ("" if k is None else f", turn {k}")

    def _render(self, turns):
        conv = Conversation(turns, task=self.task, task_id=self.task_id)
        contents = [t.content for t in turns]
        if self._template.shorten == "head_tail":
            contents = [self._template._shorten_text(c, self._template.max_turn_chars)[0]
                        for c in contents]
        # (text, turn spans, turn last characters); streamable reads have no read spans.
        from ._prompt import _render  # looked up at call time (tests replace it)

        return _render(self._template, conv, self._tokenizer, contents, self._kwargs,
                               self.where(len(turns) - 1))[:3]

    def _feed(self, segment, last_char, line_start, what):
        """Tokenize ``segment``, check the context, run it through the cached model."""
        import torch

        from ._prompt import _start_positions, _tokenize

        where = self.where(len(self.turns))
        local = [] if last_char is None else [last_char]
        ids, offsets, pos = _tokenize(self._tokenizer, segment,
                                              np.asarray(local, dtype=np.int64), where)
        if self._cache is None:
            raise RuntimeError(f"{self.where()}: the stream was closed.")
        if self.n_tokens + ids.shape[0] > self._limit:
            raise PromptTooLongError(
                f"{where}: {what} would bring the prompt to {self.n_tokens + ids.shape[0]} "
                f"tokens, more than the model's context of {self._limit}; the session is "
                "unchanged. skafa does not cut turns silently: shorten each turn with "
                "PromptTemplate.online(shorten='head_tail', max_turn_chars=...) in the "
                "extractor (and train the auditor on features read that way), or stop "
                "auditing this run.", n_tokens=self.n_tokens + ids.shape[0],
                max_tokens=self._limit)
        if ids.shape[0] == 0:
            return None
        if last_char is None:
            rows, segments = np.zeros(0, dtype=np.int64), None
        elif self._read.rows == "line":
            first = int(_start_positions(offsets, [line_start], pos)[0])
            rows = np.arange(first, int(pos[0]) + 1, dtype=np.int64)
            segments = np.zeros(rows.shape[0], dtype=np.int64)
        else:
            rows, segments = pos.astype(np.int64), None
        values = self._reader.run(
            torch.from_numpy(ids[None, :]).to(self._device),
            torch.from_numpy(rows).to(self._device),
            segments=None if segments is None else torch.from_numpy(segments).to(self._device),
            n_out=None if segments is None else 1,
            past_key_values=self._cache)
        self.n_tokens += int(ids.shape[0])
        return values.cpu().numpy()

    # ------------------------------------------------------------------ API
    def append(self, turn):
        """Read one more turn and return its vector at :attr:`site`.

        Parameters
        ----------
        turn : Turn

        Returns
        -------
        vector : ndarray of float32, shape (hidden_size,)

        Raises
        ------
        PromptTooLongError
            The turn would not fit the model's context; the stream is unchanged.
        RuntimeError
            The prompt rendered with the turn changes text before it.
        """
        from ._prompt import _turn_segments

        if not isinstance(turn, Turn):
            raise TypeError(f"turn must be a skafa.Turn, got {type(turn).__name__}.")
        k = len(self.turns)
        text, spans, last_chars = self._render(self.turns + [turn])
        a, b = _turn_segments(spans, len(text))[k + 1]
        if text[:a] != self._text:
            raise RuntimeError(
                f"{self.where(k)}: the prompt rendered with this turn changes text before "
                "it (the template or chat template depends on later turns), so the cached "
                "keys and values no longer match; use PromptTemplate.online().")
        values = self._feed(text[a:b], int(last_chars[k]) - a, int(spans[k, 0]) - a,
                            what=f"turn {k} (speaker {turn.speaker!r})")
        vec = values[0, 0]
        if not np.all(np.isfinite(vec)):
            raise ValueError(f"{self.where(k)}: non-finite activation at site {self.site!r}.")
        self._text = text[:b]
        self.turns.append(turn)
        return vec

    def close(self):
        """Free the KV cache (the stream cannot be used afterwards)."""
        self._cache = None

    def __repr__(self):
        return (f"TurnStream(site={self.site!r}, turns={len(self.turns)}, "
                f"tokens={self.n_tokens})")
