"""What the flow-matching families (the Wan and BAGEL diffusion transformers) and the flow-matching objective share:
the sinusoidal timestep embedding and the timestep shift of their noise schedules."""

from __future__ import annotations

import math

import torch


def timestep_embedding(t: torch.Tensor, n: int) -> torch.Tensor:
    """diffusers' Timesteps(n, flip_sin_to_cos=True, downscale_freq_shift=0): [cos, sin] of t x 10000^(-j/half)."""
    half = n // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    a = t.float()[..., None] * freqs
    return torch.cat([a.cos(), a.sin()], -1)


def time_shift(sigma, shift: float):
    """The timestep shift s t / (1 + (s - 1) t) of diffusers' FlowMatchEulerDiscreteScheduler: the samplers' sigmas
    and the training t (BAGEL's timestep_shift); a tensor, an array or a float."""
    return shift * sigma / (1 + (shift - 1) * sigma)
