"""Triton pieces shared by the kernel files: device helpers (inlined into the kernels that call them) and the
column-sum kernel that finishes the weight / bias gradients of the backwards from their fp32 partials."""

import torch
import triton
import triton.language as tl

from ._utils import new_empty, wrap_triton, writes


@triton.jit
def load_tile_pair(X, stride_x, DY, stride_dy, rows, cols, mask):
    """The [rows, cols] tiles of X and DY (each with its own row stride) in their dtype, 0 where masked: the
    loads of a backward that reads an input and its output gradient tile by tile."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _col_sum_kernel(P, R, D, OUT, BR: tl.constexpr, BD: tl.constexpr):
    """OUT[c] = sum over the R rows of the contiguous fp32 P[R, D] (fixed order), cast to OUT's dtype."""
    cols = tl.program_id(0) * BD + tl.arange(0, BD)
    mc = cols < D
    r = tl.arange(0, BR)
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    i = 0
    while i < R:  # a `while`: the CPU interpreter cannot run a runtime `range`
        rows = i + r
        m = (rows < R)[:, None] & mc[None, :]
        acc += tl.load(P + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=m, other=0.0)
        i += BR
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=mc)


writes(_col_sum_kernel, "OUT")


def col_sums(part: torch.Tensor, dtype: torch.dtype, op: bool = False) -> torch.Tensor:
    """The column sums of the fp32 partials ``part`` [R, D] (one row per program of a backward) in ``dtype``:
    one launch where ``part.sum(0).to(dtype)`` takes two in eager (inductor fuses those two when traced, and
    this launch is traced as well). op=True: from a triton_op body (see `_utils.wrap_triton`)."""
    kern = wrap_triton(_col_sum_kernel) if op else _col_sum_kernel
    part = part.contiguous()
    r, d = part.shape
    out = new_empty((d,), dtype, part.device)
    if d:
        kern[(triton.cdiv(d, 64),)](part, r, d, out, BR=32, BD=64, num_warps=4)
    return out
