"""Featurizers that read no hidden states: position, speaker and text features per turn.

White-box probes are only worth their cost if they beat what the position of a turn,
its speaker and its words already tell:

* :class:`TurnPositionTransformer` — per-turn position / length / speaker features;
* :class:`TurnTextTransformer` — per-turn bag-of-words (TF-IDF by default), sparse.

They take a list of :class:`~skafa.Conversation` (one sample per conversation) and
return a :class:`~skafa.TurnFeatures`, so they drop into the same pipelines as the
activation extractor (see :mod:`skafa.compose` to combine them)::

    Pipeline([
        ("feats", TurnFeatureUnion([("acts", TurnActivationTransformer(...)),
                                    ("pos", TurnPositionTransformer())])),
        ("sel", SiteSelector(GroupedArgmaxLogisticClassifier())),
    ])
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from numbers import Integral

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator, TransformerMixin, clone
from sklearn.utils.validation import check_is_fitted

from ..base import TurnInputMixin
from ..conversation import check_conversations
from ..features import TurnFeatures
from ..utils.sklearn_compat import HasMethods, Interval, fit_context
from ..utils.validation import task_ids_of

__all__ = ["TurnPositionTransformer", "TurnTextTransformer", "POSITION_FEATURE_GROUPS"]

POSITION_FEATURE_GROUPS = (
    "index_onehot",
    "index",
    "relative",
    "first_last",
    "n_turns",
    "length",
    "speaker",
    "speaker_changed",
)

_OTHER_SPEAKER = "speaker_other"


# ----------------------------------------------------------------- position features
class TurnPositionTransformer(TurnInputMixin, TransformerMixin, BaseEstimator,
                              auto_wrap_output_keys=None):
    """Position, length and speaker features of every turn (no language model).

    One dense row per turn, grouped by conversation in a :class:`~skafa.TurnFeatures`
    single block. Groups of columns (always in this order, whatever the order of
    ``include``):

    ``"index_onehot"``
        ``index=0`` ... ``index=<max_index - 1>`` and ``index>=<max_index>``:
        one-hot turn index, the last bucket collecting every later turn.
    ``"index"``
        ``index``: the 0-based turn index as a number.
    ``"relative"``
        ``relative``: ``i / (n_turns - 1)``, 0 for a single-turn conversation.
    ``"first_last"``
        ``is_first``, ``is_last`` (both 1 in a single-turn conversation).
    ``"n_turns"``
        ``n_turns`` and ``log_n_turns`` of the turn's conversation.
    ``"length"``
        ``log1p_length``: ``log(1 + number of characters of the turn's content)``.
    ``"speaker"``
        ``speaker=<name>`` for each speaker kept at fit time (sorted), plus
        ``speaker_other`` for speakers unseen in training or seen fewer than
        ``min_speaker_frequency`` times.
    ``"speaker_changed"``
        ``speaker_changed``: 1 when the speaker differs from the previous turn's
        (0 for the first turn).

    The numeric columns are not scaled; put a scaler in the probe if it needs one.

    Parameters
    ----------
    max_index : int, default=10
        Number of one-hot index buckets before the ``index>=max_index`` bucket.
    include : sequence of str, default=all groups
        Which groups of columns to produce (see above).
    min_speaker_frequency : int, default=1
        A speaker gets its own column only when it speaks at least this many turns
        in the training conversations; the rest share ``speaker_other``.

    Attributes
    ----------
    speakers_ : ndarray of str
        Speakers with their own one-hot column, sorted.
    speaker_counts_ : dict
        Number of training turns of every speaker.
    feature_names_out_ : ndarray of str
        Names of the output columns.

    See Also
    --------
    TurnTextTransformer : Bag-of-words features of every turn.
    TurnFeatureUnion : Concatenate these with activation features.

    Examples
    --------
    >>> from skafa import Conversation, Turn
    >>> from skafa.featurizers import TurnPositionTransformer
    >>> conv = Conversation([Turn("planner", "Plan."), Turn("coder", "x = 1")])
    >>> Xt = TurnPositionTransformer(include=["relative", "first_last"]).fit_transform([conv])
    >>> Xt.turn_matrix().tolist()
    [[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    """

    _parameter_constraints: dict = {
        "max_index": [Interval(Integral, 1, None, closed="left")],
        "include": ["array-like"],  # group names: checked by _validated_include
        "min_speaker_frequency": [Interval(Integral, 1, None, closed="left")],
    }

    def __init__(self, *, max_index=10, include=POSITION_FEATURE_GROUPS, min_speaker_frequency=1):
        self.max_index = max_index
        self.include = include
        self.min_speaker_frequency = min_speaker_frequency

    def _validated_include(self):
        include = self.include
        if isinstance(include, str) or not isinstance(include, Sequence):
            raise TypeError(
                "TurnPositionTransformer: include must be a sequence of group names "
                f"(e.g. ('relative', 'speaker')), got {include!r}."
            )
        include = list(include)
        unknown = [g for g in include if g not in POSITION_FEATURE_GROUPS]
        if unknown:
            raise ValueError(
                f"TurnPositionTransformer: unknown feature group(s) {unknown}; choose from "
                f"{list(POSITION_FEATURE_GROUPS)}."
            )
        if not include:
            raise ValueError("TurnPositionTransformer: include selects no feature group.")
        if len(set(include)) != len(include):
            raise ValueError(f"TurnPositionTransformer: include has duplicates: {include}.")
        return set(include)

    @fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None):
        """Learn the speaker vocabulary from the training conversations.

        Parameters
        ----------
        X : list of Conversation
            Training conversations.
        y : None
            Ignored.

        Returns
        -------
        self : TurnPositionTransformer
            Fitted transformer.
        """
        convs = check_conversations(X, "TurnPositionTransformer")
        min_freq = int(self.min_speaker_frequency)
        groups = self._validated_include()
        counts = Counter(t.speaker for conv in convs for t in conv.turns)
        self.speaker_counts_ = dict(sorted(counts.items()))
        self.speakers_ = np.asarray(
            sorted(s for s, c in counts.items() if c >= min_freq), dtype=object
        )
        self.feature_names_out_ = np.asarray(self._names(groups), dtype=object)
        return self

    def _names(self, groups):
        names = []
        if "index_onehot" in groups:
            names += [f"index={k}" for k in range(self.max_index)]
            names.append(f"index>={self.max_index}")
        if "index" in groups:
            names.append("index")
        if "relative" in groups:
            names.append("relative")
        if "first_last" in groups:
            names += ["is_first", "is_last"]
        if "n_turns" in groups:
            names += ["n_turns", "log_n_turns"]
        if "length" in groups:
            names.append("log1p_length")
        if "speaker" in groups:
            names += [f"speaker={s}" for s in self.speakers_]
            names.append(_OTHER_SPEAKER)
        if "speaker_changed" in groups:
            names.append("speaker_changed")
        return names

    def transform(self, X):
        """Compute the features of every turn.

        Parameters
        ----------
        X : list of Conversation
            Conversations to featurise.

        Returns
        -------
        Xt : TurnFeatures
            One dense float64 row per turn, ``feature_names`` set, with the speakers
            and task ids of ``X``.
        """
        check_is_fitted(self)
        convs = check_conversations(X, "TurnPositionTransformer")
        groups = self._validated_include()
        n = np.asarray([len(c) for c in convs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(n)])
        pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], n)
        n_row = np.repeat(n, n)
        speakers = np.asarray([t.speaker for c in convs for t in c.turns], dtype=object)

        cols = []
        if "index_onehot" in groups:
            onehot = np.zeros((pos.size, self.max_index + 1))
            onehot[np.arange(pos.size), np.minimum(pos, self.max_index)] = 1.0
            cols.append(onehot)
        if "index" in groups:
            cols.append(pos[:, None].astype(float))
        if "relative" in groups:
            rel = np.where(n_row > 1, pos / np.maximum(n_row - 1, 1), 0.0)
            cols.append(rel[:, None])
        if "first_last" in groups:
            cols.append(np.column_stack([pos == 0, pos == n_row - 1]).astype(float))
        if "n_turns" in groups:
            cols.append(np.column_stack([n_row, np.log(n_row)]).astype(float))
        if "length" in groups:
            lengths = np.asarray([len(t.content) for c in convs for t in c.turns], dtype=float)
            cols.append(np.log1p(lengths)[:, None])
        if "speaker" in groups:
            vocab = {s: k for k, s in enumerate(self.speakers_)}
            other = len(vocab)
            idx = np.asarray([vocab.get(s, other) for s in speakers], dtype=np.int64)
            block = np.zeros((pos.size, other + 1))
            block[np.arange(pos.size), idx] = 1.0
            cols.append(block)
        if "speaker_changed" in groups:
            changed = np.zeros(pos.size)
            if pos.size > 1:
                changed[1:] = (speakers[1:] != speakers[:-1]) & (pos[1:] > 0)
            cols.append(changed[:, None])
        values = np.concatenate(cols, axis=1).astype(np.float64, copy=False)
        names = self.feature_names_out_
        if values.shape[1] != names.size:  # include changed after fit
            raise ValueError(
                f"TurnPositionTransformer: include changed since fit ({values.shape[1]} "
                f"columns now, {names.size} at fit); refit the transformer."
            )
        return TurnFeatures(values, offsets, feature_names=names, speakers=speakers,
                            task_ids=task_ids_of(convs))

    def get_feature_names_out(self, input_features=None):
        """Names of the output columns.

        Parameters
        ----------
        input_features : None
            Ignored (the input is conversations).

        Returns
        -------
        feature_names_out : ndarray of str
        """
        check_is_fitted(self)
        return self.feature_names_out_.copy()

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = True
        tags.transformer_tags.preserves_dtype = []  # the input has no dtype
        return tags


# --------------------------------------------------------------------- text features
class TurnTextTransformer(TurnInputMixin, TransformerMixin, BaseEstimator,
                          auto_wrap_output_keys=None):
    """Bag-of-words features of every turn's text (sparse).

    Fits a text vectorizer on the training turns (each turn one document) and
    returns one sparse row per turn.

    Parameters
    ----------
    vectorizer : estimator, default=None
        A scikit-learn text vectorizer (``fit`` / ``transform`` on a list of
        strings). It is cloned in :meth:`fit`, never modified. ``None`` means
        ``TfidfVectorizer(sublinear_tf=True, min_df=2, max_features=20000)``
        (``min_df=2``: a word must appear in two training turns).
    include_speaker : bool, default=False
        Vectorise ``"{speaker}: {content}"`` instead of the content alone.

    Attributes
    ----------
    vectorizer_ : estimator
        The fitted clone of ``vectorizer``.

    See Also
    --------
    TurnPositionTransformer : Position, length and speaker features.

    Examples
    --------
    >>> from sklearn.feature_extraction.text import CountVectorizer
    >>> from skafa import Conversation, Turn
    >>> from skafa.featurizers import TurnTextTransformer
    >>> conv = Conversation([Turn("a", "add two"), Turn("b", "two plus two")])
    >>> Xt = TurnTextTransformer(CountVectorizer()).fit_transform([conv])
    >>> Xt.feature_names, Xt.turn_matrix().toarray().tolist()
    (('add', 'plus', 'two'), [[1, 0, 1], [0, 1, 2]])
    """

    _parameter_constraints: dict = {
        "vectorizer": [HasMethods(["fit", "transform"]), None],
        "include_speaker": ["boolean"],
    }

    def __init__(self, vectorizer=None, *, include_speaker=False):
        self.vectorizer = vectorizer
        self.include_speaker = include_speaker

    def _texts(self, convs):
        if self.include_speaker:
            return [f"{t.speaker}: {t.content}" for c in convs for t in c.turns]
        return [t.content for c in convs for t in c.turns]

    def _make_vectorizer(self):
        if self.vectorizer is None:
            from sklearn.feature_extraction.text import TfidfVectorizer

            return TfidfVectorizer(sublinear_tf=True, min_df=2, max_features=20000)
        return clone(self.vectorizer)

    def _wrap(self, matrix, convs):
        n = np.asarray([len(c) for c in convs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(n)])
        if sp.issparse(matrix):
            matrix = sp.csr_matrix(matrix)
        else:
            matrix = np.asarray(matrix)
            if matrix.ndim != 2:
                raise ValueError(
                    f"TurnTextTransformer: the vectorizer returned a {matrix.ndim}-D output; "
                    "need 2-D (one row per turn)."
                )
        if matrix.shape[0] != offsets[-1]:
            raise ValueError(
                f"TurnTextTransformer: the vectorizer returned {matrix.shape[0]} rows for "
                f"{offsets[-1]} turns."
            )
        names = self._feature_names_or_none(matrix.shape[1])
        speakers = [t.speaker for c in convs for t in c.turns]
        return TurnFeatures(matrix, offsets, feature_names=names, speakers=speakers,
                            task_ids=task_ids_of(convs))

    def _feature_names_or_none(self, n_features):
        getter = getattr(self.vectorizer_, "get_feature_names_out", None)
        if getter is None:
            return None
        try:
            names = getter()
        except (AttributeError, NotImplementedError, ValueError, TypeError):
            return None
        return names if len(names) == n_features else None

    @fit_context(
        # the vectorizer is validated when it is fitted
        prefer_skip_nested_validation=False
    )
    def fit(self, X, y=None):
        """Fit the vectorizer on the text of every training turn.

        Parameters
        ----------
        X : list of Conversation
            Training conversations.
        y : None
            Ignored.

        Returns
        -------
        self : TurnTextTransformer
            Fitted transformer.
        """
        self.fit_transform(X)
        return self

    @fit_context(
        # the vectorizer is validated when it is fitted
        prefer_skip_nested_validation=False
    )
    def fit_transform(self, X, y=None):
        """Fit the vectorizer and return the training turns' features.

        Parameters
        ----------
        X : list of Conversation
            Training conversations.
        y : None
            Ignored.

        Returns
        -------
        Xt : TurnFeatures
            One (sparse CSR for the default vectorizer) row per turn.
        """
        convs = check_conversations(X, "TurnTextTransformer")
        vectorizer = self._make_vectorizer()
        texts = self._texts(convs)
        try:
            matrix = vectorizer.fit_transform(texts)
        except ValueError as exc:
            raise ValueError(
                f"TurnTextTransformer: fitting the vectorizer on {len(texts)} turns of "
                f"{len(convs)} conversations failed: {exc}"
            ) from exc
        self.vectorizer_ = vectorizer
        return self._wrap(matrix, convs)

    def transform(self, X):
        """Vectorise the text of every turn with the fitted vectorizer.

        Words unseen at fit time get no column.

        Parameters
        ----------
        X : list of Conversation
            Conversations to featurise.

        Returns
        -------
        Xt : TurnFeatures
            One row per turn, with the speakers and task ids of ``X``.
        """
        check_is_fitted(self)
        convs = check_conversations(X, "TurnTextTransformer")
        return self._wrap(self.vectorizer_.transform(self._texts(convs)), convs)

    def get_feature_names_out(self, input_features=None):
        """Names of the output columns (the fitted vectorizer's vocabulary).

        Parameters
        ----------
        input_features : None
            Ignored.

        Returns
        -------
        feature_names_out : ndarray of str
        """
        check_is_fitted(self)
        if not hasattr(self.vectorizer_, "get_feature_names_out"):
            raise AttributeError(
                f"the vectorizer {type(self.vectorizer_).__name__} does not provide "
                "get_feature_names_out."
            )
        return np.asarray(self.vectorizer_.get_feature_names_out(), dtype=object)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = True
        tags.transformer_tags.preserves_dtype = []  # the input has no dtype
        return tags
