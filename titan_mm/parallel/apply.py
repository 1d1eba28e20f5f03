"""Apply a :class:`~titan_mm.parallel.plan.ParallelizePlan` to a model, in one fixed order.

    float8 (module swap, titan_mm.quant; CUDA only) -> TP / EP -> CP -> AC -> torch.compile -> FSDP2 (units, then root)

A one-process job computing below fp32 skips FSDP2 by default (``parallel.one_rank_mixed_precision = cast``): its
all-gather and reduce-scatter would be copies there, so :func:`apply_param_cast` makes the compute copies itself
(``optimizer``: it keeps them between steps and titan_mm.train.cast_adamw's step writes them, :class:`CastCopies`).

Every step reads only the plan (module-FQN patterns) and the job config; nothing here knows a model family.

Gradient reduction contract (read this if you write a train step): the step divides ``loss_sum`` by the
number of label tokens of the *global* batch, so each rank's loss is already its share of the global mean.
Data-parallel gradients must therefore be **summed**, not averaged: FSDP2 is set to a divide factor of 1
with SUM-only collectives (``set_gradient_divide_factor(1.0)`` + ``set_force_sum_reduction_for_comms``).
That is also what makes FSDP2 work on gloo, which has neither ``PREMUL_SUM`` nor ``AVG``. On a one-rank mesh FSDP2
keeps its defaults (it reduces nothing there).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_mm.config import JobConfig
from titan_mm.dtypes import torch_dtype
from titan_mm.kernels import accumulate, upcast
from titan_mm.parallel.cp import apply_cp
from titan_mm.parallel.ep import apply_ep
from titan_mm.parallel.mesh import ParallelDims
from titan_mm.parallel.plan import ParallelizePlan, match_modules
from titan_mm.parallel.tp import apply_tp
from titan_mm.quant.float8 import apply_float8

logger = logging.getLogger(__name__)

__all__ = ["parallelize", "one_rank_cast", "apply_ac", "apply_compile", "apply_fsdp", "apply_param_cast", "CastCopies",
           "cast_copies"]


def parallelize(model: nn.Module, plan: ParallelizePlan, parallel_dims: ParallelDims, cfg: JobConfig,
                fsdp_roots: Callable[[nn.Module], list[nn.Module]] | None = None) -> nn.Module:
    """Shard, checkpoint, compile and wrap ``model`` as ``plan`` and ``cfg`` say; returns the same module.

    ``fsdp_roots(model)``: the modules fully_shard-ed last, as the FSDP roots, instead of ``model`` (pipeline
    stages: one root per stage, called after AC / compile so that it sees the final blocks; the model itself
    then stays a plain container; titan_mm/parallel/pipeline.py).

    ``model`` may live on the meta device (the trainer builds it there and materialises after this call).
    ``cfg`` is the job's :class:`titan_mm.config.JobConfig` (``JobConfig()`` for the defaults: fp32, no AC /
    compile / float8). Its typed sections ``training``, ``parallel``, ``activation_checkpoint``, ``compile`` and
    ``float8`` are read here (TP and CP get the ``parallel`` section, float8 its own), so their defaults are the
    config's.
    """
    if not isinstance(cfg, JobConfig):
        raise TypeError(f"parallelize needs the titan_mm.config.JobConfig (JobConfig() for the defaults), "
                        f"got {type(cfg).__name__}.")
    pd = parallel_dims
    on_cuda = torch.cuda.is_available() and cfg.parallel.backend != "gloo"
    param_dtype = torch_dtype(cfg.training.param_dtype)
    if not on_cuda and param_dtype != torch.float32:
        # float16 keeps its loss scaler (titan_mm.train.step.LossScaler): the CPU runs the same scaling path
        logger.warning("training.param_dtype=%s on CPU: computing in float32 instead (bf16 / fp16 matmuls on CPU "
                       "are slow and the CPU tests compare against fp32).", param_dtype)
        param_dtype = torch.float32
    cast = one_rank_cast(pd.world_size, cfg, param_dtype, pipelined=fsdp_roots is not None)

    if cfg.float8.enable:
        apply_float8(model, cfg.float8, on_cuda=on_cuda, fsdp=not cast)

    if pd.tp_enabled:
        apply_tp(model, plan, pd, cfg.parallel)
    if pd.ep_enabled:
        apply_ep(model, plan, pd)
    if pd.cp_enabled:
        apply_cp(model, plan, pd, cfg.parallel)

    # no units at all (a pipeline rank whose stages run no block: titan_mm.parallel.pipeline) is nothing to do
    ac = cfg.activation_checkpoint
    if ac.mode != "none" and plan.ac_units:
        apply_ac(model, plan.ac_units, ac.mode, ac.selective_option, ac.num_layers)

    if cfg.compile.enable and plan.compile_units:
        apply_compile(model, plan.compile_units, fullgraph=cfg.compile.fullgraph)

    if cast:
        apply_param_cast(model, param_dtype, keep=cfg.parallel.one_rank_mixed_precision == "optimizer")
    elif pd.build_meshes():  # a process group exists (always for world > 1)
        reduce_dtype = torch_dtype(cfg.training.reduce_dtype)
        if pd.fsdp_enabled or param_dtype != torch.float32 or pd.ep_enabled:
            apply_fsdp(model, plan, pd, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward,
                       roots=fsdp_roots(model) if fsdp_roots is not None else None,
                       prefetch=cfg.parallel.fsdp_prefetch)
    return model


# ----------------------------------------------------------------------------------------------- AC
# Ops whose outputs selective ("op") AC keeps; everything else in a unit is recomputed in backward.
def _sac_save_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.linear.default}
    for name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_mm", "_grouped_mm"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None:  # never recompute communication
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "all_reduce"):
            if hasattr(c10d, name):
                ops.add(getattr(c10d, name).default)
    return ops


def apply_ac(model: nn.Module, units: tuple[str, ...], mode: str, selective_option: str = "op",
             num_layers: int = 0) -> None:
    """Wrap each AC unit: ``full`` recomputes the whole unit; ``selective`` = ``op`` (keep matmul/attention/
    collective outputs, recompute the rest) or an integer N (full AC on every N-th unit). ``num_layers`` > 0:
    only the first that many units (in model order) are candidates."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.mode must be none, full or selective, got {mode!r}.")
    targets = _top_level(match_modules(model, units))
    if not targets:
        raise ValueError(f"activation checkpointing is on but no module matches the plan's ac_units {units}.")
    if num_layers < 0:
        raise ValueError(f"activation_checkpoint.num_layers must be >= 0 (0 = every unit), got {num_layers}.")
    if num_layers:
        targets = targets[:num_layers]
    every = None
    context_fn = None
    if mode == "selective":
        if selective_option == "op":
            save = _sac_save_ops()

            def policy(ctx, op, *args, **kwargs):
                return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

            def context_fn():  # noqa: F811
                return create_selective_checkpoint_contexts(policy)
        elif selective_option.isdigit() and int(selective_option) >= 1:
            every = int(selective_option)
        else:
            raise ValueError(
                f"activation_checkpoint.selective_option must be 'op' or a positive integer N, got {selective_option!r}."
            )
    for i, (fqn, mod) in enumerate(targets):
        if every is not None and i % every:
            continue
        kw = {"preserve_rng_state": False}  # checkpoint_wrapper defaults to the non-reentrant implementation
        if context_fn is not None:
            kw["context_fn"] = context_fn
        _replace(model, fqn, checkpoint_wrapper(mod, **kw))


