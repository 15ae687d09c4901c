"""Baselines that read no hidden states: position, speaker and text features, dummies.

White-box probes are only worth their cost if they beat what the position of a turn,
its speaker and its words already tell. This module provides

* :class:`TurnPositionTransformer` — per-turn position / length / speaker features;
* :class:`TurnTextTransformer` — per-turn bag-of-words (TF-IDF by default), sparse;
* :class:`TurnFeatureUnion` — concatenate several ``conversations -> TurnFeatures``
  transformers turn by turn (e.g. "activations + position");
* :class:`SiteConcatenator` — join chosen activation sites into one block;
* :class:`DummyStepClassifier` — rule-of-thumb decisive-step predictors
  (first turn, a constant index, the most frequent index, the most frequent
  relative position, uniform at random).

The transformers take a list of :class:`~skafa.Conversation` (one sample per
conversation) and return a :class:`~skafa.TurnFeatures`, so they drop into the same
pipelines as the activation extractor::

    Pipeline([
        ("feats", TurnFeatureUnion([("acts", TurnActivationTransformer(...)),
                                    ("pos", TurnPositionTransformer())])),
        ("sel", SiteSelector(GroupedArgmaxLogisticClassifier())),
    ])
"""

from __future__ import annotations

import numbers
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator, TransformerMixin, clone
from sklearn.utils import Bunch, check_random_state
from sklearn.utils.metaestimators import _BaseComposition
from sklearn.utils.parallel import Parallel, delayed
from sklearn.utils.validation import check_is_fitted

from .conversation import Conversation
from .features import TurnFeatures

__all__ = [
    "TurnPositionTransformer",
    "TurnTextTransformer",
    "TurnFeatureUnion",
    "SiteConcatenator",
    "DummyStepClassifier",
]

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


# --------------------------------------------------------------------------- helpers
def _conversation_label(conv, i) -> str:
    parts = []
    if getattr(conv, "task_id", None) is not None:
        parts.append(f"task_id {conv.task_id!r}")
    if getattr(conv, "record_id", None) is not None:
        parts.append(f"record {conv.record_id!r}")
    return f"conversation {i}" + (f" ({', '.join(parts)})" if parts else "")


def _features_label(X, i) -> str:
    if X.task_ids is not None and X.task_ids[i] is not None:
        return f"conversation {i} (task_id {X.task_ids[i]!r})"
    return f"conversation {i}"


def _check_conversations(X, caller) -> list:
    """Return ``X`` as a non-empty list of :class:`Conversation`, or raise naming the bad entry."""
    if isinstance(X, TurnFeatures):
        raise TypeError(
            f"{caller} takes a list of Conversation objects, not TurnFeatures; put it "
            "before (or beside, in a TurnFeatureUnion) the activation extractor."
        )
    if isinstance(X, (str, bytes, Conversation)) or not hasattr(X, "__iter__"):
        raise TypeError(
            f"{caller} takes a list of Conversation objects (one per sample), got "
            f"{type(X).__name__}."
        )
    convs = list(X)
    if not convs:
        raise ValueError(f"{caller} got zero conversations.")
    for i, conv in enumerate(convs):
        if not isinstance(conv, Conversation):
            hint = (
                " Build it with Conversation.from_who_and_when(record) or "
                "Conversation.from_messages(messages)."
                if isinstance(conv, dict)
                else ""
            )
            raise TypeError(
                f"{caller}: conversation {i} is a {type(conv).__name__}, not a "
                f"Conversation.{hint}"
            )
    return convs


def _task_ids(convs):
    ids = [c.task_id for c in convs]
    return ids if any(t is not None for t in ids) else None


