"""Tests for skafa.conversation: Turn, Conversation and their constructors."""

import copy
import dataclasses
import json
import pickle

import joblib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skafa.conversation import Conversation, ConversationError, Turn


def _record(**changes):
    record = {
        "question": "What is 2+2?",
        "ground_truth": "4",
        "question_ID": "task-1",
        "history": [
            {"content": "Let me compute.", "role": "assistant", "name": "Math_Expert"},
            {"content": "print(2+2)", "role": "user", "name": "Computer_terminal"},
            {"content": "The answer is 5.", "role": "assistant", "name": "Math_Expert"},
        ],
        "mistake_step": "2",
        "mistake_agent": "Math_Expert",
        "mistake_reason": "Misread the output.",
        "level": 1,
    }
    record.update(changes)
    return record


def _conv(**kwargs):
    turns = [Turn("planner", "Let's search."), Turn("coder", "print(1)", role="assistant")]
    return Conversation(turns, **kwargs)


# ----------------------------------------------------------------------- Turn
def test_turn_fields_and_to_dict():
    t = Turn("WebSurfer", "clicked", role="WebSurfer")
    assert (t.speaker, t.content, t.role) == ("WebSurfer", "clicked", "WebSurfer")
    assert t.to_dict() == {"speaker": "WebSurfer", "content": "clicked", "role": "WebSurfer"}
    assert Turn("a", "").content == ""  # empty content is allowed
    assert Turn("a", "x").role is None


@pytest.mark.parametrize("speaker", ["", "   ", None, 3, b"name"])
def test_turn_rejects_bad_speaker(speaker):
    with pytest.raises(ConversationError, match="speaker"):
        Turn(speaker, "text")


@pytest.mark.parametrize("content", [None, 3, ["a"], b"bytes"])
def test_turn_rejects_non_text_content(content):
    with pytest.raises(ConversationError, match="content must be a string"):
        Turn("a", content)


def test_turn_rejects_non_text_role():
    with pytest.raises(ConversationError, match="role"):
        Turn("a", "b", role=1)


def test_conversation_error_is_value_error():
    assert issubclass(ConversationError, ValueError)


