"""bench/fp8_gemm.py's CPU smoke (``--cpu --tiny``): every form of every projection runs and the summary compares
each layer with bf16; the rowwise quantization the w8a8 forms time (titan_mm.nn.fp8) is right: e4m3 values times their row scale
give x back within e4m3's rounding, and the scaled GEMM equals the product of those dequantized values."""

from __future__ import annotations

import json

import pytest
import torch

from titan_mm.nn.fp8 import FP8, FP8_MAX, fp8_rows

fp8 = pytest.importorskip("bench.fp8_gemm")


def test_cpu_tiny_smoke(tmp_path):
    out = tmp_path / "fp8.json"
    assert fp8.main(["--cpu", "--tiny", "--rows", "1,8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and not [r for r in res["rows"] if "error" in r]
    forms = {"bf16", "scaled_mm", "scaled_mm_swapped", "fp8_mm", "quant_eager", "quant_compiled", "fp8_rowwise_fused"}
    assert {(s["rows"], s["form"]) for s in res["summary"]} == {(m, f) for m in (1, 8) for f in forms}
    assert all(s["vs_bf16"] == 1.0 for s in res["summary"] if s["form"] == "bf16")


def test_rowwise_quantization_and_the_scaled_gemm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-3, 3, 5)[:, None]  # rows of very different ranges
    w = torch.randn(16, 64, generator=g)
    xq, xs = fp8_rows(x)
    wq, ws = fp8_rows(w)
    assert xq.dtype == FP8 and xs.shape == (5, 1)
    assert xq.float().abs().amax(-1).tolist() == [FP8_MAX] * 5  # each row fills the range
    back = xq.float() * xs
    # e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 of the value (normal range)
    assert ((back - x).abs() <= x.abs() * 2**-4 + xs * 2**-9).all()
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t().contiguous(), out_dtype=torch.float32)
    torch.testing.assert_close(y, back @ (wq.float() * ws).t(), rtol=1e-5, atol=1e-5)
