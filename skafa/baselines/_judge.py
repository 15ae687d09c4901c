"""Prompted judge: the behavioural baseline on the same local model and prompt as the probes.

:class:`PromptedJudge` asks the language model itself which step holds the
decisive error, using exactly the prompt that the probes read activations from
(:class:`~skafa.llm.PromptTemplate`), followed by the start of an assistant
answer (``answer_prefix``, e.g. ``"The decisive error is at step "``). It is
zero-shot: ``fit`` loads the model and validates the input but learns nothing
from the labels, so any difference between the judge and a probe trained on the
same model's activations is what the probe *learned* to read.

Two modes:

``"logprob"`` (default)
    Deterministic, no parsing. Every step ``i`` of a conversation is a
    candidate answer; its score is the log-probability that the model writes
    exactly the number ``i`` after the answer prefix (see
    :class:`PromptedJudge` for the exact definition and why the number must
    *end* there). The prediction is the argmax. All candidates are scored with
    one forward pass over the shared prompt plus one packed pass over all
    candidates' tokens, which reuses the prompt's key/value cache.
``"generate"``
    Greedy generation of up to ``max_new_tokens`` tokens after the answer
    prefix; the first integer in the generated text is the answer.

Both ask all at once (``strategy="all_at_once"``, one question per run). The
Who&When paper's strategies that ask several questions about one run
(``"step_by_step"``, ``"binary_search"``, ``"sequential"``) are in
``_strategies`` (what to ask and when to stop) and :class:`_QuestionSession`
(asking the model, with the KV cache of the questions' shared prefix);
:meth:`PromptedJudge.strategy_report` gives any strategy's forward passes and
tokens per conversation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import re
import time

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils import Bunch, metadata_routing
from sklearn.utils.validation import check_is_fitted

from ..base import DecisiveStepMixin
from ..conversation import check_conversations
from ..llm import (
    ModelHandle,
    PromptTemplate,
    banded_sliding_window_attention,
    has_sliding_window,
    kv_cache_argument,
    verify_saved_model,
)
from ..persistence import PersistenceMixin
from ..utils.progress import log
from ..utils.sklearn_compat import Interval, StrOptions, fit_context
from ..utils.validation import (
    check_steps,
    describe_conversation,
    labels_from_conversations,
)
from ._strategies import (
    PassCounter,
    QuestionAsker,
    binary_search,
    sweep_result,
    word_continuation_mask,
    yes_no_sweep,
)

__all__ = ["PromptedJudge"]

_MODES = ("logprob", "generate")
#: How the judge asks (``PromptedJudge(strategy=...)``; see ``_strategies``).
_STRATEGIES = ("all_at_once", "step_by_step", "binary_search", "sequential")
_INT_RE = re.compile(r"-?[0-9]+")  # ASCII digits only, as for mistake_step
_ASCII_DIGITS = frozenset("0123456789")


# ----------------------------------------------------------------------------- helpers
def _check_steps(y, convs, caller="PromptedJudge"):
    """Validate step labels against the conversations; None -> their mistake_step."""
    if y is None:
        return labels_from_conversations(convs, caller)
    return check_steps(y, convs)


def _softmax(scores):
    scores = np.asarray(scores, dtype=np.float64)
    finite = np.isfinite(scores)
    if not finite.any():
        return np.full(scores.shape, 1.0 / scores.size)
    z = np.where(finite, scores - scores[finite].max(), -np.inf)
    e = np.exp(z)
    return e / e.sum()


def _common_prefix_length(seqs):
    first = seqs[0]
    n = min(len(s) for s in seqs)
    k = 0
    while k < n and all(s[k] == first[k] for s in seqs[1:]):
        k += 1
    return k


def answer_token_plan(tokenizer, answer_prefix, n_steps):
    """Split the candidate answers into shared tokens and per-candidate continuations.

    Each candidate answer ``answer_prefix + str(i)`` (``i = 0..n_steps-1``) is
    tokenized as a whole (no special tokens), so a tokenizer that merges the
    prefix's trailing space with the number (``" 12"``) is treated naturally.
    The longest token prefix common to every candidate becomes part of the
    prompt; the rest of each candidate is what is scored. The common part is
    capped so every candidate keeps at least one token.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        The model's tokenizer.
    answer_prefix : str
        Text the assistant answer starts with.
    n_steps : int
        Number of candidate steps (the conversation's number of turns).

    Returns
    -------
    shared : list of int
        Token ids common to all candidates (appended to the prompt).
    continuations : list of list of int
        Token ids of each candidate after ``shared``; never empty.
    """
    return answer_plan(tokenizer, answer_prefix, [str(i) for i in range(n_steps)])


def answer_plan(tokenizer, answer_prefix, candidates):
    """:func:`answer_token_plan` for any candidate answers (texts), not only numbers.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    answer_prefix : str
    candidates : list of str
        The answers; ``answer_prefix + candidate`` is tokenized as a whole.

    Returns
    -------
    shared : list of int
    continuations : list of list of int
        One non-empty token list per candidate.
    """
    texts = [f"{answer_prefix}{c}" for c in candidates]
    seqs = [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    k = min(_common_prefix_length(seqs), min(len(s) for s in seqs) - 1)
    return seqs[0][:k], [s[k:] for s in seqs]


def number_continuation_mask(tokenizer, vocab_size):
    """Boolean mask of the token ids whose text starts with an ASCII digit.

    After the digits of a candidate number, any such token would make the
    number longer ("1" -> "12"); every other token (punctuation, space, end of
    turn, ...) ends it. Ids beyond the tokenizer's vocabulary (padding rows of
    the LM head) count as ending the number.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    vocab_size : int
        Number of logits the model produces.

    Returns
    -------
    mask : ndarray of bool, shape (vocab_size,)
    """
    n = min(len(tokenizer), int(vocab_size))
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    mask = np.zeros(int(vocab_size), dtype=bool)
    for i, tok in enumerate(tokens):
        if tok and tok[0] in _ASCII_DIGITS:
            mask[i] = True
    return mask


def _output_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _left_pad(seqs, pad_id):
    """Left-pad int sequences; return ids, 2-D mask, position ids (torch)."""
    import torch

    lengths = [len(s) for s in seqs]
    L = max(lengths)
    ids = torch.full((len(seqs), L), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, L - len(s):] = torch.as_tensor(np.asarray(s, dtype=np.int64))
        mask[b, L - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions, lengths


def _prefix_forward(model, seqs, pad_id, device):
    """One forward over left-padded prefixes; return last logits, cache and layout."""
    import torch

    ids, mask, positions, lengths = _left_pad(seqs, pad_id)
    with torch.inference_mode():
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device) if min(lengths) != max(lengths) else None,
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[:, -1, :].float(), _output_cache(out), mask, lengths


def _candidate_logprob(first_logp, logp, end_logp, toks):
    """Score of one candidate: its tokens' log-probabilities plus the number's end.

    ``first_logp`` is the log-distribution after the prefix, ``logp[j]`` the one
    after the candidate's token ``j`` (``j < m - 1``) and ``end_logp`` the
    log-probability that no digit follows the last token.
    """
    import torch

    total = first_logp[toks[0]]
    if len(toks) > 1:
        tgt = torch.as_tensor(toks[1:], dtype=torch.long, device=logp.device)
        total = total + logp[: len(toks) - 1].gather(-1, tgt[:, None]).sum()
    return float(total + end_logp)


def _end_of_number_logp(logits, number_mask):
    """log P(the next token does not start with a digit), per row of ``logits``."""
    import torch

    ends = torch.as_tensor(~np.asarray(number_mask, dtype=bool), device=logits.device)
    return torch.logsumexp(logits[..., ends], dim=-1) - torch.logsumexp(logits, -1)


def _in_context(prefix_context, rows, width):
    """The context ``prefix_context(rows, width)`` or, without one, a no-op."""
    import contextlib

    return contextlib.nullcontext() if prefix_context is None else prefix_context(rows, width)


def _score_candidates_one_by_one(model, prefixes, continuations, number_mask, pad_id,
                                 device, prefix_context=None):
    """:func:`score_candidates` for sliding-window models: one prefix, one candidate
    at a time, each candidate continuing its own copy of the prefix's cache."""
    import copy

    import torch

    scores = []
    for b, (prefix, conts) in enumerate(zip(prefixes, continuations)):
        with _in_context(prefix_context, [b], len(prefix)):
            first_logits, cache, _, lengths = _prefix_forward(model, [prefix], pad_id, device)
        first_logp = torch.log_softmax(first_logits[0], dim=-1)
        row = np.empty(len(conts), dtype=np.float64)
        for c, toks in enumerate(conts):
            m = len(toks)
            with torch.inference_mode():
                out = model(
                    input_ids=torch.as_tensor([list(toks)], dtype=torch.long, device=device),
                    position_ids=(lengths[0] + torch.arange(m, device=device))[None],
                    use_cache=True,
                    logits_to_keep=0,
                    **{kv_cache_argument(model): copy.deepcopy(cache)},
                )
            logits = out.logits[0].float()
            row[c] = _candidate_logprob(first_logp, torch.log_softmax(logits, dim=-1),
                                        _end_of_number_logp(logits[m - 1], number_mask), toks)
        scores.append(row)
    return scores


