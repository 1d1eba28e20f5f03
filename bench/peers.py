"""Peer training stacks for bench/mfu.py, each built the way its users run it on one GPU.

- ``torchtitan``: torchtitan 0.2.2's own Qwen3 model, per-block torch.compile, FSDP2 with bf16 params /
  fp32 reduce, full-logit cross-entropy (what torchtitan's trainer does).
- ``hf`` / ``hf_liger``: HF transformers' Qwen3 (sdpa attention), optionally with Liger 0.8.5's kernels
  (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) applied through its monkey-patch API, FSDP2 per
  decoder layer with the same mixed-precision policy.

Every builder returns ``(model, step_fn)`` where ``step_fn(input_ids, labels) -> loss`` runs forward and
backward; the caller owns the optimizer step and timing so all stacks are measured the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _hf_qwen3_config(shape: dict):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["dim"],
        num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["ffn_dim"],
        rope_theta=shape.get("rope_theta", 1_000_000.0),
        max_position_embeddings=max(shape["seq_len"], 4096),
        tie_word_embeddings=shape["tied"],
        rms_norm_eps=1e-6,
    )
    if shape.get("num_experts"):
        return Qwen3MoeConfig(
            **common,
            num_experts=shape["num_experts"],
            num_experts_per_tok=shape["top_k"],
            moe_intermediate_size=shape["moe_ffn_dim"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
    return Qwen3Config(**common)


def build_hf(shape: dict, device: torch.device, liger: bool, compile_blocks: bool = False):
    from transformers import AutoModelForCausalLM

    cfg = _hf_qwen3_config(shape)
    cfg._attn_implementation = "sdpa"
    if liger:
        if shape.get("num_experts"):
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe as patch
        else:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3 as patch
        patch(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    for layer in model.model.layers:
        if compile_blocks:
            layer.compile()
        fully_shard(layer, mp_policy=MP)
    fully_shard(model, mp_policy=MP)

    def step(input_ids, labels):
        out = model(input_ids=input_ids, labels=labels, use_cache=False)
        out.loss.backward()
        return out.loss.detach()

    return model, step


def build_torchtitan(shape: dict, device: torch.device, compile_blocks: bool = True):
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs

    kw = dict(
        vocab_size=shape["vocab_size"],
        max_seq_len=shape["seq_len"],
        head_dim=shape["head_dim"],
        dim=shape["dim"],
        n_layers=shape["n_layers"],
        n_heads=shape["n_heads"],
        n_kv_heads=shape["n_kv_heads"],
        qk_norm=True,
        hidden_dim=shape["ffn_dim"],
        rope_theta=shape.get("rope_theta", 1_000_000.0),
        enable_weight_tying=shape["tied"],
    )
    if shape.get("num_experts"):
        from torchtitan.models.moe import MoEArgs

        kw.update(
            moe_enabled=True,
            moe_inter_dim=shape["moe_ffn_dim"],
            moe_args=MoEArgs(
                num_experts=shape["num_experts"],
                top_k=shape["top_k"],
                score_func="softmax",
                route_norm=True,
                score_before_experts=False,
                use_grouped_mm=True,
            ),
        )
    args = Qwen3ModelArgs(**kw)
    with torch.device("meta"):
        model = Qwen3Model(args)
    for block in model.layers.values():
        if compile_blocks:
            block.compile(fullgraph=True)
        fully_shard(block, mp_policy=MP)
    fully_shard(model, mp_policy=MP)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)

    def step(input_ids, labels):
        logits = model(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        return loss.detach()

    return model, step
