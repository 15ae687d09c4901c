"""Loaders for the Who&When failure-attribution benchmark, in scikit-learn's style.

* :func:`load_who_and_when` reads a local copy (the public repository's layout, one
  subset folder, or one JSON file holding a list of records) into a
  :class:`~sklearn.utils.Bunch` of :class:`~skafa.Conversation` objects.
* :func:`fetch_who_and_when` downloads the public dataset once into the data home
  (:func:`get_data_home`) and then loads it.
* :func:`who_and_when_path` says where ``load_who_and_when()`` looks by default.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import urllib.request
import warnings
import zipfile
from pathlib import Path, PurePosixPath

import numpy as np
from sklearn.utils import Bunch

from ..conversation import Conversation
from ..exceptions import ConversationError
from ..utils.fileio import read_regular_file
from ..utils.progress import say

__all__ = [
    "SUBSETS",
    "WHO_AND_WHEN_URL",
    "fetch_who_and_when",
    "get_data_home",
    "load_who_and_when",
    "who_and_when_path",
]

#: The two subsets of Who&When, in the order records are returned.
SUBSETS = ("Algorithm-Generated", "Hand-Crafted")

#: Zip archive of the default branch of the public repository (folder ``Who&When``).
WHO_AND_WHEN_URL = "https://github.com/mingyin1/Agents_Failure_Attribution/archive/HEAD.zip"

_ARCHIVE_FOLDER = "Who&When"
_DEFAULT_FOLDER = "who_and_when"
_ALIASES = {
    "algorithm-generated": "Algorithm-Generated",
    "algorithm_generated": "Algorithm-Generated",
    "algorithm": "Algorithm-Generated",
    "hand-crafted": "Hand-Crafted",
    "hand_crafted": "Hand-Crafted",
    "hand": "Hand-Crafted",
}

_DESCR = """\
.. _who_and_when_dataset:

Who&When failure-attribution benchmark
--------------------------------------

