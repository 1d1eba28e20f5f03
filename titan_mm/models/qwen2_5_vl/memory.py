"""Qwen2.5-VL activation terms for the memory estimator: the Qwen2 decoder's (qwen2/memory.py), plus the ViT
blocks' and the stem's, adapted from Qwen3-VL's (qwen3_vl/memory.py): RMSNorm (fp32 rstd only), SwiGLU
(gate and up outputs saved: 2 Iv instead of Iv), no DeepStack. Divided by tp only with ``topo.encoder_tp``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from titan_mm.models.qwen2 import memory as qwen2_memory
from titan_mm.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from titan_mm.registry import BlockBytes, MemoryTerms

if TYPE_CHECKING:
    from titan_mm.parallel.memory import Topology


def vision_block_bytes(cfg: Qwen2_5_VLConfig, topo: Topology, act_bytes: int = 2, *,
                       compile: bool = True) -> BlockBytes:
    """Saved bytes per patch of one ViT block: norm inputs (2 Dv) + fp32 rstd, the linear inputs (2 Dv), qkv
    output (3 Dv), rotated q, k (2 Dv), attention output (Dv) + fp32 lse, gate and up outputs (2 Iv; eager
    also keeps silu's output) and the SwiGLU product (Iv)."""
    v = cfg.vision
    a, Dv, Iv, Hv = act_bytes, v.hidden_size, v.intermediate_size, v.num_heads
    t = topo.tp if topo.encoder_tp else 1
    full = a * (4 * Dv + (6 * Dv + Iv * (3 if compile else 4)) / t) + 8 + 4 * Hv / t
    selective = a * (Dv + 4 * Dv / t + Dv + 3 * Iv / t + Dv) + 4 * Hv / t
    kept = {"none": full, "selective": selective, "full": a * Dv}[topo.ac]
    return BlockBytes(kept, full, 3 * a * Iv / t)


def vision_stem_bytes(cfg: Qwen2_5_VLConfig, topo: Topology, act_bytes: int = 2) -> float:
    """Per patch outside the blocks: the (window-ordered) patch-embedding input and the merger (RMSNorm input,
    fc1 input, fc1 / gelu outputs)."""
    v = cfg.vision
    t = topo.tp if topo.encoder_tp else 1
    return act_bytes * (v.patch_dim + v.hidden_size * (2 + 2 / t))


def memory_terms(cfg: Qwen2_5_VLConfig, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    text = qwen2_memory.memory_terms(cfg.text, topo, act_bytes, kernels=kernels, compile=compile, float8=float8)
    return dataclasses.replace(text, vision=vision_block_bytes(cfg, topo, act_bytes, compile=compile),
                               vision_stem=vision_stem_bytes(cfg, topo, act_bytes))
