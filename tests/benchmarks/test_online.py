"""The online-auditing benchmark script runs end to end on the tiny random model."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from skafa.benchmarks import POSITION_AUDITOR, paired_online

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_online_smoke(tmp_path):
    bench = _load("benchmark_online")
    result = bench.main(["--smoke", "--out", str(tmp_path / "out"),
                         "--cache-dir", str(tmp_path / "cache")])
    methods = {"auditor (cumulative)", "auditor (hazard)",
               "position-only auditor (cumulative)", "post-hoc probe argmax (offline bound)"}
    assert set(result["summary"]) == methods
    y = np.array(result["y_true"])
    for name in methods:
        P = np.array(result["predictions"][name])
        assert P.shape == (1, 40) and P.min() >= -1  # every run predicted once
        r = result["summary"][name]
        assert r["n_failed"] == 40 and r["n_safe"] == int(np.sum(y >= 1))
        for key in ("Step-Acc", "Exact-F1", "FAR", "miss rate"):
            v = r[key]
            assert 0.0 <= v["low"] <= v["estimate"] <= v["high"] <= 1.0, (name, key)
        assert r["Step-Acc"]["estimate"] == np.mean(P[0] == y)
    offline = np.array(result["predictions"]["post-hoc probe argmax (offline bound)"])
    assert offline.min() >= 0  # the offline bound always names a step
    out = tmp_path / "out"
    assert (out / "online_smoke_synthetic.json").exists()
    assert not (out / "online_smoke_synthetic.partial.json").exists()
    md = (out / "online_smoke_synthetic.md").read_text()
    assert "| auditor (cumulative) |" in md and "FAR target" in md
    assert (out / "online_smoke_synthetic_scores.png").stat().st_size > 1000
    saved = json.loads((out / "online_smoke_synthetic.json").read_text())
    assert saved["far_target"] == 0.2 and saved["score_traces"]
    # a second run reads the activation cache: no forward pass
    again = bench.main(["--smoke", "--extract-only", "--cache-dir", str(tmp_path / "cache")])
    assert again["n_forward_passes"] == 0
    # --resume reuses finished outer fits: with all of them recorded, none is refitted
    partial = dict(saved, done=[[0, 0], [0, 1]], choices=saved["choices"])
    (out / "online_smoke_synthetic.partial.json").write_text(json.dumps(partial))
    resumed = bench.main(["--smoke", "--resume", "--out", str(out),
                          "--cache-dir", str(tmp_path / "cache")])
    assert resumed["summary"] == result["summary"] and resumed["times"].get("cv", 0.0) == 0.0
    partial["far_target"] = 0.5
    (out / "online_smoke_synthetic.partial.json").write_text(json.dumps(partial))
    with pytest.raises(SystemExit, match="other settings"):
        bench.main(["--smoke", "--resume", "--out", str(out),
                    "--cache-dir", str(tmp_path / "cache")])


def test_benchmark_streaming_smoke(tmp_path):
    bench = _load("benchmark_streaming")
    result = bench.main(["--smoke", "--out", str(tmp_path / "streaming.json")])
    assert result["n_turns"] > 0 and result["ratio"] > 0
    assert result["max_abs_diff"] < 1e-3  # streamed vectors equal re-read vectors
    assert result["tokens_streamed"] < result["tokens_reread"]


def test_benchmark_online_paired_and_rescore(tmp_path):
    """Paired differences use the same resamples; --rescore rebuilds the tables exactly."""
    bench = _load("benchmark_online")
    out = tmp_path / "out"
    result = bench.main(["--smoke", "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    y = np.array(result["y_true"])
    groups = np.array(result["task_ids"], dtype=object)
    P = np.array(result["predictions"]["auditor (hazard)"])
    same = paired_online(P, P, y, groups, n_resamples=50, seed=0)
    assert all(r == {"estimate": 0.0, "low": 0.0, "high": 0.0} for r in same.values())
    key = f"auditor (hazard) - {POSITION_AUDITOR}"
    s = result["summary"]
    for metric in ("Exact-F1", "Step-Acc", "FAR"):
        want = s["auditor (hazard)"][metric]["estimate"] - s[POSITION_AUDITOR][metric]["estimate"]
        assert result["paired"][key][metric]["estimate"] == pytest.approx(want)
    path = out / "online_smoke_synthetic.json"
    md_before = (out / "online_smoke_synthetic.md").read_text()
    again = bench.main(["--rescore", str(path), "--n-resamples", "200"])
    assert again["summary"] == result["summary"] and again["paired"] == result["paired"]
    assert (out / "online_smoke_synthetic.md").read_text() == md_before
    assert "paired difference" in md_before


_DOCS = Path(__file__).resolve().parents[2] / "docs"
_ONLINE_ROWS = {"auditor (cumulative target)": "auditor (cumulative)",
                "auditor (hazard target)": "auditor (hazard)",
                "position-only auditor (cumulative)": POSITION_AUDITOR,
                "post-hoc probe argmax (offline bound)": "post-hoc probe argmax (offline bound)"}
# column header -> (summary key, percent?)
_ONLINE_COLUMNS = {"Exact-F1 % (b)": ("Exact-F1", True), "FAR % (b)": ("FAR", True),
                   "Step-Acc % (a)": ("Step-Acc", True), "ASS (a)": ("ASS", False),
                   "delay (a)": ("delay", False),
                   "early-alarm share % (a)": ("early share", True),
                   "miss rate % (a)": ("miss rate", True), "Agent-Acc % (a)": ("Agent-Acc", True)}


def _online(tag):
    return json.loads((_DOCS / "results" / f"online_{tag}_Algorithm-Generated.json").read_text())


def _fmt(s, percent, signed=False):
    """One estimate with its CI as §5 writes it (points or a plain 2-decimal number)."""
    def one(x):
        if not percent:
            return f"{x:.2f}"
        if not signed:
            return f"{100 * x:.1f}"
        return "0.0" if round(100 * x, 1) == 0 else f"{100 * x:+.1f}".replace("-", "−")
    if s["low"] == s["high"] == s["estimate"] and not signed:
        return one(s["estimate"])  # a figure that cannot vary (the bound never misses): no CI
    return f"{one(s['estimate'])} [{one(s['low'])}, {one(s['high'])}]"


@pytest.mark.parametrize("marker, tag, far", [
    ("online-table-smollm2", "smollm2-135m", 0.05),
    ("online-table-smollm2-far0.2", "smollm2-135m-far0.2", 0.2),
    ("online-table-qwen-0.5b", "qwen2.5-coder-0.5b", 0.05)])
def test_benchmarks_md_section_5_tables_match_the_result_files(benchmarks_md_table, marker, tag,
                                                               far):
    """§5's auditor tables: every method's figures with their CIs, from the result file of
    the run the table names (the offline bound has no Exact-F1 or FAR: it never abstains)."""
    r = _online(tag)
    assert r["far_target"] == far and r["n_conversations"] == 100 and r["n_safe"] == 85
    header, rows = benchmarks_md_table(marker)
    assert header[1:] == list(_ONLINE_COLUMNS)
    assert {cells[0] for cells in rows} <= set(_ONLINE_ROWS) and len(rows) >= 3
    for cells in rows:
        s = r["summary"][_ONLINE_ROWS[cells[0]]]
        want = [_fmt(s[key], percent) for key, percent in _ONLINE_COLUMNS.values()]
        if cells[0].startswith("post-hoc"):
            want[:2] = ["—", "—"]
        assert cells[1:] == want, (marker, cells[0])


@pytest.mark.parametrize("marker, runs", [
    ("online-paired-smollm2", {"0.05": "smollm2-135m", "0.2": "smollm2-135m-far0.2"}),
    ("online-paired-qwen-0.5b", {"0.05": "qwen2.5-coder-0.5b"})])
def test_benchmarks_md_section_5_paired_tables_match_the_result_files(benchmarks_md_table,
                                                                      marker, runs):
    """§5's paired differences against the position-only auditor, per target form and FAR
    target, from the result files' paired bootstrap."""
    header, rows = benchmarks_md_table(marker)
    assert header[1:] == ["Exact-F1 (b)", "Step-Acc (a)", "FAR (b)"]
    assert len(rows) == 2 * len(runs)
    for cells in rows:
        form, target = cells[0].split(", FAR target ")
        paired = _online(runs[target])["paired"][f"auditor ({form}) - {POSITION_AUDITOR}"]
        assert cells[1:] == [_fmt(paired[k], True, signed=True)
                             for k in ("Exact-F1", "Step-Acc", "FAR")], (marker, cells[0])
