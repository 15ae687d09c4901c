"""skafa: white-box failure attribution for multi-agent LLM runs, the scikit-learn way.

Find the decisive step (and the responsible agent) of a failed multi-agent run by
reading an open-weight language model's hidden states at every turn and training
small linear probes on labelled failures.

The public API is the table below: each name, and the subpackage that defines it.
Names load on first access (PEP 562), so ``import skafa`` stays light and never
imports torch. Where each concept lives: ``docs/architecture.md``.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from importlib import import_module

from ._version import __version__

#: Every public name of the top level -> the module that exports it. Kept by hand (a
#: test compares it with ``skafa.utils.all_estimators()`` and ``docs/api.md``).
_EXPORTS = {
    # the data
    "Conversation": "conversation",
    "Turn": "conversation",
    "TurnFeatures": "features",
    "load_who_and_when": "datasets",
    "fetch_who_and_when": "datasets",
    # reading a language model
    "TurnActivationTransformer": "llm",
    "PromptTemplate": "llm",
    "ActivationCache": "llm",
    "load_model": "llm",
    "register_model": "llm",
    "smollm2_path": "llm",
    "all_sites": "llm",
    # features without a language model
    "TurnPositionTransformer": "featurizers",
    "TurnTextTransformer": "featurizers",
    # probes
    "GroupedArgmaxClassifier": "probes",
    "GroupedArgmaxLogisticClassifier": "probes",
    "GroupedSoftmaxClassifier": "probes",
    # baselines
    "DummyStepClassifier": "baselines",
    "GraftedJudge": "baselines",
    "PromptedJudge": "baselines",
    # composition
    "PerTurn": "compose",
    "TurnFeatureUnion": "compose",
    "SiteConcatenator": "compose",
    "AttributionPipeline": "compose",
    "make_attribution_pipeline": "compose",
    # model selection
    "SiteSelector": "model_selection",
    "SiteEnsemble": "model_selection",
    "TurnScoreStacker": "model_selection",
    "site_sweep": "model_selection",
    "grouped_learning_curve": "model_selection",
    # runs of another framework
    "ShiftDetector": "domain",
    "CoralAdapter": "domain",
    # the recommended configuration and the one-call attributor
    "make_configuration": "configurations",
    "FailureAttributor": "attributor",
    "Attribution": "attributor",
    "AttributionReport": "attributor",
    "TurnRank": "attributor",
    # online auditing
    "OnlineAuditor": "online",
    "AuditSession": "online",
    "Verdict": "online",
    # saving without pickle
    "save": "persistence",
    "load": "persistence",
    # errors and warnings
    "ConversationError": "exceptions",
    "PromptTooLongError": "exceptions",
    "CacheCorruptionWarning": "exceptions",
    "ModelMismatchWarning": "exceptions",
    "DistributionShiftWarning": "exceptions",
    "PersistenceVersionWarning": "exceptions",
}

#: Subpackages and public modules reachable as attributes (``skafa.metrics``, ...).
_SUBMODULES = (
    "attributor", "base", "baselines", "benchmarks", "cli", "compose", "configurations",
    "conversation", "datasets", "domain", "exceptions", "features", "featurizers", "integrations", "labelling", "llm", "metrics",
    "model_selection", "online", "persistence", "probes", "report", "testing", "utils",
)

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'skafa' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
