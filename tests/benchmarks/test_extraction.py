"""The extraction benchmark (:mod:`skafa.benchmarks`) and its command
``examples/benchmark_extraction.py`` run end to end on a tiny model (seconds)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import skafa.benchmarks._extraction as extraction
from skafa.benchmarks import (
    EXTRACTION_PEERS,
    ExtractionBenchmarkSettings,
    first_records,
    measure_peak_memory,
    run_device_benchmark,
    run_extraction_benchmark,
    run_peers_benchmark,
)
from skafa.llm import PromptTemplate, load_model
from skafa.testing import (
    make_conversations,
    make_tiny_llama,
    make_tiny_tokenizer,
    write_who_and_when,
)

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "benchmark_extraction.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("benchmark_extraction", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama saved to a folder (fresh processes load it by path), and records."""
    root = tmp_path_factory.mktemp("extraction-bench")
    folder = root / "tiny"
    make_tiny_llama(n_layers=2, seed=3, max_position_embeddings=8192).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    data = write_who_and_when(root / "wnw", make_conversations(4, min_turns=3, seed=5))
    return str(folder), str(data)


def _fake_memory(calls):
    def measure(method, record_file, **kwargs):
        calls.append((method, Path(record_file).name, kwargs.get("peers", False)))
        return 1.0 + len(calls), 10
    return measure


def test_first_records_skip_long_prompts_and_name_a_missing_folder(tiny, tmp_path):
    folder, data = tiny
    _, tok = load_model(folder, dtype="float32")
    prompt = PromptTemplate()
    chosen, skipped = first_records(data, 10, 10**6, tok, prompt)
    assert [c.record_id for c, _ in chosen] == [f"Algorithm-Generated/{i}" for i in range(1, 5)]
    assert skipped == []
    n = [e.n_tokens for _, e in chosen]
    limit = sorted(n)[1]  # keeps the two shortest
    chosen, skipped = first_records(data, 10, limit, tok, prompt)
    assert len(chosen) == 2 and all(e.n_tokens <= limit for _, e in chosen)
    assert sorted(k for _, k in skipped) == sorted(k for k in n if k > limit)
    assert len(first_records(data, 1, 10**6, tok, prompt)[0]) == 1
    with pytest.raises(FileNotFoundError, match="Who&When data not found"):
        first_records(tmp_path, 1, 100, tok, prompt)


def test_measure_peak_memory_in_a_fresh_process(tiny, tmp_path):
    folder, data = tiny
    record = Path(data) / "Algorithm-Generated" / "1.json"
    extra, n_tokens = measure_peak_memory("skafa", record, peers=True, model=folder,
                                          threads=1)
    assert extra >= 0 and n_tokens > 0
    with pytest.raises(FileNotFoundError, match="no record file"):
        measure_peak_memory("skafa", tmp_path / "missing.json", peers=True, model=folder)


@pytest.mark.parametrize("method", ["bare", "skafa", "hidden_states"])
def test_memory_child_of_the_plain_run(tiny, tmp_path, method):
    """What the fresh process runs, here in-process: one record, one JSON answer."""
    import json

    folder, data = tiny
    out = tmp_path / "out.json"
    extraction._memory_child({"method": method, "peers": False, "model": folder,
                              "record": str(Path(data) / "Algorithm-Generated" / "2.json"),
                              "threads": None, "out": str(out)})
    res = json.loads(out.read_text())
    assert res["method"] == method and res["n_tokens"] > 0 and res["extra_mib"] >= 0


def test_measure_peak_memory_names_a_failed_process(tiny, monkeypatch):
    folder, data = tiny
    record = Path(data) / "Algorithm-Generated" / "1.json"
    monkeypatch.setattr(extraction, "_CHILD", "raise SystemExit('out of memory')")
    with pytest.raises(RuntimeError, match=r"'bare' on .*1.json: the process failed "
                                           r"\(out of memory\)"):
        measure_peak_memory("bare", record, model=folder)


