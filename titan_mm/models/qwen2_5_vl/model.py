"""Qwen2.5-VL: Qwen3-VL's model (titan_mm/models/qwen3_vl/model.py: embed -> trunk -> head, the visual-token
scatter through the host-built ``visual_index``, ``embed_out`` for sequence parallel, freezing and per-part
learning rates) with the Qwen2 decoder as the language model, the Qwen2.5-VL vision tower (vision.py; no
DeepStack, so the stream carries no additions) and chunked M-RoPE.

Parameter names (titan): ``visual.*`` (vision.py; HF names in hf.py) and ``language_model.*`` (the Qwen2 /
Qwen3 decoder's: tok_embeddings, layers.{i}.attn.{wq,wk,wv}.{weight,bias}, ..., norm, output).

Positions: ``position_ids`` [3, B, S] (t, h, w) as HF's get_rope_index (:func:`rope_index`: an image's t is 0;
a video's t advances by tokens_per_second * second_per_grid_t per temporal patch), or [B, S] for text only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn

from titan_mm.nn.media import mrope_index
from titan_mm.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from titan_mm.models.qwen2_5_vl.vision import VisionTower, build_window_meta
from titan_mm.models.qwen3.model import Qwen3Model
from titan_mm.models.qwen3_vl.model import (GRID_KEYS, EmbedOutput, Qwen3VLModel, apply_freeze, consume,
                                            vision_backend, visual_index)


def chunked_mrope_cos_sin(position_ids_3BS: torch.Tensor, inv_freq_F: torch.Tensor, section: tuple[int, int, int],
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked M-RoPE cos / sin [B, S, K] (HF Qwen2-VL / Qwen2.5-VL): frequencies 0 .. s_t-1 rotate by the t
    position, the next s_h by h, the last s_w by w. fp32, returned in ``dtype``."""
    if position_ids_3BS.dim() == 2:  # text only: t = h = w
        position_ids_3BS = position_ids_3BS[None].expand(3, -1, -1)
    j = torch.arange(inv_freq_F.shape[0], device=inv_freq_F.device)
    use_h = (j >= section[0]) & (j < section[0] + section[1])
    use_w = j >= section[0] + section[1]
    f_3BSF = position_ids_3BS[..., None].float() * inv_freq_F.float()
    f_BSF = torch.where(use_h, f_3BSF[1], torch.where(use_w, f_3BSF[2], f_3BSF[0]))
    emb = torch.cat([f_BSF, f_BSF], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen2_5_VLModel(Qwen3VLModel):
    """Qwen3VLModel's forward on other parts: only the modules and the rope differ."""

    def __init__(self, cfg: Qwen2_5_VLConfig):
        nn.Module.__init__(self)  # Qwen3VLModel.__init__ would build Qwen3-VL's tower
        self.cfg = cfg
        self.language_model = Qwen3Model(cfg.decoder)
        self.visual = VisionTower(cfg.vision, self.language_model.ops)
        self.embed_out = EmbedOutput()
        apply_freeze(self, cfg)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunked M-RoPE cos / sin [B, S, K] from position_ids [3, B, S] (or [B, S] for text only)."""
        return chunked_mrope_cos_sin(position_ids, self.language_model.rope_inv_freq, self.cfg.mrope_section, dtype)


def rope_index(kinds_L, image_grids, video_grids, cfg: Qwen2_5_VLConfig, second_per_grid_ts=None) -> np.ndarray:
    """Host side: [3, L] int64 (t, h, w) positions of one document, as HF Qwen2.5-VL's get_rope_index.
    ``kinds_L``: per token 0 text, 1 image pad, 2 video pad; one run of pads per image / video (a video is one
    run of t * h * w / merge**2 pads); ``second_per_grid_ts``: seconds per temporal patch of each video
    (default 1). The data pipeline's rule (titan_mm.nn.media.mrope_index), with this config's numbers."""
    n_videos = len(np.asarray(video_grids, dtype=np.int64).reshape(-1, 3))
    secs = np.ones(n_videos) if second_per_grid_ts is None else second_per_grid_ts
    return mrope_index(kinds_L, image_grids, video_grids, cfg.vision.spatial_merge_size, secs,
                       cfg.vision.tokens_per_second)


def vision_inputs(cfg: Qwen2_5_VLConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Host side: ``{"vision_meta", "visual_index"}`` for a batch with pixels ({} without): the window order,
    its inverse and both attention metadata over the images then the videos, and ``visual_index`` [B, S]."""
    device = torch.device(device)
    grids, n_img, m2 = [], 0, cfg.vision.spatial_merge_size**2
    for pk, gk in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if batch.get(pk) is not None and batch[pk].numel():
            g = batch.get(gk)
            if g is None:
                raise ValueError(f"batch has {pk} but no {gk}; the data pipeline must provide the (t, h, w) grids.")
            grids.append(g.cpu())
            if pk == "pixel_values":
                n_img = int((grids[-1].prod(-1) // m2).sum())
    if not grids:
        return {}
    meta = build_window_meta(torch.cat(grids), cfg.vision, vision_backend(cfg, device), device, cfg.vision_bucket)
    idx = visual_index(batch["input_ids"].cpu(), cfg.image_token_id, cfg.video_token_id, n_img)
    return {"vision_meta": meta._replace(n_image_tokens=n_img), "visual_index": idx.to(device, non_blocking=True)}


CONSUMED_KEYS = (*GRID_KEYS, "video_second_per_grid")
"""What prepare_batch consumes: the grids (into ``vision_meta`` / ``visual_index``) and ``video_second_per_grid``,
which the data pipeline's ``position_ids`` already hold (:func:`rope_index`). The forward takes none of them."""


def prepare_batch(cfg: Qwen2_5_VLConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The family's ModelSpec.prepare_batch: the batch with :func:`vision_inputs` in place of
    :data:`CONSUMED_KEYS`, on the host, before the batch moves to the device and before any context-parallel split."""
    return {**consume(batch, CONSUMED_KEYS), **vision_inputs(cfg, batch, device)}


def build(cfg: Qwen2_5_VLConfig) -> Qwen2_5_VLModel:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen2_5_VLModel(cfg)
