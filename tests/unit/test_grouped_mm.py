"""titan_mm.kernels.grouped_mm (kernels/grouped_gemm.py: the MoE experts' grouped GEMM without host syncs, for
dtypes torch._grouped_mm lacks on CUDA) equals the loop over experts, forward and both gradients, through TRITON_INTERPRET=1: experts
with no rows, partial tiles, fp32 (IEEE) and fp16. On CUDA the same kernel runs for fp32 / fp16 MoE
(tests/gpu/test_qwen3_gpu.py checks the forward for host syncs)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import run_interpreted

from titan_mm.kernels import grouped_mm

_INTERP = r"""
import torch
from titan_mm.kernels import grouped_mm
from titan_mm.nn.moe import grouped_linear

torch.manual_seed(0)
bad = []
for dt, tol in ((torch.float32, 1e-4), (torch.float16, 3e-2)):
    counts = torch.tensor([0, 70, 3, 0, 65])
    x = torch.randn(int(counts.sum()), 48).to(dt).requires_grad_()
    w = torch.randn(5, 40, 48).to(dt).requires_grad_()
    g = torch.randn(x.shape[0], 40).to(dt)
    y = grouped_mm(x, w, counts)
    y.backward(g)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yr = grouped_linear(xr, wr, counts)
    yr.backward(g.float())
    for name, a, b in (("y", y, yr), ("dx", x.grad, xr.grad), ("dw", w.grad, wr.grad)):
        err = float((a.float() - b).abs().max())
        if a.dtype != dt or a.shape != b.shape or not err <= tol:
            bad.append(f"{dt} {name}: max err {err}")
print("BAD" if bad else "OK", bad)
"""


def test_triton_grouped_mm_matches_the_loop_in_the_interpreter():
    run_interpreted(_INTERP)


def test_bad_shapes_are_one_line():
    with pytest.raises(ValueError, match="must agree on K and E"):
        grouped_mm(torch.zeros(4, 8), torch.zeros(2, 3, 7), torch.tensor([2, 2]))


def test_kernel_submodules_do_not_shadow_the_public_functions():
    # a lazily imported submodule named like a public function replaces it on the package (the H200 caught
    # `grouped_mm` turning into a module after its first call)
    import importlib
    import pkgutil

    import titan_mm.kernels as kernels

    for m in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"titan_mm.kernels.{m.name}")
    shadowed = [n for n in kernels.__all__ if type(getattr(kernels, n)).__name__ == "module"]
    assert not shadowed, f"titan_mm.kernels.{shadowed} are modules, not the functions __all__ promises"
