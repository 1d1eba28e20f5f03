"""Rowwise float8 quantization of activations (titan_mm.nn.fp8's arithmetic): per row of x [M, K], scale = amax x
(1 / 448) and x / scale in e4m3, in one launch.

A w8a8 linear (serve.quantization = "fp8_rowwise_fused") quantizes its input every call. bench/fp8_gemm.py on the H100
(8B layer, 256 rows): torch._scaled_mm alone 1.62x bf16's GEMMs, with the cast as torch ops 0.68x, with the cast
compiled into one kernel 1.38x; torchao's rowwise linear 0.69x. The engine replays CUDA graphs without
torch.compile, so the one-kernel cast is this: one program per row, the whole row in registers (read once).
``swiglu_fp8_rows`` is the same cast of a SwiGLU's product, computed from the fused gate / up GEMM's output in the
launch (the down projection's input: the bf16 product is neither written nor read back). ``fp8_cols`` casts the rows
of x's transpose, written transposed (a rowwise float8 training linear's weight-gradient operands and its weight for
the input gradient; titan_mm.quant.rowwise), reading x twice in two launches (the columns' amax, met across blocks
of ``rows`` rows by atomic max; then the cast): split over rows as well as columns by default, since one program a
block of 32 columns gives an 8B layer's 4096 columns 128 programs, fewer than the H100's 132 SMs; ``rows=0`` (one
block of all rows) is kept to time against (tests/gpu/test_kernels_gpu.py times both).
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


@triton.jit
def _col_amax(X, A, M, C, sx, ROWS, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    r0 = tl.program_id(1) * ROWS
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for m0 in range(0, ROWS, BLOCK_M):
        rows = r0 + m0 + tl.arange(0, BLOCK_M)
        x = tl.load(X + rows[:, None].to(tl.int64) * sx + cols[None, :], mask=(rows < M)[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
    tl.atomic_max(A + cols, amax, mask=cm)  # amaxes are >= 0: float max is the bits' max


@triton.jit
def _cols_cast(X, Y, A, S, M, C, sx, sy, ROWS, FMAX: tl.constexpr, INV: tl.constexpr, SMIN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    scale = tl.maximum(tl.load(A + cols, mask=cm, other=0.0) * INV, SMIN)
    r0 = tl.program_id(1) * ROWS
    for m0 in range(0, ROWS, BLOCK_M):
        rows = r0 + m0 + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cm[None, :]
        x = tl.load(X + rows[:, None].to(tl.int64) * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[None, :]), -FMAX), FMAX)
        tl.store(Y + cols[None, :].to(tl.int64) * sy + rows[:, None], q.to(Y.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(S + cols, scale, mask=cm)


def fp8_cols(x: torch.Tensor, block_m: int = 64, block_c: int = 32,
             rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, C] (last dim contiguous) -> fp8_rows of x.T: (e4m3 [C, M], fp32 scales [C, 1]), without writing x.T.
    ``rows`` (a multiple of ``block_m``): rows a program, or 0 for all of them (one program a block of columns)."""
    M, C = x.shape
    span = rows or triton.cdiv(max(M, 1), block_m) * block_m
    assert span % block_m == 0, (rows, block_m)
    y = torch.empty(C, M, dtype=FP8, device=x.device)
    s = torch.empty(C, 1, dtype=torch.float32, device=x.device)
    if M and C:
        a = torch.zeros(C, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(C, block_c), triton.cdiv(M, span))
        _col_amax[grid](x, a, M, C, x.stride(0), span, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
        _cols_cast[grid](x, y, a, s, M, C, x.stride(0), y.stride(0), span, FMAX=FP8_MAX, INV=INV_FP8_MAX,
                         SMIN=MIN_SCALE, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
    return y, s