def score_candidates(model, prefixes, continuations, number_mask, *, pad_id=0,
                     prefix_context=None):
    """Log-probability of every candidate continuation, reusing the prefix KV cache.

    For each sequence ``b`` in the batch, runs one forward pass over
    ``prefixes[b]`` (left-padded with the others, ``use_cache=True``), then one
    forward pass over all candidates of all sequences packed side by side,
    attending to the cached prefix through a custom 4-D mask: a candidate token
    sees its own prefix and the earlier tokens of its own candidate only, and
    its position id continues its prefix's. The score of a candidate with tokens
    ``t_0..t_{m-1}`` is ``sum_j log p(t_j | prefix, t_<j) + log P(next token
    does not start with a digit | prefix, t_0..t_{m-1})``.

    A model with sliding-window attention layers (Gemma-2, Gemma-3, Mistral)
    keeps only the last window of keys in those layers' cache, and a custom mask
    cannot express the window, so there each sequence's prefix runs alone and
    each candidate continues a copy of that prefix's cache through the model's
    own masking: the same scores, one small forward pass per candidate.

    Parameters
    ----------
    model : transformers causal LM
        In eval mode; its attention implementation must accept an additive 4-D
        float mask (eager and sdpa do).
    prefixes : list of sequence of int
        Token ids of each prompt (shared by its candidates).
    continuations : list of list of list of int
        ``continuations[b][c]`` are the (non-empty) token ids of candidate ``c``.
    number_mask : ndarray of bool, shape (vocab_size,)
        :func:`number_continuation_mask` of the tokenizer.
    pad_id : int, default=0
        Token id used for padding (never attended to).
    prefix_context : callable or None, default=None
        ``prefix_context(rows, width)`` returns a context manager entered around
        each forward pass over prefixes only (never the candidates' pass):
        ``rows`` are the indices into ``prefixes`` of that pass and ``width`` its
        (left-padded) length, so the last token of every prefix sits at
        ``width - 1``. :class:`~skafa.baselines.GraftedJudge` intervenes there.

    Returns
    -------
    scores : list of ndarray of float64
        ``scores[b][c]`` is the log-probability of candidate ``c``.
    """
    import torch

    device = next(model.parameters()).device
    if has_sliding_window(model):
        with banded_sliding_window_attention(model):
            return _score_candidates_one_by_one(model, prefixes, continuations, number_mask,
                                                pad_id, device, prefix_context)
    with _in_context(prefix_context, list(range(len(prefixes))),
                     max(len(p) for p in prefixes)):
        first_logits, cache, mask2d, lengths = _prefix_forward(model, prefixes, pad_id, device)
    return _score_packed(model, cache, torch.log_softmax(first_logits, dim=-1), mask2d,
                         lengths, continuations, number_mask, pad_id, device)


def packed_queries(continuations, lead=False):
    """Number of query tokens :func:`_score_packed` runs for these candidates."""
    return int(lead) + max([1] + [sum(len(c) for c in conts) for conts in continuations])


