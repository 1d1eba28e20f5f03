"""BAGEL's image sampler through the training forward (ByteDance-Seed/Bagel modeling/bagel/bagel.py
``generate_image`` / ``_forward_flow``, inferencer.py ``gen_image``): Euler steps over ``linspace(1, 0, steps)``
shifted by ``timestep_shift`` (the last point is the end, so ``steps - 1`` model calls), x <- x - v dt with v the
velocity eps - x0; text classifier-free guidance inside ``cfg_interval`` with BAGEL's "global" renorm (the guided
velocity scaled down to at most the conditional one's norm, at least ``cfg_renorm_min`` of it); the latent patches
put back into a [z, h, w] latent image and decoded by the FLUX VAE (titan_mm.models.bagel.vae).

The reference keeps the prompt in a KV cache and runs only the image's query tokens per step. Here each step runs the
whole sample (``[bos prompt eos]`` causal, then ``[vs, latents, ve]`` noised) through the training forward under its
segment mask: the prompt never sees the image, so its keys and values are the cached ones and the velocities are the
same, at the cost of recomputing the prompt per step. The unconditional branch is BAGEL's ``cfg_text`` context: the
image split alone (the caption dropped, as ``text_cond_dropout_prob`` trains it), at position 0.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from titan_mm.data.packing import collate_rows
from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.data import generation_doc
from titan_mm.models.bagel.model import BagelModel
from titan_mm.models.bagel.spec import SCHEMA, prepare_batch
from titan_mm.models.bagel.synthetic import DEBUG_SPECIALS, Specials
from titan_mm.models.wan.sample import time_shift
from titan_mm.nn.attention import build_attn_meta


def check_sampling(cfg: BagelConfig, steps: int, shift: float, cfg_text_scale: float,
                   cfg_interval: tuple[float, float], latent_hw: tuple[int, int]) -> None:
    """One ValueError line for settings that cannot run."""
    if steps < 2:
        raise ValueError(f"steps = {steps}: BAGEL's schedule linspace(1, 0, steps) needs at least 2 points")
    if shift <= 0:
        raise ValueError(f"timestep shift = {shift}: it must be > 0 (BAGEL's inferencer uses 3.0)")
    if cfg_text_scale < 0:
        raise ValueError(f"cfg_text_scale = {cfg_text_scale}: use >= 0 (1 or less turns guidance off)")
    if not 0 <= cfg_interval[0] <= cfg_interval[1] <= 1:
        raise ValueError(f"cfg_interval {cfg_interval}: give (low, high) with 0 <= low <= high <= 1")
    p = cfg.latent_patch_size
    h, w = latent_hw
    if h < p or w < p or h % p or w % p or h // p > cfg.max_latent_size or w // p > cfg.max_latent_size:
        down = cfg.vae_config.downsample
        raise ValueError(f"a latent of {h}x{w} does not fit: its sides must be multiples of the latent patch {p}, "
                         f"at most {cfg.max_latent_size * p} (images up to {cfg.max_latent_size * p * down} px per "
                         "side)")


def schedule(steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(t [steps - 1], dt [steps - 1]) fp32: BAGEL's shifted linspace(1, 0, steps), its points but the last, and
    their differences."""
    t = time_shift(torch.linspace(1, 0, steps), shift)
    return t[:-1], t[:-1] - t[1:]


