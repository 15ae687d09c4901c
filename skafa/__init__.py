"""skafa: white-box failure attribution for multi-agent LLM runs, the scikit-learn way.

Find the decisive step (and the responsible agent) of a failed multi-agent run by
reading an open-weight language model's hidden states at every turn and training
small linear probes on labelled failures.

Public objects are importable from the top level; heavy modules (torch,
transformers) load lazily on first use.
"""

from importlib import import_module

from ._version import __version__
from .conversation import Conversation, ConversationError, Turn
from .features import TurnFeatures

# name -> submodule that defines it (imported on first access, PEP 562)
_LAZY = {
    # datasets
    "load_who_and_when": "datasets",
    "fetch_who_and_when": "datasets",
    # prompt and models
    "PromptTemplate": "prompt",
    "Encoding": "prompt",
    "load_model": "models",
    "register_model": "models",
    "smollm2_path": "models",
    # extraction
    "TurnActivationTransformer": "extraction",
    "ActivationCache": "cache",
    "all_sites": "sites",
    # estimators
    "GroupedArgmaxClassifier": "probes",
    "GroupedArgmaxLogisticClassifier": "probes",
    "PerTurn": "composition",
    "SiteSelector": "selection",
    "site_sweep": "selection",
    # featurizers, composition, dummies
    "TurnPositionTransformer": "featurizers",
    "TurnTextTransformer": "featurizers",
    "TurnFeatureUnion": "composition",
    "SiteConcatenator": "composition",
    "DummyStepClassifier": "dummies",
    "PromptedJudge": "judge",
    # pipelines
    "AttributionPipeline": "composition",
    "make_attribution_pipeline": "composition",
    # online auditing
    "OnlineAuditor": "online",
    "AuditSession": "online",
    # facade and persistence
    "FailureAttributor": "attributor",
    "Attribution": "attributor",
    "save": "persistence",
    "load": "persistence",
}

_SUBMODULES = {
    "attributor", "baselines", "cache", "composition", "datasets", "dummies", "estimators",
    "extraction", "features", "featurizers", "judge", "metrics", "models", "online", "persistence",
    "pipeline", "probes", "prompt", "selection", "sites", "testing", "utils",
}

__all__ = ["__version__", "Conversation", "ConversationError", "Turn", "TurnFeatures",
           *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'skafa' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)