def test_turn_is_frozen():
    t = Turn("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.speaker = "c"


# -------------------------------------------------------------- Conversation
def test_conversation_basics():
    conv = _conv(task="Print one.", mistake_step=1, mistake_agent="coder", task_id="t1",
                 record_id="r/1")
    assert len(conv) == conv.n_turns == 2
    assert conv.speakers == ("planner", "coder")
    assert conv.mistake_speaker == "coder"
    assert isinstance(conv.turns, tuple)
    assert [t.speaker for t in conv] == ["planner", "coder"]
    assert conv[0].content == "Let's search."
    assert conv[-1].role == "assistant"
    assert "record_id='r/1'" in repr(conv) and "mistake_step=1" in repr(conv)
    assert _conv().mistake_speaker is None
    assert "mistake_step" not in repr(_conv())


def test_conversation_normalises_fields():
    conv = _conv(task=None, expected_answer=1.5, task_id=np.int64(7), mistake_step=np.int64(1))
    assert conv.task == ""
    assert conv.expected_answer == "1.5"
    assert conv.task_id == 7 and type(conv.task_id) is int  # ids keep their type
    assert _conv(task_id="7").task_id == "7"
    with pytest.raises(ConversationError, match="task_id must be a str, an int or None"):
        _conv(task_id=7.0)
    assert conv.mistake_step == 1 and type(conv.mistake_step) is int
    assert _conv(expected_answer=None).expected_answer == ""
    assert _conv(expected_answer=42).expected_answer == "42"


@pytest.mark.parametrize("turns", ["abc", b"abc", 3, None, (t for t in [Turn("a", "b")])])
def test_conversation_rejects_non_sequence_turns(turns):
    with pytest.raises(ConversationError, match="sequence of Turn"):
        Conversation(turns)


def test_conversation_rejects_empty_and_non_turns():
    with pytest.raises(ConversationError, match="at least one turn"):
        Conversation([])
    with pytest.raises(ConversationError, match="turn 1 is a dict"):
        Conversation([Turn("a", "b"), {"speaker": "a", "content": "b"}], record_id="x/1")


@pytest.mark.parametrize("field", ["task", "expected_answer"])
@pytest.mark.parametrize("value", [["a"], {"a": 1}, True])
def test_conversation_rejects_non_text_task_fields(field, value):
    with pytest.raises(ConversationError, match=field):
        _conv(**{field: value})


@pytest.mark.parametrize("step", [True, 1.0, "1", [1], np.float64(1.0)])
def test_conversation_rejects_non_int_mistake_step(step):
    with pytest.raises(ConversationError, match="'mistake_step' must be an int"):
        _conv(mistake_step=step, record_id="x/9")


@pytest.mark.parametrize("step", [-1, 2, 100])
def test_conversation_rejects_out_of_range_mistake_step(step):
    with pytest.raises(ConversationError, match=r"outside the history \(0\.\.1\)") as info:
        _conv(mistake_step=step, record_id="AG/3")
    assert "AG/3" in str(info.value)


def test_conversation_rejects_bad_agent_and_metadata():
    with pytest.raises(ConversationError, match="mistake_agent"):
        _conv(mistake_agent=3)
    with pytest.raises(ConversationError, match="metadata"):
        _conv(metadata=[("a", 1)])


def test_conversation_is_immutable():
    source = {"level": 1}
    conv = _conv(metadata=source)
    with pytest.raises(dataclasses.FrozenInstanceError):
        conv.mistake_step = 0
    with pytest.raises(TypeError):
        conv.metadata["level"] = 2
    source["level"] = 99  # the conversation kept a copy
    assert conv.metadata["level"] == 1
    with pytest.raises(TypeError):
        conv.turns[0] = Turn("x", "y")


def test_equality_and_hash_ignore_metadata():
    a = _conv(mistake_step=1, metadata={"a": 1})
    b = _conv(mistake_step=1, metadata={"a": 2})
    assert a == b and hash(a) == hash(b)
    assert a != _conv(mistake_step=0)
    assert len({a, b, _conv(mistake_step=0)}) == 2


def test_to_dict_from_dict_round_trip_and_json():
    conv = _conv(task="t", expected_answer="e", task_id="id", mistake_step=1,
                 mistake_agent="coder", record_id="r", metadata={"level": 2, "tags": {"x"}})
    data = conv.to_dict()
    text = json.dumps(data)  # JSON-serialisable, even with a set in metadata
    back = Conversation.from_dict(json.loads(text))
    assert back == conv
    assert back.turns == conv.turns
    assert back.metadata["level"] == 2
    assert back.metadata["tags"] == "{'x'}"  # non-JSON values become their text
    assert Conversation.from_dict(_conv().to_dict()) == _conv()


def test_pickle_copy_and_joblib_hash():
    conv = _conv(mistake_step=1, metadata={"a": [1, 2]})
    back = pickle.loads(pickle.dumps(conv))
    assert back == conv and back.metadata == {"a": [1, 2]}
    with pytest.raises(TypeError):  # still read-only after unpickling
        back.metadata["a"] = 0
    deep = copy.deepcopy(conv)
    assert deep == conv and deep.metadata == {"a": [1, 2]}
    assert joblib.hash(conv) == joblib.hash(back)
    assert joblib.hash(conv) != joblib.hash(_conv(mistake_step=0))


# ---------------------------------------------------------- from_who_and_when
def test_from_who_and_when_algorithm_generated():
    conv = Conversation.from_who_and_when(_record(), record_id="Algorithm-Generated/7")
    assert conv.speakers == ("Math_Expert", "Computer_terminal", "Math_Expert")
    assert conv.mistake_step == 2 and isinstance(conv.mistake_step, int)
    assert conv.mistake_agent == "Math_Expert"
    assert conv.task == "What is 2+2?" and conv.expected_answer == "4"
    assert conv.task_id == "task-1" and conv.record_id == "Algorithm-Generated/7"
    assert [t.role for t in conv] == ["assistant", "user", "assistant"]
    assert dict(conv.metadata) == {"mistake_reason": "Misread the output.", "level": 1}


def test_from_who_and_when_hand_crafted_uses_role_as_speaker():
    history = [
        {"content": "task", "role": "human"},
        {"content": "plan", "role": "Orchestrator (thought)"},
        {"content": "go", "role": "Orchestrator (-> WebSurfer)"},
        {"content": "page", "role": "WebSurfer"},
    ]
    conv = Conversation.from_who_and_when(_record(history=history, mistake_step="3",
                                                  mistake_agent="WebSurfer"))
    assert conv.speakers == ("human", "Orchestrator (thought)", "Orchestrator (-> WebSurfer)",
                             "WebSurfer")
    assert conv.mistake_speaker == "WebSurfer"


def test_from_who_and_when_name_fallbacks():
    history = [
        {"content": "a", "role": "assistant", "name": "  "},  # blank name -> role
        {"content": "b", "role": "user", "name": None},  # null name -> role
        {"content": "c", "role": 5, "name": "Expert"},  # non-text role is dropped
    ]
    conv = Conversation.from_who_and_when(_record(history=history, mistake_step="0"))
    assert conv.speakers == ("assistant", "user", "Expert")
    assert conv[2].role is None


@pytest.mark.parametrize("raw, expected", [("2", 2), (" 1 ", 1), (0, 0), ("0", 0)])
def test_from_who_and_when_accepts_integer_steps(raw, expected):
    assert Conversation.from_who_and_when(_record(mistake_step=raw)).mistake_step == expected


@pytest.mark.parametrize("raw", ["2.0", 2.0, True, "two", "", " ", [1], float("nan"),
                                 float("inf")])
@pytest.mark.parametrize("labelled", [True, "auto"])
def test_from_who_and_when_rejects_non_integer_step(raw, labelled):
    with pytest.raises(ConversationError, match="is not an integer") as info:
        Conversation.from_who_and_when(_record(mistake_step=raw), record_id="AG/5",
                                       labelled=labelled)
    assert "'AG/5'" in str(info.value)


def test_labelled_true_refuses_a_null_step():
    with pytest.raises(ConversationError, match=r"'AG/5'.*mistake_step.*labelled='auto'"):
        Conversation.from_who_and_when(_record(mistake_step=None), record_id="AG/5",
                                       labelled=True)


@pytest.mark.parametrize("raw", ["-1", "3", 10])
def test_from_who_and_when_rejects_out_of_range_step(raw):
    with pytest.raises(ConversationError, match=r"outside the history \(0\.\.2\)"):
        Conversation.from_who_and_when(_record(mistake_step=raw))


@pytest.mark.parametrize("key", ["question", "history", "mistake_step", "mistake_agent"])
def test_from_who_and_when_missing_key(key):
    record = _record()
    del record[key]
    with pytest.raises(ConversationError, match=rf"missing required field\(s\) \['{key}'\]"):
        Conversation.from_who_and_when(record, record_id="HC/2", labelled=True)


def test_from_who_and_when_optional_keys_may_be_missing():
    record = _record()
    del record["ground_truth"]
    conv = Conversation.from_who_and_when(record)
    assert conv.expected_answer == ""
    # question_ID is the task id (the groups of a grouped splitter): required
    del record["question_ID"]
    with pytest.raises(ConversationError, match="question_ID"):
        Conversation.from_who_and_when(record)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"history": []}, "'history' is empty"),
        ({"history": "text"}, "'history' must be a list"),
        ({"history": {"0": {}}}, "'history' must be a list"),
        ({"history": [["not", "a", "dict"]]}, r"history\[0\] is not an object"),
        ({"history": [{"content": "x"}]}, r"history\[0\] has no speaker"),
        ({"history": [{"content": "x", "role": "", "name": ""}]}, r"history\[0\] has no speaker"),
        ({"history": [{"content": "x", "role": "a"}, {"content": None, "role": "b"}]},
         r"history\[1\]\.content must be text, got NoneType"),
        ({"history": [{"content": 3, "role": "a"}]},
         r"history\[0\]\.content must be text, got int"),
        ({"history": [{"role": "a"}]}, r"history\[0\]\.content must be text"),
        ({"mistake_agent": None}, "'mistake_agent' must be text"),
        ({"ground_truth": ["4"]}, "'expected_answer' must be text"),
    ],
)
def test_from_who_and_when_errors(change, message):
    record = _record(**change)
    if "history" in change and change["history"] and isinstance(change["history"], list):
        record["mistake_step"] = "0"
    with pytest.raises(ConversationError, match=message):
        Conversation.from_who_and_when(record, record_id="AG/1", labelled=True)


