"""The Qwen3-Omni-MoE thinker's answers to the family contract (titan_mm.registry.ModelSpec): Qwen3-VL-MoE's
(titan_mm/models/qwen3_vl/spec.py: the Qwen3-MoE decoder, the ViT's shapes, the visual tokens, ChatML) plus the
audio tokens and the audio front end (:data:`AUDIO`: clips unpadded, 13 tokens per 100-frame window). Videos follow
Qwen3OmniMoeProcessor (:data:`VISION_LAYOUT`: Qwen2VLVideoProcessor's frames, one pad run per video, no timestamps), a video part may interleave its own audio track (use_audio_in_video, merged
by time), and positions are built by this family's prepare_batch."""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen2_5_omni import spec as omni_spec
from titan_mm.models.qwen3_omni_moe.audio import output_lengths
from titan_mm.models.qwen3_omni_moe.config import Qwen3OmniMoeConfig
from titan_mm.models.qwen3_vl import spec as vl_spec
from titan_mm.nn.media import AudioFrontEnd
from titan_mm.registry import DataNeeds

# Qwen3OmniMoeProcessor: Qwen2.5-Omni's frames, sizes and timing with Qwen3-VL's mean / std 0.5; a video's own audio
# merged with it by time
VISION_LAYOUT = dataclasses.replace(omni_spec.VISION_LAYOUT, mean=vl_spec.VISION_LAYOUT.mean,
                                    std=vl_spec.VISION_LAYOUT.std, audio_in_video="by_time")
AUDIO = AudioFrontEnd(tokens=output_lengths)  # one clip per processor call: no padding or truncation

dims = vl_spec.dims
runtime = vl_spec.runtime
with_runtime = vl_spec.with_runtime
kernel_shapes = vl_spec.kernel_shapes  # the audio encoder calls no titan_mm.kernels op (LayerNorm, exact GELU)
fused_params = vl_spec.fused_params


def data_needs(cfg: Qwen3OmniMoeConfig) -> DataNeeds:
    needs = vl_spec.data_needs(cfg)
    audio = {"audio_pad": cfg.audio_token_id, "audio_start": cfg.audio_start_token_id,
             "audio_end": cfg.audio_end_token_id}
    # video time in the positions' units: position_id_per_seconds
    return dataclasses.replace(needs, special_tokens={**needs.special_tokens, **audio}, video=True,
                               vision_layout=VISION_LAYOUT, video_tokens_per_second=cfg.position_id_per_seconds,
                               audio=AUDIO)
