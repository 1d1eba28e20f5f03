"""Data needs for data tests that run without a model: Qwen3-VL's (16-pixel patches over 2 frames, 2x2 merge,
M-RoPE positions, its vision token ids, the Instruct chat template), as its family's spec states them.

    from tests.data_needs import QWEN3_VL_NEEDS     # the repo root is on sys.path (pytest's pythonpath)

OMNI_NEEDS adds Qwen2.5-Omni's audio front end (its vision ids are Qwen3-VL's), for the audio data tests.
"""

import dataclasses

from titan_mm.registry import DataNeeds

QWEN3_VL_NEEDS = DataNeeds(
    positions="mrope", patch_size=16, temporal_patch_size=2, merge_size=2, chat_template="qwen3_vl",
    special_tokens={"vision_start": 151652, "vision_end": 151653, "image_pad": 151655, "video_pad": 151656},
)

OMNI_NEEDS = dataclasses.replace(QWEN3_VL_NEEDS, audio_encoder="qwen2_5_omni")
