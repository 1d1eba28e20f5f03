"""Serving's fp8 kernels off the GPU: titan_mm.kernels.fp8_gemm (the rowwise fp8 GEMM at decode rows) and
fp8_rows.swiglu_fp8_rows (SwiGLU's product cast for the down projection) through TRITON_INTERPRET=1, and both compiled
for Hopper by Triton's own compiler (no GPU needed) at the launches the engine uses, within its shared memory. Their
bit-exactness and speed on the GPU: tests/gpu/test_kernels_gpu.py and bench/fp8_gemm.py.

The interpreter computes tl.dot in fp32 numpy, so the GEMM matches the fp32 product of the dequantized operands to
summation order (k roundings of 2^-24 of the terms' sum). Its e4m3 cast rounds some values just under a power of two
down a whole binade (127.9 to 64), so the SwiGLU cast is checked against the interpreted fp8_rows kernel on torch's
product: equal to one e4m3 step (2^-3 of the value's power of two: the two products may differ in the last fp32
bits), scales to 1e-6.
"""

from __future__ import annotations

import pytest

from tests.triton_interp import run_interpreted

GEMM = r"""
import torch
from titan_mm.kernels.fp8_gemm import fp8_mm
from titan_mm.nn.fp8 import fp8_rows
torch.manual_seed(0)
for m, n, k, bias, cfg in ((5, 96, 256, True, dict(BM=64, BN=64, BK=256, num_stages=5, num_warps=4)),
                           (70, 64, 512, False, dict(BM=128, BN=64, BK=256, num_stages=4, num_warps=8))):
    x8, sx = fp8_rows(torch.randn(m, k))
    w8, sw = fp8_rows(torch.randn(n, k))
    sw = sw.t().contiguous()
    b = torch.randn(n) if bias else None
    y = fp8_mm(x8, sx, w8, sw, b, torch.float32, cfg)
    xf, wf = x8.float() * sx, w8.float() * sw.t()
    ref = xf @ wf.t() + (b if bias else 0)
    tol = (xf.abs() @ wf.abs().t()) * k * 2.0**-24 + 1e-6  # fp32 sums in another order: k roundings of the terms
    assert ((y - ref).abs() <= tol).all(), ((y - ref).abs() / tol).max()
print("OK")
"""

SWIGLU = r"""
import torch
import torch.nn.functional as F
from titan_mm.kernels.fp8_rows import fp8_rows, swiglu_fp8_rows
torch.manual_seed(0)
x = torch.randn(7, 2 * 80) * torch.logspace(-2, 2, 7)[:, None]
x[3] = 0  # a zero row: the smallest scale, zeros
q, s = swiglu_fp8_rows(x)
g, u = x.chunk(2, dim=-1)
q_ref, s_ref = fp8_rows(F.silu(g) * u)  # the interpreted cast kernel on torch's product
torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
assert q.shape == (7, 80) and not q[3].float().any()
a, b = q.float(), q_ref.float()
step = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-6))) - 3)
assert ((a - b).abs() <= step).all(), ((a - b).abs() / step).max()
print("OK")
"""


def test_fp8_gemm_in_the_interpreter():
    run_interpreted(GEMM)


def test_swiglu_fp8_rows_in_the_interpreter():
    run_interpreted(SWIGLU)


def _compile(fn, sig: dict, const: dict, warps: int, stages: int = 3):
    triton = pytest.importorskip("triton")  # optional: CPU machines without triton skip, hence the imports here
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn=fn, signature=sig | dict.fromkeys(const, "constexpr"), constexprs=const),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


@pytest.mark.parametrize("rows", [1, 128, 256])
def test_fp8_gemm_compiles_for_hopper_at_its_launches(rows):
    from titan_mm.kernels.fp8_gemm import _fp8_mm, launch_config

    cfg = dict(launch_config(rows, 4096, 12288))
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    sig = {"X": "*fp8e4nv", "W": "*fp8e4nv", "SX": "*fp32", "SW": "*fp32", "BIAS": "*bf16", "Y": "*bf16"}
    sig |= dict.fromkeys(("M", "N", "K", "sxm", "swn", "sym"), "i32")
    k = _compile(_fp8_mm, sig, dict(HAS_BIAS=True, **cfg), warps, stages)
    assert 0 < k.metadata.shared <= 227 * 1024  # Hopper's shared memory per block


def test_swiglu_fp8_rows_compiles_for_hopper():
    from titan_mm.kernels.fp8_rows import _fp8_rows

    sig = {"X": "*bf16", "Y": "*fp8e4nv", "S": "*fp32", "K": "i32", "sx": "i32", "sy": "i32"}
    _compile(_fp8_rows, sig, dict(FMAX=448.0, INV=1 / 448, SMIN=1e-12, BLOCK=16384, SWIGLU=True), 16)


def test_fp8_cols_compiles_for_hopper():
    """The transposed casts (titan_mm.quant.rowwise's) at their launches: bf16 in, e4m3 out, within Hopper's shared
    memory."""
    from titan_mm.kernels.fp8_rows import _col_amax, _cols_cast

    sig_amax = {"X": "*bf16", "A": "*fp32", "M": "i32", "C": "i32", "sx": "i32", "ROWS": "i32"}
    k = _compile(_col_amax, sig_amax, dict(BLOCK_M=64, BLOCK_C=32), 4)
    assert 0 <= k.metadata.shared <= 227 * 1024
    sig_cast = {"X": "*bf16", "Y": "*fp8e4nv", "A": "*fp32", "S": "*fp32", "M": "i32", "C": "i32", "sx": "i32",
                "sy": "i32", "ROWS": "i32"}
    k = _compile(_cols_cast, sig_cast, dict(FMAX=448.0, INV=1 / 448, SMIN=1e-12, BLOCK_M=64, BLOCK_C=32), 4)
    assert 0 <= k.metadata.shared <= 227 * 1024
