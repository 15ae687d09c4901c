"""``read="recap"`` and ``read="echo"`` and the plain-text rendering, checked against references."""

import dataclasses
import os
import time

import numpy as np
import pytest
import torch
from sklearn.base import clone

from skafa import GroupedArgmaxLogisticClassifier, SiteSelector
from skafa.attributor import FailureAttributor
from skafa.conversation import Conversation, Turn
from skafa.exceptions import PromptTooLongError
from skafa.llm import (
    PromptTemplate,
    TurnActivationTransformer,
    activation_key,
    decoder_layout,
    encode,
    plan,
    register_model,
    shared_memory_cache,
    unregister_model,
)
from skafa.testing import (
    make_conversations,
    make_tiny_gemma,
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

RESID = ["resid_pre.0", "resid_pre.1", "resid_final"]  # what output_hidden_states gives
FACTORIES = {"llama": make_tiny_llama, "qwen2": make_tiny_qwen2, "gemma2": make_tiny_gemma,
             "gemma3": make_tiny_gemma3}


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    shared_memory_cache().clear()
    yield
    shared_memory_cache().clear()


def plain_tokenizer():
    """A fast tokenizer with a BOS token and no chat template, like a base model's."""
    tok = make_tiny_tokenizer(date_in_template=True)
    tok.chat_template = None
    tok.name_or_path = "skafa-tiny-base"
    return tok


@pytest.fixture
def tiny(request):
    family, plain = (request.param, False) if isinstance(request.param, str) else request.param
    model = FACTORIES[family](n_layers=2, seed=5)
    tok = plain_tokenizer() if plain else make_tiny_tokenizer()
    name = f"test-read-recap-echo-{family}-{'plain' if plain else 'chat'}"
    register_model(name, model, tok, overwrite=True)
    yield name, model, tok
    unregister_model(name)


def _reference(model, enc, sites, read):
    """Sites read from ``output_hidden_states=True`` at the encoding's read positions."""
    layout = decoder_layout(model)
    with torch.no_grad():
        hs = layout.decoder(torch.as_tensor(enc.input_ids)[None], output_hidden_states=True,
                            use_cache=False).hidden_states
    out = []
    for site in sites:
        h = (hs[-1] if site == "resid_final" else hs[int(site.split(".")[1])])[0].numpy()
        if read == "mean":
            out.append(np.stack([h[s:e + 1].mean(axis=0) for s, e in
                                 zip(enc.turn_start_positions, enc.turn_positions)]))
        else:
            out.append(h[enc.read_positions])
    return np.stack(out, axis=1)


def _check_read_tokens(enc, conv, template, tok):
    """The read positions hold the intended characters, decoded back from the tokens."""
    n = len(conv)
    pos = enc.read_positions
    assert pos.shape == (n,) and pos.dtype == np.int64
    assert np.all(np.diff(pos) > 0) and pos[0] > enc.turn_positions[-1]
    assert enc.n_tokens == len(enc.input_ids) and pos[-1] < enc.n_tokens
    if enc.read == "recap":
        spans = enc.recap_char_spans
        lines = [template.recap_format.format(i=i, speaker=t.speaker, role=t.role or "")
                 for i, t in enumerate(conv.turns)]
        lasts = spans[:, 1] - 1
        assert enc.echo_positions is None
    else:
        spans = enc.echo_char_spans
        lines = [enc.text[s:e] for s, e in enc.turn_char_spans]  # the first copy
        lasts = enc.turn_last_chars - enc.turn_char_spans[:, 0] + spans[:, 0]
        assert enc.recap_positions is None
    assert spans.shape == (n, 2)
    # Every read line follows the instruction, which follows the last turn.
    instr = enc.text.index(template.instruction, enc.turn_char_spans[-1, 1])
    assert instr == enc.turn_char_spans[-1, 1] + 2 and spans[0, 0] > instr
    for i in range(n):
        assert enc.text[spans[i, 0]:spans[i, 1]] == lines[i], i
        a, b = enc.offsets[pos[i]]
        c = int(lasts[i])
        assert a <= c < b, (i, a, b, c)
        # The token decodes to its span of text, which holds the line's last character...
        piece = tok.decode([int(enc.input_ids[pos[i]])])
        assert piece == enc.text[a:b], (i, piece, enc.text[a:b])
        assert piece[c - a] == enc.text[c]
        if enc.read == "recap":
            assert enc.text[c] == lines[i][-1]
        else:  # ... the same character as the turn's end in the first copy
            assert enc.text[c] == enc.text[enc.turn_last_chars[i]]
        # ... and it is the last token covering that character.
        if pos[i] + 1 < enc.n_tokens:
            assert enc.offsets[pos[i] + 1][0] > c or enc.offsets[pos[i] + 1][1] <= c


@pytest.mark.parametrize("read", ["recap", "echo"])
@pytest.mark.parametrize("tokenizer", [make_tiny_tokenizer, plain_tokenizer])
def test_read_positions_cover_the_intended_tokens(read, tokenizer):
    tok = tokenizer()
    template = PromptTemplate()
    for conv in make_conversations(6, min_turns=1, max_turns=7, seed=21):
        enc = encode(conv, tok, read=read)
        assert enc.read == read
        assert enc.rendering == ("plain" if tok.chat_template is None else "chat")
        _check_read_tokens(enc, conv, template, tok)
        # The transcript itself is rendered exactly as for read="last".
        last = encode(conv, tok)
        np.testing.assert_array_equal(enc.turn_positions, last.turn_positions)
        np.testing.assert_array_equal(enc.input_ids[:last.turn_positions[-1] + 1],
                                      last.input_ids[:last.turn_positions[-1] + 1])
        assert enc.n_tokens > last.n_tokens


def test_recap_format_and_headers_are_used_and_validated():
    tok = make_tiny_tokenizer()
    conv = make_conversations(1, min_turns=3, max_turns=3, seed=2)[0]
    t = PromptTemplate(recap_header=None, recap_format="[{i}|{speaker}|{role}]",
                       instruction="Which one?")
    enc = encode(conv, tok, template=t, read="recap")
    assert "Steps:" not in enc.text
    assert "Which one?\n\n[0|planner|]\n[1|" in enc.text
    _check_read_tokens(enc, conv, t, tok)
    e = encode(conv, tok, template=dataclasses.replace(t, echo_header="Again:"), read="echo")
    assert "Which one?\n\nAgain:\n0 - planner:" in e.text
    for bad in ("Step {i}\n", "Step {i} ", "", "{content}", "Step {j}"):
        with pytest.raises(ValueError, match="recap_format"):
            PromptTemplate(recap_format=bad)
    with pytest.raises(ValueError, match="read must be one of"):
        encode(conv, tok, read="first")
    with pytest.raises(ValueError, match="chat_template must be one of"):
        PromptTemplate(chat_template="none")


def test_recap_survives_a_trimming_chat_template_and_reports_a_rewriting_one():
    conv = make_conversations(1, seed=4)[0]
    tok = make_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}")
    enc = encode(conv, tok, read="recap")
    _check_read_tokens(enc, conv, PromptTemplate(), tok)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] | replace('Step ', 'S') }}"
                         "{% endfor %}")
    with pytest.raises(ValueError, match="recap lines were not found verbatim"):
        encode(conv, tok, read="recap")


