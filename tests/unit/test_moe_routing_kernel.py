"""The fused MoE routing (titan_mm.kernels.moe_routing, kernel op ``moe_routing``) against its reference
(titan_mm.nn.moe.route_stats: softmax, torch.topk, renormalization, aux_stats) through Triton's CPU
interpreter: top_w, top_i, the aux statistics and the logits' gradient (from top_w's and the statistics'
gradients), fp32 and bf16 logits, with and without norm_topk_prob and a valid mask, E 8 / 60 / 128 with K 2 / 4 / 8,
N not a multiple of the rows per program (small row blocks, so several programs' partials are summed); the eager
Function path and the torch.library ops (opcheck, torch.compile(fullgraph=True)); ties rank by the lower index.

Each row's logits are distinct (bf16 too: a permutation of multiples of 1/16), since torch.topk leaves the order
of equal values unspecified. bf16 outputs may be one bf16 ulp apart (fp32 rounding inside, and the interpreter
rounds fp32 -> bf16 toward zero). The GPU run at Qwen3-30B-A3B's shape is tests/gpu/test_moe_routing_gpu.py."""

import pytest

from tests.triton_interp import run_interpreted

_INTERP = r"""
import os

os.environ["TITAN_KERNELS_POISON"] = "1"  # outputs start NaN-filled: an unwritten element shows
import torch
from titan_mm import kernels as K
from titan_mm.kernels import _dispatch, moe_router as R
from titan_mm.nn import moe

torch.manual_seed(0)
bad = []


def distinct_logits(N, E, dtype):
    # per row a permutation of distinct multiples of 1/16 (exact in bf16), times a power of two
    perm = torch.rand(N, E).argsort(1).float()
    scale = 2.0 ** torch.randint(-1, 1, (N, 1)).float()
    return ((perm - E / 2) / 16 * scale).to(dtype)


def close(a, b, dtype, what, case):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    if not torch.allclose(a.float(), b.float(), **tol):
        bad.append(f"{what} {case}: {(a.float() - b.float()).abs().max():.3e}")


def check(N, E, k, dtype, norm, use_valid, strided=False, stats_only=False):
    case = (N, E, k, str(dtype), norm, use_valid, strided, _dispatch.PREFER_OPS)
    lg = distinct_logits(N, E, dtype)
    if strided:  # rows of a wider buffer
        lg = torch.cat([lg, torch.zeros(N, 3, dtype=dtype)], 1)[:, :E]
    valid = (torch.rand(N) > 0.3) if use_valid else None
    a, b = lg.clone().requires_grad_(), lg.clone().requires_grad_()
    w, i, s = K.moe_routing(a, k, norm, valid)
    w2, i2, s2 = moe.route_stats(b, k, norm, valid)
    if w.dtype != dtype or i.dtype != torch.int64 or s.dtype != torch.float32 or s.shape != (2, E):
        bad.append(f"dtypes / shapes {case}")
    if not torch.equal(i, i2):
        bad.append(f"top_i {case}")
    if not torch.equal(s[0], s2[0]):
        bad.append(f"counts {case}")
    close(w, w2, dtype, "top_w", case)
    close(s[1], s2[1], torch.float32, "prob sums", case)
    gw, gs = torch.randn(N, k).to(dtype), torch.randn(2, E)
    torch.autograd.backward([w, s], [gw, gs])
    torch.autograd.backward([w2, s2], [gw, gs])
    close(a.grad, b.grad, dtype, "d logits", case)
    if not stats_only:
        return
    # the statistics' gradient alone (top_w's is None in the eager Function)
    a.grad = b.grad = None
    K.moe_routing(a, k, norm, valid)[2].backward(gs)
    moe.route_stats(b, k, norm, valid)[2].backward(gs)
    close(a.grad, b.grad, dtype, "d logits (stats only)", case)


DEFAULT = R.ROWS, R.TILE
R.ROWS = 16  # the interpreter's time goes by programs: one a case here, several below
for dtype in (torch.float32, torch.bfloat16):
    for E, k in ((8, 2), (8, 8), (60, 4), (128, 2), (128, 8)):  # every E and K; K = E picks every expert
        for norm, use_valid in ((False, False), (True, True)):
            check(13, E, k, dtype, norm, use_valid)
    check(13, 60, 4, dtype, True, False)  # each switch alone once
    check(13, 60, 4, dtype, False, True)
R.ROWS, R.TILE = 8, 1024  # several programs
for dtype in (torch.float32, torch.bfloat16):
    check(21, 60, 4, dtype, True, True, stats_only=True)
    check(21, 128, 8, dtype, False, False, stats_only=True)
check(13, 60, 4, torch.float32, True, True, strided=True)
check(0, 8, 2, torch.float32, True, False)
_dispatch.PREFER_OPS = True  # the torch.library ops, eagerly
for dtype in (torch.float32, torch.bfloat16):
    check(21, 60, 4, dtype, True, True)
check(21, 128, 8, torch.float32, False, False)
_dispatch.PREFER_OPS = False
R.ROWS, R.TILE = DEFAULT  # the default launch
check(150, 128, 8, torch.bfloat16, True, True)
R.ROWS = 16
check(20, 512, 10, torch.float32, True, True)  # the widest routers in view, K not a power of two
R.ROWS = DEFAULT[0]

# ties: the lower expert index first (a stable descending sort of the probabilities)
lg = torch.randint(-3, 3, (30, 16)).float()
w, i, _ = K.moe_routing(lg, 4, False)
want = torch.sort(torch.softmax(lg, -1), dim=-1, descending=True, stable=True).indices[:, :4]
if not torch.equal(i, want):
    bad.append("ties: not the lower index first")

# the ops' registrations (schemas, fake implementations, autograd) as torch.library checks them; traced launches
# take the kernels' declared outputs (the interpreter cannot build the TTIR torch reads them from)
from titan_mm.kernels.moe_router import moe_routing_bwd_op, moe_routing_op
from titan_mm.tools.kernel_checks import use_declared_writes

use_declared_writes()

R.ROWS, R.TILE = 8, 1024
lg = distinct_logits(11, 60, torch.float32).requires_grad_()
valid = torch.rand(11) > 0.3
torch.library.opcheck(moe_routing_op, (lg, valid, 4, True))
torch.library.opcheck(moe_routing_op, (lg, None, 2, False))
_, ti, _ = moe_routing_op(lg.detach(), valid, 4, True)
torch.library.opcheck(moe_routing_bwd_op, (torch.randn(11, 4), torch.randn(2, 60), lg.detach(), valid, ti, True))
torch.library.opcheck(moe_routing_bwd_op, (None, torch.randn(2, 60), lg.detach(), None, ti, False))

# torch.compile(fullgraph=True): the launches traced into the graphs, equal to eager

def f(lg, valid, gw):
    w, i, s = K.moe_routing(lg, 4, True, valid)
    return (w.float() * gw).sum() + s[1].pow(2).sum() + i.sum() * 0


gw = torch.randn(11, 4)
a, b = lg.detach().clone().requires_grad_(), lg.detach().clone().requires_grad_()
out = f(a, valid, gw)
out.backward()
out2 = torch.compile(f, fullgraph=True, backend="aot_eager")(b, valid, gw)
out2.backward()
if not (torch.allclose(out, out2, rtol=1e-6) and torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)):
    bad.append(f"compile: {(out - out2).abs().item():.2e}, grad {(a.grad - b.grad).abs().max():.2e}")
print("BAD" if bad else "OK", bad)
"""


@pytest.mark.slow  # ~21 s of Triton's interpreter on 2 cores; tests/gpu/test_moe_routing_gpu.py runs the kernel
def test_fused_routing_matches_the_reference_in_the_interpreter():
    run_interpreted(_INTERP, timeout=600)
