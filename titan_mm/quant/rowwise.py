"""Rowwise float8 training linears on titan_mm's own casts (``float8.recipe = "rowwise"`` with
``float8.rowwise_casts = "titan"``).

torchao's rowwise recipe loses its GEMMs' gain in its casts: on Qwen3-8B (12 layers, one H100) its GEMMs took
tensorwise's time but its casts 65.7 ms more a step, 35.9 ms of it in one inductor reduction (the column-wise amax
and transposed cast of the weight gradient's operands; docs/benchmarks.md). Here titan_mm.kernels casts every
operand (``fp8_rows``: a row a program; ``fp8_cols``: the rows of a transpose, written transposed), and the three
GEMMs are torch._scaled_mm with one fp32 scale per row of each operand along its reduction:

    y  = x @ w.T     x rows over K,   w rows over K       (fast accumulation, as torchao's forward)
    dx = g @ w       g rows over N,   w.T rows over N
    dw = g.T @ x     g.T rows over M, x.T rows over M     (M % 16 != 0: in the input's dtype, the float8 GEMM's rule)

All e4m3 with amax / 448 scales (titan_mm.nn.fp8; torchao's recipe also rounds its scales to powers of two). The
linear keeps nn.Linear's parameters and state-dict keys (a class swap, as FSDP2's fully_shard does); its input is
saved in its own dtype, as a bf16 linear's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from titan_mm.kernels import fp8_cast

__all__ = ["Float8RowwiseLinear", "to_rowwise"]


def _scaled_mm(a8, sa, b8, sb, out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    """a8 [M, K] @ b8.T with b8 [N, K] (both e4m3 rows along K), scales sa [M, 1], sb [N, 1]."""
    return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype, use_fast_accum=fast)


class _RowwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _scaled_mm(*fp8_cast(x), *fp8_cast(w), x.dtype, fast=True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = _scaled_mm(*fp8_cast(g), *fp8_cast(w, cols=True), g.dtype, fast=False) if ctx.needs_input_grad[0] else None
        if x.shape[0] % 16:
            dw = (g.t() @ x).to(w.dtype)
        else:
            # in g's dtype: cuBLAS's rowwise-scaled GEMM writes bf16 only (a float32 master weight's gradient widens)
            dw = _scaled_mm(*fp8_cast(g, cols=True), *fp8_cast(x, cols=True), g.dtype, fast=False).to(w.dtype)
        return dx, dw


class Float8RowwiseLinear(nn.Linear):
    """nn.Linear whose three GEMMs run in float8 with rowwise scales (this module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _RowwiseMatmul.apply(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + ", float8 rowwise"


def to_rowwise(model: nn.Module, keep: Callable[[nn.Module, str], bool]) -> int:
    """Turn every plain nn.Linear for which ``keep(module, fqn)`` into a Float8RowwiseLinear in place; -> how many."""
    n = 0
    for fqn, mod in model.named_modules():
        if type(mod) is nn.Linear and keep(mod, fqn):
            mod.__class__ = Float8RowwiseLinear
            n += 1
    return n

