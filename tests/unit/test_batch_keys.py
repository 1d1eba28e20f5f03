"""A family's prepare_batch consumes what it turns into metadata (docs/models.md "Batch keys"): after it, every batch
key the train step hands the forward as a keyword (titan_mm.train.step.model_inputs) is a parameter of the forward,
and no forward lists a key a prepare_batch consumes (the grids, seconds per grid, clip lengths, HF's
use_audio_in_video). HF's use_audio_in_video, when a batch carries it, must say what the tokens say."""

from __future__ import annotations

import inspect

import pytest
import torch

from titan_mm.models.qwen2_5_omni import synthetic as omni_syn
from titan_mm.models.qwen2_5_omni.thinker import CONSUMED_KEYS
from titan_mm.models.qwen3_vl import synthetic as vl_syn
from titan_mm.objectives import CausalLM
from titan_mm.registry import resolve_model
from titan_mm.train.step import model_inputs

VL = {"qwen3_vl": (8, 8), "qwen3_5": (8, 8), "qwen2_5_vl": (8, 8)}
OMNI = ("qwen2_5_omni", "qwen3_omni_moe")


def _batch(family: str, cfg) -> dict:
    g = torch.Generator().manual_seed(0)
    if family in OMNI:
        s = omni_syn.make_sample(cfg, [("text", 4), ("image", (4, 4)), ("audio", 120), ("text", 3)], g)
        return omni_syn.pack([s], cfg)
    s = vl_syn.make_sample(cfg, [("text", 4), ("image", VL[family]), ("text", 3), ("video", (2, 4, 4)),
                                 ("text", 2)], g)
    return vl_syn.pack([s], cfg)


def _forward_params(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


@pytest.mark.parametrize("family", [*VL, *OMNI])
def test_prepared_batch_holds_only_what_the_forward_reads(family):
    spec, cfg = resolve_model(family, "debug")
    with torch.device("meta"):
        model = spec.build(cfg)
    batch = _batch(family, cfg)
    prepared = spec.prepare_batch(cfg, batch, "cpu")
    consumed = {"image_grid_thw", "video_grid_thw"} | (set(CONSUMED_KEYS) if family in OMNI else set())
    assert consumed & set(batch) and not consumed & set(prepared), sorted(prepared)
    assert not consumed & _forward_params(model), f"{family}'s forward still lists {consumed & _forward_params(model)}"
    inputs = model_inputs(prepared, CausalLM())
    assert set(inputs) <= _forward_params(model), sorted(set(inputs) - _forward_params(model))
    assert {"pixel_values", "vision_meta" if family not in OMNI else "omni_meta"} <= set(inputs)
    assert batch.keys() >= {"image_grid_thw"}  # the host's batch is left as it was (the trainer's FLOPs read it)


@pytest.mark.parametrize("family", OMNI)
def test_use_audio_in_video_must_match_the_tokens(family):
    spec, cfg = resolve_model(family, "debug")
    batch = _batch(family, cfg)  # an image and a clip, no video: the flag's False is true, its True a claim
    assert "use_audio_in_video" not in spec.prepare_batch(cfg, {**batch, "use_audio_in_video": False}, "cpu")
    vs = torch.nonzero(batch["input_ids"][0] == cfg.vision_start_token_id)[0, 0]
    ids = batch["input_ids"].clone()
    ids[0, vs + 1] = cfg.video_token_id  # now the batch's first visual part reads as a video alone
    with pytest.raises(ValueError, match=r"use_audio_in_video=True, but 1 video\(s\) of the batch have no audio") as e:
        spec.prepare_batch(cfg, {**batch, "input_ids": ids, "use_audio_in_video": True}, "cpu")
    assert "\n" not in str(e.value)
    ids[0, vs + 1] = cfg.audio_start_token_id  # <vision_start><audio_start>: a video with its audio interleaved
    with pytest.raises(ValueError, match=r"use_audio_in_video=False, but 1 video\(s\) of the batch have their audio"):
        spec.prepare_batch(cfg, {**batch, "input_ids": ids, "use_audio_in_video": False}, "cpu")