def _check_int(value, name, *, minimum, caller):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{caller}: {name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


class _Timer:
    """Print ``[Class] ..... message, total=  0.1s`` like scikit-learn's verbose steps."""

    def __init__(self, source, message):
        self.source, self.message = source, message

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.message is not None:
            elapsed = time.perf_counter() - self.start
            head = f"[{self.source}] "
            tail = f"{self.message}, total={elapsed:6.1f}s"
            print(head + "." * max(70 - len(head) - len(tail), 1) + " " + tail, flush=True)
        return False


# ----------------------------------------------------------------- position features
class TurnPositionTransformer(TransformerMixin, BaseEstimator, auto_wrap_output_keys=None):
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
    >>> from skafa.baselines import TurnPositionTransformer
    >>> conv = Conversation([Turn("planner", "Plan."), Turn("coder", "x = 1")])
    >>> Xt = TurnPositionTransformer(include=["relative", "first_last"]).fit_transform([conv])
    >>> Xt.turn_matrix().tolist()
    [[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    """

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
        convs = _check_conversations(X, "TurnPositionTransformer")
        caller = "TurnPositionTransformer"
        _check_int(self.max_index, "max_index", minimum=1, caller=caller)
        min_freq = _check_int(self.min_speaker_frequency, "min_speaker_frequency",
                              minimum=1, caller=caller)
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
        convs = _check_conversations(X, "TurnPositionTransformer")
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
                            task_ids=_task_ids(convs))

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
        tags.input_tags.two_d_array = False
        tags.requires_fit = True
        return tags


# --------------------------------------------------------------------- text features
class TurnTextTransformer(TransformerMixin, BaseEstimator, auto_wrap_output_keys=None):
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
    >>> from skafa.baselines import TurnTextTransformer
    >>> conv = Conversation([Turn("a", "add two"), Turn("b", "two plus two")])
    >>> Xt = TurnTextTransformer(CountVectorizer()).fit_transform([conv])
    >>> Xt.feature_names, Xt.turn_matrix().toarray().tolist()
    (('add', 'plus', 'two'), [[1, 0, 1], [0, 1, 2]])
    """

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
        if not (hasattr(self.vectorizer, "fit") and hasattr(self.vectorizer, "transform")):
            raise TypeError(
                "TurnTextTransformer: vectorizer must implement fit and transform, got "
                f"{type(self.vectorizer).__name__}."
            )
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
                            task_ids=_task_ids(convs))

    def _feature_names_or_none(self, n_features):
        getter = getattr(self.vectorizer_, "get_feature_names_out", None)
        if getter is None:
            return None
        try:
            names = getter()
        except (AttributeError, NotImplementedError, ValueError, TypeError):
            return None
        return names if len(names) == n_features else None

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
        convs = _check_conversations(X, "TurnTextTransformer")
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
        convs = _check_conversations(X, "TurnTextTransformer")
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
        tags.input_tags.two_d_array = False
        tags.input_tags.string = True
        tags.requires_fit = True
        return tags


# ------------------------------------------------------------------ feature union
def _fit_one(transformer, X, y, *, source, message, want_output):
    with _Timer(source, message):
        est = clone(transformer, safe=False)
        if want_output:
            Xt = est.fit_transform(X, y) if hasattr(est, "fit_transform") else (
                est.fit(X, y).transform(X)
            )
            return est, Xt
        est.fit(X, y)
        return est, None


def _transform_one(transformer, X):
    return transformer.transform(X)


class TurnFeatureUnion(TransformerMixin, _BaseComposition, auto_wrap_output_keys=None):
    """Concatenate the per-turn features of several conversation transformers.

    Like :class:`sklearn.pipeline.FeatureUnion`, but each transformer maps a list of
    conversations to a :class:`~skafa.TurnFeatures` and the results are joined turn
    by turn with :meth:`TurnFeatures.concatenate` (feature names prefixed
    ``"{name}__"``). A single-block part (position, text) is appended to every site
    of a multi-site part (activations), so a :class:`SiteSelector` downstream can
    still choose a site for "activations + position". Multi-site parts must share
    their site names. Combining a sparse text block with a multi-site part
    densifies the text block at every site.

    Unlike ``FeatureUnion``, the transformers in ``transformer_list`` are not
    fitted in place: :meth:`fit` fits clones, kept in :attr:`transformer_list_`.

    Parameters
    ----------
    transformer_list : list of (str, transformer)
        Named transformers (``fit(conversations)``, ``transform(conversations) ->
        TurnFeatures``). A transformer may be ``"drop"`` to leave it out.
    n_jobs : int, default=None
        Transformers fitted / applied in parallel (joblib). ``None`` means 1.
        Keep 1 when a transformer runs a language model.
    verbose : bool, default=False
        Print the time taken to fit each transformer.

    Attributes
    ----------
    transformer_list_ : list of (str, transformer)
        The fitted clones of the transformers that are not ``"drop"``.
    named_transformers_ : Bunch
        The same, by name.

    Examples
    --------
    >>> from skafa import Conversation, Turn
    >>> from skafa.baselines import TurnFeatureUnion, TurnPositionTransformer
    >>> conv = Conversation([Turn("a", "x"), Turn("b", "y")])
    >>> union = TurnFeatureUnion([
    ...     ("rel", TurnPositionTransformer(include=["relative"])),
    ...     ("spk", TurnPositionTransformer(include=["speaker"])),
    ... ])
    >>> union.fit_transform([conv]).feature_names
    ('rel__relative', 'spk__speaker=a', 'spk__speaker=b', 'spk__speaker_other')
    """

    def __init__(self, transformer_list, *, n_jobs=None, verbose=False):
        self.transformer_list = transformer_list
        self.n_jobs = n_jobs
        self.verbose = verbose

    def get_params(self, deep=True):
        """Get parameters, including those of the named transformers (``name__param``).

        Parameters
        ----------
        deep : bool, default=True
            Include the transformers and their parameters.

        Returns
        -------
        params : dict
        """
        return self._get_params("transformer_list", deep=deep)

    def set_params(self, **params):
        """Set parameters; ``name=transformer`` replaces one, ``name__param=v`` sets one.

        Parameters
        ----------
        **params : dict
            Parameters of this union or of its transformers.

        Returns
        -------
        self : TurnFeatureUnion
        """
        self._set_params("transformer_list", **params)
        return self

    @property
    def named_transformers(self):
        """The (unfitted) transformers given as parameters, by name."""
        return Bunch(**dict(self.transformer_list))

    def _validate_transformers(self):
        tl = self.transformer_list
        if isinstance(tl, (str, bytes)) or not isinstance(tl, Sequence) or not tl:
            raise ValueError(
                "TurnFeatureUnion: transformer_list must be a non-empty list of "
                f"(name, transformer) pairs, got {tl!r}."
            )
        for k, item in enumerate(tl):
            pair = isinstance(item, (tuple, list)) and len(item) == 2
            if not pair or not isinstance(item[0], str):
                raise ValueError(
                    f"TurnFeatureUnion: transformer_list[{k}] must be a (name, transformer) "
                    f"pair, got {item!r}."
                )
        names = [name for name, _ in tl]
        self._validate_names(names)
        for name, t in tl:
            if isinstance(t, str):
                if t != "drop":
                    raise ValueError(
                        f"TurnFeatureUnion: transformer {name!r} is the string {t!r}; only "
                        "'drop' is supported."
                    )
                continue
            if not (hasattr(t, "fit") and hasattr(t, "transform")):
                raise TypeError(
                    f"TurnFeatureUnion: transformer {name!r} ({type(t).__name__}) must "
                    "implement fit and transform."
                )
        active = [(name, t) for name, t in tl if not (isinstance(t, str) and t == "drop")]
        if not active:
            raise ValueError("TurnFeatureUnion: every transformer is 'drop'; nothing to compute.")
        return active

    def _fit(self, X, y, want_output):
        active = self._validate_transformers()
        total = len(active)
        results = Parallel(n_jobs=self.n_jobs)(
            delayed(_fit_one)(
                t, X, y,
                source="TurnFeatureUnion",
                message=f"(step {k} of {total}) Processing {name}" if self.verbose else None,
                want_output=want_output,
            )
            for k, (name, t) in enumerate(active, 1)
        )
        self.transformer_list_ = [(name, est) for (name, _), (est, _) in zip(active, results)]
        self.named_transformers_ = Bunch(**dict(self.transformer_list_))
        return [Xt for _, Xt in results]

    def fit(self, X, y=None):
        """Fit a clone of every transformer on ``X``.

        Parameters
        ----------
        X : list of Conversation
            Training conversations.
        y : array-like, default=None
            Passed to every transformer's ``fit``.

        Returns
        -------
        self : TurnFeatureUnion
            Fitted union.
        """
        self._fit(X, y, want_output=False)
        return self

    def fit_transform(self, X, y=None):
        """Fit every transformer, transform ``X`` and concatenate per turn.

        Parameters
        ----------
        X : list of Conversation
            Training conversations.
        y : array-like, default=None
            Passed to every transformer's ``fit``.

        Returns
        -------
        Xt : TurnFeatures
        """
        parts = self._fit(X, y, want_output=True)
        return self._concatenate(parts, X)

    def transform(self, X):
        """Transform ``X`` with every fitted transformer and concatenate per turn.

        Parameters
        ----------
        X : list of Conversation
            Conversations to featurise.

        Returns
        -------
        Xt : TurnFeatures
        """
        check_is_fitted(self)
        parts = Parallel(n_jobs=self.n_jobs)(
            delayed(_transform_one)(t, X) for _, t in self.transformer_list_
        )
        return self._concatenate(parts, X)

    def _concatenate(self, parts, X):
        names = [name for name, _ in self.transformer_list_]
        n_samples = len(X)
        for name, part in zip(names, parts):
            if not isinstance(part, TurnFeatures):
                raise TypeError(
                    f"TurnFeatureUnion: transformer {name!r} returned a "
                    f"{type(part).__name__}, not TurnFeatures."
                )
            if len(part) != n_samples:
                raise ValueError(
                    f"TurnFeatureUnion: transformer {name!r} returned {len(part)} "
                    f"conversations for {n_samples} inputs."
                )
        first = parts[0]
        for name, part in zip(names[1:], parts[1:]):
            if not np.array_equal(part.offsets, first.offsets):
                bad = int(np.flatnonzero(part.n_turns != first.n_turns)[0])
                raise ValueError(
                    f"TurnFeatureUnion: transformers {names[0]!r} and {name!r} disagree on "
                    f"the number of turns of {_features_label(first, bad)}: "
                    f"{int(first.n_turns[bad])} vs {int(part.n_turns[bad])}."
                )
        multi = [(name, p.sites) for name, p in zip(names, parts)
                 if p.values.ndim == 3 and p.n_sites > 1]
        for name, sites in multi[1:]:
            if sites != multi[0][1]:
                raise ValueError(
                    f"TurnFeatureUnion: multi-site transformers {multi[0][0]!r} and {name!r} "
                    f"have different sites ({list(multi[0][1])[:4]}... vs {list(sites)[:4]}...)."
                )
        return TurnFeatures.concatenate(parts, prefixes=names)

    def get_feature_names_out(self, input_features=None):
        """Output feature names, ``"{transformer name}__{feature name}"``.

        Parameters
        ----------
        input_features : None
            Ignored.

        Returns
        -------
        feature_names_out : ndarray of str
        """
        check_is_fitted(self)
        out = []
        for name, t in self.transformer_list_:
            if not hasattr(t, "get_feature_names_out"):
                raise AttributeError(
                    f"transformer {name!r} ({type(t).__name__}) does not provide "
                    "get_feature_names_out."
                )
            out.extend(f"{name}__{f}" for f in t.get_feature_names_out())
        return np.asarray(out, dtype=object)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False
        tags.requires_fit = True
        return tags

    def _sk_visual_block_(self):
        from sklearn.utils._repr_html.estimator import _VisualBlock

        names, transformers = zip(*self.transformer_list)
        return _VisualBlock("parallel", transformers, names=names)


# --------------------------------------------------------------- site concatenator
class SiteConcatenator(TransformerMixin, BaseEstimator, auto_wrap_output_keys=None):
    """Join several activation sites of a :class:`~skafa.TurnFeatures` into one block.

    ``resid_pre.10`` (576 features) and ``resid_pre.20`` (576) become one site
    ``"resid_pre.10+resid_pre.20"`` with 1152 features, named
    ``"{site}__{feature}"``, in the order of ``sites``. Speakers and task ids are kept.

    Parameters
    ----------
    sites : str or list of str
        Site names to join, in order.

    Attributes
    ----------
    sites_ : tuple of str
        The validated site names.
    site_name_ : str
        Name of the output site (``"+".join(sites_)``).
    n_site_features_ : int
        Features per input site seen in :meth:`fit`.
    feature_names_out_ : ndarray of str
        Output feature names.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> from skafa.baselines import SiteConcatenator
    >>> X = TurnFeatures(np.arange(12.).reshape(2, 3, 2), [0, 2], sites=["a", "b", "c"])
    >>> Xt = SiteConcatenator(["c", "a"]).fit_transform(X)
    >>> Xt.sites, Xt.turn_matrix().tolist()
    (('c+a',), [[4.0, 5.0, 0.0, 1.0], [10.0, 11.0, 6.0, 7.0]])
    """

    def __init__(self, sites):
        self.sites = sites

    @staticmethod
    def _check_input(X):
        if not isinstance(X, TurnFeatures):
            raise TypeError(
                f"SiteConcatenator takes TurnFeatures (e.g. from the activation extractor), "
                f"got {type(X).__name__}."
            )

    def fit(self, X, y=None):
        """Check that every requested site exists in ``X``.

        Parameters
        ----------
        X : TurnFeatures
        y : None
            Ignored.

        Returns
        -------
        self : SiteConcatenator
        """
        self._check_input(X)
        sites = [self.sites] if isinstance(self.sites, str) else self.sites
        if not isinstance(sites, Sequence) or not sites:
            raise ValueError(
                f"SiteConcatenator: sites must be a non-empty list of names, got {self.sites!r}."
            )
        sites = tuple(sites)
        if not all(isinstance(s, str) for s in sites):
            raise TypeError(f"SiteConcatenator: site names must be strings, got {list(sites)}.")
        if len(set(sites)) != len(sites):
            raise ValueError(f"SiteConcatenator: duplicate site names in {list(sites)}.")
        missing = [s for s in sites if s not in X.sites]
        if missing:
            raise ValueError(
                f"SiteConcatenator: site(s) {missing} not in the input; available: "
                f"{X._site_summary()}."
            )
        self.sites_ = sites
        self.site_name_ = "+".join(sites)
        self.n_site_features_ = X.n_features
        base = X.feature_names or tuple(f"x{k}" for k in range(X.n_features))
        self.feature_names_out_ = np.asarray(
            [f"{s}__{f}" for s in sites for f in base], dtype=object
        )
        return self

    def transform(self, X):
        """Return ``X`` with the chosen sites joined into one block.

        Parameters
        ----------
        X : TurnFeatures

        Returns
        -------
        Xt : TurnFeatures
            A single site named :attr:`site_name_`.
        """
        check_is_fitted(self)
        self._check_input(X)
        missing = [s for s in self.sites_ if s not in X.sites]
        if missing:
            raise ValueError(
                f"SiteConcatenator: site(s) {missing} seen in fit are not in this input; "
                f"available: {X._site_summary()}."
            )
        if X.n_features != self.n_site_features_:
            raise ValueError(
                f"SiteConcatenator: input has {X.n_features} features per site, fit saw "
                f"{self.n_site_features_}."
            )
        if X.values.ndim == 2:  # a single block: sites_ is that block
            values = X.values
        else:
            idx = [X.sites.index(s) for s in self.sites_]
            block = X.values[:, idx, :]
            values = block.reshape(block.shape[0], 1, len(idx) * block.shape[2])
        return X._replace(values=values, sites=(self.site_name_,),
                          feature_names=self.feature_names_out_)

    def get_feature_names_out(self, input_features=None):
        """Output feature names, ``"{site}__{feature}"``.

        Parameters
        ----------
        input_features : None
            Ignored.

        Returns
        -------
        feature_names_out : ndarray of str
        """
        check_is_fitted(self)
        return self.feature_names_out_.copy()

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False
        tags.requires_fit = True
        return tags


# ------------------------------------------------------------------ dummy classifier
_STRATEGIES = ("first", "constant", "most_frequent", "most_frequent_relative", "uniform")


def _relative_bins(steps, n_turns, n_bins):
    # floor(n_bins * i / (n - 1)) in exact integer arithmetic; 0 for one-turn conversations.
    bins = (np.asarray(steps, dtype=np.int64) * n_bins) // np.maximum(n_turns - 1, 1)
    return np.minimum(bins, n_bins - 1)


class DummyStepClassifier(BaseEstimator):
    """Predict the decisive step by a rule that reads no content.

    The floor a failure-attribution model has to beat. Works on a list of
    :class:`~skafa.Conversation` or on a :class:`~skafa.TurnFeatures` (only the
    number of turns, and the speakers for :meth:`predict_agent`, are used).

    Parameters
    ----------
    strategy : {"first", "constant", "most_frequent", "most_frequent_relative", \
            "uniform"}, default="first"
        * ``"first"``: turn 0.
        * ``"constant"``: turn ``constant``. A negative value counts from the end
          (``-1`` is the last turn). The index is clipped into each conversation:
          a conversation with fewer than ``constant + 1`` turns gets its last
          turn, one with fewer than ``-constant`` turns its first.
        * ``"most_frequent"``: the decisive index seen most often in training
          (ties go to the smallest), clipped to each conversation's last turn.
        * ``"most_frequent_relative"``: the relative position ``i / (n - 1)``
          (0 for one-turn conversations) is cut into ``n_bins`` equal bins; the
          bin seen most often in training (ties: smallest) is mapped back, in each
          conversation, to the turn whose relative position is nearest the bin's
          centre (ties: the earlier turn). That turn lies in the bin whenever the
          conversation has a turn there.
        * ``"uniform"``: a turn drawn uniformly from each conversation.
    constant : int, default=None
        The turn index for ``strategy="constant"`` (required there).
    n_bins : int, default=10
        Number of relative-position bins for ``"most_frequent_relative"``.
    random_state : int, RandomState instance or None, default=None
        Seeds ``"uniform"``. With an int, every call of :meth:`predict` draws the
        same steps.

    Attributes
    ----------
    n_train_ : int
        Number of training conversations.
    step_counts_ : ndarray of int
        ``step_counts_[i]``: training conversations whose decisive step is ``i``.
    most_frequent_step_ : int
        The most frequent training step (smallest on ties).
    relative_bin_counts_ : ndarray of int, shape (n_bins,)
        Training steps per relative-position bin.
    most_frequent_bin_ : int
        The most frequent bin (smallest on ties).

    Notes
    -----
    Not a scikit-learn classifier (no ``ClassifierMixin``): one sample is a whole
    conversation and ``score`` is step accuracy. Pass an explicit grouped splitter
    to cross-validation utilities.

    Examples
    --------
    >>> from skafa import Conversation, Turn
    >>> from skafa.baselines import DummyStepClassifier
    >>> convs = [Conversation([Turn("a", "x")] * n) for n in (2, 3, 4)]
    >>> dummy = DummyStepClassifier(strategy="constant", constant=2).fit(convs, [1, 2, 2])
    >>> dummy.predict(convs).tolist(), dummy.score(convs, [1, 2, 2])
    ([1, 2, 2], 1.0)
    """

    def __init__(self, *, strategy="first", constant=None, n_bins=10, random_state=None):
        self.strategy = strategy
        self.constant = constant
        self.n_bins = n_bins
        self.random_state = random_state

    # ------------------------------------------------------------------ input
    @staticmethod
    def _turn_counts(X):
        if isinstance(X, TurnFeatures):
            return X.n_turns.astype(np.int64)
        convs = _check_conversations(X, "DummyStepClassifier")
        return np.asarray([len(c) for c in convs], dtype=np.int64)

    @staticmethod
    def _label(X, i):
        if isinstance(X, TurnFeatures):
            return _features_label(X, i)
        return _conversation_label(list(X)[i] if not isinstance(X, Sequence) else X[i], i)

    def _check_y(self, X, y, n_turns):
        from .estimators import _validate_steps

        return _validate_steps(y, n_turns, lambda i: self._label(X, i))

    # -------------------------------------------------------------------- fit
    def fit(self, X, y, groups=None):
        """Record the training step distribution.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
            Training conversations.
        y : array-like of int, shape (n_conversations,)
            Decisive step of each conversation.
        groups : array-like, default=None
            Ignored; accepted for API compatibility.

        Returns
        -------
        self : DummyStepClassifier
            Fitted estimator.
        """
        if self.strategy not in _STRATEGIES:
            raise ValueError(
                f"DummyStepClassifier: unknown strategy {self.strategy!r}; choose from "
                f"{list(_STRATEGIES)}."
            )
        if self.strategy == "constant":
            c = self.constant
            if c is None or isinstance(c, bool) or not isinstance(c, numbers.Integral):
                raise ValueError(
                    "DummyStepClassifier: strategy='constant' needs an int constant "
                    f"(a turn index; negative counts from the end), got {c!r}."
                )
        n_bins = _check_int(self.n_bins, "n_bins", minimum=1, caller="DummyStepClassifier")
        n_turns = self._turn_counts(X)
        y = self._check_y(X, y, n_turns)
        self.n_train_ = int(y.size)
        self.step_counts_ = np.bincount(y)
        self.most_frequent_step_ = int(np.argmax(self.step_counts_))
        self.relative_bin_counts_ = np.bincount(_relative_bins(y, n_turns, n_bins),
                                                minlength=n_bins)
        self.most_frequent_bin_ = int(np.argmax(self.relative_bin_counts_))
        return self

    # ---------------------------------------------------------------- predict
    def _deterministic_steps(self, n_turns):
        last = n_turns - 1
        if self.strategy == "first":
            return np.zeros_like(n_turns)
        if self.strategy == "constant":
            c = int(self.constant)
            steps = np.full_like(n_turns, c) if c >= 0 else n_turns + c
            return np.clip(steps, 0, last)
        if self.strategy == "most_frequent":
            return np.minimum(self.most_frequent_step_, last)
        if self.strategy == "most_frequent_relative":
            centre = (self.most_frequent_bin_ + 0.5) / self.n_bins
            steps = np.empty_like(n_turns)
            for i, n in enumerate(n_turns):
                rel = np.arange(n) / (n - 1) if n > 1 else np.zeros(1)
                steps[i] = int(np.argmin(np.abs(rel - centre)))  # first minimum on ties
            return steps
        raise AssertionError(self.strategy)

    def predict(self, X):
        """Predict the decisive step of each conversation.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures

        Returns
        -------
        steps : ndarray of int, shape (n_conversations,)
        """
        check_is_fitted(self)
        n_turns = self._turn_counts(X)
        if self.strategy == "uniform":
            rng = check_random_state(self.random_state)
            return rng.randint(0, n_turns).astype(np.int64)
        return self._deterministic_steps(n_turns).astype(np.int64)

    def predict_agent(self, X):
        """Speaker of the predicted turn of each conversation.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
            A TurnFeatures must carry ``speakers``.

        Returns
        -------
        agents : ndarray of object, shape (n_conversations,)
        """
        steps = self.predict(X)
        if isinstance(X, TurnFeatures):
            return X.speakers_at(steps)
        convs = list(X)
        return np.asarray([c.turns[s].speaker for c, s in zip(convs, steps)], dtype=object)

    def turn_predict_proba(self, X):
        """Probability that each turn is the predicted one.

        One-hot on the predicted turn for the deterministic strategies;
        ``1 / n_turns`` everywhere for ``"uniform"``.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures

        Returns
        -------
        proba : list of ndarray
            One 1-D array per conversation, summing to 1.
        """
        check_is_fitted(self)
        n_turns = self._turn_counts(X)
        if self.strategy == "uniform":
            return [np.full(n, 1.0 / n) for n in n_turns]
        out = []
        for n, s in zip(n_turns, self._deterministic_steps(n_turns)):
            p = np.zeros(n)
            p[s] = 1.0
            out.append(p)
        return out

    def turn_decision_function(self, X):
        """Score of every turn: equal to :meth:`turn_predict_proba`.

        For ``"uniform"`` all turns score the same, so the scores do not say
        which turn :meth:`predict` draws.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures

        Returns
        -------
        scores : list of ndarray
            One 1-D array per conversation.
        """
        return self.turn_predict_proba(X)

    def score(self, X, y):
        """Step accuracy of :meth:`predict` on ``X``.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
        y : array-like of int, shape (n_conversations,)

        Returns
        -------
        accuracy : float
        """
        steps = self.predict(X)
        y = self._check_y(X, y, self._turn_counts(X))
        return float(np.mean(steps == y))

    def expected_accuracy(self, X, y):
        """Expected step accuracy over the strategy's randomness.

        ``mean(1 / n_turns)`` for ``"uniform"``; the exact accuracy of
        :meth:`predict` for the deterministic strategies.

        Parameters
        ----------
        X : list of Conversation or TurnFeatures
        y : array-like of int, shape (n_conversations,)

        Returns
        -------
        accuracy : float
        """
        check_is_fitted(self)
        n_turns = self._turn_counts(X)
        y = self._check_y(X, y, n_turns)
        if self.strategy == "uniform":
            return float(np.mean(1.0 / n_turns))
        return float(np.mean(self._deterministic_steps(n_turns) == y))

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.estimator_type = None  # deliberately not a classifier: see Notes
        tags.target_tags.required = True
        tags.input_tags.two_d_array = False
        tags.non_deterministic = self.strategy == "uniform"
        return tags
