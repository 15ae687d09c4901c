"""Run the documented example scripts on the tiny random model, so they cannot rot;
the docstring examples of the package run as doctests with the tests."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"skafa_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compare():
    return _load("compare_with_baselines")


def test_compare_with_baselines_runs_on_tiny_model(compare, capsys):
    out = compare.main(["--n", "24", "--folds", "3", "--n-resamples", "200"])
    text = capsys.readouterr().out

    methods = ["probe", "probe + position", "position-only", "TF-IDF",
               "dummy: most_frequent", "dummy: first"]
    assert list(out["predictions"]) == methods
    for name in methods:
        assert name in text
    # The tiny Llama has 2 layers: stride 1 -> resid_pre.0, resid_pre.1, resid_final.
    assert out["sites"] == ["resid_pre.0", "resid_pre.1", "resid_final"]

    from skafa.testing import make_conversations

    convs = make_conversations(24, min_turns=3, max_turns=8, seed=0)
    y = np.array([c.mistake_step for c in convs])
    n_turns = np.array([len(c) for c in convs])
    for name, steps in out["predictions"].items():
        assert steps.shape == (24,) and steps.dtype.kind == "i"
        assert np.all((steps >= 0) & (steps < n_turns)), name
        row = out["rows"][name]
        assert row["step"].estimate == pytest.approx(np.mean(steps == y))
        for r in row.values():
            assert r.n == 24 and r.low <= r.estimate <= r.high
    # "first" predicts turn 0 for every conversation, whatever the folds.
    np.testing.assert_array_equal(out["predictions"]["dummy: first"], 0)
    assert set(out["paired"]) == set(methods) - {"probe"}
    d = out["paired"]["dummy: first"]
    assert d.estimate == pytest.approx(np.mean(out["predictions"]["probe"] == y) - np.mean(y == 0))


def test_compare_with_baselines_help(compare, capsys):
    with pytest.raises(SystemExit) as exc:
        compare.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--data" in capsys.readouterr().out


# ------------------------------------------------------------ the user guide
GUIDE = EXAMPLES.parent / "docs" / "user-guide.md"


def _guide_pages():
    """docs/user-guide.md (the index, with the setup snippet) and then each concept page
    under docs/guide/ in the order the index links them."""
    import re

    pages = re.findall(r"\]\((guide/[^)#]+\.md)\)", GUIDE.read_text(encoding="utf-8"))
    pages = list(dict.fromkeys(pages))
    on_disk = sorted(f"guide/{p.name}" for p in (GUIDE.parent / "guide").glob("*.md"))
    assert sorted(pages) == on_disk
    return [GUIDE] + [GUIDE.parent / p for p in pages]


def _python_blocks(text):
    """``(line, code)`` of every ```python block not preceded by ``<!-- not-run``."""
    import re

    blocks = []
    for m in re.finditer(r"(?P<pre>[^\n]*)\n```python\n(?P<code>.*?)\n```", text, re.S):
        if m.group("pre").strip().startswith("<!-- not-run"):
            continue
        blocks.append((text[:m.start("code")].count("\n") + 1, m.group("code")))
    return blocks


def test_user_guide_snippets_run(tmp_path, monkeypatch):
    # Every runnable snippet of the user guide (docs/user-guide.md, then its pages under
    # docs/guide/ in order), in one namespace (they build on each other), on the tiny
    # random model the guide registers as "tiny".
    import sklearn

    from skafa.llm import unregister_model

    blocks = [(f"{page}:{line}", code) for page in _guide_pages()
              for line, code in _python_blocks(page.read_text(encoding="utf-8"))]
    assert len(blocks) > 20
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "user_guide"}
    unregister_model("tiny")
    try:
        with sklearn.config_context():  # the guide toggles metadata routing
            for where, code in blocks:
                exec(compile(code, where, "exec"), namespace)
    finally:
        unregister_model("tiny")


def test_benchmark_read_mean_help(capsys):
    spec = importlib.util.spec_from_file_location(
        "benchmark_read_mean", EXAMPLES / "benchmark_read_mean.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "--repeats" in capsys.readouterr().out


def test_benchmark_sliding_attention_smoke(tmp_path):
    bench = _load("benchmark_sliding_attention")
    out = tmp_path / "rows.json"
    rows = bench.main(["--smoke", "--out", str(out)])
    assert [r["n_tokens"] for r in rows] == [128, 512]
    for r in rows:
        assert r["dense_s"] > 0 and r["banded_s"] > 0
        assert r["max_rel_diff"] < 1e-4
    import json

    assert json.loads(out.read_text())["rows"] == rows


def _who_and_when_records(root, n=2):
    """A Who&When-shaped folder of ``n`` tiny Algorithm-Generated records."""
    import json

    for i in range(1, n + 1):
        path = root / "Algorithm-Generated" / f"{i}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        history = [{"content": f"step {k} of run {i}: the value is {k * i}", "role": "assistant",
                    "name": f"Expert_{k % 2}"} for k in range(4)]
        path.write_text(json.dumps({
            "question": f"q{i}", "ground_truth": "1", "question_ID": f"task{i}",
            "history": history, "mistake_step": "1", "mistake_agent": "Expert_1",
            "mistake_reason": "r"}), encoding="utf-8")
    return root


def test_compare_dtypes_on_tiny_model(tmp_path, capsys):
    import copy

    import torch

    from skafa.llm import register_model, unregister_model
    from skafa.testing import make_tiny_llama, make_tiny_tokenizer

    script = _load("compare_dtypes")
    data = _who_and_when_records(tmp_path / "data")
    model = make_tiny_llama()
    # a registered model is used in the dtype it was registered in: one per dtype
    register_model("tiny-dtypes-f32", model, make_tiny_tokenizer(), overwrite=True)
    register_model("tiny-dtypes-bf16", copy.deepcopy(model).to(torch.bfloat16),
                   make_tiny_tokenizer(), overwrite=True)
    try:
        common = ["--data", str(data), "--sites", "all",
                  "--records", "Algorithm-Generated/1", "Algorithm-Generated/2",
                  "--cache-dir", str(tmp_path / "cache")]
        same = script.main([*common, "--model", "tiny-dtypes-f32", "--dtype", "float32"])
        assert np.asarray(same["median"]).max() == 0.0     # a dtype against itself
        bf16 = script.main([*common, "--model", "tiny-dtypes-bf16", "--dtype", "bfloat16",
                            "--reference-model", "tiny-dtypes-f32"])
        bf16 = np.asarray(bf16["median"])
        assert bf16.shape == (2, len(same["sites"]))
        assert 0 < bf16.max() < 0.05                         # bf16 moves vectors, a little
        assert "| Algorithm-Generated/2 | 4 |" in capsys.readouterr().out
        with pytest.raises(SystemExit, match="Algorithm-Generated/9"):
            script.main([*common[:4], "--model", "tiny-dtypes-f32",
                         "--records", "Algorithm-Generated/9"])
    finally:
        unregister_model("tiny-dtypes-f32")
        unregister_model("tiny-dtypes-bf16")
    # the relative error itself
    a = np.ones((2, 1, 4))
    assert script.relative_errors(a, 1.1 * a) == pytest.approx(np.full((2, 1), 0.1))
    with pytest.raises(ValueError, match="shapes differ"):
        script.relative_errors(a, a[:1])


def test_benchmark_dtype_on_tiny_model(tmp_path, capsys):
    from skafa.testing import make_tiny_llama, make_tiny_tokenizer

    script = _load("benchmark_dtype")
    folder = tmp_path / "tiny"  # a path: each dtype is loaded in a worker process of its own
    make_tiny_llama().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    out = tmp_path / "dtype.md"
    res = script.main(["--model", str(folder), "--tokens", "40", "--repeats", "2",
                       "--sites", "all", "--out", str(out)])
    # interleaved repeats, one time per dtype and repeat
    assert [len(res["times"][d]) for d in ("float32", "bfloat16")] == [2, 2]
    assert all(s > 0 for d in res["times"] for s in res["times"][d])
    assert res["errors"].shape == (res["info"]["float32"]["n_tokens"], len(res["sites"]))
    assert 0 < res["errors"].max() < 0.05  # bf16 moves vectors, a little
    report = out.read_text()
    assert "| bfloat16 |" in report and report in capsys.readouterr().out
    assert "s per 1,000 tokens" in report and "| resid_final |" in report
    assert all(res["info"][d]["load_hwm"] > 0 for d in res["info"])
    # the suite's CPU has no bfloat16 units (SKAFA_CPU_BF16=0): float32's kernel, and the
    # native kernel beside it, whose numbers it matches up to the order of float32 sums
    assert res["info"]["bfloat16"]["via_float32"] is True
    assert res["info"]["bfloat16-native"]["via_float32"] is False
    assert len(res["times"]["bfloat16-native"]) == 2
    assert "| bfloat16 | float32 kernel |" in report and "| bfloat16-native | native |" in report
    assert 0 <= res["native_errors"].max() < 0.05


def test_benchmark_eta_on_tiny_model(tmp_path, capsys, who_and_when_dir):
    from skafa.testing import make_tiny_llama, make_tiny_tokenizer

    folder = tmp_path / "tiny"
    make_tiny_llama(max_position_embeddings=4096).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    _load("benchmark_eta").main([
        "--model", str(folder), "--data", str(who_and_when_dir),
        "--read", "last", "--max-prompt-tokens", "2048", "--dtype", "float32",
        "--workers", "2", "--measured-s", "10"])
    out = capsys.readouterr().out
    assert "100 of 100 conversations to extract" in out and "at 512 and" in out
    lines = [ln for ln in out.splitlines() if "worker(s), " in ln]
    assert [ln.split(":")[0] for ln in lines] == ["one 512-token rate", "two lengths (skafa)"]
    assert all("x the measured 10 s" in ln for ln in lines)


# ----------------------------------------------------------- docstring examples
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


def test_benchmark_transfer_help(capsys):
    module = _load("benchmark_transfer")
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--cache-dir" in capsys.readouterr().out



def test_shift_tails_help(capsys):
    module = _load("shift_tails")
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