def _score_packed(model, cache, first_logp, mask2d, lengths, continuations, number_mask,
                  pad_id, device, lead=None):
    """Score every candidate of every sequence in one pass that continues ``cache``.

    ``cache`` holds the ``L = mask2d.shape[1]`` (left-padded) prefix tokens of each
    row, ``first_logp`` the log-distribution after each prefix, ``lengths`` the
    prefixes' true lengths. The candidates of row ``b`` are packed side by side
    behind its prefix under a 4-D mask (each sees its prefix and its own earlier
    tokens; position ids continue the prefix's). With ``lead`` (one token id per
    row), the prefix's last token is not in ``cache`` but runs first in the same
    pass (query 0, seeing the cached tokens and itself), ``first_logp`` is read
    from it and every candidate sees it too. The pass appends its tokens to
    ``cache``.
    """
    import torch

    B, L = mask2d.shape
    k = 0 if lead is None else 1

    # Pack every candidate of sequence b into one row (behind the lead token, if any).
    starts = []
    Q = packed_queries(continuations, lead is not None)
    for conts in continuations:
        offs = np.concatenate([[0], np.cumsum([len(c) for c in conts])]).astype(int) + k
        starts.append(offs)
    ids = torch.full((B, Q), int(pad_id), dtype=torch.long)
    positions = torch.zeros((B, Q), dtype=torch.long)
    allowed = torch.zeros((B, Q, L + Q), dtype=torch.bool)
    allowed[:, :, :L] = mask2d[:, None, :].bool()
    for b, conts in enumerate(continuations):
        offs = starts[b]
        if k:
            ids[b, 0] = int(lead[b])
            positions[b, 0] = lengths[b]
            allowed[b, :, L] = True  # every query sees the lead; the lead sees itself
        for c, toks in enumerate(conts):
            s, m = int(offs[c]), len(toks)
            ids[b, s:s + m] = torch.as_tensor(toks, dtype=torch.long)
            positions[b, s:s + m] = lengths[b] + k + torch.arange(m)
            allowed[b, s:s + m, L + s:L + s + m] = torch.ones(m, m, dtype=torch.bool).tril()
        used = int(offs[-1])
        if used < Q:  # padding queries: let them see themselves only (no NaN rows)
            q = torch.arange(used, Q)
            allowed[b, q, :] = False
            allowed[b, q, L + q] = True
            positions[b, used:] = lengths[b] + k
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(allowed.shape, dtype=dtype)
    additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    with torch.inference_mode():
        out = model(
            input_ids=ids.to(device),
            attention_mask=additive[:, None].to(device),
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=0,
            **{kv_cache_argument(model): cache},
        )
    logits = out.logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    end_logp = _end_of_number_logp(logits, number_mask)
    if k:
        first_logp = logp[:, 0]

    scores = []
    for b, conts in enumerate(continuations):
        offs = starts[b]
        row = np.empty(len(conts), dtype=np.float64)
        for c, toks in enumerate(conts):
            s, m = int(offs[c]), len(toks)
            row[c] = _candidate_logprob(first_logp[b], logp[b, s:s + m - 1],
                                        end_logp[b, s + m - 1], toks)
        scores.append(row)
    return scores


def greedy_generate(model, prefixes, max_new_tokens, *, pad_id=0, eos_ids=()):
    """Greedy decoding of up to ``max_new_tokens`` tokens after each prefix.

    Parameters
    ----------
    model : transformers causal LM
    prefixes : list of sequence of int
        Prompt token ids (left-padded together).
    max_new_tokens : int
    pad_id : int, default=0
    eos_ids : iterable of int
        A row stops after producing one of these.

    Returns
    -------
    generated : list of list of int
        New token ids per prefix (including a final eos token if one was produced).
    """
    import torch

    device = next(model.parameters()).device
    eos = set(int(e) for e in eos_ids)
    with banded_sliding_window_attention(model):
        logits, cache, mask2d, lengths = _prefix_forward(model, prefixes, pad_id, device)
    B = len(prefixes)
    out_ids = [[] for _ in range(B)]
    done = [False] * B
    mask = mask2d.clone()
    pos = torch.as_tensor(lengths, dtype=torch.long)
    padded = min(lengths) != max(lengths)
    for step in range(int(max_new_tokens)):
        nxt = logits.argmax(-1).cpu()
        for b in range(B):
            if not done[b]:
                tok = int(nxt[b])
                out_ids[b].append(tok)
                done[b] = tok in eos
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
        with torch.inference_mode():
            out = model(
                input_ids=nxt[:, None].to(device),
                attention_mask=mask.to(device) if padded else None,
                position_ids=pos[:, None].to(device),
                use_cache=True,
                logits_to_keep=1,
                **{kv_cache_argument(model): cache},
            )
        logits, cache = out.logits[:, -1, :].float(), _output_cache(out)
        pos = pos + 1
    return out_ids


def parse_step(text, n_steps):
    """Parse the first integer of ``text`` as a step in ``0..n_steps-1``.

    Parameters
    ----------
    text : str
        Generated text.
    n_steps : int
        Number of steps of the conversation.

    Returns
    -------
    value : int or None
        The first integer (``-?[0-9]+``, ASCII digits only) found, or None when
        there is none. An integer of more than 18 digits is no step of any
        conversation: ``(None, False)`` (Python refuses to parse very long ones).
    ok : bool
        True when an integer was found and lies in ``0..n_steps-1``.
    """
    match = _INT_RE.search(text)
    if match is None or len(match.group().lstrip("-")) > 18:
        return None, False
    value = int(match.group())
    return value, 0 <= value < n_steps


# ----------------------------------------------------------------------------- questions
def _end_masks(tokenizer, lm):
    """What ends a candidate answer: a non-digit after a number, a non-word after a word."""
    vocab = int(lm.get_output_embeddings().weight.shape[0])
    return {"number": number_continuation_mask(tokenizer, vocab),
            "word": word_continuation_mask(tokenizer, vocab)}


def _roll_back(cache, length):
    """Cut a dynamic KV cache back to its first ``length`` tokens (every layer)."""
    now = int(cache.get_seq_length())
    if now > length:
        cache.crop(-(now - length))  # negative: remove that many (transformers 4 and 5)
    if int(cache.get_seq_length()) != length:
        raise RuntimeError(f"could not roll the KV cache back to {length} tokens.")


