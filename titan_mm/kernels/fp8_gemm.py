"""Rowwise float8 GEMM at a decode step's rows: y = (x8 @ w8.T) x sx x sw (+ bias), fp32 sums, y in bf16 / fp16.

torch._scaled_mm (cuBLAS) tiles 128 x 128. At up to 256 rows that leaves SMs idle where N (outputs) is not above K
(inputs): the o and down projections of an 8B layer get 64 programs on the H100's 132 SMs, and in a serving step at
256 sequences the four projections read their fp8 weights at 58% of the copy rate
(bench/results/serve_profile_8B_fp8_h100_cublas.json). Tiles of 64 output columns (and 64 rows up to 128 rows) put
more SMs on the weight stream; the programs of one column tile are adjacent in the grid, so their rows share its
weight tile through L2. No split over K: each output is one program's sum, so results do not depend on the launch.

Measured on the H100 at the 8B's four projections with weights read from HBM (bench/fp8_gemm.py --l2_bytes 2e8,
bench/results/fp8_gemm_h100_rule.json; launches from the sweep in fp8_gemm_h100_sweep.json), cuBLAS kept where it
won (``launch_config``: N above K past 64 rows): a layer's fp8 GEMMs 78.0 us against cuBLAS's 98.0 at 1 row, 82.1
against 99.4 at 64, 86.2 against 99.9 at 128, 108.0 against 111.9 at 192 and 101.2 against 108.1 at 256.

Legend: M rows, N outputs, K inputs; x8 [M, K] and w8 [N, K] e4m3, sx [M, 1] and sw [1, N] fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 256
"""Most rows this kernel takes (a decode step's; prefill steps keep cuBLAS, whose tiles fill the GPU there)."""
SMALL_M = 64
"""Up to this many rows every projection measured faster here (cuBLAS's 128-row tiles are half empty)."""


@triton.jit
def _fp8_mm(X, W, SX, SW, BIAS, Y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = X + rm[:, None].to(tl.int64) * sxm + rk[None, :]
    wp = W + rn[:, None].to(tl.int64) * swn + rk[None, :]
    in_m, in_n = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):  # K % BK == 0: the caller's check
        x = tl.load(xp, mask=in_m[:, None], other=0.0)
        w = tl.load(wp, mask=in_n[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        xp += BK
        wp += BK
    acc *= tl.load(SX + rm, mask=in_m, other=0.0)[:, None] * tl.load(SW + rn, mask=in_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
    yp = Y + rm[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(yp, acc.to(Y.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def launch_config(m: int, n: int, k: int) -> dict | None:
    """The launch for m rows of a (k -> n) projection, or None where cuBLAS was faster: past SMALL_M rows when n > k
    (q/k/v and gate/up: enough 128-column tiles to fill the SMs). 64-row tiles up to 128 rows, then 128 (eight
    warps); 256 inputs a step, 64 outputs a program: the sweep's best at each row count."""
    if m > MAX_M or (m > SMALL_M and n > k):
        return None
    if m <= 128:
        return dict(BM=64, BN=64, BK=256, num_stages=5, num_warps=4)
    return dict(BM=128, BN=64, BK=256, num_stages=4, num_warps=8)


def fits(x8: torch.Tensor, w8: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (else cuBLAS): a launch_config, K a multiple of its BK, unit last
    strides."""
    cfg = launch_config(x8.shape[0], w8.shape[0], x8.shape[1])
    return cfg is not None and x8.shape[1] % cfg["BK"] == 0 and x8.stride(-1) == 1 and w8.stride(-1) == 1


def fp8_mm(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype, cfg: dict | None = None) -> torch.Tensor:
    """(x8 @ w8.T) x sx x sw (+ bias) in ``out_dtype`` (see the module's legend), with launch_config's launch or
    ``cfg`` (the bench's sweep); titan_mm.kernels.fp8_mm calls it only where ``fits``."""
    (m, k), n = x8.shape, w8.shape[0]
    cfg = cfg or launch_config(m, n, k)
    if cfg is None:
        raise ValueError(f"fp8_mm: no Triton launch for {m} rows of ({k} -> {n}): call titan_mm.kernels.fp8_mm, "
                         "which takes cuBLAS there")
    y = torch.empty(m, n, dtype=out_dtype, device=x8.device)
    if m:
        bm, bn = cfg["BM"], cfg["BN"]
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _fp8_mm[grid](x8, w8, sx, sw, bias if bias is not None else sw, y, m, n, k, x8.stride(0), w8.stride(0),
                      y.stride(0), HAS_BIAS=bias is not None, **cfg)
    return y
