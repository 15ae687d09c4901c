"""Tests for skafa.llm._prompt and skafa.testing (tiny tokenizer, models, conversations)."""

import datetime as _dt
import json
import pickle
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from skafa.conversation import Conversation, Turn
from skafa.exceptions import PromptTooLongError
from skafa.llm import (
    Encoding,
    PromptPlan,
    PromptTemplate,
    check_fits,
    encode,
    plan,
    template_uses_date,
)
from skafa.testing import (
    make_conversations,
    make_tiny_gemma,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
    tiny_vocab_size,
)


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def llama_tok():
    return make_tiny_tokenizer(date_in_template=True)


def _conv(contents, speakers=None, **kw):
    speakers = speakers or [f"agent{i % 3}" for i in range(len(contents))]
    return Conversation([Turn(s, c) for s, c in zip(speakers, contents)],
                        task=kw.pop("task", "Add the numbers."),
                        expected_answer=kw.pop("expected_answer", "42"), **kw)


def _assert_positions_valid(enc, conv, template=PromptTemplate()):
    """Every position's token covers the turn's last character, in order, inside its line."""
    assert isinstance(enc, Encoding)
    assert enc.turn_positions.dtype == np.int64 and enc.input_ids.dtype == np.int64
    assert enc.turn_positions.shape == (len(conv),)
    assert enc.n_tokens == len(enc.input_ids) == len(enc.offsets)
    assert np.all(np.diff(enc.turn_positions) > 0)
    for i, (p, c) in enumerate(zip(enc.turn_positions, enc.turn_last_chars)):
        start, end = enc.offsets[p]
        assert start <= c < end, (i, start, c, end)
        # It is the LAST token covering that character.
        if p + 1 < enc.n_tokens:
            assert not (enc.offsets[p + 1][0] <= c < enc.offsets[p + 1][1])
        line_start, line_end = enc.turn_char_spans[i]
        assert line_start <= c < line_end
        if i + 1 < len(conv):  # never reaches into the next turn's line
            assert end <= enc.turn_char_spans[i + 1][0]
    # The character really is the end of the (possibly shortened) content.
    for i, turn in enumerate(conv.turns):
        content = enc.shortened_contents[i]
        pre, _ = template._turn_parts(i, turn)
        s = enc.turn_char_spans[i][0]
        assert enc.text[s:s + len(pre) + len(content)] == pre + content
        if content:
            assert enc.turn_last_chars[i] == s + len(pre) + len(content) - 1
        else:
            assert enc.turn_last_chars[i] == s + len(pre) - 1


# ------------------------------------------------------------------------ tiny tokenizer
def test_tiny_tokenizer_fast_roundtrip_and_deterministic(tok):
    assert tok.is_fast
    assert len(tok) == tiny_vocab_size()
    texts = ["Hello, world!", "héllo wörld 😀 ünïcödé \t tabs\n\nnewlines",
             "def f(x):\n    return {'a': [1, 2]}  # code", "日本語のテキスト", ""]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    other = make_tiny_tokenizer()
    assert other is not tok
    assert other.get_vocab() == tok.get_vocab()
    assert tok.unk_token is None  # byte-level: nothing is unknown


def test_tiny_tokenizer_special_tokens_and_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_llama_style_tokenizer_adds_bos_but_encode_has_one(llama_tok):
    assert template_uses_date(llama_tok)
    conv = make_conversations(1)[0]
    enc = encode(conv, llama_tok, chat_template_kwargs={"date_string": "26 Jul 2024"})
    bos = llama_tok.bos_token_id
    assert enc.input_ids[0] == bos and enc.input_ids[1] != bos
    assert int(np.sum(enc.input_ids == bos)) == 1
    # The trap encode avoids: tokenizing the rendered template with special tokens.
    doubled = llama_tok(enc.text)["input_ids"]
    assert doubled[:2] == [bos, bos]
    _assert_positions_valid(enc, conv)


