"""Pipeline parallelism: the split of the trunk into stages, the stage modules, and torch's schedules running them.

    layout = make_layout(cfg.parallel, n_blocks, n_micro)          # stage -> (start, stop) blocks
    builder = StageBuilder(plan, layout, pp_rank, dims)
    local_plan = builder.prune(model)                              # meta model -> this rank's stages only
    parallelize(model, local_plan, pd, cfg, fsdp_roots=builder.modules)  # one FSDP root per stage module
    builder.materialize(device); builder.init_weights(full_meta_model, device)   # the full model's draw order
    pipe = builder.pipeline(pp_group, device)                      # PipelineStage(s) + the torch schedule
    term_sums, aux_sum = pipe.run(micro_batches, denoms, aux_scale)  # one step's forward + backward

**The model keeps its parameter names.** Each rank builds the whole model on the meta device and drops what its
stages do not run: the blocks outside their ranges (deleted from the plan's ``pp_blocks`` ModuleDict, whose
other keys keep their indices), the plan's ``pp_first`` modules (embedding, vision tower) unless it runs stage 0,
and its ``pp_last`` modules (final norm, head) unless it runs the last stage. The pruned model is the rank's
``TrainState.model``: the optimizer, the grad-norm clip, DCP and export see the full model's FQNs, so a checkpoint
reshards across pipeline layouts (pp 2 -> 1 -> 2, another split) like any FSDP / TP resharding, and
``python -m titan_mm.export`` builds the full model from it. The family code knows nothing of pipelines: a stage
calls the contract's ``embed`` / ``rope`` / ``trunk(stream, rope, attn, start, stop)`` / ``head``.

**A stage module** (:class:`StageModule`, one per local stage) holds the modules the stage runs (as children, so
FSDP2 makes it the root over them and zero-bubble schedules find their parameters) and calls the pruned model's
contract methods. It is not a parent of the model: state dicts are taken from the model.

**What travels between stages** (a fixed tuple, the same for every micro-batch and step): the residual stream
``h`` [B, S_local, D]; with MoE the router statistics [2, E] summed so far (zeros before the first MoE block: the
MoE aux loss is a function of the statistics summed over all MoE blocks, so they are carried to the last stage,
whose head turns them into the aux loss, and its gradient flows back through every stage); with DeepStack the
additions still ahead (after blocks ``stop .. n_adds-1``; zeros for a text-only micro-batch); then the stream's
``cond``, the conditioning every block reads unchanged (a video diffusion transformer's text states, modulation and
time embedding: stage 0's embed computes them, every stage passes them on, their gradients flow back to stage 0).
The vision tower runs on stage 0.

**Per-micro-batch metadata** (attention metadata, positions, family inputs, the objective's loss) is built on the host
before ``schedule.step`` and kept in a table indexed by micro-batch. Each forward gets its micro-batch index as the keyword
``mb`` (a CPU tensor the schedule chunks from ``arange(n_micro)``), so a stage finds its micro-batch's metadata
without a host sync and whatever order the schedule runs them in (each torch schedule does run a stage's forwards
in order 0 .. M-1; the index makes that irrelevant). ``embed`` gets the family inputs it names; ``rope``, ``trunk``
and ``head`` those they take as keyword-only parameters (a 3-D RoPE reads ``grid_fhw``; a mixture of transformers'
layers and final norms route by a token permutation, ``expert_order`` / ``expert_inverse``).

**The loss**: the last stage runs the objective's loss on the head's hidden states (titan_mm.objectives) and sends
its terms [T]; the loss function returns ``sum_t term_t / denom_t + aux * aux_scale`` (denom_t: the term's global
count), the same normalization as without PP, so the micro-batches' losses add up to the step's loss
(``scale_grads=False``: torch does not divide again). Every output a stage sends must get a gradient back; router
statistics that the loss does not use (aux loss off) are added to it times 0.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from titan_mm.nn.attention import batch_rows
from titan_mm.nn.output import Stream
from titan_mm.parallel.plan import ParallelizePlan, match_modules
from titan_mm.parallel.pp_schedule import (SCHEDULES, SPLIT_BACKWARD, action_lists, schedule_class, stage_ids,
                                            virtual_stages)

__all__ = ["Layout", "Micro", "Pipeline", "StageBuilder", "StageModule", "balanced_split", "make_layout"]


# ----------------------------------------------------------------------------------------------- the split
@dataclass(frozen=True)
class Layout:
    """Which blocks each stage runs and where the stages sit."""

    pp: int
    schedule: str
    virtual: int
    """Stages per rank."""
    n_micro: int
    ranges: tuple[tuple[int, int], ...]
    """Per global stage: blocks start .. stop-1."""

    @property
    def n_stages(self) -> int:
        return len(self.ranges)

    def local(self, pp_rank: int) -> list[int]:
        return stage_ids(pp_rank, self.pp, self.virtual, self.schedule)

    def describe(self) -> str:
        return (f"{self.schedule}, {self.pp} ranks x {self.virtual} stage(s), {self.n_micro} micro-batches, blocks "
                + " | ".join(f"{a}-{b - 1}" if b > a else "-" for a, b in self.ranges))


def balanced_split(n_blocks: int, n_stages: int, per_block: list[float], fixed: list[float]) -> list[int]:
    """Blocks per stage minimizing the largest ``fixed[s] + n[s] * per_block[s]`` (bytes of a stage: what it
    holds besides its blocks, and what each block adds). Middle stages take at least one block, the first and
    last may take none; blocks are added one at a time where the resulting stage is smallest (optimal for
    costs linear in the block count)."""
    if n_blocks < max(0, n_stages - 2):
        raise ValueError(f"{n_stages} pipeline stages need at least {n_stages - 2} trunk blocks, the model has "
                         f"{n_blocks}; lower parallel.pp or parallel.pp_virtual_stages.")
    n = [0 if s in (0, n_stages - 1) else 1 for s in range(n_stages)]
    for _ in range(n_blocks - sum(n)):
        s = min(range(n_stages), key=lambda k: (fixed[k] + (n[k] + 1) * per_block[k], k))
        n[s] += 1
    return n


def make_layout(par, n_blocks: int, n_micro: int, balance: Callable[[int, int], list[int]] | None = None,
                fsdp: bool = False) -> Layout:
    """The layout of ``[parallel]`` (``pp``, ``pp_schedule``, ``pp_virtual_stages``, ``pp_layers_per_stage`` /
    ``pp_split_points``) for a trunk of ``n_blocks`` and ``n_micro`` micro-batches per step. ``balance(n_blocks,
    n_stages) -> blocks per stage`` gives the split when the config names none (None: as even as possible).
    ``fsdp``: the stages are FSDP2-sharded. Every mistake is a one-line ValueError."""
    schedule_class(par.pp_schedule)
    if par.pp_schedule in SPLIT_BACKWARD and torch.__version__ < "2.13":
        # torch 2.11's weight-gradient pass (autograd.grad over stage outputs) reads _input_metadata, which custom
        # autograd.Function nodes (the chunked cross-entropy) no longer expose: it raises there (2.13 runs it)
        raise ValueError(f"parallel.pp_schedule={par.pp_schedule} splits the backward, which fails in torch "
                         f"{torch.__version__} on the model's custom autograd functions; use torch >= 2.13, or "
                         "1F1B / Interleaved1F1B.")
    if fsdp and par.pp_schedule in SPLIT_BACKWARD and par.fsdp_reshard_after_forward != "never":
        # the weight-gradient pass (W) runs after FSDP2 resharded the parameters the forward used: it would find
        # none of them in the graph and leave their gradients out
        raise ValueError(f"parallel.pp_schedule={par.pp_schedule} splits the backward, which needs the gathered "
                         "parameters kept until it: set parallel.fsdp_reshard_after_forward = never.")
    v = virtual_stages(par.pp_schedule, par.pp_virtual_stages)
    n_stages = par.pp * v
    if n_micro < par.pp:
        raise ValueError(f"parallel.pp={par.pp} with {n_micro} micro-batch(es) per step leaves stages idle; set "
                         f"parallel.pp_microbatches (or training.global_batch_size) to at least {par.pp}.")
    if par.pp_layers_per_stage and par.pp_split_points:
        raise ValueError("set parallel.pp_layers_per_stage or parallel.pp_split_points, not both.")
    if par.pp_split_points:
        pts = list(par.pp_split_points)
        if len(pts) != n_stages - 1:
            raise ValueError(f"parallel.pp_split_points has {len(pts)} entries; {n_stages} stages (pp x "
                             f"pp_virtual_stages) need {n_stages - 1}.")
        bounds = [0, *pts, n_blocks]
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        what = f"parallel.pp_split_points={pts}"
    elif par.pp_layers_per_stage:
        counts = list(par.pp_layers_per_stage)
        if len(counts) != n_stages:
            raise ValueError(f"parallel.pp_layers_per_stage has {len(counts)} entries; {n_stages} stages (pp x "
                             f"pp_virtual_stages) need {n_stages}.")
        what = f"parallel.pp_layers_per_stage={counts}"
    else:
        counts = balance(n_blocks, n_stages) if balance else balanced_split(n_blocks, n_stages, [1.0] * n_stages,
                                                                            [0.0] * n_stages)
        what = "the balanced split"
    if sum(counts) != n_blocks or any(c < 0 for c in counts):
        raise ValueError(f"{what} gives {counts} blocks per stage; they must be >= 0 and sum to the model's "
                         f"{n_blocks} trunk blocks.")
    if any(c == 0 for c in counts[1:-1]):
        raise ValueError(f"{what} leaves a middle stage without blocks ({counts}); only the first and last stage "
                         "may take none.")
    action_lists(par.pp_schedule, par.pp, v, n_micro)  # the schedule's own checks (micro-batch counts)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return Layout(par.pp, par.pp_schedule, v, n_micro, tuple(zip(bounds, bounds[1:])))


# ----------------------------------------------------------------------------------------------- stages
class Micro(NamedTuple):
    """One micro-batch as the stages read it (built on the host, tensors on the device)."""

    input_ids: torch.Tensor | None
    """None for a batch without tokens (BatchSchema.tokens False: the family's embed reads its own keys)."""
    position_ids: torch.Tensor
    attn: Any
    embed_kw: dict
    """The family inputs ``embed`` takes (pixel values, vision metadata, ...)."""
    kw: dict[str, dict]
    """Per contract method (``rope``, ``trunk``, ``head``), the family inputs it takes as keyword-only parameters
    (a 3-D RoPE's ``grid_fhw``; a mixture of transformers' token permutation ``expert_order`` /
    ``expert_inverse``)."""
    loss: Callable
    """The objective's ``loss(model, out) -> {term: sum}`` for this micro-batch (Objective.bind)."""
    terms: tuple[str, ...]
    """The objective's term names, the order of the last stage's output."""


def _params_of(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _keyword_only(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


class StageModule(nn.Module):
    """One pipeline stage: ``forward(*received, mb) -> sent`` (the last stage: ``(loss terms [T], aux [1])``).

    ``parts`` are the modules the stage runs (FSDP root over them); ``model`` (the rank's pruned model, not a
    child) provides ``embed`` / ``rope`` / ``trunk`` / ``head``."""

    def __init__(self, model: nn.Module, parts: list[nn.Module], stage: int, n_stages: int, start: int, stop: int,
                 book: list, n_adds: int, n_experts: int):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        object.__setattr__(self, "_model", model)  # not a submodule: the model's own FQNs stay the checkpoint's
        self.stage, self.start, self.stop = stage, start, stop
        self.first, self.last = stage == 0, stage == n_stages - 1
        self._book, self.n_adds, self.n_experts = book, n_adds, n_experts

    def _unpack(self, received: tuple[torch.Tensor, ...]) -> Stream:
        h, rest = received[0], received[1:]
        stats = None
        if self.n_experts:
            stats, rest = rest[0], rest[1:]
        # adds after blocks start .. n_adds-1 arrive; the trunk indexes adds by block, earlier ones are never read
        n = max(0, self.n_adds - self.start)
        adds = (None,) * self.start + tuple(rest[:n]) if n else ()
        return Stream(h, stats, adds, tuple(rest[n:]))

    def _pack(self, stream: Stream) -> tuple[torch.Tensor, ...]:
        out = [stream.h]
        if self.n_experts:
            st = stream.moe_stats
            out.append(st if st is not None else torch.zeros(2, self.n_experts, dtype=torch.float32,
                                                             device=stream.h.device))
        for i in range(self.stop, self.n_adds):  # the additions later stages still need (zeros: no image)
            a = stream.adds[i] if i < len(stream.adds) else None
            out.append(a if a is not None else torch.zeros_like(stream.h))
        return tuple(out) + stream.cond

    def forward(self, *received: torch.Tensor, mb: torch.Tensor):
        b: Micro = self._book[int(mb[0])]  # a CPU tensor: no device sync
        m = self._model
        stream = m.embed(b.input_ids, **b.embed_kw) if self.first else self._unpack(received)
        rope = m.rope(b.position_ids, stream.h.dtype, **b.kw["rope"])
        stream = m.trunk(stream, rope, b.attn, self.start, self.stop, **b.kw["trunk"])
        if not self.last:
            return self._pack(stream)
        out = m.head(stream, b.attn, hidden=True, **b.kw["head"])
        terms = b.loss(m, out)
        aux = out.aux_loss.float()
        if stream.moe_stats is not None and not aux.requires_grad and stream.moe_stats.requires_grad:
            aux = aux + 0.0 * stream.moe_stats.sum()  # the sent statistics must get a gradient back (exact zeros)
        return torch.stack([terms[t].float() for t in b.terms]), torch.stack((aux,))  # [T] and [1], not views


class StageBuilder:
    """This rank's part of the pipeline: prunes the model (built on meta) to the stages of ``pp_rank``, builds their
    modules and, once the model is parallelized and materialized, the schedule."""

    def __init__(self, plan: ParallelizePlan, layout: Layout, pp_rank: int, dims):
        if not plan.pp_blocks:
            raise ValueError("parallel.pp > 1 but the model's plan names no pp_blocks (the trunk's block container); "
                             "this family cannot be pipelined: set parallel.pp = 1.")
        if dims.tie_word_embeddings:
            raise ValueError("parallel.pp > 1 with tied input / output embeddings (tie_word_embeddings): the first "
                             "and the last stage would share the weight; use pp = 1 for this model.")
        if layout.ranges[-1][1] != dims.num_layers:
            raise ValueError(f"the pipeline layout covers {layout.ranges[-1][1]} blocks, the model has "
                             f"{dims.num_layers}.")
        self.plan, self.layout, self.pp_rank = plan, layout, pp_rank
        self.n_adds = dims.vision.deepstack_layers if dims.vision is not None else 0
        self.n_experts = dims.num_experts
        self.stages = layout.local(pp_rank)
        self.first = 0 in self.stages
        self.last = layout.n_stages - 1 in self.stages
        self.model: nn.Module | None = None
        self.book: list[Micro] = []
        self._modules: list[StageModule] | None = None

    def prune(self, model: nn.Module) -> ParallelizePlan:
        """Drop, in place, what this rank's stages do not run (module docstring). Returns the plan for what is left:
        entries that named only dropped modules are left out (an entry that matched nothing before still fails in
        parallelize), and loss parallel only on the last stage."""
        plan = self.plan
        fields = ("fsdp_units", "ac_units", "compile_units", "tp", "sequence_parallel", "encoder_tp", "ep", "cp")
        before = {f: {p: bool(match_modules(model, (p,))) for p in getattr(plan, f)} for f in fields}
        blocks = model.get_submodule(plan.pp_blocks)
        if sorted(blocks.keys(), key=int) != [str(i) for i in range(len(blocks))]:
            raise ValueError(f"plan.pp_blocks={plan.pp_blocks!r} must be a ModuleDict keyed 0 .. n-1.")
        self.model = model
        self._check_coverage()
        keep = {i for s in self.stages for i in range(*self.layout.ranges[s])}
        for k in list(blocks.keys()):
            if int(k) not in keep:
                del blocks[k]
        for fqn in (() if self.first else plan.pp_first) + (() if self.last else plan.pp_last):
            parent, _, name = fqn.rpartition(".")
            delattr(model.get_submodule(parent) if parent else model, name)

        def keep(f):
            entries = getattr(plan, f)
            left = [p for p in entries if not before[f][p] or match_modules(model, (p,))]
            return {p: entries[p] for p in left} if isinstance(entries, dict) else tuple(left)

        lp = plan.loss_parallel if self.last else None
        return dataclasses.replace(plan, loss_parallel=lp, **{f: keep(f) for f in fields})

    def _check_coverage(self) -> None:
        owners = (self.plan.pp_blocks,) + self.plan.pp_first + self.plan.pp_last
        for name, _ in self.model.named_parameters():
            if not any(name.startswith(o + ".") for o in owners):
                raise ValueError(f"parameter {name!r} belongs to no pipeline part: the plan's pp_blocks / pp_first / "
                                 "pp_last must cover every parameter.")

    def kept(self) -> list[str]:
        """FQNs of the modules this rank kept (its blocks, and the first / last stage's parts)."""
        out = [f"{self.plan.pp_blocks}.{i}" for s in self.stages for i in range(*self.layout.ranges[s])]
        return (list(self.plan.pp_first) if self.first else []) + out + (list(self.plan.pp_last) if self.last else [])

    def modules(self, model: nn.Module | None = None) -> list[StageModule]:
        """The stage modules of this rank (built once, after AC / compile wrapped the blocks: parallelize's
        ``fsdp_roots``)."""
        if self._modules is None:
            m = self.model
            blocks = m.get_submodule(self.plan.pp_blocks)
            out = []
            for s in self.stages:
                start, stop = self.layout.ranges[s]
                parts = [m.get_submodule(f) for f in self.plan.pp_first] if s == 0 else []
                parts += [blocks[str(i)] for i in range(start, stop)]
                if s == self.layout.n_stages - 1:
                    parts += [m.get_submodule(f) for f in self.plan.pp_last]
                out.append(StageModule(m, parts, s, self.layout.n_stages, start, stop, self.book, self.n_adds,
                                       self.n_experts))
            self._modules = out
        return self._modules

    def materialize(self, device: torch.device) -> None:
        """``to_empty`` through every stage module (FSDP2 re-registers its sharded parameters there), then the
        model's own buffers still on meta."""
        for w in self.modules():
            w.to_empty(device=device)
        self.model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)

    def init_weights(self, full_meta: nn.Module, device: torch.device) -> None:
        """``init_weights`` in the full model's draw order, so that titan_mm.nn.init.seeded_init gives
        every pipeline layout the weights of pp = 1: this rank's modules are put into ``full_meta`` (the whole
        model on meta) in place of theirs, the draws of the others land on meta (counted, not filled)."""
        for fqn in self.kept():
            parent, _, name = fqn.rpartition(".")
            setattr(full_meta.get_submodule(parent) if parent else full_meta, name, self.model.get_submodule(fqn))
        full_meta.init_weights(buffer_device=device)
        self.model.init_buffers(device)

    def pipeline(self, pp_group, device: torch.device) -> "Pipeline":
        mods = self.modules()
        stages = [PipelineStage(w, w.stage, self.layout.n_stages, device, group=pp_group) for w in mods]
        return Pipeline(self.layout, mods, stages, self.book, pp_group, device)


class Pipeline:
    """One rank's stages and the torch schedule that runs them."""

    def __init__(self, layout: Layout, modules: list[StageModule], stages: list, book: list, pp_group,
                 device: torch.device):
        self.layout, self.modules, self.stages, self.book = layout, modules, stages, book
        self.pp_group, self.device = pp_group, device
        self.is_last = any(w.last for w in modules)
        cls = schedule_class(layout.schedule)
        arg = stages[0] if SCHEDULES[layout.schedule] == "single" else stages
        self.schedule = cls(arg, n_microbatches=layout.n_micro, loss_fn=self._loss, scale_grads=False)
        self._step: dict[str, Any] = {}
        model = modules[0]._model
        self._embed_keys = _params_of(model.embed) - {"input_ids"}
        self._kw_keys = {f: _keyword_only(getattr(model, f)) for f in ("rope", "trunk", "head")}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
        self._forward_keys = None if takes_any else _params_of(model.forward)  # None: a **kwargs forward takes any

    def micro(self, b: dict, attn, inputs: dict, loss: Callable, terms: tuple[str, ...]) -> Micro:
        """A device batch, its attention metadata, the family inputs of its forward (``inputs``) and the objective's
        ``loss`` / ``terms`` as the stages read them; an input the model's forward does not take raises as the
        forward would."""
        unknown = sorted(set(inputs) - self._forward_keys) if self._forward_keys is not None else []
        if unknown:
            raise TypeError(f"the model's forward takes no input {unknown[0]!r} (batch keys {sorted(b)})")
        pos = b.get("position_ids")
        if pos is None:
            B, S = batch_rows(b)
            pos = torch.arange(S, device=self.device)[None].expand(B, S)
        return Micro(b.get("input_ids"), pos, attn, {k: v for k, v in inputs.items() if k in self._embed_keys},
                     {f: {k: v for k, v in inputs.items() if k in keys} for f, keys in self._kw_keys.items()}, loss,
                     terms)

    def _loss(self, out, target):
        terms, aux = out
        st = self._step
        # keyed by micro-batch: torch 2.13's first-step metadata inference calls the loss once more, on micro-batch
        # 0's target and placeholder activations, before micro-batch 0 runs (the real call overwrites it)
        st["sums"][int(target[0])] = torch.cat([terms.detach(), aux.detach()])
        loss = terms[0] / st["denoms"][0]
        for i in range(1, len(st["denoms"])):
            loss = loss + terms[i] / st["denoms"][i]
        loss = loss + aux[0] * st["aux_scale"]
        if st["nan"]:
            loss = loss * float("nan")
        return loss if st["scale"] is None else loss * st["scale"]

    def run(self, micros: list[Micro], denoms: list[float], aux_scale: float, scale: torch.Tensor | None = None,
            inject_nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one step's micro-batches through the schedule; gradients accumulate in the
        parameters. ``denoms``: each loss term's global count. Returns (the loss terms' sums [T], the sum of aux)
        over the micro-batches, the same on every pp rank."""
        return self._schedule(micros, self.schedule.step, denoms, aux_scale, scale, inject_nan)

    def eval(self, micros: list[Micro]) -> torch.Tensor:
        """Forward only (the schedule's eval: no backward actions), under no_grad: the loss terms' sums [T] over
        the micro-batches, the same on every pp rank."""
        with torch.no_grad():
            return self._schedule(micros, self.schedule.eval, [1.0] * len(micros[0].terms), 0.0, None, False)[0]

    def gather_state_dict(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every pp rank, from each rank's own (``sd``: its stages, full tensors):
        each tensor is broadcast by the one pp rank that holds it (the plan gives every parameter one owner)."""
        me, n = dist.get_rank(self.pp_group), dist.get_world_size(self.pp_group)
        held: list[dict] = [{} for _ in range(n)]
        dist.all_gather_object(held, {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, group=self.pp_group)
        comm = self.device if dist.get_backend(self.pp_group) == "nccl" else torch.device("cpu")
        out = {}
        for k in sorted({k for h in held for k in h}):
            owner = next(r for r in range(n) if k in held[r])
            shape, dtype = held[owner][k]
            t = sd[k].to(comm) if owner == me else torch.empty(shape, dtype=dtype, device=comm)
            dist.broadcast(t, src=dist.get_global_rank(self.pp_group, owner), group=self.pp_group)
            out[k] = t.to(self.device)
        return out

    def _schedule(self, micros: list[Micro], call, denoms: list[float], aux_scale: float, scale: torch.Tensor | None,
                  inject_nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if len(micros) != self.layout.n_micro:
            raise ValueError(f"the pipeline runs {self.layout.n_micro} micro-batches per step, got {len(micros)}.")
        self.book[:] = micros
        self._step = {"sums": {}, "denoms": denoms, "aux_scale": aux_scale, "scale": scale, "nan": inject_nan}
        idx = torch.arange(len(micros))
        try:
            call(target=idx, mb=idx)
        finally:
            self.book.clear()
        sums = (torch.stack(list(self._step["sums"].values())).sum(0) if self.is_last
                else torch.zeros(len(denoms) + 1, device=self.device))
        if self._step["nan"]:
            sums = sums * float("nan")
        comm = self.device if dist.get_backend(self.pp_group) == "nccl" else torch.device("cpu")
        sums = sums.to(comm, torch.float32)
        dist.all_reduce(sums, group=self.pp_group)  # only the last stage has them: a sum is a broadcast
        return sums[:-1].to(self.device), sums[-1].to(self.device)
