"""Hostile and odd input, round three (issue 33): bounded reads, no runtime settings
from files, format strings, readers' own errors, unlabelled runs, plot text."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skafa import Conversation, Turn
from skafa.exceptions import ConversationError, PromptTooLongError
from skafa.integrations.autogen import conversation_from_autogen
from skafa.integrations.langgraph import conversation_from_langgraph
from skafa.integrations.otel import conversation_from_otel_spans
from skafa.llm import PromptTemplate
from skafa.utils.fileio import read_regular_file, read_safetensors

# ---------------------------------------------------------------- A. bounded file reads


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_read_regular_file_refuses_devices_and_fifos(tmp_path):
    link = tmp_path / "entry.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular_file(link)
    with pytest.raises(ValueError, match="not a regular file"):
        read_safetensors(link)
    with pytest.raises(ValueError, match="regular file"):
        read_regular_file(link, follow_symlinks=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular_file(fifo)  # must not block waiting for a writer
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular_file(tmp_path)


def test_read_regular_file_bounds(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"abc")
    assert read_regular_file(f) == b"abc"
    assert read_regular_file(f, max_bytes=3) == b"abc"
    with pytest.raises(ValueError, match="more than the 2 bytes"):
        read_regular_file(f, max_bytes=2)
    ok = tmp_path / "ok"
    ok.symlink_to(f)
    assert read_regular_file(ok) == b"abc"
    with pytest.raises(ValueError, match="symbolic link"):
        read_regular_file(ok, follow_symlinks=False)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_saved_estimator_symlinked_to_dev_zero_is_refused(tmp_path):
    from skafa.persistence import load

    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / "skafa.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a regular file"):
        load(folder)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=300))
def test_read_safetensors_fuzz_only_value_errors(tmp_path, blob):
    f = tmp_path / "f.safetensors"
    f.write_bytes(blob)
    try:
        read_safetensors(f)
    except ValueError:
        pass


# ---------------------------------------------------------------- B. sparse column claims


def test_sparse_file_cannot_claim_more_columns_than_it_holds(tmp_path):
    import scipy.sparse as sp

    from skafa import TurnFeatures

    m = sp.csr_matrix((np.ones(3), [0, 1, 2], [0, 1, 2, 3]), shape=(3, 2**26))
    path = tmp_path / "x.safetensors"
    TurnFeatures(m, [0, 3], sites=["s"]).save(path)
    assert path.stat().st_size < 2000
    with pytest.raises(ValueError, match="67,108,864 columns.*justify at most"):
        TurnFeatures.load(path)
    small = sp.csr_matrix((np.ones(3), [0, 1, 2], [0, 1, 2, 3]), shape=(3, 2**20))
    TurnFeatures(small, [0, 3], sites=["s"]).save(path)
    assert TurnFeatures.load(path).values.shape == (3, 2**20)


# ---------------------------------------------------------------- C. format strings, budget


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


# ---------------------------------------------------------------- D. runtime settings


def test_load_takes_runtime_settings_from_the_caller(tmp_path):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    from skafa.persistence import RUNTIME_PARAMS, load, save

    assert {"cache_dir", "n_jobs", "device", "verbose"} <= set(RUNTIME_PARAMS)
    X = np.random.default_rng(0).normal(size=(20, 3))
    y = np.arange(20) % 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # sklearn 1.8: n_jobs has no effect
        pipe = Pipeline([("lr", LogisticRegression(n_jobs=8, verbose=3))],
                        verbose=True).fit(X, y)
    path = save(pipe, tmp_path / "p")
    loaded = load(path)
    assert loaded.steps[0][1].n_jobs is None and loaded.steps[0][1].verbose == 0
    assert loaded.verbose is False
    again = load(path, n_jobs=2, verbose=1)
    assert again.steps[0][1].n_jobs == 2 and again.steps[0][1].verbose == 1


def test_loaded_extractor_writes_nowhere(tmp_path):
    from skafa.llm import TurnActivationTransformer, register_model
    from skafa.persistence import load, save
    from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

    register_model("hostile-tiny", make_tiny_llama(seed=0), make_tiny_tokenizer(),
                   overwrite=True)
    cache = tmp_path / "named-in-file"
    X = make_conversations(3)
    ext = TurnActivationTransformer("hostile-tiny", sites=["resid_final"],
                                    cache_dir=str(cache), n_jobs=1).fit(X)
    path = save(ext, tmp_path / "ext")
    import shutil

    shutil.rmtree(cache, ignore_errors=True)
    loaded = load(path, verify_model=False)
    assert loaded.cache_dir is None and loaded.n_jobs is None and loaded.device == "cpu"
    loaded.transform(X)
    assert not cache.exists()
    own = tmp_path / "mine"
    assert load(path, cache_dir=str(own), verify_model=False).cache_dir == str(own)


# ---------------------------------------------------------------- E. readers' own errors


def _chat(span_id, parent=None, t=0, agent=None):
    attrs = {"gen_ai.operation.name": "chat",
             "gen_ai.output.messages": '[{"role": "assistant", "content": "hi"}]'}
    if agent:
        attrs["gen_ai.agent.name"] = agent
    return {"name": "chat", "span_id": span_id, "parent_id": parent, "start_ns": t,
            "attributes": attrs}


def _nested(depth):
    value = {"stringValue": "x"}
    for _ in range(depth):
        value = {"arrayValue": {"values": [value]}}
    return value


@pytest.mark.parametrize("spans, match", [
    ([{"name": "chat", "spanId": "a", "attributes": [{"value": {"stringValue": "x"}}]}],
     r"span 0: attribute 0 has no 'key'"),
    ({"spans": "abc"}, "'spans' must be a list, got str"),
    ({"resourceSpans": [{"scopeSpans": "x"}]}, r"resourceSpans\[0\]\.scopeSpans must be a list"),
    ([_chat("a"), _chat("a", t=1)], "spans 0 and 1 have the same span id 'a'"),
    ([{"name": "chat", "spanId": "a", "attributes": [{"key": "k", "value": _nested(100_000)}]}],
     "span 0: an attribute value nests more than"),
    ([{"name": "c", "span_id": "a", "attributes": 5}], "span 0: its attributes are a int"),
])
def test_otel_errors_name_the_trace_and_span(spans, match):
    with pytest.raises(ConversationError, match=r"trace 'r1': " + match):
        conversation_from_otel_spans(spans, record_id="r1")


def test_otel_deep_python_nesting_is_not_a_recursion_error():
    deep = current = []
    for _ in range(100_000):
        current.append([])
        current = current[0]
    span = {"name": "t", "span_id": "a", "attributes": {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "f",
        "gen_ai.tool.call.arguments": deep}}
    with pytest.raises(ConversationError, match="span 0: nested too deeply"):
        conversation_from_otel_spans([span])


def test_otel_agent_lookup_is_linear():
    import time

    spans = [{"name": "invoke_agent", "span_id": "s0", "start_ns": 0, "attributes": {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "boss"}}]
    spans += [_chat(f"s{i}", f"s{i - 1}", t=i) for i in range(1, 20_000)]
    start = time.perf_counter()
    conv, _ = conversation_from_otel_spans(spans)
    assert set(conv.speakers) == {"boss"}
    assert time.perf_counter() - start < 20  # quadratic: minutes


def test_otel_agent_lookup_keeps_nearest_agent():
    spans = [
        {"name": "a", "span_id": "A", "start_ns": 0, "attributes": {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "outer"}},
        {"name": "b", "span_id": "B", "parent_id": "A", "start_ns": 1, "attributes": {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "inner"}},
        _chat("c", "B", t=2), _chat("d", "A", t=3), _chat("e", "zz", t=4),
        _chat("f", "B", t=5, agent="own"),
    ]
    conv, _ = conversation_from_otel_spans(spans, agent_name="dflt")
    assert conv.speakers == ("inner", "outer", "dflt", "own")


@pytest.mark.parametrize("calls, match", [
    (5, "tool calls must be a list of calls, got int"),
    ("call it", "tool calls must be a list of calls, got str"),
    ({"name": "f"}, "tool calls must be a list of calls, got dict"),
    ([{"args": {}}], "tool call 0 has no name"),
])
def test_malformed_tool_calls_are_refused(calls, match):
    with pytest.raises(ConversationError, match="message 1: .*" + match):
        conversation_from_langgraph([{"type": "human", "content": "q"},
                                     {"type": "ai", "content": "", "tool_calls": calls}])
    with pytest.raises(ConversationError, match="message 1: .*" + match):
        conversation_from_autogen([
            {"type": "TextMessage", "source": "user", "content": "q"},
            {"type": "ToolCallRequestEvent", "source": "a", "content": calls}])


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                       st.text(max_size=5))
_json = st.recursive(_json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=3), st.dictionaries(st.sampled_from(
        ["name", "type", "content", "span_id", "parent_id", "spanId", "attributes", "key",
         "value", "tool_calls", "source", "spans", "resourceSpans", "scopeSpans",
         "gen_ai.operation.name", "start_ns", "args", "function", "status"]), c, max_size=4)),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(data=_json)
def test_adapters_fuzz_raise_only_their_own_errors(data):
    for adapter in (conversation_from_otel_spans, conversation_from_langgraph,
                    conversation_from_autogen):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                adapter(data)
        except (ConversationError, TypeError) as exc:
            # TypeError only for input that is not a list/document at all
            if isinstance(exc, TypeError):
                assert not isinstance(data, list), exc


# ---------------------------------------------------------------- who&when records


def _record(**change):
    record = {"question": "q", "ground_truth": "a", "question_ID": "T1",
              "history": [{"role": "x", "content": "c"}, {"role": "y", "content": "d"}],
              "mistake_step": "1", "mistake_agent": "y"}
    record.update(change)
    return record


def _folder(tmp_path, files):
    folder = tmp_path / "Hand-Crafted"
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def test_huge_mistake_step_is_skippable(tmp_path):
    from skafa.datasets import load_who_and_when

    text = json.dumps(_record()).replace('"mistake_step": "1"', '"mistake_step": ' + "9" * 5000)
    folder = _folder(tmp_path, {"1.json": json.dumps(_record()), "2.json": text})
    with pytest.raises(ConversationError, match="2.json"):
        load_who_and_when(folder)
    with pytest.warns(UserWarning, match="skipped 1"):
        data = load_who_and_when(folder, strict=False)
    assert len(data.conversations) == 1
    with pytest.raises(ConversationError, match="outside any history"):
        Conversation.from_who_and_when(_record(mistake_step="9" * 5000))


@pytest.mark.parametrize("key", ["question", "ground_truth"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused(tmp_path, key, value):
    from skafa.datasets import load_who_and_when

    text = json.dumps(_record(**{key: "PLACEHOLDER"})).replace('"PLACEHOLDER"', value)
    folder = _folder(tmp_path, {"1.json": text})
    with pytest.raises(ConversationError, match="1.json"):
        load_who_and_when(folder)
    with pytest.raises(ConversationError, match=f"'{key}' is .*not read as"):
        Conversation.from_who_and_when(_record(**{key: float(value)}))


def test_same_record_id_twice_is_refused(tmp_path):
    from skafa.datasets import load_who_and_when

    folder = _folder(tmp_path, {"1.json": json.dumps(_record()),
                                "1.JSON": json.dumps(_record())})
    if len(list(folder.iterdir())) < 2:
        pytest.skip("case-insensitive file system")
    with pytest.raises(ConversationError, match="record id 'Hand-Crafted/1'"):
        load_who_and_when(folder)


# ---------------------------------------------------------------- F. unlabelled runs


def test_unlabelled_runs_load_and_metrics_skip_them(tmp_path):
    from skafa.datasets import load_who_and_when
    from skafa.metrics import drop_unlabelled, step_accuracy

    absent = _record()
    del absent["mistake_step"], absent["mistake_agent"]
    folder = _folder(tmp_path, {"1.json": json.dumps(_record()),
                                "2.json": json.dumps(absent),
                                "3.json": json.dumps(_record(mistake_step=None,
                                                             mistake_agent=None))})
    with pytest.raises(ConversationError, match="labelled='auto'"):
        load_who_and_when(folder)
    data = load_who_and_when(folder, labelled="auto")
    assert [c.mistake_step for c in data.conversations] == [1, None, None]
    assert data.mistake_steps.tolist() == [1, -1, -1]
    none = load_who_and_when(folder, labelled=False)
    assert all(c.mistake_step is None for c in none.conversations)
    with pytest.warns(UserWarning, match="skipped 2 unlabelled conversation"):
        y, p = drop_unlabelled(data.mistake_steps, [1, 0, 0])
    assert step_accuracy(y, p) == 1.0
    with pytest.raises(ValueError, match="all 2 conversations are unlabelled"):
        drop_unlabelled([None, -1], [0, 0])
    conv = Conversation.from_who_and_when(absent, labelled="auto")
    assert conv.mistake_step is None and conv.mistake_agent is None


# ---------------------------------------------------------------- G. plot text


def test_dollar_in_speaker_names_plots():
    pytest.importorskip("matplotlib")
    from skafa.report import _plot_text

    assert _plot_text("a$b$c") == r"a\$b\$c"
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title(_plot_text("$\\frac$ cost $5"))
    fig.savefig(io.BytesIO(), format="png")  # raises on unbalanced mathtext
    plt.close(fig)
