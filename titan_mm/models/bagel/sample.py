"""BAGEL's image sampler on the training forward's KV-cache path (ByteDance-Seed/Bagel modeling/bagel/bagel.py
``generate_image`` / ``_forward_flow``, inferencer.py ``gen_image``): Euler steps over ``linspace(1, 0, steps)``
shifted by ``timestep_shift`` (the last point is the end, so ``steps - 1`` model calls), x <- x - v dt with v the
velocity eps - x0; text classifier-free guidance inside ``cfg_interval`` with BAGEL's "global" renorm (the guided
velocity scaled down to at most the conditional one's norm, at least ``cfg_renorm_min`` of it); the latent patches
put back into a [z, h, w] latent image and decoded by the FLUX VAE (titan_mm.models.bagel.vae).

As the reference, each context (``[bos prompt eos]``; editing: the source's clean VAE split and its ViT split
before it) runs once through the forward into a KV cache (titan_mm.nn.kv_cache, under its own segment mask), and
each step runs only the image's query tokens ``[vs, latents, ve]`` (one split at the next position) against the
cached keys and values: the context never sees the image, so these are the keys and values a whole-sample forward
would recompute each step. The unconditional branch is BAGEL's ``cfg_text`` context: the image split alone (the
caption dropped, as ``text_cond_dropout_prob`` trains it), at position 0.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from titan_mm.data.packing import Doc, collate_rows
from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.data import generation_doc
from titan_mm.models.bagel.model import BagelModel
from titan_mm.models.bagel.spec import ROUTING_KEYS, SCHEMA, prepare_batch
from titan_mm.models.bagel.synthetic import DEBUG_SPECIALS, Specials
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.flow import time_shift
from titan_mm.nn.kv_cache import alloc_contiguous_cache, plan_step


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


def split_query(doc: Doc) -> tuple[Doc | None, Doc]:
    """(the context: every split but the last, None when there is none; the image query: the last split, the noised
    image) of a generation sample (data.generation_doc), each a doc of its own with its positions kept."""
    n = doc.segments[-1][0]
    c = len(doc) - n

    def part(a: int, b: int, segments: tuple, media: dict) -> Doc:
        return Doc(doc.input_ids[a:b], doc.labels[a:b], positions=doc.positions[:, a:b], media=media,
                   seq={k: v[a:b] for k, v in doc.seq.items()}, segments=segments)

    return (part(0, c, doc.segments[:-1], doc.media) if c else None), part(c, len(doc), doc.segments[-1:], {})


def _collated(doc: Doc) -> dict:
    return collate_rows([[doc]], len(doc), pad_id=0, position_axes=1, multiple=1, schema=SCHEMA)


def _prepared(cfg: BagelConfig, raw: dict, dev: torch.device) -> dict:
    b = prepare_batch(cfg, raw, dev)
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}


class _Branch:
    """One context's sampling, built once: the context (``[bos prompt eos]``; editing: the source's VAE and ViT
    splits before it) runs once through the forward into a KV cache under its own segment mask, as BAGEL's
    ``forward_cache_update_*``; each step runs only the image query ``[vs, latents, ve]`` (one full split at the
    next position) against the cached keys and values, as ``_forward_flow`` with ``past_key_values``."""

    def __init__(self, model: BagelModel, prompt_ids: list[int] | None, latent_hw: tuple[int, int],
                 specials: Specials, source: tuple[torch.Tensor, torch.Tensor] | None):
        cfg, c = model.cfg, model.cfg.llm_config
        w = model.llm2vae.weight
        doc = generation_doc(cfg, prompt_ids, torch.zeros(cfg.vae_config.z_channels, *latent_hw), specials, source)
        context, query = split_query(doc)
        ctx, n = len(doc) - len(query), len(query)
        cache = alloc_contiguous_cache(c.num_hidden_layers, 1, len(doc), c.num_key_value_heads, c.head_dim, w.dtype,
                                       w.device)
        if context is not None:
            raw = _collated(context)
            see = build_attn_meta(raw, "sdpa", "cpu", kind="segments").sdpa_mask[:, 0]  # the training mask
            cache = plan_step(cache, [ctx], see_new=see)
            b = _prepared(cfg, raw, w.device)
            cache = self._forward(model, b, cache, torch.zeros_like(b["cond_latents"]),
                                  torch.zeros(b["latent_pos"].shape, device=w.device),
                                  logits_at=torch.tensor([ctx - 1], device=w.device)).kv_cache
        # the query sees every cached key and all of its own split, its k / v rewritten into the same slots
        self.cache = plan_step(cache, [n], cached_lens=[ctx], see_new=torch.ones(1, n, n, dtype=torch.bool))
        self.b = _prepared(cfg, _collated(query), w.device)
        self.mask, self.model = self.b["latent_mask"], model

    def _forward(self, model, b, cache, noisy, timesteps, **kw):
        attn = build_attn_meta(b, "sdpa", cache.k[0].device, kv_cache=cache)
        return model(b["input_ids"], position_ids=b["position_ids"], attn=attn,
                     **{k: b[k] for k in ROUTING_KEYS}, noisy_latents=noisy, cond_latents=b["cond_latents"],
                     timesteps=timesteps, latent_pos=b["latent_pos"],
                     **{k: b[k] for k in ("vit_patches", "vit_pos", "vit_index", "vit_attn") if k in b}, **kw)

    def velocity(self, x_NP: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[N, P] fp32: llm2vae at the image's latent tokens for latents ``x_NP`` at time ``t``."""
        b, m = self.b, self.mask
        noisy = torch.zeros(*m.shape, x_NP.shape[-1], device=x_NP.device, dtype=x_NP.dtype)
        noisy[m] = x_NP
        out = self._forward(self.model, b, self.cache, noisy, torch.where(m, t, 0.0),
                            loss=lambda model, o: model.predict_velocity(o, b))
        return out.terms[m].float()


@torch.no_grad()
def sample(model: BagelModel, prompt_ids: list[int], noise_NP: torch.Tensor, latent_hw: tuple[int, int], *,
           steps: int = 50, shift: float = 3.0, cfg_text_scale: float = 4.0,
           cfg_interval: tuple[float, float] = (0.4, 1.0), cfg_renorm_min: float = 0.0,
           specials: Specials = DEBUG_SPECIALS,
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
    cond = _Branch(model, prompt_ids, latent_hw, specials, source)
    uncond = _Branch(model, None, latent_hw, specials, source) if cfg_text_scale > 1.0 else None
    no_img = (_Branch(model, prompt_ids, latent_hw, specials, None)
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
