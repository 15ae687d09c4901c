"""The §8 cost benchmark (question 4) runs end to end on the tiny random model."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import skafa.benchmarks._locator_cost as locator_cost
from skafa.benchmarks import (
    LOCATOR_COST_METHODS,
    LocatorCostSettings,
    run_locator_cost_benchmark,
)
from skafa.llm import PromptTemplate, TurnActivationTransformer
from skafa.testing import make_conversations, register_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
N, REPEATS = 4, 2


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "cost.md"
    bench = _load("benchmark_locator_cost")
    result = bench.main(["--smoke", "--n", str(N), "--repeats", str(REPEATS),
                         "--output", str(out)])
    return result, out


def test_smoke_writes_every_method_with_positive_ratios(smoke):
    result, out = smoke
    md = out.read_text()
    assert md == result["markdown"]
    for method in LOCATOR_COST_METHODS:
        assert locator_cost._LABELS[method] in md, method
        assert result["ratio_to_bare"][method] > 0, method
        assert result["median_s"][method] > 0, method
        assert len(result["seconds"][method]) == N
    assert result["ratio_to_bare"]["bare"] == 1.0
    assert result["records"] == [f"synthetic/{i}" for i in range(N)]  # the first n, in order
    assert "without `kv_dir`" in md and "with `kv_dir`" in md
    assert "--smoke --n 4" in md and "threads" in md
    # the judges read more tokens than the 'last' prompt: the answer and candidate tokens
    for method in ("judge", "grafted_judge"):
        assert all(t > s for t, s in zip(result["tokens_through_model"][method],
                                         result["tokens_last"])), method
    assert result["tokens_through_model"]["head_features"] == result["tokens_last"]
    splits = result["splits"]
    assert splits["same_predictions"] and splits["sizes"] == [[2, 2], [2, 2]]
    runs = splits["runs"]
    assert all(run["vs_bare_sum"] > 0 for run in runs.values())
    # with kv_dir each prompt is read once instead of twice
    assert runs["kv_dir"]["tokens_through_model"] < runs["no kv_dir"]["tokens_through_model"]


def test_head_features_ran_a_pass_per_call_and_equal_the_cached_transformers(smoke, tmp_path):
    result, _ = smoke
    assert result["forward_passes"] == [1] * (N * REPEATS)
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=result["prompt_budget"])
    convs = make_conversations(N, seed=0)
    cached = TurnActivationTransformer("locator-cost-smoke", read="last", sites="head_attn",
                                       prompt=template, dtype=result["dtype"],
                                       cache_dir=tmp_path).fit(convs).transform(convs)
    got = result["head_features"]
    assert all(X is not None and X.values.shape[0] == len(c) for X, c in zip(got, convs))
    np.testing.assert_array_equal(np.concatenate([X.values for X in got]), cached.values)
    assert list(got[0].sites) == list(cached.sites)


def test_interleaving_order_rotates(smoke):
    result, _ = smoke
    order = result["order"]
    assert len(order) == N * REPEATS
    names = list(LOCATOR_COST_METHODS)
    for entry in order:
        k = (entry["repeat"] + entry["record"]) % len(names)
        assert entry["order"] == names[k:] + names[:k]
        assert sorted(entry["order"]) == sorted(names)
    # every method runs first somewhere, and a record's order changes between repeats
    assert {e["order"][0] for e in order} == set(names)
    by_record = {}
    for e in order:
        by_record.setdefault(e["record"], []).append(tuple(e["order"]))
    assert all(len(set(v)) == REPEATS for v in by_record.values())


@pytest.mark.parametrize("field, value", [("n", 0), ("repeats", 0), ("n", 1.5),
                                          ("max_prompt_tokens", 0), ("split_cv", 1)])
def test_invalid_settings_raise(field, value):
    settings = LocatorCostSettings(model=register_tiny_model(), **{field: value})
    with pytest.raises(ValueError, match=f"LocatorCostSettings.{field}"):
        run_locator_cost_benchmark(settings, make_conversations(4))


def test_too_few_conversations_raise():
    settings = LocatorCostSettings(model=register_tiny_model(), n=5)
    with pytest.raises(ValueError, match="n=5 records asked for, but only 3"):
        run_locator_cost_benchmark(settings, make_conversations(3))


def test_a_cached_feature_pass_is_refused(monkeypatch):
    # With the memory cache on, a repeat is answered without a forward pass: the
    # benchmark must refuse to report that as the pass's time.
    real = locator_cost.TurnActivationTransformer

    def cached(*args, **kwargs):
        kwargs["memory_cache"] = True
        return real(*args, **kwargs)

    monkeypatch.setattr(locator_cost, "TurnActivationTransformer", cached)
    settings = LocatorCostSettings(model=register_tiny_model(), n=2, repeats=2,
                                   max_prompt_tokens=512)
    with pytest.raises(RuntimeError, match="forward passes in one call instead of 1"):
        run_locator_cost_benchmark(settings, make_conversations(2, seed=3))