# ------------------------------------------------------------------------ encode
def test_encode_positions_cover_last_character(tok):
    for conv in make_conversations(5, seed=3):
        enc = encode(conv, tok)
        _assert_positions_valid(enc, conv)
        for i, turn in enumerate(conv.turns):
            assert f"\n{i} - {turn.speaker}: {turn.content}\n" in enc.text
        assert enc.total_chars_removed == 0 and not enc.chars_removed.any()
        assert "Task: " + conv.task in enc.text
        assert "Expected answer: " + conv.expected_answer in enc.text


def test_encode_method_equals_function(tok):
    conv = make_conversations(1)[0]
    t = PromptTemplate(system="Judge.", instruction=None)
    a, b = t.encode(conv, tok), encode(conv, tok, template=t)
    assert a.text == b.text and np.array_equal(a.input_ids, b.input_ids)


def test_encode_tricky_contents(tok):
    conv = _conv([
        "",                             # empty: position at the prefix's last char
        "format {speaker} {i} {0} }{",  # braces are never formatted
        "ends with emoji 😀",            # multi-byte last char: last byte token
        "trailing newline\n",
        "   ",
        "<|im_start|>x",                 # special-token text is still located (warns)
        "multi\nline\ncontent.",
    ])
    with pytest.warns(UserWarning, match="special token"):
        enc = encode(conv, tok)
    _assert_positions_valid(enc, conv)
    assert "format {speaker} {i} {0} }{" in enc.text
    p = enc.turn_positions[2]
    assert enc.text[enc.offsets[p][0]:enc.offsets[p][1]].endswith("😀")
    # The emoji spans several byte tokens: all of them share its offsets, p is the last.
    assert tuple(enc.offsets[p - 1]) == tuple(enc.offsets[p])


def test_encode_repeated_lines_are_found_in_order(tok):
    # Identical turns and a system message that contains a turn line verbatim.
    conv = _conv(["same", "same", "same"], speakers=["a", "a", "a"], task="0 - a: same")
    t = PromptTemplate(system="0 - a: same\n1 - a: same", turn_format="{speaker}: {content}")
    enc = encode(conv, tok, template=t)
    starts = enc.turn_char_spans[:, 0]
    assert np.all(np.diff(starts) > 0)
    assert starts[0] > enc.text.index("Conversation:")
    _assert_positions_valid(enc, conv, t)


def test_custom_turn_format_and_sections(tok):
    conv = make_conversations(1, seed=5)[0]
    t = PromptTemplate(system=None, answer_header=None, history_header=None,
                       turn_format="Step {i} [{speaker}|{role}]\n{content}\n--",
                       instruction="Which?")
    enc = encode(conv, tok, template=t)
    assert "Expected answer" not in enc.text
    assert "You are a tiny test assistant." in enc.text  # template's default system
    assert "Step 0 [planner|]\n" in enc.text
    _assert_positions_valid(enc, conv, t)


def test_slow_tokenizer_rejected():
    class SlowTok:
        is_fast = False
        chat_template = "{{ messages }}"

    with pytest.raises(TypeError, match="fast"):
        encode(make_conversations(1)[0], SlowTok())
    with pytest.raises(TypeError, match="fast"):
        plan(make_conversations(1), SlowTok(), max_tokens=10)


def test_tokenizer_without_chat_template_rejected_or_rendered_plain():
    t = make_tiny_tokenizer()
    t.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        encode(make_conversations(1)[0], t, template=PromptTemplate(chat_template="tokenizer"))
    # The default, chat_template="auto", renders plain text (see test_read_recap_echo.py).
    assert encode(make_conversations(1)[0], t).rendering == "plain"


def test_template_that_rewrites_text_names_the_turn():
    t = make_tiny_tokenizer()
    t.chat_template = ("{% for m in messages %}{{ m['content'] | replace('beta', 'BETA') }}"
                       "{% endfor %}")
    conv = _conv(["alpha", "beta gamma", "delta"], speakers=["x", "y", "z"],
                 record_id="rec-7")
    with pytest.raises(ValueError, match=r"rec-7.*turn 1 \(speaker 'y'\)"):
        encode(conv, t)


