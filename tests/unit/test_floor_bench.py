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
