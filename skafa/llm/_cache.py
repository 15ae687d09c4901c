"""Content-addressed cache of per-conversation activations.

One entry holds the activations of one conversation at a set of sites: a float32
array ``(n_turns, n_sites, hidden_size)`` plus the site names. Entries are keyed
by :func:`activation_key`, a SHA-256 of everything that determines the
activations (model identity and architecture, dtype, prompt settings, chat
template arguments, and the conversation's *content*: task, expected answer,
turns' speakers and contents) — not the device, labels, ids or metadata.

Two layers, both optional:

- an in-process LRU (:class:`MemoryLRU`) bounded by bytes; by default a single
  process-wide instance (:func:`shared_memory_cache`, 512 MiB) is shared by every
  :class:`~skafa.llm.TurnActivationTransformer`, so clones made by a grid
  search reuse each other's work;
- an on-disk directory: one safetensors file per conversation,
  ``<dir>/<key[:2]>/<key>.safetensors``, written atomically (temporary file in the
  same folder, ``fsync``, ``os.replace``) so concurrent writers never leave a
  half-written entry under the final name. Every read checks a SHA-256 digest of
  the header and the data (so edited site names are caught, not only flipped
  values), the key, the shape, the site list, a CRC-32 of the data and
  finiteness; a bad entry (or one written before digests existed) is
  reported with a :class:`CacheCorruptionWarning` and treated as a miss (it is
  then recomputed and overwritten), never used.

An entry that has more sites than requested is sliced; one that lacks a requested
site is a miss, and the recomputed sites are merged with the cached ones when the
entry is written back. (Two processes writing *different* site sets for the same
conversation at the same moment can each replace the other's file: the last
writer wins and the other sites are recomputed later; an entry is never corrupt.)
A failed disk write (full or read-only disk) is reported with a ``RuntimeWarning``
and extraction goes on.

The SHA-256 digest is stored in the entry, so it catches accidents, not tampering:
whoever can write the folder can recompute it. For a cache shared between users (or
downloaded), a **cache key** adds a keyed MAC (HMAC-SHA256 over the header and the
values, :data:`MAC_KEY` in the header): set ``SKAFA_CACHE_KEY`` (the key itself) or
``SKAFA_CACHE_KEY_FILE`` (a file holding it) in the environment, or pass ``mac_key``
to :class:`ActivationCache`. With a key, every entry is written with its MAC, and an
entry without a valid one (written without the key, with another key, or re-signed
by someone who does not hold the key) is never used: it is reported with a
:class:`CacheCorruptionWarning` naming it, counted in ``stats["unsigned"]``, and
recomputed and overwritten. Without a key nothing changes (a MAC in an entry is
ignored). The key is never logged, and it is not part of the entries' names, so
one folder can move from unsigned to signed use.

Claims (:meth:`ActivationCache.claim`) let processes that share a directory split
the work: a ``<key>.claim`` file, created atomically, says "being extracted
elsewhere". A claim is advisory: whoever meets another's claim does other
conversations first and comes back; one left by a killed process only delays that
conversation (and is removed once it is written), it never blocks it, and a result
is correct whoever computes it. A claim names its process (pid, host, start time): a
process that has nothing else left waits for a conversation a running process of the
same host has claimed instead of computing it twice.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import threading
import warnings
import zlib
from collections import OrderedDict

import numpy as np

from ..exceptions import CacheCorruptionWarning
from ..utils.claims import claim_holder_alive, create_claim
from ..utils.fileio import (
    DIGEST_KEY,
    json_field,
    read_regular_file,
    read_safetensors,
    write_safetensors,
)
from ..utils.signals import raise_if_stop_requested
from ._reads import READS
from ._sites import site_depth

__all__ = [
    "ActivationCache",
    "MemoryLRU",
    "activation_key",
    "conversation_content",
    "shared_memory_cache",
    "DEFAULT_MEMORY_BYTES",
    "CACHE_KEY_ENV",
    "CACHE_KEY_FILE_ENV",
    "MAC_KEY",
]

#: Default size bound of the process-wide in-memory cache (512 MiB).
DEFAULT_MEMORY_BYTES = 512 * 1024**2

#: Version of the entry format and of the key recipe. Bump when either changes.
#: 2: the model identity in the key holds the sha256 of the whole weights files
#: (was: size, first and last MiB of a GGUF file; names and sizes of a folder's files).
_FORMAT = "skafa.activations/2"
_TENSOR = "activations"

#: Environment variable holding the cache key (its UTF-8 bytes are the HMAC key).
CACHE_KEY_ENV = "SKAFA_CACHE_KEY"
#: Environment variable naming a file that holds the cache key (surrounding
#: whitespace, such as a final newline, is not part of the key).
CACHE_KEY_FILE_ENV = "SKAFA_CACHE_KEY_FILE"
#: Header field of an entry's keyed MAC (HMAC-SHA256, hex), written only with a key.
MAC_KEY = "skafa_hmac_sha256"
#: Shortest cache key accepted, in bytes.
_MIN_KEY_BYTES = 16
#: Largest key file read (a key is short; anything bigger is not a key file).
_MAX_KEY_FILE_BYTES = 4096
_MAC_DOMAIN = b"skafa.activations.hmac/1\0"

#: Site kinds keyed apart from hidden states, with the version of their recipe
#: (``head_attn``: mass from the prompt's last token to each turn's line, version 1).
_SITE_KINDS = {"head_attn": "head_attn/1"}


def conversation_content(conversation):
    """The parts of a conversation that determine its activations.

    Parameters
    ----------
    conversation : Conversation

    Returns
    -------
    content : dict
        ``task``, ``expected_answer`` and ``turns`` (``[speaker, content, role]``
        per turn). Labels (``mistake_step``, ``mistake_agent``), ``task_id``,
        ``record_id`` and ``metadata`` are excluded: they do not change the prompt.
    """
    return {
        "task": conversation.task,
        "expected_answer": conversation.expected_answer,
        "turns": [[t.speaker, t.content, t.role] for t in conversation.turns],
    }


def _canonical_json(obj):
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      default=str)


def activation_key(*, model_identity, model_fingerprint, dtype, prompt_fingerprint,
                   chat_template_kwargs, conversation, tokenizer_fingerprint=None,
                   template_date=None, read="last", site_kind=None):
    """SHA-256 key of one conversation's activations.

    Parameters
    ----------
    model_identity : dict or str
        Which weights (e.g. the GGUF file's digest), from
        :func:`skafa.llm.model_identity`. Must be JSON-serialisable.
    model_fingerprint : dict
        Architecture fingerprint from :func:`skafa.llm.model_fingerprint`.
        A ``"device"`` entry, if any, is ignored (keys are device-independent).
    dtype : str
        Compute dtype (``"float32"``, ``"bfloat16"``, ...).
    prompt_fingerprint : str
        :meth:`skafa.llm.PromptTemplate.fingerprint`.
    chat_template_kwargs : dict or None
        Extra variables of the chat template (e.g. a pinned ``date_string``).
    conversation : Conversation
        Only its content counts (:func:`conversation_content`).
    tokenizer_fingerprint : str, optional
        Digest of the tokenizer and its chat template (a registered model can be
        paired with any tokenizer, so the weights alone do not fix the prompt).
    template_date : str, optional
        Today's date when the chat template writes it and it is not pinned, so that
        entries from another day are not reused.
    read : str, default="last"
        How turn vectors are read (:class:`~skafa.llm.TurnActivationTransformer`'s
        ``read``). ``"last"`` adds nothing to the key, so caches written before this
        option existed stay valid.
    site_kind : {None, "head_attn"}, default=None
        What the entry's sites hold. ``None``: hidden states (adds nothing to the
        key, so existing caches stay valid). ``"head_attn"``: per-head attention
        mass (``head_attn.<l>`` sites, one feature per head), keyed apart with
        the version of its recipe, as its rows have another width.

    Returns
    -------
    key : str
        64 hex characters.
    """
    fingerprint = dict(model_fingerprint or {})
    fingerprint.pop("device", None)
    payload = {
        "format": _FORMAT,
        "model_identity": model_identity,
        "model_fingerprint": fingerprint,
        "dtype": str(dtype),
        "prompt": str(prompt_fingerprint),
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "conversation": conversation_content(conversation),
        "tokenizer": tokenizer_fingerprint,
        "template_date": template_date,
    }
    if not isinstance(read, str) or read not in READS:
        raise ValueError(f"read must be one of {tuple(READS)}, got {read!r}.")
    if READS[read].keyed:  # "last" adds nothing: keys older than reads stay valid
        payload["read"] = str(read)
    if site_kind is not None:
        if site_kind not in _SITE_KINDS:
            raise ValueError(f"site_kind must be None or one of {tuple(_SITE_KINDS)}, got "
                             f"{site_kind!r}.")
        payload["site_kind"] = _SITE_KINDS[site_kind]
    return hashlib.sha256(_canonical_json(payload).encode("utf-8")).hexdigest()


def _union(entries):
    """Union of several ``(sites, values)`` entries (later entries win), in depth order."""
    columns = {}
    for sites, values in entries:
        for j, s in enumerate(sites):
            columns[s] = values[:, j]
    sites = tuple(sorted(columns, key=site_depth))
    values = np.stack([columns[s] for s in sites], axis=1)
    return sites, np.ascontiguousarray(values, dtype=np.float32)


def _select(sites, values, wanted):
    """Slice ``wanted`` sites out of an entry; ``None`` if any is missing."""
    index = {s: j for j, s in enumerate(sites)}
    try:
        cols = [index[s] for s in wanted]
    except KeyError:
        return None
    if cols == list(range(len(sites))):
        return values
    return values[:, cols]


class MemoryLRU:
    """In-process least-recently-used store bounded by the bytes it holds.

    Parameters
    ----------
    max_bytes : int, default=DEFAULT_MEMORY_BYTES
        Upper bound on the total ``nbytes`` of the stored arrays. An entry larger
        than the bound is not stored. ``0`` disables the store.

    Notes
    -----
    Stored arrays are read-only; :meth:`get` returns views of them, so callers
    copy what they keep. Thread-safe.
    """

    def __init__(self, max_bytes=DEFAULT_MEMORY_BYTES):
        self.max_bytes = int(max_bytes)
        self._data = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self):
        """Total bytes currently held."""
        return self._nbytes

    def __len__(self):
        return len(self._data)

    def __contains__(self, key):
        return key in self._data

    def get_entry(self, key):
        """Return ``(sites, values)`` for ``key`` (marking it recently used) or ``None``."""
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                self._data.move_to_end(key)
            return entry

    def put_entry(self, key, sites, values):
        """Store ``(sites, values)`` under ``key``, evicting least recently used entries."""
        values = np.array(values, dtype=np.float32, copy=True, order="C")
        values.setflags(write=False)
        size = values.nbytes
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._nbytes -= old[1].nbytes
            if size > self.max_bytes:
                return
            self._data[key] = (tuple(sites), values)
            self._nbytes += size
            while self._nbytes > self.max_bytes and self._data:
                _, (_, evicted) = self._data.popitem(last=False)
                self._nbytes -= evicted.nbytes

    def clear(self):
        """Drop every entry."""
        with self._lock:
            self._data.clear()
            self._nbytes = 0


_SHARED = None
_SHARED_LOCK = threading.Lock()


def shared_memory_cache():
    """The process-wide :class:`MemoryLRU` (created on first use, 512 MiB).

    Change its bound with ``shared_memory_cache().max_bytes = n`` and empty it
    with ``shared_memory_cache().clear()``.
    """
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MemoryLRU(DEFAULT_MEMORY_BYTES)
        return _SHARED


def _read_key_file(path, source):
    """The key held by the file ``path`` (whitespace around it stripped)."""
    path = os.path.expanduser(os.fspath(path))
    try:
        data = read_regular_file(path, max_bytes=_MAX_KEY_FILE_BYTES)
    except FileNotFoundError:
        raise ValueError(f"the cache key file {path} ({source}) does not exist.") from None
    except OSError as exc:
        raise ValueError(f"the cache key file {path} ({source}) cannot be read "
                         f"({exc.strerror or type(exc).__name__}).") from None
    except ValueError as exc:
        raise ValueError(f"the cache key file {path} ({source}) was refused: {exc}") from None
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = 0
    if mode & 0o006:
        warnings.warn(f"the cache key file {path} ({source}) can be "
                      f"{'read' if mode & 0o004 else 'written'} by every user of this "
                      f"machine (mode {mode:04o}): whoever can read it can sign cache "
                      f"entries, whoever can write it can choose the key. Make it "
                      f"readable only by the users who share the cache (chmod 600 or 640).",
                      RuntimeWarning, stacklevel=4)
    return data.strip()


def _cache_key(mac_key):
    """``(key bytes or None, where it came from)`` for :class:`ActivationCache`'s ``mac_key``.

    Never puts the key itself in a message.
    """
    if mac_key is False:
        return None, None
    if mac_key is None:
        text = os.environ.get(CACHE_KEY_ENV)
        file = os.environ.get(CACHE_KEY_FILE_ENV)
        if text is not None and file is not None:
            raise ValueError(f"both {CACHE_KEY_ENV} and {CACHE_KEY_FILE_ENV} are set; set "
                             "one of them (the key, or a file that holds it).")
        if text is not None:
            key, source = text.encode("utf-8"), f"the environment variable {CACHE_KEY_ENV}"
        elif file is not None:
            if not file:
                raise ValueError(f"{CACHE_KEY_FILE_ENV} is set but empty; name the file "
                                 "that holds the cache key, or unset it.")
            source = f"named by {CACHE_KEY_FILE_ENV}"
            key = _read_key_file(file, source)
        else:
            return None, None
    elif isinstance(mac_key, (bytes, bytearray, memoryview)):
        key, source = bytes(mac_key), "mac_key"
    elif isinstance(mac_key, os.PathLike):
        source = "mac_key"
        key = _read_key_file(mac_key, source)
    else:  # a str may be the key itself: say its type only
        raise TypeError("mac_key must be bytes (the key), a path-like object such as "
                        "pathlib.Path (a file that holds it), False (no key, whatever "
                        "the environment says) or None (the environment's "
                        f"{CACHE_KEY_ENV} / {CACHE_KEY_FILE_ENV}), got "
                        f"{type(mac_key).__name__}.")
    if len(key) < _MIN_KEY_BYTES:
        raise ValueError(f"the cache key from {source} has {len(key)} bytes; a cache key "
                         f"needs at least {_MIN_KEY_BYTES} (for example the output of "
                         "`python -c 'import secrets; print(secrets.token_hex(32))'`).")
    return key, source


class ActivationCache:
    """Two-level (memory, disk) cache of per-conversation activations.

    Parameters
    ----------
    directory : str or path-like, default=None
        On-disk store; created on first write. ``None``: memory only.
    memory : MemoryLRU, True, False or None, default=True
        ``True``: the process-wide :func:`shared_memory_cache`; a
        :class:`MemoryLRU`: that instance; ``False``/``None``: no memory layer.
    mac_key : bytes, path-like, False or None, default=None
        The cache key of a folder shared between users (or downloaded): every entry
        is written with an HMAC-SHA256 of its header and values under this key, and
        an entry without a valid one is refused (warned about, counted in
        ``stats["unsigned"]``, recomputed and overwritten). ``bytes``: the key (at
        least 16 bytes); a path-like object (e.g. :class:`pathlib.Path`, not a
        ``str``): a file holding it. ``None``: the environment's
        ``SKAFA_CACHE_KEY`` (the key, UTF-8) or ``SKAFA_CACHE_KEY_FILE`` (a file
        holding it), and no key when neither is set. ``False``: no key, whatever the
        environment says. The key is read once, here, and never logged.

    Attributes
    ----------
    stats : dict
        Counters since creation: ``memory_hits``, ``disk_hits``, ``misses``,
        ``corrupt`` (entries rejected by a check), ``unsigned`` (entries refused
        for lack of a valid MAC under the cache key; always 0 without a key),
        ``writes`` (disk files written).

    Examples
    --------
    >>> import numpy as np
    >>> cache = ActivationCache(memory=MemoryLRU(1 << 20))
    >>> cache.put("k" * 64, ["resid_pre.0", "resid_final"], np.zeros((2, 2, 4), np.float32))
    >>> cache.get("k" * 64, ["resid_final"], n_turns=2, hidden_size=4).shape
    (2, 1, 4)
    """

    def __init__(self, directory=None, memory=True, *, mac_key=None):
        self.directory = (None if directory is None
                          else os.path.expanduser(os.fspath(directory)))
        if memory is True:
            memory = shared_memory_cache()
        elif memory is False:
            memory = None
        self.memory = memory
        self._mac_key, _ = _cache_key(mac_key)
        # Entries checked under a key live apart in the (shared) memory layer: an entry
        # another cache of this process read without the key is not trusted here.
        self._memory_tag = ("" if self._mac_key is None else ":mac-" + hmac.new(
            self._mac_key, b"skafa.activations.memory/1", "sha256").hexdigest()[:16])
        self.stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "corrupt": 0,
                      "unsigned": 0, "writes": 0}

    @property
    def signed(self):
        """Whether entries are written with, and read only with, a valid keyed MAC."""
        return self._mac_key is not None

    def __repr__(self):  # never the key
        return (f"{type(self).__name__}(directory={self.directory!r}, "
                f"memory={self.memory is not None}, signed={self.signed})")

    def disk_only(self):
        """A cache of the same folder and key without the memory layer (for workers).

        Returns
        -------
        cache : ActivationCache
            Counting from zero. It carries the key (bytes): a pickled copy sent to a
            worker process verifies and signs as this one does.
        """
        return type(self)(self.directory, memory=False,
                          mac_key=False if self._mac_key is None else self._mac_key)

    def _memory_key(self, key):
        return key + self._memory_tag

    # ------------------------------------------------------------------ paths
    def path(self, key):
        """File that holds (or would hold) ``key`` on disk; ``None`` without a directory."""
        if self.directory is None:
            return None
        return os.path.join(self.directory, key[:2], f"{key}.safetensors")

    # ----------------------------------------------------------------- claims
    def claim(self, key):
        """Mark ``key`` as being extracted by this process, if nobody else has.

        Creates ``<key>.claim`` beside the entry with ``O_CREAT | O_EXCL`` (atomic
        on a local or NFSv3+ file system). Advisory only: it orders work between
        processes sharing the directory and never decides what a result is.

        Parameters
        ----------
        key : str
            From :func:`activation_key`.

        Returns
        -------
        claimed : bool
            ``True``: the claim is this process's (release it with
            :meth:`release`); also ``True`` without a directory, where there is
            nobody to share with. ``False``: another process holds it, or the
            claim could not be written (a read-only directory) — then the caller
            may extract anyway.
        """
        path = self.path(key)
        if path is None:
            return True
        claim = f"{path}.claim"
        try:
            os.makedirs(os.path.dirname(claim), exist_ok=True)
        except OSError:  # not writable here
            return False
        return bool(create_claim(claim))  # held elsewhere, or not writable: False

    def claim_path(self, key):
        """The claim file of ``key`` (see :meth:`claim`); ``None`` without a directory."""
        path = self.path(key)
        return None if path is None else f"{path}.claim"

    def claimed_by_live_process(self, key):
        """Whether a running process of this host, other than this one, claims ``key``.

        :func:`skafa.utils.claims.claim_holder_alive` of the claim file: a claim
        left by a killed process (even one whose pid was reused), one of another
        host, or a file that is not a well-formed claim gives ``False``.

        Parameters
        ----------
        key : str
            From :func:`activation_key`.

        Returns
        -------
        alive : bool
        """
        path = self.claim_path(key)
        return path is not None and claim_holder_alive(path)

    def release(self, key):
        """Remove the claim on ``key``, whoever made it (no error if there is none).

        Extraction calls it once the entry is written, when no claim on ``key``
        means anything any more, so a claim left by a killed process goes too.

        Parameters
        ----------
        key : str
            From :func:`activation_key`.
        """
        path = self.path(key)
        if path is not None:
            try:
                os.remove(f"{path}.claim")
            except OSError:
                pass

    def stat(self, key):
        """Size, modification time and inode of the file for ``key``.

        Cheap (no read, nothing checked; :meth:`get` checks): tells whether another
        process wrote the entry since the last look.

        Parameters
        ----------
        key : str
            From :func:`activation_key`.

        Returns
        -------
        stat : tuple of (int, int, int) or None
            ``(st_size, st_mtime_ns, st_ino)``; ``None`` when there is no file (or no
            directory).
        """
        path = self.path(key)
        if path is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino)

    # ------------------------------------------------------------------- read
    def get(self, key, sites, *, n_turns, hidden_size):
        """Cached activations of ``key`` at ``sites``, or ``None`` (a miss).

        Parameters
        ----------
        key : str
            From :func:`activation_key`.
        sites : sequence of str
            Requested sites; the result has them in this order.
        n_turns, hidden_size : int
            Expected shape; an entry of another shape is rejected as corrupt.

        Returns
        -------
        values : ndarray of float32, shape (n_turns, len(sites), hidden_size) or None
            May be a read-only view; copy before modifying.
        """
        sites = tuple(sites)
        if self.memory is not None:
            entry = self.memory.get_entry(self._memory_key(key))
            if entry is not None:
                out = _select(entry[0], entry[1], sites)
                if out is not None and out.shape[0] == n_turns and out.shape[2] == hidden_size:
                    self.stats["memory_hits"] += 1
                    return out
        entry = self._read_disk(key, n_turns=n_turns, hidden_size=hidden_size)
        if entry is not None:
            out = _select(entry[0], entry[1], sites)
            if self.memory is not None:
                self._put_memory(key, *entry)
            if out is not None:
                self.stats["disk_hits"] += 1
                return out
        self.stats["misses"] += 1
        return None

    def contains(self, key, sites, *, n_turns, hidden_size):
        """Whether :meth:`get` would hit, without counting it in :attr:`stats`."""
        sites = tuple(sites)
        entries = []
        if self.memory is not None:
            entries.append(self.memory.get_entry(self._memory_key(key)))
        if self.directory is not None and not any(
                e is not None and _select(e[0], e[1], sites) is not None for e in entries):
            entries.append(self._peek_disk(key, n_turns, hidden_size))
        return any(e is not None and e[1].shape[0] == n_turns and e[1].shape[2] == hidden_size
                   and _select(e[0], e[1], sites) is not None for e in entries)

    def _read_disk(self, key, *, n_turns, hidden_size):
        path = self.path(key)
        if path is None or not os.path.exists(path):
            return None
        try:
            return _read_entry(path, key, n_turns=n_turns, hidden_size=hidden_size,
                               mac_key=self._mac_key)
        except _Unsigned as exc:
            self.stats["unsigned"] += 1
            warnings.warn(
                f"Ignoring activation cache entry {path}: {exc}. It will be recomputed "
                "and overwritten (signed with the cache key).",
                CacheCorruptionWarning,
                stacklevel=3,
            )
            return None
        except Exception as exc:  # noqa: BLE001 - any failure means "do not use it"
            # ...but a stop request (SIGTERM, Ctrl-C) that surfaced as this error stops
            raise_if_stop_requested(f"reading the activation cache entry {path}", cause=exc)
            self.stats["corrupt"] += 1
            warnings.warn(
                f"Ignoring corrupt activation cache entry {path}: {exc}. "
                "It will be recomputed and overwritten.",
                CacheCorruptionWarning,
                stacklevel=3,
            )
            return None

    # ------------------------------------------------------------------ write
    def put(self, key, sites, values, *, disk=True):
        """Store activations of ``key`` at ``sites``.

        Sites already cached for ``key`` and not in ``sites`` are kept (merged).

        Parameters
        ----------
        key : str
        sites : sequence of str
        values : array of shape (n_turns, len(sites), hidden_size)
        disk : bool, default=True
            Also write the disk layer. ``False`` updates the memory layer only
            (used when another process, e.g. a joblib worker, wrote the file).
        """
        sites = tuple(sites)
        values = np.asarray(values, dtype=np.float32)
        if values.ndim != 3 or values.shape[1] != len(sites):
            raise ValueError(
                f"values must have shape (n_turns, {len(sites)}, hidden_size), got "
                f"{values.shape}."
            )
        n_turns, _, hidden = values.shape
        # Keep sites cached earlier for this key that were not recomputed now.
        entries = []
        disk = disk and self.directory is not None
        if disk:
            entries.append(self._peek_disk(key, n_turns, hidden))
        if self.memory is not None:
            entries.append(self.memory.get_entry(self._memory_key(key)))
        entries = [e for e in entries
                   if e is not None and e[1].shape[0] == n_turns and e[1].shape[2] == hidden]
        merged_sites, merged = _union(entries + [(sites, values)])
        if self.memory is not None:
            self._put_memory(key, merged_sites, merged)
        if disk:
            try:
                _write_entry(self.path(key), key, merged_sites, merged, mac_key=self._mac_key)
            except OSError as exc:  # a full or read-only disk must not stop extraction
                warnings.warn(f"Could not write activation cache entry {self.path(key)}: "
                              f"{exc}. Continuing without it.", RuntimeWarning, stacklevel=2)
            else:
                self.stats["writes"] += 1

    def _peek_disk(self, key, n_turns, hidden):
        path = self.path(key)
        if path is None or not os.path.exists(path):
            return None
        try:
            return _read_entry(path, key, n_turns=n_turns, hidden_size=hidden,
                               mac_key=self._mac_key)
        except Exception as exc:  # noqa: BLE001 - a corrupt or unsigned entry is overwritten
            raise_if_stop_requested(f"reading the activation cache entry {path}", cause=exc)
            return None

    def _put_memory(self, key, sites, values):
        self.memory.put_entry(self._memory_key(key), sites, values)

    def clear_memory(self):
        """Empty the memory layer (shared by default: affects every user of it)."""
        if self.memory is not None:
            self.memory.clear()


# ------------------------------------------------------------------- file format
def _crc(values):
    return f"{zlib.crc32(memoryview(np.ascontiguousarray(values)).cast('B')) & 0xFFFFFFFF:08x}"


class _Unsigned(ValueError):
    """An entry without a valid MAC under the cache key."""


def _entry_mac(mac_key, tensors, metadata):
    """HMAC-SHA256 (hex) of an entry's header (less its digest and MAC) and tensors."""
    h = hmac.new(mac_key, _MAC_DOMAIN, "sha256")
    meta = {k: v for k, v in metadata.items() if k not in (DIGEST_KEY, MAC_KEY)}
    h.update(json.dumps(meta, sort_keys=True, ensure_ascii=True).encode("utf-8"))
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(b"\0" + json.dumps([name, arr.dtype.str, list(arr.shape)]).encode("utf-8"))
        h.update(memoryview(arr).cast("B") if arr.size else b"")
    return h.hexdigest()


