"""How a prompted judge asks: the Who&When strategies on the probes' model and prompt.

:class:`~skafa.baselines.PromptedJudge` asks its model for the decisive step in one
of four ways (its ``strategy`` parameter); this module holds the three that ask
several questions about one run. Every question is the judge's
:class:`~skafa.llm.PromptTemplate` with its closing instruction replaced by the
question, followed by the start of the answer; every answer is read by
log-probability over a closed set of candidate answers (no parsing), as the
all-at-once judge reads the step number.

``"step_by_step"``
    For ``t = 0, 1, ...`` the transcript up to turn ``t`` and the question "Is step
    ``t`` (speaker) the decisive error?"; the answer is *yes* when
    ``log p(Yes) - log p(No)`` exceeds the judge's ``yes_threshold``. It stops at
    the first yes, which is the prediction; when no turn gets a yes, every turn
    was asked and the most likely yes wins.
``"binary_search"``
    The whole transcript and the question "Is the decisive error in steps ``a-m``
    or in steps ``m+1-b``?" for the current range ``a..b`` (the first half holds
    ``ceil(n/2)`` turns); the chosen half becomes the range, until one turn is
    left: ``floor(log2 n)`` to ``ceil(log2 n)`` questions.
``"sequential"``
    The whole transcript and "Which agent is responsible for the decisive error?"
    among the run's speakers, then step by step over that agent's turns only:
    ``1 +`` the number of those turns asked.

This module says what to ask and when to stop (it never touches the model): the
questions (:class:`QuestionAsker`), the stopping rules and the turn scores. The
model answers through ``QuestionAsker.ask``, implemented by ``_judge._QuestionSession``:
the questions of one run share the system message, the task and the beginning of
the transcript, so it keeps the KV cache of the tokens it has read and runs only
what a new question does not share with them (the longest common token prefix),
then scores the candidates in one packed pass continuing that cache (as the
all-at-once judge does). A model with sliding-window layers keeps only the last
window of keys, which cannot be rolled back: there every question runs from
scratch. The cost of every run is counted on the model itself (a forward
pre-hook, :class:`PassCounter`): :meth:`PromptedJudge.strategy_report` returns it.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

__all__ = ["QuestionAsker", "binary_search", "word_continuation_mask", "yes_no_sweep"]

#: Question of "step_by_step" (and of the second stage of "sequential").
STEP_QUESTION = ("Is step {i} ({speaker}) the decisive error? Answer with Yes or No, in "
                 "the form 'Answer: <Yes or No>'.")
YES_NO_PREFIX = "Answer: "
YES, NO = "Yes", "No"
#: Question of "binary_search" about the range ``a..b`` split into ``a..m`` and ``m+1..b``.
RANGE_QUESTION = ("The decisive error is in {whole}. Is it in {first} or in {second}? "
                  "Answer in the form 'Steps: <first step>-<last step>'.")
RANGE_PREFIX = "Steps: "
#: Question of "sequential" (first stage).
AGENT_QUESTION = ("Which agent is responsible for the decisive error? The agents are: "
                  "{agents}. Answer with the name of the agent, in the form "
                  "'Agent: <name>'.")
AGENT_PREFIX = "Agent: "


# ----------------------------------------------------------------------------- answers
def word_continuation_mask(tokenizer, vocab_size):
    """Boolean mask of the token ids whose text starts with a letter, digit or ``_``.

    After a candidate word ("Yes", an agent's name) such a token would make the
    word longer ("No" -> "Not", "agent_1" -> "agent_10"); any other token (a
    space-led word, punctuation, the end of turn) ends it. Ids beyond the
    tokenizer's vocabulary count as ending the word.
    """
    n = min(len(tokenizer), int(vocab_size))
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    mask = np.zeros(int(vocab_size), dtype=bool)
    for i, tok in enumerate(tokens):
        if tok and (tok[0].isalnum() or tok[0] == "_"):
            mask[i] = True
    return mask


def log_sigmoid(x):
    """``log(1 / (1 + exp(-x)))``, elementwise, stable."""
    return -np.logaddexp(0.0, -np.asarray(x, dtype=np.float64))


def first_yes(margins, threshold):
    """Index of the first margin above ``threshold``; without one, of the largest margin."""
    margins = np.asarray(margins, dtype=np.float64)
    above = np.flatnonzero(margins > threshold)
    return int(above[0]) if above.size else int(np.argmax(margins))


def settle(scores, prediction):
    """Make ``prediction`` the first argmax of ``scores`` (in place; returns them).

    Every strategy builds its turn scores so that its answer has the highest one;
    only an exact float tie with an earlier turn (two answers' log-probabilities
    within rounding) could break that, and then the answer's score is raised to
    the next float.
    """
    if int(np.argmax(scores)) != prediction:
        scores[prediction] = np.nextafter(np.max(scores), np.inf)
    return scores


def _span(a, b):
    return f"{a}" if a == b else f"{a}-{b}"


def _steps(a, b):
    return f"step {a}" if a == b else f"steps {a}-{b}"


# ----------------------------------------------------------------------------- counting
class PassCounter:
    """Count the forward passes of a model and the tokens they run (a pre-hook)."""

    def __init__(self):
        self.calls = 0
        self.tokens = 0

    @contextlib.contextmanager
    def counting(self, model):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.calls += 1
            if ids is not None:
                self.tokens += int(ids.numel())

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()


class QuestionAsker:
    """The three questions of the strategies, on top of one ``ask`` (the model's part).

    A subclass implements ``ask(kind, about, n_turns, question, answer_prefix,
    candidates, terminator)``: the log-probability of every candidate answer to
    ``question`` asked after the first ``n_turns`` turns of ``self.conv``
    (``terminator``: ``"number"`` or ``"word"``, what ends a candidate).
    """

    conv = None

    def ask(self, kind, about, n_turns, question, answer_prefix, candidates,
            terminator):  # pragma: no cover - abstract
        raise NotImplementedError

    def ask_step(self, t):
        """``log p(Yes) - log p(No)`` that turn ``t`` is the decisive error."""
        turn = self.conv.turns[t]
        s = self.ask("step", [int(t)], t + 1,
                     STEP_QUESTION.format(i=t, speaker=turn.speaker),
                     YES_NO_PREFIX, [YES, NO], "word")
        return float(s[0] - s[1])

    def ask_range(self, a, m, b):
        """Log-probabilities (normalised over the two) of the halves ``a..m``, ``m+1..b``."""
        s = self.ask("range", [int(a), int(m), int(b)], len(self.conv),
                     RANGE_QUESTION.format(whole=_steps(a, b), first=_steps(a, m),
                                           second=_steps(m + 1, b)),
                     RANGE_PREFIX, [_span(a, m), _span(m + 1, b)], "number")
        return s - np.logaddexp(s[0], s[1])

    def ask_agent(self, agents):
        """Log-probabilities (normalised over ``agents``) of each agent."""
        s = self.ask("agent", list(agents), len(self.conv),
                     AGENT_QUESTION.format(agents=", ".join(agents)),
                     AGENT_PREFIX, list(agents), "word")
        return s - np.logaddexp.reduce(s)


# ----------------------------------------------------------------------------- strategies
@dataclasses.dataclass
class Sweep:
    """The yes/no stage of one conversation: which turns, their margins, the base score.

    ``turns`` are the candidate turns in the order they are asked about,
    ``margins[k]`` is ``log p(Yes) - log p(No)`` for ``turns[k]`` (only the turns
    asked: a prefix of ``turns``), ``base`` the log-probability of the stage
    before (the agent, for "sequential"; 0 otherwise).
    """

    turns: list
    margins: list
    base: float = 0.0

    def decide(self, threshold):
        """The turn the stop-at-the-first-yes rule answers under ``threshold``."""
        k = first_yes(self.margins, threshold)
        return self.turns[k]


def yes_no_sweep(session, strategy, threshold, *, stop=True):
    """Ask the yes/no questions of ``"step_by_step"`` / ``"sequential"``.

    With ``stop`` the questions stop at the first margin above ``threshold``;
    without, every candidate turn is asked (to choose a threshold in ``fit``).
    """
    conv = session.conv
    if strategy == "sequential":
        agents = list(dict.fromkeys(conv.speakers))
        lq = session.ask_agent(agents)
        chosen = agents[int(np.argmax(lq))]
        turns = [t for t, s in enumerate(conv.speakers) if s == chosen]
        base = float(np.max(lq))
    else:
        turns, base = list(range(len(conv))), 0.0
    sweep = Sweep(turns=turns, margins=[], base=base)
    for t in turns:
        sweep.margins.append(session.ask_step(t))
        if stop and sweep.margins[-1] > threshold:
            break
    return sweep


def sweep_result(sweep, n_turns, threshold):
    """Prediction and turn scores of a yes/no sweep.

    A turn asked about scores ``base + log sigmoid(margin)`` (the log-probability
    of the answers that point at it: the agent, then yes, the two answers
    normalised); a turn never asked about scores ``-inf``. The first yes (or,
    without one, the largest margin) has the highest score.
    """
    prediction = sweep.decide(threshold)
    scores = np.full(n_turns, -np.inf)
    asked = sweep.turns[: len(sweep.margins)]
    scores[asked] = sweep.base + log_sigmoid(sweep.margins)
    return prediction, settle(scores, prediction)


def binary_search(session):
    """Halve the range until one turn is left; prediction and turn scores.

    A turn scores the log-probability (normalised over the two halves) of its half
    at the question that settled it: the half that was left out for every turn
    outside the final one, the half chosen last for the answer (0.0 for a
    one-turn run, which needs no question). Ties go to the first half. The
    answer's score is at least ``log 1/2``, every other one at most.
    """
    n = len(session.conv)
    a, b = 0, n - 1
    scores = np.zeros(n, dtype=np.float64)
    last = 0.0
    while a < b:
        m = a + (b - a + 2) // 2 - 1  # the first half has ceil(size / 2) turns
        lq = session.ask_range(a, m, b)
        if lq[0] >= lq[1]:
            scores[m + 1:b + 1], last, b = lq[1], lq[0], m
        else:
            scores[a:m + 1], last, a = lq[0], lq[1], m + 1
    scores[a] = last
    return a, settle(scores, a)
