"""Widening copy (bf16 / fp16 -> fp32) of a contiguous tensor: one 1-D pass, vectorized loads and stores.

torch's copy between different dtypes runs an unrolled, per-element kernel (dynamic casting): at 3.55 B bf16
gradients a step (the Qwen3-8B 12-layer case of bench/mfu.py) it reached 1.8 TB/s on the H200, about half of
the copy ceiling. The one-rank cast path (titan_mm.parallel.apply.apply_param_cast) widens every gradient with it.
"""

import torch
import triton
import triton.language as tl

from ._utils import new_empty

_BLOCK = 4096


@triton.jit
def _upcast_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(Y + offs, tl.load(X + offs, mask=m).to(Y.dtype.element_ty), mask=m)


def upcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (contiguous) in ``dtype``, as a new contiguous tensor."""
    y = new_empty(x.shape, dtype, x.device)
    n = x.numel()
    if n:
        _upcast_kernel[(triton.cdiv(n, _BLOCK),)](x, y, n, BLOCK=_BLOCK, num_warps=8)
    return y