def test_template_rejecting_system_role_gives_hint():
    t = make_tiny_tokenizer()
    t.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                       "{{ raise_exception('System role not supported') }}{% endif %}"
                       "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    conv = make_conversations(1)[0]
    with pytest.raises(ValueError, match="system_placement='user'"):
        encode(conv, t)
    enc = encode(conv, t, template=PromptTemplate(system_placement="user"))
    assert enc.text.startswith(PromptTemplate().system)


def test_content_only_format_with_empty_content_rejected(tok):
    conv = _conv(["x", ""], record_id="r2")
    with pytest.raises(ValueError, match=r"r2.*turn 1 renders to nothing"):
        encode(conv, tok, template=PromptTemplate(turn_format="{content}"))


def test_reserved_chat_template_kwargs_rejected(tok):
    with pytest.raises(ValueError, match="add_generation_prompt"):
        encode(make_conversations(1)[0], tok, chat_template_kwargs={"add_generation_prompt": 0})


def test_encode_rejects_non_conversation(tok):
    with pytest.raises(TypeError, match="not a skafa Conversation"):
        encode({"turns": []}, tok)


# ------------------------------------------------------------------------ date pinning
def _fake_datetime(day):
    class FakeDateTime(_dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 1, day, 12, 0, 0)

    return FakeDateTime


def test_date_pinned_template_is_stable_across_days(llama_tok, monkeypatch):
    from transformers.utils import chat_template_utils as ctu

    if not hasattr(ctu, "datetime"):
        pytest.skip("this transformers version does not expose chat_template_utils.datetime")
    conv = make_conversations(1)[0]
    results = {}
    for day in (3, 17):
        monkeypatch.setattr(ctu, "datetime", _fake_datetime(day))
        pinned = encode(conv, llama_tok, chat_template_kwargs={"date_string": "26 Jul 2024"})
        with pytest.warns(UserWarning, match="date"):
            unpinned = encode(conv, llama_tok)
        results[day] = (pinned, unpinned)
        assert f"Today Date: {day:02d} Jan 2024" in unpinned.text
        assert "Today Date: 26 Jul 2024" in pinned.text
    assert np.array_equal(results[3][0].input_ids, results[17][0].input_ids)
    assert results[3][0].text == results[17][0].text
    assert not np.array_equal(results[3][1].input_ids, results[17][1].input_ids)
    _assert_positions_valid(results[3][0], conv)


def test_no_date_warning_for_dateless_template(tok):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encode(make_conversations(1)[0], tok)


# ------------------------------------------------------------------------ shortening
def test_shorten_none_never_alters_text(tok):
    long = "x" * 3000 + " END"
    conv = _conv(["short", long])
    enc = encode(conv, tok, template=PromptTemplate())
    assert long in enc.text and "omitted" not in enc.text
    assert enc.total_chars_removed == 0


def test_head_tail_removes_exactly_and_marks(tok):
    content = "".join(chr(ord("a") + i % 26) for i in range(500))
    m = len(" [... 40 characters omitted ...] ")  # 33
    conv = _conv(["short turn", content, "x" * 100, "y" * (100 + m), "z" * (101 + m)])
    t = PromptTemplate(shorten="head_tail", max_turn_chars=100)
    enc = encode(conv, tok, template=t)
    assert enc.chars_removed.tolist() == [0, 400, 0, 0, m + 1]
    assert enc.total_chars_removed == 401 + m
    expected = content[:50] + " [... 400 characters omitted ...] " + content[-50:]
    assert expected in enc.text
    assert enc.shortened_contents[1] == expected
    assert "x" * 100 in enc.text  # exactly at the limit: untouched
    assert "y" * (100 + m) in enc.text  # the marker would not be shorter: untouched
    marker = f" [... {m + 1} characters omitted ...] "
    assert enc.shortened_contents[4] == "z" * 50 + marker + "z" * 50
    _assert_positions_valid(enc, conv, t)


