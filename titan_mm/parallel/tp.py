"""Tensor parallelism from the plan's ``tp`` entries (module pattern -> style), over the ``tp`` mesh axis.

Styles (values of ``ParallelizePlan.tp``):

    "colwise"            nn.Linear: weight (and bias) Shard(0); input Replicate, output = local shard of the
                         features (q/k/v, gate/up). Heads are split, so attention runs on H/tp local heads.
    "rowwise"            nn.Linear: weight Shard(1); input = local features, output all-reduced to
                         Replicate (o, down).
    "embedding_rowwise"  nn.Embedding: weight Shard(0) over the vocabulary; output all-reduced (Replicate).
                         Not for tied embeddings: the output head would then need loss parallel.
    "grad_sum"           a replicated parameter that is *used on local shards* (qk-norm weights applied
                         to the local heads): its forward value is the same on every tp rank but each rank's
                         gradient is partial, so it is summed over tp in backward. The module holding the
                         parameter must be read by its parent's forward (``rms_norm(q, self.q_norm.weight)``):
                         the parent gets a pre-forward hook that swaps in a view whose backward all-reduces,
                         and a post-forward hook that puts the parameter back (FQNs and state dicts unchanged).
    "replicate"          documentation only: the module stays replicated and computes identical values and
                         gradients on every tp rank (norms, router, output head in this mode).

The residual stream between blocks is replicated over tp (no sequence parallel yet), and the loss is
computed redundantly on every tp rank with the full vocabulary (no loss parallel yet); see docs/parallel.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_mm.parallel.mesh import ParallelDims
from titan_mm.parallel.plan import ParallelizePlan, match_modules

STYLES = ("colwise", "rowwise", "embedding_rowwise", "grad_sum", "replicate")


class _SumGradOverGroup(torch.autograd.Function):
    """Identity in forward; all-reduce (sum) of the gradient over ``group`` in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _install_grad_sum(parent: nn.Module, child_name: str, group) -> None:
    stash: dict[str, Any] = {}

    def pre(mod, args):
        child = getattr(mod, child_name)
        for pname, p in list(child._parameters.items()):
            if p is None:
                continue
            stash[pname] = p
            child._parameters[pname] = _SumGradOverGroup.apply(p, group)

    def post(mod, args, out):
        child = getattr(mod, child_name)
        for pname, p in stash.items():
            child._parameters[pname] = p
        stash.clear()
        return out

    parent.register_forward_pre_hook(pre)
    parent.register_forward_hook(post)


def apply_tp(model: nn.Module, plan: ParallelizePlan, pd: ParallelDims, cfg: Any = None) -> None:
    tp_mesh = pd.mesh("tp")
    if tp_mesh is None:
        raise RuntimeError("parallel.tp > 1 needs torch.distributed; call titan_mm.parallel.mesh.init_distributed().")
    if not plan.tp:
        raise ValueError(
            f"parallel.tp={pd.tp} but this model's plan has no tp entries; add them to the family's plan.py "
            "(see docs/parallel.md) or set parallel.tp = 1."
        )
    bad = {k: v for k, v in plan.tp.items() if v not in STYLES}
    if bad:
        raise ValueError(f"unknown TP styles {bad}; known styles: {STYLES}.")
    for pattern, style in plan.tp.items():
        matched = match_modules(model, (pattern,))
        if not matched:
            raise ValueError(f"TP plan entry {pattern!r} ({style}) matches no module of {type(model).__name__}.")
        for fqn, mod in matched:
            if style == "colwise":
                _check(mod, nn.Linear, fqn, style)
                parallelize_module(mod, tp_mesh, ColwiseParallel())
            elif style == "rowwise":
                _check(mod, nn.Linear, fqn, style)
                parallelize_module(mod, tp_mesh, RowwiseParallel())
            elif style == "embedding_rowwise":
                _check(mod, nn.Embedding, fqn, style)
                parallelize_module(mod, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
            elif style == "grad_sum":
                parent_name, _, child = fqn.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                _install_grad_sum(parent, child, tp_mesh.get_group())


def _check(mod, cls, fqn, style):
    if not isinstance(mod, cls):
        raise TypeError(f"TP style {style!r} applies to {cls.__name__}, but {fqn} is a {type(mod).__name__}.")
