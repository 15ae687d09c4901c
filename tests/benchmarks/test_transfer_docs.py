"""The tables of docs/your-own-framework.md equal their result file."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "docs" / "results" / "transfer_smollm2.json"
PAGE = ROOT / "docs" / "your-own-framework.md"


def _block(name):
    text = PAGE.read_text(encoding="utf-8")
    m = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert m, f"markers {name} missing"
    return m.group(1)


def _ci(r):
    return f"{100 * r['mean']:.1f}% [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"


@pytest.fixture(scope="module")
def result():
    return json.loads(RESULT.read_text())


def test_k0_table(result):
    block = _block("transfer-k0")
    for key, d in result["directions"].items():
        src, tgt = key.split(" -> ")
        cells = [_ci(d["rows"][m]) for m in (
            "probe (A0, no adaptation)", "position-only", "TF-IDF",
            "most frequent (relative)", "uniform (expected)")]
        assert f"| {src} → {tgt} | " + " | ".join(cells) in block


def test_adaptation_table_and_winner(result):
    block = _block("transfer-adaptation")
    for name, r in result["adaptation_rule"]["differences"].items():
        assert (f"| {name} | {100 * r['mean']:+.1f} [{100 * r['low']:+.1f}, "
                f"{100 * r['high']:+.1f}] | {r['n']} |") in block
    assert result["adaptation_rule"]["winner"] == "A2 CORAL"


def test_curves_table(result):
    block = _block("transfer-curves")
    for key, d in result["directions"].items():
        tgt = key.split(" -> ")[1]
        for method, c in d["curves"].items():
            line = next(li for li in block.splitlines() if li.startswith(f"| {tgt} | {method} |"))
            for r in c["rows"]:
                if r["mean"] == r["mean"]:
                    assert _ci(r) in line, (tgt, method, r["size"])


def test_shift_table(result):
    block = _block("transfer-shift")
    for key, d in result["directions"].items():
        s = d["shift"]
        assert (f"| {key.split(' -> ')[0]} | {100 * s['held-out source runs']:.1f}% of "
                f"{s['n_source']} | {100 * s['target runs']:.1f}% of {s['n_target']} |") in block
