"""Result files of nested comparisons: resumable stores and a validated reader.

Everything here is JSON (no pickle), written atomically through
:func:`skafa.utils.fileio.atomic_write_bytes` and checked when read back, so a
killed run resumes from what it finished and a damaged or foreign file is an
error that names the file, never silently wrong numbers.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..utils.fileio import atomic_write_bytes, read_regular_file

__all__ = ["FoldResultStore", "JudgeScoreStore", "ResultStoreError", "read_json",
           "read_result", "result_dtype", "write_json"]


class ResultStoreError(ValueError):
    """A stored result file does not fit the run that reads it (named in the message)."""


def write_json(path, obj, *, indent=None):
    """Write ``obj`` as JSON to ``path`` atomically (temp file, fsync, rename)."""
    atomic_write_bytes(path, json.dumps(obj, indent=indent, default=str).encode("utf-8"))


def read_json(path):
    """Read a JSON file skafa wrote (a regular file); invalid JSON: :class:`ResultStoreError`."""
    try:
        return json.loads(read_regular_file(path).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultStoreError(f"{path} is not valid JSON ({exc}); remove it.") from None


def _canonical(obj):
    """``obj`` as it reads back from JSON (tuples become lists, numbers stay)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _stored_entries(path, signature, kind, other):
    """The ``entries`` of a store file with this ``signature`` (``{}`` without a file)."""
    if not path.exists():
        return {}
    old = read_json(path)
    if not isinstance(old, dict) or not isinstance(old.get("entries"), dict):
        raise ResultStoreError(f"{path} is not {kind}; remove it.")
    if _canonical(old.get("signature")) != signature:
        raise ResultStoreError(f"{path} {other}; remove it.")
    return old["entries"]


class FoldResultStore:
    """Finished outer fits of a nested comparison on disk, so a killed run resumes.

    One JSON file holds a ``signature`` (every setting the results depend on) and,
    per outer fit ``"<repeat>|<fold>"``, each method's test predictions, inner
    score and choices. It is rewritten atomically after each :meth:`put`, which
    first reads the file again, so fits another process added meanwhile are kept;
    several processes may fill different files at the same time.

    Parameters
    ----------
    path : str or path-like
        The store's file; read when it exists.
    signature : dict
        JSON-serializable settings; a file written with another signature is
        refused (:class:`ResultStoreError`), never mixed in.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> path = tempfile.mkdtemp() + "/store.json"
    >>> store = FoldResultStore(path, {"folds": 2})
    >>> store.put(0, 1, {"probe": (np.array([2, 0]), 0.5, {"C": 0.1})})
    >>> FoldResultStore(path, {"folds": 2}).get(0, 1)["probe"][0].tolist()
    [2, 0]
    """

    def __init__(self, path, signature):
        self.path, self.signature = Path(path), _canonical(signature)
        self.entries = self._read()

    def _read(self):
        """The file's entries, checked (``{}`` when there is no file yet)."""
        entries = _stored_entries(self.path, self.signature, "a fold result store",
                                  "was written with other settings "
                                  "(model, prompt, sites, folds or records)")
        for key, fits in entries.items():
            if not re.fullmatch(r"\d+\|\d+", key) or not isinstance(fits, dict):
                raise ResultStoreError(f"{self.path}: bad entry {key!r}; remove it.")
            for name, v in fits.items():
                if not isinstance(v, dict) or not {"pred", "score", "info"} <= set(v):
                    raise ResultStoreError(
                        f"{self.path}: the stored fit {name!r} of {key} lacks "
                        "pred/score/info; remove it.")
        return entries

    def refresh(self):
        """Read the file again: fits another process stored meanwhile are added.

        A fit this store holds and the file lacks is kept; for a fit both hold,
        the file's wins (it is the latest write). :meth:`put` refreshes before it
        writes, so two processes filling the same file do not erase each other's
        fits (a write that lands between another's read and rename still can:
        the store is not a lock).

        Returns
        -------
        self : FoldResultStore
        """
        for key, fits in self._read().items():
            self.entries.setdefault(key, {}).update(fits)
        return self

    def get(self, repeat, fold):
        """``{method: (predictions, inner score, info)}`` stored for one outer fit."""
        got = self.entries.get(f"{repeat}|{fold}", {})
        return {n: (np.asarray(v["pred"], dtype=np.int64), v["score"], v["info"])
                for n, v in got.items()}

    def check(self, repeat, fold, n_test):
        """Refuse stored predictions that are not ``n_test`` valid steps."""
        for n, (p, *_) in self.get(repeat, fold).items():
            if p.shape != (n_test,) or p.min(initial=0) < 0:
                raise ResultStoreError(
                    f"{self.path}: the stored fit {n!r} of repeat {repeat} fold {fold} "
                    f"has {p.shape} predictions for {n_test} test runs; remove the file.")

    def put(self, repeat, fold, out):
        """Add ``{method: (predictions, inner score, info)}`` of one outer fit; write.

        The file is read again first (:meth:`refresh`), so fits another process
        stored in it meanwhile are kept.
        """
        self.refresh()
        entry = self.entries.setdefault(f"{repeat}|{fold}", {})
        for n, (pred, score, info) in out.items():
            entry[n] = {"pred": np.asarray(pred).astype(int).tolist(), "score": score,
                        "info": info}
        write_json(self.path, {"signature": self.signature, "entries": self.entries})


