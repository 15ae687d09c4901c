"""The one way skafa writes and reads its safetensors files: atomic and checksummed.

Every file skafa writes (:meth:`TurnFeatures.save <skafa.TurnFeatures.save>`, activation
cache entries, saved estimators) goes through :func:`atomic_write_bytes`: the bytes are
written to a temporary file in the destination folder, flushed, ``fsync``-ed and
renamed over the final name, so a reader never sees a half-written file, even with
concurrent writers.

:func:`write_safetensors` adds a SHA-256 digest of the metadata (the JSON header) *and*
of every tensor's name, dtype, shape and bytes; :func:`read_safetensors` recomputes it
before anything is returned, so a flipped byte, a truncated file or a reordered header
field is an error, not silently wrong data.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile

import numpy as np

__all__ = ["atomic_write_bytes", "write_safetensors", "read_safetensors", "json_field",
           "read_regular_file", "read_json_file", "DIGEST_KEY"]

#: Metadata key holding the SHA-256 digest of the rest of the file.
DIGEST_KEY = "skafa_sha256"


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename).

    Parameters
    ----------
    path : str or path-like
        Destination; its folder is created when missing.
    data : bytes
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename durable; best effort (not possible on every platform)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def read_regular_file(path, *, max_bytes=None, follow_symlinks=True) -> bytes:
    """Read a whole *regular* file, bounded by its size: the one way skafa reads a file back.

    Every reader of a file that might come from someone else (saved estimators,
    :class:`~skafa.TurnFeatures` files, activation cache entries) uses this
    function, so none of them can be made to read without end: a symlink to
    ``/dev/zero`` or ``/dev/urandom``, a FIFO or a device is refused before a
    byte is read (``fstat`` of the opened descriptor, so the check and the read
    see the same file), the size is checked against ``max_bytes`` first, and at
    most the size found is read.

    Parameters
    ----------
    path : str or path-like
    max_bytes : int, default=None
        Refuse a larger file. ``None``: the file's own size is the only bound.
    follow_symlinks : bool, default=True
        With ``False``, a symlink as the last component of ``path`` is refused
        (``O_NOFOLLOW``); for files only skafa writes, such as cache entries.

    Returns
    -------
    bytes

    Raises
    ------
    FileNotFoundError
        When ``path`` does not exist.
    ValueError
        When ``path`` is not a regular file (a device, FIFO, socket or folder,
        or a symlink with ``follow_symlinks=False``), is larger than
        ``max_bytes``, or changes size while it is read.
    """
    path = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink under O_NOFOLLOW; EACCES, EISDIR...
        kind = "a symbolic link" if os.path.islink(path) and not follow_symlinks else None
        raise ValueError(f"{path}: cannot be read as a regular file "
                         f"({kind or exc.strerror or exc}).") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file (a device, FIFO, socket or "
                             "folder, perhaps behind a symbolic link); refusing to read it.")
        size = info.st_size
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"{path}: {size} bytes, more than the {max_bytes} bytes "
                             "accepted for this kind of file.")
        chunks, remaining = [], size
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 26))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        if remaining or os.read(fd, 1):
            raise ValueError(f"{path}: the file changed size while it was read "
                             f"({size} bytes announced).")
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_json_file(path, *, max_bytes, where=None):
    """Read a JSON file someone else may have written: regular, bounded, strict JSON.

    The file is read with :func:`read_regular_file` (regular files only, at most
    ``max_bytes``); ``NaN``, ``Infinity`` and ``-Infinity``, which Python's
    :mod:`json` accepts but JSON does not, are refused, as are text that is not
    UTF-8 and nesting too deep to parse.

    Parameters
    ----------
    path : str or path-like
    max_bytes : int
        A larger file is refused before it is read.
    where : str, optional
        Names the file in messages (default ``"file '<path>'"``).

    Returns
    -------
    object
        The parsed document.

    Raises
    ------
    ValueError
        Naming the file and what is wrong with it.
    """
    where = where or f"file {str(path)!r}"

    def no_constant(name):
        raise ValueError(f"{where}: holds {name}, which is not valid JSON.")

    try:
        raw = read_regular_file(path, max_bytes=max_bytes)
    except OSError as exc:
        raise ValueError(f"{where}: cannot be read ({exc}).") from None
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: is not UTF-8 text ({exc.reason}).") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: is not valid JSON ({exc.msg} at line {exc.lineno}, "
                         f"column {exc.colno}).") from None
    except RecursionError:
        raise ValueError(f"{where}: is nested too deeply.") from None


def _digest(tensors, metadata) -> str:
    h = hashlib.sha256()
    meta = {k: v for k, v in metadata.items() if k != DIGEST_KEY}
    h.update(json.dumps(meta, sort_keys=True, ensure_ascii=True).encode("utf-8"))
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(json.dumps([name, arr.dtype.str, list(arr.shape)]).encode("utf-8"))
        h.update(memoryview(arr).cast("B") if arr.size else b"")
    return h.hexdigest()


def write_safetensors(path, tensors: dict, metadata: dict) -> None:
    """Write tensors and string metadata as one checksummed safetensors file.

    Parameters
    ----------
    path : str or path-like
    tensors : dict of str to ndarray
        Numeric arrays (safetensors dtypes).
    metadata : dict of str to str
        Stored in the header; a SHA-256 digest of metadata and tensors is added
        under :data:`DIGEST_KEY`.
    """
    from safetensors.numpy import save

    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    metadata = {str(k): str(v) for k, v in metadata.items()}
    metadata[DIGEST_KEY] = _digest(tensors, metadata)
    atomic_write_bytes(path, save(tensors, metadata=metadata))


def read_safetensors(path, *, require_digest=True, follow_symlinks=True):
    """Read a file written by :func:`write_safetensors`, verifying its digest.

    Parameters
    ----------
    path : str or path-like
    require_digest : bool, default=True
        Refuse a file without a digest (set False only to read files written
        before digests existed).
    follow_symlinks : bool, default=True
        Passed to :func:`read_regular_file` (which reads the file: regular
        files only, at most their size).

    Returns
    -------
    tensors : dict of str to ndarray
    metadata : dict of str to str

    Raises
    ------
    ValueError
        When the file is not a regular file, cannot be parsed, or its digest
        is missing or wrong.
    """
    from safetensors.numpy import load

    path = os.fspath(path)
    blob = read_regular_file(path, follow_symlinks=follow_symlinks)
    try:
        tensors = load(blob)  # validates offsets and sizes against the blob
        header_len = int.from_bytes(blob[:8], "little")
        metadata = json.loads(blob[8:8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path}: not a readable safetensors file ({exc}).") from None
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{path}: the safetensors metadata is not a str -> str map.")
    stored = metadata.get(DIGEST_KEY)
    if stored is None:
        if require_digest:
            raise ValueError(f"{path}: the file has no {DIGEST_KEY} digest; it was not "
                             "written by this version of skafa or was edited.")
    elif stored != _digest(tensors, metadata):
        raise ValueError(f"{path}: SHA-256 digest mismatch: the file was changed after it "
                         "was written (flipped bytes, edited header or truncation).")
    return tensors, dict(metadata)


def json_field(metadata, key):
    """Parse the JSON text held by ``metadata[key]``; any problem is a ``ValueError``.

    A header is untrusted input: a missing field, invalid JSON and JSON nested too
    deeply to parse (``"[" * 100_000``, which makes :func:`json.loads` raise
    ``RecursionError``) all become a ``ValueError`` naming the field.

    Parameters
    ----------
    metadata : dict of str to str
    key : str

    Returns
    -------
    object
        The parsed value.
    """
    if key not in metadata:
        raise ValueError(f"the header has no {key!r} field")
    text = metadata[key]
    if not isinstance(text, str):
        raise ValueError(f"header field {key!r} is not text")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"header field {key!r} is nested too deeply to be valid JSON "
                         "written by skafa") from None
    except ValueError as exc:
        raise ValueError(f"header field {key!r} is not valid JSON ({exc})") from None