def _write_entry(path, key, sites, values, mac_key=None):
    values = np.ascontiguousarray(values, dtype=np.float32)
    metadata = {
        "format": _FORMAT,
        "key": key,
        "sites": json.dumps(list(sites)),
        "shape": json.dumps(list(values.shape)),
        "crc32": _crc(values),
    }
    if mac_key is not None:
        metadata[MAC_KEY] = _entry_mac(mac_key, {_TENSOR: values}, metadata)
    write_safetensors(path, {_TENSOR: values}, metadata)


def _read_entry(path, key, *, n_turns, hidden_size, mac_key=None):
    """Read and check one entry; raise ValueError describing any problem.

    The SHA-256 digest of :func:`~skafa.utils.fileio.read_safetensors` covers the
    header (key, site names, shape) and the values, so an entry whose site names
    were reordered is refused although its values' CRC still matches. Entries
    written before digests existed have none and are refused too (a miss: they are
    recomputed and overwritten). With ``mac_key``, the entry's keyed MAC is checked
    before anything else of it is read (:class:`_Unsigned` when it is missing or
    wrong), in constant time.
    """
    tensors, metadata = read_safetensors(path, require_digest=True, follow_symlinks=False)
    if mac_key is not None:
        stored = metadata.get(MAC_KEY)
        if stored is None:
            raise _Unsigned("it has no MAC (it was written without the cache key)")
        if not hmac.compare_digest(str(stored).encode("utf-8", "replace"),
                                   _entry_mac(mac_key, tensors, metadata).encode("ascii")):
            raise _Unsigned("its MAC does not match the cache key (written with another "
                            "key, or changed by someone who does not hold this one)")
    if metadata.get("format") != _FORMAT:
        raise ValueError(f"format {metadata.get('format')!r}, expected {_FORMAT!r}")
    if metadata.get("key") != key:
        raise ValueError("the key stored in the file does not match its name")
    names = sorted(tensors)
    if names != [_TENSOR]:
        raise ValueError(f"tensors {names}, expected [{_TENSOR!r}]")
    values = tensors[_TENSOR]
    sites = json_field(metadata, "sites")
    if (not isinstance(sites, list) or not sites or not all(isinstance(s, str) for s in sites)
            or len(set(sites)) != len(sites)):
        raise ValueError("invalid site list")
    for s in sites:
        site_depth(s)  # raises on an unknown site name
    if values.dtype != np.float32:
        raise ValueError(f"dtype {values.dtype}, expected float32")
    expected = (n_turns, len(sites), hidden_size)
    if values.shape != expected or list(values.shape) != json_field(metadata, "shape"):
        raise ValueError(f"shape {values.shape}, expected {expected}")
    if _crc(values) != metadata.get("crc32"):
        raise ValueError("CRC-32 mismatch (data changed after writing)")
    if not np.isfinite(values).all():
        raise ValueError("non-finite values")
    values.setflags(write=False)
    return tuple(sites), values
