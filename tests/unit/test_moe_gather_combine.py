"""The MoE's token moves (moe.expand_rows / moe.combine / moe.reduce_rows) equal the plain indexing and
index_add forms in values and gradients, bit for bit in fp32, and no hidden-state row is scatter-added."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_mm.nn import moe


def _routing(N=37, K=3, E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    top_i = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return top_i, g


def test_expand_and_combine_equal_indexing_and_index_add():
    N, K, E, D = 37, 3, 6, 8
    top_i, g = _routing(N, K, E)
    r = moe.sort_by_expert(top_i, E)
    assert torch.equal(r.counts_E, torch.bincount(top_i.reshape(-1), minlength=E))
    x = torch.randn(N, D, generator=g, requires_grad=True)
    y = torch.randn(N * K, D, generator=g, requires_grad=True)
    w = torch.rand(N, K, generator=g, requires_grad=True)
    dx_A, dy_N = torch.randn(N * K, D, generator=g), torch.randn(N, D, generator=g)

    def ref(x, y, w):
        xa = x[r.src_A]
        out = torch.zeros(N, D).index_add_(0, r.src_A, y * w.reshape(-1)[r.order_A, None])
        return xa, out

    def ours(x, y, w):
        return moe.expand_rows(x, r.src_A, r.inv_NK), moe.combine(y, w, r, torch.float32)

    results = []
    for fn in (ref, ours):
        xs = [t.detach().clone().requires_grad_() for t in (x, y, w)]
        xa, out = fn(*xs)
        torch.autograd.backward([xa, out], [dx_A, dy_N])
        results.append([xa, out] + [t.grad for t in xs])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_regroup_by_expert_and_back():
    """Expert parallelism's regroup of the received rows (one expert each): a stable sort by expert, expand_rows in
    and reduce_rows back, with the gradients of plain indexing and index_add."""
    g = torch.Generator().manual_seed(1)
    e = torch.randint(0, 3, (11,), generator=g)
    r = moe.sort_by_expert(e[:, None], 3)
    perm = torch.argsort(e, stable=True)
    assert torch.equal(r.src_A, perm) and torch.equal(r.counts_E, torch.bincount(e, minlength=3))
    x = torch.randn(11, 4, generator=g, requires_grad=True)
    dy = torch.randn(11, 4, generator=g)
    xs = moe.expand_rows(x, r.src_A, r.inv_NK)
    xs.backward(dy)
    assert torch.equal(xs, x[perm]) and torch.equal(x.grad, torch.zeros(11, 4).index_add_(0, perm, dy))
    x.grad = None
    back = moe.reduce_rows(moe.expand_rows(x, r.src_A, r.inv_NK), r.inv_NK, r.src_A)
    back.backward(dy)
    assert torch.equal(back, x) and torch.equal(x.grad, dy)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.row_scatters = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("index_add", "index_put")) and args[0].dim() > 1 and args[0].shape[-1] > 1:
            self.row_scatters.append((func.__name__, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def test_moe_layer_scatters_no_rows_in_forward_or_backward():
    """Only the [A, 1] router weights are gathered with an index_put backward; rows of width D never are."""
    torch.manual_seed(0)
    layer = moe.MoE(8, 16, 6, 2, norm_topk_prob=True)
    layer.reset_parameters(0.1)
    x = torch.randn(2, 5, 8, requires_grad=True)
    with _Ops() as ops:
        y, stats = layer(x)
        (y.pow(2).sum() + stats.sum()).backward()
    assert ops.row_scatters == []
