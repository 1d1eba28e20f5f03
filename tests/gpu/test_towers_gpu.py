"""bench/towers.py on CUDA at the tiny shapes (the path the full-shape run takes: bf16, kernels, the encoders'
CUDA attention backend, compiled blocks, the kernel-level profile split): every tower runs, its MFU is counted and
its split has GEMM and attention kernels. The full-shape figures: ``python3 bench/towers.py`` (docs/efficiency.md)."""

from __future__ import annotations

import json

import pytest
import torch

towers = pytest.importorskip("bench.towers")


@pytest.mark.gpu
def test_towers_tiny_on_cuda(tmp_path):
    out = tmp_path / "towers.json"
    assert towers.main(["--tiny", "--warmup", "2", "--steps", "2", "--out", str(out)]) == 0
    rows = {r["tower"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(towers.TOWERS)
    for r in rows.values():
        assert "error" not in r, r
        assert r["device"] == torch.cuda.get_device_name() and r["dtype"] == "bfloat16" and r["compiled"]
        assert r["backend"] in ("varlen", "flex") and 0 < r["mfu"] < 1
        assert r["profile_ms"]["gemm"] > 0 and r["profile_ms"]["attention"] > 0, r["profile_ms"]
