"""Render a conversation as one chat prompt and locate every turn's last token.

A :class:`PromptTemplate` turns a :class:`~skafa.conversation.Conversation` into a
judge prompt: a system message explaining the job, then one user message with the
task, the expected answer, one numbered line per turn and a closing question. The
tokenizer's own chat template renders the messages; the fast tokenizer's character
offsets then give, for every turn, the index of the token that contains the turn's
last character (:attr:`Encoding.turn_positions`). Those are the positions at which
skafa reads hidden states.

Because a decoder is causal, the activation at a turn's last token depends only on
what precedes it: the system message, the task, the expected answer and the earlier
turns. The closing instruction matters only for generation (the LLM judge) and for the
recap and echo reads below.

Two layouts let every turn's vector see the whole run in the same single forward
pass (``read=`` of :func:`encode`, :func:`plan` and
:class:`~skafa.llm.TurnActivationTransformer`):

- ``read="recap"``: after the transcript come the instruction (the question) and
  then one short recap line per turn (``recap_format``, e.g. ``Step 3 (WebSurfer)``);
  turn ``i`` is read at the last token of its recap line
  (:attr:`Encoding.recap_positions`).
- ``read="echo"``: after the transcript come the instruction and the whole
  transcript again; turn ``i`` is read at the last token of its line in the copy
  (:attr:`Encoding.echo_positions`).

In both, positions come from the rendering itself (the character offsets of the
lines skafa wrote, mapped to tokens), never from searching for the recap text.

Base models have no chat template. ``PromptTemplate(chat_template="auto")`` (the
default) renders plain text for them (BOS token, the system text, a blank line,
the user message, a newline) and uses the tokenizer's chat template otherwise;
``"plain"`` forces plain text, ``"tokenizer"`` refuses a tokenizer without one.

Long conversations are never cut silently. ``shorten="none"`` (the default) leaves
the text alone and :func:`check_fits` / :func:`plan` report prompts that are too
long; ``"head_tail"`` and ``"middle_first"`` shorten turn contents visibly (a marker
says how many characters were omitted) and record exactly how many characters each
turn lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from ..conversation import Conversation
from ..exceptions import PromptTooLongError
from ..persistence import register_value_codec
from ._reads import READS

__all__ = [
    "PROMPT_FORMAT_VERSION",
    "PromptTemplate",
    "Encoding",
    "PromptPlan",
    "encode",
    "plan",
    "check_fits",
    "template_uses_date",
]

#: Version of the rendering logic; part of :meth:`PromptTemplate.fingerprint`, bumped
#: whenever the same template settings would render a different prompt.
PROMPT_FORMAT_VERSION = 1

# The reads (``read=``) and what each adds to the prompt are in ``_reads.READS``.

_SHORTEN = ("none", "head_tail", "middle_first")
_SYSTEM_PLACEMENT = ("system", "user")
_CHAT_TEMPLATE = ("auto", "tokenizer", "plain")
#: Fields added after PROMPT_FORMAT_VERSION 1 and their defaults. A field at its
#: default is left out of the fingerprint, so keys written before it existed hold.
_NEW_FIELDS = {"recap_header": "Steps:", "recap_format": "Step {i} ({speaker})",
               "echo_header": "The same conversation again:", "chat_template": "auto"}
_RESERVED_KWARGS = ("messages", "conversation", "tokenize", "add_generation_prompt",
                    "continue_final_message", "return_dict", "tools", "documents")

DEFAULT_SYSTEM = (
    "You are an expert judge of multi-agent AI systems. You will read the log of a "
    "multi-agent run that failed to solve its task: the task, the expected answer, and "
    "the numbered steps of the conversation, each with the agent that spoke. Exactly "
    "one step contains the decisive error: the first mistake that, had it not been "
    "made, would have let the agents reach the correct answer. Find that step and the "
    "agent responsible for it."
)
DEFAULT_INSTRUCTION = (
    "Which step contains the decisive error? Answer with the step number and the name "
    "of the agent, in the form 'Step: <number>, Agent: <name>'."
)
#: System message of :meth:`PromptTemplate.online`: no claim that the run failed, no
#: expected answer, nothing that depends on how long the run will be.
ONLINE_SYSTEM = (
    "You are monitoring a multi-agent AI system while it runs. You will read the task "
    "and the numbered steps executed so far, each with the agent that spoke. Watch for "
    "the decisive error: the first mistake that, if nobody corrects it, will make the "
    "agents fail the task."
)
#: Closing question of :meth:`PromptTemplate.online` (constant: it follows every turn).
ONLINE_INSTRUCTION = (
    "Has the decisive error happened in the steps so far? Answer 'Alarm: <step "
    "number>, <agent>' or 'Continue'."
)


def _describe(conversation, index=None) -> str:
    from ..utils.validation import describe_conversation

    return describe_conversation(index, task_id=getattr(conversation, "task_id", None),
                                 record_id=getattr(conversation, "record_id", None))


# --------------------------------------------------------------------------- template
#: The fields each format string of a PromptTemplate may use, and nothing else.
_FORMAT_FIELDS = {"turn_format": ("i", "speaker", "role", "content"),
                  "recap_format": ("i", "speaker", "role"),
                  "marker": ("n",)}


def _check_format_fields(name, text, allowed):
    """Refuse a format string using anything but plain ``{field}`` of ``allowed``.

    A template may come from a saved file: a width (``{i:>900000000}`` allocates
    gigabytes), a conversion, attribute access (``{speaker.__class__}``) or
    indexing would let the file decide what formatting computes.
    """
    import string

    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(f"PromptTemplate.{name} {text[:200]!r} is not a valid format: "
                         f"{exc}.") from None
    for _, field_name, spec, conversion in parsed:
        if field_name is None:
            continue
        if field_name not in allowed or spec or conversion:
            shown = "{" + field_name + ("!" + conversion if conversion else "") + (
                ":" + spec if spec else "") + "}"
            raise ValueError(
                f"PromptTemplate.{name} {text[:200]!r} is not a valid format: it uses "
                f"the field {shown[:200]!r}; only "
                f"{', '.join('{' + f + '}' for f in allowed)} may be used, without width, "
                "precision, conversion, attribute access or indexing.")


@dataclass(frozen=True)
class PromptTemplate:
    """How a conversation becomes a judge prompt (immutable, JSON-serialisable).

    The prompt has an optional system message (``system``) and one user message::

        {task_header} {task}
        {answer_header} {expected_answer}

        {history_header}
        {turn line 0}
        {turn line 1}
        ...

        {instruction}

    Each turn line is ``turn_format`` with ``{i}`` (0-based step index, the same
    numbering as ``Conversation.mistake_step``), ``{speaker}``, ``{role}`` and
    ``{content}``. Both messages go through the tokenizer's own chat template
    (or are joined as plain text, see ``chat_template``).

    ``read="recap"`` and ``read="echo"`` (arguments of :meth:`encode`, not fields:
    one template serves every read) extend the user message after the turns. The
    instruction then comes right after the transcript and the lines that are read
    follow it, so every read token has seen the whole run and the question::

        ... {turn line n-1}                 ... {turn line n-1}

        {instruction}                       {instruction}

        {recap_header}                      {echo_header}
        {recap line 0}                      {turn line 0}
        ...                                 ...
        {recap line n-1}                    {turn line n-1}

            read="recap"                        read="echo"

    With ``read="last"`` or ``"mean"`` the prompt is exactly the one above.

    Parameters
    ----------
    system : str or None, default=DEFAULT_SYSTEM
        System message; ``None`` or ``""`` sends none (the chat template may then
        insert its own default).
    task_header : str, default="Task:"
        Text before the task. The task line is omitted when the task is empty.
    answer_header : str or None, default="Expected answer:"
        Text before the expected answer; ``None`` omits the expected answer
        (the "without ground truth" setting).
    history_header : str or None, default="Conversation:"
        Line before the numbered turns; ``None`` omits it.
    turn_format : str, default="{i} - {speaker}: {content}"
        Format of one turn line. Must contain ``{content}`` exactly once, as its
        own field; may use ``{i}``, ``{speaker}`` and ``{role}`` (``""`` when the
        turn has no role). Contents are inserted verbatim (braces in the content
        are safe).
    instruction : str or None, default=DEFAULT_INSTRUCTION
        Closing question after the turns; ``None`` omits it. It follows every turn,
        so it does not change any turn's activations in a causal model with
        ``read="last"`` or ``"mean"``; with ``"recap"`` and ``"echo"`` the lines that
        are read come after it, so it does change theirs.
    max_turn_chars : int or None, default=None
        With ``shorten="head_tail"``: the most characters of a turn's content kept.
    shorten : {"none", "head_tail", "middle_first"}, default="none"
        ``"none"`` never alters text. ``"head_tail"`` keeps the first
        ``ceil(k/2)`` and last ``floor(k/2)`` characters (``k=max_turn_chars``) of
        every longer content and puts ``marker`` between them. ``"middle_first"``
        finds the largest per-turn cap ``k`` such that the prompt, with every
        content longer than ``k`` shortened the same way, has at most
        ``max_prompt_tokens`` tokens: the longest turns lose their middles first.
        In both, a content is only shortened when that makes it shorter, i.e. when
        more characters would be removed than the marker adds (a 101-character
        turn with ``k=100`` stays whole). Only turn contents are shortened, never
        the task or headers.
    marker : str, default=" [... {n} characters omitted ...] "
        Inserted where text was removed; ``{n}`` becomes the number of characters
        removed from that turn.
    max_prompt_tokens : int or None, default=None
        With ``shorten="middle_first"``: the token budget of the whole prompt.
    system_placement : {"system", "user"}, default="system"
        ``"user"`` puts the system text at the top of the user message, for chat
        templates that reject a system role (e.g. Gemma's).
    recap_header : str or None, default="Steps:"
        With ``read="recap"``: line before the recap lines; ``None`` omits it.
    recap_format : str, default="Step {i} ({speaker})"
        With ``read="recap"``: one line per turn, with ``{i}`` (the same 0-based
        index as the turn line), ``{speaker}`` and ``{role}``. Turn ``i`` is read
        at the token holding the last character of its recap line. One line, not
        empty, no trailing whitespace (chat templates may trim it).
    echo_header : str or None, default="The same conversation again:"
        With ``read="echo"``: line before the second copy of the turns; ``None``
        omits it.
    chat_template : {"auto", "tokenizer", "plain"}, default="auto"
        How the messages become text. ``"tokenizer"``: the tokenizer's chat
        template (a tokenizer without one is refused). ``"plain"``: plain text
        for base models, ``{bos_token}{system}\n\n{user message}\n`` (the BOS
        token only when the tokenizer has one; no system part when ``system`` is
        empty). ``"auto"``: the tokenizer's chat template when it has one, plain
        text otherwise (:meth:`rendering` says which); the rendering used is part
        of the activation cache key.
    segment_turns : bool, default=False
        Tokenize the prompt in segments cut at turn boundaries (the text before
        the first turn line; turn line 0; then ``"\\n"`` + turn line ``i`` for
        every later turn; the rest) and concatenate the tokens. Every turn's
        tokens then depend on that turn's text only, so the tokens of a prefix
        ``0..k`` of a conversation are exactly the first tokens of the whole
        conversation's prompt whatever the tokenizer's merges across a newline
        (Qwen2's ``".\\n"``, for instance). Required by online auditing
        (:meth:`online`, :class:`skafa.online.AuditSession`); incompatible with
        ``shorten="middle_first"``, whose cuts depend on every turn. Omitted from
        :meth:`fingerprint` when False, so existing cache keys do not change.

    Examples
    --------
    >>> from skafa.llm import PromptTemplate
    >>> t = PromptTemplate(shorten="head_tail", max_turn_chars=200)
    >>> PromptTemplate.from_dict(t.to_dict()) == t
    True
    >>> len(t.fingerprint())
    64
    """

    system: str | None = DEFAULT_SYSTEM
    task_header: str = "Task:"
    answer_header: str | None = "Expected answer:"
    history_header: str | None = "Conversation:"
    turn_format: str = "{i} - {speaker}: {content}"
    instruction: str | None = DEFAULT_INSTRUCTION
    max_turn_chars: int | None = None
    shorten: str = "none"
    marker: str = " [... {n} characters omitted ...] "
    max_prompt_tokens: int | None = None
    system_placement: str = "system"
    recap_header: str | None = _NEW_FIELDS["recap_header"]
    recap_format: str = _NEW_FIELDS["recap_format"]
    echo_header: str | None = _NEW_FIELDS["echo_header"]
    chat_template: str = _NEW_FIELDS["chat_template"]
    segment_turns: bool = False

    def __post_init__(self):
        for name in ("system", "answer_header", "history_header", "instruction",
                     "recap_header", "echo_header"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"PromptTemplate.{name} must be a string or None, got "
                                f"{type(v).__name__}.")
        for name in ("task_header", "turn_format", "marker", "recap_format", "chat_template"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"PromptTemplate.{name} must be a string.")
        for name, allowed in _FORMAT_FIELDS.items():
            _check_format_fields(name, getattr(self, name), allowed)
        if self.chat_template not in _CHAT_TEMPLATE:
            raise ValueError(f"PromptTemplate.chat_template must be one of {_CHAT_TEMPLATE}, "
                             f"got {self.chat_template!r}.")
        try:
            recap = self.recap_format.format(i=0, speaker="s", role="r")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"PromptTemplate.recap_format {self.recap_format!r} is not a valid format: "
                f"{exc!r}. Use only {{i}}, {{speaker}} and {{role}}.") from None
        if not recap.strip() or "\n" in self.recap_format or recap != recap.rstrip():
            raise ValueError(
                f"PromptTemplate.recap_format must render one non-empty line without "
                f"trailing whitespace, got {self.recap_format!r}.")
        if self.shorten not in _SHORTEN:
            raise ValueError(f"PromptTemplate.shorten must be one of {_SHORTEN}, got "
                             f"{self.shorten!r}.")
        if self.system_placement not in _SYSTEM_PLACEMENT:
            raise ValueError(f"PromptTemplate.system_placement must be one of "
                             f"{_SYSTEM_PLACEMENT}, got {self.system_placement!r}.")
        for name in ("max_turn_chars", "max_prompt_tokens"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                    raise ValueError(f"PromptTemplate.{name} must be a positive int or "
                                     f"None, got {v!r}.")
                object.__setattr__(self, name, int(v))
        if not isinstance(self.segment_turns, (bool, np.bool_)):
            raise TypeError("PromptTemplate.segment_turns must be True or False, got "
                            f"{self.segment_turns!r}.")
        object.__setattr__(self, "segment_turns", bool(self.segment_turns))
        if self.segment_turns and self.shorten == "middle_first":
            raise ValueError(
                "PromptTemplate(segment_turns=True) cannot use shorten='middle_first': its "
                "per-turn cap depends on the length of every turn, so a later turn would "
                "change how earlier turns are shortened. Use shorten='head_tail' (each turn "
                "is shortened on its own) or shorten='none'.")
        if self.shorten == "head_tail" and self.max_turn_chars is None:
            raise ValueError("PromptTemplate(shorten='head_tail') needs max_turn_chars.")
        if self.shorten != "head_tail" and self.max_turn_chars is not None:
            raise ValueError("PromptTemplate.max_turn_chars only applies with "
                             f"shorten='head_tail' (got shorten={self.shorten!r}).")
        if self.shorten == "middle_first" and self.max_prompt_tokens is None:
            raise ValueError("PromptTemplate(shorten='middle_first') needs max_prompt_tokens.")
        if self.shorten != "middle_first" and self.max_prompt_tokens is not None:
            raise ValueError(
                "PromptTemplate.max_prompt_tokens only applies with shorten='middle_first' "
                f"(got shorten={self.shorten!r}); to check lengths without shortening use "
                "skafa.llm.plan or check_fits.")
        # turn_format: exactly one {content}; the parts around it format cleanly.
        if self.turn_format.count("{content}") != 1:
            raise ValueError("PromptTemplate.turn_format must contain '{content}' exactly "
                             f"once, got {self.turn_format!r}.")
        pre, post = self.turn_format.split("{content}")
        for part in (pre, post):
            try:
                part.format(i=0, speaker="s", role="r")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"PromptTemplate.turn_format {self.turn_format!r} is not a valid "
                    f"format: {exc!r}. Use only {{i}}, {{speaker}}, {{role}}, {{content}}."
                ) from None
        try:
            self.marker.format(n=1)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"PromptTemplate.marker {self.marker!r} is not a valid format "
                             f"(only {{n}} may be used): {exc!r}.") from None

    # ------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict:
        """Return the settings as a JSON-serialisable dict (:meth:`from_dict` inverts it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> PromptTemplate:
        """Build a template from :meth:`to_dict` output; unknown keys raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown PromptTemplate field(s) {unknown}; known: {sorted(known)}.")
        return cls(**dict(data))

    def fingerprint(self, read="last", *, rendering=None) -> str:
        """sha256 hex digest of the canonical JSON of the settings and format version.

        Stable across processes and sessions; used in activation cache keys.

        Parameters
        ----------
        read : {"last", "mean", "recap", "echo"}, default="last"
            The prompt this fingerprint identifies. For ``"recap"`` and ``"echo"``
            it also covers that read's fields and layout version; for ``"last"``
            and ``"mean"`` it leaves out the recap/echo fields, which do not change
            their prompt.
        rendering : {"chat", "plain"} or None, default=None
            The rendering actually used (:meth:`rendering`); ``"plain"`` is
            recorded, so a plain-text prompt never shares a fingerprint with a
            chat-template one. ``None``: only what ``chat_template`` says.

        Returns
        -------
        str
            64 hexadecimal characters. A template whose fields added after format
            version 1 (``recap_header``, ``recap_format``, ``echo_header``,
            ``chat_template``) are at their defaults has, for ``read="last"``, the
            fingerprint it had before those fields existed.
        """
        if not isinstance(read, str) or read not in READS:
            raise ValueError(f"read must be one of {tuple(READS)}, got {read!r}.")
        if rendering not in (None, "chat", "plain"):
            raise ValueError(f"rendering must be 'chat', 'plain' or None, got {rendering!r}.")
        settings = self.to_dict()
        payload = {"prompt_format_version": PROMPT_FORMAT_VERSION}
        payload.update({k: v for k, v in settings.items() if k not in _NEW_FIELDS})
        if self.chat_template != _NEW_FIELDS["chat_template"]:
            payload["chat_template"] = self.chat_template
        if rendering == "plain" or self.chat_template == "plain":
            payload["rendering"] = "plain"
        spec = READS[read]
        if spec.tail is not None:
            payload["read_layout"] = {"read": read, "version": spec.layout_version,
                                      **{k: settings[k] for k in spec.fields}}
        if not self.segment_turns:
            payload.pop("segment_turns", None)  # keys of templates older than the field
        canon = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    @classmethod
    def online(cls, **overrides) -> PromptTemplate:
        """Template for online auditing: the task and the turns so far, nothing else.

        Unlike the default (post-hoc) template it shows no expected answer
        (``answer_header=None``), its system message (:data:`ONLINE_SYSTEM`)
        does not say the run failed, its closing question
        (:data:`ONLINE_INSTRUCTION`) is a constant, and ``segment_turns=True``
        makes turn boundaries token boundaries. So the prompt of the prefix
        ``0..k`` of a run is token for token the beginning of the full run's
        prompt, up to and including turn ``k``; with a causal model the vector
        read at turn ``k`` of the full run is what an auditor watching the run
        would have seen after turn ``k``.

        Parameters
        ----------
        **overrides
            Any other :class:`PromptTemplate` field, e.g.
            ``shorten="head_tail", max_turn_chars=2000`` (each turn is shortened
            on its own, so prefixes stay prefixes). Settings that would make a
            turn's rendering depend on later turns are refused
            (``shorten="middle_first"``, ``segment_turns=False``).

        Returns
        -------
        PromptTemplate

        Examples
        --------
        >>> t = PromptTemplate.online()
        >>> t.answer_header is None, t.segment_turns
        (True, True)
        """
        settings = dict(system=ONLINE_SYSTEM, answer_header=None,
                        instruction=ONLINE_INSTRUCTION, segment_turns=True)
        settings.update(overrides)
        if not settings["segment_turns"]:
            raise ValueError("PromptTemplate.online needs segment_turns=True (turn "
                             "boundaries must be token boundaries).")
        return cls(**settings)

    # ------------------------------------------------------------------ render
    def _turn_parts(self, i, turn):
        pre, post = self.turn_format.split("{content}")
        kw = dict(i=i, speaker=turn.speaker, role=turn.role or "")
        return pre.format(**kw), post.format(**kw)

    def _shorten_text(self, content: str, keep: int) -> tuple[str, int]:
        """Keep ``keep`` characters (head ceil, tail floor) around the marker.

        Returns the new content and the number of characters removed (0, content
        unchanged, when the marker would not be shorter than the removed text).
        """
        removed = len(content) - keep
        if removed <= 0:
            return content, 0
        marker = self.marker.format(n=removed)
        if len(marker) >= removed:
            return content, 0  # the marker would be as long as what it replaces
        head = (keep + 1) // 2
        tail = keep - head
        return (content[:head] + marker + (content[len(content) - tail:] if tail else "")), removed

    def messages(self, conversation: Conversation, contents: Sequence[str] | None = None,
                 *, read="last"):
        """Return the chat messages and the turn lines for ``conversation``.

        Parameters
        ----------
        conversation : Conversation
        contents : sequence of str, optional
            Replacement turn contents (already shortened); default the originals.
        read : {"last", "mean", "recap", "echo"}, default="last"
            ``"recap"`` and ``"echo"`` add the recap lines or the second copy of
            the turns after the instruction (see the class docstring).

        Returns
        -------
        messages : list of dict
            ``[{"role": "system", ...}, {"role": "user", ...}]`` (no system
            message when ``system`` is empty).
        lines : list of tuple
            ``(prefix, content, suffix)`` of every turn line, in order.
        """
        messages, lines, _, _ = self._layout(conversation, contents, read)
        return messages, lines

    def _layout(self, conversation, contents, read):
        """Messages, turn lines, and the text after the last turn line with the spans in it.

        Returns ``(messages, lines, tail, read_spans)``: ``tail`` is the exact text
        the user message holds after the end of the last (first-copy) turn line;
        ``read_spans`` lists, for ``read="recap"``/``"echo"``, ``(start, end, last)``
        of every recap line / copied turn line relative to the start of ``tail``
        (``last`` is the character that defines the read position), else ``[]``.
        """
        if not isinstance(read, str) or read not in READS:
            raise ValueError(f"read must be one of {tuple(READS)}, got {read!r}.")
        if contents is None:
            contents = [t.content for t in conversation.turns]
        lines = []
        for i, (turn, content) in enumerate(zip(conversation.turns, contents)):
            pre, post = self._turn_parts(i, turn)
            lines.append((pre, content, post))
        blocks = []
        if self.system and self.system_placement == "user":
            blocks.append(self.system)
        head = []
        if conversation.task:
            head.append(f"{self.task_header} {conversation.task}" if self.task_header
                        else conversation.task)
        if self.answer_header is not None:
            head.append(f"{self.answer_header} {conversation.expected_answer}"
                        if self.answer_header else conversation.expected_answer)
        if head:
            blocks.append("\n".join(head))
        history = [] if self.history_header is None else [self.history_header]
        history.extend(pre + content + post for pre, content, post in lines)
        blocks.append("\n".join(history))
        # Everything after the last turn line, built piece by piece so that the
        # offset of every read line is known without searching any text.
        tail, read_spans = "", []
        if self.instruction:
            tail += "\n\n" + self.instruction
        tail_kind = READS[read].tail
        if tail_kind is not None:
            header = getattr(self, READS[read].header_field)
            tail += "\n\n"
            if header is not None:
                tail += header + "\n"
            for i, (turn, (pre, content, post)) in enumerate(zip(conversation.turns, lines)):
                if i:
                    tail += "\n"
                if tail_kind == "recap":
                    line = self.recap_format.format(i=i, speaker=turn.speaker,
                                                    role=turn.role or "")
                    last = len(line) - 1
                else:
                    line = pre + content + post
                    last = len(pre) + len(content) - 1  # the same rule as turn_positions
                read_spans.append((len(tail), len(tail) + len(line), len(tail) + last))
                tail += line
        messages = []
        if self.system and self.system_placement == "system":
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": "\n\n".join(blocks) + tail})
        return messages, lines, tail, read_spans

    def rendering(self, tokenizer) -> str:
        """Which rendering this template uses with ``tokenizer``: ``"chat"`` or ``"plain"``.

        Parameters
        ----------
        tokenizer : transformers tokenizer

        Returns
        -------
        {"chat", "plain"}
            ``"plain"`` for ``chat_template="plain"``, and for ``"auto"`` when the
            tokenizer has no chat template; ``"chat"`` otherwise.

        Raises
        ------
        ValueError
            ``chat_template="tokenizer"`` and the tokenizer has no chat template.
        """
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.chat_template == "plain" or (self.chat_template == "auto" and not has):
            return "plain"
        if not has:
            raise ValueError(
                f"Tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template "
                "and PromptTemplate(chat_template='tokenizer') requires one. Use "
                "chat_template='plain' (or 'auto') to render plain text for a base model, "
                "or set tokenizer.chat_template to a Jinja template.")
        return "chat"

    def encode(self, conversation, tokenizer, *, chat_template_kwargs=None, index=None,
               read="last", max_tokens=None):
        """Render and tokenize ``conversation``; see :func:`encode`."""
        return encode(conversation, tokenizer, template=self,
                      chat_template_kwargs=chat_template_kwargs, index=index, read=read,
                      max_tokens=max_tokens)


# --------------------------------------------------------------------------- encoding
@dataclass(frozen=True, eq=False)
class Encoding:
    """One rendered, tokenized prompt with the position of every turn.

    Attributes
    ----------
    input_ids : ndarray of int64, shape (n_tokens,)
        Token ids of :attr:`text` (tokenized with ``add_special_tokens=False``; the
        chat template supplies BOS and other special tokens itself).
    turn_positions : ndarray of int64, shape (n_turns,)
        For each turn, the index of the token that contains the turn's last
        character: the last character of its (possibly shortened) content, or, for
        an empty content, the last character of the text before it in the turn line
        (e.g. the space after ``"speaker:"``). When several tokens cover that
        character (a multi-byte character split into byte tokens), the last of them.
        Strictly increasing.
    turn_start_positions : ndarray of int64, shape (n_turns,)
        For each turn, the index of the first token of its turn line: the token
        holding the line's first character, or the token after the previous turn's
        position when that token also holds the end of the previous turn. Tokens
        ``turn_start_positions[i] .. turn_positions[i]`` (inclusive) are turn
        ``i``'s line up to its last character (the span ``read="mean"`` averages).
    turn_char_spans : ndarray of int64, shape (n_turns, 2)
        ``[start, end)`` of each turn's whole line in :attr:`text`.
    turn_last_chars : ndarray of int64, shape (n_turns,)
        Index in :attr:`text` of the character that defines each turn position.
    offsets : ndarray of int64, shape (n_tokens, 2)
        Character span ``[start, end)`` of every token in :attr:`text`.
    text : str
        The rendered prompt.
    n_tokens : int
    chars_removed : ndarray of int64, shape (n_turns,)
        Characters removed from each turn's content by the shortening policy.
    total_chars_removed : int
    read : {"last", "mean", "recap", "echo"}
        The read this prompt was rendered for.
    rendering : {"chat", "plain"}
        Whether the tokenizer's chat template or plain text produced :attr:`text`.
    recap_positions : ndarray of int64, shape (n_turns,) or None
        With ``read="recap"``: for each turn, the token holding the last character
        of its recap line (strictly increasing, after every turn position);
        ``None`` otherwise.
    recap_char_spans : ndarray of int64, shape (n_turns, 2) or None
        ``[start, end)`` of each recap line in :attr:`text` (``read="recap"``).
    echo_positions : ndarray of int64, shape (n_turns,) or None
        With ``read="echo"``: for each turn, the token holding the last character
        of its line in the second copy, by the rule of :attr:`turn_positions`;
        ``None`` otherwise.
    echo_char_spans : ndarray of int64, shape (n_turns, 2) or None
        ``[start, end)`` of each turn's line in the second copy (``read="echo"``).
    """

    input_ids: np.ndarray
    turn_positions: np.ndarray
    turn_start_positions: np.ndarray
    turn_char_spans: np.ndarray
    turn_last_chars: np.ndarray
    offsets: np.ndarray
    text: str
    n_tokens: int
    chars_removed: np.ndarray
    total_chars_removed: int
    shortened_contents: tuple = field(default=(), repr=False)
    read: str = "last"
    rendering: str = "chat"
    recap_positions: np.ndarray | None = None
    recap_char_spans: np.ndarray | None = None
    echo_positions: np.ndarray | None = None
    echo_char_spans: np.ndarray | None = None

    @property
    def n_turns(self) -> int:
        """Number of turns."""
        return int(self.turn_positions.shape[0])

    @property
    def read_positions(self) -> np.ndarray:
        """The token read for every turn under :attr:`read`.

        :attr:`recap_positions` for ``"recap"``, :attr:`echo_positions` for
        ``"echo"``, :attr:`turn_positions` for ``"last"`` and ``"mean"`` (the
        mean ends there and starts at :attr:`turn_start_positions`).
        """
        tail = READS[self.read].tail
        return self.turn_positions if tail is None else getattr(self, f"{tail}_positions")

    def __repr__(self):
        extra = "" if self.read == "last" else f", read={self.read!r}"
        extra += "" if self.rendering == "chat" else f", rendering={self.rendering!r}"
        return (f"Encoding(n_tokens={self.n_tokens}, n_turns={self.n_turns}, "
                f"total_chars_removed={self.total_chars_removed}{extra})")


def _array(a, dtype=np.int64):
    # Writable on purpose: torch.as_tensor warns on read-only numpy arrays.
    return np.ascontiguousarray(a, dtype=dtype)


def template_uses_date(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes today's date (``strftime_now``).

    Such templates render a different prompt every day unless the date is pinned
    through ``chat_template_kwargs`` (for Llama 3: ``{"date_string": "26 Jul 2024"}``).
    """
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = " ".join(str(v) for v in tpl.values())
    return isinstance(tpl, str) and "strftime_now" in tpl


def _check_tokenizer(tokenizer):
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"skafa needs a *fast* tokenizer (with character offsets) to locate turns; got "
            f"{type(tokenizer).__name__} (is_fast=False). Load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True) or skafa.llm.load_model.")


def _plain_text(tokenizer, messages):
    """``{bos_token}{system}\\n\\n{user}\\n``: the plain-text rendering for base models."""
    bos = getattr(tokenizer, "bos_token", None)
    bos = bos if isinstance(bos, str) else ""
    return bos + "\n\n".join(m["content"] for m in messages) + "\n"


def _render(template, conversation, tokenizer, contents, chat_template_kwargs, where,
            read="last"):
    messages, lines, tail, read_spans = template._layout(conversation, contents, read)
    rendering = template.rendering(tokenizer)
    kwargs = dict(chat_template_kwargs or {})

    def render(msgs):
        if rendering == "plain":
            return _plain_text(tokenizer, msgs)
        try:
            out = tokenizer.apply_chat_template(msgs, tokenize=False,
                                                add_generation_prompt=True, **kwargs)
        except Exception as exc:  # jinja TemplateError, e.g. "System role not supported"
            hint = ""
            if "system" in str(exc).lower() and template.system_placement == "system":
                hint = (" The chat template may not accept a system message: use "
                        "PromptTemplate(system_placement='user').")
            raise ValueError(f"{where}: the tokenizer's chat template failed: {exc}.{hint}") \
                from exc
        if not isinstance(out, str):
            raise TypeError(f"{where}: apply_chat_template returned {type(out).__name__}, "
                            "expected text.")
        return out

    text = render(messages)
    # ``tail`` (from the layout) is the exact text after the last turn line of the user
    # message: the instruction, and for read="recap"/"echo" the recap lines or the copy.
    key = (rendering, str(getattr(tokenizer, "chat_template", None)), type(tokenizer).__name__,
           _canonical(getattr(tokenizer, "special_tokens_map", None)),
           _canonical(messages[:-1]), _canonical(kwargs))
    spans, last_chars = _locate_lines(text, render, messages, lines, tail, conversation,
                                      where, key)
    read_spans = np.asarray(read_spans, dtype=np.int64).reshape(-1, 3)
    if READS[read].tail is not None:
        # The recap lines (or the copy) follow the last turn line at offsets known
        # from the layout; check that the rendered text holds exactly that tail.
        anchor = int(spans[-1, 1])
        if text[anchor:anchor + len(tail)] != tail:
            what = READS[read].what_plural
            raise ValueError(
                f"{where}: the instruction and the {what} were not found verbatim right "
                "after the last turn in the rendered chat template output; the template "
                "must have escaped, trimmed or rewritten its text. Check "
                "tokenizer.chat_template or PromptTemplate(chat_template='plain').")
        read_spans = read_spans + anchor
    return (text, spans, np.asarray(last_chars, dtype=np.int64), read_spans[:, :2],
            read_spans[:, 2], rendering)


#: Stands in for the user message to find where the chat template puts it.
_USER_SENTINEL = "skafa0user0message0sentinel0d41c8"
#: ``(head, foot)`` around the user message, by rendering inputs (see _user_slot).
_SLOTS = {}


def _canonical(obj):
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str)


def _user_slot(render, messages, key, where, refresh=False):
    """The text a rendering puts before and after the user message.

    Found by rendering ``messages`` with the user message replaced by a sentinel,
    and kept by ``key`` (everything else the rendering depends on), so that each
    prompt is rendered once; ``refresh`` renders again (a template that writes
    today's date changes its shell at midnight).
    """
    if not refresh and key in _SLOTS:
        return _SLOTS[key]
    shell_messages = [dict(m) for m in messages]
    shell_messages[-1]["content"] = _USER_SENTINEL
    shell = render(shell_messages)
    k = shell.find(_USER_SENTINEL)
    if k < 0 or shell.find(_USER_SENTINEL, k + 1) >= 0:
        raise ValueError(
            f"{where}: the chat template does not insert the user message once and "
            "verbatim, so turn positions cannot be located. Check "
            "tokenizer.chat_template.")
    if len(_SLOTS) >= 256:
        _SLOTS.clear()
    _SLOTS[key] = slot = (shell[:k], shell[k + len(_USER_SENTINEL):])
    return slot


def _user_base(text, head, foot, user):
    """Offset in ``text`` of the user message's first character, or None."""
    if text.startswith(head) and text.endswith(foot) and len(text) >= len(head) + len(foot):
        middle = text[len(head):len(text) - len(foot)]
        for lead in (0, len(user) - len(user.lstrip())):  # verbatim, or trimmed
            if (user[lead:lead + len(middle)] == middle
                    and not user[lead + len(middle):].strip()):
                return len(head) - lead
    return None


def _locate_lines(text, render, messages, lines, tail, conversation, where, key):
    """``[start, end)`` and last character of every turn line in ``text``, from the layout.

    skafa builds the user message itself, so the offset of every turn line inside it
    is known: the turn lines end where ``tail`` (the text after the last turn line)
    starts. Where the chat template puts the user message is found by rendering the
    same messages with the user message replaced by a sentinel: what precedes and
    follows the sentinel must precede and follow the user message in ``text``
    (templates that ``trim`` the message are allowed for). The text is never
    *searched* for a turn line, so a task or expected answer shaped like the
    transcript (``"Conversation:\\n0 - a: x"``) cannot be taken for it.

    Parameters
    ----------
    text : str
        The rendered prompt.
    render : callable
        ``render(messages) -> str``, the rendering that produced ``text``.
    messages : list of dict
        The messages rendered; the last one is skafa's user message.
    lines : list of (str, str, str)
        ``(prefix, content, suffix)`` of every turn line, in order.
    tail : str
        The exact text the user message holds after the last turn line.
    conversation : Conversation
    where : str
        Names the conversation in errors.
    key : tuple
        Everything but the user message that the rendering depends on (caches the
        shell, see :func:`_user_slot`).

    Returns
    -------
    spans : ndarray of int64, shape (n_turns, 2)
    last_chars : ndarray of int64, shape (n_turns,)
    """
    for i, (pre, content, _) in enumerate(lines):
        if not (pre or content):
            raise ValueError(f"{where}: turn {i} renders to nothing before its (empty) "
                             "content; give turn_format a prefix such as '{i} - {speaker}: '.")
    user = messages[-1]["content"]
    # Offsets of the turn lines inside the user message, from its layout.
    joined = [pre + content + post for pre, content, post in lines]
    block = "\n".join(joined)
    first = len(user) - len(tail) - len(block)
    if first < 0 or user[first:first + len(block)] != block or not user.endswith(tail):
        raise RuntimeError(f"{where}: internal error: the turn lines are not where the "
                           "prompt layout puts them.")  # pragma: no cover
    starts_in_user = first + np.concatenate(
        [[0], np.cumsum([len(line) + 1 for line in joined[:-1]])]).astype(np.int64)
    # Where the rendering puts the user message.
    head, foot = _user_slot(render, messages, key, where)
    base = _user_base(text, head, foot, user)
    if base is None:  # maybe a stale shell (a dated template): render it again
        head, foot = _user_slot(render, messages, key, where, refresh=True)
        base = _user_base(text, head, foot, user)

    def not_found(i):
        speaker = conversation.turns[i].speaker
        return ValueError(
            f"{where}: turn {i} (speaker {speaker!r}) was not found verbatim in the "
            "rendered chat template output; the template must have escaped, trimmed "
            "or rewritten its text. Check tokenizer.chat_template or adjust "
            "PromptTemplate (e.g. end with an instruction so the last turn is not "
            "trimmed).")

    if base is None:
        # The template changed the user message. If every turn line is still intact
        # at its place (only later text changed), use them; else name the first
        # turn line that changed.
        rest = text[len(head):] if text.startswith(head) else ""
        same = len(os.path.commonprefix([rest, user]))
        ends = starts_in_user + np.asarray([len(line) for line in joined])
        if rest and np.all(ends <= same):
            base = len(head)
        else:
            raise not_found(int(np.argmax(ends > same)))
    spans, last_chars = [], []
    for i, (pre, content, post) in enumerate(lines):
        start = base + int(starts_in_user[i])
        end = start + len(joined[i])
        if text[start:end] != joined[i]:
            raise not_found(i)
        spans.append((start, end))
        last_chars.append(start + len(pre) + len(content) - 1)  # content end, else prefix end
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2), np.asarray(last_chars)


