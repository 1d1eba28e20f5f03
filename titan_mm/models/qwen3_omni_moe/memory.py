"""Qwen3-Omni-MoE thinker activation terms for the memory estimator: Qwen3-VL-MoE's (qwen3_vl/memory.py: the
Qwen3-MoE decoder, the ViT blocks, stem and DeepStack additions). The estimator has one encoder slot (per patch),
so the audio encoder is not counted: its tokens are few next to the decoder's (12.5 per second of audio, 1280 wide,
32 blocks); docs/qwen3_omni_moe.md lists it as not done."""

from __future__ import annotations

from titan_mm.models.qwen3_vl.memory import memory_terms

__all__ = ["memory_terms"]
