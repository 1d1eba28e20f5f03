"""docs/efficiency.md stays built from bench/results: the text between its markers is what bench/efficiency.py
renders now (rebuild: python3 bench/efficiency.py --doc docs/efficiency.md)."""

import json
from pathlib import Path

import pytest

eff = pytest.importorskip("bench.efficiency")
dev = pytest.importorskip("bench.devices")
ROOT = Path(__file__).resolve().parents[2]


def _between_markers() -> str:
    doc = (ROOT / "docs/efficiency.md").read_text()
    return doc[doc.index(eff.BEGIN) + len(eff.BEGIN): doc.index(eff.END)]


def test_doc_matches_the_rendered_report():
    assert _between_markers() == "\n" + eff.report(), \
        "docs/efficiency.md is stale: run python3 bench/efficiency.py --doc docs/efficiency.md"


def test_every_titan_row_of_the_1_7b_case_appears():
    rows = json.loads((ROOT / "bench/results/mfu.json").read_text())["rows"]
    titan = [r for r in rows if r["case"] == "qwen3_1.7b" and r["stack"].startswith("titan") and "error" not in r]
    assert titan
    doc = _between_markers()
    own = doc[doc.index("`bench/results/mfu.json`:"):].split("\n\n`bench/results/")[0]  # mfu.json's own table
    for r in titan:
        want = (f"| qwen3_1.7b | {dev.device_label(dev.device_of(r))} | {r['stack']} | {r['ac']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
                f"{100 * r['mfu']:.1f}% |")
        assert any(ln.startswith(want) for ln in own.splitlines()), want
