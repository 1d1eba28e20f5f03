"""Expert parallelism: experts sharded over the ``ep`` mesh axis, tokens moved by all-to-all.

Plan entries (``ParallelizePlan.ep``): module pattern -> ``"experts"`` for modules with the stacked-expert
layout of :class:`titan_mm.nn.moe.GroupedExperts` (``w1``/``w3`` [E, F, D], ``w2`` [E, D, F],
``forward(x_ND, top_w_NK, top_i_NK)``). Each matched module is replaced, under the same name and with the
same parameter names, by :class:`ExpertParallelExperts`, whose weights are DTensors ``Shard(0)`` on the
``ep`` mesh (rank r of the ep group holds experts ``[r*E/ep, (r+1)*E/ep)``). FSDP then shards them further
over ``ep_fsdp`` (see mesh.py), so EP x FSDP need not equal the expert count.

Forward (dropless; every routed token reaches its expert):
  1. sort the N*K assignments by expert id; count tokens per expert;
  2. all-to-all the per-expert counts; **the split sizes are copied to the host once** (one ``.cpu()``:
     the only host-device sync of EP; the token all-to-all needs them as Python ints);
  3. all-to-all the token rows to the ranks that own their experts (autograd-aware collective);
  4. regroup the received rows from (source rank, expert) to (expert, source rank) order, on device (float8
     experts: into groups padded to 16 rows, moe.sort_by_expert's padded layout);
  5. grouped SwiGLU over the local experts (``torch._grouped_mm`` on CUDA bf16, torchao's float8 grouped GEMM with
     float8 experts, a loop elsewhere);
  6. undo 4, all-to-all back, weight by the router probabilities and sum per token (moe.combine: gathers,
     as on one rank).
A shared expert (``extra``, the family's ``MoE.shared_term``) runs between issuing 3 and reading its result, so on
NCCL it overlaps the token all-to-all (not measured yet: that needs several GPUs).

Expert weights are not split over ``tp`` (the MoE input is replicated over tp, each tp rank runs the same
expert computation, so expert gradients are already identical over tp).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_mm.nn import init
from titan_mm.nn.moe import (FLOAT8_ALIGN, add_extra, expand_rows, grouped_swiglu, reduce_rows,
                                        sort_by_expert)
from titan_mm.parallel.mesh import ParallelDims
from titan_mm.parallel.plan import ParallelizePlan, match_modules

_WEIGHTS = ("w1", "w3", "w2")


class ExpertParallelExperts(nn.Module):
    """Drop-in replacement for GroupedExperts whose experts live on the ranks of ``ep_mesh``."""

    def __init__(self, src: nn.Module, ep_mesh):
        super().__init__()
        self.num_experts = src.num_experts
        self.moves = src.moves
        self.float8 = src.float8
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size()
        if self.num_experts % self.ep:
            raise ValueError(f"ep({self.ep}) does not divide num_experts({self.num_experts}).")
        for name in _WEIGHTS:
            p = getattr(src, name)
            # every rank holds the same full tensor (or meta): take the local slice, no communication
            d = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(d, requires_grad=p.requires_grad))

    def reset_parameters(self, std: float) -> None:
        for name in _WEIGHTS:
            init.normal_(getattr(self, name), mean=0.0, std=std)

    def forward(self, x_ND: torch.Tensor, top_w_NK: torch.Tensor, top_i_NK: torch.Tensor,
                extra: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:
        E, P = self.num_experts, self.ep
        EL = E // P
        group = self.ep_mesh.get_group()
        dev = x_ND.device
        r = sort_by_expert(top_i_NK, E)
        recv_E = torch.empty_like(r.counts_E)  # recv_E[src*EL + e] = rows rank src sends to my local expert e
        dist.all_to_all_single(recv_E, r.counts_E, group=group)
        # The one host sync of EP: split sizes of the token all-to-all (Python ints).
        splits = torch.stack([r.counts_E.view(P, EL).sum(1), recv_E.view(P, EL).sum(1)]).cpu()
        in_splits, out_splits = splits[0].tolist(), splits[1].tolist()
        n_recv = sum(out_splits)

        x_recv = all_to_all_single_autograd(self.moves.expand(x_ND, r.src_A, r.inv_NK), out_splits, in_splits, group)
        # the collective is in flight until x_recv is first read: the shared expert runs meanwhile
        extra_ND = extra() if extra is not None else None
        # (src, expert) order -> (expert, src) order: a stable sort by local expert, on device from recv_E (no
        # sync); float8: in the padded layout, as on one rank
        seg = torch.repeat_interleave(torch.arange(P * EL, device=dev), recv_E, output_size=n_recv)
        lr = sort_by_expert((seg % EL)[:, None], EL, FLOAT8_ALIGN if self.float8 else 1)
        w1, w3, w2 = (_local(getattr(self, n)) for n in _WEIGHTS)
        y_local = grouped_swiglu(expand_rows(x_recv, lr.src_A, lr.inv_NK), lr.counts_E, w1, w3, w2, self.float8,
                                 self.moves.grouped_mm)
        y_recv = reduce_rows(y_local, lr.inv_NK, lr.src_A)
        y_AD = all_to_all_single_autograd(y_recv, in_splits, out_splits, group)
        return add_extra(self.moves.combine(y_AD, top_w_NK, r, x_ND.dtype), extra_ND)


def _local(w):
    return w.to_local() if isinstance(w, DTensor) else w


def apply_ep(model: nn.Module, plan: ParallelizePlan, pd: ParallelDims) -> None:
    ep_mesh = pd.mesh("ep")
    if ep_mesh is None:
        raise RuntimeError("parallel.ep > 1 needs torch.distributed; call titan_mm.parallel.mesh.init_distributed().")
    patterns = tuple(k for k, v in plan.ep.items() if v == "experts")
    bad = {k: v for k, v in plan.ep.items() if v != "experts"}
    if bad:
        raise ValueError(f"unknown EP styles {bad}; the only EP style is 'experts'.")
    if not patterns:
        raise ValueError(
            f"parallel.ep={pd.ep} but this model's plan has no ep entries (is it a MoE model?); set parallel.ep = 1."
        )
    matched = match_modules(model, patterns)
    matched = [(f, m) for f, m in matched if all(hasattr(m, w) for w in _WEIGHTS)]
    if not matched:
        raise ValueError(f"EP plan patterns {patterns} match no expert module (with w1/w3/w2) of {type(model).__name__}.")
    for fqn, mod in matched:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ExpertParallelExperts(mod, ep_mesh))
