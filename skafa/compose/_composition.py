"""Composition: combine and adapt per-turn transformers, and pipelines that know skafa.

- :class:`PerTurn` applies any scikit-learn transformer to the turn rows of every
  site block of a :class:`~skafa.TurnFeatures`;
- :class:`TurnFeatureUnion` concatenates several ``conversations -> TurnFeatures``
  transformers turn by turn (e.g. "activations + position");
- :class:`SiteConcatenator` joins chosen activation sites into one block;
- :class:`AttributionPipeline` is a :class:`~sklearn.pipeline.Pipeline` that also
  delegates skafa's conversation-level methods (``predict_agent``,
  ``turn_decision_function``, ``turn_predict_proba``), and :func:`final_step_call`
  is the one way to call such a method through a pipeline.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator, MetaEstimatorMixin, TransformerMixin, clone
from sklearn.pipeline import Pipeline
from sklearn.utils import Bunch, get_tags
from sklearn.utils.metaestimators import available_if
from sklearn.utils.parallel import Parallel, delayed
from sklearn.utils.validation import check_is_fitted

from ..base import DecisiveStepMixin, TurnInputMixin
from ..features import TurnFeatures, check_turn_features
from ..utils.progress import Timer
from ..utils.sklearn_compat import (
    BaseComposition,
    HasMethods,
    final_estimator_has,
    fit_context,
    name_estimators,
)
from ..utils.validation import check_feature_names, describe

__all__ = [
    "PerTurn",
    "TurnFeatureUnion",
    "SiteConcatenator",
    "AttributionPipeline",
    "make_attribution_pipeline",
    "final_step_call",
    "final_step_input",
]


# ---------------------------------------------------------------------------
# Turn-level transformers inside pipelines
# ---------------------------------------------------------------------------


def _transformer_has(attr):
    def check(self):
        getattr(self.transformer, attr)
        return True

    return check


class PerTurn(TurnInputMixin, TransformerMixin, MetaEstimatorMixin, BaseEstimator,
              auto_wrap_output_keys=None):
    """Apply a scikit-learn transformer to the turn rows of every site block.

    A plain ``StandardScaler`` or ``PCA`` cannot read the ragged
    :class:`~skafa.TurnFeatures`; ``PerTurn(StandardScaler())`` fits one clone of
    the transformer per site on the training turn rows and transforms the
    rows of each block, returning a new :class:`~skafa.TurnFeatures` with the
    same conversations, offsets, speakers, task ids and site names. Inside a
    :class:`~sklearn.pipeline.Pipeline` (and hence cross-validation) it is fitted
    on the training conversations only.

    Parameters
    ----------
    transformer : transformer object
        Any estimator with ``fit`` and ``transform`` working on 2-D turn
        matrices (``StandardScaler``, ``PCA``, ``TruncatedSVD``, ...). It is
        fitted without ``y``.

    Attributes
    ----------
    transformers_ : dict of str -> transformer
        One fitted clone per site, keyed by site name.
    sites_ : tuple of str
        Sites seen in ``fit``. ``transform`` accepts any subset of them.
    n_features_in_ : int
        Number of features per turn seen in ``fit``.
    feature_names_in_ : ndarray of str
        Feature names of ``X`` when it has them; ``transform`` refuses features
        whose names differ (other names, or the same in another order).

    Notes
    -----
    A single-block (2-D or sparse) container stays a single block; with
    several sites the outputs are stacked into a dense 3-D block, which
    requires every site's transformer to output the same number of features.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.preprocessing import StandardScaler
    >>> from skafa import TurnFeatures
    >>> from skafa.compose import PerTurn
    >>> X = TurnFeatures(np.arange(12.0).reshape(6, 2), [0, 2, 6])
    >>> Xt = PerTurn(StandardScaler()).fit_transform(X)
    >>> Xt.n_turns.tolist(), bool(abs(Xt.turn_matrix().mean()) < 1e-12)
    ([2, 4], True)
    """

    _parameter_constraints: dict = {"transformer": [HasMethods(["fit", "transform"])]}

    def __init__(self, transformer):
        self.transformer = transformer

    @fit_context(
        # the wrapped transformer is validated when it is fitted
        prefer_skip_nested_validation=False
    )
    def fit(self, X, y=None):
        """Fit one clone of ``transformer`` per site on the turn rows of ``X``.

        Parameters
        ----------
        X : TurnFeatures
        y : None
            Ignored (the per-conversation target has no per-turn meaning).

        Returns
        -------
        self : object
        """
        X = check_turn_features(X, self)
        self.transformers_ = {
            site: clone(self.transformer).fit(X.turn_matrix(site)) for site in X.sites
        }
        self.sites_ = tuple(X.sites)
        self.n_features_in_ = X.n_features
        check_feature_names(self, X, reset=True)
        return self

    def transform(self, X):
        """Transform the turn rows of every site block.

        Parameters
        ----------
        X : TurnFeatures
            Must hold sites seen in ``fit`` (any subset of them).

        Returns
        -------
        Xt : TurnFeatures
            Same conversations, speakers, task ids and sites; new values.
        """
        check_is_fitted(self)
        X = check_turn_features(X, self)
        if X.n_features != self.n_features_in_:
            raise ValueError(
                f"X has {X.n_features} features per turn, but PerTurn was fitted with "
                f"{self.n_features_in_}."
            )
        check_feature_names(self, X, reset=False)
        unknown = [s for s in X.sites if s not in self.transformers_]
        if unknown:
            raise ValueError(
                f"PerTurn was fitted on sites {list(self.sites_)}; X holds unknown "
                f"site(s) {unknown}."
            )
        blocks = []
        for site in X.sites:
            out = self.transformers_[site].transform(X.turn_matrix(site))
            if out.shape[0] != X.n_turns_total:
                raise ValueError(
                    f"the transformer returned {out.shape[0]} rows for site {site!r}; "
                    f"PerTurn needs one output row per turn ({X.n_turns_total})."
                )
            blocks.append(out)
        if X.values.ndim == 2:
            values = blocks[0] if sp.issparse(blocks[0]) else np.asarray(blocks[0])
        else:
            widths = {b.shape[1] for b in blocks}
            if len(widths) != 1:
                raise ValueError(
                    f"the per-site transformers output different widths {sorted(widths)}; "
                    "a multi-site TurnFeatures needs the same number of features at "
                    "every site."
                )
            blocks = [b.toarray() if sp.issparse(b) else np.asarray(b) for b in blocks]
            values = np.stack(blocks, axis=1)
        names = None
        if hasattr(self.transformer, "get_feature_names_out"):
            try:
                names = self.get_feature_names_out()
            except (AttributeError, ValueError, NotImplementedError):
                names = None
            if names is not None and len(names) != values.shape[-1]:
                names = None
        return X.with_values(
            values,
            sites=X.sites,
            feature_names=None if names is None else [str(n) for n in names],
        )

    @available_if(_transformer_has("get_feature_names_out"))
    def get_feature_names_out(self, input_features=None):
        """Output feature names (shared by all sites).

        Parameters
        ----------
        input_features : array-like of str, default=None
            Input feature names; defaults to ``feature_names_in_`` or
            ``x0, x1, ...``.

        Returns
        -------
        feature_names_out : ndarray of str
        """
        check_is_fitted(self)
        if input_features is None:
            input_features = getattr(self, "feature_names_in_", None)
        if input_features is None:
            input_features = [f"x{i}" for i in range(self.n_features_in_)]
        input_features = np.asarray(input_features, dtype=object)
        if input_features.shape != (self.n_features_in_,):
            raise ValueError(
                f"input_features should have length {self.n_features_in_}, got "
                f"{input_features.shape[0]}."
            )
        first = next(iter(self.transformers_.values()))
        return np.asarray(first.get_feature_names_out(input_features), dtype=object)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # sparse blocks inside a TurnFeatures are passed to the transformer; bare
        # sparse matrices are refused.
        tags.input_tags.sparse = False
        tags.transformer_tags.preserves_dtype = list(
            get_tags(self.transformer).transformer_tags.preserves_dtype)
        return tags


# ------------------------------------------------------------------ feature union
def _fit_one(transformer, X, y, *, source, message, want_output):
    with Timer(source, message):
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


class TurnFeatureUnion(TurnInputMixin, TransformerMixin, BaseComposition,
                       auto_wrap_output_keys=None):
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
    >>> from skafa.compose import TurnFeatureUnion
    >>> from skafa.featurizers import TurnPositionTransformer
    >>> conv = Conversation([Turn("a", "x"), Turn("b", "y")])
    >>> union = TurnFeatureUnion([
    ...     ("rel", TurnPositionTransformer(include=["relative"])),
    ...     ("spk", TurnPositionTransformer(include=["speaker"])),
    ... ])
    >>> union.fit_transform([conv]).feature_names
    ('rel__relative', 'spk__speaker=a', 'spk__speaker=b', 'spk__speaker_other')
    """

    _parameter_constraints: dict = {
        "transformer_list": [list, tuple],  # the pairs: checked by _validate_transformers
        "n_jobs": [Integral, None],
        "verbose": ["verbose"],
    }

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

    @fit_context(
        # the transformers are validated when they are fitted
        prefer_skip_nested_validation=False
    )
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

    @fit_context(
        # the transformers are validated when they are fitted
        prefer_skip_nested_validation=False
    )
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
                    f"the number of turns of {describe(first, bad)}: "
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
        tags.transformer_tags.preserves_dtype = []  # the input has no dtype
        tags.requires_fit = True
        return tags

    def _sk_visual_block_(self):
        from ..utils.sklearn_compat import VisualBlock

        names, transformers = zip(*self.transformer_list)
        return VisualBlock("parallel", transformers, names=names)


