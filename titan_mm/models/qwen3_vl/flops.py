"""Training FLOPs of Qwen3-VL / Qwen3-VL-MoE: the LLM (titan_mm/models/qwen3/flops.py) plus the vision tower.

Vision tower, per batch (training = 3 x forward; a matmul of m x k by k x n is 2mkn forward FLOPs):
  6 * Np * (P*Dv + depth * (4*Dv^2 + 2*Dv*Iv))                 patch embed + ViT blocks' matmuls
  + 6 * Nm * (1 + n_deepstack) * (16*Dv^2 + 4*Dv*O)            patch merger + DeepStack mergers
  + 12 * depth * Dv * sum_segments L^2                         bidirectional attention (QK^T + PV),
                                                               one segment per image / video frame
  Np = patches, Nm = Np / merge^2 merged tokens, P = C*T*ps*ps, Dv = vision width, Iv = vision MLP width,
  O = LLM width.
Frozen parts are still counted at 3x forward (their backward to activations is still needed up to the
first trainable part; this over-counts a frozen ViT's weight gradients, which is the usual MFU convention).
MFU "LLM only" divides the LLM FLOPs alone by time (what most trainers report, lmms-engine included);
"total" adds the vision tower.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan_mm.models.qwen3 import flops as qwen3_flops
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig


def vision_flops(vcfg: VisionConfig, grid_thw: torch.Tensor | Iterable | None) -> float:
    """Training FLOPs of the vision tower over images/videos with these (t, h, w) patch grids."""
    if grid_thw is None:
        return 0.0
    grids = grid_thw.tolist() if hasattr(grid_thw, "tolist") else list(grid_thw)
    if not grids:
        return 0.0
    D, I, O, m2 = vcfg.hidden_size, vcfg.intermediate_size, vcfg.out_hidden_size, vcfg.spatial_merge_size**2
    n_patch = sum(t * h * w for t, h, w in grids)
    n_merged = n_patch // m2
    seg_sq = sum(t * (h * w) ** 2 for t, h, w in grids)
    mm = n_patch * (vcfg.patch_dim * D + vcfg.depth * (4 * D * D + 2 * D * I))
    mm += n_merged * (1 + len(vcfg.deepstack_visual_indexes)) * (16 * D * D + 4 * D * O)
    return 6.0 * mm + 12.0 * vcfg.depth * D * seg_sq


def flops_breakdown(cfg: Qwen3VLConfig, doc_lens: Iterable[int], image_grid_thw=None, video_grid_thw=None) -> dict:
    """{"llm": ..., "vision": ..., "total": ...} training FLOPs of one batch."""
    llm = qwen3_flops.flops(cfg.text, doc_lens)
    vis = vision_flops(cfg.vision, image_grid_thw) + vision_flops(cfg.vision, video_grid_thw)
    return {"llm": llm, "vision": vis, "total": llm + vis}


def flops(cfg: Qwen3VLConfig, doc_lens, image_grid_thw=None, video_grid_thw=None, **_) -> float:
    """Total training FLOPs (LLM + vision tower). ``doc_lens`` may also be a batch dict (then its
    ``cu_seqlens`` / ``doc_ids`` give the document lengths and its grids the vision work)."""
    if isinstance(doc_lens, dict):
        batch = doc_lens
        return flops_of_batch(cfg, batch)["total"]
    return flops_breakdown(cfg, doc_lens, image_grid_thw, video_grid_thw)["total"]


def flops_of_batch(cfg: Qwen3VLConfig, batch: dict) -> dict:
    """LLM / vision / total training FLOPs of a packed batch dict (host-side)."""
    return flops_breakdown(cfg, qwen3_flops.doc_lens_from_batch(batch), batch.get("image_grid_thw"),
                           batch.get("video_grid_thw"))


def num_params(cfg: Qwen3VLConfig) -> dict:
    """Parameter counts: llm, vision (ViT + mergers), total."""
    v = cfg.vision
    D, I = v.hidden_size, v.intermediate_size
    block = 4 * D * D + 4 * D + 2 * D * I + I + D + 4 * D  # qkv+proj (+bias), fc1/fc2 (+bias), 2 LayerNorms
    merger = lambda norm_dim: 2 * norm_dim + 16 * D * D + 4 * D + 4 * D * v.out_hidden_size + v.out_hidden_size  # noqa: E731
    vis = v.patch_dim * D + D + v.num_position_embeddings * D + v.depth * block + merger(D)
    vis += len(v.deepstack_visual_indexes) * merger(4 * D)
    llm = qwen3_flops.num_params(cfg.text)
    return {"llm": llm, "vision": vis, "total": llm + vis}
