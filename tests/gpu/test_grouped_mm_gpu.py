"""The experts' grouped GEMMs on CUDA (run on the H200).

titan_mm.kernels.grouped_mm: fp32 and fp16 experts equal the loop over experts, forward and both gradients, at
Qwen3-MoE-like widths with empty and partial groups, and neither pass syncs (torch.cuda.set_sync_debug_mode("error"))
once compiled.

float8 experts (float8.moe_experts; SM>=90 with torchao's MoE training): torchao's float8 grouped GEMMs on the padded
layout equal an emulation of their rowwise float8 casts (fp32 GEMMs of the dequantized operands), pad rows give zero
rows; a Qwen3-30B-A3B MoE layer (eager and compiled, PyTorch's and the fused token moves) gives bf16's output and
every gradient within 1e-1 relative L2 (e4m3 with rowwise scales: an fp32 emulation of the same casts gave 6.5-6.9%
for the output and every gradient at these widths), and its forward does not sync (the backward's syncs are printed).

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_grouped_mm_gpu.py -s
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from titan_mm.kernels import grouped_mm
from titan_mm.nn import moe
from titan_mm.nn.moe import grouped_linear

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


def _float8_ready():
    try:
        import torchao.prototype.moe_training  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torchao's MoE training is not installed: {e}")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("float8 grouped GEMMs need SM>=90")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _fp8(x, dim):
    """torchao's rowwise cast, dequantized: power-of-two scales from the amax along ``dim``, e4m3, saturated."""
    amax = x.float().abs().amax(dim=dim, keepdim=True).clamp_min(1e-12)
    s = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s


def test_float8_grouped_swiglu_matches_its_emulation():
    """The float8 SwiGLU on the padded layout (an empty group and the last group's extra rows included) against fp32
    GEMMs of the same float8 operands (bf16 between the GEMMs, as on the GPU path)."""
    _float8_ready()
    torch.manual_seed(0)
    E, K, D, F_, N = 16, 4, 2048, 768, 1024
    top_i = torch.stack([torch.randperm(E - 1, device="cuda")[:K] + 1 for _ in range(N)])  # expert 0: no rows
    r = moe.sort_by_expert(top_i, E, moe.FLOAT8_ALIGN)
    pad = r.src_A == N
    x = moe.expand_rows(torch.randn(N, D, device="cuda", dtype=torch.bfloat16), r.src_A, r.inv_NK)
    w1, w3 = (torch.randn(E, F_, D, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
    w2 = torch.randn(E, D, F_, device="cuda", dtype=torch.bfloat16) * 0.02
    y = moe.grouped_swiglu(x, r.counts_E, w1, w3, w2, float8=True)
    assert not y[pad].any() and torch.isfinite(y).all()

    sizes = r.counts_E.tolist()
    def mm(a, w):
        return torch.cat([_fp8(a_e, 1) @ _fp8(w[e], 1).T for e, a_e in enumerate(torch.split(a, sizes))]).bfloat16()

    want = mm(F.silu(mm(x, w1)) * mm(x, w3), w2)
    err = _rel(y[~pad], want[~pad])
    print(f"\n[float8 grouped swiglu] relative L2 vs emulation {err:.2e}, vs bf16 "
          f"{_rel(y, moe.grouped_swiglu(x, r.counts_E, w1, w3, w2)):.2e}")
    assert err < 2e-2, err


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fused", [False, True], ids=["torch_moves", "fused_moves"])
def test_float8_moe_layer_matches_bf16_without_sync(fused, compiled):
    _float8_ready()
    from titan_mm import kernels

    torch.manual_seed(0)
    D, F_, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B
    moves = moe.TokenMoves(kernels.moe_expand, kernels.moe_combine) if fused else moe.TokenMoves()
    bf = moe.MoE(D, F_, E, K, norm_topk_prob=True, moves=moves).cuda()
    bf.reset_parameters(0.02)
    bf = bf.to(torch.bfloat16)
    f8 = moe.MoE(D, F_, E, K, norm_topk_prob=True, moves=moves, float8=True).cuda().to(torch.bfloat16)
    f8.load_state_dict(bf.state_dict())
    x = torch.randn(2, 2048, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 2048, D, device="cuda", dtype=torch.bfloat16)

    def run(layer, check_syncs=False):
        fn = torch.compile(layer) if compiled else layer
        x.grad = None
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if check_syncs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            y, stats = fn(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        with warnings.catch_warnings(record=True) as syncs:  # the backward's syncs are counted, not failed
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if check_syncs else 0)
            try:
                ((y.float() * g).sum() + stats.sum()).backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        backward_syncs = sum("synchroniz" in str(w.message) for w in syncs)
        return [y.detach(), x.grad] + [p.grad for p in layer.parameters()], backward_syncs

    want, _ = run(bf)
    run(f8)  # compiles / autotunes (which may sync)
    got, backward_syncs = run(f8, check_syncs=True)
    names = ["y", "dx"] + [n for n, _ in f8.named_parameters()]
    errs = {n: _rel(a, b) for n, a, b in zip(names, got, want)}
    print(f"\n[float8 moe layer fused={fused} compiled={compiled}] relative L2 vs bf16: "
          + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f"; backward host syncs: {backward_syncs}")
    for n, a in zip(names, got):
        assert torch.isfinite(a).all(), n
    assert all(e < 1e-1 for e in errs.values()), errs