def test_head_tail_odd_limit_and_custom_marker(tok):
    conv = _conv(["0123456789abcdefghij"])
    t = PromptTemplate(shorten="head_tail", max_turn_chars=3, marker="<{n}>")
    enc = encode(conv, tok, template=t)
    assert enc.shortened_contents[0] == "01<17>j"
    assert enc.chars_removed.tolist() == [17]


def test_middle_first_fits_and_shortens_longest_first(tok):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "code", "plan", "the", "result"]
    long_a = " ".join(rng.choice(words, 400))
    long_b = " ".join(rng.choice(words, 150))
    conv = _conv(["short one", long_a, "also short", long_b, "tiny"], task_id="t9")
    full = encode(conv, tok)
    budget = full.n_tokens // 2
    t = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    enc = encode(conv, tok, template=t)
    assert enc.n_tokens <= budget
    assert enc.chars_removed[0] == enc.chars_removed[2] == enc.chars_removed[4] == 0
    assert enc.chars_removed[1] > enc.chars_removed[3] > 0
    # Both long turns are capped at the same kept length (water level).
    kept = [len(c) - r for c, r in zip([long_a, long_b], enc.chars_removed[[1, 3]])]
    assert kept[0] == kept[1]
    for i in (1, 3):
        n = int(enc.chars_removed[i])
        assert f" [... {n} characters omitted ...] " in enc.shortened_contents[i]
        orig = conv.turns[i].content
        assert len(enc.shortened_contents[i]) == len(orig) - n + len(t.marker.format(n=n))
    assert enc.total_chars_removed == int(enc.chars_removed.sum())
    _assert_positions_valid(enc, conv, t)
    # A budget that already fits changes nothing.
    same = encode(conv, tok, template=PromptTemplate(shorten="middle_first",
                                                     max_prompt_tokens=full.n_tokens))
    assert same.text == full.text and same.total_chars_removed == 0


def test_middle_first_impossible_budget_raises(tok):
    conv = _conv(["a" * 200, "b" * 200], task_id="T1", record_id="R1")
    t = PromptTemplate(shorten="middle_first", max_prompt_tokens=20)
    with pytest.raises(PromptTooLongError, match=r"task 'T1'.*record 'R1'.*20"):
        encode(conv, tok, template=t)
    p = plan([conv], tok, t, max_tokens=20)
    assert not p[0]["fits"] and p[0]["n_tokens"] > 20


@pytest.mark.parametrize("kwargs, match", [
    (dict(shorten="head_tail"), "needs max_turn_chars"),
    (dict(shorten="middle_first"), "needs max_prompt_tokens"),
    (dict(max_turn_chars=10), "only applies"),
    (dict(max_prompt_tokens=10), "only applies"),
    (dict(shorten="cut"), "must be one of"),
    (dict(shorten="head_tail", max_turn_chars=0), "positive int"),
    (dict(turn_format="{i}: {speaker}"), "exactly once"),
    (dict(turn_format="{i} {content} {content}"), "exactly once"),
    (dict(turn_format="{step} {content}"), "not a valid format"),
    (dict(marker="{m}"), "marker"),
    (dict(system_placement="assistant"), "system_placement"),
])
def test_template_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PromptTemplate(**kwargs)


# ------------------------------------------------------------------------ serialisation
def test_template_serialisation_and_fingerprint():
    t = PromptTemplate(shorten="middle_first", max_prompt_tokens=8192)
    d = t.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert PromptTemplate.from_dict(d) == t
    assert PromptTemplate.from_dict(json.loads(json.dumps(d))).fingerprint() == t.fingerprint()
    assert pickle.loads(pickle.dumps(t)) == t
    assert t.fingerprint() != PromptTemplate().fingerprint()
    assert PromptTemplate().fingerprint() == PromptTemplate().fingerprint()
    assert hash(t) == hash(PromptTemplate.from_dict(d))
    with pytest.raises(ValueError, match="Unknown PromptTemplate field"):
        PromptTemplate.from_dict({**d, "bogus": 1})
    with pytest.raises(Exception):
        t.shorten = "none"  # frozen


