"""Global gradient-norm clipping that is correct over every mesh axis.

Gradients can be plain tensors (world 1, or params no plan touched: identical on every rank) or DTensors
on *different* meshes (dense params on the fsdp x tp mesh, experts on the ep_fsdp x ep mesh).
``torch.nn.utils.clip_grad_norm_`` cannot stack norms from different meshes, so we group gradients by
(mesh, placements), let DTensor compute each group's norm (it reduces over the Shard / Partial axes and
not over Replicate ones), materialise each group's norm with one all-reduce, and combine the groups on
the host side of the graph (still tensors: no host sync).

Pipeline parallelism (``pp_group``): each pp rank holds other parameters (its stages'), so the per-rank norms'
``p``-th powers are summed over the pp ranks (max for the inf-norm); the result is the norm of the whole model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_coef", "clip_grad_norm_", "total_grad_norm"]


@torch.no_grad()
def total_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0, foreach: bool | None = None,
                    pp_group=None) -> torch.Tensor:
    """The norm of all ``grads`` taken together, as a plain (replicated) fp32 tensor; ``pp_group``: also over the
    pipeline stages (each rank's ``grads`` are its stages' parameters)."""
    norm_type = float(norm_type)
    if pp_group is not None:
        return _over_pp(total_grad_norm(grads, norm_type, foreach), norm_type, pp_group, grads)
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor):
            key = (g.device_mesh, tuple(g.placements))
        else:  # narrow ones (the cast path's kept gradients) apart: their norms are taken in fp32
            key = ("local", g.device, g.dtype.itemsize < 4)
        groups[key].append(g)
    if not groups:
        return torch.zeros((), dtype=torch.float32)
    parts = []
    for key, gs in groups.items():
        if key[0] == "local" and key[2]:
            parts.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32)),
                                                  norm_type))
            continue
        n = torch.nn.utils.get_total_norm(gs, norm_type=norm_type, error_if_nonfinite=False, foreach=foreach)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        parts.append(n.float())
    device = parts[0].device
    parts = [p.to(device) for p in parts]
    if math.isinf(norm_type):
        return torch.stack(parts).max()
    return torch.stack(parts).pow(norm_type).sum().pow(1.0 / norm_type)


def _over_pp(local: torch.Tensor, norm_type: float, group, grads: list[torch.Tensor]) -> torch.Tensor:
    dev = next((g.device for g in grads), local.device)
    comm = dev if dist.get_backend(group) == "nccl" else torch.device("cpu")
    if math.isinf(norm_type):
        t = local.to(comm).reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t[0].to(local.device)
    t = local.to(comm).pow(norm_type).reshape(1)
    dist.all_reduce(t, group=group)
    return t[0].pow(1.0 / norm_type).to(local.device)


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings gradients of norm ``total`` to at most ``max_norm`` (1 when they are under it)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter] | torch.nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_group=None,
    scale: bool = True,
    grads_of: Callable[[Iterable[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before clipping.

    ``max_norm <= 0`` only measures. Non-finite norms are returned as they are (the caller's NaN policy
    decides); the gradients are then scaled by NaN too, which a skipped step discards. ``pp_group``: the norm
    covers the pipeline stages of the other pp ranks too (parallel.pp > 1). ``scale=False``: only measure; the
    caller applies :func:`clip_coef` itself (the train step folds it into fused AdamW's kernel). ``grads_of``:
    where the gradients of ``params`` are, when not all in ``.grad`` (titan_mm.parallel.apply.CastCopies.grads_of).
    """
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    grads = [p.grad for p in params if p.grad is not None] if grads_of is None else grads_of(params)
    total = total_grad_norm(grads, norm_type, foreach, pp_group)
    if scale and max_norm > 0 and grads:
        coef = clip_coef(total, max_norm)
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            local = g._local_tensor if isinstance(g, DTensor) else g
            by_device[local.device].append(local)
        for dev, ts in by_device.items():
            torch._foreach_mul_(ts, coef.to(dev))
    return total
