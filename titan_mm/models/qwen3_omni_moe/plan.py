"""Qwen3-Omni-MoE thinker parallelize plan (data): Qwen3-VL-MoE's (titan_mm/models/qwen3_vl/plan.py: the Qwen3-MoE
decoder's FSDP units per block, TP as qwen3's, EP for the experts, SP / loss parallel / CP / PP entries; ViT blocks
as FSDP / AC / compile units and the ViT's encoder-TP entries) plus the audio encoder: every audio block is an FSDP
/ AC / compile unit, and with ``parallel.encoder_tp`` its q / k / v and fc1 are colwise, out_proj and fc2 rowwise
(all-reduced: the audio token stream stays replicated). The conv stem, ln_post and the projections stay in the
root unit. Every rank runs both towers on every micro-batch (stand-ins when it has no such media, model.py), so
their FSDP collectives always match."""

from __future__ import annotations

from titan_mm.models.qwen2_5_omni.plan import with_audio_tower
from titan_mm.models.qwen3_omni_moe.config import Qwen3OmniMoeConfig
from titan_mm.models.qwen3_vl import plan as vl_plan
from titan_mm.parallel.plan import ParallelizePlan


def plan(cfg: Qwen3OmniMoeConfig) -> ParallelizePlan:
    return with_audio_tower(vl_plan.plan(cfg))
