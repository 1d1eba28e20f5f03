"""Video parity with transformers' Qwen2_5OmniProcessor (offline: the built-in Qwen2.5-Omni tokenizer; the video
processor is test_processor_qwen2_5_vl.py's Qwen2VLVideoProcessor built from HF's own functions, since HF's file
imports torchvision; WhisperFeatureExtractor with 128 bins). Videos of 1 frame and of an odd frame count: ids, grids,
pixels and video_second_per_grid (HF: temporal patch / the requested fps). A video part with
``use_audio_in_video``: its audio track is decoded from the same file (HF is handed the same samples, as its
``audio_from_video_indices`` path allows) and the ids interleave as HF's with load_audio_from_video; features and
lengths equal. Positions of a packed row (an audio-in-video doc beside a doc with a video alone and an audio clip)
equal HF's get_rope_index per document. A video without an audio track asked for it is skipped (no_audio_track)."""

import io
import types

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf_omni  # noqa: E402
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from titan_mm.config import Data  # noqa: E402
from titan_mm.data import vision  # noqa: E402
from titan_mm.data.audio import decode_audio  # noqa: E402
from titan_mm.data.packing import collate_rows  # noqa: E402
from titan_mm.data.processors import Processor, ProcessorConfig  # noqa: E402
from titan_mm.data.schema import parse_record  # noqa: E402
from titan_mm.data.sources import SkipSample  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer, tokenizer_dir  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

from tests.parity.test_processor_qwen2_5_vl import (IMG_MAX, IMG_MIN, VID_MAX, VID_MIN,  # noqa: E402
                                                    HFVideoProcessor, _chat)

SPEC = get_model_spec("qwen2_5_omni")
MODEL = SPEC.flavor("debug")
NEEDS = SPEC.data_needs(MODEL)
OMNI = "builtin:qwen2_5_omni"


def _cfg(**data) -> ProcessorConfig:
    base = dict(image_min_pixels=IMG_MIN, image_max_pixels=IMG_MAX, video_min_pixels=VID_MIN,
                video_max_pixels=VID_MAX, video_fps=HFVideoProcessor.fps, video_min_frames=4, video_max_frames=768)
    return ProcessorConfig(Data(**{**base, **data}), NEEDS)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(OMNI)


@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(tokenizer_dir(OMNI))


def hf_processor(hf_tok, native_fps):
    """Qwen2_5OmniProcessor without its __init__: Qwen2.5-VL's image processor and HF's Qwen2-VL video functions."""
    return omni_processor(Qwen2_5OmniProcessor, Qwen2VLImageProcessorPil(size={"shortest_edge": IMG_MIN,
                                                                              "longest_edge": IMG_MAX}),
                          HFVideoProcessor(list(native_fps)), hf_tok)


def omni_processor(cls, image_processor, video_processor, hf_tok):
    """An Omni processor ``cls`` without its __init__ (which would auto-load processors): these image / video
    processors, Whisper features with 128 bins, the built-in Omni tokenizer's token names."""
    p = cls.__new__(cls)
    p.image_processor, p.video_processor = image_processor, video_processor
    p.feature_extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    p.tokenizer, p.chat_template = hf_tok, None
    for role, name in (("image", "<|IMAGE|>"), ("audio", "<|AUDIO|>"), ("video", "<|VIDEO|>")):
        setattr(p, f"{role}_token", name)
        setattr(p, f"{role}_token_id", hf_tok.convert_tokens_to_ids(name))
    p.vision_bos_token, p.vision_eos_token = "<|vision_bos|>", "<|vision_eos|>"
    p.audio_bos_token, p.audio_eos_token = "<|audio_bos|>", "<|audio_eos|>"
    return p


def hf_call(p, text, videos, audio=None):
    """The model config's TMRoPE timing (the processor has its own copies of these two numbers)."""
    kw = dict(position_id_per_seconds=MODEL.position_id_per_seconds, seconds_per_chunk=float(MODEL.seconds_per_chunk),
              return_tensors="np")
    if audio is not None:  # the track, decoded once, handed over as HF's audio_from_video_indices path allows
        kw.update(audio=audio, audio_from_video_indices=list(range(len(audio))), load_audio_from_video=True)
    return p(text=[text], videos=videos, **kw)


