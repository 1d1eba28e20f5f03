"""The values a model hands between its parts (docs/models.md, "The contract").

    stream = model.embed(...)                        # first pipeline stage only
    stream = model.trunk(stream, rope, attn, start, stop)   # any contiguous slice of blocks
    out = model.head(stream, attn, hidden=True)       # last stage only: final norm, aux loss, hidden or logits
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Stream(NamedTuple):
    """What flows from the embedding through the trunk to the head: every value a block reads or adds to."""

    h: torch.Tensor
    """[B, S, D] residual stream."""
    moe_stats: torch.Tensor | None = None
    """[2, E] router statistics summed over the MoE blocks run so far (None: none ran)."""
    adds: tuple[torch.Tensor, ...] = ()
    """[B, S, D] additions to the residual after blocks 0 .. len(adds)-1 (Qwen3-VL DeepStack features)."""
    cond: tuple[torch.Tensor, ...] = ()
    """Conditioning that ``embed`` computes and every block reads unchanged (a video diffusion transformer: the text
    states, the modulation and the time embedding); pipeline stages send it on with ``h``."""


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None
    """[B, S, V] in the model dtype when no labels are given ([B, V] with ``logits_at``); None otherwise."""
    loss_sum: torch.Tensor | None
    """fp32 scalar: sum of token CE over labels != -100, each token's CE times its weight when the head was given
    ``loss_weights`` (a diffusion objective's 1/t); the step divides by the global label count."""
    aux_loss: torch.Tensor | None
    """fp32 scalar MoE load-balancing loss, already multiplied by the config's router_aux_loss_coef
    (the step adds it as is); 0 for dense models."""
    kv_cache: Any = None
    """The KV cache the forward was given in its attention metadata (written in place), returned; None in
    training."""
    hidden: torch.Tensor | None = None
    """[B, S, D] final-norm hidden states, when the forward was given an objective's ``loss`` (the input of its
    hooks: ``lm_loss``, ``predict_velocity``); None otherwise."""
    terms: dict[str, torch.Tensor] | None = None
    """The objective's named loss-term sums ({"ce": fp32 sum}, titan_mm.objectives), when the forward was given its
    ``loss``; None otherwise."""
