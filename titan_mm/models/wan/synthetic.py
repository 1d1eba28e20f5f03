"""Synthetic Wan batches for ``data.dataset = "synthetic"`` (ModelSpec.synthetic): random "text states" and clips
whose latents are a fixed function of them, so a model that reads the text learns (the debug config's loss falls).
titan_mm.train.synthetic's loader draws row r of step t from a generator seeded by (seed, t, r) alone: the same
global batch for any dp world, exact on resume."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from titan_mm.models.wan import digits
from titan_mm.models.wan.config import WanConfig
from titan_mm.models.wan.data import latent_batch

TEXT_TOKENS = 8
"""Text states per synthetic prompt."""
SIDE = 4
"""Patches per side of a synthetic latent frame (rows = columns)."""


def clip_batch(cfg: WanConfig, gens: list[torch.Generator], frames: int) -> dict:
    """One micro-batch of len(gens) clips of ``frames`` latent frames x SIDE x SIDE patches, a row per clip."""
    mix = torch.randn(cfg.text_dim, cfg.in_channels, generator=torch.Generator().manual_seed(1234))
    pt, ph, pw = cfg.patch_size
    text = torch.stack([torch.randn(TEXT_TOKENS, cfg.text_dim, generator=g) for g in gens])
    shape = (cfg.in_channels, frames * pt, SIDE * ph, SIDE * pw)
    noise = torch.stack([torch.randn(shape, generator=g) for g in gens])
    x = torch.tanh(text.mean(1) @ mix)[:, :, None, None, None] + 0.1 * noise
    return latent_batch(cfg, x, text)


def synthetic(cfg: WanConfig, seq_len: int) -> Callable[[list[torch.Generator]], dict]:
    """ModelSpec.synthetic: the micro-batch of a row's generators, clips of ``seq_len`` patches (cfg.synthetic
    "digits": the moving-digits task's clips)."""
    if cfg.synthetic == "digits":
        return digits.synthetic(cfg, seq_len)
    if seq_len % (SIDE * SIDE):
        raise ValueError(f"data.seq_len = {seq_len}: synthetic Wan clips are frames of {SIDE}x{SIDE} patches; use a "
                         f"multiple of {SIDE * SIDE}")
    return functools.partial(clip_batch, cfg, frames=seq_len // (SIDE * SIDE))
