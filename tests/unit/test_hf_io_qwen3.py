"""HF directories in and out for Qwen3 / Qwen3-MoE: round trip through transformers, sharding, expert
layouts, and clear errors for missing / mis-shaped tensors and wrong model types."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parity"))
from _qwen3_helpers import VOCAB, hf_model  # noqa: E402

from titan_mm.models.hf_io import HFCheckpointError, read_safetensors, write_safetensors  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

pytest.importorskip("transformers")


def _load_titan(hf_dir, name="qwen3"):
    spec = get_model_spec(name)
    cfg = spec.config_from_hf(hf_dir)
    with torch.device("meta"):
        model = spec.build(cfg)
    spec.load_hf(model, hf_dir)
    return spec, cfg, model


@pytest.mark.parametrize("moe,tie", [(False, False), (False, True), (True, False)])
def test_round_trip_through_transformers(tmp_path, moe, tie):
    from transformers import AutoModelForCausalLM

    hf = hf_model(moe=moe, tie=tie, seed=7)
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf.save_pretrained(src)
    spec, cfg, model = _load_titan(src, "qwen3_moe" if moe else "qwen3")
    assert cfg.is_moe == moe and cfg.tie_word_embeddings == tie
    assert not any(p.is_meta for p in model.parameters()) and not model.rope_inv_freq.is_meta
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert (model(ids).logits - ref).abs().max().item() <= 1e-5
    spec.save_hf(model, cfg, dst)
    saved = json.load(open(dst / "config.json"))
    assert "attn_backend" not in saved and "loss_chunk_size" not in saved and "kernels" not in saved
    back = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, attn_implementation="eager")
    assert type(back).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, ref)
    # titan reads its own export identically
    _, cfg2, model2 = _load_titan(dst)
    assert cfg2 == cfg
    for (k, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(model2.state_dict().items())):
        assert torch.equal(a, b), k


def test_sharded_and_fused_expert_layouts(tmp_path):
    hf = hf_model(moe=True, seed=3)
    hf.save_pretrained(tmp_path / "hf_sharded", max_shard_size="40KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").exists()
    spec, cfg, model = _load_titan(tmp_path / "hf_sharded")
    # our writer shards too, and can write the fused (gate_up_proj) layout, which we also read
    spec.save_hf(model, cfg, tmp_path / "ours", max_shard_bytes=30_000)
    idx = json.load(open(tmp_path / "ours" / "model.safetensors.index.json"))
    assert len(set(idx["weight_map"].values())) > 1
    spec.save_hf(model, cfg, tmp_path / "fused", fused_experts=True)
    names = read_safetensors(tmp_path / "fused").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    for d in ("ours", "fused"):
        _, _, m2 = _load_titan(tmp_path / d)
        for k, v in model.state_dict().items():
            assert torch.equal(v, m2.state_dict()[k]), (d, k)


def _rewrite(src, dst, drop=None, reshape=None, cfg_patch=None):
    sd = read_safetensors(src)
    if drop:
        sd.pop(drop)
    if reshape:
        sd[reshape] = torch.zeros(3, 5)
    write_safetensors(sd, dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update(cfg_patch or {})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))


def test_errors_name_the_problem(tmp_path):
    hf_model(moe=False, seed=1).save_pretrained(tmp_path / "ok")
    hf_model(moe=True, seed=1).save_pretrained(tmp_path / "ok_moe")

    _rewrite(tmp_path / "ok", tmp_path / "missing", drop="model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(HFCheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        _load_titan(tmp_path / "missing")

    _rewrite(tmp_path / "ok", tmp_path / "shape", reshape="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(HFCheckpointError, match=r"wrong shape for model\.layers\.0\.mlp\.up_proj\.weight.*\(3, 5\)"):
        _load_titan(tmp_path / "shape")

    _rewrite(tmp_path / "ok", tmp_path / "untied_missing_head", cfg_patch={"tie_word_embeddings": False},
             drop="lm_head.weight")
    with pytest.raises(HFCheckpointError, match=r"lm_head\.weight"):
        _load_titan(tmp_path / "untied_missing_head")

    _rewrite(tmp_path / "ok", tmp_path / "llama", cfg_patch={"model_type": "llama"})
    with pytest.raises(ValueError, match=r"model_type='llama'"):
        _load_titan(tmp_path / "llama")
    # a model built from one config refuses a directory of another model type
    spec, cfg, model = _load_titan(tmp_path / "ok")
    with pytest.raises(HFCheckpointError, match=r"model_type='qwen3_moe'.*'qwen3'"):
        spec.load_hf(model, tmp_path / "ok_moe")

    _rewrite(tmp_path / "ok_moe", tmp_path / "moe_missing", drop="model.layers.1.mlp.experts.3.up_proj.weight")
    with pytest.raises(HFCheckpointError, match=r"layer 1: expert tensors mlp\.experts\.\{e\}\.up_proj\.weight missing for experts \[3\]"):
        _load_titan(tmp_path / "moe_missing")

    _rewrite(tmp_path / "ok", tmp_path / "extra", cfg_patch={})
    sd = read_safetensors(tmp_path / "extra")
    sd["model.layers.0.self_attn.rotary.weight"] = torch.zeros(2)
    write_safetensors(sd, tmp_path / "extra")
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor.*model\.layers\.0\.self_attn\.rotary\.weight"):
        _load_titan(tmp_path / "extra")

    os.makedirs(tmp_path / "empty")
    with pytest.raises(HFCheckpointError, match=r"config\.json"):
        _load_titan(tmp_path / "empty")


@pytest.mark.parametrize(
    "kw",
    [
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        {"attention_bias": True},
    ],
    ids=["yarn", "sliding_window", "attention_bias"],
)
def test_export_keeps_rope_window_and_bias(tmp_path, kw, caplog):
    from transformers import AutoModelForCausalLM

    from titan_mm.nn.attention import build_attn_meta
    from titan_mm.models.qwen3.config import Qwen3Config

    hf = hf_model(seed=5, **kw)
    hf.save_pretrained(tmp_path / "src")
    with caplog.at_level("WARNING"):
        spec, cfg, model = _load_titan(tmp_path / "src")
    assert not [r for r in caplog.records if r.name.startswith("titan_mm")], caplog.text  # no unknown keys
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    meta = build_attn_meta({"input_ids": ids}, "sdpa", "cpu", sliding_window=cfg.attn_sliding_window)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert (model(ids, attn=meta).logits - ref).abs().max().item() <= 1e-5
    spec.save_hf(model, cfg, tmp_path / "dst")
    assert Qwen3Config.from_hf(tmp_path / "dst") == cfg
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, ref)


def test_every_flavor_round_trips_through_transformers_config():
    from transformers import AutoConfig

    from titan_mm.models.qwen3 import FLAVORS
    from titan_mm.models.qwen3.config import Qwen3Config

    for name, cfg in FLAVORS.items():
        d = cfg.to_hf_dict(dtype="bfloat16")
        assert not set(Qwen3Config.RUNTIME_FIELDS) & set(d), name
        hf_cfg = AutoConfig.for_model(**d)
        assert hf_cfg.model_type == cfg.model_type
        assert Qwen3Config.from_hf_dict(hf_cfg.to_dict()) == cfg, name
        assert Qwen3Config.from_hf_dict(d) == cfg, name


def test_save_from_a_shuffled_state_dict_fused(tmp_path):
    import random

    hf = hf_model(moe=True, seed=8)
    hf.save_pretrained(tmp_path / "src")
    spec, cfg, model = _load_titan(tmp_path / "src")
    items = list(model.state_dict().items())
    random.Random(0).shuffle(items)
    spec.save_hf(dict(items), cfg, tmp_path / "dst", fused_experts=True, dtype=torch.bfloat16)
    assert json.load(open(tmp_path / "dst" / "config.json"))["torch_dtype"] == "bfloat16"
    _, _, back = _load_titan(tmp_path / "dst")
    for k, v in model.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), back.state_dict()[k]), k
