"""Wan's clips in the data pipeline (DataNeeds.clips; docs/wan.md "Data"): the frozen UMT5 text encoder and
AutoencoderKLWan of a diffusers pipeline folder, and the batch that cached or freshly encoded clips make.

Text as WanPipeline encodes a prompt (``_get_t5_prompt_embeds``): tokens padded to TEXT_LEN with the attention
mask, UMT5's last hidden states cut to the prompt's own length (the loader zero-pads them back, as diffusers
does). Video as the Wan trainers encode it: frames to [-1, 1], the VAE's posterior mode (deterministic, so the
cache and the in-pipeline path agree), normalized by the VAE config's latents_mean / latents_std.
"""

from __future__ import annotations

import html
import math
import os

import numpy as np
import torch

from titan_mm.models.wan.config import WanConfig
from titan_mm.models.wan.model import patchify
from titan_mm.nn.media import Bound, ClipLayout

TEXT_LEN = 512
"""Text states per prompt: diffusers' WanPipeline max_sequence_length."""


def latent_batch(cfg: WanConfig, latents_BCFHW: torch.Tensor, text_BLD: torch.Tensor) -> dict:
    """The micro-batch (spec.SCHEMA) of clips of one shape: a row per clip, every patch a flow-matching target; with
    ``cfg.first_frame_clean`` (TI2V) the first latent frame's patches are the clean condition (noise unit -1)."""
    patches, grid = patchify(latents_BCFHW, cfg.patch_size)
    B, S = patches.shape[:2]
    unit = torch.zeros(B, S, dtype=torch.long)
    if cfg.first_frame_clean:
        unit[grid[..., 0] == 0] = -1
    return {"latents": patches, "latent_mask": torch.ones(B, S, dtype=torch.bool),
            "noise_unit": unit, "grid_fhw": grid,
            "position_ids": torch.zeros(B, S, dtype=torch.long), "doc_ids": torch.zeros(B, S, dtype=torch.int32),
            "cu_seqlens": torch.arange(B + 1, dtype=torch.int32) * S, "max_seqlen": S, "text_states": text_BLD}


class WanEncoders:
    """The frozen UMT5 encoder (with its tokenizer) and VAE (titan_mm.nn.media.ClipEncoders)."""

    def __init__(self, tokenizer, text_encoder, vae, patch: tuple[int, int, int], device: str = "cpu"):
        self.tokenizer, self.device = tokenizer, torch.device(device)
        self.text_encoder = text_encoder.eval().requires_grad_(False).to(self.device)
        self.vae = vae.eval().requires_grad_(False).to(self.device)
        c = vae.config
        if patch[0] != 1:
            raise ValueError(f"clips for a temporal patch of {patch[0]} latent frames are not built yet (Wan's is 1)")
        self.frame_step = int(c.scale_factor_temporal)
        self.pixel_multiple = int(c.scale_factor_spatial) * math.lcm(patch[1], patch[2])
        dt = torch.float32
        self.mean = torch.tensor(c.latents_mean, dtype=dt).view(-1, 1, 1, 1)
        self.std = torch.tensor(c.latents_std, dtype=dt).view(-1, 1, 1, 1)

    @torch.no_grad()
    def text(self, prompt: str) -> torch.Tensor:
        prompt = " ".join(html.unescape(html.unescape(prompt)).split())  # WanPipeline's prompt_clean, less ftfy
        t = self.tokenizer([prompt], padding="max_length", max_length=TEXT_LEN, truncation=True,
                           add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        mask = t.attention_mask.to(self.device)
        out = self.text_encoder(t.input_ids.to(self.device), mask).last_hidden_state[0]
        return out[: int(mask.gt(0).sum())].float().cpu()

    @torch.no_grad()
    def video(self, frames_THWC: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(frames_THWC)).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        z = self.vae.encode(x.to(self.device, self.vae.dtype)).latent_dist.mode()[0].float().cpu()
        return (z - self.mean) / self.std


def load_encoders(cfg: WanConfig, folder: str, device: str = "cpu") -> WanEncoders:
    """The encoders of a diffusers Wan pipeline folder (tokenizer/, text_encoder/, vae/)."""
    # transformers and diffusers are optional dependencies (the diffusers extra): only encoding needs them
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    missing = [s for s in ("tokenizer", "text_encoder", "vae") if not os.path.isdir(os.path.join(folder, s))]
    if missing:
        raise ValueError(f"data.encoders {folder!r} has no {', '.join(s + '/' for s in missing)}; give a diffusers "
                         "Wan pipeline folder (tokenizer/, text_encoder/, vae/), e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    return WanEncoders(AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer")),
                       UMT5EncoderModel.from_pretrained(os.path.join(folder, "text_encoder"), dtype=torch.float32),
                       AutoencoderKLWan.from_pretrained(os.path.join(folder, "vae"), torch_dtype=torch.float32),
                       cfg.patch_size, device)


def clip_layout(cfg: WanConfig) -> ClipLayout:
    return ClipLayout(text_len=TEXT_LEN, batch=Bound(latent_batch, cfg), encoders=Bound(load_encoders, cfg))