def test_plain_run_reports_every_method(tiny, monkeypatch):
    folder, data = tiny
    calls = []
    monkeypatch.setattr(extraction, "measure_peak_memory", _fake_memory(calls))
    lines = []
    settings = ExtractionBenchmarkSettings(data=data, n=3, repeats=2, model=folder,
                                           command="python bench.py --n 3 ")
    out = run_extraction_benchmark(settings, log=lines.append)
    text = out["markdown"]
    assert out["n_records"] == 3 and set(out["total"]) == {"bare", "skafa", "hidden_states"}
    assert all(v > 0 for v in out["total"].values())
    assert [c[0] for c in calls] == ["bare", "skafa", "hidden_states"]
    assert out["memory"] == {"bare": 2.0, "skafa": 3.0, "hidden_states": 4.0}
    assert "- Command: `python bench.py --n 3` (run from the repository root)" in text
    # 2 layers: 5 sites, 3 residual ones; early stop after the first layer's sites
    assert "all 5 sites, no cache" in text and "3 residual sites gathered" in text
    assert "| stop after `mlp_in.0` (default) |" in text and "| run all 2 layers |" in text
    assert text.count("| (a) bare decoder forward") == 2  # time and memory tables
    assert lines[0].startswith("model loaded in") and "repeat 2/2:" in lines[2]


def test_peers_run_compares_with_skafa_and_names_missing_peers(tiny, monkeypatch):
    folder, data = tiny
    calls = []
    monkeypatch.setattr(extraction, "measure_peak_memory", _fake_memory(calls))
    # Only the always-available methods, and one peer that cannot wrap the model.

    class Broken:
        def __init__(self, model, tokenizer, sites):
            raise RuntimeError("no such module")

    monkeypatch.setattr(extraction, "EXTRACTION_PEERS",
                        {"bare": EXTRACTION_PEERS["bare"], "skafa": EXTRACTION_PEERS["skafa"],
                         "copy": EXTRACTION_PEERS["skafa"], "broken": Broken})
    monkeypatch.setattr(extraction, "_available_peers", lambda: (
        [("bare", None), ("skafa", None), ("copy", "1.0"), ("broken", None)],
        {"gone": "ModuleNotFoundError: gone"}))
    settings = ExtractionBenchmarkSettings(data=data, n=2, repeats=1, model=folder)
    out = run_peers_benchmark(settings, log=None)
    assert set(out["total"]) == {"bare", "skafa", "copy"}
    np.testing.assert_array_equal(out["errors"]["copy"], 0.0)  # skafa against itself
    assert out["failed"] == {"broken": "RuntimeError: no such module"}
    text = out["markdown"]
    assert "| skafa `extract_activations` (1.0) |" in text
    assert "- gone: not run (ModuleNotFoundError: gone)." in text
    assert "- broken: not run (RuntimeError: no such module)." in text
    assert "- copy: largest relative error (L2 of a turn vector) 0.0e+00" in text
    assert all(peers for *_, peers in calls)


def test_device_run_in_half_precision_times_float32_too(tiny, tmp_path):
    """On a CPU in bf16 the report has the bare float32 row; in float32 it has not."""
    folder, data = tiny
    module = _load_example()
    argv = ["--device-run", "--model", folder, "--batch-size", "1", "--n", "2",
            "--repeats", "2", "--data", data]
    out = module.main([*argv, "--dtype", "bfloat16", "--output", str(tmp_path / "bf16.md")])
    text = (tmp_path / "bf16.md").read_text()
    assert text == out["markdown"]
    rows = [line for line in text.splitlines() if line.startswith("| bare forward")]
    assert len(rows) == 2 and "float32" in rows[1]
    assert "bfloat16 vs float32 on the first 2 records: largest relative error" in text
    # The float32 forward is timed (a positive number) in the same repeats.
    assert float(rows[1].split("|")[2]) > 0
    assert "batch_size=1" in text and sorted(out["batches"]) == [[0], [1]]

    settings = ExtractionBenchmarkSettings(data=data, n=2, repeats=1, model=folder,
                                           batch_size="auto", dtype="float32")
    out = run_device_benchmark(settings)
    text = out["markdown"]
    assert sum(line.startswith("| bare forward") for line in text.splitlines()) == 1
    # float32 against itself: the same values.
    assert "largest relative error of a turn vector 0.00e+00" in text
    assert "batch_size='auto'" in text and sorted(sum(out["batches"], [])) == [0, 1]


def test_example_exits_when_the_data_are_missing(tmp_path):
    module = _load_example()
    with pytest.raises(SystemExit, match="Who&When data not found"):
        module.main(["--data", str(tmp_path), "--output", str(tmp_path / "x.md")])
