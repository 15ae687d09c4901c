"""The configurations of the pre-registered comparison, buildable by name.

``docs/benchmarks.md`` (section 3, "Beat position") fixed 27 configurations before
any of them ran on a real record: 3 reads (``last``, ``recap``, ``echo``) x 9 probe
settings, in an order that breaks ties. This module holds configurations 1-8 of
that table (a probe, its C grid, one site or the top-3 average, with or without
position features) so that the benchmark, :class:`~skafa.FailureAttributor`'s
default and a user's own experiment build them from one definition:

>>> from skafa.configurations import configuration_names, make_configuration
>>> configuration_names()[:2]
['last: logistic/single/acts', 'last: logistic/single/acts+pos']
>>> extractor, selector = make_configuration("last: softmax/top3/acts", "my-model")
>>> extractor.read, extractor.sites, selector.n_sites, selector.param_grid
('last', 'stride:3', 3, {'C': [0.01, 0.1, 1.0]})

Configuration 9 (stacking of probe, position and TF-IDF turn scores) reads
conversations rather than features, so it is not an ``(extractor, selector)``
pair; build it with :class:`~skafa.TurnScoreStacker` (its definition is in the
benchmark script, ``make_stacker``).

:data:`RECOMMENDED` is the configuration rule step 2 of the pre-registration
picked (the one chosen most often by the nested comparison's inner CV over the
completed Algorithm-Generated cells); it is what ``FailureAttributor()`` builds.
A reader the 1.5B rematch's rule gave a configuration of its own
(:data:`RECOMMENDED_FOR_READER`) gets that one:
:func:`recommended_configuration` says which.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

from sklearn.model_selection import GroupKFold

__all__ = [
    "PREREGISTERED_READS",
    "PREREGISTERED_PROBES",
    "PREREGISTERED_SITES",
    "RECOMMENDED",
    "RECOMMENDED_FOR_READER",
    "configuration_names",
    "parse_configuration",
    "make_configuration",
    "recommended_configuration",
]

#: Reads, in the pre-registered order (cost order; it breaks ties).
PREREGISTERED_READS = ("last", "recap", "echo")

#: Sites every configuration searches (``skafa.llm.stride_sites(n_layers, 3)``).
PREREGISTERED_SITES = "stride:3"

LOGISTIC_CS = (0.001, 0.01, 0.1)
SOFTMAX_CS = (0.01, 0.1, 1.0)

#: Configurations 1-8: (id, estimator, C grid, n_sites, features), in table order.
PREREGISTERED_PROBES = (
    ("logistic/single/acts", "logistic", LOGISTIC_CS, 1, "acts"),
    ("logistic/single/acts+pos", "logistic", LOGISTIC_CS, 1, "acts+pos"),
    ("logistic/top3/acts", "logistic", LOGISTIC_CS, 3, "acts"),
    ("logistic/top3/acts+pos", "logistic", LOGISTIC_CS, 3, "acts+pos"),
    ("softmax/single/acts", "softmax", SOFTMAX_CS, 1, "acts"),
    ("softmax/single/acts+pos", "softmax", SOFTMAX_CS, 1, "acts+pos"),
    ("softmax/top3/acts", "softmax", SOFTMAX_CS, 3, "acts"),
    ("softmax/top3/acts+pos", "softmax", SOFTMAX_CS, 3, "acts+pos"),
)

#: Configuration 9's id (see the module docstring).
STACK_ID = "stack(probe, position, TF-IDF)"

#: The recommended default: what rule step 2 of the pre-registration picked
#: (docs/benchmarks.md, section 3). Applied on 2026-12-03 to all three
#: Algorithm-Generated cells the rule names (SmolLM2-135M-Instruct,
#: Qwen2.5-Coder-0.5B-Instruct, Gemma-3-270M): ``echo: softmax/top3/acts`` was chosen
#: in 10 of the 45 outer fits (next: 4); ``examples/apply_prereg_rule.py`` reproduces it.
RECOMMENDED = "echo: softmax/top3/acts"

#: Readers with a recommendation of their own: rule step 2 of the 1.5B rematch
#: (docs/benchmarks.md, section 7), applied on 2026-12-07 to the Qwen2.5-Coder-1.5B
#: Algorithm-Generated cell: its headline beat position-only by +9.3 points, paired
#: 95% CI [+1.7, +17.0], and ``echo: logistic/top3/acts`` was chosen in 4 of its 15
#: outer fits (next: 3). ``examples/apply_prereg_rule.py --reader-rule`` reproduces it.
#: Keys are the short model names of :func:`skafa.llm.load_model`.
RECOMMENDED_FOR_READER = {"qwen2.5-coder-1.5b": "echo: logistic/top3/acts"}


def recommended_configuration(model="smollm2"):
    """The recommended configuration's name for reading with ``model``.

    Parameters
    ----------
    model : str, default="smollm2"
        A short model name (``"qwen2.5-coder-1.5b"``) or anything else
        :func:`skafa.llm.load_model` takes.

    Returns
    -------
    name : str
        :data:`RECOMMENDED_FOR_READER` of the short name when the pre-registered
        rule gave that reader one, else :data:`RECOMMENDED` (paths and other
        names included: the rule named a reader, not a file).

    Examples
    --------
    >>> recommended_configuration()   # the embedded default reader
    'echo: softmax/top3/acts'
    >>> recommended_configuration("qwen2.5-coder-1.5b")
    'echo: logistic/top3/acts'
    """
    return RECOMMENDED_FOR_READER.get(model, RECOMMENDED) if isinstance(model, str) else RECOMMENDED


def configuration_names(reads=PREREGISTERED_READS):
    """The configuration names (``"<read>: <id>"``) in the pre-registered order.

    Parameters
    ----------
    reads : sequence of str, default=PREREGISTERED_READS
        Reads to list, in the order given.

    Returns
    -------
    names : list of str
        Nine names per read: configurations 1-8, then stacking.
    """
    return [f"{read}: {pid}" for read in reads
            for pid in [p[0] for p in PREREGISTERED_PROBES] + [STACK_ID]]


def parse_configuration(name):
    """Split a configuration name into its read and its probe settings.

    Parameters
    ----------
    name : str
        ``"<read>: <id>"``, e.g. ``"last: softmax/top3/acts+pos"``.

    Returns
    -------
    read : str
    estimator : {"logistic", "softmax"}
    Cs : tuple of float
    n_sites : int
    features : {"acts", "acts+pos"}

    Raises
    ------
    ValueError
        For a name that is not one of configurations 1-8 (the message lists
        them, and says how configuration 9 is built).
    """
    read, _, pid = str(name).partition(": ")
    probes = {p[0]: p[1:] for p in PREREGISTERED_PROBES}
    if read in PREREGISTERED_READS and pid == STACK_ID:
        raise ValueError(
            f"{name!r} is configuration 9 (stacking): it reads conversations, not "
            "features, so it is not an (extractor, selector) pair; build it with "
            "skafa.TurnScoreStacker (see make_stacker in "
            "examples/benchmark_who_and_when.py).")
    if read not in PREREGISTERED_READS or pid not in probes:
        valid = [n for n in configuration_names() if not n.endswith(STACK_ID)]
        raise ValueError(f"unknown configuration {name!r}; configurations 1-8 are "
                         f"{valid[:8]} with any read of {list(PREREGISTERED_READS)}.")
    return (read, *probes[pid])


def make_configuration(name=None, model="smollm2", *, random_state=None,
                       **extractor_params):
    """Build the ``(extractor, selector)`` pair of a pre-registered configuration.

    Parameters
    ----------
    name : str, default=None
        One of configurations 1-8 (:func:`configuration_names`); None: the
        recommended one for ``model`` (:func:`recommended_configuration`).
    model : str, default="smollm2"
        Model name or path for the :class:`~skafa.TurnActivationTransformer`.
    random_state : int or None, default=None
        Passed to the logistic probe.
    **extractor_params
        Further :class:`~skafa.TurnActivationTransformer` parameters
        (``prompt``, ``cache_dir``, ``device``, ``dtype``, ``batch_size``...);
        ``read`` and ``sites`` belong to the configuration and are refused.

    Returns
    -------
    extractor : TurnActivationTransformer or TurnFeatureUnion
        The activations at :data:`PREREGISTERED_SITES` with the configuration's
        read; with ``acts+pos`` features a :class:`~skafa.TurnFeatureUnion` of
        them and :class:`~skafa.TurnPositionTransformer` (position features
        appended at every site).
    selector : SiteSelector
        The probe with its C grid searched jointly with the site(s) on
        ``GroupKFold(5)`` (``param_grid``), one site or the average of the
        top 3.
    """
    from .compose import TurnFeatureUnion
    from .featurizers import TurnPositionTransformer
    from .llm import TurnActivationTransformer
    from .model_selection import SiteSelector
    from .probes import GroupedArgmaxLogisticClassifier, GroupedSoftmaxClassifier

    if name is None:
        name = recommended_configuration(model)
    read, kind, Cs, n_sites, features = parse_configuration(name)
    fixed = sorted({"read", "sites"} & set(extractor_params))
    if fixed:
        raise ValueError(f"configuration {name!r} fixes {fixed}; pass the other "
                         "TurnActivationTransformer parameters only.")
    extractor = TurnActivationTransformer(model, read=read, sites=PREREGISTERED_SITES,
                                          **extractor_params)
    if features == "acts+pos":
        extractor = TurnFeatureUnion([("act", extractor), ("pos", TurnPositionTransformer())])
    probe = (GroupedArgmaxLogisticClassifier(random_state=random_state) if kind == "logistic"
             else GroupedSoftmaxClassifier())
    selector = SiteSelector(probe, cv=GroupKFold(n_splits=5), n_sites=n_sites,
                            param_grid={"C": list(Cs)})
    return extractor, selector