def test_default_fingerprint_is_pinned():
    # Golden value: if this changes, cached activations from earlier versions no longer
    # match. Change it only together with the default wording or PROMPT_FORMAT_VERSION.
    assert PromptTemplate().fingerprint() == (
        "ccb0d27c58e16fc0c6af1b6ea8ac2521a751c5229215868fa9e8f3d4a564483e"
    )


def test_template_clones_with_sklearn():
    from sklearn.base import BaseEstimator, clone

    class Est(BaseEstimator):
        def __init__(self, prompt=None):
            self.prompt = prompt

    est = Est(prompt=PromptTemplate(shorten="head_tail", max_turn_chars=50))
    assert clone(est).prompt == est.prompt


# ------------------------------------------------------------------------ plan / check_fits
def test_check_fits_names_conversation(tok):
    convs = make_conversations(4)
    enc = encode(convs[3], tok)
    assert check_fits(enc, enc.n_tokens, 3, convs[3]) is enc
    with pytest.raises(ValueError) as info:
        check_fits(enc, 50, 3, convs[3])
    msg = str(info.value)
    assert "conversation 3" in msg and "task 'task-1'" in msg
    assert "record 'synthetic/3'" in msg
    assert f"{enc.n_tokens} prompt tokens" in msg and "limit of 50" in msg
    assert isinstance(info.value, PromptTooLongError) and info.value.n_tokens == enc.n_tokens


def test_plan_reports_every_conversation(tok):
    convs = make_conversations(6)
    lengths = [encode(c, tok).n_tokens for c in convs]
    t = PromptTemplate(shorten="middle_first", max_prompt_tokens=1)
    minimal = [r["n_tokens"] for r in plan(convs, tok, t, max_tokens=1)]  # reports, no raise
    assert all(m < n for m, n in zip(minimal, lengths))
    limit = max(sorted(lengths)[3], max(minimal))
    p = plan(convs, tok, max_tokens=limit)
    assert isinstance(p, PromptPlan) and len(p) == 6
    assert [r["n_tokens"] for r in p] == lengths
    assert [r["fits"] for r in p] == [n <= limit for n in lengths]
    assert [r["task_id"] for r in p] == [c.task_id for c in convs]
    assert [r["record_id"] for r in p] == [c.record_id for c in convs]
    assert not p.all_fit and len(p.too_long) == sum(n > limit for n in lengths)
    assert p.total_chars_removed == 0
    assert "PromptPlan(6 conversations" in repr(p)
    t = PromptTemplate(shorten="middle_first", max_prompt_tokens=limit)
    ps = plan(convs, tok, t, max_tokens=limit)
    assert ps.all_fit and ps.total_chars_removed > 0
    assert all(r["n_tokens"] <= limit for r in ps)
    assert all(sum(r["turn_chars_removed"]) == r["chars_removed"] for r in ps)


def test_plan_validates_max_tokens(tok):
    with pytest.raises(ValueError, match="max_tokens"):
        plan(make_conversations(1), tok, max_tokens=0)


# ------------------------------------------------------------------------ property test
def test_positions_property_random_texts(tok):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.lists(text, min_size=1, max_size=5))
    def check(contents):
        conv = _conv(contents)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enc = encode(conv, tok, template=PromptTemplate(system="S", instruction="Q?"))
        _assert_positions_valid(enc, conv)

    check()
    assert hypothesis


