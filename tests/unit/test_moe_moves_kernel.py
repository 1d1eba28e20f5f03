"""The fused MoE token moves (titan_mm.kernels.moe_expand / moe_combine, kernel op ``moe_moves``) against PyTorch's
(titan_mm.nn.moe.expand_rows / combine): values and gradients in fp32 through Triton's CPU interpreter,
on the eager Function path and through the torch.library ops (opcheck), with odd widths, strided inputs and the
padded layout of the float8 experts. The bf16
comparison at Qwen3-30B-A3B's shape runs on the GPU (tests/gpu/test_kernels_gpu.py)."""

import pytest

from tests.triton_interp import run_interpreted

_INTERP = r"""
import torch
from titan_mm import kernels as K
from titan_mm.kernels import _dispatch
from titan_mm.kernels.moe_moves import moe_combine_op, moe_sum_rows_op
from titan_mm.nn import moe

torch.manual_seed(0)
bad = []
# align 16: the padded layout of the float8 experts (pad rows: zeros out of the expand, zero gradients into them)
for N, E, k, D, align in ((7, 6, 2, 33, 1), (16, 8, 3, 2100, 1), (1, 4, 4, 8, 1), (7, 6, 2, 33, 16)):
    top_i = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    top_w = torch.rand(N, k)
    r = moe.sort_by_expert(top_i, E, align)
    rows = r.src_A.numel()
    for ops in (False, True):
        _dispatch.PREFER_OPS = ops
        x = torch.randn(N, D, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        g_AD = torch.randn(rows, D)
        xa = K.moe_expand(x, r.src_A, r.inv_NK)
        if not torch.equal(xa, moe.expand_rows(x2, r.src_A, r.inv_NK)) or (align > 1 and xa[r.src_A == N].any()):
            bad.append(f"expand {N, E, k, D, align} ops={ops}")
        xa.backward(g_AD)
        moe.expand_rows(x2, r.src_A, r.inv_NK).backward(g_AD)
        if not torch.allclose(x.grad, x2.grad, atol=1e-5):
            bad.append(f"expand grad {N, E, k, D, align} ops={ops}")
        y = torch.randn(2 * rows, D)[::2].requires_grad_()  # strided rows
        w = top_w.clone().requires_grad_()
        y2, w2 = y.detach().clone().requires_grad_(), top_w.clone().requires_grad_()
        g = torch.randn(N, D)
        out, ref = K.moe_combine(y, w, r, torch.float32), moe.combine(y2, w2, r, torch.float32)
        if not torch.allclose(out, ref, atol=1e-5):
            bad.append(f"combine {N, E, k, D, align} ops={ops}: {(out - ref).abs().max():.2e}")
        out.backward(g)
        ref.backward(g)
        if not (torch.allclose(y.grad, y2.grad, atol=1e-5) and torch.allclose(w.grad, w2.grad, atol=1e-4)):
            bad.append(f"combine grads {N, E, k, D, align} ops={ops}")
        if align > 1 and y.grad[r.src_A == N].any():
            bad.append(f"combine: pad rows' gradient not zero {N, E, k, D, align} ops={ops}")
_dispatch.PREFER_OPS = False
# the ops' registrations (schemas, fake implementations, autograd) as torch.library checks them
r = moe.sort_by_expert(torch.stack([torch.randperm(6)[:2] for _ in range(5)]), 6)
w_NK = torch.rand(5, 2, requires_grad=True)
y = torch.randn(10, 40, requires_grad=True)
torch.library.opcheck(moe_combine_op, (y, r.inv_NK, w_NK))
torch.library.opcheck(moe_sum_rows_op, (torch.randn(10, 40), r.inv_NK))
print("BAD" if bad else "OK", bad)
"""


@pytest.mark.slow  # ~11 s of Triton's interpreter on 2 cores; the GPU kernel tests run it on the device
def test_fused_moves_match_pytorch_in_the_interpreter():
    run_interpreted(_INTERP, timeout=400)
