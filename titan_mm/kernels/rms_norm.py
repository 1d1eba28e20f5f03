"""RMSNorm and residual-add + RMSNorm (Qwen3RMSNorm numerics), forward and backward, as custom ops.

Tiles of ~4096 elements hold whole rows in registers (1 row at hidden 4096; 32 rows for a q/k-norm over
head_dim 128). Forward: fp32 statistics, saves rstd [N] fp32. Backward: persistent programs (4 per SM) walk a
contiguous range of rows tile by tile, accumulate dW in fp32 registers and write one partial per program;
the partials are summed in PyTorch (small: programs x D).
Legend: N rows (tokens), D hidden.
"""


import torch
import triton
import triton.language as tl

from ._utils import as_rows, new_empty, next_pow2, sm_count


def _tile(d: int) -> tuple[int, int, int]:
    """(rows per tile, column block, warps): about 4096 elements per tile, whole rows in registers.
    Hidden 4096 -> 1 row x 4096; a Qwen3 q/k-norm over head_dim 128 -> 32 rows x 128."""
    bd = next_pow2(d)
    br = max(1, min(64, 4096 // bd))
    elems = br * bd
    return br, bd, (4 if elems <= 2048 else (8 if elems <= 8192 else 16))


@triton.jit
def _rms_fwd_kernel(
    X, stride_x, R, stride_r, NR, Y, W, RSTD, N, D, eps,
    HAS_RES: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BD)
    mr = rows < N
    m = mr[:, None] & (cols[None, :] < D)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
        nr = (x + r).to(NR.dtype.element_ty)  # rounded like the eager add
        tl.store(NR + rows[:, None] * D + cols[None, :], nr, mask=m)
        x = nr.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(RSTD + rows, rstd, mask=mr)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    xn = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)  # HF casts before the weight multiply
    tl.store(Y + rows[:, None] * D + cols[None, :], (w[None, :] * xn).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rms_bwd_kernel(
    DY, stride_dy, X, stride_x, W, RSTD, DNR, stride_dnr, DX, DW_PART,
    N, D,
    ROWS: tl.constexpr, HAS_DRES: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    mc = cols < D
    w = tl.load(W + cols, mask=mc, other=0.0).to(tl.float32)
    dw = tl.zeros([BR, BD], dtype=tl.float32)
    start = pid * ROWS
    for i in range(0, ROWS, BR):  # constexpr trip count (the CPU interpreter needs one)
        rows = (start + i + tl.arange(0, BR)).to(tl.int64)
        mr = rows < N
        m = mr[:, None] & mc[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=mr, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / D
        dx = rstd[:, None] * (g - xhat * c[:, None])
        if HAS_DRES:
            dx += tl.load(DNR + rows[:, None] * stride_dnr + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * xhat
    tl.store(DW_PART + pid.to(tl.int64) * D + cols, tl.sum(dw, axis=0), mask=mc)


def _fwd(x, residual, w, eps):
    w = w.contiguous()
    x2 = as_rows(x)
    n, d = x2.shape
    br, bd, warps = _tile(d)
    y = new_empty(x.shape, x.dtype, x.device)
    rstd = new_empty(x.shape[:-1], torch.float32, x.device)
    if residual is not None:
        r2 = as_rows(residual)
        nr = new_empty(x.shape, x.dtype, x.device)
    else:
        r2, nr = x2, y  # unused
    if n > 0:
        _rms_fwd_kernel[(triton.cdiv(n, br),)](
            x2, x2.stride(0), r2, r2.stride(0), nr, y, w, rstd, n, d, eps,
            HAS_RES=residual is not None, BR=br, BD=bd, num_warps=warps,
        )
    return y, (nr if residual is not None else None), rstd


def _bwd(dy, x, w, rstd, dnr):
    w = w.contiguous()
    rstd = rstd.contiguous()
    x2 = as_rows(x)
    dy2 = as_rows(dy)
    n, d = x2.shape
    br, bd, warps = _tile(d)
    # persistent programs (4 per SM) each own a contiguous range of rows and one fp32 dW partial;
    # rows per program is a power of two >= the tile (a constexpr: only a handful of variants compile)
    progs = max(1, min(triton.cdiv(n, br), 4 * sm_count(x.device)))
    rows_per_prog = max(br, next_pow2(triton.cdiv(n, progs))) if n > 0 else br
    progs = triton.cdiv(n, rows_per_prog) if n > 0 else 1
    dx = new_empty(x.shape, x.dtype, x.device)
    dw_part = new_empty((progs, d), torch.float32, x.device)
    dnr2 = as_rows(dnr) if dnr is not None else dy2
    if n > 0:
        _rms_bwd_kernel[(progs,)](
            dy2, dy2.stride(0), x2, x2.stride(0), w, rstd, dnr2, dnr2.stride(0), dx, dw_part,
            n, d,
            ROWS=rows_per_prog, HAS_DRES=dnr is not None, BR=br, BD=bd, num_warps=warps,
        )
    else:
        dw_part.zero_()
    return dx, dw_part.sum(0).to(w.dtype)


# ---- rms_norm -------------------------------------------------------------------------------------------


@torch.library.custom_op("titan_mm::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _fwd(x, None, w, eps)
    return y, rstd


@rms_norm_op.register_fake
def _(x, w, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("titan_mm::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dnr: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _bwd(dy, x, w, rstd, dnr)


@rms_norm_bwd_op.register_fake
def _(dy, x, w, rstd, dnr):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


def _rms_setup(ctx, inputs, output):
    x, w, eps = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_backward(ctx, dy, drstd):
    x, w, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd_op(dy, x, w, rstd, None)
    return dx, dw, None


rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)


# ---- add_rms_norm ---------------------------------------------------------------------------------------


@torch.library.custom_op("titan_mm::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd(x, residual, w, eps)


@add_rms_norm_op.register_fake
def _(x, residual, w, eps):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, torch.empty_like(y), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _add_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[2], output[2])
    ctx.mark_non_differentiable(output[2])


def _add_backward(ctx, dy, dnr, drstd):
    nr, w, rstd = ctx.saved_tensors
    if dy is None:  # only new_residual was used downstream
        return dnr, dnr, None, None
    dx, dw = rms_norm_bwd_op(dy, nr, w, rstd, dnr)
    return dx, dx, dw, None


add_rms_norm_op.register_autograd(_add_backward, setup_context=_add_setup)


class RMSNormFunction(torch.autograd.Function):
    """The eager fast path (same kernels, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        y, _, rstd = _fwd(x, None, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = _bwd(dy, x, w, rstd, None)
        return dx, dw, None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, w, eps):
        y, nr, rstd = _fwd(x, residual, w, eps)
        ctx.save_for_backward(nr, w, rstd)
        return y, nr

    @staticmethod
    def backward(ctx, dy, dnr):
        nr, w, rstd = ctx.saved_tensors
        dx, dw = _bwd(dy, nr, w, rstd, dnr)
        return dx, dx, dw, None
