"""Training objectives as registered data (docs/models.md "Objectives"): the batch fields each reads, the attention
kind it asks for, its host-side ``prepare`` (noise, corrupted inputs, targets), the host-counted normalizer of each
loss term, and the named loss-term sums it returns from the model's output (titan_mm.objectives.base).

    obj = build_objective(cfg, spec, model_cfg)

A family's ModelSpec names its objective(s) (``ModelSpec.objectives``, default ``("causal",)``; options from
``ModelSpec.objective_options(model_cfg)``). Several objectives on one packed row (BAGEL: "causal" on the text,
"flow_matching" on the latents) combine into one (:class:`Combined`): their terms side by side, their ``prepare``
in turn. The job's ``[objective] kind`` picks a diffusion LM instead of the family's causal LM (docs/dllm.md).

Register another with ``register(name, factory)``; ``factory(cfg, spec, model_cfg, options) -> Objective``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titan_mm.config import ConfigError, JobConfig
from titan_mm.objectives.base import Objective, attention_pairs, noise_generator
from titan_mm.objectives.causal import CausalLM
from titan_mm.objectives.diffusion import MASK_KINDS, DiffusionLM, build_diffusion
from titan_mm.objectives.flow_matching import FlowMatching
from titan_mm.objectives.policy import Policy

__all__ = ["CausalLM", "Combined", "DiffusionLM", "FlowMatching", "Objective", "Policy", "attention_pairs",
           "build_objective", "noise_generator", "register"]

Factory = Callable[[JobConfig, Any, Any, dict], Objective]
_REGISTRY: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Register ``factory(cfg, spec, model_cfg, options) -> Objective`` under ``name`` (re-registering replaces)."""
    _REGISTRY[name] = factory


def _factory(name: str) -> Factory:
    if name not in _REGISTRY:
        near = difflib.get_close_matches(name, list(_REGISTRY), n=2, cutoff=0.4)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        raise ConfigError(f"unknown objective {name!r}; {hint}registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


@dataclass(frozen=True)
class Combined(Objective):
    """Several objectives on different token groups of one batch: terms side by side, ``prepare`` in turn."""

    parts: tuple[Objective, ...]

    def __post_init__(self):
        names = [t for p in self.parts for t in p.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"combined objectives name a loss term twice: {names}; give each part its own terms")
        kinds = {p.mask_kind for p in self.parts} - {None}
        if "segments" in kinds:  # a segment description holds causal segments: it serves the causal part too
            kinds.discard("causal")
        if len(kinds) > 1:
            raise ValueError(f"combined objectives ask for different attention kinds {sorted(kinds)}; one batch "
                             "has one mask: let the family's segment description decide (mask_kind None)")

    def _union(self, attr: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for p in self.parts for k in getattr(p, attr)))

    terms = property(lambda self: self._union("terms"))
    fields = property(lambda self: self._union("fields"))
    loss_keys = property(lambda self: self._union("loss_keys"))
    host_keys = property(lambda self: self._union("host_keys"))
    seq_keys = property(lambda self: self._union("seq_keys"))
    stats = property(lambda self: self._union("stats"))
    mask_kind = property(lambda self: "segments" if any(p.mask_kind == "segments" for p in self.parts)
                         else next((p.mask_kind for p in self.parts if p.mask_kind), None))
    block_size = property(lambda self: next((p.block_size for p in self.parts if p.block_size), None))

    def prepare(self, micro_batches: list[dict], step: int, dp_rank: int = 0) -> list[dict]:
        for p in self.parts:
            micro_batches = p.prepare(micro_batches, step, dp_rank)
        return micro_batches

    def counts(self, batch: dict[str, Any]) -> dict[str, int]:
        return {k: v for p in self.parts for k, v in p.counts(batch).items()}

    def loss_sums(self, model, out, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: v for p in self.parts for k, v in p.loss_sums(model, out, batch).items()}


def _diffusion(cfg: JobConfig, spec, model_cfg, options: dict) -> Objective:
    return build_diffusion(cfg, spec, model_cfg)


def _flow_options(cfg: JobConfig) -> dict:
    """The [objective] flow_* settings the job gives (empty / 0: the family's)."""
    o = cfg.objective
    return {k: v for k, v in (("sampler", o.flow_sampler), ("shift", o.flow_shift),
                              ("weighting", o.flow_weighting)) if v}


def _flow_matching(cfg: JobConfig, spec, model_cfg, options: dict) -> Objective:
    options = {**options, **_flow_options(cfg)}
    try:
        return FlowMatching(seed=cfg.training.seed, **options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"flow matching options {options} of model {cfg.model.name!r}: {e}") from None


register("causal", lambda cfg, spec, model_cfg, options: CausalLM())
for _kind in MASK_KINDS:
    register(_kind, _diffusion)
register("flow_matching", _flow_matching)
register("policy", lambda cfg, spec, model_cfg, options: Policy(
    eps_low=cfg.rl.eps_low, eps_high=cfg.rl.eps_high, kl_coef=cfg.rl.kl_coef, loss_norm=cfg.rl.loss_norm))


def build_objective(cfg: JobConfig, spec, model_cfg) -> Objective:
    """The objective that trains ``spec``'s family in job ``cfg``: the spec's objective(s), with the job's
    ``[objective] kind`` in the causal LM's place when it names a diffusion LM. Mistakes are ConfigErrors (the mask
    token, the kind x attention backend, options), raised before anything heavy is built."""
    names = tuple(spec.objectives)
    kind = "policy" if cfg.rl.enable else cfg.objective.kind  # [rl]: the policy loss over rollouts (docs/rl.md)
    if kind != "causal":
        if "causal" not in names:
            what = "rl.enable" if cfg.rl.enable else f"objective.kind={kind!r}"
            raise ConfigError(f"{what} replaces the causal LM, which model {spec.name!r} does not train (its "
                              f"objectives: {', '.join(names)}); drop {what.split('=')[0]}")
        names = tuple(kind if n == "causal" else n for n in names)
    if _flow_options(cfg) and "flow_matching" not in names:
        raise ConfigError(f"objective.{'/'.join('flow_' + k for k in _flow_options(cfg))} set flow matching, which "
                          f"model {spec.name!r} does not train (its objectives: {', '.join(names)}); drop them")
    options = spec.objective_options(model_cfg) if spec.objective_options else {}
    parts = tuple(_factory(n)(cfg, spec, model_cfg, options.get(n, {})) for n in names)
    if len(parts) == 1:
        return parts[0]
    try:
        return Combined(parts)
    except ValueError as e:
        raise ConfigError(f"model {spec.name!r}: {e}") from None
