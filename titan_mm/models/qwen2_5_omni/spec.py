"""The Qwen2.5-Omni thinker's answers to the family contract (titan_mm.registry.ModelSpec): Qwen2.5-VL's
(titan_mm/models/qwen2_5_vl/spec.py: the Qwen2 decoder, the ViT's shapes, the visual tokens, ChatML) plus the
audio tokens, the audio front end (:data:`AUDIO`: clips padded to 30 s), its special-token names (:data:`TOKENIZER`,
``builtin:qwen2_5_omni``) and the audio encoder's LayerNorm / MLP widths. Videos follow Qwen2_5OmniProcessor
(:data:`VISION_LAYOUT`), a video part may interleave its own audio track (use_audio_in_video), and positions are
TMRoPE, which this family's prepare_batch builds itself."""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen2_5_omni.audio import audio_tokens
from titan_mm.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from titan_mm.models.qwen2_5_vl import spec as vl_spec
from titan_mm.nn.media import AudioFrontEnd
from titan_mm.registry import DataNeeds, FusedRows, Runtime, TokenizerNames

# Qwen2_5OmniProcessor: Qwen2.5-VL's frames and sizes, a temporal patch timed by the requested fps; a video's own
# audio interleaves per seconds_per_chunk
VISION_LAYOUT = dataclasses.replace(vl_spec.VISION_LAYOUT, video_time="requested_fps", audio_in_video="chunks")
AUDIO = AudioFrontEnd(tokens=audio_tokens, max_seconds=30)  # every clip padded and truncated to Whisper's 30 s
# builtin:qwen2_5_omni: Qwen2.5's BPE (= Qwen3's) with Qwen2.5-Omni's names of its added tokens, at the same ids
TOKENIZER = TokenizerNames(base="qwen3", renames={
    151646: "<|AUDIO|>", 151647: "<|audio_bos|>", 151648: "<|audio_eos|>", 151652: "<|vision_bos|>",
    151653: "<|vision_eos|>", 151655: "<|IMAGE|>", 151656: "<|VIDEO|>"})

dims = vl_spec.dims
kernel_shapes = vl_spec.kernel_shapes  # the audio encoder calls no titan_mm.kernels op (LayerNorm, exact GELU)


def runtime(cfg: Qwen2_5OmniConfig) -> Runtime:
    return vl_spec.runtime(cfg)


def with_runtime(cfg: Qwen2_5OmniConfig, attn_backend: str, kernels: bool | str) -> Qwen2_5OmniConfig:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def data_needs(cfg: Qwen2_5OmniConfig) -> DataNeeds:
    needs = vl_spec.data_needs(cfg)
    audio = {"audio_pad": cfg.audio_token_id, "audio_start": cfg.audio_start_token_id,
             "audio_end": cfg.audio_end_token_id}
    # video time in TMRoPE's units: position_id_per_seconds, not the ViT's tokens_per_second
    return dataclasses.replace(needs, special_tokens={**needs.special_tokens, **audio}, video=True,
                               vision_layout=VISION_LAYOUT, video_tokens_per_second=cfg.position_id_per_seconds,
                               seconds_per_chunk=cfg.seconds_per_chunk, audio=AUDIO)


def fused_params(cfg: Qwen2_5OmniConfig) -> dict[str, FusedRows]:
    return vl_spec.fused_params(cfg)