def _video(n, h, w, fps, audio_secs=None, fmt="mp4", seed=0) -> bytes:
    """An mpeg4 video of random frames; with ``audio_secs``, a 440 Hz + noise audio track (aac in mp4, flac in mkv)."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska" if fmt == "mkv" else fmt) as c:
        vs = c.add_stream("mpeg4", rate=fps)
        vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
        streams = [vs]
        if audio_secs:
            rate = 16000 if fmt == "mkv" else 44100  # the aac track is resampled to 16 kHz on decode
            a = c.add_stream("flac" if fmt == "mkv" else "aac", rate=rate, layout="mono")
            t = np.arange(int(rate * audio_secs)) / rate
            wave = (0.4 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
            streams.append(a)
        for _ in range(n):
            f = av.VideoFrame.from_ndarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), format="rgb24")
            for pk in vs.encode(f):
                c.mux(pk)
        if audio_secs:
            fmt_name = "s16" if fmt == "mkv" else "fltp"
            samples = (wave * 32767).astype(np.int16) if fmt == "mkv" else wave
            step = 1024
            for i in range(0, len(samples), step):
                fr = av.AudioFrame.from_ndarray(samples[None, i:i + step], format=fmt_name, layout="mono")
                fr.sample_rate, fr.pts = rate, i
                for pk in a.encode(fr):
                    c.mux(pk)
        for s in streams:
            for pk in s.encode():
                c.mux(pk)
    return buf.getvalue()


def _video_part(data, audio_in_video=False) -> dict:
    part = {"type": "video", "video": data}
    return {**part, "use_audio_in_video": True} if audio_in_video else part


def video_alone_parity(tok, processor, hf, n, h, w, fps):
    """A video of ``n`` frames alone: ``processor``'s document against ``hf(native_fps, text, frames)`` (HF's
    processor output): ids, grid, pad count, seconds per grid (2 / the requested fps) and pixels equal.
    -> (the encoded video, the document)."""
    data = _video(n, h, w, fps, seed=n)
    frames, native = vision.decode_video(data)
    sample = parse_record(_chat(_video_part(data), "What happens?"))
    text, _, _ = processor.render(sample)
    out = hf(native, text, np.stack(frames))
    doc = processor(sample)
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    grid = doc.media["video_grid_thw"][0]
    np.testing.assert_array_equal(grid, out["video_grid_thw"])
    assert (doc.input_ids == tok.video_pad_id).sum() == grid.prod() // 4 and tok.audio_pad_id not in doc.input_ids
    secs = doc.media["video_second_per_grid"][0]
    np.testing.assert_array_equal(secs, np.asarray(out["video_second_per_grid"], dtype=np.float32))
    assert secs.tolist() == [2 / processor.cfg.data.video_fps]
    np.testing.assert_allclose(doc.media["pixel_values_videos"][0], out["pixel_values_videos"], rtol=0, atol=1e-6)
    return data, doc


@pytest.mark.parametrize("n,h,w,fps", [(1, 64, 90, 10), (23, 90, 122, 25)])
def test_video_parity(tok, hf_tok, n, h, w, fps):
    """1 frame (taken whole) and 23 frames (an odd count): HF's second_per_grid is temporal patch / requested fps."""
    data, doc = video_alone_parity(tok, Processor(tok, _cfg()), lambda native, text, frames: hf_call(
        hf_processor(hf_tok, [native]), text, [frames]), n, h, w, fps)
    secs = doc.media["video_second_per_grid"][0]
    if n > 1:  # the same frames as Qwen2.5-VL's processor, timed by the requested fps, not the sampled one
        vl = get_model_spec("qwen2_5_vl")
        item = vision.process_video(data, ProcessorConfig(_cfg().data, vl.data_needs(vl.flavor("debug"))))
        np.testing.assert_array_equal(item.tensors["pixel_values_videos"], doc.media["pixel_values_videos"][0])
        assert item.tensors["video_second_per_grid"][0] != secs[0]


# (frames, h, w, fps, audio seconds, container): 5 s of video and audio (3 chunks of 2 s); an odd-frame video
# whose (flac) track outlasts it; a 1-frame video with a short track
AIV = [(50, 64, 90, 10, 5.0, "mp4"), (23, 58, 80, 7, 4.3, "mkv"), (1, 64, 64, 10, 0.7, "mkv")]


def _aiv_doc(tok, hf_tok, n, h, w, fps, secs, fmt, seed=0):
    data = _video(n, h, w, fps, audio_secs=secs, fmt=fmt, seed=seed)
    frames, native = vision.decode_video(data)
    wave = decode_audio(data)
    mine = Processor(tok, _cfg())
    sample = parse_record(_chat("Listen:", _video_part(data, True), "what is heard?"))
    text, _, _ = mine.render(sample)
    out = hf_call(hf_processor(hf_tok, [native]), text, [np.stack(frames)], audio=[wave])
    return mine(sample), out, wave


