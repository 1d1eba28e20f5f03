"""Qwen2.5-VL parallelize plan (data): Qwen3-VL's (titan_mm/models/qwen3_vl/plan.py) on the Qwen2 decoder
(qwen2's TP: q/k/v colwise with their biases, no qk-norm entries), with this tower's encoder-TP entries: ViT
``wqkv`` (head-major) and the SwiGLU gate / up colwise, ``proj`` / down rowwise, the merger's ``mlp.0``
colwise and ``mlp.2`` rowwise. ViT blocks are FSDP / AC / compile units; no DeepStack mergers."""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from titan_mm.models.qwen3_vl import plan as vl_plan
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig
from titan_mm.parallel.plan import ParallelizePlan


def plan(cfg: Qwen2_5_VLConfig) -> ParallelizePlan:
    # Qwen3-VL's plan reads only the text config and whether there are DeepStack mergers
    dec = cfg.decoder
    vl = Qwen3VLConfig(text=dec, vision=VisionConfig(out_hidden_size=dec.hidden_size, deepstack_visual_indexes=()),
                       mrope_section=(dec.head_dim // 2, 0, 0), tie_word_embeddings=dec.tie_word_embeddings)
    p = vl_plan.plan(vl)
    encoder_tp = {
        "visual.blocks.*.attn.wqkv": "colwise",
        "visual.blocks.*.attn.proj": "rowwise",
        "visual.blocks.*.mlp.gate_proj": "colwise",
        "visual.blocks.*.mlp.up_proj": "colwise",
        "visual.blocks.*.mlp.down_proj": "rowwise",
        "visual.merger.mlp.0": "colwise",
        "visual.merger.mlp.2": "rowwise",
    }
    return dataclasses.replace(p, encoder_tp=encoder_tp)