# ----------------------------------------------------------------------------------------------- compile
def apply_compile(model: nn.Module, units: tuple[str, ...], fullgraph: bool = False) -> None:
    """``Module.compile()`` each compile unit in place (FQNs, state-dict keys and FSDP hooks stay as they are)."""
    targets = _top_level(match_modules(model, units))
    if not targets:
        raise ValueError(f"compile.enable is on but no module matches the plan's compile_units {units}.")
    for _, mod in targets:
        mod.compile(fullgraph=fullgraph)


# ----------------------------------------------------------------------------------------------- FSDP2
def _sum_reduction(mod, mesh) -> None:
    """Sum DP gradients (divide factor 1, SUM-only collectives); see the module docstring. A one-rank mesh keeps
    FSDP2's defaults: it reduces nothing then, and a set factor makes it divide every gradient by it (one fp32 pass
    over each unit's gradients a step: 6.7 ms of a Qwen3-8B 12-layer step on the H200)."""
    if mesh.size() == 1:
        return
    if hasattr(mod, "set_gradient_divide_factor"):
        mod.set_gradient_divide_factor(1.0)
    else:  # older torch
        mod.set_reduce_scatter_divide_factor(1.0)
    if hasattr(mod, "set_force_sum_reduction_for_comms"):
        mod.set_force_sum_reduction_for_comms(True)


