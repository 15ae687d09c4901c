"""Data model: a failed multi-agent run as an immutable, validated :class:`Conversation`.

A :class:`Conversation` is one sample for every skafa estimator. Its turns are
:class:`Turn` objects (speaker, content, and the source's original role), and its
label is ``mistake_step``: the 0-based index of the decisive turn.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .exceptions import ConversationError

__all__ = ["Turn", "Conversation", "check_conversations"]


def _where(record_id: str | None) -> str:
    return f"record {_clip(record_id, 200)}" if record_id is not None else "conversation"


def _check_text(value, where, what):
    """Raise unless ``value`` can be encoded as UTF-8 (no lone surrogate).

    ``json.loads`` accepts ``"\\ud800"`` and Python strings can hold it, but no
    tokenizer can encode it; naming the record and field here beats a failure
    deep inside the tokenizer.
    """
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConversationError(
            f"{where}: {what} contains a lone surrogate ({value[exc.start]!r} at "
            f"character {exc.start}), which is not valid Unicode text; fix or drop it "
            "(e.g. text.encode('utf-8', 'replace').decode())."
        ) from None


def _speaker_of(msg, key, fallback, where, label):
    """The speaker under ``key``; ``fallback`` only when ``key`` is absent, None or blank."""
    speaker = msg.get(key)
    if speaker is not None and not isinstance(speaker, str):
        raise ConversationError(
            f"{where}: {label} field {key!r} must be text, got "
            f"{type(speaker).__name__} {_clip(speaker)}."
        )
    if (speaker is None or not speaker.strip()) and fallback:
        speaker = msg.get(fallback)
    return speaker


def _parse_step(raw_step, where):
    """A Who&When ``mistake_step``: an int, or a string of ASCII digits (``-`` allowed).

    ``int()`` would also accept ``"1_0"`` (10), ``"٣"`` and ``"２"``; those are
    not step numbers a dataset means.
    """
    if raw_step is None:
        raise ConversationError(
            f"{where}: field 'mistake_step' is null, and labelled=True needs every label; "
            "pass labelled='auto' to load it as an unlabelled run.")
    if isinstance(raw_step, str) and not raw_step.strip():
        raise ConversationError(
            f"{where}: field 'mistake_step'={_clip(raw_step)} is not an integer (an "
            "unlabelled run has mistake_step null or absent, not blank).")
    if isinstance(raw_step, bool):
        ok = False
    elif isinstance(raw_step, int):
        return raw_step
    elif isinstance(raw_step, str):
        text = raw_step.strip()
        ok = re.fullmatch(r"-?[0-9]+", text) is not None  # [0-9]: ASCII digits only
    else:
        ok = False
    if not ok:
        raise ConversationError(
            f"{where}: field 'mistake_step'={_clip(raw_step)} is not an integer (an int or "
            "a string of ASCII digits 0-9, optionally after '-')."
        )
    if len(text.lstrip("-").lstrip("0")) > 18:  # no history is that long; int() may refuse it
        raise ConversationError(
            f"{where}: field 'mistake_step'={_clip(raw_step)} ({len(text)} characters) is "
            "outside any history.")
    return int(text)


def _clip(value, n=60):
    """``repr(value)`` cut to ``n`` characters (a field may hold megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int of > 4,300 digits inside; deep nesting
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= n else text[:n] + "..."


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-agent conversation.

    Parameters
    ----------
    speaker : str
        Who spoke (the agent name, e.g. ``"WebSurfer"`` or ``"Orchestrator (thought)"``).
    content : str
        What was said. May be empty but must be text.
    role : str or None, default=None
        The source's original role field (e.g. ``"assistant"``) when it has one.
    """

    speaker: str
    content: str
    role: str | None = None

    def __post_init__(self):
        if not isinstance(self.speaker, str) or not self.speaker.strip():
            raise ConversationError(
                f"Turn.speaker must be a non-empty string, got {_clip(self.speaker)}."
            )
        if not isinstance(self.content, str):
            raise ConversationError(
                f"Turn.content must be a string, got {type(self.content).__name__}."
            )
        if self.role is not None and not isinstance(self.role, str):
            raise ConversationError(
                f"Turn.role must be a string or None, got {type(self.role).__name__}."
            )

    def to_dict(self) -> dict:
        """Return a JSON-serialisable dict (``speaker``, ``content``, ``role``)."""
        return {"speaker": self.speaker, "content": self.content, "role": self.role}


@dataclass(frozen=True, eq=True)
class Conversation:
    """A (usually failed) multi-agent run: the sample unit of skafa.

    Parameters
    ----------
    turns : sequence of Turn
        The turns in order; at least one.
    task : str, default=""
        The task the agents were given.
    expected_answer : str, default=""
        The expected final answer (Who&When's ``ground_truth``).
    task_id : str, int or None, default=None
        Identifier of the task. Several runs can share a task, so use it as the
        ``groups`` of a grouped splitter. It keeps its type (``1`` and ``"1"`` are
        two tasks).
    mistake_step : int or None, default=None
        0-based index of the decisive turn, when labelled.
    mistake_agent : str or None, default=None
        The annotated responsible agent, when labelled. It usually, but not always,
        equals ``turns[mistake_step].speaker``.
    record_id : str or None, default=None
        Where the record came from (e.g. ``"Algorithm-Generated/12"``); used in errors.
    metadata : mapping, default={}
        Free metadata (read-only view). Not used by any estimator, not compared.

    Examples
    --------
    >>> from skafa import Conversation, Turn
    >>> conv = Conversation([Turn("planner", "Let's search."), Turn("coder", "print(1)")],
    ...                     task="Print one.", mistake_step=1)
    >>> len(conv), conv.speakers
    (2, ('planner', 'coder'))
    """

    turns: tuple[Turn, ...]
    task: str = ""
    expected_answer: str = ""
    task_id: str | int | None = None
    mistake_step: int | None = None
    mistake_agent: str | None = None
    record_id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        where = _where(self.record_id)
        if isinstance(self.turns, (str, bytes)) or not isinstance(self.turns, Sequence):
            raise ConversationError(f"{where}: 'turns' must be a sequence of Turn objects.")
        turns = tuple(self.turns)
        if not turns:
            raise ConversationError(f"{where}: a conversation needs at least one turn.")
        for i, turn in enumerate(turns):
            if not isinstance(turn, Turn):
                raise ConversationError(
                    f"{where}: turn {i} is a {type(turn).__name__}, not a Turn."
                )
        object.__setattr__(self, "turns", turns)
        for i, turn in enumerate(turns):
            _check_text(turn.speaker, where, f"turn {i} speaker")
            _check_text(turn.content, where, f"turn {i} content")
            if turn.role is not None:
                _check_text(turn.role, where, f"turn {i} role")
        for name in ("task", "expected_answer"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, "")
            elif not isinstance(value, str):
                # Who&When's ground_truth is sometimes a number: keep its text.
                if isinstance(value, float) and not math.isfinite(value):
                    raise ConversationError(
                        f"{where}: field {name!r} is {value!r}, not text or a finite number "
                        "(NaN and Infinity in a record are refused, not read as "
                        f"{str(value)!r}).")
                if isinstance(value, int) and not isinstance(value, bool) \
                        and value.bit_length() > 4000:
                    raise ConversationError(f"{where}: field {name!r} is an integer of "
                                            f"{value.bit_length()} bits, not text.")
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    object.__setattr__(self, name, str(value))
                else:
                    raise ConversationError(
                        f"{where}: field {name!r} must be text, got {type(value).__name__}."
                    )
        for name in ("task", "expected_answer"):
            _check_text(getattr(self, name), where, name)
        if self.task_id is not None and not isinstance(self.task_id, str):
            from .utils.validation import check_task_id

            try:
                object.__setattr__(self, "task_id", check_task_id(self.task_id))
            except TypeError as exc:
                raise ConversationError(f"{where}: {exc}") from None
        step = self.mistake_step
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, int):
                try:
                    import numpy as np

                    if isinstance(step, np.integer):
                        step = int(step)
                    else:
                        raise TypeError
                except TypeError:
                    raise ConversationError(
                        f"{where}: field 'mistake_step' must be an int, got {_clip(step)}."
                    ) from None
            if not 0 <= step < len(turns):
                raise ConversationError(
                    f"{where}: field 'mistake_step'={_clip(step)} is outside the history "
                    f"(0..{len(turns) - 1})."
                )
            object.__setattr__(self, "mistake_step", step)
        if self.mistake_agent is not None and not isinstance(self.mistake_agent, str):
            raise ConversationError(f"{where}: field 'mistake_agent' must be text.")
        for name in ("task_id", "mistake_agent"):
            if isinstance(getattr(self, name), str):  # an int task id is kept as an int
                _check_text(getattr(self, name), where, name)
        if not isinstance(self.metadata, Mapping):
            raise ConversationError(f"{where}: 'metadata' must be a mapping.")
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.turns)

    def __iter__(self):
        return iter(self.turns)

    def __getitem__(self, i):
        return self.turns[i]

    def __hash__(self):
        return hash((self.turns, self.task, self.expected_answer, self.task_id,
                     self.mistake_step, self.mistake_agent, self.record_id))

    # The read-only metadata view (MappingProxyType) cannot be pickled: store a plain
    # dict and restore the view, so pickle, copy.deepcopy, joblib.hash and joblib's
    # worker processes accept conversations.
    def __getstate__(self):
        state = dict(self.__dict__)
        state["metadata"] = dict(self.metadata)
        return state

    def __setstate__(self, state):
        state = dict(state)
        state["metadata"] = MappingProxyType(dict(state.get("metadata") or {}))
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def speakers(self) -> tuple[str, ...]:
        """Speaker of every turn, in order."""
        return tuple(t.speaker for t in self.turns)

    @property
    def n_turns(self) -> int:
        """Number of turns."""
        return len(self.turns)

    @property
    def mistake_speaker(self) -> str | None:
        """Speaker of the decisive turn (``None`` when unlabelled)."""
        if self.mistake_step is None:
            return None
        return self.turns[self.mistake_step].speaker

    def __repr__(self) -> str:
        label = "" if self.mistake_step is None else f", mistake_step={self.mistake_step}"
        rid = "" if self.record_id is None else f"record_id={self.record_id!r}, "
        return f"Conversation({rid}n_turns={len(self)}{label}, task={self.task[:40]!r})"

    # --------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict:
        """Return a JSON-serialisable dict; :meth:`from_dict` inverts it."""
        return {
            "turns": [t.to_dict() for t in self.turns],
            "task": self.task,
            "expected_answer": self.expected_answer,
            "task_id": self.task_id,
            "mistake_step": self.mistake_step,
            "mistake_agent": self.mistake_agent,
            "record_id": self.record_id,
            "metadata": _jsonable(dict(self.metadata)),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Conversation:
        """Build a conversation from the output of :meth:`to_dict`.

        Raises
        ------
        ConversationError
            Naming the record (when ``record_id`` is given) and the missing or
            malformed field (``'turns'``, ``turns[3].'speaker'``, ...).
        """
        if not isinstance(data, Mapping):
            raise ConversationError(
                f"conversation: expected a mapping (the output of Conversation.to_dict), "
                f"got {type(data).__name__}."
            )
        where = _where(data.get("record_id"))
        if "turns" not in data:
            raise ConversationError(f"{where}: missing required field 'turns'.")
        raw = data["turns"]
        if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
            raise ConversationError(f"{where}: field 'turns' must be a list of turn dicts.")
        turns = []
        for i, t in enumerate(raw):
            if not isinstance(t, Mapping):
                raise ConversationError(
                    f"{where}: turns[{i}] is a {type(t).__name__}, not a dict with "
                    "'speaker' and 'content'."
                )
            for key in ("speaker", "content"):
                if key not in t:
                    raise ConversationError(
                        f"{where}: turns[{i}] is missing required field {key!r}."
                    )
            try:
                turns.append(Turn(t["speaker"], t["content"], t.get("role")))
            except ConversationError as exc:
                raise ConversationError(f"{where}: turns[{i}]: {exc}") from None
        return cls(
            turns,
            task=data.get("task", ""),
            expected_answer=data.get("expected_answer", ""),
            task_id=data.get("task_id"),
            mistake_step=data.get("mistake_step"),
            mistake_agent=data.get("mistake_agent"),
            record_id=data.get("record_id"),
            metadata=data.get("metadata") or {},
        )

    @classmethod
    def from_who_and_when(cls, record: Mapping, *, record_id: str | None = None,
                          labelled="auto") -> Conversation:
        """Build a conversation from one Who&When record (either subset).

        Algorithm-Generated records name the speaker in each turn's ``name``;
        Hand-Crafted records have no ``name`` and the speaker is ``role``
        (e.g. ``"Orchestrator (thought)"``). ``mistake_step`` arrives as a string
        and is converted to an int; only ASCII digits are a number (``"1_0"``,
        ``"٣"`` and ``"２"`` are refused, although ``int()`` accepts them).
        ``question_ID`` is required: it is the task id used as ``groups`` by
        grouped splitters, and a record without one would only fail much later.

        A record whose ``mistake_step`` and ``mistake_agent`` are null or absent
        (a run of your own, in the Who&When format, that nobody has annotated)
        loads as an *unlabelled* conversation: ``mistake_step`` and
        ``mistake_agent`` are ``None``. It can be attributed; ``fit`` refuses it,
        naming it, and the metrics of :mod:`skafa.metrics` skip it and say how
        many they skipped. Each label stands alone: a record with a step but a
        null agent keeps its step (the agent is *not* filled in from the
        speaker of that turn, which differs from the annotation in about one
        record in nine; :attr:`mistake_speaker` gives the speaker), and a
        record with an agent but a null step is unlabelled for the step
        metrics and labelled for :func:`~skafa.metrics.agent_accuracy`.

        Parameters
        ----------
        record : mapping
            The parsed JSON record, with keys ``question``, ``ground_truth``,
            ``question_ID``, ``history`` and, when labelled, ``mistake_step``
            and ``mistake_agent``.
        record_id : str, optional
            Name used in error messages and kept as :attr:`record_id`.
        labelled : {"auto", True, False}, default="auto"
            ``"auto"``: each label is used when present; when null or absent it
            is ``None`` (an unlabelled run). ``True``: ``mistake_step`` and
            ``mistake_agent`` are required and must not be null (to check that
            a benchmark copy is fully labelled). ``False``: labels are ignored
            even when present.

        Raises
        ------
        ConversationError
            Naming the record and field: missing keys (``question_ID``
            included), an empty or non-text ``question_ID``, empty history, a turn
            without speaker, with a non-text ``name`` or content, text holding a
            lone surrogate, NaN or Infinity as ``question`` or ``ground_truth``, a
            non-integer (blank, NaN, a float) or out-of-range ``mistake_step``, a
            ``mistake_agent`` that is neither text nor null; with
            ``labelled=True``, a null or absent label.
        """
        if labelled not in (True, False, "auto"):
            raise ValueError(f"labelled must be True, False or 'auto', got {labelled!r}.")
        where = _where(record_id)
        if not isinstance(record, Mapping):
            raise ConversationError(f"{where}: expected a JSON object, got {type(record).__name__}.")
        required = ("question", "question_ID", "history")
        if labelled is True:
            required += ("mistake_step", "mistake_agent")
        missing = [k for k in required if k not in record]
        if missing:
            hint = ("; pass labelled='auto' to load runs without labels as unlabelled"
                    if {"mistake_step", "mistake_agent"} & set(missing) else "")
            raise ConversationError(f"{where}: missing required field(s) {missing}{hint}.")
        for key in ("question", "ground_truth"):
            value = record.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConversationError(
                    f"{where}: field {key!r} is {value!r}, not text or a finite number "
                    f"(NaN and Infinity are refused, not read as {str(value)!r}).")
        task_id = record["question_ID"]
        if isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or task_id == "":
            raise ConversationError(
                f"{where}: field 'question_ID' must be a non-empty string (the task id that "
                f"groups runs of the same task), got {_clip(task_id)}."
            )
        history = record["history"]
        if not isinstance(history, list):
            raise ConversationError(f"{where}: field 'history' must be a list of turns.")
        if not history:
            raise ConversationError(f"{where}: field 'history' is empty.")
        turns = []
        for i, msg in enumerate(history):
            if not isinstance(msg, Mapping):
                raise ConversationError(f"{where}: history[{i}] is not an object.")
            role = msg.get("role")
            speaker = _speaker_of(msg, "name", "role", where, f"history[{i}]")
            if not isinstance(speaker, str) or not speaker.strip():
                raise ConversationError(
                    f"{where}: history[{i}] has no speaker (neither 'name' nor 'role')."
                )
            content = msg.get("content")
            if not isinstance(content, str):
                raise ConversationError(
                    f"{where}: history[{i}].content must be text, got "
                    f"{type(content).__name__}."
                )
            turns.append(Turn(speaker, content, role if isinstance(role, str) else None))
        raw_step = record.get("mistake_step") if labelled else None
        step = (None if raw_step is None and labelled is not True
                else _parse_step(raw_step, where))
        if step is not None and not 0 <= step < len(turns):
            raise ConversationError(
                f"{where}: field 'mistake_step'={step} is outside the history "
                f"(0..{len(turns) - 1})."
            )
        agent = record.get("mistake_agent") if labelled else None
        if not isinstance(agent, str) and not (agent is None and labelled != True):  # noqa: E712
            hint = ("; pass labelled='auto' to load it as unlabelled" if agent is None else
                    f", got {type(agent).__name__} {_clip(agent)}")
            raise ConversationError(f"{where}: field 'mistake_agent' must be text{hint}.")
        known = {"question", "ground_truth", "question_ID", "history", "mistake_step",
                 "mistake_agent"}
        metadata = {k: v for k, v in record.items() if k not in known}
        return cls(
            turns,
            task=record["question"] if record["question"] is not None else "",
            expected_answer=record.get("ground_truth", ""),
            task_id=task_id,
            mistake_step=step,
            mistake_agent=agent,
            record_id=record_id,
            metadata=metadata,
        )

    @classmethod
    def from_messages(
        cls,
        messages: Sequence[Mapping],
        *,
        speaker_key: str = "name",
        fallback_speaker_key: str | None = "role",
        task: str = "",
        expected_answer: str = "",
        task_id: str | int | None = None,
        mistake_step: int | None = None,
        mistake_agent: str | None = None,
        record_id: str | None = None,
        metadata: Mapping | None = None,
    ) -> Conversation:
        """Build a conversation from an OpenAI / AG2-style chat history.

        Parameters
        ----------
        messages : sequence of dict
            Each with ``"content"`` and a speaker under ``speaker_key``
            (or ``fallback_speaker_key`` when that key is absent, None or empty;
            a value of another type, such as ``name=5``, raises).
        speaker_key : str, default="name"
            Key holding the speaker.
        fallback_speaker_key : str or None, default="role"
            Key used when ``speaker_key`` is missing; ``None`` makes it required.
        task, expected_answer, task_id, mistake_step, mistake_agent, record_id, metadata
            As in :class:`Conversation`.

        Raises
        ------
        ConversationError
            Naming the message index when a speaker is missing or not text, or
            content is not text (e.g. a tool-call message whose content is ``None``).
        """
        where = _where(record_id)
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise ConversationError(f"{where}: 'messages' must be a list of dicts.")
        if not messages:
            raise ConversationError(f"{where}: 'messages' is empty.")
        turns = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping):
                raise ConversationError(f"{where}: message {i} is not a dict.")
            speaker = _speaker_of(msg, speaker_key, fallback_speaker_key, where, f"message {i}")
            if not isinstance(speaker, str) or not speaker.strip():
                keys = [speaker_key] + ([fallback_speaker_key] if fallback_speaker_key else [])
                raise ConversationError(f"{where}: message {i} has no speaker under {keys}.")
            content = msg.get("content")
            if not isinstance(content, str):
                raise ConversationError(
                    f"{where}: message {i} field 'content' must be text, got "
                    f"{type(content).__name__}."
                )
            role = msg.get("role")
            turns.append(Turn(speaker, content, role if isinstance(role, str) else None))
        return cls(
            turns,
            task=task,
            expected_answer=expected_answer,
            task_id=task_id,
            mistake_step=mistake_step,
            mistake_agent=mistake_agent,
            record_id=record_id,
            metadata=metadata or {},
        )


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return json.loads(json.dumps(value, default=str))


def check_conversations(X, caller) -> list:
    """Return ``X`` as a non-empty list of Conversation, or raise naming the bad entry.

    Parameters
    ----------
    X : sequence of Conversation
    caller : str
        Name of the estimator or function, used in messages.

    Returns
    -------
    list of Conversation

    Raises
    ------
    TypeError
        ``X`` is not a sequence of Conversation (a single Conversation, a string,
        a dict, a TurnFeatures, or an element of another type).
    ValueError
        ``X`` is empty.
    """
    from collections.abc import Mapping

    import numpy as np

    from .features import TurnFeatures

    if isinstance(X, TurnFeatures):
        raise TypeError(
            f"{caller} takes a list of Conversation objects, not TurnFeatures; put it "
            "before (or beside, in a TurnFeatureUnion) the activation extractor."
        )
    if isinstance(X, Conversation):
        raise TypeError(
            f"{caller} takes a list of Conversation objects, got a single Conversation; "
            "wrap it in a list."
        )
    if isinstance(X, (str, bytes, Mapping)) or not hasattr(X, "__iter__") or (
        isinstance(X, np.ndarray) and X.ndim != 1
    ):
        raise TypeError(
            f"{caller} takes a list of Conversation objects (one per sample), got "
            f"{type(X).__name__}."
        )
    convs = list(X)
    if not convs:
        raise ValueError(f"{caller} got zero conversations: pass at least one Conversation.")
    for i, conv in enumerate(convs):
        if not isinstance(conv, Conversation):
            hint = (
                " Build it with Conversation.from_who_and_when(record) or "
                "Conversation.from_messages(messages)."
            )
            raise TypeError(
                f"{caller}: conversation {i} is a {type(conv).__name__}, not a "
                f"Conversation.{hint}"
            )
    return convs
