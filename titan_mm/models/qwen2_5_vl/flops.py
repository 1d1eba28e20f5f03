"""Training FLOPs of Qwen2.5-VL: the Qwen2 decoder (qwen2/flops.py) plus the vision tower.

Vision tower, per batch (training = 3 x forward; an m x k by k x n matmul is 2mkn forward FLOPs):
  6 * Np * (P*Dv + depth * (4*Dv^2 + 3*Dv*Iv))          patch embed + ViT blocks (qkv, proj, SwiGLU)
  + 6 * Nm * (16*Dv^2 + 4*Dv*O)                         patch merger
  + 12 * Dv * (n_full * sum_frames L^2 + (depth - n_full) * sum_windows L^2)   attention (QK^T + PV)
  Np patches, Nm = Np / merge^2, L = a frame's or a window's patches, n_full = len(fullatt_block_indexes).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan_mm.models.qwen2 import flops as qwen2_flops
from titan_mm.models.qwen2_5_vl.config import Qwen2_5_VLConfig, VisionConfig
from titan_mm.models.qwen2_5_vl.vision import window_order
from titan_mm.models.qwen3 import flops as qwen3_flops


def vision_flops(vcfg: VisionConfig, grid_thw) -> float:
    """Training FLOPs of the vision tower over images / videos with these (t, h, w) patch grids."""
    if grid_thw is None:
        return 0.0
    grids = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3)
    if not len(grids):
        return 0.0

    D, I, O, m2 = vcfg.hidden_size, vcfg.intermediate_size, vcfg.out_hidden_size, vcfg.spatial_merge_size**2
    n_patch = int(grids.prod(-1).sum())
    frame_sq = sum(t * (h * w) ** 2 for t, h, w in grids.tolist())
    window_sq = sum(n * n for n in window_order(grids, vcfg)[1])
    n_full = len(vcfg.fullatt_block_indexes)
    mm = n_patch * (vcfg.patch_dim * D + vcfg.depth * (4 * D * D + 3 * D * I))
    mm += n_patch // m2 * (16 * D * D + 4 * D * O)
    return 6.0 * mm + 12.0 * D * (n_full * frame_sq + (vcfg.depth - n_full) * window_sq)


def flops_breakdown(cfg: Qwen2_5_VLConfig, doc_lens: Iterable[int], image_grid_thw=None, video_grid_thw=None) -> dict:
    llm = qwen2_flops.flops(cfg.text, doc_lens)
    vis = vision_flops(cfg.vision, image_grid_thw) + vision_flops(cfg.vision, video_grid_thw)
    return {"llm": llm, "vision": vis, "total": llm + vis}


def flops(cfg: Qwen2_5_VLConfig, doc_lens, image_grid_thw=None, video_grid_thw=None, **_) -> float:
    """Total training FLOPs (LLM + vision tower); ``doc_lens`` may also be a batch dict."""
    if isinstance(doc_lens, dict):
        b = doc_lens
        return flops_breakdown(cfg, qwen3_flops.doc_lens_from_batch(b), b.get("image_grid_thw"),
                               b.get("video_grid_thw"))["total"]
    return flops_breakdown(cfg, doc_lens, image_grid_thw, video_grid_thw)["total"]