class _QuestionSession(QuestionAsker):
    """The questions about one conversation, sharing the KV cache of their common prefix.

    :meth:`ask` renders the question's prompt (the judge's template with the
    question as its instruction, over the first ``n_turns`` turns, then the
    answer's shared tokens), finds the longest token prefix it shares with the
    tokens held in the cache (the previous prompt but its last token), rolls the
    cache back to it, runs the rest of the prompt but its last token, then scores
    the candidates in one packed pass whose query 0 is that last token
    (:func:`_score_packed` with ``lead``) and rolls the cache back to the prompt.
    A model with sliding-window layers (whose cache cannot be rolled back) scores
    every question from scratch with :func:`score_candidates`.
    """

    def __init__(self, judge, lm, tokenizer, index, conv, masks):
        self.judge, self.lm, self.tokenizer = judge, lm, tokenizer
        self.index, self.conv, self.masks = index, conv, masks
        self.pad_id = judge._pad_id(tokenizer)
        self.reuse = not has_sliding_window(lm)
        self.device = next(lm.parameters()).device
        self.cache, self.held = None, np.zeros(0, dtype=np.int64)
        self.trace, self.prompt_tokens = [], 0

    def close(self):
        self.cache, self.held = None, np.zeros(0, dtype=np.int64)

    def prompt(self, n_turns, question, answer_prefix, candidates):
        """Token ids of the question's prompt (the answer's shared tokens included)
        and each candidate's remaining tokens."""
        from ..online import conversation_prefix

        conv = self.conv if n_turns == len(self.conv) else conversation_prefix(self.conv,
                                                                               n_turns)
        shared, conts = answer_plan(self.tokenizer, answer_prefix, candidates)
        template = dataclasses.replace(self.judge.prompt_, instruction=question)
        extra = len(shared) + max(len(c) for c in conts)
        enc = self.judge._encode(self.index, conv, self.tokenizer, extra,
                                 "the question's answer tokens", template=template)
        ids = np.concatenate([np.asarray(enc.input_ids, dtype=np.int64),
                              np.asarray(shared, dtype=np.int64)])
        return ids, conts

    def ask(self, kind, about, n_turns, question, answer_prefix, candidates, terminator):
        """Log-probability of every candidate answer (float64 array); recorded."""
        ids, conts = self.prompt(n_turns, question, answer_prefix, candidates)
        scores = self.score(ids, conts, self.masks[terminator])
        self.prompt_tokens += len(ids)
        self.trace.append({"kind": kind, "about": about, "n_turns_shown": int(n_turns),
                           "question": question, "candidates": list(candidates),
                           "scores": [float(v) for v in scores], "prompt_tokens": len(ids)})
        return scores

    def score(self, ids, conts, end_mask):
        """Candidate log-probabilities after ``ids``, continuing the held cache."""
        import torch

        if not self.reuse or len(ids) < 2:
            return score_candidates(self.lm, [ids], [conts], end_mask, pad_id=self.pad_id)[0]
        n = len(ids)
        keep = min(_common_prefix_length([self.held, ids[: n - 1]]), n - 1)
        if keep == 0:
            self.cache = None
        elif self.cache is not None:
            _roll_back(self.cache, keep)
        if keep < n - 1:
            extra = {} if self.cache is None else {kv_cache_argument(self.lm): self.cache}
            with torch.inference_mode():
                out = self.lm(
                    input_ids=torch.as_tensor(ids[None, keep:n - 1], device=self.device),
                    position_ids=torch.arange(keep, n - 1, device=self.device)[None],
                    use_cache=True, logits_to_keep=1, **extra)
            self.cache = _output_cache(out)
        self.held = ids[: n - 1]
        try:
            return _score_packed(self.lm, self.cache, None,
                                 torch.ones((1, n - 1), dtype=torch.long), [n - 1], [conts],
                                 end_mask, self.pad_id, self.device, lead=[int(ids[-1])])[0]
        finally:
            _roll_back(self.cache, n - 1)


# ----------------------------------------------------------------------------- estimator
class _ConversationRows:
    """Per-turn rows of a list of conversations, for :class:`~skafa.base.DecisiveStepMixin`.

    The mixin reads ``offsets`` and ``split_rows`` off the validated input; a
    judge's input is conversations, whose turns are its rows.
    """

    def __init__(self, convs):
        self.offsets = np.concatenate(
            [[0], np.cumsum([len(c) for c in convs])]).astype(np.int64)

    def split_rows(self, rows):
        return np.split(np.asarray(rows), self.offsets[1:-1])


