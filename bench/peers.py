"""Peer training stacks for bench/mfu.py, each built the way its users run it on one GPU.

- ``torchtitan``: torchtitan 0.2.2's own Qwen3 model, per-block torch.compile, FSDP2 with bf16 params /
  fp32 reduce, full-logit cross-entropy (what torchtitan's trainer does).
- ``diffusers`` (Wan): diffusers' ``WanTransformer3DModel`` as a diffusers training loop runs it (the issue 48
  peer): per-block torch.compile, FSDP2 per block and on the root with the same mixed-precision policy, the flow
  matching loss of titan_mm's objective on the same noise (:func:`build_diffusers_wan`).
- ``hf`` / ``hf_liger``: HF transformers' Qwen3 (sdpa attention), optionally with Liger 0.8.5's kernels
  (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) applied through its monkey-patch API, FSDP2 per
  decoder layer (and per vision / audio encoder block) with the same mixed-precision policy. The Omni thinkers
  take the audio as HF's processor gives it (:func:`hf_audio_inputs`: clips padded to one length plus
  ``feature_attention_mask``) and an all-ones ``attention_mask``, without which HF builds no TMRoPE positions.

Every builder returns ``(model, step_fn)`` where ``step_fn(batch) -> loss`` (batch on the device; the Wan peer's:
the host clip batch and the step number) runs forward and backward; the caller owns the optimizer step and timing
so all stacks are measured the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_mm.models.wan.model import unpatchify

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# the peers' table of cases: HF model_type -> (transformers class, Liger's SwiGLU patch on; its Qwen3-VL one is
# off by default)
HF_PEERS = {
    "qwen3": ("Qwen3ForCausalLM", True),
    "qwen3_moe": ("Qwen3MoeForCausalLM", True),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", False),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", True),
    # Liger 0.8.5 patches Qwen3.5 (apply_liger_kernel_to_qwen3_5 / _moe); issue 27's peer is transformers alone ("hf")
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", False),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", False),
    # Liger 0.8.5 has no Omni patch (no apply_liger_kernel_to_qwen2_5_omni / _qwen3_omni_moe, none in its
    # MODEL_TYPE_TO_APPLY_LIGER_FN): run "hf"
    "qwen2_5_omni_thinker": ("Qwen2_5OmniThinkerForConditionalGeneration", False),
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerForConditionalGeneration", False),
}


def _hf_modules(model):
    """Decoder layers (and vision blocks, audio encoder layers) of an HF Qwen3 / Qwen3-VL / Omni thinker model, the
    FSDP units. The towers sit on ``model.model`` (transformers 5.2x) or on the thinker itself (older layouts)."""
    inner = model.model
    units = list(getattr(inner, "language_model", inner).layers)
    for tower, blocks in (("visual", "blocks"), ("audio_tower", "layers")):
        t = getattr(inner, tower, None)
        t = getattr(model, tower, None) if t is None else t
        if t is not None:
            units += list(getattr(t, blocks))
    return units


def hf_audio_inputs(batch: dict) -> dict:
    """HF's audio inputs of a titan batch (clips side by side, ``input_features [n_mels, sum frames]`` with
    ``audio_feature_lengths``): ``input_features [n_clips, n_mels, max frames]`` (zero-padded) and
    ``feature_attention_mask [n_clips, max frames]``, as the Omni processors give them; {} without audio."""
    if "audio_feature_lengths" not in batch:
        return {}
    lens = [int(n) for n in batch["audio_feature_lengths"].tolist()]
    feats = batch["input_features"]
    padded = feats.new_zeros(len(lens), feats.shape[0], max(lens))
    mask = torch.zeros(len(lens), max(lens), dtype=torch.long)
    off = 0
    for i, n in enumerate(lens):
        padded[i, :, :n] = feats[:, off : off + n]
        mask[i, :n] = 1
        off += n
    return {"input_features": padded, "feature_attention_mask": mask}


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

        patch = getattr(lk, f"apply_liger_kernel_to_{mt}", None)
        if patch is None:
            raise SystemExit(f"liger_kernel {getattr(lk, '__version__', '')} has no apply_liger_kernel_to_{mt}: "
                             f"run the hf stack for {mt}")
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

    params = inspect.signature(model.forward).parameters
    wants_types = "mm_token_type_ids" in params
    omni = "feature_attention_mask" in params

    def step(batch):
        kw = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
        if omni:  # batch: hf_audio_inputs' keys; the all-ones mask lets HF build its TMRoPE positions
            kw.update({k: batch[k] for k in ("input_features", "feature_attention_mask") if k in batch})
            kw["attention_mask"] = torch.ones_like(batch["input_ids"])
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


def build_diffusers_wan(hf_config: dict, device: torch.device, objective, mp: MixedPrecisionPolicy = MP,
                        compile_blocks: bool = True, checkpoint_blocks: int = 0):
    """diffusers' WanTransformer3DModel from a transformer config.json dict (titan_mm's ``cfg.to_hf_dict()``) in
    fp32 master weights, each block compiled and fully_shard-ed (``mp``: bf16 params / fp32 reduce), then the root;
    ``checkpoint_blocks``: the first N blocks under torch's checkpoint_wrapper (titan's full AC on N blocks; -1:
    every block), where a clip's activations do not fit otherwise.
    Its step takes titan_mm's host clip batch (SCHEMA: patches, one clip a row) and the step number: ``objective``
    (the titan stack's flow matching: sampler, seed) draws t and the noise as the trainer does at that step; the
    clip goes in as diffusers' [B, C, F, H, W] with diffusers' timestep t x 1000 (one per clip, or one per patch
    where a row's t differ), and the loss is the same weighted velocity MSE over the latent elements."""
    from diffusers import WanTransformer3DModel  # optional dependency: the diffusers extra, only this peer needs it

    kw = {k: list(v) if isinstance(v, tuple) else v for k, v in hf_config.items() if not k.startswith("_")}
    with torch.device(device):
        model = WanTransformer3DModel(**kw).float()
    n_ac = len(model.blocks) if checkpoint_blocks < 0 else checkpoint_blocks
    for i, block in enumerate(model.blocks):
        if i < n_ac:  # non-reentrant, as titan's full AC (titan_mm.parallel.apply)
            block = model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        if compile_blocks:
            block.compile()
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    patch = tuple(kw["patch_size"])

    def step(host_batch: dict, step_index: int):
        mb = objective.prepare([host_batch], step_index)[0]
        fhw = tuple(int(n) + 1 for n in mb["grid_fhw"][0].amax(0).tolist())
        x = unpatchify(mb["noisy_latents"], fhw, patch).to(device)
        target = unpatchify(mb["flow_target"], fhw, patch).to(device)
        t = mb["timesteps"]
        t = (t[:, 0] if bool((t == t[:, :1]).all()) else t).to(device) * 1000  # diffusers' timestep = sigma x 1000
        w = unpatchify(mb["flow_weight"][..., None].expand(-1, -1, x.shape[1] * math.prod(patch)), fhw, patch)
        pred = model(x, t, mb["text_states"].to(device), return_dict=False)[0]
        loss = ((pred.float() - target).square() * w.to(device)).sum() / int(mb["num_latent_elements"])
        loss.backward()
        return loss.detach()

    return model, step
