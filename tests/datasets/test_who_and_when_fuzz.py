"""Fuzzing of the Who&When record readers: a Conversation or a ConversationError naming the record.

``Conversation.from_who_and_when`` gets arbitrary JSON-like values (None, NaN,
Infinity, huge integers, nesting) in every field of a record; ``load_who_and_when``
gets the raw bytes of such records, mangled (truncated, spliced with NaN or a
5,000-digit number, random bytes). Neither may raise anything but a
:class:`~skafa.ConversationError` (or, from the loader, a ``ValueError`` it
documents), and the message must name the record or the file.
"""

import json
import math
import sys
import tempfile
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skafa import Conversation, ConversationError
from skafa.datasets import load_who_and_when

_FIELDS = ("question", "ground_truth", "question_ID", "history", "mistake_step",
           "mistake_agent")

_scalars = st.one_of(
    st.none(), st.booleans(), st.text(max_size=8),
    st.integers(), st.sampled_from([2 ** 63, -1, 0]),
    st.sampled_from([5000, -1300]).map(lambda e: 10 ** abs(e) * (1 if e > 0 else -1)),
    st.floats(allow_nan=True, allow_infinity=True),
)
_json = st.recursive(
    _scalars,
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=6), children, max_size=3)),
    max_leaves=8,
)
_speaker = st.one_of(st.text(min_size=1, max_size=8), _scalars)
_turn = st.one_of(
    st.fixed_dictionaries({"content": st.one_of(st.text(max_size=10), _json)},
                          optional={"role": _speaker, "name": _speaker}),
    _json,
)


@st.composite
def _records(draw):
    """A record whose every field is plausible, arbitrary or absent."""
    history = draw(st.one_of(st.lists(_turn, max_size=4), _json))
    n = len(history) if isinstance(history, list) else 1
    plausible = {
        "question": st.text(max_size=10),
        "ground_truth": st.one_of(st.text(max_size=5), st.integers()),
        "question_ID": st.one_of(st.text(max_size=5), st.integers()),
        "history": st.just(history),
        "mistake_step": st.one_of(st.none(), st.integers(-1, n), st.integers(-1, n).map(str),
                                  st.sampled_from(["", " 1 ", "1_0", "٣", "9" * 30])),
        "mistake_agent": st.one_of(st.none(), st.text(max_size=6)),
    }
    record = {}
    for key in _FIELDS:
        choice = draw(st.sampled_from(["plausible", "plausible", "arbitrary", "absent"]))
        if choice != "absent":
            record[key] = draw(plausible[key] if choice == "plausible" else _json)
    record.update(draw(st.dictionaries(st.text(max_size=6), _json, max_size=2)))
    return record


def _check_conversation(conv, record_id):
    assert isinstance(conv, Conversation) and conv.record_id == record_id
    assert len(conv) >= 1
    assert conv.mistake_step is None or 0 <= conv.mistake_step < len(conv)
    assert conv.mistake_agent is None or isinstance(conv.mistake_agent, str)


@settings(max_examples=150, deadline=None)
@given(_records(), st.sampled_from(["auto", True, False]))
def test_from_who_and_when_returns_a_conversation_or_names_the_record(record, labelled):
    try:
        conv = Conversation.from_who_and_when(record, record_id="fuzz/7", labelled=labelled)
    except ConversationError as exc:
        assert "'fuzz/7'" in str(exc)
        return
    _check_conversation(conv, "fuzz/7")
    if labelled is False:
        assert conv.mistake_step is None and conv.mistake_agent is None
    if labelled is True:
        assert conv.mistake_step is not None and conv.mistake_agent is not None
    if labelled == "auto" and record.get("mistake_step") is None:
        assert conv.mistake_step is None


def _to_text(value):
    """JSON text, writing NaN/Infinity as JavaScript does and huge ints in full."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return json.dumps(value, allow_nan=True)
    finally:
        sys.set_int_max_str_digits(limit)


def _finite(value):
    """True when no float inside ``value`` is NaN or infinite."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


_mangles = st.sampled_from(["none", "truncate", "nan", "infinity", "huge", "overflow",
                            "deep", "bytes"])


def _mangle(text, how, cut, junk):
    if how == "truncate":
        return text[: cut % (len(text) + 1)].encode()
    if how in ("nan", "infinity", "huge", "overflow"):
        token = {"nan": "NaN", "infinity": "-Infinity", "huge": "7" * 5000,
                 "overflow": "1e999"}[how]
        # replace the first value after a colon, wherever it is
        at = text.find(": ", cut % (len(text) + 1))
        if at < 0:
            return (text + token).encode()
        return (text[: at + 2] + token + "," + text[at + 2:]).encode()
    if how == "deep":
        return ("[" * 100_000 + text).encode()
    if how == "bytes":
        return junk
    return text.encode()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_records(), min_size=1, max_size=3), _mangles, st.integers(0, 10 ** 6),
       st.binary(max_size=40), st.booleans(), st.booleans())
def test_file_reader_returns_conversations_or_names_the_file(records, how, cut, junk,
                                                             as_list, strict):
    text = _to_text(records if as_list else records[0])
    raw = _mangle(text, how, cut, junk)
    with tempfile.TemporaryDirectory() as tmp:
        if as_list:
            path = Path(tmp) / "runs.json"
        else:
            path = Path(tmp) / "Hand-Crafted"
            path.mkdir()
        (path if as_list else path / "3.json").write_bytes(raw)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # strict=False counts skips
                data = load_who_and_when(path, strict=strict)
        except ValueError as exc:  # ConversationError is a ValueError
            message = str(exc)
            assert str(path) in message, message
            if isinstance(exc, ConversationError) and strict and not as_list:
                assert "3.json" in message and "'Hand-Crafted/3'" in message, message
            return
    for conv, record_id in zip(data.conversations, data.record_ids):
        _check_conversation(conv, record_id)
        assert all(isinstance(turn.content, str) for turn in conv)
        assert isinstance(conv.task, str) and isinstance(conv.expected_answer, str)
        assert _finite(dict(conv.metadata))  # NaN, Infinity and 1e999 never get in
    assert all(s >= -1 for s in data.mistake_steps.tolist())