# ------------------------------------------------------- unlabelled records
def _without(record, *keys):
    return {k: v for k, v in record.items() if k not in keys}


@pytest.mark.parametrize("record", [
    _record(mistake_step=None, mistake_agent=None),
    _without(_record(), "mistake_step", "mistake_agent"),
    _without(_record(mistake_step=None), "mistake_agent"),
], ids=["null", "absent", "mixed"])
def test_unlabelled_record_loads_by_default(record):
    conv = Conversation.from_who_and_when(record, record_id="own/1")
    assert conv.mistake_step is None and conv.mistake_agent is None
    assert conv.mistake_speaker is None and conv.record_id == "own/1"
    assert "mistake_step" not in dict(conv.metadata)
    assert Conversation.from_dict(json.loads(json.dumps(conv.to_dict()))) == conv
    with pytest.raises(ConversationError, match=r"'own/1'.*mistake_(step|agent)"):
        Conversation.from_who_and_when(record, record_id="own/1", labelled=True)


def test_half_labelled_records_keep_the_label_they_have():
    # a step without an agent: the step is the label; the agent is not made up from
    # the speaker (the annotation and the speaker differ in 15 of 130 records)
    conv = Conversation.from_who_and_when(_record(mistake_agent=None), record_id="h/1")
    assert (conv.mistake_step, conv.mistake_agent) == (2, None)
    assert conv.mistake_speaker == "Math_Expert"
    # an agent without a step: an agent-only annotation, unlabelled for steps
    conv = Conversation.from_who_and_when(_record(mistake_step=None), record_id="h/2")
    assert (conv.mistake_step, conv.mistake_agent) == (None, "Math_Expert")
    for change in ({"mistake_agent": None}, {"mistake_step": None}):
        with pytest.raises(ConversationError, match="'h/3'"):
            Conversation.from_who_and_when(_record(**change), record_id="h/3", labelled=True)