@pytest.mark.parametrize("read", ["recap", "echo"])
@pytest.mark.parametrize("tiny", ["llama", "qwen2", "gemma2", "gemma3"], indirect=True)
def test_read_matches_reference(tiny, read):
    name, model, tok = tiny
    convs = make_conversations(3, min_turns=2, max_turns=5, seed=3)
    t = TurnActivationTransformer(name, read=read, sites=RESID, memory_cache=False).fit(convs)
    X = t.transform(convs)
    last = TurnActivationTransformer(name, sites=RESID, memory_cache=False).fit_transform(convs)
    assert t.run_stats["n_forward_passes"] == len(convs)
    for i, conv in enumerate(convs):
        enc = t.prompt_.encode(conv, tok, read=read)
        np.testing.assert_allclose(X[i], _reference(model, enc, t.sites_, read),
                                   rtol=1e-5, atol=1e-5, err_msg=f"conversation {i}")
        # The test can fail: these are not the turn-end vectors (layer 0 excluded,
        # where two equal tokens have equal vectors).
        deep = [j for j, s in enumerate(t.sites_) if s != "resid_pre.0"]
        assert not np.allclose(X[i][:, deep], last[i][:, deep], atol=1e-3)
    # Batched (right-padded) passes give the same vectors.
    batched = TurnActivationTransformer(name, read=read, sites=RESID, memory_cache=False,
                                        batch_size=3).fit_transform(convs)
    np.testing.assert_allclose(batched.values, X.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("read", ["recap", "echo"])
@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_every_turn_vector_sees_the_whole_run(tiny, read):
    """Changing the last turn changes turn 0's recap/echo vector, never its last-token one."""
    name, _, _ = tiny
    conv = make_conversations(1, min_turns=4, max_turns=4, seed=8)[0]
    turns = list(conv.turns)
    turns[-1] = Turn(turns[-1].speaker, turns[-1].content + " Then I changed my mind.")
    other = Conversation(turns, task=conv.task, expected_answer=conv.expected_answer,
                         task_id=conv.task_id, mistake_step=conv.mistake_step,
                         mistake_agent=conv.mistake_agent)
    for r, expect_change in (("last", False), (read, True)):
        t = TurnActivationTransformer(name, read=r, sites=["resid_final"],
                                      memory_cache=False).fit([conv])
        a, b = t.transform([conv]).values, t.transform([other]).values
        assert np.allclose(a[0], b[0], atol=1e-6) != expect_change, r


@pytest.mark.parametrize("read", ["last", "mean", "recap", "echo"])
@pytest.mark.parametrize("tiny", [("gemma3", True), ("llama", True)], indirect=True)
def test_plain_rendering_for_a_base_tokenizer_matches_reference(tiny, read):
    name, model, tok = tiny
    convs = make_conversations(3, min_turns=2, max_turns=5, seed=6)
    t = TurnActivationTransformer(name, read=read, sites=RESID, memory_cache=False).fit(convs)
    assert t.rendering_ == "plain"
    X = t.transform(convs)
    for i, conv in enumerate(convs):
        enc = t.prompt_.encode(conv, tok, read=read)
        assert enc.rendering == "plain"
        assert enc.text.startswith("<|begin_of_text|>" + PromptTemplate().system + "\n\nTask: ")
        assert enc.input_ids[0] == tok.bos_token_id
        assert (enc.input_ids == tok.bos_token_id).sum() == 1
        for k, (s, e) in enumerate(enc.turn_char_spans):
            assert enc.text[s:e].startswith(f"{k} - {conv.turns[k].speaker}: ")
            a, b = enc.offsets[enc.turn_positions[k]]
            assert a <= enc.turn_last_chars[k] < b
        if read in ("recap", "echo"):
            _check_read_tokens(enc, conv, t.prompt_, tok)
        np.testing.assert_allclose(X[i], _reference(model, enc, t.sites_, read),
                                   rtol=1e-5, atol=1e-5, err_msg=f"conversation {i}")


def test_plain_rendering_options_and_fingerprints():
    conv = make_conversations(1, seed=1)[0]
    chat_tok, base_tok = make_tiny_tokenizer(), plain_tokenizer()
    auto, plain = PromptTemplate(), PromptTemplate(chat_template="plain")
    strict = PromptTemplate(chat_template="tokenizer")
    assert auto.rendering(chat_tok) == "chat" and auto.rendering(base_tok) == "plain"
    assert plain.rendering(chat_tok) == "plain" and strict.rendering(chat_tok) == "chat"
    with pytest.raises(ValueError, match="no chat_template"):
        strict.rendering(base_tok)
    with pytest.raises(ValueError, match="no chat_template"):
        encode(conv, base_tok, template=strict)
    # "plain" on a chat tokenizer: no chat markup; no BOS for a tokenizer without one.
    text = encode(conv, chat_tok, template=plain).text
    assert "<|im_start|>" not in text and text.startswith(auto.system + "\n\nTask: ")
    assert text.endswith(auto.instruction + "\n")
    no_system = encode(conv, chat_tok, template=PromptTemplate(system=None,
                                                               chat_template="plain"))
    assert no_system.text.startswith("Task: ")
    # Fingerprints: plain rendering is recorded; old fingerprints are unchanged.
    assert auto.fingerprint() == auto.fingerprint(read="last", rendering="chat")
    assert auto.fingerprint(rendering="plain") != auto.fingerprint()
    assert plain.fingerprint() != auto.fingerprint()
    assert strict.fingerprint() != auto.fingerprint()
    assert PromptTemplate.from_dict(plain.to_dict()) == plain
    # to_dict of an old template (without the new fields) still loads.
    old = {k: v for k, v in auto.to_dict().items()
           if k not in ("recap_header", "recap_format", "echo_header", "chat_template")}
    assert PromptTemplate.from_dict(old) == auto


def test_fingerprints_per_read_keep_old_keys():
    t = PromptTemplate()
    # Fixed value: the fingerprint of PromptTemplate() before recap/echo/plain existed
    # (computed on the main branch at 7f01648), so existing caches stay valid.
    assert t.fingerprint() == "ccb0d27c58e16fc0c6af1b6ea8ac2521a751c5229215868fa9e8f3d4a564483e"
    assert t.fingerprint(read="mean") == t.fingerprint()
    fps = {r: t.fingerprint(read=r) for r in ("last", "recap", "echo")}
    assert len(set(fps.values())) == 3
    other = PromptTemplate(recap_format="Turn {i}: {speaker}", echo_header="Again:")
    assert other.fingerprint() == t.fingerprint()  # the last-token prompt is the same
    assert other.fingerprint(read="recap") != fps["recap"]
    assert other.fingerprint(read="echo") != fps["echo"]
    with pytest.raises(ValueError, match="read must be one of"):
        t.fingerprint(read="first")


def _padded(conv, k):
    """``conv`` with long turns (so that shortening has something to remove)."""
    turns = [Turn(t.speaker, t.content + " The log says: " + "row ok, " * (20 + 7 * (i + k)))
             for i, t in enumerate(conv.turns)]
    return Conversation(turns, task=conv.task, expected_answer=conv.expected_answer,
                        task_id=conv.task_id, mistake_step=conv.mistake_step)


def test_shortening_counts_the_copy_and_the_recap():
    tok = make_tiny_tokenizer()
    convs = [_padded(c, k) for k, c in enumerate(
        make_conversations(4, min_turns=3, max_turns=5, seed=13))]
    lengths = {r: plan(convs, tok, max_tokens=10 ** 6, read=r).n_tokens
               for r in ("last", "recap", "echo")}
    assert np.all(lengths["recap"] > lengths["last"])
    assert np.all(lengths["echo"] > lengths["recap"])
    # A budget every "last" prompt meets, but no echo prompt does unshortened.
    budget = int(lengths["last"].max())
    assert np.all(lengths["echo"] > budget)
    t = PromptTemplate(shorten="middle_first", max_prompt_tokens=budget)
    by_read = {r: plan(convs, tok, t, max_tokens=budget, read=r) for r in ("last", "echo")}
    assert by_read["last"].total_chars_removed == 0 and by_read["last"].all_fit
    assert by_read["echo"].all_fit and by_read["echo"].total_chars_removed > 0
    for i, conv in enumerate(convs):
        enc = encode(conv, tok, template=t, read="echo")
        assert enc.n_tokens <= budget
        assert enc.total_chars_removed == by_read["echo"][i]["chars_removed"]
        # Both copies carry the same shortened contents.
        for (s, e), (s2, e2) in zip(enc.turn_char_spans, enc.echo_char_spans):
            assert enc.text[s:e] == enc.text[s2:e2]
        if enc.total_chars_removed:
            assert "characters omitted" in enc.text[enc.echo_char_spans[0, 0]:]
    # Too small even for the marker-only prompt: reported, not cut silently.
    with pytest.raises(PromptTooLongError):
        encode(convs[0], tok, template=PromptTemplate(shorten="middle_first",
                                                      max_prompt_tokens=60), read="echo")


def test_context_check_counts_the_copy():
    tok = make_tiny_tokenizer()
    conv = _padded(make_conversations(1, min_turns=4, max_turns=4, seed=2)[0], 0)
    ctx = encode(conv, tok).n_tokens + 4  # the "last" prompt fits, the echo prompt does not
    assert encode(conv, tok, read="echo").n_tokens > ctx
    register_model("test-echo-context", make_tiny_llama(n_layers=1, max_position_embeddings=ctx),
                   tok, overwrite=True)
    try:
        TurnActivationTransformer("test-echo-context", memory_cache=False).fit_transform([conv])
        echo = TurnActivationTransformer("test-echo-context", read="echo", memory_cache=False)
        with pytest.raises(PromptTooLongError, match=f"more than the limit of {ctx}"):
            echo.fit_transform([conv])
        shortened = TurnActivationTransformer(
            "test-echo-context", read="echo", memory_cache=False,
            prompt=PromptTemplate(shorten="middle_first", max_prompt_tokens=ctx))
        assert shortened.fit_transform([conv]).values.shape[0] == len(conv)
    finally:
        unregister_model("test-echo-context")


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_read_is_part_of_the_cache_key(tiny, tmp_path):
    name, _, _ = tiny
    convs = make_conversations(2, seed=1)
    values = {}
    for read in ("last", "mean", "recap", "echo"):
        t = TurnActivationTransformer(name, read=read, cache_dir=tmp_path).fit(convs)
        values[read] = t.transform(convs).values
        assert t.run_stats["n_forward_passes"] == 2, read  # nothing reused from another read
        again = clone(t).fit(convs)
        np.testing.assert_array_equal(again.transform(convs).values, values[read])
        assert again.run_stats["n_forward_passes"] == 0
    for a, va in values.items():
        for b, vb in values.items():
            if a < b:
                assert not np.allclose(va, vb), (a, b)
    # A different recap format is a different recap prompt: recomputed, not reused.
    other = TurnActivationTransformer(name, read="recap", cache_dir=tmp_path,
                                      prompt=PromptTemplate(recap_format="Turn {i}")).fit(convs)
    assert not np.allclose(other.transform(convs).values, values["recap"])
    assert other.run_stats["n_forward_passes"] == 2
    # ...while a "last" read ignores it and reuses its entries.
    reuse = TurnActivationTransformer(name, cache_dir=tmp_path,
                                      prompt=PromptTemplate(recap_format="Turn {i}")).fit(convs)
    np.testing.assert_array_equal(reuse.transform(convs).values, values["last"])
    assert reuse.run_stats["n_forward_passes"] == 0
    base = {"model_identity": "m", "model_fingerprint": {}, "dtype": "float32",
            "prompt_fingerprint": "p", "chat_template_kwargs": None, "conversation": convs[0]}
    assert activation_key(**base) == activation_key(**base, read="last")
    keys = {activation_key(**base, read=r) for r in ("last", "mean", "recap", "echo")}
    assert len(keys) == 4


def test_plain_and_chat_renderings_do_not_share_cache_entries(tmp_path):
    model = make_tiny_llama(n_layers=1, seed=2)
    register_model("test-plain-cache", model, make_tiny_tokenizer(), overwrite=True)
    convs = make_conversations(2, seed=3)
    try:
        chat = TurnActivationTransformer("test-plain-cache", cache_dir=tmp_path).fit(convs)
        a = chat.transform(convs).values
        plain = TurnActivationTransformer("test-plain-cache", cache_dir=tmp_path,
                                          prompt=PromptTemplate(chat_template="plain"))
        b = plain.fit(convs).transform(convs).values
        assert plain.rendering_ == "plain" and plain.run_stats["n_forward_passes"] == 2
        assert not np.allclose(a, b)
    finally:
        unregister_model("test-plain-cache")


def test_failure_attributor_forwards_recap_and_echo():
    for read in ("recap", "echo"):
        fa = FailureAttributor(TurnActivationTransformer("smollm2", read=read))
        assert fa.get_params()["extractor__read"] == read
        assert fa._make_pipeline().named_steps["acts"].read == read
    with pytest.raises(ValueError, match="read.*must be a str among"):
        TurnActivationTransformer("x", read="recaps").fit(make_conversations(1))


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_failure_attributor_fits_with_recap(tiny):
    name, _, _ = tiny
    convs = make_conversations(12, min_turns=2, max_turns=4, seed=9)
    fa = FailureAttributor(
        TurnActivationTransformer(name, read="recap", sites=["resid_pre.1", "resid_final"]),
        SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0), cv=2)).fit(convs)
    assert fa.best_site_ in ("resid_pre.1", "resid_final")
    assert fa.predict(convs).shape == (len(convs),)