@pytest.mark.parametrize("n,h,w,fps,secs,fmt", AIV)
def test_audio_in_video_parity(tok, hf_tok, n, h, w, fps, secs, fmt):
    doc, out, wave = _aiv_doc(tok, hf_tok, n, h, w, fps, secs, fmt, seed=n)
    assert abs(len(wave) / 16000 - secs) < 0.1  # the track itself, not silence
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    ids = doc.input_ids.tolist()
    at = ids.index(tok.vision_start_id)
    assert ids[at + 1] == tok.audio_start_id and ids.count(tok.audio_start_id) == 1
    body = ids[at + 2:ids.index(tok.audio_end_id)]
    assert ids[ids.index(tok.audio_end_id) + 1] == tok.vision_end_id
    runs = [k for k, j in enumerate(body) if k == 0 or body[k - 1] != j]
    if secs > MODEL.seconds_per_chunk and n > 1:  # several chunks: video then audio in each, interleaved
        assert len(runs) > 2 and body[0] == tok.video_pad_id
    grid = doc.media["video_grid_thw"][0]
    np.testing.assert_array_equal(grid, out["video_grid_thw"])
    assert body.count(tok.video_pad_id) == grid.prod() // 4
    np.testing.assert_array_equal(doc.media["video_second_per_grid"][0],
                                  np.asarray(out["video_second_per_grid"], dtype=np.float32))
    np.testing.assert_allclose(doc.media["pixel_values_videos"][0], out["pixel_values_videos"], rtol=0, atol=1e-6)
    k = int(out["feature_attention_mask"].sum())
    assert doc.media["audio_feature_lengths"][0].tolist() == [k]
    np.testing.assert_array_equal(doc.media["input_features"][0].T, out["input_features"][0][:, :k])
    tower = hf_omni.Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(k))[1]
    assert body.count(tok.audio_pad_id) == int(tower)


def _hf_rope(ids, image_grid, video_grid, secs, audio_lens, uaiv):
    """Qwen2_5OmniThinker's get_rope_index (HF) on a fake holding the debug flavor's token ids and TMRoPE timing."""
    ids_t = torch.as_tensor(ids)[None]
    cfg = types.SimpleNamespace(**{k: getattr(MODEL, k) for k in (
        "image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id", "audio_start_token_id",
        "position_id_per_seconds", "seconds_per_chunk")})
    cls = hf_omni.Qwen2_5OmniPreTrainedModelForConditionalGeneration
    fake = types.SimpleNamespace(config=cfg, spatial_merge_size=MODEL.vision.spatial_merge_size)
    for name in ("get_llm_pos_ids_for_vision", "get_chunked_index"):
        setattr(fake, name, types.MethodType(getattr(cls, name), fake))
    pos, _ = cls.get_rope_index(fake, ids_t, image_grid, video_grid, torch.ones_like(ids_t), uaiv,
                                None if audio_lens is None else torch.as_tensor(audio_lens), secs)
    return pos[:, 0]


def test_packed_positions_match_hf_get_rope_index(tok, hf_tok):
    """One row: an audio-in-video doc, then a doc with a video alone and an audio clip. Each doc's TMRoPE positions
    (the family's prepare_batch) equal HF's get_rope_index with that doc's use_audio_in_video."""
    a, out, _ = _aiv_doc(tok, hf_tok, *AIV[0])
    b, batch, prepared = packed_row(tok, Processor(tok, _cfg()), a, SPEC, MODEL)
    vg, secs, lens = batch["video_grid_thw"], batch["video_second_per_grid"], batch["audio_feature_lengths"]
    assert vg.shape == (2, 3) and secs.tolist() == [1.0, 1.0] and lens.shape == (2,)
    np.testing.assert_array_equal(vg[0].numpy(), out["video_grid_thw"][0])
    for d, v, at, uaiv in ((a, 0, 0, True), (b, 1, len(a), False)):
        ref = _hf_rope(d.input_ids, None, vg[v:v + 1], secs[v:v + 1], lens[v:v + 1], uaiv)
        np.testing.assert_array_equal(prepared["position_ids"][:, 0, at:at + len(d)].numpy(), ref.numpy())


