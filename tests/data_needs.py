"""Data needs for data tests that run without a model: Qwen3-VL's (16-pixel patches over 2 frames, 2x2 merge,
M-RoPE positions, its vision token ids, the Instruct chat template), as its family's spec states them.

    from tests.data_needs import QWEN3_VL_NEEDS     # the repo root is on sys.path (pytest's pythonpath)

OMNI_NEEDS adds Qwen2.5-Omni's audio front end (its vision ids are Qwen3-VL's), for the audio data tests.
"""

import dataclasses

from titan_mm.models.qwen2_5_omni.spec import AUDIO as QWEN2_5_OMNI_AUDIO
from titan_mm.data.vision import mrope_positions
from titan_mm.models.qwen3_vl.spec import VISION_LAYOUT as QWEN3_VL_LAYOUT
from titan_mm.registry import DataNeeds

QWEN3_VL_NEEDS = DataNeeds(
    positions="mrope", doc_positions=mrope_positions, patch_size=16, temporal_patch_size=2, merge_size=2, chat_template="chatml",
    special_tokens={"vision_start": 151652, "vision_end": 151653, "image_pad": 151655, "video_pad": 151656},
    vision_layout=QWEN3_VL_LAYOUT,
)

OMNI_NEEDS = dataclasses.replace(QWEN3_VL_NEEDS, audio=QWEN2_5_OMNI_AUDIO)
