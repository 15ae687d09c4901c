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

import numbers
import time

import numpy as np
from sklearn.model_selection import GroupKFold, KFold
from sklearn.utils import Bunch

from ..llm import (
    banded_sliding_window_attention,
    decoder_layout,
    head_attention_rows,
    turn_attention_mass,
)
from ..model_selection import grouped_splits
from ..utils.progress import log
from ..utils.sklearn_compat import Interval, fit_context
from ..utils.validation import group_labels
from ._judge import _StepJudge

__all__ = ["GraftedJudge", "head_direct_effects"]


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
    captured = {}
    handles = []
    if direct_tokens is not None:
        def keep(key):
            def hook(module, args, output=None):
                value = args[0] if output is None else output
                captured[key] = value[0, -1].detach().float()
            return hook

        for layer_index, layer in enumerate(layout.layers):
            o_proj = layer.self_attn.o_proj
            handles.append(o_proj.register_forward_pre_hook(keep(("z", layer_index))))
            handles.append(o_proj.register_forward_hook(keep(("o", layer_index))))
        handles.append(layout.final_norm.register_forward_pre_hook(keep(("x", None))))
    try:
        with torch.inference_mode(), banded_sliding_window_attention(lm), \
                head_attention_rows(lm, [ids.shape[1] - 1]) as recorded:
            lm(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    rows = recorded.stacked()[:, 0, :, 0, :]
    if direct_tokens is None:
        return rows, None
    with torch.inference_mode():
        direct = _direct_from_captured(lm, layout, captured, direct_tokens)
    return rows, direct


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


def _graft_context(lm, grafts):
    """``context_for(batch)`` for :meth:`_StepJudge._score_plan`: the graft as an override."""
    import torch

    def context_for(batch):
        def prefix_context(rows, width):
            override = {}
            for head in grafts[batch[rows[0]]]:
                w = np.zeros((len(rows), 1, width), dtype=np.float32)
                for r, b in enumerate(rows):
                    g = grafts[batch[b]][head]
                    w[r, 0, width - g.shape[0]:] = g  # prefixes are left-padded
                override[head] = torch.from_numpy(w)
            return head_attention_rows(lm, [width - 1], override=override)

        return prefix_context

    return context_for


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
        Conversations per forward pass of the candidate scoring.
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

    Notes
    -----
    Cost: ``fit`` runs one clean pass per training conversation to rank the
    heads, then, per inner fold, one clean pass and one grafted scoring per grid
    pair for each held-out conversation; ``predict`` one clean pass plus the
    judge's scoring (about twice the judge's cost). The writer score is a
    direct-effect (first-order) reading: a head that writes through later
    layers is not seen. The locators' attention is taken from the clean pass,
    so a locator downstream of a writer does not see the graft.

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
        locator_grid = _check_grid(self.locator_grid, "locator_grid")
        writer_grid = _check_grid(self.writer_grid, "writer_grid")
        convs, lm, tokenizer = self._fit_model(X, None)
        steps = self._check_decisive_steps(y, convs)
        plan = self._candidate_plan(convs, lm, tokenizer)
        locator_stats, writer_stats = self._head_statistics(lm, convs, plan, steps)
        self.n_layers_, self.n_heads_ = (int(n) for n in locator_stats.shape[1:])
        everyone = np.arange(len(convs))
        self.head_locator_scores_ = _mean_scores(locator_stats, everyone)
        self.head_writer_scores_ = _mean_scores(writer_stats, everyone)
        pairs = [(a, b) for a in locator_grid for b in writer_grid]
        if len(pairs) == 1:
            self.cv_results_ = None
            self.n_locators_, self.n_writers_ = pairs[0]
        else:
            splits = self._inner_splits(convs, steps, groups)
            split_scores = self._inner_scores(lm, convs, plan, steps, pairs, splits,
                                              locator_stats, writer_stats)
            sizes = np.array([len(test) for _, test in splits], dtype=np.float64)
            mean = split_scores @ sizes / sizes.sum()
            best = max(range(len(pairs)),
                       key=lambda k: (mean[k], -sum(pairs[k]), -pairs[k][0]))
            self.cv_results_ = {"params": [tuple(p) for p in pairs],
                                "mean_test_score": mean,
                                "split_test_scores": split_scores}
            self.n_locators_, self.n_writers_ = pairs[best]
        self.locator_heads_ = _rank(self.head_locator_scores_)[:self.n_locators_]
        self.writer_heads_ = _rank(self.head_writer_scores_)[:self.n_writers_]
        log(self, 1, f"locators {self.locator_heads_}, writers {self.writer_heads_}")
        return self

    def _head_statistics(self, lm, convs, plan, steps):
        """Per conversation and head: mass on the decisive turn, direct-effect contrast."""
        locator, writer = [], []
        start = time.perf_counter()
        for i, (conv, enc) in enumerate(zip(convs, plan.encodings)):
            firsts = [int(c[0]) for c in plan.continuations[i]]
            tokens = sorted(set(firsts))
            rows, direct = _answer_pass(lm, plan.prefixes[i], direct_tokens=tokens)
            spans = list(zip(np.asarray(enc.turn_start_positions).tolist(),
                             (np.asarray(enc.turn_positions) + 1).tolist()))
            step = int(steps[i])
            locator.append(turn_attention_mass(rows, spans[step:step + 1])[..., 0])
            true = tokens.index(firsts[step])
            others = [k for k in range(len(tokens)) if k != true]
            if others:
                writer.append(direct[..., true] - direct[..., others].mean(-1))
            else:  # every candidate starts with the same token: no contrast
                writer.append(np.full(direct.shape[:2], np.nan))
            log(self, 2, f"ranked heads on {i + 1}/{len(convs)} conversations, "
                         f"{time.perf_counter() - start:.2f} s")
        return np.stack(locator).astype(np.float64), np.stack(writer).astype(np.float64)

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

    def _inner_scores(self, lm, convs, plan, steps, pairs, splits, locator_stats,
                      writer_stats):
        """Step accuracy of every pair on every inner fold: shape (n_pairs, n_splits)."""
        out = np.zeros((len(pairs), len(splits)))
        n_loc = max(p[0] for p in pairs)
        n_wri = max(p[1] for p in pairs)
        for fold, (train, test) in enumerate(splits):
            locators = _rank(_mean_scores(locator_stats, train))[:n_loc]
            writers = _rank(_mean_scores(writer_stats, train))[:n_wri]
            sub = [convs[i] for i in test]
            subplan = Bunch(**plan)
            for key in ("prefixes", "continuations", "encodings"):
                subplan[key] = [plan[key][i] for i in test]
            rows = [_answer_pass(lm, p)[0] for p in subplan.prefixes]
            plain = None
            for k, (a, b) in enumerate(pairs):
                grafts = [_graft_rows(r, locators[:a], writers[:b], float(self.mix))
                          for r in rows]
                if not any(grafts):
                    if plain is None:
                        plain = self._score_plan(lm, sub, subplan)
                    scores = plain
                else:
                    scores = self._score_plan(lm, sub, subplan, _graft_context(lm, grafts))
                hits = [int(np.argmax(s)) == int(steps[i]) for s, i in zip(scores, test)]
                out[k, fold] = np.mean(hits)
            log(self, 1, f"inner fold {fold + 1}/{len(splits)}: "
                         + ", ".join(f"{p}: {out[k, fold]:.3f}" for k, p in enumerate(pairs)))
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
        locators = [tuple(h) for h in self.locator_heads_]
        writers = [tuple(h) for h in self.writer_heads_]
        grafts = [_graft_rows(_answer_pass(lm, p)[0], locators, writers, float(self.mix))
                  for p in plan.prefixes]
        return self._score_plan(lm, convs, plan, _graft_context(lm, grafts))