Failed runs of LLM multi-agent systems, each annotated with the decisive step (the
0-based index of the turn whose error caused the failure) and the responsible agent.
From Zhang et al., "Which Agent Causes Task Failures and When? On Automated Failure
Attribution of LLM Multi-Agent Systems", ICML 2025
(https://github.com/mingyin1/Agents_Failure_Attribution, MIT licence).

Subsets:

- Algorithm-Generated (126 records in the full release): CaptainAgent/AG2 teams; the
  speaker of a turn is its ``name`` (e.g. ``Excel_Expert``, ``Computer_terminal``).
- Hand-Crafted (58 records in the full release): Magentic-One; turns have no ``name``
  and the speaker is ``role`` (e.g. ``Orchestrator (thought)``, ``WebSurfer``).

Fields of the returned Bunch (one entry per record, in order of subset, then numeric
record id):

- conversations : list of skafa.Conversation
- mistake_steps : int array, the decisive turn of each conversation (the label ``y``);
  -1 for an unlabelled record (``mistake_step`` null or absent: runs of your own)
- mistake_agents : object array, the annotated responsible agent (None when
  unlabelled). It usually, but not
  always, equals the speaker of the decisive turn (a record may name ``Orchestrator``
  for a turn spoken as ``Orchestrator (-> WebSurfer)``); see
  skafa.metrics.agent_accuracy for the matching rules.
- task_ids : object array, the task (``question_ID``). One task can appear in several
  records and in both subsets: use it as ``groups`` of a grouped splitter.
- record_ids : object array, e.g. ``"Algorithm-Generated/12"``
- subsets : object array, the subset of each record
- skipped : list of (file, reason) for malformed records skipped with strict=False
"""


# ------------------------------------------------------------------- locations
def get_data_home(data_home=None) -> Path:
    """Return the folder where skafa keeps downloaded datasets, creating it.

    Parameters
    ----------
    data_home : str or path-like, optional
        The folder to use. By default the environment variable ``SKAFA_DATA``, or
        ``~/skafa_data`` when it is unset.

    Returns
    -------
    data_home : pathlib.Path
        The (existing) data folder.
    """
    if data_home is None:
        data_home = os.environ.get("SKAFA_DATA") or os.path.join("~", "skafa_data")
    path = Path(data_home).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def who_and_when_path() -> Path:
    """Where :func:`load_who_and_when` looks when ``path`` is not given.

    The environment variable ``SKAFA_WHO_AND_WHEN`` when set, else
    ``<data home>/who_and_when`` (the folder :func:`fetch_who_and_when` fills; the
    data home is ``SKAFA_DATA`` or ``~/skafa_data``). The folder may not exist.

    Returns
    -------
    path : pathlib.Path
    """
    env = os.environ.get("SKAFA_WHO_AND_WHEN")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("SKAFA_DATA") or os.path.join("~", "skafa_data")
    return Path(home).expanduser() / _DEFAULT_FOLDER


def _canonical_subset(subset):
    """Map ``subset`` (or an alias) to its canonical name; ``None`` stays ``None``."""
    if subset is None:
        return None
    if not isinstance(subset, str):
        raise TypeError(f"subset must be a string or None, got {type(subset).__name__}.")
    name = _ALIASES.get(subset.strip().casefold())
    if name is None:
        raise ValueError(
            f"unknown subset {subset!r}; use None (both), {SUBSETS[0]!r} (alias "
            f"'algorithm') or {SUBSETS[1]!r} (alias 'hand')."
        )
    return name


def _subset_of_name(name: str) -> str:
    """Canonical subset for a folder/file name when it is one, else the name itself."""
    return _ALIASES.get(name.strip().casefold(), name)


def _record_sort_key(path: Path):
    stem = path.stem
    return (0, int(stem), "") if stem.isdigit() else (1, 0, stem)


def _json_files(folder: Path) -> list:
    files = [
        p for p in folder.iterdir()
        if p.suffix.lower() == ".json" and p.is_file() and not p.name.startswith(".")
    ]
    return sorted(files, key=_record_sort_key)


# --------------------------------------------------------------------- loading
#: Integers of more digits than this are refused (Python's int() refuses past 4,300).
_MAX_INT_DIGITS = 4000


class _Refused:
    """Stands, in parsed JSON, for a value a record may not hold (NaN, a huge integer).

    The parser keeps going, so the error can name the field where it stood
    (``history[3].content``) rather than only the file.
    """

    __slots__ = ("what",)

    def __init__(self, what):
        self.what = what

    def __repr__(self):
        return self.what


def _parsers(refused):
    """``parse_constant``, ``parse_int`` and ``parse_float`` for :func:`json.loads`.

    Each returns a :class:`_Refused` placeholder, appended to ``refused``, for a
    value a record may not hold: NaN, Infinity, an integer of more than
    ``_MAX_INT_DIGITS`` digits, a number that overflows a float (``1e999``).
    """

    def parse_constant(name):  # "NaN", "Infinity" or "-Infinity"
        refused.append(_Refused(name))
        return refused[-1]

    def parse_int(text):
        digits = len(text.lstrip("-"))
        if digits > _MAX_INT_DIGITS:
            refused.append(_Refused(f"an integer of {digits} digits"))
            return refused[-1]
        return int(text)

    def parse_float(text):  # 1e999 is a JSON number, but it reads as inf
        value = float(text)
        if not math.isfinite(value):
            shown = text if len(text) <= 40 else text[:40] + "..."
            refused.append(_Refused(f"{shown} (a number too large for a float)"))
            return refused[-1]
        return value

    return parse_constant, parse_int, parse_float


def _field_path(parts):
    """``("history", 3, "content")`` -> ``"history[3].content"``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _find_refused(value):
    """(path, _Refused) of the first refused value inside ``value``, or None.

    Iterative (no recursion limit): parsed JSON is as deep as the parser allowed.
    """
    stack = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, _Refused):
            return path, item
        if isinstance(item, dict):
            children = [(path + (k,), v) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(path + (i,), v) for i, v in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))  # depth first, in document order
    return None