class JudgeScoreStore:
    """A judge's per-turn scores of finished conversations, in one small JSON file.

    The counterpart of :class:`FoldResultStore` for a model that fits nothing (the
    prompted judge): it sits with the results, so a judge run one session could not
    finish goes on in the next. Each record's entry names the digest of the
    conversation it scored; a record whose content changed is refused rather than
    reused. Rewritten atomically after each conversation.

    Parameters
    ----------
    path : str or path-like
        The store's file; read when it exists.
    signature : dict
        Model, dtype, prompt and answer prefix; another signature is refused.
    """

    def __init__(self, path, signature):
        self.path = Path(path)
        self.signature = _canonical(signature)
        self.entries = _stored_entries(self.path, self.signature, "a judge score store",
                                       "holds judge scores of other settings "
                                       "(model, dtype, prompt or answer prefix)")

    def get(self, record_id, digest, n_turns):
        """The stored scores of ``record_id``, or None; refused if they do not fit it."""
        entry = self.entries.get(str(record_id))
        if entry is None:
            return None
        if entry.get("digest") != digest or len(entry.get("scores", ())) != n_turns:
            raise ResultStoreError(
                f"{self.path}: the stored judge scores of {record_id} are of "
                f"another conversation (digest {entry.get('digest')}, "
                f"{len(entry.get('scores', ()))} turns; now {digest}, "
                f"{n_turns} turns); remove the file.")
        return np.asarray(entry["scores"], dtype=np.float64)

    def put(self, record_id, digest, scores):
        """Store one conversation's scores and rewrite the file."""
        self.entries[str(record_id)] = {"digest": digest,
                                        "scores": np.asarray(scores, dtype=float).tolist()}
        write_json(self.path, {"signature": self.signature, "entries": self.entries})


def read_result(path):
    """Read a comparison's result file (``<tag>_<subset>.json``), checked.

    Every result file written since the first benchmark is readable, including
    those older files that lack the per-conversation predictions. Checked: a
    ``summary`` of per-method metrics with ``step_accuracy`` estimates in [0, 1];
    where present, ``predictions`` of shape (repeats, n) per method, equal in
    length to ``y_true``, ``record_ids`` and ``task_ids``.

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    result : dict
        The file's content.

    Raises
    ------
    ResultStoreError
        Naming the file and what does not fit.
    """
    result = read_json(path)
    if not isinstance(result, dict) or not isinstance(result.get("summary"), dict):
        raise ResultStoreError(f"{path}: not a comparison result (no 'summary').")
    for name, row in result["summary"].items():
        if name.startswith("_") or not isinstance(row, dict) or "step_accuracy" not in row:
            continue
        est = row["step_accuracy"].get("estimate") if isinstance(row["step_accuracy"], dict) \
            else row["step_accuracy"]
        if not isinstance(est, (int, float)) or not 0.0 <= est <= 1.0:
            raise ResultStoreError(f"{path}: step accuracy of {name!r} is {est!r}.")
    n = None
    for key in ("y_true", "record_ids", "task_ids"):
        if key in result:
            if n is not None and len(result[key]) != n:
                raise ResultStoreError(f"{path}: {key} has {len(result[key])} entries, "
                                       f"not {n}.")
            n = len(result[key])
    for name, P in result.get("predictions", {}).items():
        try:
            P = np.asarray(P)
        except ValueError:  # ragged
            P = np.asarray([], dtype=object)
        if P.ndim != 2 or (n is not None and P.shape[1] != n) or \
                not np.issubdtype(P.dtype, np.integer):
            raise ResultStoreError(f"{path}: predictions of {name!r} have shape {P.shape}"
                                   f" (dtype {P.dtype}), not (repeats, {n}) steps.")
    return result


def result_dtype(result):
    """The model dtype of a result: its ``dtype``, else its command's ``--dtype``.

    Files written before results named the dtype hold it only in their command
    line, where its absence means the default, float32.

    Examples
    --------
    >>> result_dtype({"command": "python x.py --dtype bfloat16"})
    'bfloat16'
    >>> result_dtype({"command": "python x.py"})
    'float32'
    """
    if "dtype" in result:
        return str(result["dtype"])
    found = re.search(r"--dtype[ =](\S+)", str(result.get("command", "")))
    return found.group(1) if found else "float32"
