"""Qwen3-VL / Qwen3-VL-MoE activation terms for the memory estimator (titan_mm/parallel/memory.py): the
text model's are Qwen3's (titan_mm/models/qwen3/memory.py), plus the ViT blocks, the stem (patch embedding,
mergers) and the DeepStack additions. The ViT and the mergers are divided by tp only with
``topo.encoder_tp`` (``parallel.encoder_tp``; their patch stream is never sequence-split); sequence parallel
cuts the DeepStack additions to the local shard with the embeddings."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from titan_mm.models.qwen3 import memory as qwen3_memory
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig
from titan_mm.registry import BlockBytes, MemoryTerms

if TYPE_CHECKING:
    from titan_mm.parallel.memory import Topology


def vision_block_bytes(cfg: Qwen3VLConfig, topo: Topology, act_bytes: int = 2, *, compile: bool = True) -> BlockBytes:
    """Saved bytes per patch of one ViT block: LayerNorm inputs (2 Dv) + fp32 mean / rstd, their outputs as
    linear inputs (2 Dv), the qkv projection output (3 Dv: v is a view of it and keeps it alive), rotated q
    and k (2 Dv), attention output (Dv) + fp32 lse, fc1 output (Iv; eager also keeps gelu's output).
    Replicated over tp unless ``topo.encoder_tp``: then the per-head and MLP-channel terms (everything but
    the LayerNorms and the linear inputs) are divided by tp."""
    v = cfg.vision
    a = act_bytes
    Dv, Iv, Hv = v.hidden_size, v.intermediate_size, v.num_heads
    t = topo.tp if topo.encoder_tp else 1
    full = a * (4 * Dv + (6 * Dv + Iv * (1 if compile else 2)) / t) + 16 + 4 * Hv / t
    # block input, qkv output, attention output, proj output, fc1 output, fc2 output + lse
    selective = a * (Dv + (3 * Dv + Dv) / t + Dv + Iv / t + Dv) + 4 * Hv / t
    kept = {"none": full, "selective": selective, "full": a * Dv}[topo.ac]
    return BlockBytes(kept, full, 2 * a * Iv / t)


def vision_stem_bytes(cfg: Qwen3VLConfig, topo: Topology, act_bytes: int = 2) -> float:
    """Saved bytes per patch outside the ViT blocks: patch-embedding input, the main merger (LayerNorm
    input, fc1 input, fc1 / gelu outputs: 4 Dv per patch) and each DeepStack merger (3 Dv per patch; its
    LayerNorm input is the block output, kept by the next block). With ``topo.encoder_tp`` the fc1 / gelu
    outputs are divided by tp."""
    v = cfg.vision
    a = act_bytes
    t = topo.tp if topo.encoder_tp else 1
    return a * v.patch_dim + a * v.hidden_size * ((2 + 2 / t) + (1 + 2 / t) * len(v.deepstack_visual_indexes))


def deepstack_bytes(cfg: Qwen3VLConfig, topo: Topology, act_bytes: int = 2) -> float:
    """Bytes per text token of the DeepStack additions, alive through the forward (one [N, D] per DeepStack
    layer; sequence parallel cuts them to the local shard with the embeddings)."""
    st = topo.tp if topo.sp else 1
    return act_bytes * cfg.text.hidden_size * len(cfg.vision.deepstack_visual_indexes) / st


def memory_terms(cfg: Qwen3VLConfig, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    """The estimator's terms of a Qwen3-VL model: Qwen3's for ``cfg.text`` plus the vision tower's
    (``kernels``: None = the config's)."""
    text = qwen3_memory.memory_terms(cfg.text, topo, act_bytes, kernels=kernels, compile=compile, float8=float8)
    return dataclasses.replace(
        text,
        vision=vision_block_bytes(cfg, topo, act_bytes, compile=compile),
        vision_stem=vision_stem_bytes(cfg, topo, act_bytes),
        vision_head=deepstack_bytes(cfg, topo, act_bytes),
    )
