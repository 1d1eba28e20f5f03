"""Qwen3-Omni-MoE thinker vs transformers' Qwen3OmniMoeThinkerForConditionalGeneration (fp32, CPU, tiny random
config): logits and every parameter's gradient for text, images, audio, video and audio-in-video; positions vs HF's
get_rope_index; the HF round trip; a full Omni checkpoint (talker / code2wav skipped with one log line)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration  # noqa: E402

from titan_mm.models.qwen3_omni_moe import hf  # noqa: E402
from titan_mm.models.qwen3_omni_moe.audio import output_lengths  # noqa: E402
from titan_mm.models.qwen3_omni_moe.config import Qwen3OmniMoeConfig  # noqa: E402
from titan_mm.models.qwen3_omni_moe.model import Qwen3OmniMoeModel, prepare_batch  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

AUD, AS, AE, IMG, VID, VS, VE = 250, 248, 249, 251, 252, 253, 254
MELS, PATCH = 16, 3 * 2 * 4 * 4


def hf_config() -> Qwen3OmniMoeThinkerConfig:
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True, "interleaved": True},
                max_position_embeddings=512, router_aux_loss_coef=0.001)
    vis = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
               spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0])
    aud = dict(num_mel_bins=MELS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=48, d_model=32,
               output_dim=64, n_window=50, n_window_infer=200, downsample_hidden_size=8, max_source_positions=64)
    c = Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vis, audio_config=aud, audio_token_id=AUD,
                                  image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS,
                                  vision_end_token_id=VE, audio_start_token_id=AS, audio_end_token_id=AE,
                                  position_id_per_seconds=25)
    c._attn_implementation = "sdpa"
    return c


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, titan model loaded through hf.load_hf from HF's save_pretrained folder, that folder)."""
    torch.manual_seed(0)
    ref = Qwen3OmniMoeThinkerForConditionalGeneration(hf_config()).eval()
    with torch.no_grad():  # HF inits LayerNorms / biases to 1 / 0: randomize so that every map is exercised
        for n, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path_factory.mktemp("qwen3_omni_thinker")
    ref.save_pretrained(d)
    cfg = Qwen3OmniMoeConfig.from_hf(d)
    with torch.device("meta"):
        ours = Qwen3OmniMoeModel(cfg)
    hf.load_hf(ours, d)
    return ref, ours, d


def _media(kind: str, g: torch.Generator):
    """(placeholder tokens, media dict) of one image / video / clip / audio-in-video."""
    if kind == "image":
        return [VS] + [IMG] * 4 + [VE], dict(image=(torch.randn(16, PATCH, generator=g), [1, 4, 4]))
    if kind.startswith("video"):  # "video" (2 s per temporal patch) or "video0.5" (fractional positions, as HF's)
        sec = float(kind[len("video"):] or 2.0)
        return [VS] + [VID] * 8 + [VE], dict(video=(torch.randn(32, PATCH, generator=g), [2, 4, 4], sec))
    if kind.startswith("audio"):
        n = int(kind[len("audio"):])
        return [AS] + [AUD] * int(output_lengths(n)) + [AE], dict(audio=torch.randn(MELS, n, generator=g))
    if kind.startswith("aiv"):  # a 2-frame video (t at 0, 50) with its 150-frame track (20 tokens at 1 ..)
        n = int(kind[len("aiv"):])
        toks = [VS, AS] + [VID] * 8 + [AUD] * int(output_lengths(n)) + [AE, VE]
        return toks, dict(video=(torch.randn(32, PATCH, generator=g), [2, 4, 4], 2.0),
                          audio=torch.randn(MELS, n, generator=g))
    raise ValueError(kind)


