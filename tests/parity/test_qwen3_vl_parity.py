"""Parity with transformers' Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration on tiny
random configs, fp32 CPU: logits (<= 1e-5 max abs) and gradients (<= 1e-4 relative, every tensor) for
text only, one image, several images of different sizes, a video, and a packed batch of several samples
(each sample's logits equal HF's on the sample alone; the packed gradient equals the sum of HF's).
HF positions come from HF's own get_rope_index (its forward computes them from mm_token_type_ids).

Run: OMP_NUM_THREADS=1 pytest -q tests/parity/test_qwen3_vl_parity.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.models.qwen3_vl import hf as vl_hf  # noqa: E402
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig  # noqa: E402
from titan_mm.models.qwen3_vl.model import Qwen3VLModel  # noqa: E402
from titan_mm.nn.media import mrope_index  # noqa: E402
from titan_mm.models.qwen3_vl.synthetic import make_sample, pack  # noqa: E402
from titan_mm.models.qwen3_vl.model import vision_inputs  # noqa: E402

VOCAB = 160
TOK = dict(image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153)


def hf_config(moe: bool):
    text = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=36, deepstack_visual_indexes=[0, 2],
                  in_channels=3)
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, decoder_sparse_step=1,
                    mlp_only_layers=[1], router_aux_loss_coef=0.01)
        cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **TOK)
    else:
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **TOK)
    return cfg


def randomize_(model: torch.nn.Module, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


_CACHE: dict = {}


def models(moe: bool):
    """(hf model, titan model, titan config) with identical random weights (cached per module run)."""
    if moe in _CACHE:
        return _CACHE[moe]
    torch.manual_seed(0)
    hcfg = hf_config(moe)
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    hf = cls._from_config(hcfg, attn_implementation="sdpa").float().eval()
    randomize_(hf)
    cfg = Qwen3VLConfig.from_hf_dict(hcfg.to_dict(), vision_attn_backend="sdpa")
    tm = Qwen3VLModel(cfg).float()
    sd = vl_hf.hf_to_titan(dict(hf.state_dict()), cfg)
    missing, unexpected = tm.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    _CACHE[moe] = (hf, tm, cfg)
    return _CACHE[moe]


def hf_inputs(s):
    kw = dict(input_ids=s.input_ids[None], mm_token_type_ids=s.mm_type[None])
    if len(s.image_grid_thw):
        kw.update(pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw)
    if len(s.video_grid_thw):
        kw.update(pixel_values_videos=s.pixel_values_videos, video_grid_thw=s.video_grid_thw)
    return kw


def titan_forward(tm, batch, labels=False):
    attn = build_attn_meta(batch, "sdpa", "cpu")
    extra = vision_inputs(tm.cfg, batch, "cpu")
    vis = {k: batch[k] for k in ("pixel_values", "pixel_values_videos") if k in batch}
    return tm(batch["input_ids"], position_ids=batch["position_ids"], attn=attn,
              labels=batch["labels"] if labels else None, **vis, **extra)


def grads_titan_names(hf, cfg):
    g = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    return vl_hf.hf_to_titan(g, cfg)


def assert_grads_close(tm, hf, cfg, rtol=1e-4):
    hg = grads_titan_names(hf, cfg)
    n = 0
    for name, p in tm.named_parameters():
        if p.grad is None:
            assert name not in hg or hg[name].abs().max() == 0, f"titan has no grad for {name}"
            continue
        ref = hg[name]
        err = (p.grad - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err <= rtol, f"grad {name}: relative error {err:.2e}"
        n += 1
    assert n == len(hg), f"compared {n} grads, HF has {len(hg)}"


SAMPLES = {
    "text": [("text", 23)],
    "one_image": [("text", 5), ("image", (4, 6)), ("text", 7)],
    "images": [("text", 3), ("image", (4, 6)), ("text", 4), ("image", (8, 4)), ("image", (6, 6)), ("text", 5)],
    "video": [("text", 4), ("video", (2, 4, 4)), ("text", 6)],
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("case", list(SAMPLES))
def test_single_sample_logits_and_grads(moe, case):
    hf, tm, cfg = models(moe)
    s = make_sample(cfg, SAMPLES[case], torch.Generator().manual_seed(hash(case) % 1000), text_vocab=150)
    n = len(s.input_ids)
    # our host-side M-RoPE positions equal HF's get_rope_index
    if case != "text":
        ref_pos, _ = hf.model.get_rope_index(s.input_ids[None], s.mm_type[None], s.image_grid_thw if len(s.image_grid_thw) else None,
                                             s.video_grid_thw if len(s.video_grid_thw) else None)
        ours = mrope_index(s.mm_type, s.image_grid_thw, s.video_grid_thw, 2)
        assert torch.equal(ref_pos[:, 0], torch.from_numpy(ours))
    batch = pack([s], cfg)
    hf.zero_grad(set_to_none=True)
    tm.zero_grad(set_to_none=True)
    out_h = hf(**hf_inputs(s))
    out_t = titan_forward(tm, batch)
    diff = (out_t.logits[0, :n] - out_h.logits[0]).abs().max().item()
    assert diff <= 1e-5, f"logits max abs diff {diff:.2e}"
    # gradients of the summed token CE (labels already shifted, -100 on visual pads)
    lab = batch["labels"][0, :n]
    F.cross_entropy(out_h.logits[0], lab, ignore_index=-100, reduction="sum").backward()
    out_l = titan_forward(tm, batch, labels=True)
    ref_loss = F.cross_entropy(out_h.logits[0].detach(), lab, ignore_index=-100, reduction="sum")
    assert torch.allclose(out_l.loss_sum, ref_loss, rtol=1e-5, atol=1e-5)
    out_l.loss_sum.backward()
    assert_grads_close(tm, hf, cfg)


def test_moe_aux_loss_matches_hf():
    hf, tm, cfg = models(True)
    s = make_sample(cfg, SAMPLES["one_image"], torch.Generator().manual_seed(3), text_vocab=150)
    with torch.no_grad():
        out_h = hf(**hf_inputs(s), output_router_logits=True)
        batch = pack([s], cfg, seq_len=len(s.input_ids))
        batch.pop("doc_ids")  # unpacked row: no padding, same token set as HF
        out_t = titan_forward(tm, batch)
    assert torch.allclose(out_t.aux_loss, cfg.text.router_aux_loss_coef * out_h.aux_loss, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_batch(moe):
    hf, tm, cfg = models(moe)
    g = torch.Generator().manual_seed(7)
    samples = [make_sample(cfg, SAMPLES[c], g, text_vocab=150) for c in ("one_image", "text", "video", "images")]
    batch = pack(samples, cfg, seq_len=256, rows=2)
    hf.zero_grad(set_to_none=True)
    tm.zero_grad(set_to_none=True)
    out_t = titan_forward(tm, batch)
    # where each sample landed (pack fills rows greedily)
    r, off = 0, 0
    for s in samples:
        n = len(s.input_ids)
        if off + n > 256:
            r, off = r + 1, 0
        out_h = hf(**hf_inputs(s))
        diff = (out_t.logits[r, off:off + n] - out_h.logits[0]).abs().max().item()
        assert diff <= 1e-5, f"sample at row {r} offset {off}: logits max abs diff {diff:.2e}"
        lab = batch["labels"][r, off:off + n]
        F.cross_entropy(out_h.logits[0], lab, ignore_index=-100, reduction="sum").backward()
        off += n
    titan_forward(tm, batch, labels=True).loss_sum.backward()
    assert_grads_close(tm, hf, cfg)


def test_conv3d_patch_embed_is_linear():
    conv = torch.nn.Conv3d(3, 32, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=True)
    x = torch.randn(10, 3 * 2 * 4 * 4)
    ref = conv(x.view(-1, 3, 2, 4, 4)).view(10, 32)
    lin = F.linear(x, conv.weight.reshape(32, -1), conv.bias)
    assert (ref - lin).abs().max() <= 1e-6


def test_vision_pos_interpolation_matches_hf():
    """Our bilinear indices/weights reproduce HF's interpolation of the learned position table."""
    from titan_mm.models.qwen3_vl.vision import build_vision_meta

    hf, tm, cfg = models(False)
    grid = torch.tensor([[1, 4, 6], [2, 8, 4], [1, 12, 10]])
    meta = build_vision_meta(grid, cfg.vision, "sdpa")
    table = hf.model.visual.pos_embed.weight
    ours = (table[meta.pos_idx] * meta.pos_w[..., None]).sum(1)
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    idx, w = get_vision_interpolation_indices_and_weights(grid, num_grid_per_side=6, mode="bilinear",
                                                          align_corners=True, spatial_merge_size=2)
    ref = (table[idx] * w[..., None]).sum(1)
    assert (ours - ref).abs().max() <= 1e-6
