"""Bad input tried as a new user would (issue 9, item 6): one test per case.

Every test here failed on the code before the fix (commit c38813f); the report of
branch h9-badinput lists them. Saved-probe cases live with persistence; the fuzzing
of the file readers is in ``test_fuzz_readers.py``.
"""

import json
import warnings

import numpy as np
import pytest
import scipy.sparse as sp

from skafa import Conversation, Turn, TurnFeatures
from skafa.conversation import ConversationError
from skafa.utils.fileio import DIGEST_KEY, read_safetensors, write_safetensors

SIZES = [3, 1, 4, 2]


def _offsets(sizes=SIZES):
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _dense(**kwargs):
    rng = np.random.default_rng(0)
    off = _offsets()
    kwargs.setdefault("sites", ["resid_pre.0", "resid_pre.1"])
    kwargs.setdefault("speakers", [f"agent{i}" for i in range(off[-1])])
    kwargs.setdefault("task_ids", ["t0", "t1", "t2", "t0"])
    return TurnFeatures(rng.normal(size=(off[-1], 2, 3)), off, **kwargs)


def _sparse():
    off = _offsets()
    values = sp.random(off[-1], 6, density=0.4, format="csr", random_state=0,
                       dtype=np.float32)
    return TurnFeatures(values, off, feature_names=[f"f{i}" for i in range(6)],
                        speakers=[f"s{i}" for i in range(off[-1])],
                        task_ids=["a", None, "b", "a"])


def _rewrite(path, edit):
    """Apply ``edit(tensors, metadata)`` and write the file back *with a fresh digest*.

    A digest is no signature: whoever edits a file can recompute it, so structure
    checks must catch what the digest cannot.
    """
    tensors, meta = read_safetensors(path)
    tensors = {k: np.array(v) for k, v in tensors.items()}
    meta = {k: v for k, v in meta.items() if k != DIGEST_KEY}
    edit(tensors, meta)
    write_safetensors(path, tensors, meta)


# ---------------------------------------------------------------------------
# TurnFeatures files: structure, digest, nesting
# ---------------------------------------------------------------------------

def test_tampered_sparse_index_out_of_range_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    _sparse().save(path)

    def edit(t, m):
        t["sparse_indices"][0] = 10**9  # on the old code .toarray() segfaulted

    _rewrite(path, edit)
    with pytest.raises(ValueError, match=r"x\.safetensors.*column index"):
        TurnFeatures.load(path)


@pytest.mark.parametrize("edit, message", [
    (lambda t, m: t["sparse_indices"].__setitem__(0, -1), "column index"),
    (lambda t, m: t["sparse_indptr"].__setitem__(2, 10**6), "indptr"),
    (lambda t, m: t.__setitem__("sparse_indptr", t["sparse_indptr"][::-1].copy()), "indptr"),
    (lambda t, m: t.__setitem__("sparse_indptr", t["sparse_indptr"][:-1].copy()), "indptr"),
    (lambda t, m: t.__setitem__("sparse_indices", t["sparse_indices"][:-1].copy()),
     "sparse_indices"),
    (lambda t, m: t.__setitem__("sparse_indices", t["sparse_indices"].astype(np.float64)),
     "dtype"),
    (lambda t, m: m.__setitem__("shape", "[11, 6]"), "indptr"),
    (lambda t, m: m.__setitem__("shape", "[10, 6, 1]"), "shape"),
    (lambda t, m: m.__setitem__("shape", "[10, 1000000000000000]"), "MAX_SPARSE_COLUMNS"),
    (lambda t, m: m.__setitem__("shape", "[10, -6]"), "shape"),
    (lambda t, m: m.__setitem__("shape", '"10"'), "shape"),
    (lambda t, m: t.__setitem__("offsets", np.array([0, 3, 2, 8, 10])), "offsets"),
    (lambda t, m: t.__setitem__("offsets", np.array([0.0, 3, 4, 8, 10])), "offsets"),
    (lambda t, m: m.__setitem__("speakers", json.dumps(["a"] * 9)), "speakers"),
    (lambda t, m: m.__setitem__("speakers", json.dumps([1] * 10)), "speakers"),
    (lambda t, m: m.__setitem__("task_ids", json.dumps(["a", "b"])), "task_ids"),
    (lambda t, m: m.__setitem__("task_ids", json.dumps([1.5, 2, 3, 4])), "task_ids"),
    (lambda t, m: m.__setitem__("feature_names", json.dumps(["f"] * 5)), "feature"),
    (lambda t, m: m.__setitem__("sites", json.dumps(["a", "b"])), "site"),
    (lambda t, m: m.__setitem__("sites", json.dumps([3])), "site"),
    (lambda t, m: m.__setitem__("sparse", "1"), "sparse"),
    (lambda t, m: t.__setitem__("extra", np.zeros(3)), "tensor"),
    (lambda t, m: m.pop("speakers"), "speakers"),
], ids=[
    'negative-index', 'indptr-past-end', 'indptr-decreasing', 'indptr-short',
    'indices-short', 'indices-float', 'shape-more-rows', 'shape-3d', 'shape-huge-columns',
    'shape-negative',
    'shape-not-list', 'offsets-decreasing', 'offsets-float', 'speakers-length',
    'speakers-int', 'task-ids-length', 'task-ids-float', 'feature-names-length',
    'sites-length', 'sites-int', 'sparse-not-bool', 'extra-tensor', 'speakers-missing',
])
def test_tampered_sparse_structure_is_refused(tmp_path, edit, message):
    path = tmp_path / "x.safetensors"
    _sparse().save(path)
    _rewrite(path, edit)
    with pytest.raises(ValueError, match=message):
        TurnFeatures.load(path)


