"""Parity with transformers' Qwen2_5OmniThinkerForConditionalGeneration on a tiny random config, fp32 CPU: logits
(<= 1e-5 max abs) and gradients (<= 1e-4 relative, every tensor) for text only, an image, two audio clips, a video,
a video with its audio interleaved (use_audio_in_video) and all of them in one sample; our host TMRoPE positions
equal HF's get_rope_index; the weights reach our model through hf.load_hf from a save_pretrained folder; the
round trip (export -> from_pretrained: identical logits); a full Omni checkpoint's talker / token2wav tensors are
skipped with one log line; the config reader, flavors and the spec's answers.

Run: OMP_NUM_THREADS=1 pytest -q tests/parity/test_qwen2_5_omni_parity.py
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from titan_mm.models import hf_io  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.models.qwen2_5_omni import FLAVORS, Qwen2_5OmniConfig, hf as omni_hf  # noqa: E402
from titan_mm.models.qwen2_5_omni.audio import conv_lengths  # noqa: E402
from titan_mm.registry import get_model_spec, spec_for_hf_dir  # noqa: E402

from tests.parity._qwen3_helpers import titan_from_hf  # noqa: E402
from tests.parity.test_qwen3_vl_parity import randomize_  # noqa: E402

TOK = dict(audio_token_index=150, image_token_index=151, video_token_index=152, audio_start_token_id=153,
           audio_end_token_id=154, vision_start_token_id=155, vision_end_token_id=156)
AUD, IMG, VID, A_START, A_END, V_START, V_END = TOK.values()
MELS = 8


def hf_config():
    text = dict(vocab_size=160, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]})
    # window 16 px = 2 x 2 merged tokens: the images below have several windows, some partial
    vision = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=4, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=48, window_size=16, fullatt_block_indexes=[1], in_channels=3)
    # chunks of 2 * n_window = 8 frames: the clips below have several, the last one partial
    audio = dict(num_mel_bins=MELS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=40, d_model=16,
                 output_dim=48, n_window=4, max_source_positions=10)
    # 4 positions per second and 1-s chunks: a 3-frame video (1 s per frame) and 9 audio tokens interleave in 3 chunks
    return transformers.Qwen2_5OmniThinkerConfig(text_config=text, vision_config=vision, audio_config=audio,
                                                 position_id_per_seconds=4, seconds_per_chunk=1, **TOK)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(hf thinker, titan model loaded by load_hf from the HF model's save_pretrained folder, config, folder)."""
    torch.manual_seed(0)
    hf = transformers.Qwen2_5OmniThinkerForConditionalGeneration._from_config(hf_config(), attn_implementation="sdpa")
    hf = hf.float().eval()
    randomize_(hf)
    src = tmp_path_factory.mktemp("omni") / "hf"
    hf.save_pretrained(src)
    tm, spec, cfg = titan_from_hf(src, vision_attn_backend="sdpa")
    assert spec.name == "qwen2_5_omni"
    return hf, tm, cfg, src


def make_sample(cfg, segments, g):
    """Token ids and media for segments ("text", n), ("image", (h, w)), ("video", (t, h, w), sec),
    ("audio", frames) or ("video_audio", (t, h, w), sec, frames): one placeholder per encoder output token, with the
    processor's layout (audio in video: per chunk of seconds_per_chunk, the video's tokens then the audio's)."""
    m2, P = cfg.vision.spatial_merge_size**2, cfg.vision.patch_dim
    per = cfg.position_id_per_seconds * cfg.seconds_per_chunk
    ids, s = [], {"image": [], "video": [], "secs": [], "audio": []}
    for kind, *arg in segments:
        if kind == "text":
            ids += torch.randint(0, 150, (arg[0],), generator=g).tolist()
            continue
        if kind == "audio":
            s["audio"].append(torch.randn(MELS, arg[0], generator=g))
            ids += [A_START] + [AUD] * int(conv_lengths(arg[0])[1]) + [A_END]
            continue
        thw = (1, *arg[0]) if kind == "image" else arg[0]
        n = thw[0] * thw[1] * thw[2]
        s["image" if kind == "image" else "video"].append((thw, torch.randn(n, P, generator=g)))
        if kind == "image":
            ids += [V_START] + [IMG] * (n // m2) + [V_END]
            continue
        s["secs"].append(arg[1])
        if kind == "video":
            ids += [V_START] + [VID] * (n // m2) + [V_END]
            continue
        s["audio"].append(torch.randn(MELS, arg[2], generator=g))
        frame_t = [int(f * arg[1] * cfg.position_id_per_seconds) for f in range(thw[0])]
        toks = [(frame_t[f] // per, 0, VID) for f in range(thw[0]) for _ in range(n // thw[0] // m2)]
        toks += [(i // per, 1, AUD) for i in range(int(conv_lengths(arg[2])[1]))]
        ids += [V_START, A_START] + [t for *_, t in sorted(toks, key=lambda x: x[:2])] + [A_END, V_END]
    s["input_ids"] = torch.tensor([ids])
    return s


def hf_inputs(s, uaiv=False):
    kw = dict(input_ids=s["input_ids"], attention_mask=torch.ones_like(s["input_ids"]), use_audio_in_video=uaiv)
    if s["image"]:
        kw["pixel_values"] = torch.cat([p for _, p in s["image"]])
        kw["image_grid_thw"] = torch.tensor([g for g, _ in s["image"]])
    if s["video"]:
        kw["pixel_values_videos"] = torch.cat([p for _, p in s["video"]])
        kw["video_grid_thw"] = torch.tensor([g for g, _ in s["video"]])
        kw["video_second_per_grid"] = torch.tensor(s["secs"], dtype=torch.float32)
    if s["audio"]:
        n = max(a.shape[1] for a in s["audio"])
        kw["input_features"] = torch.stack([F.pad(a, (0, n - a.shape[1])) for a in s["audio"]])
        kw["feature_attention_mask"] = torch.stack([torch.arange(n) < a.shape[1] for a in s["audio"]]).long()
    return kw


def titan_batch(s, uaiv=False):
    """Our batch keys: HF's, with the clips concatenated along frames and their lengths on the host."""
    kw = hf_inputs(s, uaiv)
    b = {k: v for k, v in kw.items() if k not in ("attention_mask", "input_features", "feature_attention_mask")}
    if s["audio"]:
        b["input_features"] = torch.cat(s["audio"], 1)
        b["audio_feature_lengths"] = torch.tensor([a.shape[1] for a in s["audio"]])
    return b


def titan_forward(tm, batch, labels=None):
    spec = get_model_spec("qwen2_5_omni")
    b = spec.prepare_batch(tm.cfg, batch, "cpu")
    extra = {k: v for k, v in b.items() if k not in ("input_ids", "position_ids")}
    return tm(b["input_ids"], position_ids=b["position_ids"], attn=build_attn_meta(b, "sdpa", "cpu"),
              labels=labels, **extra), b


SAMPLES = {
    "text": ([("text", 23)], False),
    "image": ([("text", 5), ("image", (4, 6)), ("text", 7)], False),
    "audio": ([("text", 4), ("audio", 19), ("text", 3), ("audio", 11), ("text", 5)], False),
    "video": ([("text", 4), ("video", (3, 4, 4), 1.5), ("text", 6)], False),
    "video_audio": ([("text", 4), ("video_audio", (3, 4, 4), 1.0, 38), ("text", 6)], True),
    "all": ([("text", 3), ("image", (4, 4)), ("audio", 13), ("text", 2), ("video", (2, 4, 6), 0.5), ("text", 4)],
            False),
}


@pytest.mark.parametrize("case", list(SAMPLES))
def test_logits_grads_positions(models, case):
    hf, tm, cfg, _ = models
    segs, uaiv = SAMPLES[case]
    s = make_sample(cfg, segs, torch.Generator().manual_seed(len(case)))
    kw = hf_inputs(s, uaiv)
    lens = kw["feature_attention_mask"].sum(-1) if s["audio"] else None
    ref_pos, _ = hf.model.get_rope_index(kw["input_ids"], kw.get("image_grid_thw"), kw.get("video_grid_thw"),
                                         kw["attention_mask"], uaiv, lens, kw.get("video_second_per_grid"))
    hf.zero_grad(set_to_none=True)
    tm.zero_grad(set_to_none=True)
    out_h = hf(**kw)
    ids = s["input_ids"][0]
    lab = torch.where(torch.isin(ids[1:], torch.tensor(list(TOK.values()))), -100, ids[1:])
    lab = torch.cat([lab, torch.tensor([-100])])[None]
    out_t, b = titan_forward(tm, titan_batch(s, uaiv))
    assert torch.equal(b["position_ids"], ref_pos), "TMRoPE positions differ from HF's get_rope_index"
    diff = (out_t.logits - out_h.logits).abs().max().item()
    assert diff <= 1e-5, f"logits max abs diff {diff:.2e}"
    F.cross_entropy(out_h.logits[0], lab[0], ignore_index=-100, reduction="sum").backward()
    titan_forward(tm, titan_batch(s, uaiv), labels=lab)[0].loss_sum.backward()
    hg = omni_hf.hf_to_titan({k: p.grad for k, p in hf.named_parameters() if p.grad is not None}, cfg)
    worst, worst_abs = 0.0, 0.0
    for name, p in tm.named_parameters():
        if name not in hg:  # HF's unused tower (or audio_bos_eos_token): ours ran a stand-in, times 0
            assert p.grad is None or p.grad.abs().max() == 0, f"{name} has a gradient HF does not"
            continue
        err = ((p.grad - hg[name]).norm() / hg[name].norm().clamp_min(1e-12)).item()
        assert err <= 1e-4, f"grad {name}: relative error {err:.2e}"
        worst, worst_abs = max(worst, err), max(worst_abs, (p.grad - hg[name]).abs().max().item())
    if case == "text":  # both stand-ins ran: every encoder block took part in the backward
        assert tm.audio_tower.blocks[0].fc1.weight.grad is not None and tm.visual.blocks[0].mlp.up_proj.weight.grad \
            is not None
    print(f"\n{case}: logits max abs {diff:.2e}, grads worst rel {worst:.2e} / max abs {worst_abs:.2e}")


def test_flex_encoder_attention_forward(models):
    """The flex backend (BlockMasks over ViT frames / windows and audio chunks) gives sdpa's logits (CPU flex is
    forward-only)."""
    import dataclasses

    _, tm, cfg, _ = models
    flex = get_model_spec("qwen2_5_omni").build(dataclasses.replace(cfg, vision_attn_backend="flex"))
    flex.load_state_dict(tm.state_dict())
    s = make_sample(cfg, SAMPLES["all"][0], torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = titan_forward(tm, titan_batch(s))[0].logits, titan_forward(flex, titan_batch(s))[0].logits
    assert (a - b).abs().max() <= 1e-5


def test_packed_documents_restart_positions(models):
    """Two documents in one row (doc_ids): each gets the positions it has alone, media numbered across them."""
    _, tm, cfg, _ = models
    s1 = make_sample(cfg, SAMPLES["all"][0], torch.Generator().manual_seed(1))
    s2 = make_sample(cfg, SAMPLES["audio"][0], torch.Generator().manual_seed(2))
    spec = get_model_spec("qwen2_5_omni")
    alone = [spec.prepare_batch(cfg, titan_batch(s), "cpu")["position_ids"] for s in (s1, s2)]
    b1, b2 = titan_batch(s1), titan_batch(s2)
    n1, n2 = b1["input_ids"].shape[1], b2["input_ids"].shape[1]
    packed = {**b1, "input_ids": torch.cat([b1["input_ids"], b2["input_ids"]], 1),
              "doc_ids": torch.tensor([[0] * n1 + [1] * n2]),
              "input_features": torch.cat([b1["input_features"], b2["input_features"]], 1),
              "audio_feature_lengths": torch.cat([b1["audio_feature_lengths"], b2["audio_feature_lengths"]])}
    b = spec.prepare_batch(cfg, packed, "cpu")
    assert torch.equal(b["position_ids"], torch.cat(alone, 2))
    assert int((b["mm_index"] >= 0).sum()) == int(b["mm_index"].max()) + 1  # every media token placed once


def test_hf_round_trip_and_full_checkpoint(models, tmp_path, caplog):
    hf, tm, cfg, src = models
    spec = get_model_spec("qwen2_5_omni")
    dst = tmp_path / "export"
    spec.save_hf(tm, cfg, str(dst))
    assert json.loads((dst / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    hf2 = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(dst, attn_implementation="sdpa")
    hf2 = hf2.float().eval()
    s = make_sample(cfg, SAMPLES["all"][0], torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = hf(**hf_inputs(s)).logits, hf2(**hf_inputs(s)).logits
        ours = titan_forward(tm, titan_batch(s))[0].logits
    assert torch.equal(ref, out), f"round-trip logits differ by {(ref - out).abs().max():.2e}"
    assert (ours - ref).abs().max() <= 1e-5
    # a full Omni folder: thinker.* plus talker.* / token2wav.* tensors, config.json with thinker_config
    full = tmp_path / "full"
    sd = {"thinker." + k: v for k, v in hf_io.read_safetensors(src).items()}
    sd.update({"talker.model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2), "talker.codec_head.weight":
               torch.zeros(2, 2), "token2wav.code2wav_dit_model.proj.weight": torch.zeros(3)})
    hf_io.write_safetensors(sd, full)
    hf_io.write_config({"model_type": "qwen2_5_omni", "thinker_config": hf_io.read_hf_config(src),
                        "talker_config": {"model_type": "qwen2_5_omni_talker"}}, full)
    assert spec_for_hf_dir(str(full)).name == "qwen2_5_omni" and spec.config_from_hf(str(full)) == spec.config_from_hf(
        str(src))
    m = spec.build(cfg)
    with caplog.at_level(logging.INFO, logger="titan_mm.models.qwen2_5_omni.hf"):
        spec.load_hf(m, str(full))
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "skipped 3 tensors" in lines[0] and "talker.*" in lines[0] and "token2wav.*" in lines[0]
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), tm.state_dict().values()))
    small = {**hf_config().audio_config.to_dict(), "encoder_ffn_dim": 8}  # a config that does not fit the weights
    with pytest.raises(hf_io.HFCheckpointError, match="audio_tower.layers.0.fc1.weight"):
        omni_hf.read_hf_state_dict(str(src), Qwen2_5OmniConfig.from_hf_dict({**hf_io.read_hf_config(src),
                                                                             "audio_config": small}))


def test_config_reader_flavors_and_spec():
    d = hf_config().to_dict()
    with pytest.raises(ValueError, match="qwen2_5_omni family"):
        Qwen2_5OmniConfig.from_hf_dict({**d, "model_type": "qwen2_5_vl"})
    with pytest.raises(ValueError, match="no dropout"):
        Qwen2_5OmniConfig.from_hf_dict({**d, "audio_config": {**d["audio_config"], "dropout": 0.1}})
    cfg = Qwen2_5OmniConfig.from_hf_dict(d)
    assert (cfg.audio.n_window, cfg.audio.d_model, cfg.audio_token_id, cfg.position_id_per_seconds) == (4, 16, AUD, 4)
    assert cfg.mrope_section == (2, 2, 2) and not cfg.tie_word_embeddings
    assert Qwen2_5OmniConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert Qwen2_5OmniConfig.from_hf_dict({"model_type": "qwen2_5_omni", "thinker_config": d}) == cfg
    for name, layers, hidden, vocab in (("3B", 36, 2048, 151936), ("7B", 28, 3584, 152064)):
        f = FLAVORS[name]
        assert (f.text.num_hidden_layers, f.text.hidden_size, f.text.vocab_size) == (layers, hidden, vocab)
        assert f.vision.out_hidden_size == f.audio.output_dim == hidden and f.mrope_section == (16, 24, 24)
        assert (f.audio.d_model, f.audio.encoder_layers, f.audio.n_window, f.vision.depth) == (1280, 32, 100, 32)
    spec = get_model_spec("qwen2_5_omni")
    dbg = spec.flavor("debug")
    needs = spec.data_needs(dbg)
    assert needs.special_tokens["audio_pad"] == dbg.audio_token_id and needs.positions == "mrope" and needs.video
    assert spec.flops(dbg, [100], audio_feature_lengths=[300, 45]) > spec.flops(dbg, [100])
    p = spec.plan(dbg)
    assert {"audio_tower.blocks.?", "visual.blocks.?"} <= set(p.fsdp_units)
    assert p.encoder_tp["audio_tower.blocks.*.fc1"] == "colwise" and "language_model.layers.*.attn.wq" in p.tp
    with torch.device("meta"):  # the audio encoder is its own training part
        m = spec.build(spec.flavor("debug").replace(freeze_audio=True, vision_lr=1e-5))
    assert not any(p.requires_grad for n, p in m.named_parameters() if n.startswith("audio_tower."))
    groups = spec.param_groups(m, m.cfg, [{"params": [p for p in m.parameters() if p.requires_grad]}], 1e-3)
    assert {g["name"]: g["lr"] for g in groups} == {"group/llm": 1e-3, "group/vision": 1e-5, "group/merger": 1e-5}