def apply_fsdp(
    model: nn.Module,
    plan: ParallelizePlan,
    pd: ParallelDims,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "always",
    roots: list[nn.Module] | None = None,
    prefetch: int = 0,
) -> None:
    """fully_shard the plan's expert modules (on the ep_fsdp mesh), then its FSDP units, then the root (``roots``:
    these modules, each one a root, instead of ``model``: pipeline stages).

    ``prefetch`` (``parallel.fsdp_prefetch``) > 0: each unit explicitly prefetches the next that many units' all-gathers
    in its forward and the previous ones' in its backward (units in model order); 0 leaves FSDP2's own overlap.

    ``reshard_after_forward`` (``parallel.fsdp_reshard_after_forward``): "always" frees every module's gathered
    params after its forward and gathers them again for its backward; "never" keeps them from the forward
    through the backward (no backward all-gather; one unsharded copy of the weights more at the peak).
    """
    if reshard_after_forward not in ("always", "never"):
        raise ValueError(f"parallel.fsdp_reshard_after_forward={reshard_after_forward!r}: expected always or never.")
    reshard = reshard_after_forward == "always"
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    mesh = pd.fsdp_mesh()
    wrapped = []  # (module, its mesh)
    if pd.ep_enabled:
        ep_mesh = pd.ep_fsdp_mesh()
        experts = _top_level(match_modules(model, tuple(k for k, v in plan.ep.items() if v == "experts")))
        for _, mod in experts:
            wrapped.append((fully_shard(mod, mesh=ep_mesh, mp_policy=mp, reshard_after_forward=reshard), ep_mesh))
    units = _top_level(match_modules(model, plan.fsdp_units))
    for _, mod in units + [("", r) for r in (roots or [model])]:
        wrapped.append((fully_shard(mod, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard), mesh))
    for mod, m in {id(mod): (mod, m) for mod, m in wrapped}.values():
        _sum_reduction(mod, m)
    if prefetch:  # config-checked: >= 0, and 0 with pipeline stages
        blocks = [mod for _, mod in units]
        for i, mod in enumerate(blocks):
            if blocks[i + 1:i + 1 + prefetch]:
                mod.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            if blocks[max(0, i - prefetch):i]:
                mod.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])


# ----------------------------------------------------------------------------------------------- one-rank cast
def one_rank_cast(world_size: int, cfg: JobConfig, param_dtype: torch.dtype, pipelined: bool = False) -> bool:
    """Whether :func:`parallelize` makes the compute copies with :func:`apply_param_cast` instead of FSDP2: one
    process, no pipeline stages, params computed below fp32 and ``parallel.one_rank_mixed_precision`` cast or
    optimizer."""
    return (world_size == 1 and not pipelined and param_dtype != torch.float32
            and cfg.parallel.one_rank_mixed_precision in ("cast", "optimizer"))


_GROUP_ELEMS = 1 << 24
"""Elements of one cast group at most (32 MB of bf16 gradients held until the group's last one arrives); a larger
parameter is a group of its own."""
_UPCAST_ELEMS = 1 << 20
"""Elements from which a gradient is widened by titan_mm.kernels.upcast (a vectorized Triton copy); below it one
launch costs more host time than the copy takes, and the group's smaller ones share one ``_foreach_copy_``."""