def packed_row(tok, processor, a, spec, model):
    """One row: the document ``a``, then a doc with a video alone and a 1 s audio clip (``processor``'s), through
    collate and the family's prepare_batch; every audio and visual row is placed once. -> (b, batch, prepared)."""
    t = np.arange(16000) / 16000
    clip = (0.3 * np.sin(2 * np.pi * 697 * t)).astype(np.float32)
    b = processor(parse_record(_chat(_video_part(_video(23, 90, 122, 25, seed=3)), {"type": "audio", "audio": clip},
                                     "?")))
    batch = collate_rows([[a, b]], len(a) + len(b), pad_id=tok.pad_id, position_axes=3)
    prepared = spec.prepare_batch(model, batch, "cpu")
    idx = prepared["mm_index"][0]
    n_vis = int((batch["video_grid_thw"].prod(-1) // 4).sum())
    assert sorted(idx[idx >= 0].tolist()) == list(range(n_vis + int((batch["input_ids"] == tok.audio_pad_id).sum())))
    return b, batch, prepared


def test_video_without_audio_track_is_skipped(tok):
    no_track_is_skipped(Processor(tok, _cfg()))


def no_track_is_skipped(mine):
    """A video without an audio track asked for it is skipped (no_audio_track); the same video alone is not."""
    sample = parse_record(_chat(_video_part(_video(8, 64, 64, 10), True), "?"))
    with pytest.raises(SkipSample) as e:
        mine(sample)
    assert e.value.reason == "no_audio_track" and "use_audio_in_video" in e.value.detail
    mine(parse_record(_chat(_video_part(_video(8, 64, 64, 10)), "?")))  # the same video alone is fine


def test_flag_errors():
    """A non-bool flag, or one on a non-video part, is bad_schema; a family without audio in video skips it."""
    with pytest.raises(SkipSample, match="must be true or false") as e:
        parse_record(_chat({"type": "video", "video": b"x", "use_audio_in_video": "yes"}, "?"))
    assert e.value.reason == "bad_schema"
    with pytest.raises(SkipSample, match="belongs on a video part") as e:
        parse_record(_chat({"type": "image", "image": b"x", "use_audio_in_video": True}, "?"))
    assert e.value.reason == "bad_schema"
    vl = get_model_spec("qwen2_5_vl")
    p = Processor(load_tokenizer(), ProcessorConfig(Data(), vl.data_needs(vl.flavor("debug"))))
    with pytest.raises(SkipSample, match="does not interleave audio") as e:
        p.render(parse_record(_chat({"type": "video", "video": b"x", "use_audio_in_video": True}, "?")))
    assert e.value.reason == "unknown_modality"
    assert NEEDS.video and NEEDS.vision_layout.audio_in_video == "chunks" and NEEDS.seconds_per_chunk == MODEL.seconds_per_chunk


def loader_batch(tmp_path, spec, model) -> tuple[dict, dict]:
    """A JSONL record (a video with use_audio_in_video, then a video alone) through build_dataloader with the
    family's needs: nothing skipped, one clip for the video's track, and the family's prepare_batch places every
    pad once. -> (the batch, prepared)."""
    import json

    from titan_mm.data.loader import build_dataloader

    (tmp_path / "a.mkv").write_bytes(_video(23, 58, 80, 7, audio_secs=3.1, fmt="mkv"))
    (tmp_path / "b.mp4").write_bytes(_video(12, 64, 64, 6, seed=1))
    rec = _chat({"type": "video", "video": "a.mkv", "use_audio_in_video": True}, {"type": "video", "video": "b.mp4"},
                "?")
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    data = Data(dataset=str(tmp_path / "d.jsonl"), seq_len=2048, micro_batch_size=1, num_workers=0,
                tokenizer_path=OMNI, video_min_pixels=3136, video_max_pixels=20000)
    dl = build_dataloader(data, needs=spec.data_needs(model), epochs=1)
    (b,) = list(dl)
    assert dl.metrics()["skipped"] == 0
    assert b["video_grid_thw"].shape == (2, 3) and b["audio_feature_lengths"].shape == (1,)
    assert b["input_features"].shape == (128, int(b["audio_feature_lengths"].sum()))
    prepared = spec.prepare_batch(model, b, "cpu")
    ids, tok = b["input_ids"][0], load_tokenizer(OMNI)
    pads = (ids == tok.video_pad_id) | (ids == tok.audio_pad_id)
    assert int((prepared["mm_index"][0] >= 0).sum()) == int(pads.sum())
    return b, prepared


def test_loader_trains_audio_in_video(tmp_path):
    loader_batch(tmp_path, SPEC, MODEL)
