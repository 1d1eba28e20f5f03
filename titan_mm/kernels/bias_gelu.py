"""Bias + GELU (tanh approximation) for the ViT MLP, forward and backward, as a custom op.

tanh is written through exp (triton 3.6 has no tl.math.tanh import path that works everywhere).
Backward writes dx and one fp32 partial of db per row tile; the partials are summed in PyTorch.
Legend: N rows (patch tokens), D width.
"""


import torch
import triton
import triton.language as tl

from ._utils import as_rows, new_empty, next_pow2

_BR, _BD = 64, 128  # backward tile: rows x columns (the db partial is N/64 x D fp32)


@triton.jit
def _tanh(z):
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * z))


@triton.jit
def _bias_gelu_fwd_kernel(X, stride_x, B, Y, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    x += tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    tl.store(Y + row * D + cols, (0.5 * x * (1.0 + t)).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _bias_gelu_bwd_kernel(DY, stride_dy, X, stride_x, B, DX, DB_PART, N, D, BR: tl.constexpr, BD: tl.constexpr):
    pr = tl.program_id(0)
    rows = (pr * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mc = cols < D
    m = (rows[:, None] < N) & mc[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    x += tl.load(B + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = x * x
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x2 * x))
    dgelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x2)
    dx = tl.where(m, dy * dgelu, 0.0)
    tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
    tl.store(DB_PART + pr.to(tl.int64) * D + cols, tl.sum(dx, axis=0), mask=mc)


def bias_gelu_fwd(x, b):
    x2 = as_rows(x)
    b = b.contiguous()
    n, d = x2.shape
    y = new_empty(x.shape, x.dtype, x.device)
    if n * d > 0:
        block = min(1024, next_pow2(d))
        _bias_gelu_fwd_kernel[(n, triton.cdiv(d, block))](x2, x2.stride(0), b, y, d, BLOCK=block, num_warps=4)
    return y


def bias_gelu_bwd(dy, x, b):
    x2, d2 = as_rows(x), as_rows(dy)
    b = b.contiguous()
    n, d = x2.shape
    dx = new_empty(x.shape, x.dtype, x.device)
    nrb = triton.cdiv(n, _BR)
    db_part = new_empty((max(nrb, 1), d), torch.float32, x.device)
    if n * d > 0:
        _bias_gelu_bwd_kernel[(nrb, triton.cdiv(d, _BD))](
            d2, d2.stride(0), x2, x2.stride(0), b, dx, db_part, n, d, BR=_BR, BD=_BD, num_warps=8
        )
    else:
        db_part.zero_()
    return dx, db_part.sum(0).to(b.dtype)


@torch.library.custom_op("titan_mm::bias_gelu", mutates_args=())
def bias_gelu_op(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return bias_gelu_fwd(x, b)


@bias_gelu_op.register_fake
def _(x, b):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("titan_mm::bias_gelu_bwd", mutates_args=())
def bias_gelu_bwd_op(dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return bias_gelu_bwd(dy, x, b)


@bias_gelu_bwd_op.register_fake
def _(dy, x, b):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(b)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, b = ctx.saved_tensors
    return bias_gelu_bwd_op(dy, x, b)


bias_gelu_op.register_autograd(_backward, setup_context=_setup)


class BiasGeluFunction(torch.autograd.Function):
    """The eager fast path (same kernels, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, x, b):
        ctx.save_for_backward(x, b)
        return bias_gelu_fwd(x, b)

    @staticmethod
    def backward(ctx, dy):
        x, b = ctx.saved_tensors
        return bias_gelu_bwd(dy, x, b)
