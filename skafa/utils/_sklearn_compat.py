"""The one place skafa imports scikit-learn's private helpers.

scikit-learn does not promise stability for names that start with ``_`` or live in
``_``-prefixed modules. Every such import in skafa goes through this module, so a
scikit-learn release that moves one breaks exactly one file, and the fallback (or a
raised lower bound in ``pyproject.toml``) is written once. Tested against the
scikit-learn versions CI installs (see ``tests/test_sklearn_compat.py``).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from sklearn.base import _fit_context
from sklearn.model_selection._split import _UnsupportedGroupCVMixin
from sklearn.pipeline import _final_estimator_has, _name_estimators
from sklearn.utils import _safe_indexing
from sklearn.utils._param_validation import HasMethods, Interval, Options, StrOptions
from sklearn.utils.estimator_checks import _yield_api_checks
from sklearn.utils.metadata_routing import _routing_enabled
from sklearn.utils.metaestimators import _BaseComposition
from sklearn.utils.validation import _check_sample_weight

try:  # scikit-learn >= 1.6 moved the HTML repr helpers
    from sklearn.utils._repr_html.estimator import _VisualBlock
except ImportError:  # pragma: no cover - older layout
    from sklearn.utils._estimator_html_repr import _VisualBlock

__all__ = [
    "_fit_context",
    "_UnsupportedGroupCVMixin",
    "_final_estimator_has",
    "_name_estimators",
    "_safe_indexing",
    "HasMethods",
    "Interval",
    "Options",
    "StrOptions",
    "_routing_enabled",
    "_BaseComposition",
    "_check_sample_weight",
    "_yield_api_checks",
    "_VisualBlock",
]
