"""Qwen2.5-Omni thinker parallelize plan (data): Qwen2.5-VL's (titan_mm/models/qwen2_5_vl/plan.py: the Qwen2
decoder's TP as qwen2's, ViT blocks as FSDP / AC / compile units, the ViT's encoder-TP entries) plus the audio
encoder: every audio block is an FSDP / AC / compile unit, and with ``parallel.encoder_tp`` its q / k / v and fc1
are colwise, out_proj and fc2 rowwise (all-reduced: the audio token stream stays replicated). The convs, ln_post
and proj stay in the root unit. Every rank runs both towers on every micro-batch (stand-ins when it has no such
media, model.py), so their FSDP collectives always match."""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from titan_mm.models.qwen2_5_vl import plan as vl_plan
from titan_mm.parallel.plan import ParallelizePlan

AUDIO_BLOCKS = ("audio_tower.blocks.?", "audio_tower.blocks.??")


def plan(cfg: Qwen2_5OmniConfig) -> ParallelizePlan:
    return with_audio_tower(vl_plan.plan(cfg))


def with_audio_tower(p: ParallelizePlan) -> ParallelizePlan:
    """A vision-language plan plus the audio encoder's units and encoder-TP entries (both Omni thinkers)."""
    audio_tp = {
        "audio_tower.blocks.*.self_attn.q_proj": "colwise",
        "audio_tower.blocks.*.self_attn.k_proj": "colwise",
        "audio_tower.blocks.*.self_attn.v_proj": "colwise",
        "audio_tower.blocks.*.self_attn.out_proj": "rowwise",
        "audio_tower.blocks.*.fc1": "colwise",
        "audio_tower.blocks.*.fc2": "rowwise",
    }
    return dataclasses.replace(p, fsdp_units=AUDIO_BLOCKS + p.fsdp_units, ac_units=AUDIO_BLOCKS + p.ac_units,
                               compile_units=AUDIO_BLOCKS + p.compile_units, encoder_tp={**p.encoder_tp, **audio_tp},
                               pp_first=("audio_tower",) + p.pp_first)
