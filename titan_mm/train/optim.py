"""Optimizers and learning-rate schedules (plain torch.optim + LambdaLR).

Parameter groups come from :func:`build_param_groups` (model, config) -> list of group dicts; a family's
per-part learning rates (ModelSpec.param_groups, e.g. vision tower vs LLM) split them further.

Weight decay: matrices decay; norm weights, biases and embeddings do not, unless
``optimizer.decay_norms_and_biases`` / ``optimizer.decay_embeddings`` say so.

``optimizer.name = "muon"``: every group is split once more into its Muon part (:func:`muon_param_ids`: the
matrices inside the model's blocks) and its AdamW part, all in one titan_mm.train.muon.MuonAdamW, so one
LambdaLR, one clip and one checkpoint item cover both (docs/optimizers.md).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titan_mm.config import ConfigError, JobConfig, LRScheduler
from titan_mm.parallel.apply import CastCopies
from titan_mm.train.cast_adamw import CastAdamW
from titan_mm.train.muon import MuonAdamW

_EMBED_HINTS = ("embed", "tok_embeddings", "wte")


def _is_embedding_param(model: nn.Module, name: str) -> bool:
    mod_name = name.rsplit(".", 1)[0] if "." in name else ""
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        mod = None
    if isinstance(mod, nn.Embedding):
        return True
    return any(h in name for h in _EMBED_HINTS)


def _is_norm_or_bias(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or name.endswith(".bias") or "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1].lower()


def build_param_groups(model: nn.Module, cfg: JobConfig, split: Callable | None = None) -> list[dict[str, Any]]:
    """Split trainable parameters into a decay group and a no-decay group (empty groups are dropped), then
    ``split(groups, base_lr)`` when given (the family's ModelSpec.param_groups bound to the model and config).

    Tied parameters (one tensor under two names, e.g. a tied embedding / output head) appear once; a
    tensor is treated as an embedding if any of its names is one.
    """
    o = cfg.optimizer
    decay, no_decay = [], []
    seen: dict[int, bool] = {}
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    for pid, p in params.items():
        ns = names[pid]
        is_embed = any(_is_embedding_param(model, n) for n in ns)
        is_nb = any(_is_norm_or_bias(n, p) for n in ns)
        wd = True
        if is_embed and not o.decay_embeddings:
            wd = False
        elif is_nb and not is_embed and not o.decay_norms_and_biases:
            wd = False
        seen[pid] = wd
        (decay if wd else no_decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": o.weight_decay, "name": "decay"})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    if not groups:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    if split is not None:
        groups = split(groups, o.lr)
    return groups


def split_dtensor_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Split every group that holds both DTensor and plain parameters into two groups with the same options,
    name included. The foreach / fused AdamW kernels cannot take both kinds in one call; tensor parallelism without
    FSDP leaves the replicated parameters (norms; the embedding when it is not sharded) plain next to DTensors.
    So the group count depends on the layout: checkpoints keep group options per parameter (train/checkpoint.py),
    which needs the two halves to agree on every option, and the schedule drops its per-group lists on load."""
    out = []
    for g in groups:
        dt = [p for p in g["params"] if isinstance(p, DTensor)]
        plain = [p for p in g["params"] if not isinstance(p, DTensor)]
        if dt and plain:
            out += [{**g, "params": dt}, {**g, "params": plain}]
        else:
            out.append(g)
    return out


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # AC / compile wrappers inside parameter FQNs


def _clean_fqn(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _in_modules(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a module on the path of parameter ``name`` matches one of the fnmatch ``patterns``."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:k]), pat) for k in range(1, len(parts)) for pat in patterns)


def muon_param_ids(model: nn.Module, plan) -> set[int]:
    """ids of the parameters Muon updates: matrices (ndim >= 2; 3-D expert weights are batches of matrices)
    inside the model's blocks (the plan's ``fsdp_units``: the trunk's blocks, ViT blocks included), except
    embeddings, norms, biases and the output head (the module the plan names in ``loss_parallel``). A tensor
    under several names (tied weights) is Muon's only if every name is."""
    head = (plan.loss_parallel,) if plan.loss_parallel else ()
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    out = set()
    for pid, ns in names.items():
        p = params[pid]
        if p.ndim < 2 or any(_is_embedding_param(model, n) or _is_norm_or_bias(n, p) for n in ns):
            continue
        clean = [_clean_fqn(n) for n in ns]
        if all(_in_modules(n, plan.fsdp_units) and not _in_modules(n, head) for n in clean):
            out.add(pid)
    return out


def fused_layouts(model: nn.Module, fused: dict[str, Any]) -> dict[int, Any]:
    """{id(param): FusedRows} for the parameters whose FQN matches a pattern of ``fused`` (ModelSpec.fused_params)."""
    out = {}
    for name, p in model.named_parameters():
        clean = _clean_fqn(name)
        for pat, layout in fused.items():
            if fnmatch.fnmatchcase(clean, pat):
                out[id(p)] = layout
    return out


def split_muon_groups(groups: list[dict[str, Any]], muon_ids: set[int]) -> list[dict[str, Any]]:
    """Each group -> its Muon part (``algo="muon"``, name + "/muon") and its AdamW part (``algo="adamw"``), with
    the same options (lr, weight decay, initial_lr); empty parts are dropped."""
    out = []
    for g in groups:
        muon = [p for p in g["params"] if id(p) in muon_ids]
        rest = [p for p in g["params"] if id(p) not in muon_ids]
        if muon:
            out.append({**g, "params": muon, "algo": "muon", "name": f"{g.get('name', 'group')}/muon"})
        if rest:
            out.append({**g, "params": rest, "algo": "adamw"})
    return out


def build_optimizer(model: nn.Module, cfg: JobConfig, param_groups: list[dict] | None = None,
                    split: Callable | None = None, plan=None, fused: dict[str, Any] | None = None,
                    copies: CastCopies | None = None) -> torch.optim.Optimizer:
    """torch.optim.AdamW (``optimizer.name = "adamw"``) or titan_mm.train.muon.MuonAdamW (``"muon"``), which needs
    the model's ``plan`` (ParallelizePlan: its blocks and head) and takes the family's ``fused``
    (ModelSpec.fused_params(cfg)) for ``optimizer.muon_split_fused``. ``copies``: the cast path's kept copies
    (titan_mm.parallel.apply.cast_copies; parallel.one_rank_mixed_precision = optimizer): AdamW is then
    titan_mm.train.cast_adamw.CastAdamW, which writes them."""
    o = cfg.optimizer
    if o.name not in ("adamw", "muon"):
        raise ValueError(f"unknown optimizer.name {o.name!r}; available: adamw, muon")
    groups = param_groups if param_groups is not None else build_param_groups(model, cfg, split)
    if o.name == "muon":
        if plan is None:
            raise ValueError("optimizer.name='muon' needs the model's plan: build_optimizer(..., plan=spec.plan(cfg))")
        groups = split_muon_groups(groups, muon_param_ids(model, plan))
        if not any(g["algo"] == "muon" for g in groups):
            raise ConfigError("optimizer.name='muon' but the model has no trainable matrix inside its blocks "
                              f"(plan.fsdp_units {plan.fsdp_units}); use --optimizer.name adamw")
    groups = split_dtensor_groups(groups)
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    impl = o.implementation
    if impl == "auto":
        impl = "fused" if on_cuda else "foreach"
    if impl == "fused" and not on_cuda:
        raise ValueError("optimizer.implementation='fused' needs CUDA parameters; use 'auto' or 'foreach' on CPU")
    kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if impl == "fused":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = impl == "foreach"
    if o.name == "adamw":
        return torch.optim.AdamW(groups, **kwargs) if copies is None else CastAdamW(groups, copies=copies, **kwargs)

    layouts = fused_layouts(model, fused) if (o.muon_split_fused and fused) else {}
    return MuonAdamW(groups, momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                     adjust_lr=o.muon_adjust_lr, layouts=layouts, **kwargs)


def supports_found_inf(opt: Any) -> bool:
    """Whether ``opt.step()`` honours a device-side skip flag: torch's Adam / AdamW, or CastAdamW, with
    ``fused=True`` in every parameter group (what :func:`build_optimizer` returns on CUDA). Their step reads the
    attributes ``opt.grad_scale`` / ``opt.found_inf`` (the GradScaler mechanism, torch >= 2.0): with
    ``found_inf == 1`` the fused kernel leaves parameters, ``exp_avg`` and ``exp_avg_sq`` untouched and
    ``state['step']`` is restored (+1, then -found_inf); CastAdamW hands both to its own kernel as well. False for
    anything else (foreach / single-tensor AdamW, other subclasses, other optimizers),
    and when the optimizer already carries ``grad_scale`` / ``found_inf`` (someone else, e.g. a GradScaler,
    drives them)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW, CastAdamW):
        return False
    if hasattr(opt, "found_inf") or hasattr(opt, "grad_scale"):
        return False
    return bool(opt.param_groups) and all(g.get("fused") for g in opt.param_groups)


def lr_factor(step: int, total_steps: int, s: LRScheduler) -> float:
    """Multiplier on the peak lr for the update made at ``step`` (0-based)."""
    warm = s.warmup_steps
    if warm > 0 and step < warm:
        return s.warmup_start_factor + (1.0 - s.warmup_start_factor) * (step + 1) / warm
    if s.name == "constant":
        return 1.0
    lo = s.min_lr_factor
    if s.name in ("cosine", "linear"):
        span = max(total_steps - warm, 1)
        prog = min(max((step - warm) / span, 0.0), 1.0)
        if s.name == "cosine":
            return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * prog))
        return lo + (1.0 - lo) * (1.0 - prog)
    if s.name == "wsd":
        decay_steps = int(round(s.decay_ratio * total_steps))
        decay_start = total_steps - decay_steps
        if step < decay_start or decay_steps <= 0:
            return 1.0
        prog = min((step - decay_start + 1) / decay_steps, 1.0)
        if s.decay_type == "linear":
            f = 1.0 - prog
        elif s.decay_type == "cosine":
            f = 0.5 * (1.0 + math.cos(math.pi * prog))
        else:  # sqrt
            f = 1.0 - math.sqrt(prog)
        return lo + (1.0 - lo) * f
    raise ValueError(f"unknown lr_scheduler.name {s.name!r}; available: cosine, wsd, constant, linear")


class LayoutFreeLambdaLR(LambdaLR):
    """LambdaLR whose load keeps this run's per-group lists (``base_lrs``, ``_last_lr``) and takes only the step
    count: the number and order of parameter groups depend on the layout (:func:`split_dtensor_groups`), and a
    checkpoint resumes under another one; the base lrs come from the config either way."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in ("base_lrs", "_last_lr")})
        self._last_lr = [f(self.last_epoch) * b for f, b in zip(self.lr_lambdas, self.base_lrs, strict=True)]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: JobConfig) -> LambdaLR:
    """:class:`LayoutFreeLambdaLR` over :func:`lr_factor`. The lambda is a plain function, so the state_dict
    keeps only the step count: a resumed run takes its schedule (steps, warmup, ...) from its own config."""
    total, sched = cfg.training.steps, cfg.lr_scheduler

    def factor(step: int) -> float:
        return lr_factor(step, total, sched)

    return LayoutFreeLambdaLR(optimizer, lr_lambda=factor)