def _check_record_values(record, where, record_id, refused=True):
    """Raise naming ``where``, the record and the field when ``record`` holds a refused value.

    A record's ``mistake_step`` of ``NaN``, a turn's ``content`` of ``Infinity`` or a
    5,000-digit ``question_ID`` is valid JavaScript but not JSON; the error names the
    field path, e.g. ``history[3].content``. With ``refused=False`` (the parser
    made no placeholder) there is nothing to look for.
    """
    found = _find_refused(record) if refused else None
    if found is None:
        return
    path, value = found
    name = _field_path(path)
    name = name if len(name) <= 200 else name[:200] + "..."
    field = f"field {name!r}" if path else "the record"
    raise ConversationError(
        f"{where}: record {record_id!r}: {field} is {value!r}, which a record cannot hold "
        "(NaN and Infinity are not JSON, and are refused rather than read as numbers; a "
        f"record holds text and finite numbers, integers of at most {_MAX_INT_DIGITS} "
        "digits).")


def _read_json(file: Path):
    """One JSON file as ``(data, refused)``; anything wrong with it is a ConversationError.

    Regular files only, read at most their size (:func:`read_regular_file`);
    nesting too deep to parse is refused naming the file, never raised as a bare
    ``ValueError`` or ``RecursionError`` that ``strict=False`` cannot skip.
    ``NaN``/``Infinity``, integers of more than 4,000 digits and numbers that
    overflow a float (``1e999``) are parsed into placeholders that :func:`_check_record_values` refuses naming the record and
    the field; ``refused`` says whether there is any.
    """
    try:
        raw = read_regular_file(file)
    except ValueError as exc:  # a device, FIFO or folder behind the name
        raise ConversationError(str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConversationError(f"{file}: not UTF-8 text ({exc}).") from None
    refused = []
    parse_constant, parse_int, parse_float = _parsers(refused)
    try:
        return json.loads(text, parse_constant=parse_constant, parse_int=parse_int,
                          parse_float=parse_float), bool(refused)
    except json.JSONDecodeError as exc:
        raise ConversationError(f"{file}: not valid JSON ({exc}).") from None
    except RecursionError:
        raise ConversationError(f"{file}: not valid JSON (nested too deeply).") from None
    except ValueError as exc:  # anything else the parser refuses
        raise ConversationError(f"{file}: not valid JSON ({str(exc)[:200]}).") from None


def _plan(path: Path, subset):
    """Return a list of (subset_name, source) where source is a folder or a JSON file."""
    if path.is_file():
        file_subset = _subset_of_name(path.stem)
        if subset is not None and file_subset != subset:
            raise ValueError(
                f"{path} is a single file (subset {file_subset!r}); subset={subset!r} "
                "cannot be selected from it. Pass subset=None."
            )
        return [(file_subset, path)]
    if not path.is_dir():
        raise FileNotFoundError(
            f"Who&When data not found at {path}. Pass the folder holding "
            f"{SUBSETS[0]}/ and {SUBSETS[1]}/ (or one subset folder, or a JSON file), set "
            "the environment variable SKAFA_WHO_AND_WHEN, or download it with "
            "skafa.datasets.fetch_who_and_when()."
        )
    present = [s for s in SUBSETS if (path / s).is_dir()]
    if present:
        if subset is not None:
            if subset not in present:
                raise FileNotFoundError(
                    f"subset {subset!r} not found in {path} (it holds {present})."
                )
            return [(subset, path / subset)]
        return [(s, path / s) for s in present]
    # A single subset folder (or any folder of per-record JSON files).
    folder_subset = _subset_of_name(path.name)
    if subset is not None and folder_subset != subset:
        raise FileNotFoundError(
            f"{path} holds neither {SUBSETS[0]}/ nor {SUBSETS[1]}/ and is not the "
            f"{subset!r} folder itself."
        )
    return [(folder_subset, path)]


def _naming_record(exc, prefix, record_id):
    """``exc`` with ``record '<id>': `` after its ``prefix`` (the file) when it lacks it."""
    text = str(exc)
    if text.startswith(prefix) and not text.startswith(prefix + "record "):
        return ConversationError(f"{prefix}record {record_id!r}: {text[len(prefix):]}")
    return exc


def _records_of(subset_name, source: Path):
    """Yield (record_id, where, record_or_exception) for one folder or list file."""
    if source.is_dir():
        files = _json_files(source)
        if not files:
            raise FileNotFoundError(f"no *.json record files in {source}.")
        first = {}  # record id -> the file that gave it
        for file in files:
            record_id = f"{subset_name}/{file.stem}"
            if record_id in first:  # 1.json and 1.JSON: one id, two records
                yield record_id, str(file), ConversationError(
                    f"{file}: gives the record id {record_id!r}, as {first[record_id].name} "
                    "does; rename one of them (record ids must be unique).")
                continue
            first[record_id] = file
            try:
                record, refused = _read_json(file)
                _check_record_values(record, str(file), record_id, refused)
            except ConversationError as exc:
                record = _naming_record(exc, f"{file}: ", record_id)
            yield record_id, str(file), record
        return
    data, refused = _read_json(source)  # an unreadable list file is fatal even when not strict
    if isinstance(data, _Refused):
        raise ConversationError(f"{source}: the file holds {data!r}, which is not valid "
                                "JSON, not a list of records.")
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise ConversationError(
            f"{source}: expected a JSON list of records (or one record object), got "
            f"{type(data).__name__}."
        )
    if not data:
        raise ValueError(f"{source}: the list of records is empty.")
    for i, record in enumerate(data):
        record_id, where = f"{subset_name}/{i}", f"{source}[{i}]"
        try:
            _check_record_values(record, where, record_id, refused)
        except ConversationError as exc:  # this record only: strict=False skips it
            record = exc
        yield record_id, where, record


def load_who_and_when(path=None, subset=None, *, return_X_y=False, strict=True, verbose=0,
                      labelled="auto"):
    """Load a local copy of the Who&When benchmark.

    Read more in the dataset description (``DESCR`` of the result).

    Parameters
    ----------
    path : str or path-like, optional
        One of

        - a folder in the public repository's layout, holding ``Algorithm-Generated/``
          and/or ``Hand-Crafted/`` folders of per-record JSON files (``12.json``);
        - one such subset folder (or any folder of per-record JSON files; its name is
          used as the subset when it is not one of the two);
        - one JSON file holding a list of records (or a single record object); the
          record ids are ``"<stem>/<position>"``.

        By default :func:`who_and_when_path`: the environment variable
        ``SKAFA_WHO_AND_WHEN``, else ``<data home>/who_and_when``.
    subset : {None, "Algorithm-Generated", "Hand-Crafted"}, default=None
        Which subset to load; ``None`` loads every subset folder present. The
        case-insensitive aliases ``"algorithm"`` and ``"hand"`` are accepted.
    return_X_y : bool, default=False
        If True, return ``(X, y, groups)`` instead of a Bunch. ``y`` holds ``-1``
        for an unlabelled record (see ``labelled``).
    strict : bool, default=True
        If True, a malformed record raises. If False, malformed records are skipped,
        listed in ``skipped`` and summarised in one ``UserWarning``.
    verbose : int, default=0
        Print one line per subset when > 0, and every skipped file when > 1.
    labelled : {"auto", True, False}, default="auto"
        ``"auto"``: a record whose ``mistake_step`` / ``mistake_agent`` are null
        or absent loads as an *unlabelled* conversation (``mistake_step`` None,
        ``-1`` in ``mistake_steps`` and in ``y``; ``mistake_agent`` None), e.g.
        runs of your own to attribute; a record with only one of the two keeps
        that one. ``True``: every record must carry both (to check that a
        benchmark copy is complete; a record without them is malformed, so
        ``strict=False`` skips it). ``False``: labels are ignored. See
        :meth:`skafa.Conversation.from_who_and_when`.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        Dictionary-like object with attributes

        conversations : list of Conversation
            One per record, ordered by subset, then numeric record id
            (``"10"`` after ``"9"``; non-numeric ids after numeric ones, by name).
        mistake_steps : ndarray of int64, shape (n_records,)
            The decisive turn of each conversation; ``-1`` for an unlabelled
            one (scikit-learn's marker of unlabelled samples).
        mistake_agents : ndarray of object, shape (n_records,)
            The annotated responsible agent (see the dataset description);
            ``None`` for a record without one.
        task_ids : ndarray of object, shape (n_records,)
            The task id of each record (use it as ``groups``).
        record_ids : ndarray of object, shape (n_records,)
            E.g. ``"Algorithm-Generated/12"``.
        subsets : ndarray of object, shape (n_records,)
        skipped : list of (str, str)
            ``(file, reason)`` for each record skipped because ``strict=False``.
        path : str
            The resolved location that was read.
        DESCR : str
            Description of the dataset.

    (X, y, groups) : tuple if ``return_X_y`` is True
        ``X`` the list of conversations, ``y`` the int array of decisive steps
        (``mistake_steps``: ``-1`` for an unlabelled record), ``groups`` the
        array of task ids.

    Raises
    ------
    FileNotFoundError
        When ``path`` (or the requested subset folder) does not exist or holds no
        records.
    ValueError
        For an unknown ``subset``. :class:`~skafa.ConversationError` (a
        ``ValueError``) for a malformed record when ``strict=True``; its message
        names the file (and, for a list file, the position), the record id and
        the field: e.g. ``NaN`` as ``mistake_step`` or ``Infinity`` as
        ``history[3].content`` (valid JavaScript, not JSON) is refused naming
        ``mistake_step`` or ``history[3].content``.

    Notes
    -----
    Unlabelled records (``y == -1``) can be attributed, not trained on: a
    probe's ``fit`` refuses ``y == -1`` naming the record, so fit on the
    labelled ones (``X[i]`` where ``y[i] >= 0``, or
    :func:`skafa.metrics.drop_unlabelled`). The metrics of :mod:`skafa.metrics`
    skip unlabelled conversations and warn with their number.

    See Also
    --------
    fetch_who_and_when : Download the public dataset, then load it.

    Examples
    --------
    >>> from skafa.datasets import load_who_and_when
    >>> data = load_who_and_when("shared/data/who_and_when")  # doctest: +SKIP
    >>> X, y, groups = load_who_and_when(subset="hand", return_X_y=True)  # doctest: +SKIP
    """
    subset = _canonical_subset(subset)
    path = who_and_when_path() if path is None else Path(path).expanduser()
    plan = _plan(path, subset)
    conversations, record_ids, subsets, skipped = [], [], [], []
    for subset_name, source in plan:
        n_before, n_skipped_before = len(conversations), len(skipped)
        for record_id, where, record in _records_of(subset_name, source):
            try:
                if isinstance(record, ConversationError):
                    raise record
                conv = Conversation.from_who_and_when(record, record_id=record_id,
                                                      labelled=labelled)
            except ConversationError as exc:
                message = str(exc)
                if not message.startswith(where):
                    message = f"{where}: {message}"
                if strict:
                    raise ConversationError(
                        message + " (pass strict=False to skip malformed records)"
                    ) from exc
                skipped.append((where, message))
                if verbose > 1:
                    say("load_who_and_when", f"skipped {message}")
                continue
            conversations.append(conv)
            record_ids.append(record_id)
            subsets.append(subset_name)
        if verbose > 0:
            say("load_who_and_when", f"{subset_name}: {len(conversations) - n_before} records "
                f"from {source} ({len(skipped) - n_skipped_before} skipped)")
    if skipped:
        files = "; ".join(f for f, _ in skipped[:5]) + ("; ..." if len(skipped) > 5 else "")
        warnings.warn(
            f"skipped {len(skipped)} malformed Who&When record(s) (see the 'skipped' field "
            f"for every file and reason): {files}",
            UserWarning,
            stacklevel=2,
        )
    if not conversations:
        raise ValueError(
            f"no valid Who&When records in {path}; all {len(skipped)} were malformed: "
            + "; ".join(reason for _, reason in skipped[:3])
        )
    mistake_steps = np.array([-1 if c.mistake_step is None else c.mistake_step
                              for c in conversations], dtype=np.int64)
    task_ids = np.array([c.task_id for c in conversations], dtype=object)
    if return_X_y:
        return conversations, mistake_steps, task_ids
    counts = {s: subsets.count(s) for s in dict.fromkeys(subsets)}
    loaded = ", ".join(f"{n} {s}" for s, n in counts.items())
    return Bunch(
        conversations=conversations,
        mistake_steps=mistake_steps,
        mistake_agents=np.array([c.mistake_agent for c in conversations], dtype=object),
        task_ids=task_ids,
        record_ids=np.array(record_ids, dtype=object),
        subsets=np.array(subsets, dtype=object),
        skipped=skipped,
        path=str(path),
        DESCR=_DESCR + f"\nThis copy ({path}): {loaded} records, {len(skipped)} skipped.\n",
    )


# -------------------------------------------------------------------- fetching
def _is_present(folder: Path, subset) -> bool:
    wanted = SUBSETS if subset is None else (subset,)
    return all((folder / s).is_dir() and any((folder / s).glob("*.json")) for s in wanted)


def _download(url, dest: Path, timeout, verbose):
    if verbose > 0:
        say("fetch_who_and_when", f"downloading {url} ...")
    request = urllib.request.Request(url, headers={"User-Agent": "skafa"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response, open(dest, "wb") as fh:
            shutil.copyfileobj(response, fh, length=1 << 20)
    except OSError as exc:  # URLError, HTTPError, timeouts and disk errors are OSErrors
        raise OSError(
            f"could not download Who&When from {url} ({exc}). If you have a copy of the "
            "dataset, load it with skafa.datasets.load_who_and_when(path)."
        ) from exc


def _extract(archive: Path, dest: Path) -> list:
    """Extract ``*/Who&When/<subset>/<file>.json`` members of ``archive`` into ``dest``.

    Only plain ``.json`` files directly inside a subset folder are written; any other
    member (and any path trying to leave ``dest``) is ignored.
    """
    written = set()
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                parts = PurePosixPath(info.filename).parts
                if _ARCHIVE_FOLDER not in parts:
                    continue
                rest = parts[parts.index(_ARCHIVE_FOLDER) + 1:]
                if (len(rest) != 2 or rest[0] not in SUBSETS
                        or not rest[1].lower().endswith(".json") or rest[1].startswith(".")
                        or rest[1] in (".", "..") or "/" in rest[1] or "\\" in rest[1]):
                    continue
                target = dest / rest[0] / rest[1]
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                written.add(rest[0])
    except zipfile.BadZipFile as exc:
        raise OSError(
            f"the downloaded file is not a zip archive ({exc}). If you have a copy of the "
            "dataset, load it with skafa.datasets.load_who_and_when(path)."
        ) from exc
    return sorted(written)


def fetch_who_and_when(data_home=None, *, subset=None, download_if_missing=True,
                       return_X_y=False, strict=True, url=WHO_AND_WHEN_URL, timeout=60.0,
                       verbose=0, labelled="auto"):
    """Load the Who&When benchmark, downloading it into the data home if needed.

    The dataset is kept in ``<data_home>/who_and_when/{Algorithm-Generated,
    Hand-Crafted}/`` and read with :func:`load_who_and_when`. When a requested subset
    folder is missing, the zip archive of the public repository
    (``mingyin1/Agents_Failure_Attribution``, folder ``Who&When``) is downloaded with
    the standard library, its ``Who&When/<subset>/*.json`` members are extracted, and
    missing subset folders are moved into place (existing folders are never
    overwritten). The archive is deleted afterwards.

    .. note:: The download path is tested offline only (against a local zip with the
       same layout, through a ``file://`` URL); it has not been run against the live
       GitHub site, whose archive layout may change. No checksum is verified. If it
       fails, download the ``Who&When`` folder yourself and call
       :func:`load_who_and_when` with its path.

    Parameters
    ----------
    data_home : str or path-like, optional
        Where to keep datasets; see :func:`get_data_home` (``SKAFA_DATA`` or
        ``~/skafa_data``).
    subset : {None, "Algorithm-Generated", "Hand-Crafted"}, default=None
        As in :func:`load_who_and_when`; ``None`` needs both subsets.
    download_if_missing : bool, default=True
        If False, raise an ``OSError`` instead of downloading.
    return_X_y : bool, default=False
        As in :func:`load_who_and_when`.
    strict : bool, default=True
        As in :func:`load_who_and_when`.
    url : str, default=WHO_AND_WHEN_URL
        Zip archive holding a ``Who&When/`` folder (any depth). A mirror or a
        ``file://`` URL of an archive with the same layout works too.
    timeout : float, default=60.0
        Network timeout in seconds.
    verbose : int, default=0
        Print progress when > 0.
    labelled : {"auto", True, False}, default="auto"
        As in :func:`load_who_and_when` (the public release is fully labelled;
        ``True`` checks that).

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch` or tuple
        See :func:`load_who_and_when`.

    Raises
    ------
    OSError
        When the data are missing and ``download_if_missing=False``, or when the
        download or extraction fails. The message names the ``load_who_and_when(path)``
        alternative.
    """
    subset = _canonical_subset(subset)
    home = get_data_home(data_home)
    folder = home / _DEFAULT_FOLDER
    if not _is_present(folder, subset):
        wanted = list(SUBSETS) if subset is None else [subset]
        if not download_if_missing:
            raise OSError(
                f"Who&When ({', '.join(wanted)}) not found in {folder} and "
                "download_if_missing=False. Call fetch_who_and_when() with "
                "download_if_missing=True, or, if you already have a copy, use "
                "skafa.datasets.load_who_and_when(path)."
            )
        tmp = Path(tempfile.mkdtemp(prefix=".who_and_when-", dir=home))
        try:
            archive = tmp / "archive.zip"
            _download(url, archive, timeout, verbose)
            extracted = tmp / "extracted"
            found = _extract(archive, extracted)
            missing = [s for s in wanted if s not in found]
            if missing:
                raise OSError(
                    f"the archive from {url} holds no {_ARCHIVE_FOLDER}/{missing[0]}/*.json "
                    "records. Download the dataset yourself and use "
                    "skafa.datasets.load_who_and_when(path)."
                )
            folder.mkdir(parents=True, exist_ok=True)
            for s in found:
                target = folder / s
                if target.is_dir() and not any(target.iterdir()):
                    target.rmdir()  # an empty leftover folder: fill it
                if not target.exists():
                    os.replace(extracted / s, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if verbose > 0:
            say("fetch_who_and_when", f"saved to {folder}")
    return load_who_and_when(folder, subset, return_X_y=return_X_y, strict=strict,
                             verbose=verbose, labelled=labelled)