class _StepJudge(DecisiveStepMixin, PersistenceMixin, BaseEstimator):
    """What every judge shares: model, prompt, encoding, step-token scoring.

    The public methods come from :class:`~skafa.base.DecisiveStepMixin` through
    its hooks (``_turn_scores``, ``_turn_proba``, ...). A subclass sets its
    parameters in ``__init__`` (those of ``_parameter_constraints`` here plus its
    own) and overrides :meth:`_judge_scores` (one score array per conversation);
    :meth:`_score_plan` takes an intervention during the prompts' forward passes
    (``context_for``).
    """

    _parameter_constraints: dict = {
        "model": "no_validation",  # checked in fit, with a hint on registering models
        "prompt": [PromptTemplate, None],
        "chat_template_kwargs": [dict, None],
        "answer_prefix": [str],
        "device": [str],
        "dtype": [str],
        "batch_size": [Interval(numbers.Integral, 1, None, closed="left")],
        "verbose": ["verbose"],
    }

    # skafa.persistence: load(model=, device=) replace those parameters; the judge is
    # summarised in skafa.json and its model checked on load.
    _load_overrides = frozenset({"model", "device"})
    _reads_model = True
    # DecisiveStepMixin: fit reads y off the conversations when it is None; score
    # takes no sample_weight (fit takes none either).
    _decisive_requires_y = False
    _score_takes_sample_weight = False
    __metadata_request__score = {"sample_weight": metadata_routing.UNUSED}

    def _restore_after_load(self, context):
        """Check the model this judge will use (see skafa.persistence)."""
        if hasattr(self, "model_fingerprint_"):
            verify_saved_model(self, context)

    # ------------------------------------------------------------------ plumbing
    def _check_model(self):
        if not isinstance(self.model, (str, os.PathLike, ModelHandle)) or not str(self.model):
            raise TypeError(
                "model must be a model name or path (str) loaded through "
                f"skafa.llm.load_model, got {type(self.model).__name__}. To use a model "
                "object, register it with skafa.llm.register_model and pass its name."
            )

    def _resolve_prompt(self):
        return PromptTemplate() if self.prompt is None else self.prompt

    def _load(self):
        from ..llm import load_model

        return load_model(self.model, device=self.device,
                          dtype=getattr(self, "dtype_", self.dtype))

    def _fit_model(self, X, y):
        """Validate ``X`` (and ``y``), load the model, set the model attributes.

        Returns the conversations and the loaded ``(model, tokenizer)``.
        """
        self._check_model()
        convs = check_conversations(X, type(self).__name__)
        if y is not None:
            _check_steps(y, convs, type(self).__name__)
        self.prompt_ = self._resolve_prompt()
        from ..llm import context_length, model_fingerprint, model_identity, resolve_dtype

        self.dtype_ = resolve_dtype(self.dtype, self.device, model=self.model)
        lm, tokenizer = self._load()
        self.context_length_ = int(context_length(lm))
        self.model_identity_ = model_identity(self.model)
        self.model_fingerprint_ = model_fingerprint(lm)
        self.n_conversations_fit_ = len(convs)
        return convs, lm, tokenizer

    # ------------------------------------------------------------------ encoding
    def _encode(self, index, conv, tokenizer, extra_tokens, what, template=None):
        """Encode one conversation; refuse it (naming it) when it cannot fit.

        ``template`` replaces ``prompt_`` (the strategies' questions are the same
        template with another instruction).
        """
        from ..exceptions import PromptTooLongError
        from ..llm import check_fits

        template = self.prompt_ if template is None else template
        enc = template.encode(conv, tokenizer, chat_template_kwargs=self.chat_template_kwargs,
                              index=index, max_tokens=self.context_length_)
        check_fits(enc, self.context_length_, index, conv)
        if enc.n_tokens + extra_tokens > self.context_length_:
            budget = self.context_length_ - extra_tokens
            raise PromptTooLongError(
                f"{describe_conversation(index, task_id=conv.task_id, record_id=conv.record_id)} has {enc.n_tokens} prompt tokens; with the "
                f"judge's {extra_tokens} answer tokens ({what}) that is more than the "
                f"model's context length of {self.context_length_}. Shorten it with "
                f"PromptTemplate(shorten='middle_first', max_prompt_tokens={budget}) or "
                "shorten='head_tail', or drop the conversation.",
                n_tokens=enc.n_tokens + extra_tokens, max_tokens=self.context_length_)
        return enc

    def _load_checked(self):
        """Load the model and check it is the one the judge was fitted with."""
        from ..llm import load_checked_model

        return load_checked_model(self.model, device=self.device, dtype=self.dtype_,
                                  fingerprint=self.model_fingerprint_,
                                  owner=type(self).__name__)

    def _pad_id(self, tokenizer):
        for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if tid is not None:
                return int(tid)
        return 0

    def _batches(self, lengths):
        from ..llm import length_batches

        return length_batches(lengths, int(self.batch_size))

    def _log(self, start, done, total, batch, convs, n_tokens):
        if self.verbose > 0:
            ids = ", ".join(str(convs[i].record_id or i) for i in batch)
            log(self, 1, f"{done}/{total} conversations ({ids}): "
                         f"{max(n_tokens)} tokens, {time.perf_counter() - start:.2f} s")

    # ------------------------------------------------------------------ logprob scoring
    def _candidate_plan(self, convs, lm, tokenizer):
        """Prompt + shared answer tokens of every conversation, and the candidates.

        Returns
        -------
        plan : Bunch
            ``prefixes`` (int64 arrays: prompt and the answer tokens common to all
            candidates), ``continuations`` (per conversation, the remaining tokens
            of each candidate step), ``encodings``, ``number_mask`` and ``pad_id``.
        """
        vocab = int(lm.get_output_embeddings().weight.shape[0])
        number_mask = number_continuation_mask(tokenizer, vocab)
        prefixes, conts, encodings = [], [], []
        for i, conv in enumerate(convs):
            shared, cont = answer_token_plan(tokenizer, self.answer_prefix, len(conv))
            extra = len(shared) + max(len(c) for c in cont)
            enc = self._encode(i, conv, tokenizer, extra,
                               "answer prefix and the longest step number")
            prefixes.append(np.concatenate([np.asarray(enc.input_ids, dtype=np.int64),
                                            np.asarray(shared, dtype=np.int64)]))
            conts.append(cont)
            encodings.append(enc)
        return Bunch(prefixes=prefixes, continuations=conts, encodings=encodings,
                     number_mask=number_mask, pad_id=self._pad_id(tokenizer))

    def _score_plan(self, lm, convs, plan, context_for=None):
        """Candidate log-probabilities of every conversation, batch by batch.

        ``context_for(batch)``, when given, returns the ``prefix_context`` of
        :func:`score_candidates` for the conversations ``batch`` (or None).
        """
        prefixes = plan.prefixes
        scores = [None] * len(convs)
        start, done = time.perf_counter(), 0
        for batch in self._batches([len(p) for p in prefixes]):
            context = None if context_for is None else context_for(batch)
            out = score_candidates(lm, [prefixes[i] for i in batch],
                                   [plan.continuations[i] for i in batch], plan.number_mask,
                                   pad_id=plan.pad_id, prefix_context=context)
            for i, s in zip(batch, out):
                scores[i] = s
            done += len(batch)
            self._log(start, done, len(convs), batch, convs, [len(prefixes[i]) for i in batch])
        return scores

    def _logprob_scores(self, convs):
        lm, tokenizer = self._load_checked()
        return self._score_plan(lm, convs, self._candidate_plan(convs, lm, tokenizer))

    def _judge_scores(self, convs):
        """One float64 score array per conversation (length: its number of turns)."""
        return self._logprob_scores(convs)

    # ------------------------------------------------------------------ DecisiveStepMixin hooks
    def _check_decisive_input(self, X):
        return check_conversations(X, type(self).__name__)

    def _check_decisive_steps(self, y, X):
        return _check_steps(y, X, type(self).__name__)

    def _turn_scores(self, X):
        convs = self._check_decisive_input(X)
        scores = self._judge_scores(convs)
        return _ConversationRows(convs), np.concatenate(
            [np.asarray(s, dtype=np.float64) for s in scores])

    def _turn_proba(self, scores, offsets):
        # the model's distribution over answers, renormalised to the valid steps
        return np.concatenate([_softmax(s) for s in np.split(scores, offsets[1:-1])])


