"""The Wan answers to the family contract (titan_mm.registry.ModelSpec)."""

from __future__ import annotations

import dataclasses

from titan_mm.models.wan.config import WanConfig
from titan_mm.models.wan.data import clip_layout
from titan_mm.models.wan.model import clip_timesteps
from titan_mm.registry import BatchSchema, DataNeeds, KernelShapes, ModelDims, Runtime, SeqKey

SCHEMA = BatchSchema(
    seq=(SeqKey("latents", ("P",), "float32"), SeqKey("latent_mask", dtype="bool"), SeqKey("noise_unit"),
         SeqKey("grid_fhw", (3,))),
    row=("text_states",), tokens=False)
"""A batch: ``latents`` [B, S, P] clean patches (titan_mm.models.wan.model.patchify), ``latent_mask`` /
``noise_unit`` (flow matching: every patch a target, one unit per clip), ``grid_fhw`` [B, S, 3] each patch's
(frame, row, column), and per row ``text_states`` [B, L, text_dim]."""


def dims(cfg: WanConfig) -> ModelDims:
    return ModelDims(hidden_size=cfg.dim, num_layers=cfg.num_layers, num_heads=cfg.num_attention_heads,
                     num_kv_heads=cfg.num_attention_heads, head_dim=cfg.attention_head_dim, vocab_size=0,
                     intermediate_size=cfg.ffn_dim, dense_layers=cfg.num_layers)


def runtime(cfg: WanConfig) -> Runtime:
    return Runtime(attn_backend=cfg.attn_backend, kernels=cfg.kernels)


def with_runtime(cfg: WanConfig, attn_backend: str = "sdpa", kernels: bool | str = False) -> WanConfig:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def data_needs(cfg: WanConfig) -> DataNeeds:
    """Captioned clips through the frozen UMT5 + VAE (data.py), cached or encoded in the pipeline."""
    return DataNeeds(positions="1d", video=True, clips=clip_layout(cfg))


def kernel_shapes(cfg: WanConfig, tp: int = 1, encoder_tp: bool = False) -> KernelShapes:
    """The q / k RMSNorms over all heads (width D) and the FFN's tanh GELU."""
    return KernelShapes(rms_norm=(cfg.dim,), bias_gelu=(cfg.ffn_dim // tp,))


def prepare_batch(cfg: WanConfig, batch: dict, device, **_) -> dict:
    """Host side, per micro-batch: one t per clip runs the time MLP per clip (model.clip_timesteps)."""
    return clip_timesteps(batch)


def objective_options(cfg: WanConfig) -> dict[str, dict]:
    """Flow matching over whole clips: every patch sees every patch of its clip; an A14B expert samples t on its side
    of the pipeline's boundary."""
    return {"flow_matching": {"mask": "bidirectional", **({"t_range": cfg.t_range()} if cfg.expert else {})}}
