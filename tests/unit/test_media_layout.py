"""Media layouts are the family's (titan_mm/nn/media.py, DataNeeds.vision_layout / audio): every vision family states
one that the processors accept, the Omni families an audio front end counted by their own audio tower, and a wrong
layout is one line naming the field and its choices."""

import dataclasses

import pytest

from titan_mm.data.processors import ProcessorConfig
from titan_mm.nn.media import AudioFrontEnd, VisionLayout
from titan_mm.registry import DataNeeds, families


def _needs():
    for spec in families():
        yield spec.name, spec.data_needs(spec.flavor("debug"))


def test_every_vision_family_states_its_layout():
    for name, needs in _needs():
        if needs.patch_size:
            assert isinstance(needs.vision_layout, VisionLayout), name
        assert needs.audio is None or isinstance(needs.audio, AudioFrontEnd), name
        ProcessorConfig(needs=needs)  # accepted as the family states it


def test_layouts_differ_where_the_hf_processors_do():
    layouts = {name: needs.vision_layout for name, needs in _needs() if needs.patch_size}
    assert layouts["qwen3_5"] == layouts["qwen3_vl"]  # Qwen3.5 processes media as Qwen3-VL
    assert not layouts["qwen3_vl"].one_run and layouts["qwen2_5_vl"].one_run
    assert layouts["qwen2_5_omni"] == dataclasses.replace(layouts["qwen2_5_vl"], video_time="requested_fps",
                                                          audio_in_video="chunks")
    assert layouts["qwen3_omni_moe"] == dataclasses.replace(layouts["qwen2_5_omni"], mean=layouts["qwen3_vl"].mean,
                                                            std=layouts["qwen3_vl"].std, audio_in_video="by_time")


def test_bad_layouts_are_one_line():
    with pytest.raises(ValueError, match=r"VisionLayout.frames must be one of \('linspace', 'strided'\), got 'even'"):
        VisionLayout(mean=(0.5,) * 3, std=(0.5,) * 3, frames="even")
    with pytest.raises(ValueError, match="DataNeeds.vision_layout must be a titan_mm.nn.media.VisionLayout when "
                                         "patch_size is set"):
        ProcessorConfig(needs=DataNeeds(positions="mrope", patch_size=16, temporal_patch_size=2, merge_size=2))
    with pytest.raises(ValueError, match="DataNeeds.audio must be None"):
        ProcessorConfig(needs=DataNeeds(audio="qwen3_omni"))
