"""Confirmed bugs of issue 9, each with a test that fails on the code before the fix.

- ``SiteSelector`` refitted with ``refit=False`` kept the previous fit's
  ``best_estimator_`` and reported its ``n_features_in_``;
- an empty ``TurnFeatures`` (0 conversations) was reported as "every training
  conversation has a single turn"; now every estimator names the empty input;
- the docstring examples of the package did not run with the tests.
"""

import numpy as np
import pytest
from sklearn.model_selection import GroupKFold

from skafa import (
    DummyStepClassifier,
    GroupedArgmaxClassifier,
    GroupedArgmaxLogisticClassifier,
    PerTurn,
    SiteConcatenator,
    SiteSelector,
    TurnFeatures,
)
from skafa.utils.estimator_checks import make_turn_features


def test_refit_false_drops_the_previous_best_estimator():
    X, y = make_turn_features(16, n_features=4)
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(2)).fit(X, y)
    assert sel.n_features_in_ == 4 and hasattr(sel, "refit_time_")
    narrow, _ = make_turn_features(16, n_features=3)
    sel.set_params(refit=False).fit(narrow, y)
    assert not hasattr(sel, "best_estimator_")  # was the 4-feature model of the first fit
    assert not hasattr(sel, "refit_time_")
    assert not hasattr(sel, "n_features_in_")  # was 4, for data with 3 features
    with pytest.raises(AttributeError, match="refit=False"):
        sel.predict(narrow)
    # refitting with refit=True brings them back, for the new data
    assert sel.set_params(refit=True).fit(narrow, y).n_features_in_ == 3


@pytest.mark.parametrize("est", [
    GroupedArgmaxLogisticClassifier(), GroupedArgmaxClassifier(), DummyStepClassifier(),
    SiteSelector(GroupedArgmaxLogisticClassifier()), PerTurn(__import__(
        "sklearn.preprocessing", fromlist=["StandardScaler"]).StandardScaler()),
    SiteConcatenator("features"),
], ids=lambda e: type(e).__name__)
def test_empty_turn_features_are_named_as_such(est):
    empty = TurnFeatures(np.empty((0, 3)), [0])  # builds: a valid, empty container
    assert len(empty) == 0
    with pytest.raises(ValueError, match="TurnFeatures with 0 conversations") as info:
        est.fit(empty, np.empty(0, dtype=np.int64))
    assert "single turn" not in str(info.value)


def test_empty_turn_features_at_prediction():
    X, y = make_turn_features(8)
    probe = GroupedArgmaxLogisticClassifier().fit(X, y)
    dummy = DummyStepClassifier().fit(X, y)
    empty = TurnFeatures(np.empty((0, X.n_features)), [0])
    for est in (probe, dummy):
        with pytest.raises(ValueError, match="0 conversations"):
            est.predict(empty)


def test_package_doctests_run_with_the_tests(pytestconfig):
    assert "--doctest-modules" in pytestconfig.getini("addopts")
    assert "skafa" in pytestconfig.getini("testpaths")


def test_no_doctest_needs_the_real_model():
    # Examples that would load SmolLM2 (or any named real model) are skipped; the
    # rest run offline on skafa.testing's tiny models.
    import doctest
    import importlib
    import pkgutil

    import skafa

    finder = doctest.DocTestFinder()
    n_run = 0
    for info in pkgutil.walk_packages(skafa.__path__, prefix="skafa."):
        module = importlib.import_module(info.name)
        for test in finder.find(module, module=module):
            for example in test.examples:
                if '"smollm2"' in example.source or "'smollm2'" in example.source:
                    assert example.options.get(doctest.SKIP), (test.name, example.source)
                elif not example.options.get(doctest.SKIP):
                    n_run += 1
    assert n_run > 50