def make_batch(rows: list[list], seed: int = 0):
    """rows: per row a list of ints (text lengths) and media kinds. Returns (titan batch, HF kwargs)."""
    g = torch.Generator().manual_seed(seed)
    ids, media = [], {"image": [], "video": [], "audio": []}
    for row in rows:
        r = []
        for part in row:
            if isinstance(part, int):
                r += torch.randint(0, 200, (part,), generator=g).tolist()
            else:
                toks, m = _media(part, g)
                r += toks
                for k, v in m.items():
                    media[k].append(v)
        ids.append(r)
    S = max(map(len, ids))
    assert all(len(r) == S for r in ids), "rows must have equal lengths"
    batch = {"input_ids": torch.tensor(ids)}
    kw = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["input_ids"])}
    if media["image"]:
        batch["pixel_values"] = kw["pixel_values"] = torch.cat([p for p, _ in media["image"]])
        batch["image_grid_thw"] = kw["image_grid_thw"] = torch.tensor([gr for _, gr in media["image"]])
    if media["video"]:
        batch["pixel_values_videos"] = kw["pixel_values_videos"] = torch.cat([p for p, _, _ in media["video"]])
        batch["video_grid_thw"] = kw["video_grid_thw"] = torch.tensor([gr for _, gr, _ in media["video"]])
        batch["video_second_per_grid"] = kw["video_second_per_grid"] = torch.tensor([s for *_, s in media["video"]])
    if media["audio"]:
        lens = [a.shape[1] for a in media["audio"]]
        batch["input_features"] = torch.cat(media["audio"], 1)
        batch["audio_feature_lengths"] = torch.tensor(lens)
        padded = torch.zeros(len(lens), MELS, max(lens))
        mask = torch.zeros(len(lens), max(lens), dtype=torch.long)
        for i, a in enumerate(media["audio"]):
            padded[i, :, : a.shape[1]], mask[i, : a.shape[1]] = a, 1
        kw["input_features"], kw["feature_attention_mask"] = padded, mask
    return batch, kw


def _grads(model, named):
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def compare(pair, rows, use_audio_in_video=False, backend="sdpa"):
    ref, ours, _ = pair
    batch, kw = make_batch(rows)
    if use_audio_in_video:
        batch["use_audio_in_video"] = kw["use_audio_in_video"] = True
    # positions: HF's get_rope_index on the same ids
    feat_lens = kw["feature_attention_mask"].sum(1) if "feature_attention_mask" in kw else None
    want_pos, _ = ref.model.get_rope_index(kw["input_ids"], kw.get("image_grid_thw"), kw.get("video_grid_thw"),
                                           kw["attention_mask"], use_audio_in_video, feat_lens,
                                           kw.get("video_second_per_grid"))
    b = prepare_batch(ours.cfg.replace(vision_attn_backend=backend), batch, "cpu")
    assert torch.equal(b["position_ids"].to(want_pos.dtype), want_pos)
    ref.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    want = ref(**kw).logits
    fields = ("input_ids", "position_ids", "pixel_values", "pixel_values_videos", "input_features", "omni_meta",
              "mm_index")
    with torch.set_grad_enabled(backend == "sdpa"):  # CPU flex runs forward only
        got = ours(**{k: b[k] for k in fields if k in b}).logits
    err = (got - want).abs().max().item()
    assert err <= 1e-5, err
    if backend != "sdpa":
        return err, None
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * w).sum().backward()
    (got * w).sum().backward()
    g_ref = hf.hf_to_titan(_grads(ref, ref.named_parameters()), ours.cfg)
    g_ours = _grads(ours, ours.named_parameters())
    assert set(g_ours) <= set(g_ref) | {k for k in g_ours if not g_ours[k].abs().sum()}, set(g_ours) - set(g_ref)
    worst_abs, worst_rel = 0.0, 0.0
    for k, g in g_ours.items():
        r = g_ref.get(k, torch.zeros_like(g))
        d = (g - r).abs().max().item()
        worst_abs = max(worst_abs, d)
        if r.abs().max() > 1e-6:  # audio k_proj.bias: its true gradient is 0 (softmax ignores a per-query shift)
            worst_rel = max(worst_rel, d / r.abs().max().item())
    assert worst_abs <= 1e-4 and worst_rel <= 1e-4, (worst_abs, worst_rel)
    print(f"logits {err:.2e} grads abs {worst_abs:.2e} rel {worst_rel:.2e}")
    return err, worst_abs


def test_text(pair):
    compare(pair, [[12], [12]])


def test_image(pair):
    compare(pair, [[3, "image", 5, "image", 2], [22]])


def test_audio(pair):
    compare(pair, [[3, "audio250", 8], [5, "audio60", 2, "audio130", 10]])


def test_image_audio_video(pair):
    compare(pair, [[2, "image", 3, "audio60", 2, "video", 3]])


def test_audio_in_video(pair):
    compare(pair, [[4, "aiv150", 3]], use_audio_in_video=True)


def test_video_fractional_positions(pair):
    """0.5 s per temporal patch x 25 positions per second: HF's positions are fractional (float32), ours too."""
    compare(pair, [[2, "video0.5", 3, "image", 1]])


def test_flex_encoders(pair):
    """The ViT and the audio windows on flex attention (BlockMask) give the sdpa logits."""
    compare(pair, [[2, "image", 3, "audio250", 2]], backend="flex")


def test_packed_positions(pair):
    """Positions restart per document (doc_ids): each document's equal its own HF get_rope_index."""
    ref, ours, _ = pair
    batch, kw = make_batch([[2, "image", 3, "audio60", 2]])
    doc = batch["input_ids"].clone()
    b2, kw2 = make_batch([[2, "image", 3, "audio60", 2]], seed=1)
    ids = torch.cat([batch["input_ids"], b2["input_ids"]], 1)
    packed = {"input_ids": ids, "doc_ids": torch.cat([torch.zeros_like(doc), torch.ones_like(doc)], 1),
              "pixel_values": torch.cat([batch["pixel_values"], b2["pixel_values"]]),
              "image_grid_thw": torch.cat([batch["image_grid_thw"], b2["image_grid_thw"]]),
              "input_features": torch.cat([batch["input_features"], b2["input_features"]], 1),
              "audio_feature_lengths": torch.cat([batch["audio_feature_lengths"], b2["audio_feature_lengths"]])}
    pos = prepare_batch(ours.cfg, packed, "cpu")["position_ids"]
    one = prepare_batch(ours.cfg, batch, "cpu")["position_ids"]
    assert torch.equal(pos[:, :, : doc.shape[1]], one) and torch.equal(pos[:, :, doc.shape[1]:], one)


def test_roundtrip(pair, tmp_path):
    """titan -> save_hf -> transformers from_pretrained gives HF's logits exactly."""
    ref, ours, _ = pair
    hf.save_hf(ours, ours.cfg, tmp_path)
    back = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    _, kw = make_batch([[2, "image", 3, "audio60", 2]])
    with torch.no_grad():
        assert torch.equal(back(**kw).logits, ref(**kw).logits)
    assert Qwen3OmniMoeConfig.from_hf(tmp_path) == ours.cfg


def test_full_omni_checkpoint(pair, tmp_path, caplog):
    """A full Omni folder (thinker.* + talker.* + code2wav.*) loads its thinker; the speech parts are skipped and
    named in one log line."""
    ref, ours, d = pair
    sd = {"thinker." + k: v for k, v in load_file(d / "model.safetensors").items()}
    sd["talker.model.layers.0.mlp.gate.weight"] = torch.zeros(2, 2)
    sd["code2wav.decoder.0.conv.weight"] = torch.zeros(3)
    save_file(sd, tmp_path / "model.safetensors")
    thinker = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe", "thinker_config": thinker}))
    cfg = get_model_spec("qwen3_omni_moe").config_from_hf(tmp_path)
    assert cfg == ours.cfg
    with torch.device("meta"):
        m = Qwen3OmniMoeModel(cfg)
    with caplog.at_level(logging.INFO, logger="titan_mm.models.qwen3_omni_moe.hf"):
        hf.load_hf(m, tmp_path)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "2 tensors" in lines[0] and "talker.*" in lines[0] and "code2wav.*" in lines[0]
    for k, v in ours.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_spec_and_flops(pair):
    ref, ours, _ = pair
    spec = get_model_spec("qwen3_omni_moe")
    assert set(spec.flavors) >= {"debug", "30B-A3B"}
    needs = spec.data_needs(ours.cfg)
    assert needs.special_tokens["audio_pad"] == AUD and needs.positions == "mrope"
    batch, _ = make_batch([[3, "audio250", 4]])
    f_audio = spec.flops(ours.cfg, [batch["input_ids"].shape[1]], audio_feature_lengths=batch["audio_feature_lengths"])
    assert f_audio > spec.flops(ours.cfg, [batch["input_ids"].shape[1]])
    with torch.device("meta"):
        spec.build(spec.flavors["30B-A3B"])
    needs = spec.data_needs(spec.flavor("debug"))  # the data pipeline counts a clip's pads by the tower's output
    assert all(int(needs.audio.tokens(f)) == int(output_lengths(f)) for f in range(1, 450))
