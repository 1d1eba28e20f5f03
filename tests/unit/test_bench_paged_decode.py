"""bench/paged_decode.py's CPU smoke (``--cpu --tiny``): each pool dtype runs the library's decode attention, within
bf16 output rounding of the fp32 reference, and the fp8 row's bytes are half the bf16 row's."""

from __future__ import annotations

import json

import pytest

pd = pytest.importorskip("bench.paged_decode")


def test_cpu_tiny_smoke(tmp_path):
    out = tmp_path / "pd.json"
    assert pd.main(["--cpu", "--tiny", "--batches", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["pool"]: r for r in res["rows"]}
    assert res["device"] == "cpu" and set(rows) == set(pd.POOLS) and not [r for r in rows.values() if "error" in r]
    assert all(r["max_err"] <= 2.0 ** -8 * 4 for r in rows.values())  # |o| < 4: bf16's rounding of the output
    assert rows["bf16"]["kv_bytes"] == 2 * rows["fp8_e4m3"]["kv_bytes"] > 0
