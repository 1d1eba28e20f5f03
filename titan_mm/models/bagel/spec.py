"""The BAGEL answers to the family contract (titan_mm.registry.ModelSpec): the batch record, the host-side routing and
ViT metadata (prepare_batch), the objectives' options, and the shapes the tools ask for."""

from __future__ import annotations

import dataclasses

import torch

from titan_mm.models.bagel.config import BagelConfig
from titan_mm.nn.attention import AttnMeta, build_attn_meta
from titan_mm.registry import BatchSchema, KernelShapes, ModelDims, Runtime, SeqKey

TEXT, VIT, VAE = 0, 1, 2
"""Codes of ``token_kind``: a text token (and padding), a ViT token, a VAE latent token. Text and ViT tokens take the
understanding expert, VAE tokens the generation expert."""

SCHEMA = BatchSchema(seq=(
    SeqKey("token_kind", dtype="int8"), SeqKey("latents", ("P",), "float32"), SeqKey("latent_mask", dtype="bool"),
    SeqKey("noise_unit"), SeqKey("cond_latents", ("P",), "float32"), SeqKey("latent_pos")),
    flat=("vit_patches", "vit_pos", "vit_lens"))
"""A packed batch (tokens, ``position_ids`` with one position per image, ``doc_ids``, ``seg_ids`` / ``seg_kinds``:
text causal, a ViT or clean VAE image full, a noised VAE image noise), and per token: ``token_kind`` (TEXT / VIT / VAE),
``latents`` [B, S, P] the clean latent patch of a noised image's tokens (flow matching's x0), ``latent_mask`` /
``noise_unit`` (flow matching: the noised tokens, one unit per image), ``cond_latents`` [B, S, P] a clean conditioning
image's patches (t = 0, no loss), ``latent_pos`` the latent 2-D position (row x max_latent_size + column). Besides
them, the images' ViT patches side by side: ``vit_patches`` [V, patch_dim], ``vit_pos`` [V] (row x
vit_max_num_patch_per_side + column), ``vit_lens`` [images]."""


def prepare_batch(cfg: BagelConfig, batch: dict, device, **_) -> dict:
    """On the host: ``token_kind`` -> the experts' routing (:func:`expert_routing`: ``gen_index``, ``expert_order``,
    ``expert_inverse``) and the ViT tokens' ``vit_index`` over the B*S flat tokens; ``vit_lens`` -> the ViT's
    bidirectional per-image mask ``vit_attn``;
    ``labels`` -> ``label_index``, the labeled tokens over B*S (the causal LM's head runs on them alone).
    A batch without ``latents`` (the serving engine's rows: text and ViT tokens) gets no expert indices: every token
    takes the understanding expert."""
    kinds = batch["token_kind"].reshape(-1)
    out = {k: v for k, v in batch.items() if k not in ("token_kind", "vit_lens")}
    dev = torch.device(device)
    if "labels" in batch:
        out["label_index"] = (batch["labels"].reshape(-1) != -100).nonzero().squeeze(1).to(dev, non_blocking=True)
    if "latents" in batch:
        out.update({k: v.to(dev, non_blocking=True) for k, v in expert_routing(kinds).items()})
    elif bool((kinds == VAE).any()):
        raise ValueError("the batch has latent tokens (token_kind 2) but no latents; give it the schema's latent keys")
    vit = (kinds == VIT).nonzero().squeeze(1)
    patches, lens = batch.get("vit_patches"), batch.get("vit_lens")
    n = 0 if patches is None else patches.shape[0]
    if vit.numel() != n or (n and (lens is None or int(lens.sum()) != n)):
        raise ValueError(f"the batch has {vit.numel()} ViT tokens (token_kind {VIT}) but {n} vit_patches (vit_lens sum "
                         f"{None if lens is None else int(lens.sum())}); give every ViT token one patch, in order")
    if n == 0:
        for k in ("vit_patches", "vit_pos"):
            out.pop(k, None)
        return out
    out["vit_index"] = vit.to(dev, non_blocking=True)
    out["vit_attn"] = vit_meta(cfg, lens, dev)
    return out


ROUTING_KEYS = ("gen_index", "expert_order", "expert_inverse")
"""The batch keys the layers and final norms route by (``trunk`` / ``head``'s keyword-only inputs;
:func:`expert_routing`)."""


