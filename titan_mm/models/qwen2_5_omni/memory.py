"""Qwen2.5-Omni activation terms for the memory estimator: Qwen2.5-VL's (qwen2_5_vl/memory.py: the Qwen2
decoder, the ViT blocks and stem). The estimator has one encoder slot (per patch), so the audio encoder is not
counted: its tokens are few next to the decoder's (25 per second of audio, 1280 wide, 32 blocks), and it is
listed in docs/qwen2_5_omni.md as not done."""

from __future__ import annotations

from titan_mm.models.qwen2_5_vl.memory import memory_terms

__all__ = ["memory_terms"]