@pytest.mark.parametrize("step", ["", "  "])
def test_blank_step_is_refused_with_the_unlabelled_spelling(step):
    with pytest.raises(ConversationError, match=r"'b/1'.*mistake_step.*null or absent"):
        Conversation.from_who_and_when(_record(mistake_step=step), record_id="b/1")


@pytest.mark.parametrize("agent", [5, float("nan"), ["a"], True])
def test_non_text_agent_is_refused_naming_its_type(agent):
    with pytest.raises(ConversationError, match=r"'a/1'.*'mistake_agent' must be text, got"):
        Conversation.from_who_and_when(_record(mistake_agent=agent), record_id="a/1")


def test_from_who_and_when_rejects_non_mapping():
    with pytest.raises(ConversationError, match="expected a JSON object, got list"):
        Conversation.from_who_and_when([1, 2], record_id="x")


def test_from_who_and_when_question_none_and_numeric_ground_truth():
    conv = Conversation.from_who_and_when(_record(question=None, ground_truth=17))
    assert conv.task == "" and conv.expected_answer == "17"


# --------------------------------------------------------------- from_messages
def test_from_messages_speakers_and_fields():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "name": "planner", "content": "plan"},
        {"role": "assistant", "name": "", "content": "fallback"},
    ]
    conv = Conversation.from_messages(messages, task="t", task_id=3, mistake_step=1,
                                      mistake_agent="planner", record_id="m/1",
                                      metadata={"source": "test"})
    assert conv.speakers == ("user", "planner", "assistant")
    assert [t.role for t in conv] == ["user", "assistant", "assistant"]
    assert conv.task_id == 3 and conv.mistake_step == 1 and conv.record_id == "m/1"
    assert conv.metadata["source"] == "test"


def test_from_messages_custom_speaker_key():
    messages = [{"agent": "A", "content": "x"}, {"agent": "B", "content": "y", "role": "r"}]
    conv = Conversation.from_messages(messages, speaker_key="agent")
    assert conv.speakers == ("A", "B")


def test_from_messages_fallback_disabled():
    with pytest.raises(ConversationError, match=r"message 0 has no speaker under \['name'\]"):
        Conversation.from_messages([{"role": "user", "content": "x"}], fallback_speaker_key=None)
    with pytest.raises(ConversationError, match=r"no speaker under \['name', 'role'\]"):
        Conversation.from_messages([{"content": "x"}])


def test_from_messages_content_none_names_message():
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                   "tool_calls": [{"id": "1"}]}]
    with pytest.raises(ConversationError, match=r"message 1 field 'content' must be text, got "
                                                r"NoneType") as info:
        Conversation.from_messages(messages, record_id="run-4")
    assert "run-4" in str(info.value)


