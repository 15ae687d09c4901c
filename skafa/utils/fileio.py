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
import tempfile

import numpy as np

__all__ = ["atomic_write_bytes", "write_safetensors", "read_safetensors", "json_field",
           "DIGEST_KEY"]

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


def read_safetensors(path, *, require_digest=True):
    """Read a file written by :func:`write_safetensors`, verifying its digest.

    Parameters
    ----------
    path : str or path-like
    require_digest : bool, default=True
        Refuse a file without a digest (set False only to read files written
        before digests existed).

    Returns
    -------
    tensors : dict of str to ndarray
    metadata : dict of str to str

    Raises
    ------
    ValueError
        When the file cannot be parsed, or its digest is missing or wrong.
    """
    from safetensors.numpy import load

    path = os.fspath(path)
    with open(path, "rb") as f:
        blob = f.read()
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