class PromptedJudge(_StepJudge):
    """Zero-shot LLM judge of the decisive step, on the probes' model and prompt.

    The judge renders each conversation with the same
    :class:`~skafa.llm.PromptTemplate` the probes read activations from (its
    closing instruction asks which step holds the decisive error), starts the
    assistant's answer with ``answer_prefix`` and lets the model answer.

    In ``mode="logprob"`` (default) the score of step ``i`` is the
    log-probability that the answer continues with exactly the number ``i``::

        score(i) = log p(tokens of str(i) | prompt + answer_prefix)
                   + log P(next token does not start with a digit | ... str(i))

    The second term is the *terminator*: without it "1" would beat "12" merely
    because it is a prefix of it (p("1") >= p("1", "2") always). Requiring the
    number to end — any token that does not start with an ASCII digit (".",
    a space, a newline, the end-of-turn token, ...) — compares every number
    as a complete answer, and sums over all ways of ending it instead of
    betting on one terminator such as ".". ``answer_prefix + str(i)`` is
    tokenized as a whole, and tokens common to all candidates are moved into the
    prompt (so a tokenizer that merges the trailing space with the number, like
    GPT-2's ``" 12"``, is scored on its natural tokens). The prediction is the
    argmax (ties go to the earliest step). Cost: one forward pass over the
    prompt with ``use_cache=True``, then one packed pass over all candidates'
    tokens (about ``n_steps * n_digits`` tokens for the whole conversation)
    attending to the cached prompt through a custom 4-D mask, so the judge costs
    about one forward pass over the prompt (one forward pass per candidate would
    cost ``n_steps`` of them).

    In ``mode="generate"`` the model greedily writes up to ``max_new_tokens``
    tokens after ``answer_prefix``; the first integer (``-?[0-9]+``) in that text is
    its answer. A missing or out-of-range integer is a *parse failure*: the
    prediction then falls back to step 0 (the first turn), and
    :meth:`generate_report` flags it.

    ``strategy`` says how the judge asks (the Who&When paper's strategies; every
    answer is read by log-probability over a closed set of candidates, so the
    strategies other than ``"all_at_once"`` need ``mode="logprob"``):

    ``"all_at_once"`` (default)
        One question about the whole run, as above.
    ``"step_by_step"``
        For ``t = 0, 1, ...``: the transcript up to turn ``t`` and the
        question "Is step ``t`` (speaker) the decisive error?", answered *yes*
        when ``log p(Yes) - log p(No) > yes_threshold``. It stops at the first
        yes, the prediction; without one every turn was asked and the most likely
        yes (the largest margin) wins. Turn ``t`` scores ``log sigmoid(margin)``
        (the yes, normalised over Yes/No); turns never asked score ``-inf``.
    ``"binary_search"``
        The whole transcript and "Is the decisive error in steps ``a-m`` or in
        steps ``m+1-b``?", the answers being the two ranges (the first half holds
        ``ceil(n/2)`` turns; ties go to it); the chosen half is the next range,
        until one turn is left: between ``floor(log2 n)`` and ``ceil(log2 n)``
        questions. A turn scores the log-probability (over the two halves) of its
        half at the question that settled it.
    ``"sequential"``
        The whole transcript and "Which agent is responsible for the decisive
        error?" among the run's speakers (answers: their names), then step by
        step over that agent's turns only: ``1 +`` the number of them asked.
        Those turns score ``log p(agent) + log sigmoid(margin)``; every other
        turn ``-inf``.

    The prediction is always the strategy's answer and the first argmax of
    :meth:`turn_decision_function`. The questions of one run share a prefix
    (system message, task, the beginning of the transcript): its KV cache is
    kept, and each question runs only the tokens it does not share with the
    previous one, then scores its candidates in one packed pass (a model with
    sliding-window layers reruns each question whole). These strategies ask one
    conversation at a time (``batch_size`` is not used) and ignore
    ``answer_prefix``. :meth:`strategy_report` counts every question, forward
    pass and token.

    The estimator learns nothing from labels: ``fit`` validates ``X``, loads
    the model and records its identity and context length; with
    ``yes_threshold="fit"`` it also chooses the yes/no threshold on the labels.

    Parameters
    ----------
    model : str, default="smollm2"
        Name or path understood by :func:`skafa.llm.load_model` (a registered
        name such as ``"smollm2"``, or a local model directory / GGUF file). The
        model is loaded lazily through a process-level cache, so ``clone`` and
        pickling copy only this string, never weights.
    prompt : PromptTemplate or None, default=None
        How conversations become a prompt; ``None`` means ``PromptTemplate()``,
        the probes' default.
    chat_template_kwargs : dict or None, default=None
        Extra variables for the tokenizer's chat template (e.g. a pinned date).
    answer_prefix : str, default="Step: "
        Start of the assistant's answer, placed after the generation prompt.
    mode : {"logprob", "generate"}, default="logprob"
        How the model's answer is read (see above).
    strategy : {"all_at_once", "step_by_step", "binary_search", "sequential"}, \
            default="all_at_once"
        How the judge asks (see above).
    yes_threshold : float or "fit", default=0.0
        With ``"step_by_step"`` and ``"sequential"``: a turn's answer is *yes*
        when ``log p(Yes) - log p(No)`` exceeds it. ``0.0`` is the model's own
        preference (its greedy answer). ``"fit"``: ``fit`` asks about every
        candidate turn of the training conversations (no early stop) and keeps
        the threshold with the best step accuracy on their labels (the one
        closest to 0 among equals; ``yes_threshold_``). Small models say "Yes"
        (or "No") to almost any such question, which stops the search at the
        first turn (or never); the threshold corrects that bias, the one thing
        labels can teach this zero-shot judge. Unused by the other strategies.
    max_new_tokens : int, default=8
        Generation budget in ``mode="generate"`` and :meth:`generate_report`.
    device : str, default="cpu"
        Torch device to load the model on.
    dtype : str, default="auto"
        Torch dtype to load the model in; ``"auto"`` is bfloat16 on CUDA and on
        CPUs with native bfloat16 units, else float32
        (:func:`skafa.llm.resolve_dtype`; the result is ``dtype_``).
    batch_size : int, default=1
        Number of conversations per forward pass (left-padded together;
        conversations are sorted by length first to reduce padding).
    verbose : int, default=0
        Print one progress line per batch when > 0.

    Attributes
    ----------
    prompt_ : PromptTemplate
        The template used.
    context_length_ : int
        Maximum number of tokens the model accepts.
    dtype_ : str
        The dtype ``dtype`` resolved to, used from then on.
    model_identity_ : dict
        What the ``model`` string refers to (:func:`skafa.llm.model_identity`).
    model_fingerprint_ : dict
        Architecture of the loaded model (:func:`skafa.llm.model_fingerprint`);
        checked again before every prediction.
    n_conversations_fit_ : int
        Number of conversations seen by ``fit`` (nothing is learned from them,
        except the threshold with ``yes_threshold="fit"``).
    yes_threshold_ : float
        The yes/no threshold used: ``yes_threshold``, or the fitted one (``0.0``
        where the strategy asks no yes/no question).

    See Also
    --------
    skafa.llm.PromptTemplate : The prompt shared with the probes.

    Notes
    -----
    The default :class:`~skafa.llm.PromptTemplate` asks for an answer of the
    form ``'Step: <number>, Agent: <name>'``; the terminator above counts the
    ``","`` after the number like any other non-digit, so the scores do not
    depend on which punctuation the model prefers. In ``"generate"`` mode
    ``answer_prefix`` is tokenized on its own (a trailing space may be a token of
    its own). The packed pass needs an attention implementation that accepts an
    additive 4-D mask (``"eager"`` and ``"sdpa"`` do; flash-attention does not).

    The judge is a conversation-level estimator: one sample is one
    :class:`~skafa.conversation.Conversation`. Per-turn scores are returned by
    :meth:`turn_decision_function` / :meth:`turn_predict_proba` as lists of 1-D
    arrays (it deliberately has no ``decision_function`` / ``predict_proba``).
    It is not a ``ClassifierMixin``, so an integer ``cv`` picks ``KFold``.

    Examples
    --------
    >>> from skafa.baselines import PromptedJudge
    >>> judge = PromptedJudge("smollm2")                       # doctest: +SKIP
    >>> judge.fit(conversations).predict(conversations)        # doctest: +SKIP
    array([3, 0, 5, ...])
    """

    _parameter_constraints: dict = {
        **_StepJudge._parameter_constraints,
        "mode": [StrOptions(set(_MODES))],
        "strategy": [StrOptions(set(_STRATEGIES))],
        "yes_threshold": [Interval(numbers.Real, None, None, closed="neither"),
                          StrOptions({"fit"})],
        "max_new_tokens": [Interval(numbers.Integral, 1, None, closed="left")],
    }

    def __init__(
        self,
        model="smollm2",
        *,
        prompt=None,
        chat_template_kwargs=None,
        answer_prefix="Step: ",
        mode="logprob",
        strategy="all_at_once",
        yes_threshold=0.0,
        max_new_tokens=8,
        device="cpu",
        dtype="auto",
        batch_size=1,
        verbose=0,
    ):
        self.model = model
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs
        self.answer_prefix = answer_prefix
        self.mode = mode
        self.strategy = strategy
        self.yes_threshold = yes_threshold
        self.max_new_tokens = max_new_tokens
        self.device = device
        self.dtype = dtype
        self.batch_size = batch_size
        self.verbose = verbose

    # ------------------------------------------------------------------ fit
    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None, groups=None):
        """Validate the conversations and load the model. Learns nothing from ``y``.

        Except, with ``yes_threshold="fit"`` and a yes/no strategy, the threshold:
        every candidate turn of every conversation is asked about (see
        ``yes_threshold``).

        Parameters
        ----------
        X : list of Conversation
            Conversations (only validated; the judge is zero-shot).
        y : array-like of int, shape (n_conversations,), default=None
            Ignored apart from validation (checked against ``X`` when given);
            with ``yes_threshold="fit"``, the labels the threshold is chosen on
            (``None``: the conversations' ``mistake_step``).
        groups : array-like, default=None
            Ignored; accepted for API compatibility with grouped splitters.

        Returns
        -------
        self : PromptedJudge
            The fitted judge.
        """
        if self.strategy != "all_at_once" and self.mode != "logprob":
            raise ValueError(
                f"PromptedJudge(strategy={self.strategy!r}) reads every answer by "
                f"log-probability; it needs mode='logprob', got mode={self.mode!r}.")
        convs, lm, tokenizer = self._fit_model(X, y)
        if self.yes_threshold == "fit" and self.strategy in ("step_by_step", "sequential"):
            self.yes_threshold_ = self._fit_threshold(convs, y, lm, tokenizer)
        else:
            self.yes_threshold_ = 0.0 if self.yes_threshold == "fit" else float(
                self.yes_threshold)
        return self

    # ------------------------------------------------------------------ strategies
    def _fit_threshold(self, convs, y, lm, tokenizer):
        """The yes/no threshold with the best step accuracy on ``convs`` (see fit)."""
        steps = _check_steps(y, convs, type(self).__name__)
        masks = _end_masks(tokenizer, lm)
        sweeps = [self._ask(i, conv, lm, tokenizer, masks, stop=False).sweep
                  for i, conv in enumerate(convs)]
        margins = np.unique(np.concatenate([np.asarray(s.margins, dtype=np.float64)
                                            for s in sweeps]))
        # one threshold per interval between distinct margins, below them all and at
        # the largest (nothing above it: every run falls back to its largest margin)
        candidates = np.unique(np.concatenate([[0.0, margins[0] - 1.0, margins[-1]],
                                               (margins[1:] + margins[:-1]) / 2]))
        candidates = candidates[np.argsort(np.abs(candidates), kind="stable")]
        accuracy = [np.mean([s.decide(t) == step for s, step in zip(sweeps, steps)])
                    for t in candidates]
        best = candidates[int(np.argmax(accuracy))]  # the first: closest to 0
        log(self, 1, f"yes_threshold={best:.4g}: step accuracy {max(accuracy):.3f} on "
                     f"{len(convs)} conversations")
        return float(best)

    def _ask(self, index, conv, lm, tokenizer, masks, *, stop=True):
        """Ask one conversation's questions; a Bunch with the answer and its record.

        ``prediction`` and ``scores`` (one per turn), ``questions`` (the
        session's record of every question), ``prompt_tokens`` and, for the
        yes/no strategies, ``sweep`` (turns asked about and their margins).
        """
        session = _QuestionSession(self, lm, tokenizer, index, conv, masks)
        sweep = None
        try:
            if self.strategy == "binary_search":
                prediction, scores = binary_search(session)
            else:
                threshold = getattr(self, "yes_threshold_", 0.0)
                sweep = yes_no_sweep(session, self.strategy, threshold, stop=stop)
                prediction, scores = sweep_result(sweep, len(conv), threshold)
        finally:
            session.close()
        return Bunch(prediction=prediction, scores=scores, questions=session.trace,
                     prompt_tokens=session.prompt_tokens, sweep=sweep)

    def _all_at_once_record(self, index, conv, lm, tokenizer):
        """One all-at-once question (as ``_judge_scores`` asks it) and its record."""
        if self.mode == "generate":
            scores = self._judge_scores([conv])[0]
            prefix = tokenizer(self.answer_prefix, add_special_tokens=False)["input_ids"]
            n = self._encode(index, conv, tokenizer, len(prefix) + int(self.max_new_tokens),
                             "answer prefix and max_new_tokens").n_tokens + len(prefix)
            candidates = None
        else:
            plan = self._candidate_plan([conv], lm, tokenizer)
            scores = score_candidates(lm, plan.prefixes, plan.continuations, plan.number_mask,
                                      pad_id=plan.pad_id)[0]
            n = len(plan.prefixes[0])
            candidates = [str(i) for i in range(len(conv))]
        record = {"kind": "all_at_once", "about": list(range(len(conv))),
                  "n_turns_shown": len(conv), "question": self.prompt_.instruction,
                  "candidates": candidates, "scores": [float(v) for v in scores],
                  "prompt_tokens": int(n)}
        return Bunch(prediction=int(np.argmax(scores)), scores=np.asarray(scores, np.float64),
                     questions=[record], prompt_tokens=int(n))

    def _strategy_runs(self, convs, count=False):
        """Every conversation's Bunch (see ``_ask``), with its cost when ``count``."""
        lm, tokenizer = self._load_checked()
        masks = _end_masks(tokenizer, lm)
        counter = PassCounter()
        runs = []
        start = time.perf_counter()
        with counter.counting(lm) if count else contextlib.nullcontext():
            for i, conv in enumerate(convs):
                calls, tokens = counter.calls, counter.tokens
                if self.strategy == "all_at_once":
                    run = self._all_at_once_record(i, conv, lm, tokenizer)
                else:
                    run = self._ask(i, conv, lm, tokenizer, masks)
                run.forward_passes = counter.calls - calls
                run.computed_tokens = counter.tokens - tokens
                runs.append(run)
                if self.verbose > 0:
                    log(self, 1, f"{i + 1}/{len(convs)} conversations "
                                 f"({conv.record_id or i}): {len(run.questions)} questions, "
                                 f"{time.perf_counter() - start:.2f} s")
        return runs

    def strategy_report(self, X):
        """Ask every conversation as ``strategy`` says; the answers and their cost.

        Works for every strategy (``"all_at_once"`` asks one conversation at a
        time here, whatever ``batch_size``, so that each pass belongs to one
        conversation). The cost is counted on the model: every call of its
        forward (a pre-hook) and the tokens it runs.

        Parameters
        ----------
        X : list of Conversation
            Conversations to judge.

        Returns
        -------
        report : Bunch
            ``predictions`` (int64 ndarray; equal to :meth:`predict`),
            ``turn_scores`` (list of float64 ndarrays; :meth:`turn_decision_function`),
            ``n_questions`` (int64 ndarray: questions asked per conversation),
            ``forward_passes`` (int64 ndarray: calls of the model's forward),
            ``computed_tokens`` (int64 ndarray: tokens those calls ran, the
            candidates' and padding included; with the shared prefix's KV cache
            reused, far fewer than the questions' prompts),
            ``prompt_tokens`` (int64 ndarray: the sum of the questions' prompt
            lengths, what a judge without a shared cache would read),
            ``run_tokens`` (int64 ndarray: tokens of the all-at-once prompt of the
            whole run, one forward pass of the run, to express the cost in such
            passes) and ``questions`` (per conversation, one dict per question:
            ``kind``, the turns it is ``about``, ``n_turns_shown``, the
            ``question``, the ``candidates`` and their ``scores``, its
            ``prompt_tokens``).
        """
        check_is_fitted(self)
        convs = check_conversations(X, type(self).__name__)
        runs = self._strategy_runs(convs, count=True)
        lm, tokenizer = self._load_checked()
        run_tokens = [self.prompt_.encode(conv, tokenizer,
                                          chat_template_kwargs=self.chat_template_kwargs,
                                          index=i, max_tokens=self.context_length_).n_tokens
                      for i, conv in enumerate(convs)]

        def ints(key):
            return np.asarray([r[key] for r in runs], dtype=np.int64)

        return Bunch(predictions=ints("prediction"), turn_scores=[r.scores for r in runs],
                     n_questions=np.asarray([len(r.questions) for r in runs], dtype=np.int64),
                     forward_passes=ints("forward_passes"),
                     computed_tokens=ints("computed_tokens"),
                     prompt_tokens=ints("prompt_tokens"),
                     run_tokens=np.asarray(run_tokens, dtype=np.int64),
                     questions=[r.questions for r in runs])

    # ------------------------------------------------------------------ generate mode
    def generate_report(self, X):
        """Greedy-generate each conversation's answer and parse it (any ``mode``).

        Parameters
        ----------
        X : list of Conversation
            Conversations to judge.

        Returns
        -------
        report : Bunch
            ``predictions`` (int ndarray, parsed step or 0 on failure),
            ``parsed`` (object ndarray: the first integer found, or None),
            ``parse_failed`` (bool ndarray: no integer or out of range),
            ``texts`` (list of str: the generated text after ``answer_prefix``),
            ``parse_failure_rate`` (float).
        """
        check_is_fitted(self)
        convs = check_conversations(X, type(self).__name__)
        lm, tokenizer = self._load_checked()
        prefix_ids = list(tokenizer(self.answer_prefix, add_special_tokens=False)["input_ids"])
        extra = len(prefix_ids) + int(self.max_new_tokens)
        prefixes = []
        for i, conv in enumerate(convs):
            enc = self._encode(i, conv, tokenizer, extra,
                               "answer prefix and max_new_tokens")
            prefixes.append(np.concatenate([np.asarray(enc.input_ids, dtype=np.int64),
                                            np.asarray(prefix_ids, dtype=np.int64)]))
        eos = set()
        for tid in (tokenizer.eos_token_id, getattr(lm.config, "eos_token_id", None)):
            if isinstance(tid, (list, tuple)):
                eos.update(int(t) for t in tid)
            elif tid is not None:
                eos.add(int(tid))
        pad = self._pad_id(tokenizer)
        texts = [None] * len(convs)
        start, done = time.perf_counter(), 0
        for batch in self._batches([len(p) for p in prefixes]):
            gen = greedy_generate(lm, [prefixes[i] for i in batch], self.max_new_tokens,
                                  pad_id=pad, eos_ids=eos)
            for i, ids in zip(batch, gen):
                texts[i] = tokenizer.decode(ids, skip_special_tokens=True)
            done += len(batch)
            self._log(start, done, len(convs), batch, convs, [len(prefixes[i]) for i in batch])
        parsed = np.empty(len(convs), dtype=object)
        failed = np.zeros(len(convs), dtype=bool)
        preds = np.zeros(len(convs), dtype=np.int64)
        for i, (text, conv) in enumerate(zip(texts, convs)):
            value, ok = parse_step(text, len(conv))
            parsed[i] = value
            failed[i] = not ok
            preds[i] = value if ok else 0
        return Bunch(predictions=preds, parsed=parsed, parse_failed=failed, texts=texts,
                     parse_failure_rate=float(failed.mean()))

    # ------------------------------------------------------------------ scores
    def _judge_scores(self, convs):
        """``"logprob"``: the log-probability that the answer is that step's number;
        ``"generate"``: 1.0 at the parsed step (0 on a parse failure), 0.0 elsewhere;
        another strategy: its turn scores (see the class docstring)."""
        if self.strategy != "all_at_once":
            return [run.scores for run in self._strategy_runs(convs)]
        if self.mode == "logprob":
            return self._logprob_scores(convs)
        out = []
        for conv, p in zip(convs, self.generate_report(convs).predictions):
            row = np.zeros(len(conv), dtype=np.float64)
            row[p] = 1.0
            out.append(row)
        return out

    def _turn_proba(self, scores, offsets):
        # "generate": one-hot on the prediction, as the scores
        if self.mode == "generate":
            return scores
        return super()._turn_proba(scores, offsets)