@pytest.mark.parametrize("edit, message", [
    (lambda t, m: t.__setitem__("values", t["values"][:, :, :2].copy()), "shape"),
    (lambda t, m: t.__setitem__("values", t["values"][:, 0].copy()), "shape"),
    (lambda t, m: t.__setitem__("offsets", t["offsets"].astype(np.float32)), "offsets"),
    (lambda t, m: t.__setitem__("offsets", t["offsets"][None]), "offsets"),
    (lambda t, m: t.pop("values"), "values"),
], ids=[
    'values-fewer-features', 'values-2d', 'offsets-float', 'offsets-2d',
    'values-missing',
])
def test_tampered_dense_structure_is_refused(tmp_path, edit, message):
    path = tmp_path / "x.safetensors"
    _dense().save(path)
    try:
        _rewrite(path, edit)
    except (TypeError, ValueError, KeyError):  # safetensors cannot even store it
        pytest.skip("edit not representable in safetensors")
    with pytest.raises(ValueError, match=message):
        TurnFeatures.load(path)


def test_constructor_refuses_broken_sparse_matrix():
    m = sp.csr_matrix(np.eye(3))
    m.indices[0] = 7  # would crash the process in toarray()
    with pytest.raises(ValueError, match="column index"):
        TurnFeatures(m, [0, 3])


