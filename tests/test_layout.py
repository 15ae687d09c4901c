"""The package layout a maintainer relies on: concept subpackages, one export table,
no import circle, no private import across subpackages."""

import ast
import importlib
import re
from pathlib import Path

import pytest

import skafa
from skafa.utils import all_estimators, public_path

PACKAGE = Path(skafa.__file__).parent
ROOT = PACKAGE.parent


def _modules():
    """``{dotted name: path}`` of every module under skafa/."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name, path):
    """``[(lineno, target module, imported names)]`` of every skafa import in a module,
    at module level or inside functions, relative imports resolved."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "skafa":
                out.append((node.lineno, target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names
                    if a.name.split(".")[0] == "skafa"]
    return out


def _unit(module):
    """The subpackage (or top-level module) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_import_graph_has_no_circle():
    edges = {}
    for name, path in MODULES.items():
        targets = set()
        for _, target, names in _imports(name, path):
            for n in names:
                if f"{target}.{n}" in MODULES:  # `from . import submodule`
                    targets.add(f"{target}.{n}")
            targets.add(target)
        edges[name] = {t for t in targets if t in MODULES and t != name}
    # iterative DFS, report one cycle
    state, stack = {}, []

    def visit(start):
        todo = [(start, iter(sorted(edges[start])))]
        state[start] = 1
        stack.append(start)
        while todo:
            node, children = todo[-1]
            for child in children:
                if state.get(child) == 1:
                    return stack[stack.index(child):] + [child]
                if child not in state:
                    state[child] = 1
                    stack.append(child)
                    todo.append((child, iter(sorted(edges[child]))))
                    break
            else:
                state[node] = 2
                stack.pop()
                todo.pop()
        return None

    for name in sorted(MODULES):
        if name not in state:
            cycle = visit(name)
            assert cycle is None, " -> ".join(cycle)


def test_no_private_import_across_subpackages():
    offenders = []
    for name, path in MODULES.items():
        for lineno, target, names in _imports(name, path):
            if _unit(target) == _unit(name) and _unit(name):
                continue  # inside one subpackage, private modules are the point
            where = f"{path.relative_to(ROOT)}:{lineno}"
            private_parts = [p for p in target.split(".")[1:] if p.startswith("_")
                             and not p.startswith("__")]
            if private_parts and target != "skafa._version":
                offenders.append(f"{where} from {target}")
            offenders += [f"{where} {target}.{n}" for n in names
                          if n.startswith("_") and not n.startswith("__")]
    assert offenders == []


def test_production_code_never_imports_test_helpers():
    allowed = ("skafa.testing", "skafa.utils.estimator_checks", "skafa.utils._test_common")
    offenders = [f"{name}:{lineno}" for name, path in MODULES.items()
                 if not name.startswith(allowed)
                 for lineno, target, _ in _imports(name, path)
                 if target.startswith(("skafa.testing", "skafa.utils._test_common"))]
    assert offenders == []


def test_no_test_scaffolding_on_production_classes():
    for _, cls in all_estimators():
        assert "_check_instances" not in vars(cls), cls


def test_export_table_is_the_public_api():
    assert skafa.__all__ == ["__version__", *sorted(skafa._EXPORTS)]
    for name in skafa.__all__:
        assert getattr(skafa, name) is not None, name
    # every public estimator is exported at the top level, from its public home
    for name, cls in all_estimators():
        assert name in skafa._EXPORTS, f"{name} is not in skafa/__init__.py's _EXPORTS"
        assert public_path(cls) == f"skafa.{skafa._EXPORTS[name]}.{name}"
    # internals are not exported at the top level
    for internal in ("SiteReader", "MemoryLRU", "LoadContext", "Encoding", "PromptPlan",
                     "DecoderLayout", "ModelSpec", "PersistenceMixin"):
        assert internal not in skafa.__all__


def test_api_docs_list_the_export_table_and_every_subpackage():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = {line.split()[1] for line in text.splitlines() if line.startswith("::: ")}
    homes = {public_path(cls).rpartition(".")[0] for _, cls in all_estimators()}
    assert homes <= documented, homes - documented
    table = dict(re.findall(r"^\| `(\w+)` \| `skafa\.([\w.]+)` \|$", text, re.M))
    assert table == skafa._EXPORTS


def test_subpackages_export_explicitly():
    for name, path in MODULES.items():
        if path.name != "__init__.py" or name == "skafa":
            continue
        module = importlib.import_module(name)
        assert isinstance(getattr(module, "__all__", None), list), name
        for item in module.__all__:
            assert hasattr(module, item), f"{name}.{item}"


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
        if path.name == "sklearn_compat.py":
            continue
        offenders += _private_sklearn_imports(path)
    assert offenders == []
    importlib.import_module("skafa.utils.sklearn_compat")


def test_import_skafa_stays_light():
    import subprocess
    import sys

    code = ("import sys, skafa; skafa.GroupedArgmaxLogisticClassifier; "
            "print(any(m in sys.modules for m in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_tests_mirror_the_package_and_import_no_other_test():
    tests = Path(__file__).resolve().parent
    for sub in ("llm", "probes", "baselines", "compose", "model_selection", "metrics",
                "online", "persistence", "datasets", "integrations", "utils", "benchmarks"):
        assert (tests / sub).is_dir() and (PACKAGE / sub).is_dir(), sub
    offenders = []
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n.split(".")[0].startswith(("test_", "conftest", "tests"))]
    assert offenders == []
