"""Triton device helpers shared by the kernel files (inlined into the kernels that call them)."""

import triton
import triton.language as tl


@triton.jit
def load_tile_pair(X, stride_x, DY, stride_dy, rows, cols, mask):
    """The [rows, cols] tiles of X and DY (each with its own row stride) in their dtype, 0 where masked: the
    loads of a backward that reads an input and its output gradient tile by tile."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy
