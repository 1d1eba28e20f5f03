"""The serving engine's greedy outputs equal transformers' ``generate`` token for token (fp32, CPU, tiny random
models with Qwen's vocabulary and special-token ids, so that the real Qwen3 tokenizer renders chats and timestamps):

- Qwen2.5-VL (windowed ViT, chunked M-RoPE) loaded by ``Engine.from_pretrained`` from an HF folder that
  transformers wrote: prompts with one or two generated images batched with a text-only prompt, packed and under a
  16-token chunked-prefill budget.
- Videos for Qwen2.5-VL (one run of pads per video, timed by second_per_grid_ts) and Qwen3-VL (one
  ``<t seconds><|vision_start|>pads<|vision_end|>`` group per temporal patch): a short generated mp4 clip given as
  a ``data:video/mp4`` URI and a clip of in-memory frames (a MediaItem), each processed as training processes it
  (titan_mm.data.vision.process_video); HF gets the same pixel_values_videos / grids.
- A bad video part is one BadRequest naming the field (the engine) and a 400 naming the chat part (the server,
  whose ``video_url`` answer equals the offline engine's).

HF runs each batch left-padded, with mm_token_type_ids (1 image pads, 2 video pads) as its processor gives them.
Run: pytest -q tests/parity/test_serve_vl_media.py
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")

from tests.parity.test_qwen3_vl_parity import hf_config as q3_hf_config, randomize_  # noqa: E402
from tests.parity.test_qwen2_5_vl_parity import hf_config as q25_hf_config  # noqa: E402
from tests.parity.test_serve_generate import left_padded  # noqa: E402
from titan_mm.config import ConfigError, Data  # noqa: E402
from titan_mm.data import vision  # noqa: E402
from titan_mm.data.processors import ProcessorConfig  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer  # noqa: E402
from titan_mm.loader import load_model  # noqa: E402
from titan_mm.models.qwen2_5_vl import Qwen2_5_VLConfig, hf as q25_hf  # noqa: E402
from titan_mm.models.qwen3_vl import hf as q3_hf  # noqa: E402
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.serve.config import ServeConfig  # noqa: E402
from titan_mm.serve.engine import BadRequest, Engine  # noqa: E402
from titan_mm.serve.entrypoints.server import build_app  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

MAX_NEW = 8
VOCAB = 151936
# Qwen's <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
IMG, VID, VS, VE = 151655, 151656, 151652, 151653
TOK = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
# tiny media: 4-pixel patches, 2x2 merge; a clip of 8 frames at 4 fps -> 4 frames sampled at 2 fps (2 temporal patches)
DATA = Data(image_min_pixels=64, image_max_pixels=32 * 32, video_min_pixels=64, video_max_pixels=4 * 24 * 24,
            video_fps=2.0, video_min_frames=4, video_max_frames=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
_CACHE: dict = {}


def models(family: str):
    """(HF model, spec, titan config, titan twin) with the same random weights, Qwen's vocabulary and ids."""
    if family not in _CACHE:
        torch.manual_seed(0)
        base = q25_hf_config() if family == "qwen2_5_vl" else q3_hf_config(family == "qwen3_vl_moe")
        d = base.to_dict()
        d["text_config"]["vocab_size"] = VOCAB
        d.update(TOK)
        hcfg = type(base).from_dict(d)
        cls = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
               "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
               "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration}[family]
        hf = cls._from_config(hcfg, attn_implementation="sdpa").float().eval()
        randomize_(hf)
        spec = get_model_spec(family)
        cfg_cls, io_ = (Qwen2_5_VLConfig, q25_hf) if family == "qwen2_5_vl" else (Qwen3VLConfig, q3_hf)
        cfg = cfg_cls.from_hf_dict(hcfg.to_dict(), vision_attn_backend="sdpa")
        tm = spec.build(cfg).float()
        tm.load_state_dict(io_.hf_to_titan(dict(hf.state_dict()), cfg), strict=True)
        if family == "qwen3_vl_moe":  # batched generate: no aux loss over padded rows
            hf.config.text_config.output_router_logits = False
        _CACHE[family] = hf, spec, cfg, tm.eval()
    return _CACHE[family]


def image(h: int, w: int, seed: int):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def frames(n: int = 8, h: int = 32, w: int = 48, seed: int = 0) -> list[np.ndarray]:
    """A picture sliding sideways: frames that differ, as a clip's do."""
    base = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    return [np.roll(base, 3 * k, axis=1) for k in range(n)]