GEMMA = os.environ.get("SKAFA_GEMMA3_GGUF", "/work/models/gemma-3-270m-q4_k_m.gguf")
WHO_AND_WHEN = os.environ.get("SKAFA_WHO_AND_WHEN", "/work/shared/data/who_and_when")


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isfile(GEMMA), reason=f"Gemma-3-270M GGUF not found at {GEMMA}")
@pytest.mark.skipif(not os.path.isdir(WHO_AND_WHEN),
                    reason=f"Who&When data not found at {WHO_AND_WHEN}")
def test_gemma3_base_model_extracts_a_real_record():
    import skafa

    t0 = time.perf_counter()
    model, tok = skafa.load_model(GEMMA)
    load_s = time.perf_counter() - t0
    assert not tok.chat_template and type(model).__name__ == "Gemma3ForCausalLM"
    conv = skafa.load_who_and_when(WHO_AND_WHEN, subset="Algorithm-Generated").conversations[0]
    sites = ["resid_pre.9", "resid_final"]
    for read in ("last", "recap"):
        t1 = time.perf_counter()
        t = TurnActivationTransformer(GEMMA, read=read, sites=sites, memory_cache=False)
        X = t.fit_transform([conv])
        enc = t.prompt_.encode(conv, tok, read=read)
        print(f"gemma-3-270m read={read}: {enc.n_tokens} tokens, {len(conv)} turns, "
              f"extraction {time.perf_counter() - t1:.1f}s (load {load_s:.1f}s)")
        assert t.rendering_ == "plain" and enc.input_ids[0] == tok.bos_token_id
        assert X.values.shape == (len(conv), 2, 640) and np.isfinite(X.values).all()
        if read == "recap":
            _check_read_tokens(enc, conv, t.prompt_, tok)


def test_read_token_overhead_example_runs(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "read_token_overhead.py"
    spec = importlib.util.spec_from_file_location("read_token_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    counts = module.main(["--smoke", "--budget", "300"])
    out = capsys.readouterr().out
    assert "| `recap` |" in out and "| `echo` |" in out and "max_prompt_tokens=300" in out
    assert np.all(counts["last"] < counts["recap"]) and np.all(counts["recap"] < counts["echo"])
    tok, convs = make_tiny_tokenizer(), make_conversations(20, seed=0)
    np.testing.assert_array_equal(counts["echo"], [encode(c, tok, read="echo").n_tokens
                                                    for c in convs])
