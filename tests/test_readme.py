"""The README stays short and its example runs (on the tiny model, offline)."""

import re
from pathlib import Path

import numpy as np

import skafa
from skafa.llm import register_model
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) < 150


def test_readme_example_runs_on_the_tiny_model(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(code.strip().splitlines()) <= 10
    convs = make_conversations(12, min_turns=3, max_turns=5, seed=3)
    y = np.asarray([c.mistake_step for c in convs])
    groups = np.arange(len(convs))

    def fake_load(path, subset, return_X_y):
        assert subset == "Algorithm-Generated" and return_X_y
        return convs, y, groups

    monkeypatch.setattr(skafa, "load_who_and_when", fake_load)
    # 9 layers: stride:3 gives the 4 sites the recommended top-3 average needs
    name = "skafa-readme-llama"
    register_model(name, make_tiny_llama(n_layers=9), make_tiny_tokenizer(), overwrite=True)
    code = code.replace('"smollm2"', repr(name)).replace('"/tmp/skafa-cache"',
                                                         repr(str(tmp_path)))
    printed = []
    exec(compile(code, str(README), "exec"), {"print": printed.append})
    assert len(printed) == 1 and 0.0 <= float(printed[0]) <= 1.0


_READERS = {"SmolLM2-135M-Instruct": "smollm2",
            "Qwen2.5-Coder-0.5B-Instruct": "qwen2.5-coder-0.5b",
            "Gemma-3-270M (base)": "gemma-3-270m",
            "Qwen2.5-Coder-1.5B-Instruct (bfloat16)": "qwen2.5-coder-1.5b"}


def _signed(x):
    return f"{100 * x:+.1f}".replace("-", "−")


def test_readme_results_table_shows_the_committed_result_files():
    """The README's one results table is the pre-registered result files' numbers
    (Algorithm-Generated): each reader's accuracy with its CI and its paired differences."""
    import json

    text = README.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip().strip("*") for c in ln.strip("|").split("|")] for ln in lines[1:]]
    assert {r[0] for r in rows} == set(_READERS)
    results = README.parent / "docs" / "results"
    for cells in rows:
        r = json.loads((results / f"prereg_{_READERS[cells[0]]}_Algorithm-Generated.json")
                       .read_text())
        s = r["summary"]
        acc = s["skafa (pre-registered auto)"]["step_accuracy"]
        assert cells[1] == (f"{100 * acc['estimate']:.1f}% [{100 * acc['low']:.1f}, "
                            f"{100 * acc['high']:.1f}]"), cells[0]
        for col, base in ((2, "position-only"), (3, "TF-IDF")):
            base_acc = s[base]["step_accuracy"]["estimate"]
            assert header[col] == f"− {base} ({100 * base_acc:.1f}%)", (cells[0], base)
            d = r["paired"][f"skafa (pre-registered auto) - {base}"]
            want = f"{_signed(d['estimate'])} [{_signed(d['low'])}, {_signed(d['high'])}]"
            assert cells[col] == want, (cells[0], base)