# --------------------------------------------------------------- site concatenator
class SiteConcatenator(TurnInputMixin, TransformerMixin, BaseEstimator,
                       auto_wrap_output_keys=None):
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
    n_features_in_ : int
        The same (scikit-learn's name).

    feature_names_in_ : ndarray of str
        Feature names of ``X`` in :meth:`fit`, when it has them; :meth:`transform`
        refuses features whose names differ (other names, or another order).
    feature_names_out_ : ndarray of str
        Output feature names.

    Examples
    --------
    >>> import numpy as np
    >>> from skafa import TurnFeatures
    >>> from skafa.compose import SiteConcatenator
    >>> X = TurnFeatures(np.arange(12.).reshape(2, 3, 2), [0, 2], sites=["a", "b", "c"])
    >>> Xt = SiteConcatenator(["c", "a"]).fit_transform(X)
    >>> Xt.sites, Xt.turn_matrix().tolist()
    (('c+a',), [[4.0, 5.0, 0.0, 1.0], [10.0, 11.0, 6.0, 7.0]])
    """

    _parameter_constraints: dict = {"sites": [str, "array-like"]}

    def __init__(self, sites):
        self.sites = sites

    @staticmethod
    def _check_input(X):
        if not isinstance(X, TurnFeatures):
            raise TypeError(
                f"SiteConcatenator takes TurnFeatures (e.g. from the activation extractor), "
                f"got {type(X).__name__}."
            )
        check_turn_features(X, "SiteConcatenator")

    @fit_context(prefer_skip_nested_validation=True)
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
        sites = [self.sites] if isinstance(self.sites, str) else list(self.sites)
        if not sites:
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
        self.n_features_in_ = X.n_features

        check_feature_names(self, X, reset=True)
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
        check_feature_names(self, X, reset=False)
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
        tags.transformer_tags.preserves_dtype = ["float64", "float32"]
        tags.requires_fit = True
        return tags


# ------------------------------------------------------------------ pipelines
def final_step_input(estimator, X):
    """The last step of a fitted pipeline and ``X`` transformed by every earlier step.

    The one way skafa delegates to a pipeline's last step: scikit-learn's
    :class:`~sklearn.pipeline.Pipeline` only forwards the methods it knows
    (``predict``, ``score``, ...), not ``predict_agent``,
    ``turn_decision_function`` or ``turn_predict_proba``.

    Parameters
    ----------
    estimator : estimator or sklearn Pipeline
        A fitted skafa estimator, or a fitted Pipeline ending in one.
    X : list of Conversation or TurnFeatures
        Input of the pipeline.

    Returns
    -------
    final : estimator
        The last step (or ``estimator`` itself when it is not a Pipeline).
    Xt : object
        ``X`` after the transforms of all earlier steps.
    """
    if isinstance(estimator, Pipeline):
        check_is_fitted(estimator)
        Xt = X
        for _, _, transform in estimator._iter(with_final=False):
            Xt = transform.transform(Xt)
        return estimator.steps[-1][1], Xt
    return estimator, X


def final_step_call(estimator, method, X):
    """Call ``method`` of an estimator, or of a pipeline's last step on transformed ``X``.

    Parameters
    ----------
    estimator : estimator or sklearn Pipeline
        A fitted skafa estimator, or a fitted Pipeline ending in one.
    method : str
        ``"predict_agent"``, ``"turn_decision_function"`` or ``"turn_predict_proba"``
        (any method of the last step works).
    X : list of Conversation or TurnFeatures
        Input of the pipeline.

    Returns
    -------
    object
        What the last step's ``method`` returns.
    """
    final, Xt = final_step_input(estimator, X)
    return getattr(final, method)(Xt)


class AttributionPipeline(Pipeline, DecisiveStepMixin):
    """A :class:`~sklearn.pipeline.Pipeline` that also delegates skafa's methods.

    Identical to scikit-learn's Pipeline (same parameters, cloning, grid search,
    HTML repr), plus ``predict_agent``, ``turn_decision_function`` and
    ``turn_predict_proba``, available when the last step has them. They run the
    transforms of all earlier steps, then call the last step.

    Parameters
    ----------
    steps : list of (str, estimator) tuples
        As in :class:`~sklearn.pipeline.Pipeline`.
    transform_input : list of str, default=None
        As in :class:`~sklearn.pipeline.Pipeline`.
    memory : str or object with the joblib.Memory interface, default=None
        As in :class:`~sklearn.pipeline.Pipeline`.
    verbose : bool, default=False
        As in :class:`~sklearn.pipeline.Pipeline`.

    See Also
    --------
    make_attribution_pipeline : Build one without naming the steps.

    Examples
    --------
    >>> from skafa import AttributionPipeline, TurnPositionTransformer, GroupedArgmaxLogisticClassifier
    >>> from skafa.testing import make_conversations
    >>> convs = make_conversations(12)
    >>> y = [c.mistake_step for c in convs]
    >>> pipe = AttributionPipeline([("pos", TurnPositionTransformer()),
    ...                             ("probe", GroupedArgmaxLogisticClassifier())]).fit(convs, y)
    >>> len(pipe.predict_agent(convs)) == len(pipe.turn_predict_proba(convs)) == 12
    True
    """

    def __init__(self, steps, *, transform_input=None, memory=None, verbose=False):
        super().__init__(steps, transform_input=transform_input, memory=memory,
                         verbose=verbose)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # scikit-learn's Pipeline takes only some tags from its steps; the input a
        # pipeline accepts is its first step's, the target it needs its last step's.
        steps = [s for _, s in self.steps if s is not None and s != "passthrough"]
        try:
            first, last = get_tags(steps[0]), get_tags(steps[-1])
        except (IndexError, ValueError, AttributeError, TypeError):
            return tags  # invalid steps: fit reports them
        for name in ("one_d_array", "two_d_array", "three_d_array", "categorical",
                     "string", "dict", "positive_only", "allow_nan"):
            setattr(tags.input_tags, name, getattr(first.input_tags, name))
        tags.target_tags.required = last.target_tags.required
        return tags

    # ------------------------------------------- DecisiveStepMixin hooks
    # Pipeline's own predict and score come first in the MRO (with metadata
    # routing); the mixin adds predict_agent, turn_decision_function and
    # turn_predict_proba, forwarded to the last step on transformed X.
    def _has_decisive_method(self, name):
        return final_estimator_has(name)(self)

    def _decisive_delegate(self, X, method):
        return final_step_input(self, X)


def make_attribution_pipeline(*steps, memory=None, verbose=False):
    """Build an :class:`AttributionPipeline`, naming steps like ``make_pipeline``.

    Parameters
    ----------
    *steps : estimators
    memory : str or object with the joblib.Memory interface, default=None
    verbose : bool, default=False

    Returns
    -------
    AttributionPipeline
    """
    return AttributionPipeline(name_estimators(steps), memory=memory, verbose=verbose)
