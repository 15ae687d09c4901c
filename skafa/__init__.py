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

# Functions and non-class objects exported at the top level: name -> submodule that
# defines it (imported on first access, PEP 562). Public *classes* need no entry: every
# CamelCase name in the ``__all__`` of a public module is found by _discover() below,
# so a new estimator is exported by its own module alone.
_LAZY = {
    "load_who_and_when": "datasets",
    "fetch_who_and_when": "datasets",
    "load_model": "models",
    "register_model": "models",
    "smollm2_path": "models",
    "all_sites": "sites",
    "site_sweep": "selection",
    "make_attribution_pipeline": "composition",
    "save": "persistence",
    "load": "persistence",
}

_SUBMODULES = {
    "attention", "attributor", "baselines", "cache", "composition", "configurations", "cost",
    "datasets", "dummies", "estimators", "extraction", "features", "featurizers", "judge",
    "metrics", "models", "online", "persistence", "pipeline", "probes", "prompt", "selection",
    "sites", "stacking", "testing", "utils",
    # not imported by ``import skafa``; loaded on first access
    "integrations", "report", "cli",
}

#: Modules whose classes are not exported at the top level: aliases of old paths,
#: helpers for tests, the command line, and optional integrations.
_NOT_EXPORTED = {"baselines", "estimators", "pipeline", "testing", "cli", "report",
                 "integrations", "utils"}


def _discover():
    """``{class name: module}`` from the ``__all__`` of every public module, read as text.

    The ``__all__`` literal of each source file is read (never imported), so
    ``import skafa`` stays light.
    """
    import ast
    import re
    from pathlib import Path

    pattern = re.compile(r"^__all__\s*=\s*([\[(].*?[\])])\s*$", re.S | re.M)
    found = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        module = path.stem
        if module.startswith("_") or module in _NOT_EXPORTED:
            continue
        match = pattern.search(path.read_text(encoding="utf-8"))
        for name in ast.literal_eval(match.group(1)) if match else ():
            if name[:1].isupper() and not name.isupper():
                found.setdefault(name, module)
    return found


_LAZY = {**_discover(), **_LAZY}

__all__ = ["__version__", "Conversation", "ConversationError", "Turn", "TurnFeatures",
           *sorted(set(_LAZY) - {"Conversation", "ConversationError", "Turn", "TurnFeatures"})]


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