def mp4_uri(clip: list[np.ndarray], fps: int = 4) -> str:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = clip[0].shape[1], clip[0].shape[0], "yuv420p"
        for f in clip:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf, family: str, prompts: list[list[int]], images: list[list], videos: list[list]):
    """(expanded prompts, HF's greedy tokens): each pad replaced as the training processor does, the pixels and
    grids from titan_mm's processor (with HF's second_per_grid_ts for Qwen2.5-VL's videos)."""
    spec, cfg = models(family)[1:3]
    needs = spec.data_needs(cfg)
    pcfg, tok = ProcessorConfig(DATA, needs), load_tokenizer(None)
    expanded, media = [], {k: [] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                           "video_second_per_grid")}
    for p, ims, vids in zip(prompts, images, videos):
        ims, vids, e = iter(ims), iter(vids), []
        for t in p:
            if t == IMG:
                item = vision.process_image(next(ims), pcfg)
                e += [IMG] * item.n_tokens
            elif t == VID:
                v = next(vids)
                item = v if isinstance(v, vision.MediaItem) else vision.process_video(
                    base64.b64decode(v.split(",", 1)[1]), pcfg)
                e += vision.video_placeholder_ids(item, tok).tolist()
            else:
                e.append(t)
                continue
            for k, x in item.tensors.items():
                media[k].append(torch.from_numpy(np.asarray(x)))
        expanded.append(e)
    ids, mask = left_padded(expanded)
    kw = {k: torch.cat(v) for k, v in media.items() if v}
    secs = kw.pop("video_second_per_grid", None)
    if family == "qwen2_5_vl" and secs is not None:
        kw["second_per_grid_ts"] = secs
    mm = (ids == IMG).long() + 2 * (ids == VID).long()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, mm_token_type_ids=mm, **kw, max_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return expanded, out[:, ids.shape[1]:].tolist()


def check(outs, expanded, refs):
    assert [o.prompt_token_ids for o in outs] == expanded  # the engine expands its media as training does
    got = [o.outputs[0].token_ids for o in outs]
    bad = [i for i in range(len(refs)) if got[i] != refs[i]]
    assert not bad, f"prompts {bad} differ from HF generate: got {[got[i] for i in bad]}, HF {[refs[i] for i in bad]}"


@pytest.fixture(scope="module")
def q25_folder(tmp_path_factory):
    """The tiny Qwen2.5-VL as transformers writes it, with DATA's image and video processing in its processor
    configs (as HF's image and video processors save theirs)."""
    hf = models("qwen2_5_vl")[0]
    d = tmp_path_factory.mktemp("q25vl")
    hf.save_pretrained(d)
    (d / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": DATA.image_min_pixels, "longest_edge": DATA.image_max_pixels}}))
    (d / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": DATA.video_min_pixels, "longest_edge": DATA.video_max_pixels},
         "fps": DATA.video_fps, "min_frames": DATA.video_min_frames, "max_frames": DATA.video_max_frames}))
    return d


def image_case():
    """(prompts, images, videos, expanded prompts, HF's tokens): Qwen2.5-VL, 1-2 images (one shared) and a text
    prompt."""
    if "images" not in _CACHE:
        shared = image(16, 24, 0)
        prompts = [text(4, 1) + [VS, IMG, VE] + text(5, 2),
                   text(9, 3),
                   text(3, 4) + [VS, IMG, VE] + text(2, 5) + [VS, IMG, VE] + text(4, 6),
                   text(4, 1) + [VS, IMG, VE] + text(3, 7)]
        images, videos = [[shared], [], [image(24, 16, 1), image(16, 16, 2)], [shared]], [[]] * 4
        _CACHE["images"] = prompts, images, videos, *reference(models("qwen2_5_vl")[0], "qwen2_5_vl", prompts,
                                                               images, videos)
    return _CACHE["images"]


def video_case(family: str):
    """(prompts, images, videos, expanded prompts, HF's tokens): a video (an mp4 data: URI), a text prompt, and an
    image with a video of in-memory frames (a MediaItem)."""
    if ("videos", family) not in _CACHE:
        hf, spec, cfg, _ = models(family)
        clip = mp4_uri(frames(seed=0))
        # 4 frames at 1 fps, all taken: Qwen2.5-VL's 2 seconds per temporal patch (the mp4's: 1)
        in_memory = vision.process_video(None, ProcessorConfig(DATA, spec.data_needs(cfg)), frames=frames(4, seed=1),
                                         video_fps=1.0)
        if family == "qwen2_5_vl":
            assert in_memory.tensors["video_second_per_grid"].tolist() == [2.0]
        prompts = [text(3, 1) + [VS, VID, VE] + text(4, 2),
                   text(5, 3),
                   text(2, 4) + [VS, IMG, VE] + text(2, 5) + [VS, VID, VE] + text(3, 6)]
        images, videos = [[], [], [image(16, 24, 3)]], [[clip], [], [in_memory]]
        _CACHE["videos", family] = prompts, images, videos, *reference(hf, family, prompts, images, videos)
    return _CACHE["videos", family]