# ------------------------------------------------------------------------ testing helpers
def test_make_conversations():
    convs = make_conversations(7, min_turns=2, max_turns=5, seed=4)
    assert len(convs) == 7
    assert [c.task_id for c in convs] == ["task-0", "task-0", "task-1", "task-1", "task-2",
                                          "task-2", "task-3"]
    for c in convs:
        assert 2 <= len(c) <= 5
        assert 0 <= c.mistake_step < len(c)
        assert c.mistake_agent == c.turns[c.mistake_step].speaker
        assert set(c.speakers) <= {"planner", "coder", "critic"}
    assert make_conversations(7, min_turns=2, max_turns=5, seed=4) == convs
    assert make_conversations(7, seed=5) != make_conversations(7, seed=4)
    unl = make_conversations(3, labelled=False, speakers=("a",))
    assert all(c.mistake_step is None and c.mistake_agent is None for c in unl)
    assert all(set(c.speakers) == {"a"} for c in unl)
    # The planted error: only the decisive turn's sum is wrong.
    for c in convs:
        for i, turn in enumerate(c.turns):
            expr = turn.content.split("I computed ")[1].rstrip(".")
            lhs, rhs = expr.split(" = ")
            x, y = (int(v) for v in lhs.split(" + "))
            assert (x + y != int(rhs)) == (i == c.mistake_step)
    with pytest.raises(ValueError):
        make_conversations(2, min_turns=3, max_turns=2)


@pytest.mark.parametrize("factory", [make_tiny_llama, make_tiny_qwen2, make_tiny_gemma])
def test_tiny_models(factory, tok):
    import torch

    state = torch.random.get_rng_state()
    model = factory()
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.vocab_size == len(tok)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    assert model.config.max_position_embeddings == 512
    enc = encode(make_conversations(1)[0], tok)
    ids = torch.as_tensor(enc.input_ids)[None]
    with torch.no_grad():
        a = model(ids).logits
        b = factory()(ids).logits
        c = factory(seed=1)(ids).logits
    assert a.shape == (1, enc.n_tokens, len(tok))
    assert torch.equal(a, b) and not torch.equal(a, c)
    bigger = factory(n_layers=3, hidden=48, n_heads=6, n_kv_heads=3, max_position_embeddings=64)
    assert bigger.config.num_hidden_layers == 3 and bigger.config.max_position_embeddings == 64


# ------------------------------------------- odd task, answer and template text
def test_transcript_shaped_expected_answer_does_not_move_turns(tok):
    from skafa.llm import DEFAULT_INSTRUCTION, encode

    conv = Conversation([Turn("a", "x"), Turn("b", "y")], task="t",
                        expected_answer="Conversation:\n0 - a: x\n1 - b: y")
    enc = encode(conv, tok)
    start = enc.text.index("Conversation:\n0 - a: x\n1 - b: y\n\n" + DEFAULT_INSTRUCTION)
    start += len("Conversation:\n")
    assert enc.turn_char_spans.tolist() == [[start, start + 8], [start + 9, start + 17]]


def test_transcript_shaped_task_without_headers(tok):
    from skafa.llm import DEFAULT_INSTRUCTION, PromptTemplate, encode

    conv = Conversation([Turn("a", "x"), Turn("b", "y")], task="0 - a: x\n1 - b: y",
                        expected_answer="0 - a: x")
    t = PromptTemplate(task_header="", history_header=None, answer_header="")
    enc = encode(conv, tok, template=t)
    start = enc.text.index("0 - a: x\n1 - b: y\n\n" + DEFAULT_INSTRUCTION)
    assert enc.turn_char_spans.tolist() == [[start, start + 8], [start + 9, start + 17]]


def test_trimming_chat_template_is_still_located(tok):
    from skafa.llm import PromptTemplate, encode
    from skafa.testing import make_tiny_tokenizer

    t = make_tiny_tokenizer()
    t.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                       "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}")
    conv = Conversation([Turn("a", "x"), Turn("b", "y")], task="  padded task",
                        expected_answer="Conversation:\n0 - a: x")
    enc = encode(conv, t, template=PromptTemplate(system_placement="user", system=" sys ",
                                                  instruction=None))
    start = enc.text.index("Conversation:\n0 - a: x\n1 - b: y<|im_end|>")
    start += len("Conversation:\n")
    assert enc.turn_char_spans.tolist() == [[start, start + 8], [start + 9, start + 17]]