class _Branch:
    """One context's forward, built once on the host: the sample's batch, its routing and segment-mask metadata."""

    def __init__(self, model: BagelModel, prompt_ids: list[int] | None, latent_hw: tuple[int, int], backend: str,
                 specials: Specials, source: tuple[torch.Tensor, torch.Tensor] | None):
        cfg = model.cfg
        dev = model.llm2vae.weight.device
        doc = generation_doc(cfg, prompt_ids, torch.zeros(cfg.vae_config.z_channels, *latent_hw), specials, source)
        batch = collate_rows([[doc]], len(doc), pad_id=0, position_axes=1, multiple=1, schema=SCHEMA)
        b = prepare_batch(cfg, batch, dev)
        self.attn = build_attn_meta(b, backend, dev, kind="segments")
        self.mask = b["latent_mask"].to(dev)
        self.b = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        self.model = model

    def velocity(self, x_NP: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[N, P] fp32: llm2vae at the image's latent tokens for latents ``x_NP`` at time ``t``."""
        b, m = self.b, self.mask
        noisy = torch.zeros(*m.shape, x_NP.shape[-1], device=x_NP.device, dtype=x_NP.dtype)
        noisy[m] = x_NP
        out = self.model(b["input_ids"], position_ids=b["position_ids"], attn=self.attn,
                         loss=lambda model, o: model.predict_velocity(o, b), und_index=b["und_index"],
                         gen_index=b["gen_index"], noisy_latents=noisy, cond_latents=b["cond_latents"],
                         timesteps=torch.where(m, t, 0.0), latent_pos=b["latent_pos"],
                         **{k: b[k] for k in ("vit_patches", "vit_pos", "vit_index", "vit_attn") if k in b})
        return out.terms[m].float()


@torch.no_grad()
def sample(model: BagelModel, prompt_ids: list[int], noise_NP: torch.Tensor, latent_hw: tuple[int, int], *,
           steps: int = 50, shift: float = 3.0, cfg_text_scale: float = 4.0,
           cfg_interval: tuple[float, float] = (0.4, 1.0), cfg_renorm_min: float = 0.0,
           attn_backend: str = "sdpa", specials: Specials = DEBUG_SPECIALS,
           source: tuple[torch.Tensor, torch.Tensor] | None = None, cfg_img_scale: float = 1.0) -> torch.Tensor:
    """The latent image [z, h, w] fp32 of ``prompt_ids`` (no special tokens; ``specials``' BOS / EOS are put around
    them) from ``noise_NP`` [h/p x w/p, P] (t = 1, latent patches in row-major order, BAGEL's ``packed_init_noises``).
    Editing: ``source`` = (the source image's clean latent [z, h', w'], its ViT pixels [3, H, W] in [-1, 1]) before
    the prompt, and image guidance ``cfg_img_scale`` against the prompt alone (BAGEL's ``cfg_img`` context), applied
    after the text guidance (whose context is then the source image alone). Defaults: BAGEL inferencer's
    ``gen_image`` (its image scale 1.5 is for editing; 1 here turns it off)."""
    cfg = model.cfg
    check_sampling(cfg, steps, shift, cfg_text_scale, cfg_interval, latent_hw)
    p = cfg.latent_patch_size
    n = (latent_hw[0] // p) * (latent_hw[1] // p)
    if tuple(noise_NP.shape) != (n, cfg.patch_latent_dim):
        raise ValueError(f"noise of shape {list(noise_NP.shape)} is not [{n}, {cfg.patch_latent_dim}]: one latent "
                         f"patch per row for a {latent_hw[0]}x{latent_hw[1]} latent")
    if cfg_img_scale < 0 or (cfg_img_scale > 1.0 and source is None):
        raise ValueError(f"cfg_img_scale = {cfg_img_scale}: image guidance needs a source image (editing) and a "
                         "scale >= 0 (1 or less turns it off)")
    cond = _Branch(model, prompt_ids, latent_hw, attn_backend, specials, source)
    uncond = _Branch(model, None, latent_hw, attn_backend, specials, source) if cfg_text_scale > 1.0 else None
    no_img = (_Branch(model, prompt_ids, latent_hw, attn_backend, specials, None)
              if cfg_img_scale > 1.0 and uncond is not None else None)
    x = noise_NP.to(model.llm2vae.weight.device, torch.float32)
    ts, dts = schedule(steps, shift)
    for t, dt in zip(ts.tolist(), dts.tolist()):
        tt = torch.tensor(t, device=x.device)
        v = cond.velocity(x, tt)
        if uncond is not None and cfg_interval[0] < t <= cfg_interval[1]:  # image guidance only with text's
            v_u = uncond.velocity(x, tt)
            guided = v_u + cfg_text_scale * (v - v_u)
            if no_img is not None:
                v_i = no_img.velocity(x, tt)
                guided = v_i + cfg_img_scale * (guided - v_i)
            v = guided * (v.norm() / (guided.norm() + 1e-8)).clamp(min=cfg_renorm_min, max=1.0)
        x = x - v * dt
    return unpatchify(x, latent_hw, p)


def unpatchify(x_NP: torch.Tensor, latent_hw: tuple[int, int], p: int) -> torch.Tensor:
    """[z, h, w] of row-major patches [N, p x p x z] in (row, column, channel) order (the inverse of
    ``model.patchify``)."""
    h, w = latent_hw[0] // p, latent_hw[1] // p
    return x_NP.reshape(h, w, p, p, -1).permute(4, 0, 2, 1, 3).reshape(-1, h * p, w * p)


def write_png(image_CHW: torch.Tensor, path: str | os.PathLike) -> None:
    """A PNG of an image [3, H, W] in [0, 1], to 8 bits as BAGEL's ``decode_image`` (x 255, truncated)."""
    a = (image_CHW.permute(1, 2, 0) * 255).to(torch.uint8).cpu().numpy()
    Image.fromarray(np.ascontiguousarray(a)).save(path)