@pytest.mark.parametrize("messages", ["text", b"x", {"role": "user"}, 5, None])
def test_from_messages_rejects_non_list(messages):
    with pytest.raises(ConversationError, match="must be a list of dicts"):
        Conversation.from_messages(messages)


def test_from_messages_other_errors():
    with pytest.raises(ConversationError, match="'messages' is empty"):
        Conversation.from_messages([])
    with pytest.raises(ConversationError, match="message 0 is not a dict"):
        Conversation.from_messages(["hello"])
    with pytest.raises(ConversationError, match="outside the history"):
        Conversation.from_messages([{"role": "u", "content": "x"}], mistake_step=1)


# ----------------------------------------------------------------- hypothesis
_names = st.text(min_size=1, max_size=12).filter(lambda s: s.strip())
_message = st.fixed_dictionaries(
    {"content": st.text(max_size=30), "role": _names},
    optional={"name": st.one_of(_names, st.just(""), st.none())},
)


@st.composite
def _records(draw):
    history = draw(st.lists(_message, min_size=1, max_size=8))
    step = draw(st.integers(0, len(history) - 1))
    pad = draw(st.sampled_from(["", " ", "\t"]))
    as_int = draw(st.booleans())
    return {
        "question": draw(st.text(max_size=20)),
        "ground_truth": draw(st.one_of(st.text(max_size=10), st.integers())),
        "question_ID": draw(st.text(min_size=1, max_size=10)),
        "history": history,
        "mistake_step": step if as_int else f"{pad}{step}{pad}",
        "mistake_agent": draw(_names),
        "mistake_reason": draw(st.text(max_size=10)),
    }


@settings(max_examples=60, deadline=None)
@given(_records())
def test_hypothesis_records_round_trip(record):
    conv = Conversation.from_who_and_when(record, record_id="h/1")
    expected_speakers = tuple(
        m["name"] if isinstance(m.get("name"), str) and m["name"].strip() else m["role"]
        for m in record["history"]
    )
    assert conv.speakers == expected_speakers
    assert [t.content for t in conv] == [m["content"] for m in record["history"]]
    assert isinstance(conv.mistake_step, int)
    assert conv.mistake_step == int(str(record["mistake_step"]).strip())
    assert 0 <= conv.mistake_step < len(conv)
    assert conv.expected_answer == str(record["ground_truth"])
    back = Conversation.from_dict(json.loads(json.dumps(conv.to_dict())))
    assert back == conv
    assert dict(back.metadata) == {"mistake_reason": record["mistake_reason"]}


# ----------------------------------------------------- bad records and messages
def _named_record(**changes):
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
        Conversation.from_who_and_when(_named_record(question_ID=task_id), record_id="rec-3")


@pytest.mark.parametrize("step", ["1_0", "٣", "２", "+1", " 1 0", "0x1", "1.0", "-٣", "--1"])
def test_mistake_step_must_be_ascii_digits(step):
    history = [{"name": f"a{i}", "content": "x"} for i in range(12)]
    with pytest.raises(ConversationError, match="mistake_step"):
        Conversation.from_who_and_when(_named_record(history=history, mistake_step=step),
                                       record_id="r")


@pytest.mark.parametrize("step", ["1", " 1 ", 1, "01"])
def test_mistake_step_ascii_digits_still_accepted(step):
    assert Conversation.from_who_and_when(_named_record(mistake_step=step)).mistake_step == 1


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
        Conversation.from_who_and_when(_named_record(history=history, mistake_step="0"),
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
    record = json.loads(json.dumps(_named_record()).replace('"y"', '"\\udc80"'))
    with pytest.raises(ConversationError, match=r"rec-j.*turn 1"):
        Conversation.from_who_and_when(record, record_id="rec-j")


@pytest.mark.parametrize("change", [
    {"question_ID": [10 ** 5000]},
    {"history": [{"name": {"n": 10 ** 5000}, "content": "x"}]},
    {"mistake_step": [10 ** 5000]},
    {"mistake_agent": {"a": [10 ** 5000]}},
])
def test_errors_show_values_holding_huge_integers(change):
    # repr() of a container holding an int of > 4,300 digits raises ValueError
    with pytest.raises(ConversationError, match="'big/1'"):
        Conversation.from_who_and_when(_named_record(**change), record_id="big/1")
