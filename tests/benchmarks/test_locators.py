"""The §8 locator-head / grafting benchmark runs end to end on the tiny random model."""

import importlib.util
import json
from pathlib import Path

import numpy as np

from skafa import TurnFeatures
from skafa.benchmarks import LOCATOR_ROWS, gap_closed, top_locator_head

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_locators_smoke(tmp_path):
    bench = _load("benchmark_locators")
    out = tmp_path / "out"
    result = bench.main(["--smoke", "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    assert result["rows"] == list(LOCATOR_ROWS) and result["missing_rows"] == []
    saved = json.loads((out / "locators_smoke_Algorithm-Generated.json").read_text())
    assert saved["predictions"] == result["predictions"] and saved["n"] == 20
    for name in LOCATOR_ROWS:
        P = np.asarray(result["predictions"][name])
        assert P.shape == (1, 20) and P.min() >= 0, name
        r = result["summary"][name]["step_accuracy"]
        assert 0.0 <= r["low"] <= r["estimate"] <= r["high"] <= 1.0, name
    assert {"grafted_judge - judge", "locator_probe - position"} <= set(result["paired"])
    md = (out / "locators_smoke_Algorithm-Generated.md").read_text()
    assert "| locator_probe |" in md and "× one bare forward pass" in md
    assert all(v >= 0 for v in result["cost_vs_bare_forward"].values())


def test_top_locator_head_picks_the_head_on_the_decisive_turn():
    rng = np.random.default_rng(0)
    offsets = np.array([0, 3, 7, 10])
    y = np.array([2, 0, 1])
    values = rng.uniform(0, 0.2, size=(10, 2, 4))
    values[offsets[:-1] + y, 1, 3] = 0.9  # layer 1, head 3 looks at the decisive turn
    X = TurnFeatures(values, offsets, sites=["head_attn.0", "head_attn.1"])
    site, head, mass = top_locator_head(X, y)
    assert (site, head) == ("head_attn.1", 3) and mass == 0.9


def test_gap_closed():
    groups = np.arange(40)
    judge = np.zeros(40)
    probe = np.ones(40)
    grafted = (np.arange(40) % 2).astype(float)  # closes half the gap
    out = gap_closed({"judge": judge, "recommended": probe, "grafted_judge": grafted},
                     groups, n_resamples=300)
    assert out["estimate"] == 0.5 and out["low"] <= 0.5 <= out["high"]
    # no gap: the probe is no better than the judge
    assert gap_closed({"judge": judge, "recommended": judge, "grafted_judge": grafted},
                      groups, n_resamples=300) is None