def expert_routing(kinds_T: torch.Tensor) -> dict[str, torch.Tensor]:
    """The experts' routing of T tokens of ``token_kind`` ``kinds_T``, on the host: ``gen_index`` the latent tokens
    (the generation expert's, in order), ``expert_order`` the permutation that puts the understanding tokens first and
    the latent tokens after them, ``expert_inverse`` its inverse."""
    und, gen = (kinds_T != VAE).nonzero().squeeze(1), (kinds_T == VAE).nonzero().squeeze(1)
    order = torch.cat([und, gen])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return {"gen_index": gen, "expert_order": order, "expert_inverse": inverse}


def vit_meta(cfg: BagelConfig, vit_lens: torch.Tensor, device) -> AttnMeta:
    """The ViT's attention metadata for images of ``vit_lens`` patches packed side by side: each sees itself only."""
    lens = vit_lens.long()
    doc = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int32), lens)[None]
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int()
    return build_attn_meta({"doc_ids": doc, "cu_seqlens": cu, "max_seqlen": int(lens.max())}, cfg.attn_backend,
                           torch.device(device), kind="bidirectional")


GEN_MODULES = ("norm_gen", "time_embedder", "vae2llm", "llm2vae")
"""The generation path's top-level modules besides each layer's ``gen`` expert."""


def param_part(name: str) -> str:
    """"und", "gen", "vit" or "shared" of a parameter FQN (wrappers' ``_``-prefixed names skipped): the ViT tower;
    each layer's ``gen`` expert and the generation path's modules; the MLP-only split's shared attention; the rest
    (each layer's ``und`` expert, ``norm``, the embeddings, the LM head, the connector) understanding."""
    path = [p for p in name.split(".") if not p.startswith("_")]
    if path[0] == "vit":
        return "vit"
    if path[0] in GEN_MODULES or (path[0] == "layers" and path[2] == "gen"):
        return "gen"
    return "shared" if path[0] == "layers" and path[2] == "shared" else "und"


def frozen_parts(cfg: BagelConfig) -> frozenset[str]:
    """The parts the config freezes (``freeze_und``, ``freeze_vit``): the model is built with requires_grad False
    on their parameters."""
    return frozenset(part for part, on in (("und", cfg.freeze_und), ("vit", cfg.freeze_vit)) if on)


def param_groups(model: torch.nn.Module, cfg: BagelConfig, groups: list[dict], base_lr: float) -> list[dict]:
    """ModelSpec.param_groups: the trainer's groups (titan_mm.train.optim.build_param_groups) split by part, named
    ``<group>/<part>``, at ``base_lr``. A frozen part's parameters (requires_grad False from the build) are in no
    group: the optimizer neither steps nor keeps state for them."""
    part = {id(p): param_part(n) for n, p in model.named_parameters(remove_duplicate=False)}
    frozen, out = frozen_parts(cfg), []
    for g in groups:
        by: dict[str, list] = {}
        for p in g["params"]:
            by.setdefault(part[id(p)], []).append(p)
        out += [{**g, "params": ps, "name": f"{g.get('name', 'group')}/{k}"} for k, ps in by.items() if k not in frozen]
    return out


def objective_options(cfg: BagelConfig) -> dict[str, dict]:
    """Cross-entropy on the text, and flow matching with BAGEL's shifted timestep sampler on the noised latents, both
    under the batch's own segment mask (attention kind "segments")."""
    return {"flow_matching": {"sampler": "shifted", "shift": cfg.timestep_shift, "mask": "segments"}}


def dims(cfg: BagelConfig) -> ModelDims:
    """The decoder's shapes (one expert: each token runs one). The ViT is not a ``VisionDims`` tower: BAGEL's
    positions are 1-D (an image is one position), not M-RoPE."""
    c = cfg.llm_config
    return ModelDims(hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                     num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                     intermediate_size=c.intermediate_size, dense_layers=c.num_hidden_layers,
                     tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_position_embeddings)


def runtime(cfg: BagelConfig) -> Runtime:
    return Runtime(attn_backend=cfg.attn_backend, kernels=cfg.kernels)


def with_runtime(cfg: BagelConfig, attn_backend: str = "sdpa", kernels: bool | str = False) -> BagelConfig:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def kernel_shapes(cfg: BagelConfig, tp: int = 1, encoder_tp: bool = False) -> KernelShapes:
    c = cfg.llm_config
    return KernelShapes(rms_norm=(c.hidden_size,), head_norm=((c.num_attention_heads // tp, c.head_dim),),
                        swiglu=(c.intermediate_size // tp,), vocab=c.vocab_size,
                        rope=((c.num_attention_heads // tp, c.num_key_value_heads // tp, c.head_dim),))