@pytest.mark.parametrize("field", ["task", "expected_answer", "speaker"])
def test_special_tokens_outside_turn_content_warn(tok, field):
    from skafa.llm import encode

    special = "<|im_start|>"
    speaker = f"b{special}" if field == "speaker" else "b"
    kwargs = {field: f"x {special} y"} if field != "speaker" else {}
    conv = Conversation([Turn("a", "x"), Turn(speaker, "y")], record_id="rs", **kwargs)
    label = {"task": "task", "expected_answer": "expected answer",
             "speaker": "turn 1 speaker"}[field]
    with pytest.warns(UserWarning, match=rf"rs.*{label}.*special token"):
        encode(conv, tok)


# -------------------------------------- format strings and the character budget
@pytest.mark.parametrize("kwargs, field", [
    (dict(turn_format="{i:>900000000} {content}"), "{i:>900000000}"),
    (dict(turn_format="{speaker.__class__.__mro__} {content}"), "{speaker.__class__.__mro__}"),
    (dict(turn_format="{speaker[0]} {content}"), "{speaker[0]}"),
    (dict(turn_format="{speaker!r} {content}"), "{speaker!r}"),
    (dict(marker=" [{n:09999}] "), "{n:09999}"),
    (dict(marker=" [{}] "), "{}"),
    (dict(recap_format="Step {i.real}"), "{i.real}"),
    (dict(recap_format="Step {0}"), "{0}"),
])
def test_template_format_fields_are_plain(kwargs, field):
    with pytest.raises(ValueError, match="not a valid format.*" + field.replace("{", r"\{")
                       .replace("}", r"\}").replace("[", r"\[").replace("]", r"\]")
                       .replace(".", r"\.").replace("!", "!")):
        PromptTemplate(**kwargs)
    with pytest.raises(ValueError, match="not a valid format"):
        PromptTemplate.from_dict({**PromptTemplate().to_dict(), **kwargs})


def _big_conversation(n_chars):
    return Conversation([Turn("a", "hello"), Turn("b", "x" * n_chars), Turn("c", "bye")],
                        task="t", task_id="T9", record_id="R9")


def test_character_budget_checked_before_tokenizing():
    from skafa.llm import encode, plan
    from skafa.testing import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    conv = _big_conversation(2_000_000)
    with pytest.raises(PromptTooLongError, match=r"record 'R9'.*refused before tokenizing.*"
                                                  r"turn 1 is the longest"):
        encode(conv, tok, max_tokens=4096)
    short = encode(conv, tok, template=PromptTemplate(shorten="middle_first",
                                                      max_prompt_tokens=500))
    assert short.n_tokens <= 500 and short.chars_removed[1] > 1_900_000
    rows = plan([conv], tok, max_tokens=4096)
    assert not rows[0]["fits"] and rows[0]["n_tokens"] > 4096


_MEMORY_CAPPED = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
    from skafa import Conversation, Turn
    from skafa.exceptions import PromptTooLongError
    from skafa.llm import PromptTemplate, encode
    from skafa.testing import make_tiny_tokenizer
    tok = make_tiny_tokenizer()
    conv = Conversation([Turn("a", "hi"), Turn("b", "y" * 50_000_000)], task="t",
                        record_id="R50")
    try:
        encode(conv, tok)
    except PromptTooLongError as exc:
        assert "R50" in str(exc) and "turn 1" in str(exc), exc
    else:
        sys.exit("a 50 MB turn was tokenized")
    enc = encode(conv, tok, template=PromptTemplate(shorten="head_tail", max_turn_chars=1000))
    assert enc.n_tokens < 5000
    print("ok")
""")


def test_50mb_turn_under_memory_cap():
    if sys.platform != "linux":
        pytest.skip("RLIMIT_AS is enforced on Linux")
    done = subprocess.run([sys.executable, "-c", _MEMORY_CAPPED], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
