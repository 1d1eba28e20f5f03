"""Qwen3-VL: configs from HF config.json (real 30B-A3B numbers), flavors, freezing, per-part learning
rates, synthetic packed batches and FLOPs. CPU, seconds.

Run: OMP_NUM_THREADS=1 pytest -q tests/unit/test_vl_config_modes.py
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from titan_mm.models.qwen3_vl.config import FLAVORS, MOE_FLAVORS, Qwen3VLConfig, with_overrides
from titan_mm.models.qwen3_vl.flops import flops_of_batch, num_params
from titan_mm.models.qwen3_vl.model import Qwen3VLModel, mrope_cos_sin, param_kind
from titan_mm.models.qwen3_vl.synthetic import synthetic_vl_batch
from titan_mm.models.qwen3_vl.model import vision_inputs  # noqa: E402

# The fields of Qwen/Qwen3-VL-30B-A3B-Instruct/config.json that matter (as released).
HF_30B_A3B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "model_type": "qwen3_vl_moe_text", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936,
    },
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
        "model_type": "qwen3_vl_moe", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
}


def _math(c: Qwen3VLConfig):
    t = {k: v for k, v in dataclasses.asdict(c.text).items() if k not in ("bos_token_id", "eos_token_id")}
    return t, dataclasses.asdict(c.vision), c.mrope_section, c.tie_word_embeddings


def test_30b_a3b_config_json_matches_flavor():
    cfg = Qwen3VLConfig.from_hf_dict(HF_30B_A3B)
    assert _math(cfg) == _math(MOE_FLAVORS["30B-A3B"])
    n = num_params(cfg)
    assert abs(n["total"] / 1e9 - 31.07) < 0.01  # the published 31.07B parameters
    assert cfg.model_type == "qwen3_vl_moe" and cfg.text.norm_topk_prob


def test_flavor_param_counts_match_published_sizes():
    # published totals: 2.13B, 4.44B, 8.77B, 33.4B, 31.07B, 235.7B (ViT + mergers included)
    want = {"2B": 2.13, "4B": 4.44, "8B": 8.77, "32B": 33.36}
    for k, v in want.items():
        assert abs(num_params(FLAVORS[k])["total"] / 1e9 - v) < 0.02, k
    assert abs(num_params(MOE_FLAVORS["235B-A22B"])["total"] / 1e9 - 235.7) < 0.1


def test_to_hf_dict_is_read_by_transformers_and_back():
    transformers = pytest.importorskip("transformers")
    for cfg in (FLAVORS["debug"], MOE_FLAVORS["debug"], FLAVORS["8B"], MOE_FLAVORS["30B-A3B"]):
        d = cfg.to_hf_dict()
        hcls = transformers.Qwen3VLMoeConfig if cfg.is_moe else transformers.Qwen3VLConfig
        h = hcls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
        assert h.text_config.hidden_size == cfg.text.hidden_size
        assert list(h.text_config.rope_parameters["mrope_section"]) == list(cfg.mrope_section)
        back = Qwen3VLConfig.from_hf_dict(h.to_dict())
        assert _math(back) == _math(cfg)


def test_bad_configs_raise_clearly():
    with pytest.raises(ValueError, match="mrope_section"):
        dataclasses.replace(FLAVORS["debug"], mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="out_hidden_size"):
        dataclasses.replace(FLAVORS["debug"], vision=dataclasses.replace(FLAVORS["debug"].vision, out_hidden_size=64))
    with pytest.raises(ValueError, match=r"vision has unknown model-config fields.*depth"):
        with_overrides(FLAVORS["debug"], {"vision": {"dept": 3}})
    with pytest.raises(ValueError, match="nothing would train"):
        Qwen3VLModel(dataclasses.replace(FLAVORS["debug"], freeze_vision=True, freeze_merger=True, freeze_llm=True))


def _tiny():
    return with_overrides(FLAVORS["debug"], {"text": {"vocab_size": 512, "num_hidden_layers": 2},
                                             "vision": {"patch_size": 4, "num_position_embeddings": 64},
                                             "vision_start_token_id": 500, "image_token_id": 501,
                                             "video_token_id": 502, "vision_end_token_id": 503})


@pytest.mark.parametrize("flags", [dict(freeze_vision=True), dict(freeze_llm=True), dict(freeze_merger=True),
                                   dict(freeze_vision=True, freeze_merger=True)])
def test_freeze_and_param_groups(flags):
    from titan_mm.config import JobConfig
    from titan_mm.registry import get_model_spec
    from titan_mm.train.optim import build_param_groups

    cfg = dataclasses.replace(_tiny(), vision_lr=1e-5, llm_lr=3e-4, **flags)
    m = Qwen3VLModel(cfg)
    m.init_weights()
    frozen = {k for k in ("vision", "merger", "llm") if flags.get(f"freeze_{k}")}
    for n, p in m.named_parameters():
        assert p.requires_grad == (param_kind(n) not in frozen), n
    jc = JobConfig()
    jc.optimizer.lr = 1e-3
    spec = get_model_spec("qwen3_vl")  # as titan_mm.train.setup: the family's param_groups split the groups
    groups = build_param_groups(m, jc, functools.partial(spec.param_groups, m, cfg))
    want_lr = {"vision": 1e-5, "merger": 1e-5, "llm": 3e-4}
    seen = set()
    kind_of = {id(p): param_kind(n) for n, p in m.named_parameters()}
    for g in groups:
        kinds = {kind_of[id(p)] for p in g["params"]}
        assert len(kinds) == 1
        k = kinds.pop()
        assert g["lr"] == want_lr[k] and k not in frozen
        seen.add(k)
    assert seen == {"vision", "merger", "llm"} - frozen
    # a step leaves frozen parameters untouched and trains the rest
    opt = torch.optim.AdamW(groups)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    b = synthetic_vl_batch(cfg, num_tokens=128, image_hw=(8, 8), text_per_sample=20)
    extra = vision_inputs(m.cfg, b, "cpu")
    out = m(b["input_ids"], position_ids=b["position_ids"], labels=b["labels"], pixel_values=b["pixel_values"], **extra)
    out.loss_sum.backward()
    opt.step()
    for n, p in m.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        if param_kind(n) in frozen:
            assert not changed, n


def test_synthetic_batch_follows_contract_and_flops():
    cfg = _tiny()
    b = synthetic_vl_batch(cfg, num_tokens=256, rows=2, image_hw=(8, 8), text_per_sample=30)
    assert b["input_ids"].shape == (2, 256) and b["position_ids"].shape == (3, 2, 256)
    n_pad = int((b["input_ids"] == cfg.image_token_id).sum())
    assert n_pad == int((b["image_grid_thw"].prod(-1) // 4).sum())
    assert b["pixel_values"].shape == (int(b["image_grid_thw"].prod(-1).sum()), cfg.vision.patch_dim)
    assert int(b["cu_seqlens"][-1]) == 2 * 256
    f = flops_of_batch(cfg, b)
    assert f["vision"] > 0 and f["total"] == f["llm"] + f["vision"]


def test_mrope_cos_sin_matches_hf_rotary():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    tc = transformers.Qwen3VLTextConfig(head_dim=32, hidden_size=64, num_attention_heads=2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                         "mrope_section": [6, 5, 5], "mrope_interleaved": True})
    rot = Qwen3VLTextRotaryEmbedding(tc)
    pos = torch.randint(0, 3000, (3, 2, 17))
    x = torch.zeros(1, dtype=torch.float32)
    cos_h, sin_h = rot(x, pos)
    cos, sin = mrope_cos_sin(pos, rot.inv_freq, (6, 5, 5), torch.float32)
    assert (cos - cos_h).abs().max() < 1e-6 and (sin - sin_h).abs().max() < 1e-6
