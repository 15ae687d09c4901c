"""The one place skafa imports scikit-learn's private helpers.

scikit-learn does not promise stability for names that start with ``_`` or live in
``_``-prefixed modules. Every such import in skafa goes through this module and is
re-exported under a public name, so a scikit-learn release that moves one breaks
exactly one file. Tested against the scikit-learn version CI installs
(``pyproject.toml`` pins the lower bound).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from sklearn.base import _fit_context as fit_context
from sklearn.model_selection._split import (
    _UnsupportedGroupCVMixin as UnsupportedGroupCVMixin,
)
from sklearn.pipeline import _final_estimator_has as final_estimator_has
from sklearn.pipeline import _name_estimators as name_estimators
from sklearn.utils import _safe_indexing as safe_indexing
from sklearn.utils._param_validation import HasMethods, Interval, Options, StrOptions
from sklearn.utils._repr_html.estimator import _VisualBlock as VisualBlock
from sklearn.utils.estimator_checks import _yield_api_checks as yield_api_checks
from sklearn.utils.metadata_routing import _routing_enabled as routing_enabled
from sklearn.utils.metaestimators import _BaseComposition as BaseComposition
from sklearn.utils.validation import _check_sample_weight as check_sample_weight

__all__ = [
    "BaseComposition",
    "HasMethods",
    "Interval",
    "Options",
    "StrOptions",
    "UnsupportedGroupCVMixin",
    "VisualBlock",
    "check_sample_weight",
    "final_estimator_has",
    "fit_context",
    "name_estimators",
    "routing_enabled",
    "safe_indexing",
    "yield_api_checks",
]
