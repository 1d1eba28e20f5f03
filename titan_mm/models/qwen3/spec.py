"""The Qwen3 / Qwen3-MoE answers to the family contract (titan_mm.registry.ModelSpec)."""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.registry import DataNeeds, KernelShapes, ModelDims, Runtime


def dims(cfg: Qwen3Config) -> ModelDims:
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return ModelDims(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        intermediate_size=cfg.intermediate_size, dense_layers=cfg.num_hidden_layers - n_moe, moe_layers=n_moe,
        num_experts=cfg.num_experts, experts_per_tok=cfg.num_experts_per_tok if cfg.is_moe else 0,
        moe_intermediate_size=cfg.moe_intermediate_size if cfg.is_moe else 0,
        tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_position_embeddings,
    )


def runtime(cfg: Qwen3Config) -> Runtime:
    return Runtime(attn_backend=cfg.attn_backend, kernels=cfg.kernels, sliding_window=cfg.attn_sliding_window)


def with_runtime(cfg: Qwen3Config, attn_backend: str, kernels: bool | str) -> Qwen3Config:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def data_needs(cfg: Qwen3Config) -> DataNeeds:
    return DataNeeds(positions="1d", chat_template="chatml_think")


def kernel_shapes(cfg: Qwen3Config, tp: int = 1, encoder_tp: bool = False) -> KernelShapes:
    """The decoder's widths per tp rank: norms over the hidden size and over head_dim (q/k-norm, local heads),
    the residual add + norm, SwiGLU at the dense MLP width / tp, RoPE on the local heads, the LM head's vocab."""
    d = dims(cfg)
    hq, hk = d.num_heads // tp, d.num_kv_heads // tp
    return KernelShapes(
        rms_norm=(d.hidden_size,), head_norm=((hq, d.head_dim),) if cfg.qk_norm else (),
        add_rms_norm=(d.hidden_size,),
        swiglu=(d.intermediate_size // tp,) if d.dense_layers else (), rope=((hq, hk, d.head_dim),),
        vocab=d.vocab_size,
    )
