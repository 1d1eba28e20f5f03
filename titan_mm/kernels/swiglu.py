"""SwiGLU: silu(gate) * up, forward and backward, as a custom op.

2-D grid (row, column block); gate/up may be strided row views (e.g. halves of a fused gate_up
projection). The backward recomputes sigmoid from gate (nothing but the inputs is saved).
Legend: N rows (tokens), F MLP width.
"""


import torch
import triton
import triton.language as tl

from ._utils import as_rows, new_empty, next_pow2

_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(G, stride_g, U, stride_u, Y, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    g = tl.load(G + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * F + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(DY, stride_dy, G, stride_g, U, stride_u, DG, DU, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    dy = tl.load(DY + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(DG + row * F + cols, dg.to(DG.dtype.element_ty), mask=m)
    tl.store(DU + row * F + cols, (dy * silu).to(DU.dtype.element_ty), mask=m)


def _grid(n, f):
    block = min(_BLOCK, next_pow2(f))
    return (n, triton.cdiv(f, block)), block


def swiglu_fwd(gate, up):
    g2, u2 = as_rows(gate), as_rows(up)
    n, f = g2.shape
    y = new_empty(gate.shape, gate.dtype, gate.device)
    if n * f > 0:
        grid, block = _grid(n, f)
        _swiglu_fwd_kernel[grid](g2, g2.stride(0), u2, u2.stride(0), y, f, BLOCK=block, num_warps=4)
    return y


def swiglu_bwd(dy, gate, up):
    d2, g2, u2 = as_rows(dy), as_rows(gate), as_rows(up)
    n, f = g2.shape
    dg = new_empty(gate.shape, gate.dtype, gate.device)
    du = new_empty(up.shape, up.dtype, up.device)
    if n * f > 0:
        grid, block = _grid(n, f)
        _swiglu_bwd_kernel[grid](
            d2, d2.stride(0), g2, g2.stride(0), u2, u2.stride(0), dg, du, f, BLOCK=block, num_warps=4
        )
    return dg, du


@torch.library.custom_op("titan_mm::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_fwd(gate, up)


@swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("titan_mm::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_bwd(dy, gate, up)


@swiglu_bwd_op.register_fake
def _(dy, gate, up):
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(up, memory_format=torch.contiguous_format),
    )


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_bwd_op(dy, gate, up)


swiglu_op.register_autograd(_backward, setup_context=_setup)


class SwiGLUFunction(torch.autograd.Function):
    """The eager fast path (same kernels, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_bwd(dy, gate, up)
