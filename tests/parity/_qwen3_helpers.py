"""Shared helpers for Qwen3 parity / HF IO tests: tiny random HF models and their titan twins, and any family's
titan model filled from a saved HF folder (:func:`titan_from_hf`)."""

from __future__ import annotations

import torch

from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3.hf import hf_to_titan
from titan_mm.models.qwen3.model import Qwen3Model
from titan_mm.registry import spec_for_hf_dir

VOCAB = 128


def hf_config(moe: bool = False, tie: bool = False, **kw):
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, attention_dropout=0.0, rope_theta=10000.0,
    )
    if moe:
        common.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01,
                      output_router_logits=True)
    common.update(kw)
    rope_theta = common.pop("rope_theta")
    rope = common.pop("rope_parameters", None) or {"rope_type": "default"}
    rope = {**rope, "rope_theta": rope_theta}
    cls = Qwen3MoeConfig if moe else HFQwen3Config
    return cls(rope_parameters=rope, **common)


def hf_model(moe: bool = False, tie: bool = False, seed: int = 0, **kw):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(moe, tie, **kw)
    cfg._attn_implementation = "eager"
    return randomize_((Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(cfg).float().eval())


def randomize_(m):
    """HF inits norms to 1 and some weights to 0; randomize everything for a real test (in place, returns m)."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return m


def titan_from_hf(folder, **runtime):
    """(model, spec, config) of an HF folder, filled as the trainer fills one: built on meta, materialized on the
    CPU, buffers initialized, then the folder's weights through the spec's load_hf. ``runtime``: config_from_hf's
    runtime fields (vision_attn_backend="sdpa", ...)."""
    spec = spec_for_hf_dir(str(folder))
    cfg = spec.config_from_hf(str(folder), **runtime)
    with torch.device("meta"):
        m = spec.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights(buffer_device="cpu")  # parameters are then overwritten, buffers kept
    spec.load_hf(m, str(folder))
    return m, spec, cfg


def titan_twin(hf, **runtime) -> Qwen3Model:
    cfg = Qwen3Config.from_hf_dict(hf.config.to_dict(), **runtime)
    m = Qwen3Model(cfg)
    sd = hf_to_titan(dict(hf.state_dict()), cfg)
    m.load_state_dict(sd, strict=True)
    return m


def packed_batch(doc_lens: list[int], S: int, vocab: int = VOCAB, seed: int = 1) -> dict[str, torch.Tensor]:
    """One row of ``doc_lens`` documents + trailing padding, in the data pipeline's batch format."""
    g = torch.Generator().manual_seed(seed)
    n = sum(doc_lens)
    assert n <= S
    ids = torch.randint(0, vocab, (1, S), generator=g)
    pos = torch.zeros(1, S, dtype=torch.long)
    doc = torch.full((1, S), -1, dtype=torch.int32)
    o = 0
    for d, L in enumerate(doc_lens):
        pos[0, o : o + L] = torch.arange(L)
        doc[0, o : o + L] = d
        o += L
    segs = list(doc_lens) + ([S - n] if S > n else [])
    cu = torch.tensor([0] + torch.tensor(segs).cumsum(0).tolist(), dtype=torch.int32)
    return {"input_ids": ids, "position_ids": pos, "doc_ids": doc, "cu_seqlens": cu,
            "max_seqlen": torch.tensor(max(segs))}


def grads_by_titan_name(titan, hf) -> tuple[dict, dict]:
    tg = {n: p.grad for n, p in titan.named_parameters() if p.grad is not None}
    hg = hf_to_titan({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, titan.cfg)
    return tg, hg


def assert_grads_close(tg: dict, hg: dict, rtol: float = 1e-4) -> None:
    assert set(tg) == set(hg), (sorted(set(tg) ^ set(hg)))
    for n in tg:
        ref = hg[n]
        err = (tg[n] - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err <= rtol * max(scale, 1e-6), f"grad {n}: max abs err {err:.3e} vs max |grad| {scale:.3e}"
