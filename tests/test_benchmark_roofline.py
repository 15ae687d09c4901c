"""examples/benchmark_roofline.py: its --help and a smoke run on a tiny random model."""

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "benchmark_roofline.py"


@pytest.fixture(scope="module")
def roofline():
    spec = importlib.util.spec_from_file_location("skafa_example_benchmark_roofline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help(roofline, capsys):
    with pytest.raises(SystemExit) as exc:
        roofline.main(["--help"])
    assert exc.value.code == 0
    assert "--smoke" in capsys.readouterr().out


def test_smoke_run_prints_the_table(roofline, capsys):
    out = roofline.main(["--smoke", "--repeats", "2", "--warmup", "1"])
    text = capsys.readouterr().out
    header = "| " + " | ".join(roofline.COLUMNS) + " |"
    assert header in text
    assert list(roofline.COLUMNS) == ["dtype", "kernel", "GEMM GFLOP/s (sustained, before)",
                                      "GEMM GFLOP/s (sustained, after)",
                                      "extraction GFLOP/s", "extraction / GEMM"]
    assert out["threads"] >= 1 and "torch thread(s)" in text and "- machine:" in text
    assert out["rows"] and out["rows"][0]["dtype"] == "float32"
    for row in out["rows"]:
        assert f"| {row['dtype']} | {row['kernel']} |" in text and row["kernel"]
        for key in ("gemm_before", "gemm_after", "extraction", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["dtype"], key)
        gemm = (row["gemm_before"] + row["gemm_after"]) / 2
        assert row["ratio"] == pytest.approx(row["extraction"] / gemm)
        assert row["flops"] > 0 and row["n_tokens"] > 0
