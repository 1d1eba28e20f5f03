"""The model output contract (docs/architecture.md)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None
    """[B, S, V] in the model dtype when no labels are given; None otherwise."""
    loss_sum: torch.Tensor | None
    """fp32 scalar: sum of token CE over labels != -100 (the step divides by the global label count)."""
    aux_loss: torch.Tensor | None
    """fp32 scalar MoE load-balancing loss, already multiplied by the config's router_aux_loss_coef
    (the step adds it as is); 0 for dense models."""
