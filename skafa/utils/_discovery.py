"""Find skafa's public estimators from the package itself (no hand-kept list)."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import importlib
import inspect
import pkgutil

__all__ = ["all_estimators"]

_TYPE_FILTERS = ("classifier", "transformer", "meta")


def _public_modules():
    import skafa

    for info in pkgutil.walk_packages(skafa.__path__, prefix="skafa."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]) or parts[1] in ("testing", "utils"):
            continue
        yield importlib.import_module(info.name)


def all_estimators(type_filter=None):
    """Every public estimator class defined in skafa, found by walking the package.

    A class counts when it subclasses :class:`sklearn.base.BaseEstimator`, its name
    does not start with ``_``, and it is *defined* in a public skafa module (so a
    class re-exported from elsewhere is listed once, under its home module).

    Parameters
    ----------
    type_filter : {"classifier", "transformer", "meta"} or list of them, default=None
        ``"classifier"``: has ``predict``; ``"transformer"``: has ``transform``;
        ``"meta"``: takes another estimator as a parameter (``estimator``,
        ``transformer``, ``steps`` or ``transformer_list``). ``None`` lists all.

    Returns
    -------
    estimators : list of (str, type)
        ``(name, class)`` pairs sorted by name.

    Examples
    --------
    >>> from skafa.utils import all_estimators
    >>> names = [name for name, _ in all_estimators()]
    >>> "GroupedArgmaxLogisticClassifier" in names and "SiteSelector" in names
    True
    """
    from sklearn.base import BaseEstimator

    filters = [type_filter] if isinstance(type_filter, str) else list(type_filter or [])
    unknown = [f for f in filters if f not in _TYPE_FILTERS]
    if unknown:
        raise ValueError(f"type_filter must be among {_TYPE_FILTERS}, got {unknown!r}.")
    found = {}
    for module in _public_modules():
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if (name.startswith("_") or cls.__module__ != module.__name__
                    or not issubclass(cls, BaseEstimator) or inspect.isabstract(cls)):
                continue
            found[name] = cls

    def keep(cls):
        if not filters:
            return True
        params = inspect.signature(cls.__init__).parameters
        checks = {
            "classifier": hasattr(cls, "predict"),
            "transformer": hasattr(cls, "transform"),
            "meta": any(p in params for p in ("estimator", "transformer", "steps",
                                              "transformer_list")),
        }
        return any(checks[f] for f in filters)

    return sorted(((n, c) for n, c in found.items() if keep(c)), key=lambda t: t[0])
