"""Video parity with transformers' Qwen3OmniMoeProcessor for the Qwen3-Omni-MoE family's DataNeeds (debug flavor;
offline: the built-in Qwen2.5-Omni tokenizer, whose audio ids the debug flavor uses). HF's processor is built with
__new__: Qwen2VLImageProcessorPil and test_processor_qwen2_5_vl.py's Qwen2VLVideoProcessor (HF's own functions) with
the family's patch 16 / merge 2 and mean / std 0.5, the pixel bounds of HF's videos_kwargs, WhisperFeatureExtractor
with 128 bins and Qwen3-Omni's audio_kwargs (no 30 s padding / truncation). HF is handed fps = data.video_fps (its
processor times a temporal patch by the requested fps, 1.0 when absent) and the model's position_id_per_seconds.
Videos of 1 frame and of an odd frame count: ids, grids, pixels, video_second_per_grid. A video part with
``use_audio_in_video``: its track decoded once and handed to HF; the pads are the video's and the audio's merged by
time, video first on ties (HF's replace_video_with_audio_token); features, lengths, counts equal. Positions of a
packed row equal HF's get_rope_index per document. A video without an audio track asked for it is skipped; the
loader trains such a record. Clips of 0.1 / 1 / 30 / 31 s alone: test_processor_audio.py (Qwen3-Omni's parity).
"""

import types

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_omni_moe")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_q3  # noqa: E402
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor  # noqa: E402

from titan_mm.data import vision  # noqa: E402
from titan_mm.data.audio import decode_audio  # noqa: E402
from titan_mm.data.processors import Processor, ProcessorConfig  # noqa: E402
from titan_mm.data.schema import parse_record  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

from tests.parity import test_processor_qwen2_5_omni_video as q25  # noqa: E402
from tests.parity.test_processor_qwen2_5_omni_video import AIV, _video, _video_part, hf_tok, tok  # noqa: E402,F401
from tests.parity.test_processor_qwen2_5_vl import IMG_MAX, IMG_MIN, HFVideoProcessor, _chat  # noqa: E402

SPEC = get_model_spec("qwen3_omni_moe")
MODEL = SPEC.flavor("debug")
NEEDS = SPEC.data_needs(MODEL)
OMNI = q25.OMNI  # the built-in tokenizer with the Omni tokens at the debug flavor's ids
VID_MIN, VID_MAX = (Qwen3OmniMoeProcessor.videos_kwargs["size"][k] for k in ("shortest_edge", "longest_edge"))
NORM = (0.5, 0.5, 0.5)  # Qwen3-VL's image / video mean and std


class HFVideo(HFVideoProcessor):
    """Qwen2VLVideoProcessor with the family's patch, mean / std and HF Qwen3-Omni's per-frame pixel bounds."""
    patch_size, mean, std, min_pixels, max_pixels = MODEL.vision.patch_size, NORM, NORM, VID_MIN, VID_MAX

    def __call__(self, videos, fps=None, **kwargs):  # HF's processor hands its videos_kwargs' fps to the sampler
        self.fps = self.fps if fps is None else fps
        return super().__call__(videos, **kwargs)


def _cfg(**data) -> ProcessorConfig:
    """Qwen2.5-Omni's test data settings (fps 2, HF's frame bounds), this family's needs and video pixel bounds."""
    return ProcessorConfig(q25._cfg(**{"video_min_pixels": VID_MIN, "video_max_pixels": VID_MAX, **data}).data, NEEDS)


def hf_processor(hf_tok, native_fps):
    """Qwen3OmniMoeProcessor without its __init__ (which would also read the token names off a Qwen3-Omni
    tokenizer): the family's image / video processors."""
    image = Qwen2VLImageProcessorPil(
        patch_size=MODEL.vision.patch_size, temporal_patch_size=MODEL.vision.temporal_patch_size,
        merge_size=MODEL.vision.spatial_merge_size, image_mean=list(NORM), image_std=list(NORM),
        size={"shortest_edge": IMG_MIN, "longest_edge": IMG_MAX})
    return q25.omni_processor(Qwen3OmniMoeProcessor, image, HFVideo(list(native_fps)), hf_tok)


def hf_call(p, text, videos, audio=None, fps=None):
    """fps: the requested one (HF's processor would take 1.0); the model config's position_id_per_seconds."""
    kw = dict(fps=fps or _cfg().data.video_fps, position_id_per_seconds=MODEL.position_id_per_seconds,
              return_tensors="np")
    if audio is not None:  # the track, decoded once, handed over as HF's audio_from_video_indices path allows
        kw.update(audio=audio, audio_from_video_indices=list(range(len(audio))), load_audio_from_video=True)
    return p(text=[text], videos=videos, **kw)


