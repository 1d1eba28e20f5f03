"""Qwen3 FLOP counter: parameter counts against built models and the published sizes, attention counted
by real document lengths, active parameters only for MoE."""

from __future__ import annotations

import pytest
import torch

from titan_mm.models.qwen3 import FLAVORS, Qwen3Model
from titan_mm.models.qwen3 import flops as F
from titan_mm.registry import get_model_spec


@pytest.mark.parametrize("flavor", ["debug", "debug_moe"])
@pytest.mark.parametrize("tie", [False, True])
def test_num_params_matches_built_model(flavor, tie):
    cfg = FLAVORS[flavor].replace(tie_word_embeddings=tie, vocab_size=1000)
    with torch.device("meta"):
        m = Qwen3Model(cfg)
    assert F.num_params(cfg) == sum(p.numel() for p in m.parameters())


def test_published_sizes():
    # billions, as on the Qwen3 model cards (total; active for MoE includes the embedding)
    assert abs(F.num_params(FLAVORS["0.6B"]) / 1e9 - 0.6) < 0.01
    assert abs(F.num_params(FLAVORS["8B"]) / 1e9 - 8.2) < 0.02
    assert abs(F.num_params(FLAVORS["30B-A3B"]) / 1e9 - 30.5) < 0.05
    assert abs(F.num_params(FLAVORS["235B-A22B"]) / 1e9 - 235.1) < 0.1
    c = FLAVORS["30B-A3B"]
    active = F.matmul_params(c) + c.vocab_size * c.hidden_size  # + embedding row lookup, as the card counts
    assert abs(active / 1e9 - 3.3) < 0.1


def test_formula_by_document_lengths():
    cfg = FLAVORS["debug"]
    HK = cfg.num_attention_heads * cfg.head_dim
    Lyr = cfg.num_hidden_layers
    P = F.matmul_params(cfg)
    # one document of L tokens: 6 L P + 12 H K layers L(L+1)/2
    L = 100
    assert F.flops(cfg, [L]) == 6 * L * P + 12 * HK * Lyr * L * (L + 1) // 2
    # packing two documents removes exactly the cross-document pairs a*b
    a, b = 30, 70
    assert F.flops(cfg, [a + b]) - F.flops(cfg, [a, b]) == 12 * HK * Lyr * a * b
    assert F.flops_per_token(cfg, L) == F.flops(cfg, [L]) / L
    assert F.flops(cfg, torch.tensor([a, b])) == F.flops(cfg, [a, b])
    # registry entry is this function
    assert get_model_spec("qwen3").flops(cfg, [a, b]) == F.flops(cfg, [a, b])


def test_moe_counts_active_experts_only():
    cfg = FLAVORS["debug_moe"]
    dense_part = F.matmul_params(cfg.replace(num_experts_per_tok=1))
    two = F.matmul_params(cfg)  # top-2
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_hidden_layers
    assert two - dense_part == per_expert
    assert F.matmul_params(cfg, active=False) - two == (cfg.num_experts - 2) * per_expert


def test_sliding_window_pairs_and_doc_lens_from_batch():
    assert F.causal_pairs(10) == 55
    assert F.causal_pairs(10, window=3) == 3 + 2 + 1 + 7 * 3  # first 3 rows 1,2,3 then 3 each
    assert F.causal_pairs(10, window=3) == sum(min(q + 1, 3) for q in range(10))
    batch = {
        "cu_seqlens": torch.tensor([0, 5, 12, 16], dtype=torch.int32),
        "doc_ids": torch.tensor([[0] * 5 + [1] * 7 + [-1] * 4]),
    }
    assert F.doc_lens_from_batch(batch) == [5, 7]