class CastCopies:
    """What the cast path keeps between steps with ``parallel.one_rank_mixed_precision = optimizer``: every
    parameter's compute copy, reused by the next forward while the parameter is unchanged (``p._version``: an
    in-place torch op, a checkpoint or weight load bump it, and the forward casts afresh; a write that leaves the
    version alone, such as torch's fused AdamW kernel, must :meth:`drop` the copy), and the gradients of
    the large trainable parameters (at least ``_UPCAST_ELEMS`` elements) in the compute dtype instead of the fp32
    ``.grad``. titan_mm.train.cast_adamw's step reads those gradients and writes the parameter and its copy in one
    pass: the backward's widening copy and the next forward's cast are gone (9.3 ms of a 156.5 ms Qwen3-30B-A3B
    4-layer step on the H200). A gradient summed over micro-batches is held in fp32, as ``.grad`` would be."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(p) -> (p, copy, p's version)
        self._grads: dict[int, torch.Tensor] = {}

    @staticmethod
    def narrow(p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient stays in the compute dtype (the others go to ``.grad`` as with cast)."""
        return p.requires_grad and p.numel() >= _UPCAST_ELEMS

    def copy_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s kept copy, if ``p`` has not changed since it was made."""
        kept = self._copies.get(id(p))
        return kept[1] if kept is not None and kept[0] is p and kept[2] == p._version else None

    def keep(self, p: torch.Tensor, copy: torch.Tensor) -> None:
        """``copy`` is ``p`` in the compute dtype now (the optimizer calls this after writing both)."""
        self._copies[id(p)] = (p, copy, p._version)

    def drop(self, p: torch.Tensor) -> None:
        """``p`` changed: the next forward casts it afresh."""
        self._copies.pop(id(p), None)

    def add_grad(self, p: torch.Tensor, g: torch.Tensor) -> None:
        held = self._grads.get(id(p))
        if held is None:
            self._grads[id(p)] = g if g.stride() == p.stride() else g.contiguous()  # the update is elementwise
        else:  # summed in p's dtype, in place from the third micro-batch on
            self._grads[id(p)] = accumulate(held, g, p.dtype)

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient held here (None: it has none, or it is in ``p.grad``)."""
        return self._grads.get(id(p))

    def grads_of(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Every gradient of ``params``, from ``.grad`` or from here (the clip's norm reads them)."""
        grads = (p.grad if p.grad is not None else self._grads.get(id(p)) for p in params)
        return [g for g in grads if g is not None]

    def clear_grads(self) -> None:
        self._grads.clear()


_COPIES: "weakref.WeakKeyDictionary[nn.Module, CastCopies]" = weakref.WeakKeyDictionary()


def cast_copies(model: nn.Module) -> CastCopies | None:
    """The :class:`CastCopies` of a model :func:`apply_param_cast` made with ``keep=True`` (the optimizer and the
    clip read its gradients), else None."""
    return _COPIES.get(model)


class _Cast(torch.autograd.Function):
    """``[p.to(dtype) for p in ps]`` as one autograd node: the host records one node per group of parameters, not
    one per parameter (625 in Qwen3-VL-2B; bench/cast_host.py). The backward widens the gradients back to
    the parameters' dtype: the large ones with titan_mm.kernels.upcast (torch's bf16 -> fp32 copy is not vectorized:
    11.7 ms a step at Qwen3-8B 12 layers on the H200, against 5 ms for the forward cast), the rest with one
    ``_foreach_copy_``. A copy the forward did not use gets no gradient. With ``kept`` (:class:`CastCopies`) a
    parameter's unchanged copy is reused instead of cast, and a narrow gradient is handed to ``kept``."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, kept: CastCopies | None, *ps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.master_dtypes = [p.dtype for p in ps]
        ctx.kept, ctx.ps = kept, (ps if kept is not None else None)
        reused = [None if kept is None else kept.copy_of(p) for p in ps]
        outs = [torch.empty_like(p, dtype=dtype) if c is None else c.detach() for p, c in zip(ps, reused)]
        fresh = [i for i, c in enumerate(reused) if c is None]
        if fresh:
            torch._foreach_copy_([outs[i] for i in fresh], [ps[i] for i in fresh])
        if kept is not None:
            for i in fresh:
                kept.keep(ps[i], outs[i].detach())
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs: torch.Tensor | None):
        out: list[torch.Tensor | None] = [None] * len(gs)
        gs = list(gs)
        if ctx.kept is not None:
            for i, g in enumerate(gs):
                if g is not None and ctx.kept.narrow(ctx.ps[i]):
                    ctx.kept.add_grad(ctx.ps[i], g)
                    gs[i] = None  # it stays narrow, in ctx.kept: no .grad
        small = [i for i, g in enumerate(gs) if g is not None and g.numel() < _UPCAST_ELEMS]
        for i, g in enumerate(gs):
            if g is not None and g.numel() >= _UPCAST_ELEMS:
                out[i] = upcast(g, ctx.master_dtypes[i])
        if small:
            wide = [torch.empty_like(gs[i], dtype=ctx.master_dtypes[i]) for i in small]
            torch._foreach_copy_(wide, [gs[i] for i in small])
            for i, w in zip(small, wide):
                out[i] = w
        return (None, None, *out)


def _cast_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The parameter slots of ``model`` in the groups its casts are made in: by block (the slots under one
    ModuleList entry, "layers.3" or "visual.blocks.7"; any other module's slots are its own block), in order, cut
    where a group would pass ``_GROUP_ELEMS``. A group's node runs when its last gradient arrives, so it holds that
    many narrow gradients at most. Sizes are read here, once: they are shapes, which materialising a meta model
    keeps."""
    blocks: dict[str, list[tuple[nn.Module, str, int]]] = {}
    for fqn, mod in model.named_modules():
        parts = fqn.split(".")
        cut = next((i + 1 for i, part in enumerate(parts) if part.isdigit()), len(parts))
        for name, p in mod._parameters.items():
            blocks.setdefault(".".join(parts[:cut]), []).append((mod, name, 0 if p is None else p.numel()))
    groups: list[list[tuple[nn.Module, str]]] = []
    for slots in blocks.values():
        size = _GROUP_ELEMS  # start a new group at the block's first slot
        for mod, name, n in slots:
            if size + n > _GROUP_ELEMS:
                groups.append([])
                size = 0
            groups[-1].append((mod, name))
            size += n
    return groups


def apply_param_cast(model: nn.Module, dtype: torch.dtype, keep: bool = False) -> None:
    """Compute ``model`` in ``dtype`` over its fp32 parameters, FSDP2's mixed precision without FSDP2: before each
    forward every floating parameter is cast once (a tied one once for all its modules) inside the autograd graph
    and put in its modules' place; after the forward the fp32 parameters are back. The backward of each cast
    adds the gradient, in fp32, to the fp32 ``.grad`` (accumulated over micro-batches in fp32, as FSDP2's
    reduce-scatter output is), so optimizer, clipping, checkpoints and exports see fp32 parameters only. The
    copies stay alive until the backward has used them, as FSDP2's with reshard_after_forward=False. The casts
    of a group of parameters are one autograd node (_Cast; the groups of _cast_groups, split by whether they train).
    ``keep``: the copies and the large gradients are kept in a :class:`CastCopies` (:func:`cast_copies`), for
    titan_mm.train.cast_adamw.

    The modules are fixed here (call it after activation checkpointing, as parallelize does); the parameters are
    read at each forward: materialising a meta model or loading weights may replace them."""

    def slots_of(root: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(mod, name) for mod in root.modules() for name in mod._parameters]

    groups = _cast_groups(model)
    kept = CastCopies() if keep else None
    if kept is not None:
        _COPIES[model] = kept
    masters: list[tuple[nn.Module, str, nn.Parameter]] = []  # the swapped-out slots of the running forward

    def swap_in(module, args):
        copies: dict[int, torch.Tensor | None] = {}
        for group in groups:
            fresh: dict[bool, list[nn.Parameter]] = {True: [], False: []}  # by requires_grad
            for mod, name in group:
                p = mod._parameters[name]
                if p is None or not p.is_floating_point() or p.dtype == dtype:
                    continue
                masters.append((mod, name, p))
                if id(p) not in copies:
                    copies[id(p)] = None
                    fresh[p.requires_grad].append(p)
            for ps in fresh.values():
                if ps:
                    copies.update(zip(map(id, ps), _Cast.apply(dtype, kept, *ps)))
        for mod, name, p in masters:
            mod._parameters[name] = copies[id(p)]  # a non-leaf of the graph, as FSDP2's unsharded param

    def swap_out(module, args, output):
        for mod, name, p in masters:
            mod._parameters[name] = p
        masters.clear()

    model.register_forward_pre_hook(swap_in)
    model.register_forward_hook(swap_out, always_call=True)

    # An eager activation-checkpointed unit recomputes its forward in the backward, after swap_out put the fp32
    # parameters back: its inner module casts them again for that pass (the same values; outside the graph, which
    # the recompute only fills with saved tensors). In the forward itself it finds the copies and does nothing;
    # inside a compiled unit the recompute is part of the compiled backward.
    unit_slots: dict[int, list[tuple[nn.Module, str]]] = {}  # per AC unit's inner module, filled below
    recast: dict[int, list[tuple[nn.Module, str, nn.Parameter]]] = {}

    def recast_in(module, args):
        if torch.compiler.is_compiling():
            return
        swapped = recast.setdefault(id(module), [])
        for mod, name in unit_slots[id(module)]:
            p = mod._parameters[name]
            if isinstance(p, nn.Parameter) and p.is_floating_point() and p.dtype != dtype:
                swapped.append((mod, name, p))
                with _disable_current_modes():  # selective AC replays the forward's ops: these were not among them
                    c = p.detach().to(dtype)
                # requiring grad as the forward's copy did, so the recompute saves the same tensors
                mod._parameters[name] = c.requires_grad_(p.requires_grad)

    def recast_out(module, args, output):
        if torch.compiler.is_compiling():
            return
        for mod, name, p in recast.pop(id(module), []):
            mod._parameters[name] = p

    for unit in model.modules():
        if isinstance(unit, CheckpointWrapper):
            inner = unit._checkpoint_wrapped_module
            unit_slots[id(inner)] = slots_of(inner)
            inner.register_forward_pre_hook(recast_in)
            inner.register_forward_hook(recast_out, always_call=True)


# ----------------------------------------------------------------------------------------------- helpers
def _top_level(pairs: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop matches nested inside an earlier match (a unit is wrapped once, at its outermost match)."""
    out: list[tuple[str, nn.Module]] = []
    for fqn, mod in pairs:
        if any(fqn.startswith(p + ".") for p, _ in out):
            continue
        out.append((fqn, mod))
    return out


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)

