"""Peer training stacks for bench/mfu.py, each built the way its users run it on one GPU.

- ``torchtitan``: torchtitan 0.2.2's own Qwen3 model, per-block torch.compile, FSDP2 with bf16 params /
  fp32 reduce, full-logit cross-entropy (what torchtitan's trainer does).
- ``hf`` / ``hf_liger``: HF transformers' Qwen3 (sdpa attention), optionally with Liger 0.8.5's kernels
  (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) applied through its monkey-patch API, FSDP2 per
  decoder layer with the same mixed-precision policy.

Every builder returns ``(model, step_fn)`` where ``step_fn(batch) -> loss`` (batch on the device) runs forward and
backward; the caller owns the optimizer step and timing so all stacks are measured the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# the peers' table of cases: HF model_type -> (transformers class, Liger's SwiGLU patch on; its Qwen3-VL one is
# off by default)
HF_PEERS = {
    "qwen3": ("Qwen3ForCausalLM", True),
    "qwen3_moe": ("Qwen3MoeForCausalLM", True),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", False),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", True),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", False),  # Liger 0.8.5 has no Qwen3.5 patch: run "hf"
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", False),
}


def _hf_modules(model):
    """Decoder layers (and vision blocks) of an HF Qwen3 / Qwen3-VL model, the FSDP units."""
    inner = model.model
    units = list(getattr(inner, "language_model", inner).layers)
    if hasattr(inner, "visual"):
        units += list(inner.visual.blocks)
    return units


def build_hf(hf_config: dict, device: torch.device, liger: bool, compile_blocks: bool = False):
    """HF model from a config.json dict (titan_mm's ``cfg.to_hf_dict()``, so every stack has the same shape)."""
    import transformers
    from transformers import AutoConfig

    mt = hf_config["model_type"]
    cls_name, liger_swiglu = HF_PEERS[mt]
    cfg = AutoConfig.for_model(**hf_config)
    cfg._attn_implementation = "sdpa"
    if liger:
        import liger_kernel.transformers as lk

        patch = getattr(lk, f"apply_liger_kernel_to_{mt}")
        kw = dict(rope=True, rms_norm=True, fused_linear_cross_entropy=True)
        if liger_swiglu:
            kw["swiglu"] = True
        patch(**kw)
    cls = getattr(transformers, cls_name)
    with torch.device(device):
        model = cls(cfg).float()
    for unit in _hf_modules(model):
        if compile_blocks:
            unit.compile()
        fully_shard(unit, mp_policy=MP)
    fully_shard(model, mp_policy=MP)

    import inspect

    wants_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters

    def step(batch):
        kw = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
        if wants_types and "image_grid_thw" in batch:  # transformers >= 5.2x: 0 text, 1 image, 2 video
            ids = batch["input_ids"]
            kw["mm_token_type_ids"] = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
        out = model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False, **kw)
        out.loss.backward()
        return out.loss.detach()

    return model, step


def hf_twin(model: torch.nn.Module, cfg, attn: str = "sdpa"):
    """transformers' model over the very tensors of a titan_mm Qwen3 / Qwen3-MoE (its HF names from qwen3/hf.py;
    nothing is copied), in eval mode: the serving peer of bench/serve.py."""
    import transformers
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    from titan_mm.models.qwen3.hf import titan_to_hf

    hf_config = cfg.to_hf_dict()
    conf = AutoConfig.for_model(**hf_config)
    conf._attn_implementation = attn
    with torch.device(next(model.parameters()).device), no_init_weights():  # uninitialised: replaced below
        hf = getattr(transformers, HF_PEERS[hf_config["model_type"]][0])(conf)
    missing, unexpected = hf.load_state_dict(titan_to_hf(model.state_dict(), cfg), strict=False, assign=True)
    tied = ["lm_head.weight"] if hf_config.get("tie_word_embeddings") else []
    if unexpected or missing != tied:
        raise KeyError(f"titan -> HF names do not cover the model: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval().requires_grad_(False)


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

    def step(batch):
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        return loss.detach()

    return model, step