@pytest.mark.parametrize("serve", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=4)],
                         ids=["packed", "chunked"])
def test_qwen2_5_vl_from_hf_folder(q25_folder, serve, tmp_path):
    """Images (and the videos of test_videos_match_hf_generate) through Engine.from_pretrained, which reads the
    folder's image and video processing."""
    engine = Engine.from_pretrained(q25_folder, ServeConfig(block_size=4, num_blocks=128, max_model_len=256,
                                                            **serve), device="cpu")
    assert engine.spec.name == "qwen2_5_vl" and engine.data == DATA
    for prompts, images, videos, expanded, refs in (image_case(), video_case("qwen2_5_vl")):
        check(engine.generate(prompts, GREEDY, images=images, videos=videos), expanded, refs)
    assert engine.stats()["kv_blocks_used"] == 0
    (tmp_path / "config.json").symlink_to(q25_folder / "config.json")  # read before any weight
    (tmp_path / "video_preprocessor_config.json").write_text('{"fps": "fast"}')
    with pytest.raises(ConfigError, match=r"video_preprocessor_config.json: fps = 'fast' must be a positive number"):
        load_model(tmp_path)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_videos_match_hf_generate(family):
    _, spec, cfg, tm = models(family)
    prompts, images, videos, expanded, refs = video_case(family)
    for serve in (dict(), dict(max_num_batched_tokens=16, max_num_seqs=2)):  # packed; chunked, videos whole
        engine = Engine(tm, spec, cfg, ServeConfig(block_size=4, num_blocks=128, max_model_len=256, **serve),
                        data=DATA)
        check(engine.generate(prompts, GREEDY, images=images, videos=videos), expanded, refs)
        assert engine.stats()["kv_blocks_used"] == 0


def test_bad_video_parts_name_the_field():
    hf, spec, cfg, tm = models("qwen3_vl")
    engine = Engine(tm, spec, cfg, ServeConfig(block_size=4, num_blocks=128, max_model_len=256), data=DATA)
    p = text(3, 1) + [VS, VID, VE]
    cases = [(dict(videos=[b"not a video"]), "videos[0]", "bad_video"),
             (dict(videos=["data:video/mp4;base64,AAAA"]), "videos[0]", "cannot decode"),
             (dict(videos=["clips/a.mp4"]), "videos[0]", "data:video"),
             (dict(videos=[vision.process_image(image(16, 16, 0), ProcessorConfig(DATA, spec.data_needs(cfg)))]),
              "videos[0]", "kind 'image'"),
             (dict(videos=[]), "videos", "1 video pad token(s)"),
             (dict(videos="x"), "videos", "must be a list")]
    for kw, field, words in cases:
        with pytest.raises(BadRequest) as e:
            engine.add_request("r", p, GREEDY, **kw)
        assert e.value.field == field and words in e.value.message, (field, e.value.message)

    clip = mp4_uri(frames(seed=2))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What happens?"},
                                         {"type": "video_url", "video_url": {"url": clip}}]}]
    ids, images, videos = engine.chat_media([{"role": "user", "content": [
        {"type": "text", "text": "What happens?"}, {"type": "video_url", "video_url": clip}]}])[:3]
    assert videos == [clip] and not images and ids.count(VID) == 1
    with pytest.raises(BadRequest, match="chat_media"):
        engine.chat_prompt([{"role": "user", "content": [{"type": "video_url", "video_url": clip}]}])
    (ref,) = engine.generate([ids], GREEDY, videos=[videos])
    with TestClient(build_app(engine, "tiny-vl")) as client:
        body = {"model": "tiny-vl", "messages": msgs, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids) > len(ids)
        broken = "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()
        for url, words in ((broken, "cannot decode video"), ("https://example.com/a.mp4", "data:video/")):
            bad = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "video_url", "video_url": {"url": url}}]}]
            r = client.post("/v1/chat/completions", json={"model": "tiny-vl", "messages": bad, "max_tokens": 2})
            e = r.json()["error"]
            assert r.status_code == 400 and e["param"] == "messages[0].content[1].video_url", e
            assert words in e["message"], e
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()
