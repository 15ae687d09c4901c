"""Find skafa's public estimators from the package itself (no hand-kept list)."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import functools
import importlib
import inspect
import pkgutil

__all__ = ["all_estimators", "public_path", "public_estimator_paths"]

_TYPE_FILTERS = ("classifier", "transformer", "meta")
#: Public modules that are not homes of estimators: test helpers, the command line,
#: the report and the utilities themselves.
_NOT_HOMES = ("testing", "utils", "cli", "report")


def _public_modules():
    """Every public skafa module (no ``_`` in its path), imported."""
    import skafa

    for info in pkgutil.walk_packages(skafa.__path__, prefix="skafa."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]) or parts[1] in _NOT_HOMES:
            continue
        yield importlib.import_module(info.name)


@functools.lru_cache(maxsize=None)
def _homes():
    """``{class: public module name}``: where each skafa class is exported.

    A class defined in a private module (``skafa.probes``) is exported by
    the public module above it (``skafa.probes``); its public path is that module's
    name and the class name.
    """
    homes = {}
    for module in _public_modules():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if not isinstance(obj, type) or obj.__name__ != name:
                continue
            defined = obj.__module__
            if defined == module.__name__ or defined.startswith(module.__name__ + "._"):
                homes.setdefault(obj, module.__name__)
    return homes


def public_path(cls):
    """The public import path of a skafa class (``skafa.probes.Name``), or None.

    Examples
    --------
    >>> from skafa.probes import GroupedArgmaxLogisticClassifier
    >>> public_path(GroupedArgmaxLogisticClassifier)
    'skafa.probes.GroupedArgmaxLogisticClassifier'
    """
    home = _homes().get(cls)
    return None if home is None else f"{home}.{cls.__name__}"


def public_estimator_paths():
    """``{public path: class}`` of every public estimator (see :func:`all_estimators`)."""
    return {public_path(cls): cls for _, cls in all_estimators()}


def all_estimators(type_filter=None):
    """Every public estimator class of skafa, found by walking the package.

    A class counts when it subclasses :class:`sklearn.base.BaseEstimator`, is not
    abstract, and a public module exports it from its own subpackage (so a class
    re-exported elsewhere is listed once, under its public home).

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
    found = {cls.__name__: cls for cls in _homes()
             if issubclass(cls, BaseEstimator) and not inspect.isabstract(cls)}

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
