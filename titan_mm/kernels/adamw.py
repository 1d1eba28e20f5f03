"""One AdamW update of a contiguous fp32 parameter that reads a narrow (bf16 / fp16) or fp32 gradient and also
writes the parameter's narrow compute copy, in one pass.

The one-rank cast path with ``parallel.one_rank_mixed_precision = optimizer`` (titan_mm.train.cast_adamw) keeps
each large parameter's bf16 copy between steps and its gradient in bf16: this kernel replaces the backward's
widening copy, the fp32 gradient read of torch's fused AdamW and the next forward's cast (Qwen3-30B-A3B cut to 4
layers: 9.3 ms of cast copies in a 156.5 ms step on the H200, bench/results/mfu_profile.json).

The arithmetic is torch's fused AdamW's (aten fused_adam_utils.cuh) in fp32: grad / grad_scale, decoupled weight
decay, then the moments and the bias-corrected step; ``found_inf != 0`` leaves everything untouched (the caller
restores the step count, as torch does).
"""

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _adamw_kernel(P, G, M, V, C, STEP, SCALE, FOUND, N, lr, beta1, beta2, eps, weight_decay,
                  HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_FOUND:  # a skipped step: every access masked off
        N = tl.where(tl.load(FOUND) == 0, N, 0)
    mask = offs < N
    step = tl.load(STEP).to(tl.float32)
    bias1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    p = tl.load(P + offs, mask=mask)
    g = tl.load(G + offs, mask=mask).to(tl.float32)
    m = tl.load(M + offs, mask=mask)
    v = tl.load(V + offs, mask=mask)
    if HAS_SCALE:
        g = g / tl.load(SCALE)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    tl.store(C + offs, p.to(C.dtype.element_ty), mask=mask)


def adamw_step_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, copy: torch.Tensor,
                step: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
    """In place: ``p``, ``m``, ``v`` (fp32) and ``copy`` (``p`` in its narrow dtype); ``step``: the 0-dim step
    count, already advanced."""
    n = p.numel()
    if not n:
        return
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        p, g, m, v, copy, step, grad_scale if grad_scale is not None else step,
        found_inf if found_inf is not None else step, n, lr, beta1, beta2, eps, weight_decay,
        HAS_SCALE=grad_scale is not None, HAS_FOUND=found_inf is not None, BLOCK=_BLOCK, num_warps=8)