def _tokenize(tokenizer, text, last_chars, where):
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                    return_attention_mask=False)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    if ids.ndim != 1 or offsets.shape[0] != ids.shape[0]:
        raise ValueError(f"{where}: unexpected tokenizer output shape.")
    return ids, offsets, _char_tokens(offsets, last_chars, where)


def _char_tokens(offsets, chars, where, what="turn", ending="use a turn_format that "
                 "separates turns."):
    """Index of the last token covering each character in ``chars`` (strictly increasing)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    # Last token whose span covers the character c: tokens are in text order, so
    # search the running maximum of starts.
    run_starts = np.maximum.accumulate(starts) if len(starts) else starts
    positions = np.searchsorted(run_starts, chars, side="right") - 1
    for i, (c, p) in enumerate(zip(chars, positions)):
        q = p
        while q >= 0 and not (starts[q] <= c < ends[q]):
            q -= 1  # zero-width or odd tokens: walk back to a token covering c
            if q < p - 8:
                q = -1
                break
        if q < 0:
            raise ValueError(f"{where}: no token covers the last character of {what} {i} "
                             f"(character {c}); the tokenizer's offsets are unusable.")
        positions[i] = q
    if len(positions) > 1 and np.any(np.diff(positions) <= 0):
        bad = int(np.flatnonzero(np.diff(positions) <= 0)[0]) + 1
        plural = "turns" if what == "turn" else f"{what}s"
        raise ValueError(f"{where}: {plural} {bad - 1} and {bad} end in the same token; "
                         f"{ending}")
    return positions.astype(np.int64)


def _turn_segments(spans, n_chars):
    """Character cuts of ``segment_turns``: head, turn 0, "\\n" + turn i..., tail.

    Turn ``i``'s segment ends where its line ends, so it never depends on what
    follows; the newline that separates two lines opens the later one.
    """
    if len(spans) == 0:
        return [(0, n_chars)]
    cuts = [0, int(spans[0, 0])] + [int(e) for e in spans[:, 1]] + [int(n_chars)]
    return list(zip(cuts[:-1], cuts[1:]))


def _tokenize_segments(tokenizer, text, spans, last_chars, where):
    """:func:`_tokenize` on every segment of :func:`_turn_segments`, concatenated."""
    segments = _turn_segments(spans, len(text))
    ids, offsets, positions = [], [], []
    n_tokens = 0
    for k, (a, b) in enumerate(segments):
        if a == b:
            continue
        # Segment k is turn k - 1 (segment 0 is the text before the first turn).
        local = [int(last_chars[k - 1]) - a] if 1 <= k <= len(spans) else []
        seg_ids, seg_offsets, seg_pos = _tokenize(tokenizer, text[a:b],
                                                  np.asarray(local, dtype=np.int64), where)
        ids.append(seg_ids)
        offsets.append(seg_offsets + a)
        positions.append(seg_pos + n_tokens)
        n_tokens += int(seg_ids.shape[0])
    return (np.concatenate(ids).astype(np.int64),
            np.concatenate(offsets).astype(np.int64).reshape(-1, 2),
            np.concatenate(positions).astype(np.int64))


def _start_positions(offsets, line_starts, positions):
    """First token of every turn line (see :attr:`Encoding.turn_start_positions`)."""
    ends = offsets[:, 1]
    # First token ending after the line's first character, i.e. the token holding it
    # (or the first token after it, for a zero-width oddity).
    starts = np.searchsorted(np.maximum.accumulate(ends) if len(ends) else ends,
                             np.asarray(line_starts), side="right")
    previous = np.concatenate([[-1], positions[:-1]]) if len(positions) else positions
    starts = np.maximum(starts, previous + 1)
    return np.minimum(starts, positions).astype(np.int64)


def _warn_special(conversation, tokenizer, where):
    """Warn when text of the conversation holds a chat-template special token.

    Every field that reaches the prompt is checked: the task, the expected answer,
    and each turn's speaker, role and content.
    """
    specials = [t for t in (getattr(tokenizer, "all_special_tokens", None) or []) if t]
    if not specials:
        return
    fields = [("the task", conversation.task),
              ("the expected answer", conversation.expected_answer)]
    for i, turn in enumerate(conversation.turns):
        fields.append((f"turn {i} speaker", turn.speaker))
        if turn.role:
            fields.append((f"turn {i} role", turn.role))
        fields.append((f"turn {i}", turn.content))
    found = []
    for label, text in fields:
        hit = next((s for s in specials if s in text), None)
        if hit is not None:
            found.append(f"{label} contains the special token {hit!r}")
    if found:
        more = f" (and {len(found) - 3} more fields)" if len(found) > 3 else ""
        warnings.warn(
            f"{where}: {'; '.join(found[:3])}{more}; the tokenizer will treat it as a "
            "real special token.", UserWarning, stacklevel=4)


#: A prompt with more characters than this many per token of its token limit is
#: refused (or, with ``shorten="middle_first"``, shortened) *before* it is tokenized:
#: tokenizers take ~130 bytes of memory per character, so a 40 MB turn would exhaust
#: memory before a token count could refuse it. Real text averages 3-5 characters per
#: token; no token of the supported models' vocabularies is longer than 64 characters.
CHARS_PER_TOKEN_BOUND = 64
#: The token limit assumed for the character budget when neither the caller
#: (``max_tokens``), the template (``max_prompt_tokens``) nor the tokenizer
#: (``model_max_length``) gives one.
DEFAULT_TOKEN_LIMIT = 131_072


class _TooManyCharacters(PromptTooLongError):
    """The rendered prompt is over the character budget; nothing was tokenized."""


def _token_limit(template, tokenizer, max_tokens):
    """The token limit the character budget is derived from (see CHARS_PER_TOKEN_BOUND)."""
    limits = [int(m) for m in (max_tokens, template.max_prompt_tokens) if m is not None]
    if not limits:
        known = getattr(tokenizer, "model_max_length", None)
        if isinstance(known, (int, np.integer)) and 0 < known < 10**8:
            limits.append(int(known))
    return min(limits) if limits else DEFAULT_TOKEN_LIMIT


def _check_characters(text, contents, token_limit, where):
    """Refuse a rendered prompt over the character budget, before tokenizing it."""
    budget = CHARS_PER_TOKEN_BOUND * token_limit
    if len(text) <= budget:
        return
    lengths = [len(c) for c in contents]
    longest = int(np.argmax(lengths)) if lengths else None
    turn = (f"; turn {longest} is the longest ({lengths[longest]:,} characters)"
            if longest is not None else "")
    raise _TooManyCharacters(
        f"{where}: the prompt has {len(text):,} characters, more than "
        f"{CHARS_PER_TOKEN_BOUND} per token of its {token_limit:,}-token limit "
        f"({budget:,} characters), so it cannot fit and was refused before tokenizing"
        f"{turn}. Shorten that turn, or use PromptTemplate(shorten='head_tail', "
        "max_turn_chars=...) or shorten='middle_first'.",
        n_tokens=len(text) // CHARS_PER_TOKEN_BOUND + 1, max_tokens=token_limit)


def _encode_contents(template, conversation, tokenizer, contents, removed,
                     chat_template_kwargs, where, read="last", token_limit=None):
    text, spans, last_chars, read_spans, read_chars, rendering = _render(
        template, conversation, tokenizer, contents, chat_template_kwargs, where, read)
    if token_limit is not None:
        _check_characters(text, contents, token_limit, where)
    if template.segment_turns:
        if not READS[read].streamable:
            raise ValueError(f"{where}: segment_turns (online auditing) reads turns as "
                             f"they end; read={read!r} needs the whole run.")
        ids, offsets, positions = _tokenize_segments(tokenizer, text, spans, last_chars, where)
    else:
        ids, offsets, positions = _tokenize(tokenizer, text, last_chars, where)
    starts = _start_positions(offsets, spans[:, 0], positions)
    removed = np.asarray(removed, dtype=np.int64)
    extra = {}
    if READS[read].tail is not None:
        what = READS[read].what
        read_positions = _char_tokens(offsets, read_chars, where, what,
                                      "make the lines that are read end in distinct tokens.")
        if len(read_positions) and read_positions[0] <= positions[-1]:
            raise ValueError(f"{where}: the first {what} ends in the token of the last turn.")
        extra = {f"{read}_positions": _array(read_positions),
                 f"{read}_char_spans": _array(read_spans)}
    return Encoding(
        input_ids=_array(ids),
        turn_positions=_array(positions),
        turn_start_positions=_array(starts),
        turn_char_spans=_array(spans),
        turn_last_chars=_array(last_chars),
        offsets=_array(offsets),
        text=text,
        n_tokens=int(ids.shape[0]),
        chars_removed=_array(removed),
        total_chars_removed=int(removed.sum()),
        shortened_contents=tuple(contents),
        read=read,
        rendering=rendering,
        **extra,
    )


def _encode(conversation, tokenizer, template, chat_template_kwargs, index, strict=True,
            read="last", max_tokens=None):
    """Return (encoding, fits_budget). With strict, raise when middle_first cannot fit.

    Every prompt is checked against the character budget of
    :data:`CHARS_PER_TOKEN_BOUND` before it is tokenized.
    """
    where = _describe(conversation, index)
    originals = [t.content for t in conversation.turns]
    n = len(originals)
    limit = _token_limit(template, tokenizer, max_tokens)
    if template.shorten == "none":
        return _encode_contents(template, conversation, tokenizer, originals, [0] * n,
                                chat_template_kwargs, where, read, limit), True
    if template.shorten == "head_tail":
        pairs = [template._shorten_text(c, template.max_turn_chars) for c in originals]
        return _encode_contents(template, conversation, tokenizer, [p[0] for p in pairs],
                                [p[1] for p in pairs], chat_template_kwargs, where, read,
                                limit), True

    # middle_first: largest cap k such that the prompt fits.
    budget = template.max_prompt_tokens

    def at(cap):
        pairs = [template._shorten_text(c, cap) for c in originals]
        return _encode_contents(template, conversation, tokenizer, [p[0] for p in pairs],
                                [p[1] for p in pairs], chat_template_kwargs, where, read,
                                limit)

    try:
        full = _encode_contents(template, conversation, tokenizer, originals, [0] * n,
                                chat_template_kwargs, where, read, limit)
    except _TooManyCharacters:
        full = None  # cannot fit: shorten without tokenizing the whole text
    if full is not None and full.n_tokens <= budget:
        return full, True
    lo_enc = at(0)  # a _TooManyCharacters here means the fixed text alone is too long
    if lo_enc.n_tokens > budget:
        if strict:
            raise PromptTooLongError(
                f"{where}: even with every turn reduced to the omission marker the prompt "
                f"has {lo_enc.n_tokens} tokens, more than max_prompt_tokens={budget} "
                "(the task, headers and per-turn lines alone are too long).",
                n_tokens=lo_enc.n_tokens, max_tokens=budget)
        return lo_enc, False
    lo, hi = 0, max(len(c) for c in originals)  # at(lo) fits, at(hi) == full does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            enc = at(mid)
        except _TooManyCharacters:
            enc = None  # over the character budget: does not fit, nothing tokenized
        if enc is not None and enc.n_tokens <= budget:
            lo, lo_enc = mid, enc
        else:
            hi = mid
    return lo_enc, True


def encode(conversation, tokenizer, *, template=None, chat_template_kwargs=None, index=None,
           read="last", max_tokens=None):
    """Render ``conversation`` with ``template`` and find every turn's last token.

    Parameters
    ----------
    conversation : Conversation
    tokenizer : transformers fast tokenizer
        Must have ``is_fast`` (character offsets). A slow tokenizer raises
        ``TypeError``. Without a ``chat_template`` the prompt is plain text
        (``PromptTemplate(chat_template="auto")``, the default) or refused
        (``"tokenizer"``).
    template : PromptTemplate, optional
        Default ``PromptTemplate()``.
    chat_template_kwargs : dict, optional
        Extra variables for the chat template, e.g. ``{"date_string": "26 Jul 2024"}``
        to pin a template that embeds today's date (see :func:`template_uses_date`).
    index : int, optional
        Position of the conversation in its list, used in error messages.
    read : {"last", "mean", "recap", "echo"}, default="last"
        The read the prompt is for. ``"recap"`` appends one recap line per turn
        after the instruction and fills :attr:`Encoding.recap_positions`;
        ``"echo"`` appends the turns a second time and fills
        :attr:`Encoding.echo_positions`. Shortening (``shorten="middle_first"``)
        budgets the whole prompt, recap lines or second copy included.
    max_tokens : int, optional
        The token limit the prompt will be checked against (usually the model's
        context length). Only used, before tokenizing, to refuse a prompt with
        more than :data:`CHARS_PER_TOKEN_BOUND` characters per token of it (it
        cannot fit, and tokenizing it could exhaust memory); the exact check
        is :func:`check_fits`. Default: the smallest of ``max_prompt_tokens``
        and the tokenizer's ``model_max_length``, else
        :data:`DEFAULT_TOKEN_LIMIT`.

    Returns
    -------
    Encoding

    Raises
    ------
    TypeError
        Slow tokenizer, or ``conversation`` is not a Conversation.
    ValueError
        The chat template fails or alters a turn line (or the recap lines, or the
        second copy) so it cannot be found (the message names the turn); reserved
        ``chat_template_kwargs``; unknown ``read``; no chat template with
        ``chat_template="tokenizer"``.
    PromptTooLongError
        With ``shorten="middle_first"``, when even minimal turns do not fit;
        before tokenizing, when the prompt (after shortening, as the template
        is configured to) is over the character budget (see ``max_tokens``).
        The message names the conversation and its longest turn.

    Notes
    -----
    The rendered text is tokenized with ``add_special_tokens=False``: chat
    templates already write BOS (Llama 3's starts with ``{{ bos_token }}``), so
    letting the tokenizer add another would give two BOS tokens.

    Examples
    --------
    >>> from skafa.testing import make_tiny_tokenizer, make_conversations
    >>> conv = make_conversations(1)[0]
    >>> enc = encode(conv, make_tiny_tokenizer())
    >>> len(enc.turn_positions) == len(conv)
    True
    """
    if template is None:
        template = PromptTemplate()
    if not isinstance(template, PromptTemplate):
        raise TypeError(f"template must be a PromptTemplate, got {type(template).__name__}.")
    if not isinstance(conversation, Conversation):
        raise TypeError(f"{_describe(conversation, index)} is a {type(conversation).__name__}, "
                        "not a skafa Conversation.")
    _check_read(read)
    _check_tokenizer(tokenizer)
    kwargs = _check_kwargs(chat_template_kwargs)
    where = _describe(conversation, index)
    if (template.rendering(tokenizer) == "chat" and template_uses_date(tokenizer)
            and "date_string" not in kwargs):
        warnings.warn(
            f"The chat template of {getattr(tokenizer, 'name_or_path', '')!r} writes today's "
            "date, so prompts (and cached activations) change from day to day. Pin it with "
            "chat_template_kwargs={'date_string': '26 Jul 2024'} (or the variable your "
            "template uses).", UserWarning, stacklevel=2)
    _warn_special(conversation, tokenizer, where)
    return _encode(conversation, tokenizer, template, kwargs, index, read=read,
                   max_tokens=max_tokens)[0]


def _check_read(read):
    if not isinstance(read, str) or read not in READS:
        raise ValueError(f"read must be one of {tuple(READS)}, got {read!r}.")


def _check_kwargs(chat_template_kwargs):
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise TypeError("chat_template_kwargs must be a dict or None, got "
                        f"{type(chat_template_kwargs).__name__}.")
    bad = [k for k in chat_template_kwargs if k in _RESERVED_KWARGS]
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {bad}: skafa sets them itself.")
    return dict(chat_template_kwargs)


# --------------------------------------------------------------------------- planning
def check_fits(encoding, max_tokens, index=None, conversation=None):
    """Raise ``ValueError`` when a prompt is longer than ``max_tokens``.

    skafa never reads activations at positions the model was not trained on and
    never cuts a prompt silently; call this before running a model.

    Parameters
    ----------
    encoding : Encoding
    max_tokens : int
        The limit, usually :func:`skafa.llm.context_length`.
    index : int, optional
        Position of the conversation in its list (named in the message).
    conversation : Conversation, optional
        Its ``task_id`` and ``record_id`` are named in the message.

    Returns
    -------
    encoding : Encoding
        The input, when it fits.

    Raises
    ------
    PromptTooLongError
        (a ``ValueError``) naming the conversation, its token count and the limit.
    """
    max_tokens = int(max_tokens)
    if encoding.n_tokens > max_tokens:
        where = _describe(conversation, index)
        raise PromptTooLongError(
            f"{where} has {encoding.n_tokens} prompt tokens, more than the limit of "
            f"{max_tokens}. skafa does not read past the model's context or cut prompts "
            f"silently: shorten turns with PromptTemplate(shorten='middle_first', "
            f"max_prompt_tokens={max_tokens}) or shorten='head_tail', or drop the "
            "conversation (skafa.llm.plan lists every prompt that is too long).",
            n_tokens=encoding.n_tokens, max_tokens=max_tokens)
    return encoding


class PromptPlan(Sequence):
    """Per-conversation prompt lengths against a token limit (from :func:`plan`).

    A read-only sequence of dicts with keys ``index``, ``task_id``, ``record_id``,
    ``n_turns``, ``n_tokens``, ``fits``, ``chars_removed`` (total for the
    conversation) and ``turn_chars_removed`` (list, per turn).

    Attributes
    ----------
    max_tokens : int
    rows : list of dict
    """

    def __init__(self, rows, max_tokens):
        self.rows = list(rows)
        self.max_tokens = int(max_tokens)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    @property
    def all_fit(self) -> bool:
        """True when every prompt has at most ``max_tokens`` tokens."""
        return all(r["fits"] for r in self.rows)

    @property
    def too_long(self) -> list:
        """Rows of the prompts that do not fit."""
        return [r for r in self.rows if not r["fits"]]

    @property
    def n_tokens(self) -> np.ndarray:
        """Token count of every prompt."""
        return np.asarray([r["n_tokens"] for r in self.rows], dtype=np.int64)

    @property
    def total_chars_removed(self) -> int:
        """Characters removed by shortening, over all conversations."""
        return int(sum(r["chars_removed"] for r in self.rows))

    def to_frame(self):
        """Return the rows as a ``pandas.DataFrame`` (needs pandas)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def __repr__(self):
        n = len(self.rows)
        if not n:
            return f"PromptPlan(0 conversations, max_tokens={self.max_tokens})"
        return (f"PromptPlan({n} conversations, max_tokens={self.max_tokens}, "
                f"fit={n - len(self.too_long)}, longest={int(self.n_tokens.max())} tokens, "
                f"chars_removed={self.total_chars_removed})")


def plan(conversations, tokenizer, template=None, *, max_tokens, chat_template_kwargs=None,
         read="last"):
    """Report, before running a model, which prompts fit ``max_tokens``.

    Renders and tokenizes every conversation exactly as extraction will (including
    the shortening policy) but runs no model. Nothing raises for length: with
    ``shorten="middle_first"`` a conversation that cannot be shortened enough is
    reported with ``fits=False`` and its shortest length.

    Parameters
    ----------
    conversations : sequence of Conversation
    tokenizer : transformers fast tokenizer
    template : PromptTemplate, optional
        Default ``PromptTemplate()``.
    max_tokens : int
        The limit (usually the model's context length).
    chat_template_kwargs : dict, optional
        As in :func:`encode`.
    read : {"last", "mean", "recap", "echo"}, default="last"
        As in :func:`encode`: plan the prompt of that read (``"recap"`` and
        ``"echo"`` prompts are longer, and shortening counts their extra text).

    Returns
    -------
    PromptPlan

    Examples
    --------
    >>> from skafa.testing import make_tiny_tokenizer, make_conversations
    >>> p = plan(make_conversations(4), make_tiny_tokenizer(), max_tokens=4096)
    >>> p.all_fit, len(p)
    (True, 4)
    """
    if template is None:
        template = PromptTemplate()
    if not isinstance(template, PromptTemplate):
        raise TypeError(f"template must be a PromptTemplate, got {type(template).__name__}.")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
            or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}.")
    _check_read(read)
    _check_tokenizer(tokenizer)
    kwargs = _check_kwargs(chat_template_kwargs)
    if (template.rendering(tokenizer) == "chat" and template_uses_date(tokenizer)
            and "date_string" not in kwargs):
        warnings.warn("The chat template writes today's date; pin it with "
                      "chat_template_kwargs={'date_string': ...}.", UserWarning, stacklevel=2)
    rows = []
    for i, conv in enumerate(conversations):
        if not isinstance(conv, Conversation):
            raise TypeError(f"{_describe(conv, i)} is a {type(conv).__name__}, not a "
                            "skafa Conversation.")
        try:
            enc, ok = _encode(conv, tokenizer, template, kwargs, i, strict=False, read=read,
                              max_tokens=max_tokens)
        except _TooManyCharacters as exc:  # too long to tokenize: a lower bound of n_tokens
            rows.append({"index": i, "task_id": conv.task_id, "record_id": conv.record_id,
                         "n_turns": len(conv), "n_tokens": exc.n_tokens, "fits": False,
                         "chars_removed": 0, "turn_chars_removed": [0] * len(conv)})
            continue
        rows.append({
            "index": i,
            "task_id": conv.task_id,
            "record_id": conv.record_id,
            "n_turns": len(conv),
            "n_tokens": enc.n_tokens,
            "fits": bool(ok and enc.n_tokens <= max_tokens),
            "chars_removed": enc.total_chars_removed,
            "turn_chars_removed": enc.chars_removed.tolist(),
        })
    return PromptPlan(rows, max_tokens)


register_value_codec(PromptTemplate, "__prompt__", PromptTemplate.to_dict, PromptTemplate.from_dict)