def test_needs():
    assert NEEDS.video and NEEDS.vision_layout.audio_in_video == "by_time" and NEEDS.audio.max_seconds == 0
    assert (NEEDS.patch_size, NEEDS.merge_size, NEEDS.temporal_patch_size) == (16, 2, 2) == (
        MODEL.vision.patch_size, MODEL.vision.spatial_merge_size, MODEL.vision.temporal_patch_size)
    assert NEEDS.video_tokens_per_second == MODEL.position_id_per_seconds and (NEEDS.vision_layout.mean, NEEDS.vision_layout.std) == (NORM,) * 2


@pytest.mark.parametrize("n,h,w,fps", [(1, 64, 90, 10), (23, 90, 122, 25)])
def test_video_parity(tok, hf_tok, n, h, w, fps):
    """1 frame (taken whole) and 23 frames (an odd count): second_per_grid is temporal patch / requested fps."""
    _, doc = q25.video_alone_parity(tok, Processor(tok, _cfg()), lambda native, text, frames: hf_call(
        hf_processor(hf_tok, [native]), text, [frames]), n, h, w, fps)
    assert doc.media["pixel_values_videos"][0].shape == (doc.media["video_grid_thw"][0].prod(), 3 * 2 * 16 * 16)


def _aiv_doc(tok, hf_tok, n, h, w, fps, secs, fmt, seed=0, **data):
    raw = _video(n, h, w, fps, audio_secs=secs, fmt=fmt, seed=seed)
    frames, native = vision.decode_video(raw)
    wave = decode_audio(raw)
    cfg = _cfg(**data)
    mine = Processor(tok, cfg)
    sample = parse_record(_chat("Listen:", _video_part(raw, True), "what is heard?"))
    text, _, _ = mine.render(sample)
    out = hf_call(hf_processor(hf_tok, [native]), text, [np.stack(frames)], audio=[wave], fps=cfg.data.video_fps)
    return mine(sample), out, wave


# (AIV as in the Qwen2.5-Omni test) + the requested fps: 2 (whole times, ties at 0, 25, 50 ..) or 3 (2/3 s per
# temporal patch: fractional times)
AIV3 = [(*c, 2.0) for c in AIV] + [(*AIV[0], 3.0)]


