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
