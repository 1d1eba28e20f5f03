"""RMSNorm and residual-add + RMSNorm (Qwen3RMSNorm numerics), forward and backward, as triton_ops.

Forward: one tile of BR whole rows per program (one row of 4096 at hidden 4096; 16-64 rows for a q/k-norm
over head_dim 128), fp32 statistics, saves rstd [N] fp32. Backward: persistent programs (2-8 per SM)
each walk a contiguous range of rows tile by tile (optionally loading the next tile while the current one
is reduced and stored), accumulate dW in fp32 registers and write one partial per program; the partials
are summed by one more launch (`_tl.col_sums`; small: programs x D).
Launch configs (rows per tile, warps, prefetch) are picked per hidden size and dtype by `_utils.Tuner`.
Row offsets inside a program are int32; only the program's first row is an int64 offset.
Legend: N rows (tokens), D hidden.
"""


import torch
import triton
import triton.language as tl

from ._tl import col_sums, load_tile_pair
from ._utils import Tuner, as_rows, new_empty, next_pow2, sm_count, wrap_triton, writes


def _fwd_configs(key):
    bd = key[0]
    if bd >= 1024:  # whole rows: warps set the elements per thread (16 = two 16-byte loads for bf16)
        w = lambda ept: max(1, min(32, bd // (32 * ept)))  # noqa: E731
        return [dict(BR=1, num_warps=w(16)), dict(BR=1, num_warps=w(8)), dict(BR=1, num_warps=w(32)),
                dict(BR=2, num_warps=w(16))]
    # short rows (q/k-norm): several rows per tile
    return [dict(BR=max(1, 4096 // bd), num_warps=4), dict(BR=max(1, 4096 // bd), num_warps=8),
            dict(BR=max(1, 2048 // bd), num_warps=4), dict(BR=max(1, 8192 // bd), num_warps=8)]


def _bwd_configs(key):
    # PPS: persistent programs per SM (not a kernel argument), as many as fit at once by registers (about
    # 120 per thread: 2 x 8 warps); each writes one fp32 dW partial row
    bd = key[0]
    if bd >= 1024:
        w = lambda ept: max(1, min(32, bd // (32 * ept)))  # noqa: E731
        return [dict(BR=1, PREFETCH=True, PPS=2, num_warps=w(16)), dict(BR=1, PREFETCH=False, PPS=2, num_warps=w(8)),
                dict(BR=1, PREFETCH=True, PPS=2, num_warps=w(8)), dict(BR=1, PREFETCH=False, PPS=3, num_warps=w(16))]
    return [dict(BR=max(1, 2048 // bd), PREFETCH=True, PPS=4, num_warps=4),
            dict(BR=max(1, 4096 // bd), PREFETCH=False, PPS=2, num_warps=8),
            dict(BR=max(1, 4096 // bd), PREFETCH=True, PPS=2, num_warps=8),
            dict(BR=max(1, 1024 // bd), PREFETCH=True, PPS=8, num_warps=2)]


_FWD = Tuner("rms_norm_fwd", _fwd_configs)
_BWD = Tuner("rms_norm_bwd", _bwd_configs)


@triton.jit
def _rms_fwd_kernel(
    X, stride_x, R, stride_r, NR, Y, W, RSTD, N, D, eps,
    HAS_RES: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, HAS_RSTD: tl.constexpr = True,
):
    row0 = tl.program_id(0).to(tl.int64) * BR
    r = tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mr = r < N - row0
    m = mr[:, None] & (cols[None, :] < D)
    x = tl.load(X + row0 * stride_x + r[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(R + row0 * stride_r + r[:, None] * stride_r + cols[None, :], mask=m, other=0.0)
        nr = (x + res.to(tl.float32)).to(NR.dtype.element_ty)  # rounded like the eager add
        tl.store(NR + row0 * D + r[:, None] * D + cols[None, :], nr, mask=m)
        x = nr.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    if HAS_RSTD:  # saved for the backward; a forward without gradients skips it
        tl.store(RSTD + row0 + r, rstd, mask=mr)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    xn = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)  # HF casts before the weight multiply
    tl.store(Y + row0 * D + r[:, None] * D + cols[None, :], (w[None, :] * xn).to(Y.dtype.element_ty), mask=m)


writes(_rms_fwd_kernel, 'NR', 'Y', 'RSTD')


@triton.jit
def _rms_bwd_kernel(
    DY, stride_dy, X, stride_x, W, RSTD, DNR, stride_dnr, DX, DW_PART,
    N, D, ROWS,
    HAS_DRES: tl.constexpr, PREFETCH: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * ROWS
    n_here = N - start  # rows left from this program's first row (only the first ROWS are ours)
    X += start * stride_x
    DY += start * stride_dy
    DX += start * D
    RSTD += start
    if HAS_DRES:
        DNR += start * stride_dnr
    r = tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mc = cols < D
    w = tl.load(W + cols, mask=mc, other=0.0).to(tl.float32)
    dw = tl.zeros([BR, BD], dtype=tl.float32)
    if PREFETCH:  # the next tile's loads are in flight while this tile is reduced and stored
        x_next, dy_next = load_tile_pair(X, stride_x, DY, stride_dy, r, cols, (r < n_here)[:, None] & mc[None, :])
    i = 0
    while i < ROWS:  # ROWS is a multiple of BR (a `while`: the CPU interpreter cannot run a runtime `range`)
        rows = i + r
        mr = rows < n_here
        m = mr[:, None] & mc[None, :]
        if PREFETCH:
            x, dy = x_next.to(tl.float32), dy_next.to(tl.float32)
            nxt = rows + BR
            mn = ((nxt < n_here) & (nxt < ROWS))[:, None] & mc[None, :]
            x_next, dy_next = load_tile_pair(X, stride_x, DY, stride_dy, nxt, cols, mn)
        else:
            x_t, dy_t = load_tile_pair(X, stride_x, DY, stride_dy, rows, cols, m)
            x, dy = x_t.to(tl.float32), dy_t.to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=mr, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / D
        dx = rstd[:, None] * (g - xhat * c[:, None])
        if HAS_DRES:
            dx += tl.load(DNR + rows[:, None] * stride_dnr + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * xhat
        i += BR
    tl.store(DW_PART + pid.to(tl.int64) * D + cols, tl.sum(dw, axis=0), mask=mc)


writes(_rms_bwd_kernel, 'DX', 'DW_PART')


def _check_i32(rows_in_program: int, *strides: int) -> None:
    # offsets inside a program are int32: the largest one must fit
    assert rows_in_program * max(strides) < 2**31, "row stride too large for int32 in-program offsets"


def _fwd(x, residual, w, eps, op=False, stats=True):
    """op=True: called from the triton_op body (launches through `wrap_triton`, traceable); False: the eager
    autograd.Function path (the kernel itself). stats=False (eager, no gradients needed): rstd is not
    written (returned as None)."""
    kern = wrap_triton(_rms_fwd_kernel) if op else _rms_fwd_kernel
    w = w.contiguous()
    x2 = as_rows(x)
    n, d = x2.shape
    bd = next_pow2(d)
    y = new_empty(x.shape, x.dtype, x.device)
    rstd = new_empty(x.shape[:-1] if stats else (1,), torch.float32, x.device)
    if residual is not None:
        r2 = as_rows(residual)
        nr = new_empty(x.shape, x.dtype, x.device)
    else:  # unused by the kernel (HAS_RES=False); traced, no written buffer may be passed twice (the
        # functionalized launch would clone y once per argument and keep the wrong copy)
        r2, nr = x2, (new_empty((1,), x.dtype, x.device) if op else y)
    if n > 0:
        def launch(c):
            _check_i32(c["BR"], x2.stride(0), r2.stride(0), d)
            kern[(triton.cdiv(n, c["BR"]),)](
                x2, x2.stride(0), r2, r2.stride(0), nr, y, w, rstd, n, d, eps,
                HAS_RES=residual is not None, BD=bd, HAS_RSTD=stats, **c,
            )

        traced = kern is not _rms_fwd_kernel  # no timing while traced: the pick goes into the graph
        launch(_FWD.pick((bd, x.dtype, residual is not None), None if traced else launch))
    return y, (nr if residual is not None else None), (rstd if stats else None)


def _bwd(dy, x, w, rstd, dnr, op=False):
    kern = wrap_triton(_rms_bwd_kernel) if op else _rms_bwd_kernel
    w = w.contiguous()
    rstd = rstd.contiguous()
    x2 = as_rows(x)
    dy2 = as_rows(dy)
    n, d = x2.shape
    bd = next_pow2(d)
    dx = new_empty(x.shape, x.dtype, x.device)
    dnr2 = as_rows(dnr) if dnr is not None else dy2
    if n == 0:
        return dx, torch.zeros_like(w)
    sms = sm_count(x.device)

    def launch(c):
        c = dict(c)
        target = c.pop("PPS") * sms  # persistent programs; each writes one fp32 dW partial
        rows = triton.cdiv(triton.cdiv(n, target), c["BR"]) * c["BR"]  # per program, whole tiles
        progs = triton.cdiv(n, rows)
        _check_i32(rows, x2.stride(0), dy2.stride(0), dnr2.stride(0), d)
        dw_part = new_empty((progs, d), torch.float32, x.device)
        kern[(progs,)](
            dy2, dy2.stride(0), x2, x2.stride(0), w, rstd, dnr2, dnr2.stride(0), dx, dw_part,
            n, d, rows,
            HAS_DRES=dnr is not None, BD=bd, **c,
        )
        return dw_part

    traced = kern is not _rms_bwd_kernel
    dw_part = launch(_BWD.pick((bd, x.dtype, dnr is not None), None if traced else launch))
    return dx, col_sums(dw_part, w.dtype, op)


# ---- rms_norm -------------------------------------------------------------------------------------------


# triton_op: the body is the fake implementation too, and under torch.compile it is traced into the graph
# (the kernel launches become triton_kernel_wrapper nodes that inductor launches from its own wrapper code).


@torch.library.triton_op("titan_mm::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _fwd(x, None, w, eps, op=True)
    return y, rstd


@torch.library.triton_op("titan_mm::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dnr: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _bwd(dy, x, w, rstd, dnr, op=True)


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


@torch.library.triton_op("titan_mm::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd(x, residual, w, eps, op=True)


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
        y, _, rstd = _fwd(x, None, w, eps, stats=ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
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
        y, nr, rstd = _fwd(x, residual, w, eps, stats=any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(nr, w, rstd)
        return y, nr

    @staticmethod
    def backward(ctx, dy, dnr):
        nr, w, rstd = ctx.saved_tensors
        dx, dw = _bwd(dy, nr, w, rstd, dnr)
        return dx, dx, dw, None
