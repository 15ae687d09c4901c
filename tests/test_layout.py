"""The package layout a maintainer relies on: one home per concept, one compat shim."""

import ast
import importlib
from pathlib import Path

import pytest

import skafa
from skafa.utils import all_estimators

PACKAGE = Path(skafa.__file__).parent


def test_every_public_name_importable_from_the_top_level():
    for name in skafa.__all__:
        assert getattr(skafa, name) is not None, name


@pytest.mark.parametrize("old, names", [
    ("skafa.estimators", ["GroupedArgmaxClassifier", "GroupedArgmaxLogisticClassifier",
                          "PerTurn"]),
    ("skafa.baselines", ["TurnPositionTransformer", "TurnTextTransformer",
                         "TurnFeatureUnion", "SiteConcatenator", "DummyStepClassifier"]),
    ("skafa.pipeline", ["AttributionPipeline", "make_attribution_pipeline"]),
])
def test_old_module_paths_still_resolve_to_the_same_objects(old, names):
    module = importlib.import_module(old)
    for name in names:
        assert getattr(module, name) is getattr(skafa, name)


def test_all_estimators_lists_each_class_once_under_its_home_module():
    found = all_estimators()
    names = [n for n, _ in found]
    assert len(names) == len(set(names))
    homes = {n: c.__module__ for n, c in found}
    assert homes["GroupedArgmaxLogisticClassifier"] == "skafa.probes"
    assert homes["TurnPositionTransformer"] == "skafa.featurizers"
    assert homes["TurnFeatureUnion"] == "skafa.composition"
    assert homes["DummyStepClassifier"] == "skafa.dummies"
    assert not any(m in ("skafa.estimators", "skafa.baselines", "skafa.pipeline")
                   for m in homes.values())
    # every public estimator is importable from the top level, found from its module's
    # __all__ (no hand-kept table in skafa/__init__.py to update)
    for name, cls in found:
        assert getattr(skafa, name) is cls, name
        assert name in skafa.__all__ and skafa._LAZY[name] == cls.__module__.split(".")[1]


def test_top_level_classes_are_discovered_from_module_all():
    discovered = skafa._discover()
    assert discovered["GroupedSoftmaxClassifier"] == "probes"
    assert discovered["TurnScoreStacker"] == "stacking"
    # alias modules and helpers are not scanned
    assert not set(discovered.values()) & skafa._NOT_EXPORTED


def test_all_estimators_type_filter():
    transformers = {n for n, _ in all_estimators("transformer")}
    assert "TurnActivationTransformer" in transformers
    assert "GroupedArgmaxLogisticClassifier" not in transformers
    with pytest.raises(ValueError, match="type_filter"):
        all_estimators("regressor")


def _private_sklearn_imports(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "sklearn":
            if any(part.startswith("_") for part in node.module.split(".")):
                bad.append(f"{path.name}:{node.lineno} from {node.module}")
            bad += [f"{path.name}:{node.lineno} {a.name}" for a in node.names
                    if a.name.startswith("_")]
    return bad


def test_sklearn_private_names_only_through_the_compat_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_sklearn_compat.py":
            continue
        offenders += _private_sklearn_imports(path)
    assert offenders == []
    # and the compat module itself imports on this scikit-learn
    importlib.import_module("skafa.utils._sklearn_compat")


def test_api_docs_are_generated_for_every_public_module():
    text = (PACKAGE.parent / "docs" / "api.md").read_text(encoding="utf-8")
    documented = {line.split()[1] for line in text.splitlines() if line.startswith("::: ")}
    homes = {cls.__module__ for _, cls in all_estimators()}
    assert homes <= documented, homes - documented
    # no hand-kept summary tables to update when an estimator is added
    assert "| object | signature |" not in text
