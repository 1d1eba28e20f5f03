"""The fused MoE routing (titan_mm.kernels.moe_routing, kernel op ``moe_routing``) on CUDA at Qwen3-30B-A3B's layer
shape (16,384 tokens, 128 experts, top-8) against its reference (titan_mm.nn.moe.route_stats): top_w,
top_i, the aux statistics and the logits' gradient, fp32 and bf16, with and without norm_topk_prob, with padding;
random bf16 logits (many ties) rank equal values by the lower index; torch.compile(fullgraph=True) with inductor
equals eager and neither syncs the host. Speed is bench/floor.py's (``routing`` / ``routing_fused`` rows at the MoE
cases' shapes), never asserted here.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_moe_routing_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from titan_mm import kernels as K
from titan_mm.nn import moe

pytestmark = pytest.mark.gpu

N, E, TOP = 16384, 128, 8


def _distinct(n, e, dtype, seed=0):
    """Per row a permutation of distinct multiples of 1/16 (exact in bf16): torch.topk orders ties arbitrarily."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.rand(n, e, device="cuda", generator=g).argsort(1).float()
    return ((perm - e / 2) / 16).to(dtype)


def _valid(n):
    v = torch.rand(n, device="cuda") > 0.05
    v[-n // 16:] = False  # a padded tail
    return v


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)


def _run(fn, lg, norm, valid, gw, gs):
    lg = lg.detach().clone().requires_grad_()
    w, i, s = fn(lg, TOP, norm, valid)
    torch.autograd.backward([w, s], [gw, gs])
    return w, i, s, lg.grad


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_reference(dtype, norm):
    torch.manual_seed(0)
    lg, valid = _distinct(N, E, dtype), _valid(N)
    gw, gs = torch.randn(N, TOP, device="cuda").to(dtype), torch.randn(2, E, device="cuda")
    w, i, s, dx = _run(K.moe_routing, lg, norm, valid, gw, gs)
    w2, i2, s2, dx2 = _run(moe.route_stats, lg, norm, valid, gw, gs)
    assert torch.equal(i, i2)
    assert torch.equal(s[0], s2[0])
    torch.testing.assert_close(w.float(), w2.float(), **_tol(dtype))
    torch.testing.assert_close(s[1], s2[1], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(dx.float(), dx2.float(), **_tol(dtype))
    # no mask: every row counts
    w, i, s = K.moe_routing(lg, TOP, norm)
    assert torch.equal(s[0], torch.bincount(i.reshape(-1), minlength=E).float())


def test_ties_rank_by_the_lower_index():
    torch.manual_seed(1)
    lg = torch.randn(N, E, device="cuda").to(torch.bfloat16)  # bf16: most rows hold equal logits
    w, i, _ = K.moe_routing(lg, TOP, True)
    p = torch.softmax(lg, -1, dtype=torch.float32)
    want = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :TOP]
    assert torch.equal(i, want)
    w2, i2, _ = moe.route_stats(lg, TOP, True)
    torch.testing.assert_close(w.float(), w2.float(), **_tol(torch.bfloat16))  # same values, ties in any order


def test_compiled_equals_eager_without_host_syncs():
    torch.manual_seed(2)
    lg, valid = _distinct(N, E, torch.bfloat16, seed=2), _valid(N)
    gw = torch.randn(N, TOP, device="cuda").to(torch.bfloat16)

    def loss(x):
        w, i, s = K.moe_routing(x, TOP, True, valid)
        return (w.float() * gw.float()).sum() + s[1].pow(2).sum() * 1e-6, i

    a, b = lg.clone().requires_grad_(), lg.clone().requires_grad_()
    compiled = torch.compile(loss, fullgraph=True)
    la, ia = loss(a)
    la.backward()
    lb, ib = compiled(b)
    lb.backward()
    assert torch.equal(ia, ib)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.float(), a.grad.float(), **_tol(torch.bfloat16))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fn in (loss, compiled):
            x = lg.clone().requires_grad_()
            fn(x)[0].backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
