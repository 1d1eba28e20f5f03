"""Parity with transformers' Qwen2_5_VLForConditionalGeneration on a tiny random config, fp32 CPU: logits
(<= 1e-5 max abs) and gradients (<= 1e-4 relative, every tensor) for text only, one image, two images of
different sizes and a video (t > 1, second_per_grid_ts); our host positions equal HF's get_rope_index; the HF
round trip both ways; the config reader, the flavors and the spec's answers.

Run: OMP_NUM_THREADS=1 pytest -q tests/parity/test_qwen2_5_vl_parity.py
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from titan_mm.data.packing import Doc, collate_rows  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.models.qwen2_5_vl import FLAVORS, Qwen2_5_VLConfig, hf as q25_hf  # noqa: E402
from titan_mm.models.qwen2_5_vl.model import Qwen2_5_VLModel, rope_index, vision_inputs  # noqa: E402
from titan_mm.models.qwen2_5_vl.vision import build_window_meta  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

from tests.parity._qwen3_helpers import titan_from_hf  # noqa: E402
from tests.parity.test_qwen3_vl_parity import randomize_  # noqa: E402

VOCAB = 160
TOK = dict(image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153)


def hf_config(tie: bool = False):
    text = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]})
    # window 16 px = 2 x 2 merged tokens: every image below has several windows, some of them partial
    vision = dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=4, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=48, window_size=16, fullatt_block_indexes=[1],
                  tokens_per_second=2, in_channels=3)
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **TOK)


_CACHE: dict = {}


def models():
    if not _CACHE:
        torch.manual_seed(0)
        hcfg = hf_config()
        cls = transformers.Qwen2_5_VLForConditionalGeneration
        hf = cls._from_config(hcfg, attn_implementation="sdpa").float().eval()
        randomize_(hf)
        cfg = Qwen2_5_VLConfig.from_hf_dict(hcfg.to_dict(), vision_attn_backend="sdpa")
        tm = Qwen2_5_VLModel(cfg).float()
        tm.load_state_dict(q25_hf.hf_to_titan(dict(hf.state_dict()), cfg), strict=True)
        _CACHE["m"] = (hf, tm, cfg)
    return _CACHE["m"]


def make_sample(cfg, segments, g):
    """Random tokens / pixels: ("text", n), ("image", (h, w)) or ("video", (t, h, w)) in patches; a video is one
    run of pads (Qwen2.5-VL's processor puts no timestamps between frames)."""
    m2, P = cfg.vision.spatial_merge_size**2, cfg.vision.patch_dim
    ids, kinds, grids, pix = [], [], {"image": [], "video": []}, {"image": [], "video": []}
    for kind, arg in segments:
        if kind == "text":
            ids += torch.randint(0, 150, (arg,), generator=g).tolist()
            kinds += [0] * arg
            continue
        thw = (1, *arg) if kind == "image" else arg
        n = thw[0] * thw[1] * thw[2]
        grids[kind].append(thw)
        pix[kind].append(torch.randn(n, P, generator=g))
        pad = cfg.image_token_id if kind == "image" else cfg.video_token_id
        ids += [cfg.vision_start_token_id] + [pad] * (n // m2) + [cfg.vision_end_token_id]
        kinds += [0] + [1 if kind == "image" else 2] * (n // m2) + [0]
    s = {"input_ids": torch.tensor(ids), "mm_type": torch.tensor(kinds)}
    for kind, pk, gk in (("image", "pixel_values", "image_grid_thw"),
                         ("video", "pixel_values_videos", "video_grid_thw")):
        if grids[kind]:
            s[pk], s[gk] = torch.cat(pix[kind]), torch.tensor(grids[kind])
    return s


def pack_one(s, cfg, secs=None):
    """One sample in one row (padded to a multiple of 16), through the data pipeline's collator."""
    ids = s["input_ids"]
    lab = torch.full_like(ids, -100)
    lab[:-1] = torch.where(s["mm_type"][1:] == 0, ids[1:], -100)
    pos = rope_index(s["mm_type"], s.get("image_grid_thw", []), s.get("video_grid_thw", []), cfg, secs)
    media = {k: [s[k].numpy()] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
             if k in s}
    seq = -(-len(ids) // 16) * 16
    return collate_rows([[Doc(ids.numpy(), lab.numpy(), positions=pos, media=media)]], seq, pad_id=0, position_axes=3,
                        multiple=1)


def hf_inputs(s, secs=None):
    kw = dict(input_ids=s["input_ids"][None], mm_token_type_ids=s["mm_type"][None])
    kw.update({k: s[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw") if k in s})
    if secs is not None:
        kw["second_per_grid_ts"] = torch.tensor(secs)
    return kw


def titan_forward(tm, batch, labels=False):
    attn = build_attn_meta(batch, "sdpa", "cpu")
    vis = {k: batch[k] for k in ("pixel_values", "pixel_values_videos") if k in batch}
    return tm(batch["input_ids"], position_ids=batch["position_ids"], attn=attn,
              labels=batch["labels"] if labels else None, **vis, **vision_inputs(tm.cfg, batch, "cpu"))


SAMPLES = {
    "text": ([("text", 23)], None),
    "one_image": ([("text", 5), ("image", (4, 6)), ("text", 7)], None),
    "two_images": ([("text", 3), ("image", (6, 6)), ("text", 4), ("image", (8, 4)), ("text", 5)], None),
    "video": ([("text", 4), ("video", (3, 4, 6)), ("text", 6)], [1.5]),
}


@pytest.mark.parametrize("case", list(SAMPLES))
def test_logits_grads_positions(case):
    hf, tm, cfg = models()
    segs, secs = SAMPLES[case]
    s = make_sample(cfg, segs, torch.Generator().manual_seed(len(case)))
    n = len(s["input_ids"])
    batch = pack_one(s, cfg, secs)
    kw = hf_inputs(s, secs)  # our host positions equal HF's get_rope_index
    ref_pos, _ = hf.model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"], kw.get("image_grid_thw"),
                                         kw.get("video_grid_thw"), kw.get("second_per_grid_ts"))
    assert torch.equal(ref_pos[:, 0], batch["position_ids"][:, 0, :n])
    hf.zero_grad(set_to_none=True)
    tm.zero_grad(set_to_none=True)
    out_h = hf(**hf_inputs(s, secs))
    out_t = titan_forward(tm, batch)
    diff = (out_t.logits[0, :n] - out_h.logits[0]).abs().max().item()
    assert diff <= 1e-5, f"logits max abs diff {diff:.2e}"
    lab = batch["labels"][0, :n]
    F.cross_entropy(out_h.logits[0], lab, ignore_index=-100, reduction="sum").backward()
    titan_forward(tm, batch, labels=True).loss_sum.backward()
    hg = q25_hf.hf_to_titan({k: p.grad for k, p in hf.named_parameters() if p.grad is not None}, cfg)
    worst, worst_abs = 0.0, 0.0
    for name, p in tm.named_parameters():
        if p.grad is None:
            assert name not in hg or hg[name].abs().max() == 0, f"titan has no grad for {name}"
            continue
        err = ((p.grad - hg[name]).norm() / hg[name].norm().clamp_min(1e-12)).item()
        assert err <= 1e-4, f"grad {name}: relative error {err:.2e}"
        worst, worst_abs = max(worst, err), max(worst_abs, (p.grad - hg[name]).abs().max().item())
    print(f"\n{case}: logits max abs {diff:.2e}, grads worst rel {worst:.2e} / max abs {worst_abs:.2e}")


def test_flex_vision_attention_forward():
    """The flex backend (BlockMasks over frames and windows) gives sdpa's logits (CPU flex is forward-only)."""
    import dataclasses

    hf, tm, cfg = models()
    s = make_sample(cfg, SAMPLES["two_images"][0] + [("video", (2, 4, 6))], torch.Generator().manual_seed(5))
    batch = pack_one(s, cfg, [1.0])
    flex = Qwen2_5_VLModel(dataclasses.replace(cfg, vision_attn_backend="flex")).float()
    flex.load_state_dict(tm.state_dict())
    with torch.no_grad():
        a, b = titan_forward(tm, batch).logits, titan_forward(flex, batch).logits
    assert (a - b).abs().max() <= 1e-5


def test_flex_window_meta_is_built_where_it_runs():
    """A BlockMask's mask_mod holds its document ids on the device it was built for: moving one would leave them
    behind (on CUDA inductor fails to lower it), so the window meta builds its masks on the device and moving a
    built mask elsewhere is refused in one line."""
    from titan_mm.models.qwen3_vl.vision import move_vision_meta

    _, _, cfg = models()
    grid = torch.tensor([[1, 4, 6], [2, 6, 6]])
    meta = build_window_meta(grid, cfg.vision, "flex", "cpu")
    assert meta.full.mask.kv_num_blocks.device.type == meta.window.mask.kv_num_blocks.device.type == "cpu"
    assert move_vision_meta(meta.window, "cpu").mask is meta.window.mask
    with pytest.raises(ValueError, match="cannot move to meta; build the metadata on its device"):
        move_vision_meta(meta.window, "meta")


def test_window_order_matches_hf():
    from transformers.vision_utils import get_vision_window_index

    _, _, cfg = models()
    grid = torch.tensor([[1, 4, 6], [1, 6, 6], [3, 8, 4], [1, 10, 2]])
    meta = build_window_meta(grid, cfg.vision, "sdpa")
    idx, cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=16, patch_size=4)
    assert torch.equal(meta.inverse, torch.argsort(idx)) and torch.equal(meta.window.cu_seqlens, cu)


def test_hf_round_trip(tmp_path):
    hf, tm, cfg = models()
    src, dst = tmp_path / "hf", tmp_path / "export"
    hf.save_pretrained(src)
    m, spec, cfg2 = titan_from_hf(src, vision_attn_backend="sdpa")
    assert spec.name == "qwen2_5_vl"
    spec.save_hf(m, cfg2, str(dst))
    assert json.loads((dst / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    hf2 = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(dst, attn_implementation="sdpa")
    hf2 = hf2.float().eval()
    segs, secs = ([("text", 3), ("image", (4, 6)), ("video", (2, 4, 4)), ("text", 4)], [0.5])
    s = make_sample(cfg, segs, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(**hf_inputs(s, secs)).logits
        out = hf2(**hf_inputs(s, secs)).logits
        ours = titan_forward(m, pack_one(s, cfg2, secs)).logits[:, : ref.shape[1]]
    assert torch.equal(ref, out), f"round-trip logits differ by {(ref - out).abs().max():.2e}"
    assert (ours - ref).abs().max() <= 1e-5


def test_config_reader_flavors_and_spec():
    d = hf_config().to_dict()
    with pytest.raises(ValueError, match="qwen2_5_vl family"):
        Qwen2_5_VLConfig.from_hf_dict({**d, "model_type": "qwen3_vl"})
    cfg = Qwen2_5_VLConfig.from_hf_dict(d)
    assert cfg.mrope_section == (2, 2, 2) and cfg.vision.fullatt_block_indexes == (1,) and cfg.text.head_dim == 12
    assert Qwen2_5_VLConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # the released flat layout (text keys at the top level, rope_scaling type "mrope", in_chans)
    flat = {**{k: v for k, v in d["text_config"].items() if k != "rope_parameters"}, "model_type": "qwen2_5_vl",
            "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 2]},
            "vision_config": {**d["vision_config"], "in_chans": 3}, **TOK}
    assert Qwen2_5_VLConfig.from_hf_dict(flat) == cfg
    for name, layers, hidden, vocab, tie in (("3B", 36, 2048, 151936, True), ("7B", 28, 3584, 152064, False)):
        f = FLAVORS[name]
        assert (f.text.num_hidden_layers, f.text.hidden_size, f.text.vocab_size, f.tie_word_embeddings) == (
            layers, hidden, vocab, tie)
        assert f.vision.depth == 32 and f.vision.window_size == 112 and f.mrope_section == (16, 24, 24)
        assert f.vision.fullatt_block_indexes == (7, 15, 23, 31) and f.vision.out_hidden_size == hidden
        assert (f.vision.hidden_size, f.vision.intermediate_size, f.vision.tokens_per_second) == (1280, 3420, 2)
        assert (f.text.rope_theta, f.text.rms_norm_eps, f.text.head_dim) == (1e6, 1e-6, 128)
    spec = get_model_spec("qwen2_5_vl")
    dbg = spec.flavor("debug")
    needs = spec.data_needs(dbg)
    assert (needs.positions, needs.patch_size, needs.merge_size) == ("mrope", 14, 2)
    assert spec.dims(dbg).vision.depth == 2
    grid = torch.tensor([[1, 8, 8]])
    fl = spec.flops(dbg, [100], image_grid_thw=grid)
    assert fl > spec.flops(dbg, [100])
    p = spec.plan(dbg)
    assert "visual.blocks.?" in p.fsdp_units and "language_model.layers.*.attn.wq" in p.tp
