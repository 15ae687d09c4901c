"""The FLOP model of a forward pass and the two-length calibration of the ETA."""

import numpy as np
import pytest

from skafa.llm import _cost, calibrate_seconds, forward_flops
from skafa.testing import make_tiny_gemma3, make_tiny_llama


@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_gemma3])
def test_forward_flops_split_sums_to_the_total(make):
    model = make()
    n = np.array([1, 37, 600, 5000])
    weights, attention = forward_flops(model, n, split=True)
    np.testing.assert_allclose(weights + attention, forward_flops(model, n))
    np.testing.assert_allclose(weights / n, weights[0])  # the weights' term: linear in n
    w1, a1 = forward_flops(model, 300, split=True)
    assert isinstance(w1, float) and isinstance(a1, float)
    assert w1 + a1 == pytest.approx(forward_flops(model, 300))


def _fake_passes(monkeypatch, model, a, b):
    """measure_throughput as if a pass took a s per weight FLOP and b per attention FLOP."""
    calls = []

    def fake(m, *, n_tokens=512, repeats=2, seed=0):
        calls.append(n_tokens if repeats == 2 else (n_tokens, repeats))
        w, att = forward_flops(m, n_tokens, split=True)
        seconds = a * w + b * att
        return {"n_tokens": n_tokens, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
                "flops_per_s": (w + att) / seconds}
    monkeypatch.setattr(_cost, "measure_throughput", fake)
    return calls


def test_calibration_prices_attention_apart(monkeypatch):
    model = make_tiny_llama()
    a, b = 2e-11, 9e-11  # attention at a lower rate than the weights, as on a CPU
    calls = _fake_passes(monkeypatch, model, a, b)
    n = [100, 900, 6000, 8192]
    cal = calibrate_seconds(model, n)
    assert calls == [512, (4096, 1)]  # the long pass timed once
    assert cal["per_flop"] == pytest.approx((a, b))
    w, att = forward_flops(model, np.array(n), split=True)
    np.testing.assert_allclose(cal["seconds"], a * w + b * att)
    # one short pass's rate promises too little for the long prompts
    one_rate = np.asarray(forward_flops(model, np.array(n))) / cal["passes"][0]["flops_per_s"]
    assert cal["seconds"][-1] > one_rate[-1] * 1.05


def test_calibration_short_prompts_and_bad_timings_fall_back_to_one_rate(monkeypatch):
    model = make_tiny_llama()
    calls = _fake_passes(monkeypatch, model, 2e-11, 9e-11)
    cal = calibrate_seconds(model, [100, 1000])  # under twice 512: one pass
    assert calls == [512] and len(cal["passes"]) == 1
    rate = cal["passes"][0]["flops_per_s"]
    np.testing.assert_allclose(cal["seconds"], forward_flops(model, np.array([100, 1000])) / rate)
    calls = _fake_passes(monkeypatch, model, 3e-11, -1e-12)  # no positive solution
    cal = calibrate_seconds(model, [3000])
    assert calls == [512, (3000, 1)]  # capped at the longest prompt
    slowest = min(p["flops_per_s"] for p in cal["passes"])
    assert cal["per_flop"] == (1 / slowest, 1 / slowest)
    calls = _fake_passes(monkeypatch, model, 2e-11, 9e-11)
    assert len(calibrate_seconds(model, [1500], long=1200)["passes"]) == 2
    assert calls == [512, (1200, 1)]


def test_calibration_times_real_passes():
    model = make_tiny_llama(n_layers=2, hidden=32, max_position_embeddings=2048)
    cal = calibrate_seconds(model, [40, 1100], repeats=1)  # the long pass: the longest prompt
    assert [p["n_tokens"] for p in cal["passes"]] == [512, 1100]
    assert np.all(cal["seconds"] > 0) and cal["seconds"][1] > cal["seconds"][0]
    assert all(v > 0 for v in cal["per_flop"])
    # a context of 512 tokens caps the long pass at the short one's length: one rate
    short = calibrate_seconds(make_tiny_llama(n_layers=2, hidden=32), [40, 5000], repeats=1)
    assert [p["n_tokens"] for p in short["passes"]] == [512]
