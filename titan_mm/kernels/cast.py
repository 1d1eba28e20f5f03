"""Widening copy (bf16 / fp16 -> fp32) of a contiguous tensor, and the widening sum of two: one 1-D pass each,
vectorized loads and stores.

torch's copy or add between different dtypes runs an unrolled, per-element kernel (dynamic casting): at 3.55 B bf16
gradients a step (the Qwen3-8B 12-layer case of bench/mfu.py) the copy reached 1.8 TB/s on the H200, about half of
the copy ceiling. The one-rank cast path (titan_mm.parallel.apply.apply_param_cast) widens every gradient with
``upcast``, and sums a large parameter's gradients over micro-batches with ``widening_add`` (torch's fp32 += bf16 add:
59.8 ms a step of 5 micro-batches of bagel_7b_mot_4l_x5 on the H100, 890 calls).
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


@triton.jit
def _add_kernel(A, G, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    y = tl.load(A + offs, mask=m).to(tl.float32) + tl.load(G + offs, mask=m).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


def widening_add(a: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a + g``, summed in fp32 (``a`` and ``g`` contiguous, of ``out``'s numel; ``out`` may be ``a``)."""
    n = out.numel()
    if n:
        _add_kernel[(triton.cdiv(n, _BLOCK),)](a, g, out, n, BLOCK=_BLOCK, num_warps=8)
    return out
