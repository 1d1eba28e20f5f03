"""Grouped GEMM of the MoE experts without host syncs, for the dtypes torch._grouped_mm does not take on CUDA
(fp32, fp16), with its backward.

    y[rows of e] = x[rows of e] @ w[e]^T        x [A, K] (rows sorted by expert), w [E, N, K] (nn.Linear layout)

The group sizes live on the device. The tile schedule is built there too, by torch ops on them (no host read):
each expert's rows are cut into tiles of BM rows; tile t of the whole launch finds its expert and first row
through ``searchsorted`` over the cumulative tile counts. The grid is the host-known bound ceil(A / BM) + E
tiles (every expert may end with a partial tile); tiles past the last real one exit at once.

Backward: dx is the same kernel on w's transpose; dw[e] = dy[rows of e]^T @ x[rows of e] loops over the
expert's rows in BM chunks, to the bound read from the device (an expert without rows gets zeros). fp32 inputs
multiply in IEEE fp32 (no TF32), fp16 in fp16 with fp32 accumulation.
Legend: A rows (token -> expert assignments), E experts, K in features, N out features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BM, BN, BK = 64, 64, 32


@triton.jit
def _grouped_fwd(X, W, Y, OFFS, TILE_E, TILE_ROW, A, N, K, sxa, sxk, swe, swn, swk, sya, syn,
                 E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(TILE_E + t)
    if e < E:
        row0 = tl.load(TILE_ROW + t)
        end = tl.load(OFFS + e)
        rows = row0 + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        rm = rows < end
        cm = cols < N
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            km = ks < K
            x = tl.load(X + rows[:, None].to(tl.int64) * sxa + ks[None, :] * sxk, mask=rm[:, None] & km[None, :],
                        other=0.0)
            w = tl.load(W + e.to(tl.int64) * swe + cols[None, :] * swn + ks[:, None] * swk,
                        mask=km[:, None] & cm[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        tl.store(Y + rows[:, None].to(tl.int64) * sya + cols[None, :] * syn, acc.to(Y.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


@triton.jit
def _grouped_wgrad(DY, X, DW, OFFS, N, K, sda, sdn, sxa, sxk, swe, swn, swk,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    e = tl.program_id(0)
    pn = tl.program_id(1)
    pk = tl.program_id(2)
    start = 0
    if e > 0:
        start = tl.load(OFFS + e - 1)
    end = tl.load(OFFS + e)
    cols = pn * BN + tl.arange(0, BN)
    ks = pk * BK + tl.arange(0, BK)
    cm = cols < N
    km = ks < K
    acc = tl.zeros([BN, BK], tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        rm = rows < end
        dy = tl.load(DY + rows[None, :].to(tl.int64) * sda + cols[:, None] * sdn, mask=cm[:, None] & rm[None, :],
                     other=0.0)
        x = tl.load(X + rows[:, None].to(tl.int64) * sxa + ks[None, :] * sxk, mask=rm[:, None] & km[None, :],
                    other=0.0)
        if IEEE:
            acc += tl.dot(dy, x, input_precision="ieee")
        else:
            acc += tl.dot(dy, x)
    tl.store(DW + e.to(tl.int64) * swe + cols[:, None] * swn + ks[None, :] * swk, acc.to(DW.dtype.element_ty),
             mask=cm[:, None] & km[None, :])


def tile_schedule(counts_E: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device, from the group sizes: (offs [E] int32 cumulative row ends, expert of each tile [T] (E past
    the last tile), first row of each tile [T]), T = ceil(rows / BM) + E, a bound known on the host."""
    E = counts_E.numel()
    counts = counts_E.to(torch.int64)
    offs = torch.cumsum(counts, 0)
    tiles = (counts + BM - 1) // BM
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(-(-rows // BM) + E, device=counts.device)
    e = torch.searchsorted(tile_end, t, right=True)
    ec = e.clamp(max=E - 1)
    row = (offs - counts)[ec] + (t - (tile_end - tiles)[ec]) * BM
    return offs.to(torch.int32), e.to(torch.int32), row.to(torch.int32)


def _fwd(x: torch.Tensor, w: torch.Tensor, sched) -> torch.Tensor:
    offs, tile_e, tile_row = sched
    A, K = x.shape
    E, N, _ = w.shape
    y = torch.empty(A, N, device=x.device, dtype=x.dtype)
    _grouped_fwd[(tile_e.numel(), triton.cdiv(N, BN))](
        x, w, y, offs, tile_e, tile_row, A, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        y.stride(0), y.stride(1), E=E, BM=BM, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, num_warps=4)
    return y


def _wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, E: int) -> torch.Tensor:
    N, K = dy.shape[1], x.shape[1]
    dw = torch.empty(E, N, K, device=x.device, dtype=x.dtype)
    _grouped_wgrad[(E, triton.cdiv(N, BN), triton.cdiv(K, BK))](
        dy, x, dw, offs, N, K, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), dw.stride(0), dw.stride(1),
        dw.stride(2), BM=BM, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, num_warps=4)
    return dw


class GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts_E):
        sched = tile_schedule(counts_E, x.shape[0])
        ctx.save_for_backward(x, w, *sched)
        return _fwd(x, w.to(x.dtype), sched)

    @staticmethod
    def backward(ctx, dy):
        x, w, *sched = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _fwd(dy, w.to(x.dtype).transpose(1, 2), sched) if ctx.needs_input_grad[0] else None
        dw = _wgrad(dy, x, sched[0], w.shape[0]).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None
