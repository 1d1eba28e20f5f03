"""The Qwen3.5 / Qwen3.5-MoE answers to the family contract (titan_mm.registry.ModelSpec)."""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen3_5.config import Qwen3_5Config
from titan_mm.models.qwen3_vl import spec as vl_spec
from titan_mm.registry import DataNeeds, FusedRows, KernelShapes, LinearDims, ModelDims, Runtime, VisionDims


def dims(cfg: Qwen3_5Config) -> ModelDims:
    """Heads and kv heads are the full-attention layers'; the Gated DeltaNet heads (linear_num_key_heads /
    linear_num_value_heads) are multiples of them in every released config, so tensor-parallel checks on the kv
    heads cover both kinds. ``linear`` names the Gated DeltaNet layers and their state (the serving engine's
    state slots)."""
    t, v = cfg.text, cfg.vision
    L = t.num_hidden_layers
    return ModelDims(
        hidden_size=t.hidden_size, num_layers=L, num_heads=t.num_attention_heads, num_kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim, vocab_size=t.vocab_size, intermediate_size=0 if t.is_moe else t.intermediate_size,
        dense_layers=0 if t.is_moe else L, moe_layers=L if t.is_moe else 0, num_experts=t.num_experts,
        experts_per_tok=t.num_experts_per_tok if t.is_moe else 0,
        moe_intermediate_size=t.moe_intermediate_size if t.is_moe else 0, tie_word_embeddings=t.tie_word_embeddings,
        vision=VisionDims(depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads,
                          intermediate_size=v.intermediate_size, patch_dim=v.patch_dim,
                          merge_size=v.spatial_merge_size, deepstack_layers=0),
        max_position_embeddings=t.max_position_embeddings,
        linear=LinearDims(layers=tuple(i for i in range(L) if t.is_linear(i)), num_key_heads=t.linear_num_key_heads,
                          num_value_heads=t.linear_num_value_heads, key_head_dim=t.linear_key_head_dim,
                          value_head_dim=t.linear_value_head_dim, conv_kernel=t.linear_conv_kernel_dim),
    )


def runtime(cfg: Qwen3_5Config) -> Runtime:
    return Runtime(attn_backend=cfg.attn_backend, kernels=cfg.kernels, sliding_window=None)


def with_runtime(cfg: Qwen3_5Config, attn_backend: str, kernels: bool | str) -> Qwen3_5Config:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def data_needs(cfg: Qwen3_5Config) -> DataNeeds:
    """Qwen3-VL's: the same processor, chat template, M-RoPE positions and special-token roles (with Qwen3.5's ids)."""
    return vl_spec.data_needs(cfg)


def kernel_shapes(cfg: Qwen3_5Config, tp: int = 1, encoder_tp: bool = False) -> KernelShapes:
    """Per tp rank: the zero-centred norms (hidden; q / k heads) and the gated norm (value head dim) through the
    RMSNorm kernel, the residual add + norm, SwiGLU at the dense / shared-expert width, RoPE only when it rotates
    whole heads (partial RoPE runs the reference on the rotated channels), the vocab, the ViT's RoPE and its MLP's
    bias + GELU."""
    t, v = cfg.text, cfg.vision
    hq, hk = t.num_attention_heads // tp, t.num_key_value_heads // tp
    width = t.shared_expert_intermediate_size if t.is_moe else t.intermediate_size
    return KernelShapes(
        rms_norm=(t.hidden_size, t.linear_value_head_dim), head_norm=((hq, t.head_dim), (hk, t.head_dim)),
        add_rms_norm=(t.hidden_size,), swiglu=(width // tp,),
        rope=((hq, hk, t.head_dim),) if t.rotary_dim == t.head_dim else (), vocab=t.vocab_size,
        bias_gelu=(v.intermediate_size // (tp if encoder_tp else 1),) if v.hidden_act == "gelu_pytorch_tanh" else (),
    ).plus(rope=(vl_spec.vision_rope(v, tp, encoder_tp),))


def fused_params(cfg: Qwen3_5Config) -> dict[str, FusedRows]:
    """Weights that hold several projections (Muon orthogonalizes their parts one by one): the ViT's q/k/v, the
    full attention's query + gate rows per head, the Gated DeltaNet's q / k / v rows per key head."""
    t = cfg.text
    r = t.linear_num_value_heads // t.linear_num_key_heads
    return {
        **vl_spec.fused_params(cfg),
        "language_model.layers.*.attn.wq.weight": FusedRows(t.num_attention_heads, (t.head_dim, t.head_dim)),
        "language_model.layers.*.linear_attn.in_proj_qkv.weight": FusedRows(
            t.linear_num_key_heads, (t.linear_key_head_dim, t.linear_key_head_dim, r * t.linear_value_head_dim)),
    }
