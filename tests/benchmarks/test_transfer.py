"""The transfer study on two synthetic frameworks: one whose features carry the
decisive-turn signal in the same direction as the other's, but on another scale."""

import numpy as np
import pytest

from skafa import GroupedSoftmaxClassifier, SiteSelector, TurnFeatures
from skafa.benchmarks import ADAPTATIONS, adaptation_rule, run_transfer_study
from skafa.testing import make_conversations


def _two_frameworks(n_a=30, n_b=20, seed=0):
    convs = make_conversations(n_a + n_b, min_turns=3, max_turns=8, seed=seed)
    rng = np.random.default_rng(seed)
    n_turns = np.asarray([len(c) for c in convs])
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    values = rng.normal(size=(offsets[-1], 2, 4))
    y = np.asarray([c.mistake_step for c in convs])
    values[offsets[:-1] + y, 0, 0] += 3.0
    frameworks = np.asarray(["A"] * n_a + ["B"] * n_b)
    rows_b = np.repeat(frameworks == "B", n_turns)
    values[rows_b] = values[rows_b] * 4.0 + 1.0  # framework B: other scales
    X = TurnFeatures(values, offsets, sites=("s0", "s1"),
                     task_ids=[str(c.task_id) for c in convs])
    return convs, X, frameworks


def test_study_runs_both_directions_with_baselines_shift_and_curves():
    convs, X, fw = _two_frameworks()
    selector = SiteSelector(GroupedSoftmaxClassifier(), param_grid={"C": [0.1, 1.0]},
                            cv=3)
    lines = []
    res = run_transfer_study(convs, X, fw, selector=selector, train_sizes=(0, 4, 1.0),
                             n_draws=2, n_resamples=100, log=lines.append)
    assert set(res["directions"]) == {"A -> B", "B -> A"}
    for d in res["directions"].values():
        rows = d["rows"]
        for name in ("probe (A0, no adaptation)", "position-only", "TF-IDF",
                     "most frequent (relative)", "uniform (expected)",
                     *(f"probe + {a}" for a in ADAPTATIONS)):
            assert rows[name]["low"] <= rows[name]["mean"] <= rows[name]["high"], name
        assert d["best_sites"] == ["s0"]
        # the features carry the signal: transfer clearly beats the uniform guess
        assert rows["probe (A0, no adaptation)"]["mean"] > rows["uniform (expected)"]["mean"]
        # the other framework differs in scale: the shift detector sees it
        assert d["shift"]["target runs"] >= 0.9
        assert d["shift"]["held-out source runs"] <= 0.3
        curves = d["curves"]
        assert {"target-only", "pooled", "pooled, margin order"} <= set(curves)
        assert [r["size"] for r in curves["pooled"]["rows"]] == [0, 4, 1.0]
        assert [r["size"] for r in curves["target-only"]["rows"]] == [4, 1.0]
    assert res["adaptation_rule"]["winner"] in (None, *ADAPTATIONS)
    assert any("adaptation rule" in line for line in lines)


def test_adaptation_rule_needs_a_ci_above_zero_and_breaks_ties_by_order():
    groups = np.arange(40).astype(str)
    up = np.ones(40)
    rule = adaptation_rule({ADAPTATIONS[0]: up, ADAPTATIONS[1]: up}, groups, n_resamples=50)
    assert rule["winner"] == ADAPTATIONS[0]
    mixed = np.tile([1.0, -1.0], 20)
    rule = adaptation_rule({ADAPTATIONS[0]: mixed, ADAPTATIONS[1]: mixed}, groups,
                           n_resamples=50)
    assert rule["winner"] is None


def test_study_needs_two_frameworks():
    convs, X, _ = _two_frameworks(n_a=10, n_b=0)
    with pytest.raises(ValueError, match="exactly two"):
        run_transfer_study(convs, X, ["A"] * 10, curves=False)


def test_the_example_writes_json_markdown_and_plot(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "benchmark_transfer.py"
    spec = importlib.util.spec_from_file_location("skafa_example_transfer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    convs, X, fw = _two_frameworks()
    selector = SiteSelector(GroupedSoftmaxClassifier(), param_grid={"C": [1.0]}, cv=3)
    res = run_transfer_study(convs, X, fw, selector=selector, train_sizes=(0, 10, 1.0),
                             n_draws=2, n_resamples=50)
    res["margin_vs_random_k10"] = module._margin_vs_random(res, 50, 0)
    assert res["margin_vs_random_k10"]["n"] == 50
    module.write_outputs(res, tmp_path, "tiny", n_resamples=50)
    data = json.loads((tmp_path / "transfer_tiny.json").read_text())
    assert set(data["directions"]) == {"A -> B", "B -> A"}
    assert "_result" not in json.dumps(data)
    text = (tmp_path / "transfer_tiny.md").read_text()
    assert "## A -> B" in text and "Adaptation rule" in text and "Margin order" in text
    assert (tmp_path / "transfer_tiny.png").stat().st_size > 0
