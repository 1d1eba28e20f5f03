"""titan_mm.kernels.grouped_mm on CUDA (run on the H200): fp32 and fp16 experts equal the loop over experts,
forward and both gradients, at Qwen3-MoE-like widths with empty and partial groups, and neither pass syncs
(torch.cuda.set_sync_debug_mode("error")) once compiled.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_grouped_mm_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from titan_mm.kernels import grouped_mm
from titan_mm.models.common.moe import grouped_linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.float16, 5e-2)], ids=["fp32", "fp16"])
def test_grouped_mm_matches_the_loop_without_sync(dtype, tol):
    torch.manual_seed(0)
    E, K, N = 16, 512, 768
    counts = torch.randint(0, 200, (E,), device="cuda")
    counts[3] = 0
    A = int(counts.sum())
    x = (torch.randn(A, K, device="cuda") / K**0.5).to(dtype).requires_grad_()
    w = torch.randn(E, N, K, device="cuda").to(dtype).requires_grad_()
    g = torch.randn(A, N, device="cuda").to(dtype)
    grouped_mm(x, w, counts).backward(g)  # compile
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_mm(x, w, counts)
        y.backward(g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    grouped_linear(xr, wr, counts).backward(g.double())
    want = grouped_linear(xr.detach(), wr.detach(), counts)
    for name, a, b in (("y", y, want), ("dx", x.grad, xr.grad), ("dw", w.grad, wr.grad)):
        err = float(((a.double() - b).norm() / b.norm().clamp_min(1e-12)))
        assert err <= tol, f"{dtype} {name}: relative error {err:.2e}"
