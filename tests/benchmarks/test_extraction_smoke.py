"""``examples/benchmark_extraction.py --device-run`` runs end to end on a tiny model."""

import argparse
import importlib.util
from pathlib import Path

from skafa.testing import make_tiny_llama, make_tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "benchmark_extraction.py"


def _load():
    spec = importlib.util.spec_from_file_location("benchmark_extraction", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(tmp_path, folder, data, dtype):
    return argparse.Namespace(
        model=str(folder), device="cpu", dtype=dtype, batch_size="1", n=2, repeats=2,
        max_tokens=None, data=str(data), output=str(tmp_path / f"{dtype}.md"))


def test_device_run_in_half_precision_times_float32_too(tmp_path, who_and_when_dir):
    """On a CPU in bf16 the report has the bare float32 row; in float32 it has not."""
    folder = tmp_path / "tiny"
    make_tiny_llama(n_layers=2, seed=3, max_position_embeddings=8192).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    module = _load()

    module.run_device(_args(tmp_path, folder, who_and_when_dir, "bfloat16"))
    text = (tmp_path / "bfloat16.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| bare forward")]
    assert len(rows) == 2 and "float32" in rows[1]
    assert "bfloat16 vs float32 on the first 2 records: largest relative error" in text
    # The float32 forward is timed (a positive number) in the same repeats.
    assert float(rows[1].split("|")[2]) > 0

    module.run_device(_args(tmp_path, folder, who_and_when_dir, "float32"))
    text = (tmp_path / "float32.md").read_text()
    assert sum(line.startswith("| bare forward") for line in text.splitlines()) == 1
    # float32 against itself: the same values.
    assert "largest relative error of a turn vector 0.00e+00" in text
