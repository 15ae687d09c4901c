"""The prompted judge's Who&When strategies: step by step, binary search, sequential.

Tiny random models only. The adaptive strategies are checked three ways: real runs
(valid, deterministic, consistent answers; the shared-prefix KV cache gives the
scores a fresh pass gives), forced answers (a patched question that says yes at a
known turn, picks a known half or agent: the number of questions and passes is
exactly the strategy's), and the prompts themselves (the question, the turns shown).
"""

import math
import pickle

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.utils._param_validation import InvalidParameterError

from skafa.baselines import PromptedJudge
from skafa.baselines import _strategies as strategies
from skafa.baselines._judge import _end_masks as end_masks
from skafa.baselines._judge import _QuestionSession, packed_queries, score_candidates
from skafa.llm import load_model, register_model
from skafa.testing import (
    make_conversations,
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

LLAMA = "skafa-test-strategies-llama"
QWEN = "skafa-test-strategies-qwen2"
GEMMA3 = "skafa-test-strategies-gemma3"
ADAPTIVE = ["step_by_step", "binary_search", "sequential"]
PREFIX = {"step": strategies.YES_NO_PREFIX, "range": strategies.RANGE_PREFIX,
          "agent": strategies.AGENT_PREFIX}
TERMINATOR = {"step": "word", "range": "number", "agent": "word"}


def _sharpen(model, scale=30.0):
    # sharp attention: a wrong position or mask in the reused cache changes the scores
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def tiny():
    tok = make_tiny_tokenizer()
    register_model(LLAMA, _sharpen(make_tiny_llama(max_position_embeddings=4096, seed=3)),
                   tok, overwrite=True)
    qwen = _sharpen(make_tiny_qwen2(max_position_embeddings=4096, seed=4))
    qwen.set_attn_implementation("sdpa")
    register_model(QWEN, qwen, tok, overwrite=True)
    gemma3 = _sharpen(make_tiny_gemma3(max_position_embeddings=4096, seed=6, n_layers=3,
                                       sliding_window=8))
    gemma3.set_attn_implementation("sdpa")
    register_model(GEMMA3, gemma3, tok, overwrite=True)
    return tok


@pytest.fixture(scope="module")
def convs():
    return make_conversations(6, min_turns=2, max_turns=7, seed=7)


def _force(monkeypatch, answer):
    """Patch every question: the model runs as usual (its passes are counted), then
    ``answer(session, kind, about, candidates)`` replaces its scores (None: keep)."""
    original = _QuestionSession.ask

    def ask(self, kind, about, n_turns, question, prefix, candidates, terminator):
        scores = original(self, kind, about, n_turns, question, prefix, candidates,
                          terminator)
        forced = answer(self, kind, about, candidates)
        return scores if forced is None else np.asarray(forced, dtype=np.float64)

    monkeypatch.setattr(_QuestionSession, "ask", ask)


def _prompt_ids(judge, index, conv, record):
    lm, tok = load_model(judge.model)
    session = _QuestionSession(judge, lm, tok, index, conv, end_masks(tok, lm))
    return session.prompt(record["n_turns_shown"], record["question"],
                          PREFIX[record["kind"]], record["candidates"])


# ----------------------------------------------------------------------------- real runs
@pytest.mark.parametrize("name", [LLAMA, QWEN, GEMMA3])
@pytest.mark.parametrize("strategy", ADAPTIVE)
def test_valid_deterministic_and_consistent(tiny, convs, name, strategy):
    judge = PromptedJudge(name, strategy=strategy).fit(convs)
    pred = judge.predict(convs)
    assert pred.dtype == np.int64 and pred.shape == (len(convs),)
    assert all(0 <= p < len(c) for p, c in zip(pred, convs))
    np.testing.assert_array_equal(judge.predict(convs), pred)  # deterministic
    np.testing.assert_array_equal(PromptedJudge(name, strategy=strategy).fit(convs)
                                  .predict(convs), pred)
    report = judge.strategy_report(convs)
    np.testing.assert_array_equal(report.predictions, pred)
    scores = judge.turn_decision_function(convs)
    proba = judge.turn_predict_proba(convs)
    for p, s, r, q, conv in zip(pred, scores, report.turn_scores, proba, convs):
        assert s.shape == (len(conv),) and s.dtype == np.float64
        np.testing.assert_array_equal(s, r)
        assert int(np.argmax(s)) == p  # the answer is the first argmax
        assert abs(q.sum() - 1) < 1e-12 and np.all(q >= 0)
        np.testing.assert_array_equal(q == 0, np.isneginf(s))  # never asked: probability 0
    # a subset is judged as it is within the whole set (each run on its own)
    np.testing.assert_array_equal(judge.predict(convs[2:4]), pred[2:4])


@pytest.mark.parametrize("name", [LLAMA, QWEN])
@pytest.mark.parametrize("strategy", ADAPTIVE)
def test_shared_prefix_cache_gives_the_scores_of_a_fresh_pass(tiny, convs, name, strategy):
    # every question's scores, read from the rolled-back cache of the previous ones,
    # equal one clean pass over its own prompt; the tokens run are exactly those the
    # prompt does not share with the previous one, plus the packed candidates
    judge = PromptedJudge(name, strategy=strategy).fit(convs)
    report = judge.strategy_report(convs)
    lm, tok = load_model(name)
    masks = end_masks(tok, lm)
    for i, (conv, records) in enumerate(zip(convs, report.questions)):
        held, computed = np.zeros(0, dtype=np.int64), 0
        for record in records:
            ids, conts = _prompt_ids(judge, i, conv, record)
            fresh = score_candidates(lm, [ids], [conts], masks[TERMINATOR[record["kind"]]])[0]
            np.testing.assert_allclose(record["scores"], fresh, atol=1e-4, rtol=0)
            assert record["prompt_tokens"] == len(ids)
            shared = 0
            while shared < min(len(held), len(ids) - 1) and held[shared] == ids[shared]:
                shared += 1
            assert shared > 0 or not len(held)  # the system message is never run twice
            computed += len(ids) - 1 - shared + packed_queries([conts], lead=True)
            held = ids[:-1]
        assert report.computed_tokens[i] == computed
        assert report.prompt_tokens[i] == sum(r["prompt_tokens"] for r in records)
        assert report.computed_tokens[i] < report.prompt_tokens[i] or len(records) == 1


def test_all_at_once_report_matches_predict(tiny, convs):
    for name, per_question in [(LLAMA, None), (GEMMA3, "n+1")]:
        judge = PromptedJudge(name, batch_size=3).fit(convs)
        report = judge.strategy_report(convs)
        np.testing.assert_array_equal(report.predictions, judge.predict(convs))
        for s, r in zip(judge.turn_decision_function(convs), report.turn_scores):
            np.testing.assert_allclose(r, s, atol=1e-5)
        np.testing.assert_array_equal(report.n_questions, 1)
        # one pass over the prompt and one packed pass over every candidate; a
        # sliding-window model continues the prompt's cache once per candidate
        want = [2 if per_question is None else len(c) + 1 for c in convs]
        np.testing.assert_array_equal(report.forward_passes, want)
        assert np.all(report.prompt_tokens > report.run_tokens)  # + the answer prefix
        assert np.all(report.prompt_tokens - report.run_tokens < 8)
    # generation: the prompt's pass, then one pass per further token (or fewer: eos)
    judge = PromptedJudge(LLAMA, mode="generate", max_new_tokens=3).fit(convs)
    report = judge.strategy_report(convs)
    np.testing.assert_array_equal(report.predictions, judge.generate_report(convs).predictions)
    assert np.all((report.forward_passes >= 1) & (report.forward_passes <= 3))
    np.testing.assert_array_equal(report.n_questions, 1)


# ----------------------------------------------------------------------------- step by step
@pytest.mark.parametrize("name,passes", [(LLAMA, 2), (QWEN, 2), (GEMMA3, 3)])
def test_step_by_step_stops_at_the_first_yes(tiny, convs, monkeypatch, name, passes):
    # yes at turn min(2, n - 1) and at every later turn: the first one is the answer
    def answer(session, kind, about, candidates):
        assert kind == "step"
        return [5.0, 0.0] if about[0] >= min(2, len(session.conv) - 1) else [0.0, 5.0]

    _force(monkeypatch, answer)
    judge = PromptedJudge(name, strategy="step_by_step").fit(convs)
    report = judge.strategy_report(convs)
    target = np.array([min(2, len(c) - 1) for c in convs])
    np.testing.assert_array_equal(report.predictions, target)
    np.testing.assert_array_equal(report.n_questions, target + 1)
    # with the cache: one pass over the new tokens, one packed pass of Yes/No; a
    # sliding-window model: the prompt, then each answer continuing a copy of it
    np.testing.assert_array_equal(report.forward_passes, passes * (target + 1))
    for records, k, conv in zip(report.questions, target, convs):
        assert [r["about"] for r in records] == [[t] for t in range(k + 1)]
        assert [r["n_turns_shown"] for r in records] == list(range(1, k + 2))
    for s, k in zip(report.turn_scores, target):
        assert np.all(np.isneginf(s[k + 1:])) and np.all(np.isfinite(s[:k + 1]))
        assert s[k] == pytest.approx(-math.log1p(math.exp(-5.0)))


def test_step_by_step_without_a_yes_asks_every_turn(tiny, convs, monkeypatch):
    # every margin negative, the largest at turn n // 2: the most likely yes wins
    def answer(session, kind, about, candidates):
        n, t = len(session.conv), about[0]
        return [-1.0 - abs(t - n // 2), 0.0]

    _force(monkeypatch, answer)
    report = PromptedJudge(LLAMA, strategy="step_by_step").fit(convs).strategy_report(convs)
    np.testing.assert_array_equal(report.predictions, [len(c) // 2 for c in convs])
    np.testing.assert_array_equal(report.n_questions, [len(c) for c in convs])
    assert all(np.all(np.isfinite(s)) for s in report.turn_scores)


def test_yes_threshold_moves_the_first_yes(tiny, convs, monkeypatch):
    # margin of turn t: t - 1.5, so the first turn above threshold h is ceil(h + 1.5)
    _force(monkeypatch, lambda session, kind, about, candidates: [about[0] - 1.5, 0.0])
    for h, want in [(0.0, 2), (1.0, 3), (-1.0, 1), (-5.0, 0)]:
        judge = PromptedJudge(LLAMA, strategy="step_by_step", yes_threshold=h).fit(convs)
        assert judge.yes_threshold_ == h
        expected = [min(want, len(c) - 1) for c in convs]
        np.testing.assert_array_equal(judge.predict(convs), expected)


def test_fitted_threshold_is_chosen_on_the_labels(tiny, convs, monkeypatch):
    # a model that says yes to every turn up to the decisive one, but more loudly
    # there: threshold 0 stops at turn 0; any threshold in (0.5, 2) finds every label
    asked = []

    def answer(session, kind, about, candidates):
        t, y = about[0], session.conv.mistake_step
        asked.append(t)
        return [0.5 if t < y else 2.0 if t == y else -1.0, 0.0]

    _force(monkeypatch, answer)
    zero = PromptedJudge(LLAMA, strategy="step_by_step").fit(convs)
    np.testing.assert_array_equal(zero.predict(convs), 0)
    asked.clear()
    judge = PromptedJudge(LLAMA, strategy="step_by_step", yes_threshold="fit").fit(convs)
    assert len(asked) == sum(len(c) for c in convs)  # fit asks about every turn
    assert judge.yes_threshold_ == pytest.approx(1.25)  # the midpoint of 0.5 and 2.0
    assert judge.score(convs) == 1.0
    # the labels given to fit are the ones it fits: all-zero labels keep threshold 0
    # (among the thresholds below 0.5, the closest to 0)
    judge0 = PromptedJudge(LLAMA, strategy="step_by_step", yes_threshold="fit").fit(
        convs, np.zeros(len(convs), dtype=int))
    assert judge0.yes_threshold_ == 0.0


# ----------------------------------------------------------------------------- binary search
def _halvings(n, target):
    a, b, k = 0, n - 1, 0
    while a < b:
        m = a + (b - a + 2) // 2 - 1
        a, b = (a, m) if target <= m else (m + 1, b)
        k += 1
    return k


@pytest.mark.parametrize("name,passes", [(LLAMA, 2), (GEMMA3, 3)])
def test_binary_search_halves_down_to_one_turn(tiny, monkeypatch, name, passes):
    convs = make_conversations(12, min_turns=1, max_turns=13, seed=3)

    def answer(session, kind, about, candidates):
        a, m, b = about
        target = session.conv.mistake_step
        return [0.0, -3.0] if target <= m else [-3.0, 0.0]

    _force(monkeypatch, answer)
    report = PromptedJudge(name, strategy="binary_search").fit(convs).strategy_report(convs)
    np.testing.assert_array_equal(report.predictions, [c.mistake_step for c in convs])
    for conv, q, records in zip(convs, report.n_questions, report.questions):
        n = len(conv)
        assert q == _halvings(n, conv.mistake_step)
        assert math.floor(math.log2(n)) <= q <= math.ceil(math.log2(n))
        a, b = 0, n - 1
        for r in records:  # each range is the chosen half of the previous one
            assert r["about"][0] == a and r["about"][2] == b
            a, b = (a, r["about"][1]) if conv.mistake_step <= r["about"][1] else (
                r["about"][1] + 1, b)
            assert r["n_turns_shown"] == n  # the whole transcript every time
    np.testing.assert_array_equal(report.forward_passes, passes * report.n_questions)


def test_binary_search_always_first_half_asks_ceil_log2(tiny, monkeypatch):
    convs = make_conversations(10, min_turns=1, max_turns=17, seed=5)
    _force(monkeypatch, lambda session, kind, about, candidates: [0.0, -1.0])
    report = PromptedJudge(LLAMA, strategy="binary_search").fit(convs).strategy_report(convs)
    np.testing.assert_array_equal(report.predictions, 0)
    np.testing.assert_array_equal(report.n_questions,
                                  [math.ceil(math.log2(len(c))) for c in convs])
    for s, conv in zip(report.turn_scores, convs):
        # the answer scores log q(first half) at the last question; every other turn
        # the left-out half's; a one-turn run needs no question (log 1)
        if len(conv) > 1:
            assert s[0] == pytest.approx(-math.log1p(math.exp(-1.0)))
            assert np.allclose(s[1:], -math.log1p(math.exp(1.0)))
        else:
            assert s.tolist() == [0.0]
    assert any(len(c) == 1 for c in convs) and any(len(c) > 8 for c in convs)


# ----------------------------------------------------------------------------- sequential
@pytest.mark.parametrize("name,passes", [(LLAMA, 2), (GEMMA3, 3)])
def test_sequential_asks_the_agent_then_its_turns(tiny, convs, monkeypatch, name, passes):
    # the agent of the last turn is responsible; yes at its second turn (or its only one)
    def answer(session, kind, about, candidates):
        conv = session.conv
        chosen = conv.turns[-1].speaker
        if kind == "agent":
            return [0.0 if a == chosen else -4.0 for a in candidates]
        own = [t for t, s in enumerate(conv.speakers) if s == chosen]
        assert about[0] in own
        return [3.0, 0.0] if about[0] == own[min(1, len(own) - 1)] else [-3.0, 0.0]

    _force(monkeypatch, answer)
    report = PromptedJudge(name, strategy="sequential").fit(convs).strategy_report(convs)
    for conv, p, q, records, s, fp in zip(convs, report.predictions, report.n_questions,
                                          report.questions, report.turn_scores,
                                          report.forward_passes):
        own = [t for t, sp in enumerate(conv.speakers) if sp == conv.turns[-1].speaker]
        k = min(1, len(own) - 1)
        assert p == own[k]
        assert q == 1 + (k + 1)  # the agent, then that agent's turns up to the yes
        assert records[0]["kind"] == "agent"
        assert records[0]["candidates"] == list(dict.fromkeys(conv.speakers))
        assert [r["about"] for r in records[1:]] == [[t] for t in own[:k + 1]]
        assert set(np.flatnonzero(np.isfinite(s))) == set(own[:k + 1])
        n_agents = len(set(conv.speakers))
        # the agent question has one candidate per agent (a sliding-window model
        # continues its prompt's cache once per candidate)
        agent_passes = 2 if passes == 2 else 1 + n_agents
        assert fp == agent_passes + passes * (k + 1)


def test_sequential_real_run_counts(tiny, convs):
    report = PromptedJudge(QWEN, strategy="sequential").fit(convs).strategy_report(convs)
    for conv, p, q, records in zip(convs, report.predictions, report.n_questions,
                                   report.questions):
        agent = conv.turns[p].speaker
        own = [t for t, s in enumerate(conv.speakers) if s == agent]
        asked = [r["about"][0] for r in records[1:]]
        assert asked == own[:len(asked)] and p in asked
        assert q == 1 + len(asked)
        agent_scores = np.asarray(records[0]["scores"])
        assert records[0]["candidates"][int(np.argmax(agent_scores))] == agent


# ----------------------------------------------------------------------------- prompts
def test_prompts_hold_the_question_and_the_turns_shown(tiny, convs, monkeypatch):
    tok = tiny
    conv = max(convs, key=len)
    _force(monkeypatch, lambda session, kind, about, candidates:
           [0.0, 1.0] if kind in ("step", "range") else None)
    for strategy in ADAPTIVE:
        judge = PromptedJudge(LLAMA, strategy=strategy).fit([conv])
        records = judge.strategy_report([conv]).questions[0]
        for record in records:
            ids, conts = _prompt_ids(judge, 0, conv, record)
            text = tok.decode(ids)
            shown = record["n_turns_shown"]
            for t, turn in enumerate(conv.turns):  # exactly the turns shown
                assert (f"{t} - {turn.speaker}: {turn.content}" in text) == (t < shown)
            assert record["question"] in text
            assert judge.prompt_.instruction not in text  # the question replaces it
            assert conv.task in text
            assert text.rstrip().endswith(PREFIX[record["kind"]].rstrip())
            if record["kind"] == "step":
                t = record["about"][0]
                assert shown == t + 1
                assert f"Is step {t} ({conv.turns[t].speaker}) the decisive error?" in text
            elif record["kind"] == "range":
                a, m, b = record["about"]
                assert f"steps {a}-{b}" in text and f"steps {a}-{m}" in text
                assert (f"steps {m + 1}-{b}" if m + 1 < b else f"step {b}") in text
                assert record["candidates"] == [f"{a}-{m}" if m > a else f"{a}",
                                                f"{m + 1}-{b}" if b > m + 1 else f"{b}"]
            else:
                assert "The agents are: " + ", ".join(dict.fromkeys(conv.speakers)) in text
            # each candidate's tokens continue the answer prefix
            for cand, cont in zip(record["candidates"], conts):
                assert tok.decode(list(ids) + list(cont)).endswith(PREFIX[record["kind"]]
                                                                   + cand)


# ----------------------------------------------------------------------------- sklearn API
def test_params_clone_pickle_and_validation(tiny, convs):
    judge = PromptedJudge(LLAMA, strategy="binary_search", yes_threshold=0.5).fit(convs)
    params = judge.get_params()
    assert params["strategy"] == "binary_search" and params["yes_threshold"] == 0.5
    c = clone(judge)
    assert c.get_params() == params and not hasattr(c, "yes_threshold_")
    again = pickle.loads(pickle.dumps(judge))
    np.testing.assert_array_equal(again.predict(convs), judge.predict(convs))
    other = clone(judge).set_params(strategy="step_by_step").fit(convs)
    assert other.strategy_report(convs[:1]).questions[0][0]["kind"] == "step"
    with pytest.raises(InvalidParameterError, match="'strategy' parameter"):
        PromptedJudge(LLAMA, strategy="vote").fit(convs)
    with pytest.raises(InvalidParameterError, match="'yes_threshold' parameter"):
        PromptedJudge(LLAMA, strategy="step_by_step", yes_threshold="auto").fit(convs)
    with pytest.raises(InvalidParameterError, match="'yes_threshold' parameter"):
        PromptedJudge(LLAMA, strategy="step_by_step", yes_threshold=float("nan")).fit(convs)
    with pytest.raises(ValueError, match="needs mode='logprob'"):
        PromptedJudge(LLAMA, strategy="sequential", mode="generate").fit(convs)
    # "fit" needs labels, from y or the conversations
    unlabelled = make_conversations(2, seed=1, min_turns=2, max_turns=3)
    unlabelled = [type(c)(c.turns, task=c.task) for c in unlabelled]
    with pytest.raises(ValueError, match="mistake_step"):
        PromptedJudge(LLAMA, strategy="step_by_step", yes_threshold="fit").fit(unlabelled)
    # "fit" is unused by the strategies without yes/no questions
    assert PromptedJudge(LLAMA, strategy="binary_search",
                         yes_threshold="fit").fit(unlabelled).yes_threshold_ == 0.0


def test_save_load_round_trip(tiny, convs, tmp_path, monkeypatch):
    from skafa.persistence import load, save

    def answer(session, kind, about, candidates):
        t, y = about[0], session.conv.mistake_step
        return [0.3 if t < y else 1.0 if t == y else -1.0, 0.0]

    _force(monkeypatch, answer)
    judge = PromptedJudge(LLAMA, strategy="step_by_step", yes_threshold="fit").fit(convs)
    assert judge.yes_threshold_ == pytest.approx(0.65)
    loaded = load(save(judge, tmp_path / "judge"))
    assert repr(loaded) == repr(judge)
    assert loaded.strategy == "step_by_step" and loaded.yes_threshold == "fit"
    assert loaded.yes_threshold_ == judge.yes_threshold_
    np.testing.assert_array_equal(loaded.predict(convs), judge.predict(convs))


def test_verbose_reports_questions(tiny, convs, capsys):
    PromptedJudge(LLAMA, strategy="binary_search", verbose=1).fit(convs).predict(convs[:2])
    out = capsys.readouterr().out
    assert "2/2 conversations" in out and "questions" in out
