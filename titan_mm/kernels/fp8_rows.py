"""Rowwise float8 quantization of activations (titan_mm.nn.fp8's arithmetic): per row of x [M, K], scale = amax x
(1 / 448) and x / scale in e4m3, in one launch.

A w8a8 linear (serve.quantization = "fp8_rowwise_fused") quantizes its input every call. bench/fp8_gemm.py on the H100
(8B layer, 256 rows): torch._scaled_mm alone 1.62x bf16's GEMMs, with the cast as torch ops 0.68x, with the cast
compiled into one kernel 1.38x; torchao's rowwise linear 0.69x. The engine replays CUDA graphs without
torch.compile, so the one-kernel cast is this: one program per row, the whole row in registers (read once).
``swiglu_fp8_rows`` is the same cast of a SwiGLU's product, computed from the fused gate / up GEMM's output in the
launch (the down projection's input: the bf16 product is neither written nor read back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_mm.nn.fp8 import FP8, FP8_MAX, INV_FP8_MAX, MIN_SCALE

MAX_K = 65536
"""Widest row one program holds in registers (a whole row, read once); wider rows take the reference."""


@triton.jit
def _fp8_rows(X, Y, S, K, sx, sy, FMAX: tl.constexpr, INV: tl.constexpr, SMIN: tl.constexpr,
              BLOCK: tl.constexpr, SWIGLU: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < K
    x = tl.load(X + r * sx + offs, mask=m, other=0.0).to(tl.float32)
    if SWIGLU:  # the row is gate | up, K each: silu(gate) * up as kernels.swiglu computes and rounds it
        u = tl.load(X + r * sx + K + offs, mask=m, other=0.0).to(tl.float32)
        x = (x * tl.sigmoid(x) * u).to(X.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) * INV, SMIN)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FMAX), FMAX)
    tl.store(Y + r * sy + offs, q.to(Y.dtype.element_ty), mask=m)
    tl.store(S + r, scale)


def _launch(x: torch.Tensor, width: int, swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    M = x.shape[0]
    y = torch.empty(M, width, dtype=FP8, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(width)
        _fp8_rows[(M,)](x, y, s, width, x.stride(0), y.stride(0), FMAX=FP8_MAX, INV=INV_FP8_MAX, SMIN=MIN_SCALE,
                        BLOCK=block, SWIGLU=swiglu, num_warps=max(4, min(16, block // 1024)))
    return y, s


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous, K <= MAX_K) -> (e4m3 [M, K], fp32 scales [M, 1])."""
    return _launch(x, x.shape[1], False)


def swiglu_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2F] (gate | up; last dim contiguous, F <= MAX_K) -> fp8_rows(silu(gate) * up), without writing the
    product: (e4m3 [M, F], fp32 scales [M, 1])."""
    return _launch(x, x.shape[1] // 2, True)
