"""Parity with transformers' Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration on tiny random
configs with both block kinds (Gated DeltaNet and gated full attention), fp32 CPU: logits (<= 1e-5 max abs) and
gradients (<= 1e-4 relative, every tensor) for text, image and video samples, dense and MoE; packed rows equal the
samples run alone in HF (each sample's logits, the sum of the gradients); the MoE aux loss; the HF round trip both
ways (save_hf -> from_pretrained, save_pretrained -> load_hf) with identical logits; the config reader; the spec.

Run: OMP_NUM_THREADS=1 pytest -q tests/parity/test_qwen3_5_parity.py
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from titan_mm.nn.media import mrope_index  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.models.hf_io import HFCheckpointError  # noqa: E402
from titan_mm.models.qwen3_5 import flops as q35_flops  # noqa: E402
from titan_mm.models.qwen3_5 import hf as q35_hf  # noqa: E402
from titan_mm.models.qwen3_5.config import FLAVORS, MOE_FLAVORS, Qwen3_5Config  # noqa: E402
from titan_mm.models.qwen3_5.model import Qwen3_5Model, prepare_batch  # noqa: E402
from titan_mm.models.qwen3_vl.synthetic import make_sample, pack  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

VOCAB = 160
TOK = dict(image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153)
# layers: linear, full, linear, full (both kinds, and a full-attention block after a linear one)
LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def hf_config(moe: bool):
    text = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
                layer_types=LAYERS, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=12, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=36, in_channels=3)
    if moe:
        text.pop("intermediate_size")
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=24,
                    router_aux_loss_coef=0.01)
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **TOK)
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **TOK)


def randomize_(model: torch.nn.Module, seed: int = 0):
    """Random weights everywhere (HF inits norms to 0 / 1 and some weights to 0); decays kept in their range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):  # mild decays: HF's chunked rule sums log decays over a chunk in fp32, whose
                # rounding at strong decays (sums of -100s) alone exceeds the 1e-5 bar
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.5, generator=g).log())
            elif n.endswith("dt_bias") or ("norm" in n and n.endswith("weight") and "linear_attn" in n):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in n and n.endswith("weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))  # zero-centred (1 + w) or LayerNorm
            else:
                p.copy_(0.07 * torch.randn(p.shape, generator=g))


_CACHE: dict = {}


def models(moe: bool):
    """(hf model, titan model, titan config) with identical random weights (cached per module run)."""
    if moe in _CACHE:
        return _CACHE[moe]
    torch.manual_seed(0)
    hcfg = hf_config(moe)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    hf = cls._from_config(hcfg, attn_implementation="sdpa").float().eval()
    randomize_(hf)
    cfg = Qwen3_5Config.from_hf_dict(hcfg.to_dict(), vision_attn_backend="sdpa")
    tm = Qwen3_5Model(cfg).float()
    missing, unexpected = tm.load_state_dict(q35_hf.hf_to_titan(dict(hf.state_dict()), cfg), strict=False)
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


def titan_forward(tm, batch, labels=False, backend="sdpa"):
    b = prepare_batch(tm.cfg, batch, "cpu")
    attn = build_attn_meta(b, backend, "cpu")
    keys = ("pixel_values", "pixel_values_videos", "vision_meta", "visual_index", "linear_meta")
    return tm(b["input_ids"], position_ids=b["position_ids"], attn=attn,
              labels=b["labels"] if labels else None, **{k: b[k] for k in keys if k in b})


def assert_grads_close(tm, hf, cfg, rtol=1e-4):
    hg = q35_hf.hf_to_titan({k: p.grad for k, p in hf.named_parameters() if p.grad is not None}, cfg)
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
    "text": [("text", 75)],  # longer than the 64-token chunk: the rule's chunk boundary is crossed
    "image": [("text", 5), ("image", (4, 6)), ("text", 7)],
    "video": [("text", 4), ("video", (2, 4, 4)), ("text", 6)],
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("case", list(SAMPLES))
def test_single_sample_logits_and_grads(moe, case):
    hf, tm, cfg = models(moe)
    s = make_sample(cfg, SAMPLES[case], torch.Generator().manual_seed(len(case)), text_vocab=150)
    n = len(s.input_ids)
    if case != "text":  # our host-side M-RoPE positions equal HF's get_rope_index (Qwen3-VL's, video frames split)
        ref_pos, _ = hf.model.get_rope_index(s.input_ids[None], s.mm_type[None],
                                             s.image_grid_thw if len(s.image_grid_thw) else None,
                                             s.video_grid_thw if len(s.video_grid_thw) else None)
        assert torch.equal(ref_pos[:, 0], torch.from_numpy(mrope_index(s.mm_type, s.image_grid_thw,
                                                                       s.video_grid_thw, 2)))
    batch = pack([s], cfg)
    hf.zero_grad(set_to_none=True)
    tm.zero_grad(set_to_none=True)
    out_h = hf(**hf_inputs(s))
    out_t = titan_forward(tm, batch)
    diff = (out_t.logits[0, :n] - out_h.logits[0]).abs().max().item()
    assert diff <= 1e-5, f"logits max abs diff {diff:.2e}"
    lab = batch["labels"][0, :n]
    F.cross_entropy(out_h.logits[0], lab, ignore_index=-100, reduction="sum").backward()
    out_l = titan_forward(tm, batch, labels=True)
    ref = F.cross_entropy(out_h.logits[0].detach(), lab, ignore_index=-100, reduction="sum")
    assert torch.allclose(out_l.loss_sum, ref, rtol=1e-5, atol=1e-5)
    out_l.loss_sum.backward()
    assert_grads_close(tm, hf, cfg)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_equals_unpacked(moe):
    """Two rows of packed samples (text, image and video; documents that cross the rule's 64-token chunks): every
    sample's logits equal HF's on the sample alone, on sdpa and flex, and the packed gradient equals the sum of HF's.
    The recurrent state and the conv restart at each document."""
    hf, tm, cfg = models(moe)
    g = torch.Generator().manual_seed(7)
    segs = [SAMPLES["image"], [("text", 70)], SAMPLES["video"], [("text", 9)], SAMPLES["image"]]
    samples = [make_sample(cfg, s, g, text_vocab=150) for s in segs]
    batch = pack(samples, cfg, seq_len=112, rows=2)
    hf.zero_grad(set_to_none=True)
    tm.zero_grad(set_to_none=True)
    outs = {b: titan_forward(tm, batch, backend=b).logits for b in ("sdpa", "flex")}
    r, off = 0, 0
    for s in samples:
        n = len(s.input_ids)
        if off + n > 112:
            r, off = r + 1, 0
        out_h = hf(**hf_inputs(s))
        for b, lg in outs.items():
            diff = (lg[r, off:off + n] - out_h.logits[0]).abs().max().item()
            assert diff <= 1e-5, f"{b}: sample at row {r} offset {off}: logits max abs diff {diff:.2e}"
        lab = batch["labels"][r, off:off + n]
        F.cross_entropy(out_h.logits[0], lab, ignore_index=-100, reduction="sum").backward()
        off += n
    titan_forward(tm, batch, labels=True).loss_sum.backward()
    assert_grads_close(tm, hf, cfg)


def test_packed_rows_need_their_documents():
    """A packed batch without the linear-attention documents is refused, not silently run across documents."""
    _, tm, cfg = models(False)
    g = torch.Generator().manual_seed(3)
    batch = pack([make_sample(cfg, [("text", 9)], g, text_vocab=150) for _ in range(2)], cfg)
    attn = build_attn_meta(batch, "sdpa", "cpu")
    with pytest.raises(ValueError, match="without their documents"):
        tm(batch["input_ids"], position_ids=batch["position_ids"], attn=attn)


def test_moe_aux_loss_matches_hf():
    hf, tm, cfg = models(True)
    s = make_sample(cfg, SAMPLES["image"], torch.Generator().manual_seed(3), text_vocab=150)
    with torch.no_grad():
        out_h = hf(**hf_inputs(s), output_router_logits=True)
        batch = pack([s], cfg, seq_len=len(s.input_ids))
        batch.pop("doc_ids")  # unpacked row: no padding, the token set HF sees
        out_t = titan_forward(tm, batch)
    assert torch.allclose(out_t.aux_loss, cfg.text.router_aux_loss_coef * out_h.aux_loss, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hf_round_trip(tmp_path, moe):
    """save_hf -> transformers from_pretrained, and save_pretrained -> load_hf: identical logits (text and image)."""
    hf, tm, cfg = models(moe)
    s = make_sample(cfg, SAMPLES["image"], torch.Generator().manual_seed(5), text_vocab=150)
    batch = pack([s], cfg, seq_len=len(s.input_ids))
    get_model_spec(cfg.model_type).save_hf(tm, cfg, tmp_path / "ours")
    cls = type(hf)
    back = cls.from_pretrained(tmp_path / "ours", attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        assert torch.equal(back(**hf_inputs(s)).logits, hf(**hf_inputs(s)).logits)
    hf.save_pretrained(tmp_path / "theirs")
    cfg2 = Qwen3_5Config.from_hf(tmp_path / "theirs", vision_attn_backend="sdpa")
    assert cfg2 == cfg
    tm2 = Qwen3_5Model(cfg2)
    q35_hf.load_hf(tm2, tmp_path / "theirs")
    with torch.no_grad():
        assert torch.equal(titan_forward(tm2, batch).logits, titan_forward(tm, batch).logits)


def test_hf_checkpoint_errors(tmp_path):
    hf, tm, cfg = models(False)
    hf.save_pretrained(tmp_path / "d")
    with pytest.raises(HFCheckpointError, match="qwen3_5_moe"):  # a dense folder read as MoE
        q35_hf.load_hf(Qwen3_5Model(models(True)[2]), tmp_path / "d")
    d = json.loads((tmp_path / "d" / "config.json").read_text())
    d["text_config"]["linear_num_value_heads"] = 2  # config.json that does not match the weights
    (tmp_path / "d" / "config.json").write_text(json.dumps(d))
    with pytest.raises(HFCheckpointError, match="linear_attn"):
        q35_hf.load_hf(Qwen3_5Model(Qwen3_5Config.from_hf(tmp_path / "d")), tmp_path / "d")


def test_config_reader():
    hf_cfg = hf_config(False).to_dict()
    cfg = Qwen3_5Config.from_hf_dict(hf_cfg)
    t = cfg.text
    assert t.layer_types == tuple(LAYERS) and t.rotary_dim == 8 and t.mrope_section == (2, 1, 1)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim) == \
        (2, 4, 8, 12)
    assert cfg.vision.deepstack_visual_indexes == () and cfg.image_token_id == 151
    d = dict(hf_cfg, text_config={k: v for k, v in hf_cfg["text_config"].items() if k != "layer_types"})
    d["text_config"]["full_attention_interval"] = 2
    assert Qwen3_5Config.from_hf_dict(d).text.layer_types == tuple(LAYERS)
    assert Qwen3_5Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="qwen3_vl"):
        Qwen3_5Config.from_hf_dict(dict(hf_cfg, model_type="qwen3_vl"))
    with pytest.raises(ValueError, match="attn_output_gate"):
        Qwen3_5Config.from_hf_dict(dict(hf_cfg, text_config=dict(hf_cfg["text_config"], attn_output_gate=False)))
    moe = Qwen3_5Config.from_hf_dict(hf_config(True).to_dict())
    assert moe.is_moe and moe.text.shared_expert_intermediate_size == 24 and moe.model_type == "qwen3_5_moe"
    for flavors in (FLAVORS, MOE_FLAVORS):  # every flavor survives config.json
        for name, f in flavors.items():
            assert Qwen3_5Config.from_hf_dict(f.to_hf_dict()) == f, name


def test_spec_and_flops():
    _, tm, cfg = models(True)
    spec = get_model_spec("qwen3_5_moe")
    d = spec.dims(cfg)
    assert (d.num_layers, d.moe_layers, d.num_experts, d.vision.deepstack_layers) == (4, 4, 4, 0)
    assert spec.data_needs(cfg).special_tokens["image_pad"] == 151
    # the matmul parameters the formula counts are exactly the model's matmul weights (active = all experts here)
    t = cfg.text
    mm = sum(p.numel() for n, p in tm.language_model.named_parameters()
             if p.dim() >= 2 and "conv_weight" not in n and "tok_embeddings" not in n)
    assert q35_flops.matmul_params(t, active=False) == mm
    # linear layers cost the same whatever the documents; full attention counts only the causal pairs inside each
    f1, f2 = spec.flops(cfg, [64]), spec.flops(cfg, [32, 32])
    pairs = 64 * 65 // 2 - 2 * (32 * 33 // 2)
    assert f1 - f2 == pytest.approx(12 * t.num_attention_heads * t.head_dim * 2 * pairs)


def test_cp_is_refused_before_anything_is_built():
    """The Gated DeltaNet recurrence has no context-parallel form here: parallel.cp > 1 is one ConfigError."""
    from titan_mm.config import ConfigError, load_config
    from titan_mm.train.setup import check_parallel, parallel_dims

    job = load_config(["--config", "debug_qwen3_5", "--parallel.cp", "2"])
    spec = get_model_spec("qwen3_5")
    with pytest.raises(ConfigError, match=r"cp=2, but model 'qwen3_5' does not support context parallelism"):
        check_parallel(job, parallel_dims(job, 2), spec, spec.flavor("debug"))


@pytest.mark.slow
def test_blocks_compile_fullgraph():
    """Both block kinds trace whole (torch.compile fullgraph, aot_eager) on packed rows, forward and backward, with
    the eager result (the CPU path; on CUDA fla's op is compiler-disabled: one graph break)."""
    from titan_mm.models.qwen3_5.model import with_linear

    _, tm, cfg = models(False)
    g = torch.Generator().manual_seed(2)
    b = prepare_batch(cfg, pack([make_sample(cfg, [("text", 40)], g), make_sample(cfg, [("text", 30)], g)], cfg,
                                seq_len=80), "cpu")
    attn = with_linear(build_attn_meta(b, "sdpa", "cpu"), b["linear_meta"])
    cos, sin = tm.rope(b["position_ids"], torch.float32)
    h = torch.randn(1, 80, cfg.text.hidden_size)
    for i in ("0", "1"):  # Gated DeltaNet, gated attention
        blk = tm.language_model.layers[i]
        out = torch.compile(blk, fullgraph=True, backend="aot_eager")(h, cos, sin, attn)[0]
        assert torch.allclose(out, blk(h, cos, sin, attn)[0], atol=1e-6)
        out.sum().backward()
