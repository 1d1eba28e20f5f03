"""SwiGLU: silu(gate) * up, forward and backward, as triton_ops.

1-D grid over (row, column block) in row-major order, so consecutive programs stream consecutive memory;
when gate, up (and dy) are contiguous the whole tensor is one long row (no row arithmetic, no partly masked
blocks at row ends). gate/up may be strided row views (e.g. halves of a fused gate_up projection). The
backward recomputes sigmoid from gate (nothing but the inputs is saved). Block size and warps are picked
per row width and dtype by `_utils.Tuner`.
Legend: N rows (tokens), F MLP width.
"""


import triton
import triton.language as tl

from ._utils import Tuner, as_rows, new_empty, next_pow2, two_input_op, wrap_triton, writes


def _configs(key):
    f = key[0]
    cands = [dict(BLOCK=2048, num_warps=4), dict(BLOCK=4096, num_warps=8), dict(BLOCK=1024, num_warps=4),
             dict(BLOCK=4096, num_warps=4)]
    cap = max(128, next_pow2(f))  # short rows (strided case): no block wider than the row
    out = []
    for c in cands:
        c = dict(c, BLOCK=min(c["BLOCK"], cap))
        c["num_warps"] = max(1, min(c["num_warps"], c["BLOCK"] // 256))
        if c not in out:
            out.append(c)
    return out


_FWD = Tuner("swiglu_fwd", _configs)
_BWD = Tuner("swiglu_bwd", _configs)


@triton.jit
def _block(F, NCB, BLOCK: tl.constexpr):
    """(row, int64 offset of the block's first column, elements left in the row from there) of this program."""
    pid = tl.program_id(0)
    row = pid // NCB
    start = (pid - row * NCB).to(tl.int64) * BLOCK
    return row.to(tl.int64), start, F - start


@triton.jit
def _swiglu_fwd_kernel(G, stride_g, U, stride_u, Y, F, NCB, BLOCK: tl.constexpr):
    row, start, left = _block(F, NCB, BLOCK)
    cols = tl.arange(0, BLOCK)
    m = cols < left
    g = tl.load(G + row * stride_g + start + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + start + cols, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * F + start + cols, y.to(Y.dtype.element_ty), mask=m)


writes(_swiglu_fwd_kernel, 'Y')


@triton.jit
def _swiglu_bwd_kernel(DY, stride_dy, G, stride_g, U, stride_u, DG, DU, F, NCB, BLOCK: tl.constexpr):
    row, start, left = _block(F, NCB, BLOCK)
    cols = tl.arange(0, BLOCK)
    m = cols < left
    dy = tl.load(DY + row * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + start + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + start + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(DG + row * F + start + cols, dg.to(DG.dtype.element_ty), mask=m)
    tl.store(DU + row * F + start + cols, (dy * silu).to(DU.dtype.element_ty), mask=m)


writes(_swiglu_bwd_kernel, 'DG', 'DU')


def _flat(*ts):
    """[rows, F] views of the inputs; one row of rows * F when all are contiguous (and the outputs are)."""
    rows = [as_rows(t) for t in ts]
    n, f = rows[0].shape
    if all(r.stride(0) == f for r in rows):
        rows = [r.reshape(1, n * f) for r in rows]
    return rows


def swiglu_fwd(gate, up, op=False):
    """op=True: from the triton_op body (traceable launches through `wrap_triton`); False: eager Function."""
    kern = wrap_triton(_swiglu_fwd_kernel) if op else _swiglu_fwd_kernel
    g2, u2 = _flat(gate, up)
    n, f = g2.shape
    y = new_empty(gate.shape, gate.dtype, gate.device)
    if n * f > 0:
        def launch(c):
            ncb = triton.cdiv(f, c["BLOCK"])
            kern[(n * ncb,)](g2, g2.stride(0), u2, u2.stride(0), y, f, ncb, **c)

        # key: the row width (F, or contiguous) and dtype, never the token count
        traced = kern is not _swiglu_fwd_kernel  # no timing while traced: the pick goes into the graph
        launch(_FWD.pick((int(gate.shape[-1]), bool(n == 1), gate.dtype), None if traced else launch))
    return y


def swiglu_bwd(dy, gate, up, op=False):
    kern = wrap_triton(_swiglu_bwd_kernel) if op else _swiglu_bwd_kernel
    d2, g2, u2 = _flat(dy, gate, up)
    n, f = g2.shape
    dg = new_empty(gate.shape, gate.dtype, gate.device)
    du = new_empty(up.shape, up.dtype, up.device)
    if n * f > 0:
        def launch(c):
            ncb = triton.cdiv(f, c["BLOCK"])
            kern[(n * ncb,)](
                d2, d2.stride(0), g2, g2.stride(0), u2, u2.stride(0), dg, du, f, ncb, **c
            )

        traced = kern is not _swiglu_bwd_kernel
        launch(_BWD.pick((int(gate.shape[-1]), bool(n == 1), gate.dtype), None if traced else launch))
    return dg, du


swiglu_op, SwiGLUFunction = two_input_op("swiglu", swiglu_fwd, swiglu_bwd, "SwiGLUFunction")