@pytest.mark.parametrize("n,h,w,fps,secs,fmt,req", AIV3)
def test_audio_in_video_parity(tok, hf_tok, n, h, w, fps, secs, fmt, req):
    doc, out, wave = _aiv_doc(tok, hf_tok, n, h, w, fps, secs, fmt, seed=n, video_fps=req)
    assert abs(len(wave) / 16000 - secs) < 0.1  # the track itself, not silence
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    ids = doc.input_ids.tolist()
    at = ids.index(tok.vision_start_id)
    assert ids[at + 1] == tok.audio_start_id and ids.count(tok.audio_start_id) == 1
    end = ids.index(tok.audio_end_id)
    body = ids[at + 2:end]
    assert ids[end + 1] == tok.vision_end_id and set(body) == {tok.video_pad_id, tok.audio_pad_id}
    grid = doc.media["video_grid_thw"][0]
    np.testing.assert_array_equal(grid, out["video_grid_thw"])
    sec = doc.media["video_second_per_grid"][0]
    np.testing.assert_array_equal(sec, np.asarray(out["video_second_per_grid"], dtype=np.float32))
    assert sec.tolist() == [np.float32(2 / req)]
    np.testing.assert_allclose(doc.media["pixel_values_videos"][0], out["pixel_values_videos"], rtol=0, atol=1e-6)
    k = int(out["feature_attention_mask"].sum())
    assert k == len(wave) // 160 and out["input_features"].shape == (1, 128, k)  # the whole track, unpadded
    assert doc.media["audio_feature_lengths"][0].tolist() == [k]
    np.testing.assert_array_equal(doc.media["input_features"][0].T, out["input_features"][0])
    n_aud = int(hf_q3._get_feat_extract_output_lengths(torch.tensor(k)))
    n_vid, n_t = int(grid.prod()) // 4, int(grid.reshape(-1)[0])
    assert body.count(tok.audio_pad_id) == n_aud and body.count(tok.video_pad_id) == n_vid
    # merged by time: video pad j at t(j) = frame(j) * second_per_grid * position_id_per_seconds, audio pad i at i;
    # times never decrease, and on a tie the video's pad comes first (so no chunks: several alternations)
    v_t = iter(np.repeat(np.arange(n_t) * (2 / req) * MODEL.position_id_per_seconds, n_vid // n_t))
    a_t = iter(range(n_aud))
    times = [(next(v_t), 0) if t == tok.video_pad_id else (next(a_t), 1) for t in body]
    assert times == sorted(times)
    runs = 1 + sum(body[j] != body[j - 1] for j in range(1, len(body)))
    frame_t = [k * (2 / req) * MODEL.position_id_per_seconds for k in range(n_t)]
    assert any(vt % 1 == 0 and vt < n_aud for vt in frame_t)  # a tie with an audio token (at least at t = 0)
    if n_t > 1:  # several frame groups: interleaved with the audio, not a run of each
        assert body[0] == tok.video_pad_id and runs > 2
    else:  # one frame group: every video pad (t = 0) before the first audio pad (t = 0: a tie)
        assert body == [tok.video_pad_id] * n_vid + [tok.audio_pad_id] * n_aud


def _hf_rope(ids, video_grid, secs, audio_lens, uaiv):
    """HF's thinker get_rope_index (Qwen3OmniMoePreTrainedModelForConditionalGeneration) on a fake holding the debug
    flavor's token ids, position_id_per_seconds and the audio tower's n_window."""
    ids_t = torch.as_tensor(ids)[None]
    cfg = types.SimpleNamespace(**{k: getattr(MODEL, k) for k in (
        "image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id", "audio_start_token_id",
        "position_id_per_seconds")}, audio_config=types.SimpleNamespace(n_window=MODEL.audio.n_window))
    cls = hf_q3.Qwen3OmniMoePreTrainedModelForConditionalGeneration
    fake = types.SimpleNamespace(config=cfg, spatial_merge_size=MODEL.vision.spatial_merge_size)
    fake.get_llm_pos_ids_for_vision = types.MethodType(cls.get_llm_pos_ids_for_vision, fake)
    pos, _ = cls.get_rope_index(fake, ids_t, None, video_grid, torch.ones_like(ids_t), uaiv,
                                torch.as_tensor(audio_lens), secs)
    return pos[:, 0]


@pytest.mark.parametrize("case", [AIV3[0], AIV3[2], AIV3[3]])
def test_packed_positions_match_hf_get_rope_index(tok, hf_tok, case):
    """One row: an audio-in-video doc (5 s; a 1-frame video with a short track, where HF's next part starts after
    the audio run alone; 2/3 s per temporal patch, fractional times), then a doc with a video alone and an audio
    clip. Each doc's positions (the family's prepare_batch) equal HF's get_rope_index with its use_audio_in_video."""
    *shape, req = case
    a, out, _ = _aiv_doc(tok, hf_tok, *shape, video_fps=req)
    b, batch, prepared = q25.packed_row(tok, Processor(tok, _cfg(video_fps=req)), a, SPEC, MODEL)
    vg, secs, lens = batch["video_grid_thw"], batch["video_second_per_grid"], batch["audio_feature_lengths"]
    assert vg.shape == (2, 3) and secs.tolist() == [np.float32(2 / req)] * 2 and lens.shape == (2,)
    np.testing.assert_array_equal(vg[0].numpy(), out["video_grid_thw"][0])
    pos = prepared["position_ids"]
    assert pos.dtype == (torch.int64 if req == 2.0 else torch.float32)
    for d, v, at, uaiv in ((a, 0, 0, True), (b, 1, len(a), False)):
        ref = _hf_rope(d.input_ids, vg[v:v + 1], secs[v:v + 1], lens[v:v + 1], uaiv)
        np.testing.assert_array_equal(pos[:, 0, at:at + len(d)].numpy(), ref.numpy())


def test_video_without_audio_track_is_skipped(tok):
    q25.no_track_is_skipped(Processor(tok, _cfg()))


def test_loader_trains_audio_in_video(tmp_path):
    """The Qwen2.5-Omni test's loader record with this family's needs: patch-16 pixel rows, one audio-in-video
    group and the video alone."""
    b, _ = q25.loader_batch(tmp_path, SPEC, MODEL)
    assert b["pixel_values_videos"].shape[1] == 3 * 2 * 16 * 16
    ids, tok = b["input_ids"][0], load_tokenizer(OMNI)
    assert int((ids == tok.audio_start_id).sum()) == 1 and int((ids == tok.vision_start_id).sum()) == 2
