"""bench/floor.py counts the same GEMM and attention FLOPs as titan_mm's FLOP counter (the GPU timing itself
runs on the H200)."""

import dataclasses

import pytest

floor = pytest.importorskip("bench.floor")


def test_floor_flops_match_the_flop_counter():
    from titan_mm.registry import get_model_spec

    spec = get_model_spec("qwen3")
    cfg = dataclasses.replace(spec.flavor("1.7B"), num_hidden_layers=2)
    batch, seq = 2, 256
    n = batch * seq
    groups = floor.linears(cfg)
    per_layer = sum(6 * n * i * o for g in ("qkv", "o", "gate_up", "down") for i, o in groups[g])
    head = 6 * n * cfg.hidden_size * cfg.vocab_size
    attn = 3.5 * 2 * 2 * batch * cfg.num_attention_heads * seq * seq * cfg.head_dim / 2
    total = cfg.num_hidden_layers * (per_layer + attn) + head
    counted = spec.flops(cfg, [seq] * batch)
    assert abs(total / counted - 1) < 1e-3, (total, counted)
    # the fused forms are the same FLOPs as the separate ones
    for g in ("qkv", "gate_up"):
        assert sum(i * o for i, o in groups[g]) == sum(i * o for i, o in groups[g + "_fused"])


def test_moe_floor_runs_and_counts_the_experts_flops():
    """The MoE rows run end to end (on the CPU here, in fp32) and count the experts' nine GEMMs as the FLOP
    counter does: 6 FLOPs per token per active expert weight."""
    import math

    import torch

    from titan_mm.registry import get_model_spec

    spec = get_model_spec("qwen3_moe")
    t = spec.dims(spec.flavor("debug_moe"))
    n = 64
    for kind in ("router", "skewed"):
        r = floor.moe_floor(t, n, kind, device=torch.device("cpu"), dtype=torch.float32)
        assert r["gemm_flops"] == 6 * n * t.experts_per_tok * 3 * t.hidden_size * t.moe_intermediate_size
        assert r["assignments"] == n * t.experts_per_tok and r["max_over_mean"] >= 1.0
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("gemms_ms", "gemms_gate_up_fused_ms", "permute_ms",
                                                              "combine_ms", "routing_ms", "routing_fused_ms",
                                                              "layer_ms"))
    with pytest.raises(ValueError, match="router | skewed"):
        floor.routing(n, t, "uniform", torch.device("cpu"))
