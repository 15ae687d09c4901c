"""The registry of reads: where a turn's vector comes from (``read=``).

One small :class:`Read` per read holds what every module needs to know about it
(the prompt, the extractor, the activation cache, the streaming reader, the command
line), so that adding a read is one entry here, not a string switch in each module.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["Read", "READS"]


@dataclass(frozen=True)
class Read:
    """What one read is: its prompt, which rows it reads, how it is keyed.

    Parameters
    ----------
    name : str
        The value of ``read=``.
    rows : {"last", "line", "tail"}
        Which token rows give a turn's vector: ``"last"`` the token holding the
        turn's last character; ``"line"`` the mean over the turn's line (from its
        first token to that one); ``"tail"`` the token ending the turn's line in
        the text after the transcript (:attr:`tail`).
    tail : {None, "recap", "echo"}
        Text the prompt adds after the transcript for this read: one recap line
        per turn, or a second copy of the turns. ``None``: the prompt is the plain
        one (and so shared with every other read without a tail).
    header_field : str or None
        The :class:`~skafa.llm.PromptTemplate` field heading the tail.
    fields : tuple of str
        Template fields that change the tail (part of the prompt fingerprint).
    layout_version : int or None
        Version of the tail's layout (part of the prompt fingerprint).
    what, what_plural : str or None
        How messages name one read line of the tail, and all of them.

    Examples
    --------
    >>> from skafa.llm import READS
    >>> list(READS)
    ['last', 'mean', 'recap', 'echo']
    >>> READS["recap"].tail, READS["mean"].rows, READS["last"].streamable
    ('recap', 'line', True)
    """

    name: str
    rows: str
    tail: str | None = None
    header_field: str | None = None
    fields: tuple = ()
    layout_version: int | None = None
    what: str | None = None
    what_plural: str | None = None

    @property
    def streamable(self) -> bool:
        """Whether a turn's vector depends only on the run up to that turn."""
        return self.tail is None

    @property
    def keyed(self) -> bool:
        """Whether the read is named in the activation-cache key.

        ``"last"`` is not (caches written before reads existed stay valid); every
        other read is, so reads with the same prompt never share entries.
        """
        return self.name != "last"


#: The reads, by name, in the order the documentation lists them (read-only).
READS = MappingProxyType({r.name: r for r in (
    Read("last", rows="last"),
    Read("mean", rows="line"),
    Read("recap", rows="tail", tail="recap", header_field="recap_header",
         fields=("recap_header", "recap_format"), layout_version=1,
         what="recap line", what_plural="recap lines"),
    Read("echo", rows="tail", tail="echo", header_field="echo_header",
         fields=("echo_header",), layout_version=1,
         what="copied turn", what_plural="second copy of the turns"),
)})
