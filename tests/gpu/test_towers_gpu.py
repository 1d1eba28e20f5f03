"""bench/towers.py on CUDA at the tiny shapes (the path the full-shape run takes: bf16, kernels, the encoders'
CUDA attention backend, compiled blocks, the kernel-level profile split): every tower runs, its MFU is counted and
its split has GEMM and attention kernels; and with bucketed patch counts (``--bucket``). The full-shape figures:
``python3 bench/towers.py`` (docs/efficiency.md). The bucketed ViT against the unpadded one on varlen in bf16."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.test_vision_bucket import CFG, GRID, _pixels, _run, _tower, windowed_tower
from titan_mm.models.qwen2_5_vl.vision import build_window_meta
from titan_mm.models.qwen3_vl.vision import build_vision_meta

towers = pytest.importorskip("bench.towers")


@pytest.mark.gpu
def test_towers_tiny_on_cuda(tmp_path):
    out = tmp_path / "towers.json"
    assert towers.main(["--tiny", "--warmup", "2", "--steps", "2", "--out", str(out)]) == 0
    rows = {r["tower"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(towers.TOWERS)
    for r in rows.values():
        assert "error" not in r, r
        assert r["device"] == torch.cuda.get_device_name() and r["dtype"] == "bfloat16"
        assert r["compile"] == "blocks"  # the default: the trainer's compile units
        assert r["backend"] in ("varlen", "flex") and 0 < r["mfu"] < 1
        assert r["profile_ms"]["gemm"] > 0 and r["profile_ms"]["attention"] > 0, r["profile_ms"]
    assert towers.main(["--tiny", "--towers", "qwen3_vl_vit,qwen2_5_vl_vit", "--vary", "3", "--bucket", "256",
                        "--warmup", "2", "--steps", "3", "--out", str(out)]) == 0
    for r in json.loads(out.read_text())["rows"][-2:]:
        assert r["bucket"] == 256 and r["vary"] == 3 and "error" not in r and r["backend"] in ("varlen", "flex")


@pytest.mark.gpu
@pytest.mark.parametrize("tower", ["qwen3_vl", "qwen2_5_vl_windowed"])
def test_bucketed_vit_matches_unpadded_varlen(tower):
    """The bucketed ViTs on CUDA's varlen attention in bf16 (tests/unit/test_vision_bucket.py proves them in fp32 on
    the CPU) against the unpadded ones: outputs and gradients. bf16 stores every op's output with 8 bits, so a
    reordered fp32 accumulation may round a value to its neighbour: one bf16 ulp (2^-8 relative) per reduction on
    the path, at most 2 depth + 4 of them."""
    if tower == "qwen3_vl":
        model, vcfg, build = _tower(), CFG, build_vision_meta
    else:
        model, cfg = windowed_tower()
        vcfg, build = cfg.vision, build_window_meta
    model = model.to("cuda", torch.bfloat16)
    x = _pixels(vcfg, 0).cuda()
    ref = _run(model, x, build(GRID, vcfg, "varlen", "cuda"), True)
    got = _run(model, x, build(GRID, vcfg, "varlen", "cuda", bucket=256), True)
    rtol = (2 * vcfg.depth + 4) * 2.0**-8
    for g, w in zip(got, ref):
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
        assert err <= rtol, f"relative error {err:.2e} over {rtol:.2e}"
