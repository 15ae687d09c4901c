"""Ragged per-turn features: :class:`TurnFeatures`, one entry per conversation.

Layout (CSR-like)::

    values   (n_turns_total, n_sites, n_features)   activations read at several sites
          or (n_turns_total, n_features)            one block (dense or scipy.sparse)
    offsets  (n_conversations + 1,)                 turns of conversation i are
                                                    values[offsets[i]:offsets[i+1]]

``len(X) == X.shape[0] == n_conversations``, so scikit-learn's splitters,
``train_test_split``, ``cross_val_score`` and ``Pipeline`` treat one conversation as
one sample. Indexing with int arrays, lists, bool masks, slices and
``(index, Ellipsis)`` returns a new :class:`TurnFeatures`; an int returns that
conversation's per-turn array.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

from .utils.validation import describe, locate_row

__all__ = ["TurnFeatures", "check_turn_features", "agents_at"]

_FORMAT = "skafa.TurnFeatures/1"
_NUMERIC = "biuf"  # dtype kinds a TurnFeatures may hold (bool, ints, floats)


#: Column count a sparse TurnFeatures file may claim (TF-IDF vocabularies are far
#: smaller); a hostile header must not make a later fit allocate a huge coefficient array.
MAX_SPARSE_COLUMNS = 2**26
#: A sparse file may claim this many columns whatever its size (a hashing
#: vectorizer's 2**20 columns, say) ...
SPARSE_COLUMNS_FREE = 2**20
#: ... and beyond that at most this many per byte the file holds: the column count
#: is a number in a header, backed by no data, and a probe allocates per column.
SPARSE_COLUMNS_PER_BYTE = 16


def _check_csr_parts(data, indices, indptr, shape):
    """Raise ``ValueError`` unless the parts form a valid CSR matrix of ``shape``.

    scipy trusts ``indices`` and ``indptr``: an out-of-range column index makes
    ``.toarray()`` write outside its buffer (a segfault), so hostile or corrupt
    parts are checked in full here, in O(nnz).
    """
    n_rows, n_cols = shape
    if n_cols > MAX_SPARSE_COLUMNS:
        raise ValueError(
            f"the header says {n_cols:,} columns, more than "
            f"skafa.features.MAX_SPARSE_COLUMNS ({MAX_SPARSE_COLUMNS:,}); a "
            "probe would allocate that many coefficients. Raise the limit "
            "if the file is yours."
        )
    for name, arr in (
        ("sparse_data", data),
        ("sparse_indices", indices),
        ("sparse_indptr", indptr),
    ):
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if data.dtype.kind not in _NUMERIC:
        raise ValueError(
            f"sparse_data has dtype {data.dtype}; expected a numeric dtype"
        )
    for name, arr in (("sparse_indices", indices), ("sparse_indptr", indptr)):
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{name} has dtype {arr.dtype}; expected integers")
    if indices.shape != data.shape:
        raise ValueError(
            f"sparse_indices has {indices.size} entries for {data.size} stored values"
        )
    if indptr.shape != (n_rows + 1,):
        raise ValueError(
            f"sparse_indptr has {indptr.size} entries for {n_rows} rows "
            f"(expected {n_rows + 1})"
        )
    ptr = indptr.astype(np.int64)
    if ptr[0] != 0 or ptr[-1] != data.size or np.any(np.diff(ptr) < 0):
        raise ValueError(
            "sparse_indptr must start at 0, never decrease and end at the "
            f"number of stored values ({data.size})"
        )
    if indices.size:
        idx = indices.astype(np.int64)
        bad = (idx < 0) | (idx >= n_cols)
        if indices.dtype == np.uint64:
            bad |= indices > np.uint64(np.iinfo(np.int64).max)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"column index {indices[k]} of stored value {k} is outside "
                f"0..{n_cols - 1}"
            )


def _same_array(a, b):
    """Exact equality of two arrays, NaN equal to NaN at the same position."""
    nan_aware = a.dtype.kind in "fc" and b.dtype.kind in "fc"
    return np.array_equal(a, b, equal_nan=nan_aware)


def _str_list(value, name, *, allow_none_items=False, allow_int_items=False):
    """Check a list of strings read from a header (``None`` stays ``None``)."""
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(v, str)
        or (allow_none_items and v is None)
        or (allow_int_items and type(v) is int)
        for v in value
    )
    if not ok:
        what = (
            "strings, ints or nulls"
            if allow_int_items
            else "strings or nulls"
            if allow_none_items
            else "strings"
        )
        raise ValueError(f"header field {name!r} must be null or a list of {what}")
    return value


def _contents_from_file(tensors, meta):
    """Values, offsets and keyword arguments of a TurnFeatures, checked in full."""
    from .utils.fileio import json_field

    sparse = json_field(meta, "sparse")
    if not isinstance(sparse, bool):
        raise ValueError(f"header field 'sparse' must be true or false, got {sparse!r}")
    expected = (
        {"offsets", "sparse_data", "sparse_indices", "sparse_indptr"}
        if sparse
        else {"offsets", "values"}
    )
    if set(tensors) != expected:
        raise ValueError(
            f"the file holds the tensors {sorted(tensors)}; expected {sorted(expected)}"
        )
    shape = json_field(meta, "shape")
    if not (
        isinstance(shape, list)
        and shape
        and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        )
    ):
        raise ValueError("header field 'shape' must be a list of non-negative ints")
    offsets = tensors["offsets"]
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        raise ValueError(
            f"tensor 'offsets' must be a 1-D integer array, got dtype "
            f"{offsets.dtype} and shape {offsets.shape}"
        )
    if sparse:
        if len(shape) != 2:
            raise ValueError(
                f"a sparse TurnFeatures has a 2-D shape, the header says {shape}"
            )
        data, indices, indptr = (
            tensors[k] for k in ("sparse_data", "sparse_indices", "sparse_indptr")
        )
        held = sum(int(t.nbytes) for t in tensors.values()) + sum(
            len(k) + len(v) for k, v in meta.items())
        allowed = max(SPARSE_COLUMNS_FREE, SPARSE_COLUMNS_PER_BYTE * held)
        if MAX_SPARSE_COLUMNS >= shape[1] > allowed:
            raise ValueError(
                f"the header says {shape[1]:,} columns, but the file holds {held:,} bytes, "
                f"which justify at most {allowed:,} (skafa.features.SPARSE_COLUMNS_FREE, "
                f"or SPARSE_COLUMNS_PER_BYTE={SPARSE_COLUMNS_PER_BYTE} per byte); a probe "
                "fitted on it would allocate per declared column")
        _check_csr_parts(data, indices, indptr, tuple(shape))
        values = sp.csr_matrix((data, indices, indptr), shape=tuple(shape))
    else:
        values = tensors["values"]
        if values.dtype.kind not in _NUMERIC:
            raise ValueError(
                f"tensor 'values' has dtype {values.dtype}; expected a numeric dtype"
            )
        if list(values.shape) != shape:
            raise ValueError(
                f"tensor 'values' has shape {values.shape} but the header "
                f"says {tuple(shape)}"
            )
    sites = _str_list(json_field(meta, "sites"), "sites")
    if sites is None:
        raise ValueError("header field 'sites' must be a list of strings")
    kwargs = dict(
        sites=sites,
        feature_names=_str_list(json_field(meta, "feature_names"), "feature_names"),
        speakers=_str_list(json_field(meta, "speakers"), "speakers"),
        task_ids=_str_list(
            json_field(meta, "task_ids"),
            "task_ids",
            allow_none_items=True,
            allow_int_items=True,
        ),  # task ids keep their type
    )
    return values, offsets, kwargs


def _agreeing(parts, attr, first):
    """The one ``attr`` (speakers or task_ids) of parts that describe the same turns.

    Parts without it take it from the others; two parts holding different values
    raise, naming the first conversation (and turn) where they differ.
    """
    ref, ref_j = None, None
    for j, p in enumerate(parts):
        value = getattr(p, attr)
        if value is None:
            continue
        if ref is None:
            ref, ref_j = value, j
            continue
        diff = np.flatnonzero(ref != value)
        if diff.size:
            k = int(diff[0])
            if attr == "speakers":
                conv, turn = locate_row(first, k)
                where = f"{describe(first, conv)}, turn {turn}"
            else:
                where = describe(first, k)
            raise ValueError(
                f"parts {ref_j} and {j} describe the same conversations but their {attr} "
                f"differ at {where}: {ref[k]!r} vs {value[k]!r}. Concatenate features "
                "of the same conversations, in the same order."
            )
    return ref


def _as_str_tuple(values, name):
    if values is None:
        return None
    if isinstance(values, str):
        raise TypeError(f"{name} must be a sequence of strings, not a single string.")
    return tuple(str(v) for v in values)


def _numeric_values(values):
    """Object, string or complex feature values as float64, or an error naming the entry."""
    if values.dtype.kind == "c":
        raise ValueError("values are complex; features must be real numbers.")
    try:
        return values.astype(np.float64)
    except (TypeError, ValueError):
        pass
    for index in np.ndindex(values.shape):
        try:
            float(values[index])
        except (TypeError, ValueError):
            where = f"turn row {index[0]}, " + (
                f"site block {index[1]}, feature {index[2]}" if values.ndim == 3
                else f"feature {index[1]}")
            raise ValueError(
                f"values[{', '.join(map(str, index))}] ({where}) is "
                f"{values[index]!r} ({type(values[index]).__name__}), not a number; features "
                f"must be numeric (values has dtype {values.dtype}).") from None
    return values.astype(np.float64)  # pragma: no cover - every entry converted


class TurnFeatures:
    """Per-turn features of a set of conversations (ragged, CSR-like).

    Parameters
    ----------
    values : ndarray of shape (n_turns_total, n_sites, n_features) or \
            (n_turns_total, n_features), or scipy sparse matrix
        One row per turn, all conversations concatenated. A 3-D array holds one
        block per site (e.g. ``"resid_pre.12"``); a 2-D array or sparse matrix is a
        single block.
    offsets : array-like of int, shape (n_conversations + 1,)
        ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == n_turns_total``.
        Every conversation must have at least one turn.
    sites : sequence of str, optional
        Names of the site blocks (length ``n_sites``). Defaults to ``("site0", ...)``
        for 3-D values and ``("features",)`` for a single block.
    feature_names : sequence of str, optional
        Names of the ``n_features`` columns (shared by all sites).
    speakers : sequence of str, optional
        Speaker of every turn (length ``n_turns_total``), so the responsible agent
        can be read off a predicted step.
    task_ids : sequence of str, int or None, optional
        Task id of every conversation (length ``n_conversations``), usable as
        ``groups``. Ids keep their type: ``1`` and ``"1"`` are two tasks.

    Attributes
    ----------
    n_conversations, n_turns_total, n_sites, n_features : int
    n_turns : ndarray of int, shape (n_conversations,)
        Turns per conversation.
    shape : tuple
        ``(n_conversations,)`` — what scikit-learn reads as the number of samples.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> X = TurnFeatures(np.zeros((5, 2, 3)), [0, 2, 5], sites=["a", "b"])
    >>> len(X), X.n_turns.tolist(), X[[1]].n_turns_total
    (2, [2, 3], 3)
    """

    __array_priority__ = 1000  # keep numpy from broadcasting over us

    def __init__(
        self,
        values,
        offsets,
        *,
        sites=None,
        feature_names=None,
        speakers=None,
        task_ids=None,
    ):
        if sp.issparse(values):
            values = sp.csr_matrix(values)
            _check_csr_parts(values.data, values.indices, values.indptr, values.shape)
        else:
            values = np.asarray(values)
            if values.ndim not in (2, 3):
                raise ValueError(
                    "values must be 2-D (n_turns_total, n_features) or 3-D "
                    f"(n_turns_total, n_sites, n_features); got shape {values.shape}."
                )
            if values.dtype.kind not in "biuf":
                values = _numeric_values(values)
        offsets = np.asarray(offsets)
        if offsets.ndim != 1 or offsets.size < 1:
            raise ValueError(
                "offsets must be a 1-D array of length n_conversations + 1."
            )
        if offsets.dtype.kind not in "iu":
            if not np.all(np.equal(np.mod(offsets, 1), 0)):
                raise ValueError("offsets must be integers.")
        offsets = offsets.astype(np.int64)
        if offsets[0] != 0:
            raise ValueError(f"offsets[0] must be 0, got {offsets[0]}.")
        n_total = values.shape[0]
        if offsets[-1] != n_total:
            raise ValueError(
                f"offsets[-1]={offsets[-1]} does not match the {n_total} turn rows in values."
            )
        sizes = np.diff(offsets)
        if np.any(sizes <= 0):
            bad = int(np.flatnonzero(sizes <= 0)[0])
            raise ValueError(
                f"conversation {bad} has {sizes[bad]} turns; offsets must be strictly "
                "increasing (every conversation needs at least one turn)."
            )
        n_sites = values.shape[1] if values.ndim == 3 else 1
        if sites is None:
            sites = (
                tuple(f"site{i}" for i in range(n_sites))
                if values.ndim == 3
                else ("features",)
            )
        sites = _as_str_tuple(sites, "sites")
        if len(sites) != n_sites:
            raise ValueError(f"got {len(sites)} site names for {n_sites} site blocks.")
        if len(set(sites)) != len(sites):
            raise ValueError(f"site names must be unique, got {sites}.")
        feature_names = _as_str_tuple(feature_names, "feature_names")
        if feature_names is not None and len(feature_names) != values.shape[-1]:
            raise ValueError(
                f"got {len(feature_names)} feature names for {values.shape[-1]} features."
            )
        if speakers is not None:
            speakers = np.asarray([str(s) for s in speakers], dtype=object)
            if speakers.shape != (n_total,):
                raise ValueError(
                    f"speakers must have one entry per turn ({n_total}), got {speakers.shape[0]}."
                )
        if task_ids is not None:
            from .utils.validation import check_task_id

            task_ids = np.asarray(
                [check_task_id(t, f"task_ids[{i}]") for i, t in enumerate(task_ids)],
                dtype=object,
            )
            if task_ids.shape != (sizes.size,):
                raise ValueError(
                    f"task_ids must have one entry per conversation ({sizes.size}), "
                    f"got {task_ids.shape[0]}."
                )
        self.values = values
        self.offsets = offsets
        self.sites = sites
        self.feature_names = feature_names
        self.speakers = speakers
        self.task_ids = task_ids

    # ----------------------------------------------------------- constructors
    @classmethod
    def from_arrays(cls, arrays, **kwargs) -> TurnFeatures:
        """Build from a list of per-conversation arrays.

        Parameters
        ----------
        arrays : sequence of ndarray or sparse matrix
            One array per conversation, each ``(n_turns_i, n_sites, n_features)`` or
            ``(n_turns_i, n_features)``.
        **kwargs
            Passed to :class:`TurnFeatures` (``sites``, ``speakers``, ...).

        Returns
        -------
        TurnFeatures
        """
        arrays = list(arrays)
        if not arrays:
            raise ValueError("need at least one conversation.")
        offsets = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrays])])
        if all(sp.issparse(a) for a in arrays):
            values = sp.vstack(arrays, format="csr")
        else:
            values = np.concatenate([np.asarray(a) for a in arrays], axis=0)
        return cls(values, offsets, **kwargs)

    # ------------------------------------------------------------ properties
    @property
    def n_conversations(self) -> int:
        """Number of conversations (samples)."""
        return int(self.offsets.size - 1)

    @property
    def n_turns_total(self) -> int:
        """Number of turn rows over all conversations."""
        return int(self.offsets[-1])

    @property
    def n_turns(self) -> np.ndarray:
        """Turns per conversation, shape ``(n_conversations,)``."""
        return np.diff(self.offsets)

    @property
    def n_sites(self) -> int:
        """Number of site blocks."""
        return len(self.sites)

    @property
    def n_features(self) -> int:
        """Number of features per turn and site."""
        return int(self.values.shape[-1])

    @property
    def shape(self) -> tuple:
        """``(n_conversations,)``: what scikit-learn reads as the number of samples."""
        return (self.n_conversations,)

    @property
    def ndim(self) -> int:
        """Always 1: one entry per conversation."""
        return 1

    @property
    def is_sparse(self) -> bool:
        """Whether :attr:`values` is a scipy sparse matrix."""
        return sp.issparse(self.values)

    @property
    def dtype(self):
        """dtype of :attr:`values`."""
        return self.values.dtype

    def __len__(self) -> int:
        return self.n_conversations

    def __iter__(self):
        for i in range(self.n_conversations):
            yield self[i]

    def __repr__(self) -> str:
        kind = "sparse" if self.is_sparse else str(self.values.dtype)
        sites = (
            self.sites
            if self.n_sites <= 4
            else (*self.sites[:2], "...", self.sites[-1])
        )
        return (
            f"TurnFeatures(n_conversations={self.n_conversations}, "
            f"n_turns_total={self.n_turns_total}, n_sites={self.n_sites}, "
            f"n_features={self.n_features}, sites={list(sites)}, {kind})"
        )

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "TurnFeatures is ragged (one entry per conversation, several turns each) and "
            "cannot become a single NumPy array. Use a skafa estimator "
            "(GroupedArgmaxLogisticClassifier, SiteSelector), wrap turn-level sklearn "
            "transformers in skafa.PerTurn(...), or read the turn rows explicitly with "
            "X.turn_matrix(site)."
        )

    # --------------------------------------------------------------- per-turn
    def turn_conversation_index(self) -> np.ndarray:
        """Conversation index of every turn row, shape ``(n_turns_total,)``."""
        return np.repeat(np.arange(self.n_conversations), self.n_turns)

    def turn_positions(self) -> np.ndarray:
        """0-based position of every turn row inside its conversation."""
        return np.arange(self.n_turns_total) - np.repeat(
            self.offsets[:-1], self.n_turns
        )

    def turn_matrix(self, site=None):
        """Return the 2-D turn-row matrix ``(n_turns_total, n_features)`` of one site.

        Parameters
        ----------
        site : str or int, optional
            Which site block. May be omitted when there is exactly one.
        """
        if self.values.ndim == 2:
            if site is not None and site not in (0, self.sites[0]):
                raise KeyError(
                    f"unknown site {site!r}; this container has {list(self.sites)}."
                )
            return self.values
        if site is None:
            if self.n_sites != 1:
                raise ValueError(
                    f"this TurnFeatures holds {self.n_sites} sites ({self._site_summary()}); "
                    "select one with X.select_sites(name) or let skafa.SiteSelector choose."
                )
            return self.values[:, 0, :]
        return self.values[:, self._site_index(site), :]

    def global_turn_index(self, steps) -> np.ndarray:
        """Row index in :attr:`values` of turn ``steps[i]`` of conversation ``i``.

        Parameters
        ----------
        steps : array-like of int, shape (n_conversations,)

        Returns
        -------
        ndarray of int64, shape (n_conversations,)

        Raises
        ------
        ValueError
            If a step is not an integer (``1.7``, ``"1"``, a bool; ``2.0`` is
            accepted) or lies outside its conversation (naming it and its task id).
        """
        from .utils.validation import check_steps

        steps = check_steps(steps, self, name="steps")
        return self.offsets[:-1] + steps

    def speakers_at(self, steps) -> np.ndarray:
        """Speaker of turn ``steps[i]`` in conversation ``i``.

        Parameters
        ----------
        steps : array-like of int, shape (n_conversations,)

        Returns
        -------
        ndarray of object, shape (n_conversations,)
            Requires :attr:`speakers`.
        """
        if self.speakers is None:
            raise ValueError("this TurnFeatures carries no speakers.")
        return self.speakers[self.global_turn_index(steps)]

    def split_rows(self, rows) -> list:
        """Split a per-turn array into one array per conversation.

        Parameters
        ----------
        rows : array-like of shape (n_turns_total, ...)

        Returns
        -------
        list of ndarray
            ``n_conversations`` arrays.
        """
        rows = np.asarray(rows)
        if rows.shape[0] != self.n_turns_total:
            raise ValueError(
                f"expected {self.n_turns_total} rows, got {rows.shape[0]}."
            )
        return np.split(rows, self.offsets[1:-1])

    # ---------------------------------------------------------------- indexing
    def _normalise_key(self, key):
        if isinstance(key, tuple):
            if len(key) == 2 and key[1] is Ellipsis:
                key = key[0]
            elif len(key) == 1:
                key = key[0]
            else:
                raise IndexError(
                    "TurnFeatures supports X[index] and X[index, ...] only; select sites "
                    "with X.select_sites(...)."
                )
        if isinstance(key, slice):
            return np.arange(self.n_conversations)[key]
        key = np.asarray(key)
        if key.dtype == bool:
            if key.shape != (self.n_conversations,):
                raise IndexError(
                    f"boolean mask of shape {key.shape} does not match "
                    f"{self.n_conversations} conversations."
                )
            return np.flatnonzero(key)
        if key.size == 0:
            return np.zeros(0, dtype=np.int64)
        if key.dtype.kind not in "iu":
            raise IndexError(
                f"cannot index TurnFeatures with a key of dtype {key.dtype}."
            )
        key = key.astype(np.int64).ravel()
        n = self.n_conversations
        if np.any((key < -n) | (key >= n)):
            raise IndexError(f"index out of range for {n} conversations.")
        return np.where(key < 0, key + n, key)

    def __getitem__(self, key):
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            i = int(key)
            if i < 0:
                i += self.n_conversations
            if not 0 <= i < self.n_conversations:
                raise IndexError(
                    f"conversation {key} out of range ({self.n_conversations})."
                )
            return self.values[self.offsets[i] : self.offsets[i + 1]]
        idx = self._normalise_key(key)
        if idx.size == 0:
            raise IndexError("selecting zero conversations is not supported.")
        sizes = self.n_turns[idx]
        starts = self.offsets[idx]
        # Row indices of the selected conversations, in the requested order.
        rows = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        rows = rows + np.arange(sizes.sum())
        contiguous = idx.size > 0 and np.all(np.diff(idx) == 1)
        if contiguous:
            lo, hi = self.offsets[idx[0]], self.offsets[idx[-1] + 1]
            values = self.values[lo:hi]
        else:
            values = self.values[rows]
        return TurnFeatures(
            values,
            np.concatenate([[0], np.cumsum(sizes)]),
            sites=self.sites,
            feature_names=self.feature_names,
            speakers=None if self.speakers is None else self.speakers[rows],
            task_ids=None if self.task_ids is None else self.task_ids[idx],
        )

    # ------------------------------------------------------------------ sites
    def _site_summary(self):
        s = list(self.sites)
        return ", ".join(s) if len(s) <= 6 else ", ".join(s[:3] + ["..."] + s[-2:])

    def _site_index(self, site) -> int:
        if isinstance(site, (bool, np.bool_)):
            raise TypeError(
                f"site {site!r} is a bool; select sites by name or by int index."
            )
        if isinstance(site, numbers.Integral):
            if not -self.n_sites <= site < self.n_sites:
                raise KeyError(
                    f"site index {site} out of range ({self.n_sites} sites)."
                )
            return int(site) % self.n_sites
        try:
            return self.sites.index(site)
        except ValueError:
            raise KeyError(
                f"unknown site {site!r}; available: {self._site_summary()}."
            ) from None

    def select_sites(self, sites) -> TurnFeatures:
        """Return a container holding only some sites.

        Parameters
        ----------
        sites : str, int or sequence of them
            Site names (or indices), in the order wanted.

        Returns
        -------
        TurnFeatures
            Same conversations, speakers and task ids.

        Raises
        ------
        KeyError
            Naming an unknown site and listing the available ones.
        TypeError
            For a bool (``True`` is not site 1).
        """
        single = isinstance(sites, (str, numbers.Integral, np.bool_))
        names = [sites] if single else list(sites)
        if not names:
            raise ValueError("select at least one site.")
        idx = [self._site_index(s) for s in names]
        if self.values.ndim == 2:
            values = self.values
        else:
            values = self.values[:, idx, :]
        return self._replace(values=values, sites=[self.sites[i] for i in idx])

    def _replace(self, **changes) -> TurnFeatures:
        kwargs = dict(
            values=self.values,
            offsets=self.offsets,
            sites=self.sites,
            feature_names=self.feature_names,
            speakers=self.speakers,
            task_ids=self.task_ids,
        )
        kwargs.update(changes)
        values = kwargs.pop("values")
        offsets = kwargs.pop("offsets")
        return TurnFeatures(values, offsets, **kwargs)

    def with_values(self, values, *, sites=None, feature_names=None) -> TurnFeatures:
        """Return a container with the same conversations and new per-turn values.

        Parameters
        ----------
        values : ndarray or sparse matrix, shape (n_turns_total, ...)
        sites : sequence of str, optional
            Site names of the new values; kept when the number of sites is unchanged.
        feature_names : sequence of str, optional

        Returns
        -------
        TurnFeatures
        """
        if values.shape[0] != self.n_turns_total:
            raise ValueError(
                f"new values have {values.shape[0]} rows for {self.n_turns_total} turns."
            )
        if sites is None:
            n_sites = values.shape[1] if getattr(values, "ndim", 2) == 3 else 1
            sites = self.sites if n_sites == self.n_sites else None
        return self._replace(values=values, sites=sites, feature_names=feature_names)

    # --------------------------------------------------------- concatenation
    @staticmethod
    def concatenate(parts: Sequence[TurnFeatures], *, prefixes=None) -> TurnFeatures:
        """Concatenate per-turn features along the feature axis.

        All parts must describe the same conversations (equal ``offsets``, and
        equal ``speakers`` and ``task_ids`` where parts carry them). Parts
        with several sites must share their site names; a single-block part (e.g.
        position features) is appended to every site of a multi-site part, so
        ``SiteSelector`` can still choose a site for "activations + position".
        Sparse parts are kept sparse when every part is a single block.

        Parameters
        ----------
        parts : sequence of TurnFeatures
        prefixes : sequence of str, optional
            Prefix for each part's feature names (``"{prefix}__{name}"``).
        """
        parts = _feature_parts(parts, "concatenate")
        if prefixes is not None:
            if isinstance(prefixes, str):
                raise TypeError(
                    "prefixes must be a sequence (one per part), not a string."
                )
            prefixes = list(prefixes)
            if len(prefixes) != len(parts):
                raise ValueError(
                    f"got {len(prefixes)} prefixes for {len(parts)} parts."
                )
        first = parts[0]
        for j, p in enumerate(parts[1:], 1):
            if not np.array_equal(p.offsets, first.offsets):
                raise ValueError(
                    f"part {j} describes different conversations (offsets differ from part 0)."
                )
        multi = [p for p in parts if p.values.ndim == 3 and p.n_sites > 1]
        sites = multi[0].sites if multi else None
        for p in multi[1:]:
            if p.sites != sites:
                raise ValueError(
                    f"multi-site parts must share sites: {sites} vs {p.sites}."
                )
        if sites is None:
            blocks = [p.turn_matrix() for p in parts]
            if any(sp.issparse(b) for b in blocks):
                values = sp.hstack([sp.csr_matrix(b) for b in blocks], format="csr")
            else:
                values = np.concatenate(blocks, axis=1)
            # Single-site 3-D parts sharing one site name stay a named 3-D block.
            names_3d = {p.sites for p in parts if p.values.ndim == 3}
            if len(names_3d) == 1 and not sp.issparse(values):
                out_sites = names_3d.pop()
                values = values[:, None, :]
            else:
                out_sites = None
        else:
            n_sites = len(sites)
            blocks = []
            for p in parts:
                if p.values.ndim == 3 and p.n_sites > 1:
                    blocks.append(p.values)
                else:
                    b = p.turn_matrix() if p.values.ndim == 3 else p.values
                    if sp.issparse(b):
                        b = b.toarray()
                    blocks.append(
                        np.broadcast_to(
                            b[:, None, :], (b.shape[0], n_sites, b.shape[1])
                        )
                    )
            dtype = np.result_type(*[b.dtype for b in blocks])
            values = np.concatenate(
                [b.astype(dtype, copy=False) for b in blocks], axis=2
            )
            out_sites = sites
        names = None
        if prefixes is not None or all(p.feature_names is not None for p in parts):
            if prefixes is None:
                prefixes = [None] * len(parts)
            names = []
            for j, (p, pre) in enumerate(zip(parts, prefixes)):
                base = p.feature_names or tuple(f"x{k}" for k in range(p.n_features))
                names.extend(f"{pre}__{n}" if pre else n for n in base)
        speakers = _agreeing(parts, "speakers", first)
        task_ids = _agreeing(parts, "task_ids", first)
        return TurnFeatures(
            values,
            first.offsets,
            sites=out_sites,
            feature_names=names,
            speakers=speakers,
            task_ids=task_ids,
        )

    @staticmethod
    def vstack(parts: Sequence[TurnFeatures]) -> TurnFeatures:
        """Join the conversations of several containers, in order (row-wise union).

        The counterpart of :meth:`concatenate` along the conversation axis: e.g. the
        training parts of two subsets read by the same extractor, to fit one probe
        on both.

        Parameters
        ----------
        parts : sequence of TurnFeatures
            Equal ``sites``, ``feature_names`` and per-site width; all dense or all
            sparse; ``speakers`` and ``task_ids`` kept when every part has them.

        Returns
        -------
        TurnFeatures
            The conversations of ``parts[0]``, then of ``parts[1]``, ...

        Examples
        --------
        >>> import numpy as np
        >>> from skafa import TurnFeatures
        >>> a = TurnFeatures(np.zeros((3, 2)), [0, 1, 3], task_ids=["t0", "t1"])
        >>> b = TurnFeatures(np.ones((2, 2)), [0, 2], task_ids=["u0"])
        >>> X = TurnFeatures.vstack([a, b])
        >>> X.n_turns.tolist(), X.task_ids.tolist()
        ([1, 2, 2], ['t0', 't1', 'u0'])
        """
        parts = _feature_parts(parts, "stack")
        first = parts[0]
        for j, p in enumerate(parts[1:], 1):
            for attr in ("sites", "feature_names"):
                if getattr(p, attr) != getattr(first, attr):
                    raise ValueError(f"part {j} has other {attr} than part 0: "
                                     f"{getattr(p, attr)} vs {getattr(first, attr)}.")
            if p.values.shape[1:] != first.values.shape[1:] or p.is_sparse != first.is_sparse:
                raise ValueError(f"part {j} has values of shape {p.values.shape} "
                                 f"({'sparse' if p.is_sparse else 'dense'}); part 0: "
                                 f"{first.values.shape} "
                                 f"({'sparse' if first.is_sparse else 'dense'}).")
        values = (sp.vstack([p.values for p in parts], format="csr") if first.is_sparse
                  else np.concatenate([p.values for p in parts], axis=0))
        offsets = np.concatenate([[0], np.cumsum(np.concatenate([p.n_turns for p in parts]))])

        def joined(attr):
            got = [getattr(p, attr) for p in parts]
            return None if any(g is None for g in got) else np.concatenate(got)

        return TurnFeatures(values, offsets, sites=first.sites,
                            feature_names=first.feature_names,
                            speakers=joined("speakers"), task_ids=joined("task_ids"))

    def astype(self, dtype) -> TurnFeatures:
        """Return a copy with values cast to ``dtype``.

        Parameters
        ----------
        dtype : numpy dtype

        Returns
        -------
        TurnFeatures
        """
        return self._replace(values=self.values.astype(dtype))

    # ----------------------------------------------------------- persistence
    def _tensors_and_metadata(self):
        tensors = {"offsets": np.ascontiguousarray(self.offsets)}
        if self.is_sparse:
            v = self.values.tocsr()
            tensors.update(
                sparse_data=np.ascontiguousarray(v.data),
                sparse_indices=np.ascontiguousarray(v.indices.astype(np.int64)),
                sparse_indptr=np.ascontiguousarray(v.indptr.astype(np.int64)),
            )
            shape = list(v.shape)
        else:
            tensors["values"] = np.ascontiguousarray(self.values)
            shape = list(self.values.shape)
        meta = {
            "format": _FORMAT,
            "shape": json.dumps(shape),
            "sparse": json.dumps(self.is_sparse),
            "sites": json.dumps(list(self.sites)),
            "feature_names": json.dumps(
                None if self.feature_names is None else list(self.feature_names)
            ),
            "speakers": json.dumps(
                None if self.speakers is None else self.speakers.tolist()
            ),
            "task_ids": json.dumps(
                None if self.task_ids is None else self.task_ids.tolist()
            ),
        }
        return tensors, meta

    def save(self, path) -> None:
        """Write to a safetensors file (arrays + JSON metadata, no pickle).

        The file is written atomically and carries a SHA-256 digest of its header
        and tensors, which :meth:`load` verifies.

        Parameters
        ----------
        path : str or path-like
        """
        from .utils.fileio import write_safetensors

        tensors, meta = self._tensors_and_metadata()
        write_safetensors(path, tensors, meta)

    @classmethod
    def load(cls, path, *, verify=True) -> TurnFeatures:
        """Read a file written by :meth:`save`.

        The file is untrusted input. Its SHA-256 digest (over the header and every
        tensor) is recomputed, so a flipped byte, a truncation or an edited header
        is refused; and, because a digest is no signature (whoever edits a file can
        recompute it), the structure is checked in full: tensor names, dtypes and
        shapes, the sparse index arrays (column indices in range, ``indptr``
        monotone and consistent), ``offsets`` (monotone, consistent with the rows)
        and the lengths and types of the site, feature-name, speaker and task-id
        lists.

        Parameters
        ----------
        path : str or path-like
        verify : bool, default=True
            Require the digest. Files written by skafa before digests existed
            (before issue 9) have none and are refused with a message saying so;
            pass ``verify=False`` to read such a file you trust. A digest that is
            present is always checked, and the structure is always validated.

        Returns
        -------
        TurnFeatures

        Raises
        ------
        ValueError
            When the file is not a readable skafa TurnFeatures file (truncated,
            edited, another format, no digest with ``verify=True``, or an
            inconsistent structure); the message names the file and the problem.
        """
        from .utils.fileio import DIGEST_KEY, read_safetensors

        try:
            tensors, meta = read_safetensors(path, require_digest=False)
        except OSError as exc:  # missing or unreadable file: the same error as before
            raise ValueError(
                f"{path}: not a readable safetensors file ({exc})."
            ) from exc
        if meta.get("format") != _FORMAT:
            raise ValueError(
                f"{path}: not a skafa TurnFeatures file (format={meta.get('format')!r})."
            )
        if verify and DIGEST_KEY not in meta:
            raise ValueError(
                f"{path}: the file carries no {DIGEST_KEY} digest, so its content cannot "
                "be verified (it was written by skafa before digests existed, or edited). "
                "If you trust it, read it with TurnFeatures.load(path, verify=False) "
                "(its structure is still checked) and save it again."
            )
        try:
            values, offsets, kwargs = _contents_from_file(tensors, meta)
            return cls(values, offsets, **kwargs)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: corrupt TurnFeatures file ({exc}).") from None

    def equals(self, other) -> bool:
        """Compare two containers exactly.

        Parameters
        ----------
        other : object

        Returns
        -------
        bool
            True when values, offsets, sites, feature names, speakers and task ids
            are all equal. NaN equals NaN at the same position (so a container
            equals its copy); explicit zeros of a sparse matrix equal absent ones.
        """
        if not isinstance(other, TurnFeatures):
            return False
        if self.is_sparse != other.is_sparse or self.values.shape != other.values.shape:
            return False
        if self.is_sparse:
            a, b = (sp.csr_matrix(m, copy=True) for m in (self.values, other.values))
            for m in (a, b):
                m.sum_duplicates()  # canonical: sorted indices, no duplicates
                m.eliminate_zeros()
            same_values = (
                np.array_equal(a.indptr, b.indptr)
                and np.array_equal(a.indices, b.indices)
                and _same_array(a.data, b.data)
            )
        else:
            same_values = _same_array(self.values, other.values)

        def eq(a, b):
            return (a is None and b is None) or (
                a is not None and b is not None and np.array_equal(a, b)
            )

        return (
            same_values
            and np.array_equal(self.offsets, other.offsets)
            and self.sites == other.sites
            and self.feature_names == other.feature_names
            and eq(self.speakers, other.speakers)
            and eq(self.task_ids, other.task_ids)
        )


def check_turn_features(X, estimator):
    """Return ``X`` if it is a non-empty TurnFeatures, else raise saying what to do.

    Parameters
    ----------
    X : object
    estimator : object or str
        The caller (its class name is used in messages).

    Returns
    -------
    TurnFeatures
    """

    name = estimator if isinstance(estimator, str) else type(estimator).__name__
    if not isinstance(X, TurnFeatures):
        raise TypeError(
            f"{name} expects a skafa.TurnFeatures (one entry per conversation, one "
            f"feature row per turn), got {type(X).__name__}. Turn conversations into "
            "per-turn features with skafa.TurnActivationTransformer (or another skafa "
            "featurizer), or build TurnFeatures(values, offsets) from your own "
            "per-turn arrays."
        )
    if len(X) == 0:
        raise ValueError(
            f"{name} got a TurnFeatures with 0 conversations; pass at least one "
            "conversation."
        )
    return X


def agents_at(X, steps):
    """Speaker of turn ``steps[i]`` of every conversation (``None`` where ``steps[i] < 0``).

    The one way estimators read agents off predicted turns: ``X`` is a
    :class:`~skafa.TurnFeatures` (which must carry ``speakers``) or a list of
    :class:`~skafa.Conversation`. A negative step ("no alarm") has no speaker.
    """

    steps = np.asarray(steps, dtype=np.int64)
    if isinstance(X, TurnFeatures):
        if X.speakers is None:
            raise ValueError(
                "X carries no speakers, so agents cannot be read off the predicted "
                "turns; build TurnFeatures with speakers=... (one per turn) or use "
                "features from skafa.TurnActivationTransformer."
            )
        out = X.speakers_at(np.where(steps >= 0, steps, 0))
        out[steps < 0] = None
        return out
    return np.asarray(
        [None if s < 0 else c.turns[s].speaker for c, s in zip(X, steps)], dtype=object
    )


def _feature_parts(parts, verb):
    """``parts`` as a non-empty list of :class:`TurnFeatures` (what to ``verb``)."""
    parts = list(parts)
    if not parts:
        raise ValueError(f"nothing to {verb}.")
    for j, p in enumerate(parts):
        if not isinstance(p, TurnFeatures):
            raise TypeError(f"part {j} is a {type(p).__name__}, not TurnFeatures.")
    return parts