def _flip(path, where):
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("make", [_dense, _sparse])
def test_flipped_byte_in_values_or_offsets_is_detected(tmp_path, make):
    X = make()
    path = tmp_path / "x.safetensors"
    X.save(path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    regions = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    assert "offsets" in regions
    for name, (start, end) in regions.items():  # one flipped byte in every tensor
        for where in (start, end - 1):
            X.save(path)
            _flip(path, 8 + n + where)
            with pytest.raises(ValueError, match="digest"):
                TurnFeatures.load(path)


def test_reordered_speakers_in_header_are_detected(tmp_path):
    X = _dense()
    path = tmp_path / "x.safetensors"
    X.save(path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    speakers = json.loads(header["__metadata__"]["speakers"])
    speakers[0], speakers[1] = speakers[1], speakers[0]  # same length: offsets unchanged
    header["__metadata__"]["speakers"] = json.dumps(speakers)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    path.write_bytes(raw[:8] + new + raw[8 + n:])
    with pytest.raises(ValueError, match="digest"):
        TurnFeatures.load(path)


def test_file_without_digest_needs_verify_false(tmp_path):
    from safetensors.numpy import save_file

    X = _dense()
    tensors, meta = X._tensors_and_metadata()
    path = tmp_path / "old.safetensors"
    save_file(tensors, str(path), metadata=meta)  # how skafa wrote files before digests
    with pytest.raises(ValueError, match="verify=False"):
        TurnFeatures.load(path)
    assert TurnFeatures.load(path, verify=False).equals(X)
    # verify=False still checks the structure
    bad = dict(meta, speakers=json.dumps(["a"]))
    save_file(tensors, str(path), metadata=bad)
    with pytest.raises(ValueError, match="speakers"):
        TurnFeatures.load(path, verify=False)


def test_deeply_nested_turnfeatures_header_is_a_value_error(tmp_path):
    path = tmp_path / "x.safetensors"
    _dense().save(path)
    deep = "[" * 100_000 + "]" * 100_000
    _rewrite(path, lambda t, m: m.__setitem__("sites", deep))
    with pytest.raises(ValueError, match="nested"):
        TurnFeatures.load(path)


# ---------------------------------------------------------------------------
# Cache entries
# ---------------------------------------------------------------------------

CACHE_SITES = ("resid_pre.0", "resid_final")


def _cache_entry(tmp_path):
    from skafa.llm import ActivationCache

    cache = ActivationCache(tmp_path, memory=False)
    key = "ab" * 32
    values = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    cache.put(key, CACHE_SITES, values)
    return cache, key, values


def test_cache_entry_with_reversed_site_names_is_corrupt(tmp_path):
    from skafa.exceptions import CacheCorruptionWarning
    from skafa.llm._cache import _crc

    cache, key, values = _cache_entry(tmp_path)
    path = cache.path(key)
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = header["__metadata__"]
    assert json.loads(meta["sites"]) == list(CACHE_SITES)
    meta["sites"] = json.dumps(list(CACHE_SITES[::-1]))  # same length, CRC unchanged
    assert meta["crc32"] == _crc(values)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    open(path, "wb").write(raw[:8] + new + raw[8 + n:])
    with pytest.warns(CacheCorruptionWarning, match="digest"):
        assert cache.get(key, CACHE_SITES, n_turns=3, hidden_size=4) is None


def test_cache_entry_without_digest_is_a_miss(tmp_path):
    from safetensors.numpy import save_file

    from skafa.exceptions import CacheCorruptionWarning

    cache, key, values = _cache_entry(tmp_path)
    tensors, meta = read_safetensors(cache.path(key))
    meta.pop(DIGEST_KEY)
    save_file({k: np.array(v) for k, v in tensors.items()}, cache.path(key), metadata=meta)
    with pytest.warns(CacheCorruptionWarning, match="digest"):
        assert cache.get(key, CACHE_SITES, n_turns=3, hidden_size=4) is None


def test_deeply_nested_cache_header_is_a_value_error(tmp_path):
    from skafa.llm._cache import _read_entry

    cache, key, values = _cache_entry(tmp_path)
    _rewrite(cache.path(key), lambda t, m: m.__setitem__("sites", "[" * 100_000))
    with pytest.raises(ValueError, match="nested"):
        _read_entry(cache.path(key), key, n_turns=3, hidden_size=4)


# ---------------------------------------------------------------------------
# TurnFeatures API
# ---------------------------------------------------------------------------

def test_equals_with_nan():
    X = _dense()
    X.values[0, 0, 0] = np.nan
    assert X.equals(X[np.arange(len(X))])
    Y = X.astype(X.dtype)  # a copy
    assert X.equals(Y)
    Y.values[0, 0, 1] = np.nan
    assert not X.equals(Y)
    S = _sparse()
    S.values.data[0] = np.nan
    assert S.equals(S[np.arange(len(S))])


@pytest.mark.parametrize("what", ["speakers", "task_ids"])
def test_concatenate_with_conflicting_speakers_or_task_ids(what):
    a = _dense()
    other = list(getattr(a, what))
    i = 5 if what == "speakers" else 2  # turn 5 is in conversation 2 (sizes 3, 1, 4, 2)
    other[i] = "someone else"
    b = _dense(**{what: other})
    with pytest.raises(ValueError, match=rf"{what}.*conversation 2"):
        TurnFeatures.concatenate([a, b])
    # a part without speakers/task ids takes them from the others
    c = _dense(**{what: None})
    assert getattr(TurnFeatures.concatenate([c, a]), what).tolist() == list(getattr(a, what))


@pytest.mark.parametrize("steps", [[1.7, 0, 0, 0], [True, False, True, False],
                                   ["1", 0, 0, 0]])
def test_non_integer_steps_are_refused(steps):
    X = _dense()
    with pytest.raises(ValueError, match=r"steps\[0\]|integer"):
        X.global_turn_index(steps)
    with pytest.raises(ValueError, match=r"steps\[0\]|integer"):
        X.speakers_at(steps)


def test_global_turn_index_accepts_integral_floats():
    X = _dense()
    assert X.global_turn_index([1.0, 0, 2, 1]).tolist() == [1, 3, 6, 9]


@pytest.mark.parametrize("site", [True, False, np.bool_(True), [True]])
def test_select_sites_refuses_booleans(site):
    with pytest.raises(TypeError, match="bool"):
        _dense().select_sites(site)


# ---------------------------------------------------------------------------
# Conversations and records
# ---------------------------------------------------------------------------

def _record(**changes):
    record = {
        "question": "What is 2 + 2?", "ground_truth": "4", "question_ID": "q1",
        "history": [{"name": "a", "role": "assistant", "content": "x"},
                    {"name": "b", "role": "assistant", "content": "y"}],
        "mistake_step": "1", "mistake_agent": "b",
    }
    record.update(changes)
    return {k: v for k, v in record.items() if v is not ...}


@pytest.mark.parametrize("task_id", [..., None, "", 5.5, True])
def test_record_without_question_id_is_refused(task_id):
    with pytest.raises(ConversationError, match=r"rec-3.*question_ID"):
        Conversation.from_who_and_when(_record(question_ID=task_id), record_id="rec-3")


def test_loader_names_and_counts_records_without_question_id(tmp_path):
    from skafa.datasets import load_who_and_when

    folder = tmp_path / "Algorithm-Generated"
    folder.mkdir()
    (folder / "1.json").write_text(json.dumps(_record()))
    (folder / "2.json").write_text(json.dumps(_record(question_ID=...)))
    with pytest.raises(ConversationError, match=r"2\.json.*question_ID"):
        load_who_and_when(tmp_path)
    with pytest.warns(UserWarning, match="skipped 1"):
        data = load_who_and_when(tmp_path, strict=False)
    assert len(data.conversations) == 1 and "question_ID" in data.skipped[0][1]


@pytest.mark.parametrize("step", ["1_0", "٣", "２", "+1", " 1 0", "0x1", "1.0", "-٣", "--1"])
def test_mistake_step_must_be_ascii_digits(step):
    history = [{"name": f"a{i}", "content": "x"} for i in range(12)]
    with pytest.raises(ConversationError, match="mistake_step"):
        Conversation.from_who_and_when(_record(history=history, mistake_step=step),
                                       record_id="r")


@pytest.mark.parametrize("step", ["1", " 1 ", 1, "01"])
def test_mistake_step_ascii_digits_still_accepted(step):
    assert Conversation.from_who_and_when(_record(mistake_step=step)).mistake_step == 1


@pytest.mark.parametrize("name", [5, 1.5, ["a"], {"a": 1}, True])
def test_from_messages_non_text_name_is_refused(name):
    msgs = [{"name": "a", "role": "user", "content": "x"},
            {"name": name, "role": "assistant", "content": "y"}]
    with pytest.raises(ConversationError, match=r"rec.*message 1.*'name'"):
        Conversation.from_messages(msgs, record_id="rec")


def test_from_messages_missing_or_empty_name_falls_back_to_role():
    msgs = [{"role": "user", "content": "x"}, {"name": "", "role": "bot", "content": "y"},
            {"name": None, "role": "bot", "content": "z"}]
    assert Conversation.from_messages(msgs).speakers == ("user", "bot", "bot")


def test_from_who_and_when_non_text_name_is_refused():
    history = [{"name": 7, "role": "assistant", "content": "x"}]
    with pytest.raises(ConversationError, match=r"r9.*history\[0\].*'name'"):
        Conversation.from_who_and_when(_record(history=history, mistake_step="0"),
                                       record_id="r9")


@pytest.mark.parametrize("data, message", [
    ({}, "'turns'"),
    ({"turns": [{"content": "x"}]}, r"turns\[0\].*'speaker'"),
    ({"turns": [{"speaker": "a"}]}, r"turns\[0\].*'content'"),
    ({"turns": ["a"]}, r"turns\[0\]"),
    ({"turns": "ab"}, "'turns'"),
    ([1, 2], "mapping"),
])
def test_from_dict_missing_key_is_a_conversation_error(data, message):
    with pytest.raises(ConversationError, match=message):
        Conversation.from_dict(data)


def test_from_dict_names_the_record():
    with pytest.raises(ConversationError, match=r"record 'r1'.*turns\[1\].*'speaker'"):
        Conversation.from_dict({"record_id": "r1", "turns": [
            {"speaker": "a", "content": "x"}, {"content": "y"}]})


@pytest.mark.parametrize("field", ["content", "speaker", "task", "expected_answer"])
def test_lone_surrogate_is_refused_naming_the_turn(field):
    turns = [Turn("a", "fine"), Turn("b", "also fine")]
    kwargs = {}
    bad = "broken \ud800 text"
    if field in ("content", "speaker"):
        turns[1] = Turn(bad if field == "speaker" else "b", bad if field == "content" else "y")
        match = rf"rec-s.*turn 1.*{field}.*surrogate"
    else:
        kwargs[field] = bad
        match = rf"rec-s.*{field}.*surrogate"
    with pytest.raises(ConversationError, match=match):
        Conversation(turns, record_id="rec-s", **kwargs)


def test_lone_surrogate_from_json_record_names_record_and_turn():
    record = json.loads(json.dumps(_record()).replace('"y"', '"\\udc80"'))
    with pytest.raises(ConversationError, match=r"rec-j.*turn 1"):
        Conversation.from_who_and_when(record, record_id="rec-j")


# ---------------------------------------------------------------------------
# Prompt rendering
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    from skafa.testing import make_tiny_tokenizer

    return make_tiny_tokenizer()


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


# ---------------------------------------------------------------------------
# Probes: magnitude and feature names
# ---------------------------------------------------------------------------

def _probe_data(seed=0):
    rng = np.random.default_rng(seed)
    off = np.arange(0, 41, 4)
    values = rng.normal(size=(40, 3))
    y = rng.integers(0, 4, size=10)
    values[off[:-1] + y, 0] += 3.0
    return values, off, y


def test_huge_feature_value_names_its_place():
    from skafa.probes import GroupedArgmaxLogisticClassifier

    values, off, y = _probe_data()
    values[5, 1] = 1e300
    X = TurnFeatures(values, off, task_ids=[f"t{i}" for i in range(10)])
    with pytest.raises(ValueError, match=r"too large.*conversation 1 \(task 't1'\), turn 1, "
                                         r"site 'features', feature 1"):
        GroupedArgmaxLogisticClassifier().fit(X, y)


def test_permuted_feature_names_are_refused_at_predict():
    from skafa.probes import GroupedArgmaxClassifier, GroupedArgmaxLogisticClassifier

    values, off, y = _probe_data()
    X = TurnFeatures(values, off, feature_names=["a", "b", "c"])
    Xp = TurnFeatures(values, off, feature_names=["b", "a", "c"])
    Xu = TurnFeatures(values, off, feature_names=["a", "b", "z"])
    for probe in (GroupedArgmaxLogisticClassifier(), GroupedArgmaxClassifier()):
        probe.fit(X, y)
        assert probe.feature_names_in_.tolist() == ["a", "b", "c"]
        probe.predict(X)
        with pytest.raises(ValueError, match="same order"):
            probe.predict(Xp)
        with pytest.raises(ValueError, match="unseen at fit.*z"):
            probe.predict(Xu)
        with pytest.warns(UserWarning, match="no feature names"):
            probe.predict(TurnFeatures(values, off))
        probe.fit(TurnFeatures(values, off), y)
        assert not hasattr(probe, "feature_names_in_")
        with pytest.warns(UserWarning, match="fitted without feature names"):
            probe.predict(X)


def test_permuted_feature_names_are_refused_by_per_turn_and_site_concatenator():
    from sklearn.preprocessing import StandardScaler

    from skafa.compose import PerTurn, SiteConcatenator

    X = _dense(feature_names=["a", "b", "c"])
    Xp = _dense(feature_names=["c", "b", "a"])
    for est in (PerTurn(StandardScaler()), SiteConcatenator(["resid_pre.0", "resid_pre.1"])):
        est.fit(X)
        est.transform(X)
        with pytest.raises(ValueError, match="same order"):
            est.transform(Xp)


# ---------------------------------------------------------------------------
# dtype and device
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model_name():
    from skafa.llm import register_model, unregister_model
    from skafa.testing import make_tiny_llama, make_tiny_tokenizer

    name = "skafa-test-bad-input"
    register_model(name, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    yield name
    unregister_model(name)


@pytest.mark.parametrize("param, value, message", [
    ("dtype", "int8", "dtype"), ("device", "banana", "device"),
    ("dtype", "float64", "float32"),  # the registered model is float32
])
def test_bad_dtype_or_device_fails_at_fit(tiny_model_name, param, value, message):
    from skafa import PromptedJudge, TurnActivationTransformer
    from skafa.testing import make_conversations

    convs = make_conversations(2)
    for est in (TurnActivationTransformer(tiny_model_name, **{param: value}),
                PromptedJudge(tiny_model_name, **{param: value})):
        with pytest.raises(ValueError, match=message):
            est.fit(convs)


def test_bad_dtype_or_device_in_load_model(tiny_model_name):
    from skafa.llm import load_model

    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model_name, dtype="int8")
    with pytest.raises(ValueError, match="device"):
        load_model(tiny_model_name, device="banana")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(tiny_model_name, dtype="float32", device="cpu")
