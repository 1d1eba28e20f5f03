"""bench/mfu.py's ``bagel_ref`` stack: BAGEL's training step composed from its reference components.

BAGEL's own repository (ByteDance-Seed/Bagel) is not pip-installable, and the GPU machine has no network to fetch
it, so its ``Bagel.forward`` cannot run there. This peer computes what it computes (modeling/bagel/bagel.py,
qwen2_navit.py, siglip_navit.py, modeling_utils.py) from the components that reference is built of, as
tests/unit/test_bagel.py's parity reference does:

- the decoder: each ``language_model.model.layers.{i}`` is BAGEL's Qwen2MoTDecoderLayer as two transformers
  ``Qwen3DecoderLayer`` (``attention_bias=True`` minus o_proj's bias: Qwen2 with QK-norm), the understanding copy
  and the ``_moe_gen`` copy; every projection, norm and MLP is routed per token by index as BAGEL's
  PackedAttentionMoT does (``packed_und_token_indexes`` / ``packed_gen_token_indexes``), and attention runs over the
  whole packed sequence through transformers' own attention functions: ``flex_attention`` under a BlockMask of
  BAGEL's ``create_sparse_mask`` (causal or same full / noise split, never another split's noise, same document),
  or ``sdpa`` under that mask materialized (the CPU);
- the ViT: transformers' ``SiglipEncoderLayer`` over the packed images at once, each image attending only to itself
  (siglip_navit's varlen flash attention: images of one size as a batch without a mask, mixed sizes under a
  block-diagonal mask), then BAGEL's connector and ViT position table;
- the VAE tokens: ``vae2llm`` + the timestep embedder + the latent position table (BAGEL's generation inputs);
- the loss: cross-entropy over the label tokens plus the velocity MSE (``llm2vae``) over the noised latents, each
  over its global count, as titan_mm's objective normalizes them.

Parameters carry the released layout's names (``ema.safetensors``: titan_mm.models.bagel.hf), so
:func:`load_released` takes titan's weights through the family's own export names and the two stacks start from the
same model. Each decoder layer and ViT layer is compiled and fully_shard-ed (FSDP2 on the one-GPU mesh: bf16 params,
fp32 reduce), then the root, as the other peers.

Not reproduced: BAGEL's data pipeline (its PackedDataset and per-sample packing; the step takes titan's packed rows),
its FLUX VAE in the step (the rows hold latents, as titan's bench case), BAGEL's EMA model and its FSDP wrapping
policy (FSDP1 with its own shard grouping), and the MLP-only Qwen2MoEDecoderLayer variant (refused).
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.attention.flex_attention import (
    and_masks,
    create_block_mask,
    create_mask,
    or_masks,
)
from transformers import Qwen3Config, SiglipVisionConfig
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.hf import hf_name
from titan_mm.models.bagel.model import sincos_table
from titan_mm.models.bagel.spec import VAE, VIT
from titan_mm.nn.attention import FULL, NOISE

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ATTN = {"sdpa": sdpa_attention_forward, "flex": flex_attention_forward}
MOT = "Qwen2MoTDecoderLayer"


def route(fu, fg, x: torch.Tensor, und: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
    """BAGEL's MoT routing: the tokens ``und`` through ``fu``, ``gen`` through ``fg``, written back in place of
    the packed sequence (index tensors from the host, no boolean indexing: no host sync)."""
    yu, yg = fu(x.index_select(0, und)), fg(x.index_select(0, gen))
    out = yu.new_zeros((x.shape[0],) + yu.shape[1:])
    return out.index_copy(0, und, yu).index_copy(0, gen, yg)


class MoTLayer(nn.Module):
    """``language_model.model.layers.{i}``: the understanding and generation copies of one decoder layer."""

    def __init__(self, qc: Qwen3Config, i: int, heads: tuple[int, int, int], attn: str):
        super().__init__()
        self.und, self.gen = Qwen3DecoderLayer(qc, i), Qwen3DecoderLayer(qc, i)
        for layer in (self.und, self.gen):
            layer.self_attn.o_proj.register_parameter("bias", None)  # BAGEL's Qwen2 o_proj has none
        self.heads, self.attn = heads, ATTN[attn]

    def forward(self, h, und, gen, cos, sin, mask):
        H, G, K = self.heads
        u, g = self.und, self.gen
        x = route(u.input_layernorm, g.input_layernorm, h, und, gen)
        q, k, v = (route(getattr(u.self_attn, n), getattr(g.self_attn, n), x, und, gen)
                   for n in ("q_proj", "k_proj", "v_proj"))
        q = route(u.self_attn.q_norm, g.self_attn.q_norm, q.view(-1, H, K), und, gen)
        k = route(u.self_attn.k_norm, g.self_attn.k_norm, k.view(-1, G, K), und, gen)
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        o, _ = self.attn(u.self_attn, q, k, v.view(-1, G, K).transpose(0, 1)[None], mask, scaling=K**-0.5)
        h = h + route(u.self_attn.o_proj, g.self_attn.o_proj, o.reshape(h.shape[0], H * K), und, gen)
        return h + route(lambda y: u.mlp(u.post_attention_layernorm(y)),
                         lambda y: g.mlp(g.post_attention_layernorm(y)), h, und, gen)


class _Table(nn.Module):
    """BAGEL's PositionEmbedding: a frozen sin-cos ``pos_embed`` parameter."""

    def __init__(self, dim: int, side: int):
        super().__init__()
        self.pos_embed = nn.Parameter(sincos_table(dim, side), requires_grad=False)


def timestep_embedding(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """modeling_utils.TimestepEmbedder.timestep_embedding: [cos, sin] of t x 10000^(-i / half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class BagelRef(nn.Module):
    """BAGEL's ``Bagel`` module (the trained parts), under the released checkpoint's parameter names."""

    def __init__(self, cfg: BagelConfig, attn: str = "sdpa"):
        super().__init__()
        c, v = cfg.llm_config, cfg.vit_config
        if c.layer_module != MOT:
            raise ValueError(f"the bagel_ref stack builds {MOT} layers; layer_module {c.layer_module!r} (the MLP-only "
                             "split) is not built: bench a MoT flavor")
        qc = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, attention_bias=True,
                         rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta)
        heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        lm = nn.Module()
        lm.model = nn.Module()
        lm.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        lm.model.layers = nn.ModuleList(MoTLayer(qc, i, heads, attn) for i in range(c.num_hidden_layers))
        lm.model.norm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        lm.model.norm_moe_gen = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        lm.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.language_model = lm
        self.rotary = Qwen3RotaryEmbedding(qc)
        sc = SiglipVisionConfig(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                                num_hidden_layers=v.num_hidden_layers, num_attention_heads=v.num_attention_heads,
                                image_size=v.image_size, patch_size=v.patch_size, layer_norm_eps=v.layer_norm_eps,
                                attn_implementation="sdpa")
        vm = nn.Module()
        vm.embeddings = nn.Module()
        vm.embeddings.patch_embedding = nn.Linear(v.patch_dim, v.hidden_size)  # convert_conv2d_to_linear's
        vm.embeddings.position_embedding = nn.Embedding(v.positions, v.hidden_size)
        vm.encoder = nn.Module()
        vm.encoder.layers = nn.ModuleList(SiglipEncoderLayer(sc) for _ in range(v.num_hidden_layers))
        vm.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.vit_model = nn.Module()
        self.vit_model.vision_model = vm
        self.connector = nn.Module()
        self.connector.fc1 = nn.Linear(v.hidden_size, c.hidden_size)
        self.connector.fc2 = nn.Linear(c.hidden_size, c.hidden_size)
        self.time_embedder = nn.Module()
        self.time_embedder.mlp = nn.Sequential(nn.Linear(256, c.hidden_size), nn.SiLU(),
                                               nn.Linear(c.hidden_size, c.hidden_size))
        self.vae2llm = nn.Linear(cfg.patch_latent_dim, c.hidden_size)
        self.llm2vae = nn.Linear(c.hidden_size, cfg.patch_latent_dim)
        self.latent_pos_embed = _Table(c.hidden_size, cfg.max_latent_size)
        self.vit_pos_embed = _Table(c.hidden_size, cfg.vit_max_num_patch_per_side)

    def vit(self, patches, pos, vit_mask, images: int):
        """siglip_navit over the step's ``images`` packed images, each attending to itself: as a batch of equal
        images without a mask (``vit_mask`` None: the flash kernel siglip_navit's varlen call runs), else as one
        sequence under the block-diagonal ``vit_mask``; then the connector."""
        vm = self.vit_model.vision_model
        emb = vm.embeddings.patch_embedding
        x = emb(patches.to(emb.weight.dtype)) + vm.embeddings.position_embedding(pos)
        x = x.view(images if vit_mask is None else 1, -1, x.shape[-1])
        for layer in vm.encoder.layers:
            x = layer(x, vit_mask)
        x = vm.post_layernorm(x).flatten(0, 1)
        return self.connector.fc2(F.gelu(self.connector.fc1(x), approximate="tanh")) + self.vit_pos_embed.pos_embed[pos]

    def forward(self, s: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(CE sum, velocity MSE sum) of the step inputs ``s`` (:func:`step_inputs`)."""
        lm = self.language_model.model
        h = lm.embed_tokens(s["input_ids"])
        if s["images"]:
            h = h.index_copy(0, s["vit_index"], self.vit(s["vit_patches"], s["vit_pos"], s["vit_mask"], s["images"]))
        dt = h.dtype  # the compute dtype (bf16 under FSDP2's mixed precision): the host's fp32 inputs follow it
        temb = self.time_embedder.mlp(timestep_embedding(s["timesteps"]).to(dt))
        h = h.index_copy(0, s["gen"], self.vae2llm(s["latents"].to(dt)) + temb
                         + self.latent_pos_embed.pos_embed[s["latent_pos"]])
        cos, sin = self.rotary(h[None], s["position_ids"][None])
        for layer in lm.layers:
            h = layer(h, s["und"], s["gen"], cos, sin, s["mask"])
        h = route(lm.norm, lm.norm_moe_gen, h, s["und"], s["gen"])
        logits = self.language_model.lm_head(h.index_select(0, s["ce_index"]))
        ce = F.cross_entropy(logits.float(), s["ce_labels"], reduction="sum")
        pred = self.llm2vae(h.index_select(0, s["mse_index"]))
        mse = ((pred.float() - s["flow_target"]).square().sum(-1) * s["flow_weight"]).sum()
        return ce, mse


def load_released(model: BagelRef, titan_sd: dict[str, torch.Tensor]) -> None:
    """Copy titan_mm's weights (its state dict, full tensors) into ``model`` through the released layout's names
    (titan_mm.models.bagel.hf.hf_name): BAGEL's ``..._moe_gen`` copy is our MoT layer's ``gen``."""
    own = {}
    for k, v in titan_sd.items():
        name = hf_name(k)
        m = re.match(r"(language_model\.model\.layers\.\d+\.)(.*)", name)
        if m:
            rest = m.group(2)
            name = m.group(1) + ("gen." + rest.replace("_moe_gen", "") if "_moe_gen" in rest else "und." + rest)
        own[name] = v
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name not in ("latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed") \
                    and not name.startswith("rotary."):
                p.copy_(own.pop(name))
    if own:
        raise KeyError(f"titan weights with no place in the reference: {sorted(own)[:5]}")


def bagel_mask_mod(doc: torch.Tensor, seg: torch.Tensor, kind: torch.Tensor):
    """BAGEL's create_sparse_mask over the flat packed tokens: (causal, or the same full / noise split) and never
    another split's noise, within one document. ``doc`` / ``seg``: per-token document and split ids (unique over
    the packed sequence), ``kind``: SEGMENT_KINDS codes."""
    full_and_noise = torch.where((kind == FULL) | (kind == NOISE), seg, -1)
    noise = torch.where(kind == NOISE, seg, -1)

    def causal(b, h, q, k):
        return q >= k

    def full_and_noise_mask(b, h, q, k):
        return (full_and_noise[q] == full_and_noise[k]) & (full_and_noise[q] >= 0)

    def remove_noise(b, h, q, k):
        return ~((noise[k] >= 0) & (noise[q] != noise[k]))

    def sample(b, h, q, k):
        return doc[q] == doc[k]

    return and_masks(or_masks(causal, full_and_noise_mask), remove_noise, sample)


def step_inputs(mb: dict, cfg: BagelConfig, device, attn: str) -> dict:
    """A prepared micro-batch (titan's packed rows after the objective's prepare) as BAGEL's packed step inputs: the
    rows flattened to one sequence, the host's index tensors (und / gen / ViT tokens, CE and MSE positions), the
    attention mask (a BlockMask for flex, the same mask materialized for sdpa) and the ViT's per-image mask."""
    B, S = mb["input_ids"].shape
    kind = mb["token_kind"].reshape(-1)
    offset = (torch.arange(B) * S)[:, None]  # ids unique over the packed sequence, as BAGEL's one long sample
    doc = (mb["doc_ids"].long() + offset).reshape(-1)
    seg = (mb["seg_ids"].long() + offset).reshape(-1)
    lat = mb["latent_mask"].reshape(-1)
    gen = (kind == VAE).nonzero().squeeze(1)
    labels = mb["labels"].reshape(-1)
    ce_index = (labels != -100).nonzero().squeeze(1)
    P = mb["noisy_latents"].shape[-1]
    lens = mb["vit_lens"]
    img = torch.repeat_interleave(torch.arange(len(lens)), lens)
    s = dict(input_ids=mb["input_ids"].reshape(-1), position_ids=mb["position_ids"].reshape(-1),
             und=(kind != VAE).nonzero().squeeze(1), gen=gen, vit_index=(kind == VIT).nonzero().squeeze(1),
             vit_patches=mb["vit_patches"], vit_pos=mb["vit_pos"],

             latents=(mb["noisy_latents"] + mb["cond_latents"]).reshape(-1, P)[gen],
             timesteps=mb["timesteps"].reshape(-1)[gen], latent_pos=mb["latent_pos"].reshape(-1)[gen],
             ce_index=ce_index, ce_labels=labels[ce_index], mse_index=lat.nonzero().squeeze(1),
             flow_target=mb["flow_target"].reshape(-1, P)[lat], flow_weight=mb["flow_weight"].reshape(-1)[lat])
    s = {k: v.to(device) for k, v in s.items()}
    # images of one size go as a batch (no mask); mixed sizes as one sequence, each image seeing itself
    s["images"] = len(lens)
    s["vit_mask"] = None if bool((lens == lens[:1]).all()) else (img[:, None] == img[None])[None, None].to(device)
    mod = bagel_mask_mod(doc.to(device), seg.to(device), mb["seg_kinds"].reshape(-1).to(device))
    T = B * S
    s["mask"] = create_block_mask(mod, None, None, T, T, device=device) if attn == "flex" else \
        create_mask(mod, None, None, T, T, device=device)
    return s


def build_bagel_ref(cfg: BagelConfig, device: torch.device, objective, attn: str = "sdpa", mp=MP,
                    compile_layers: bool = True, init=None):
    """The reference stack: :class:`BagelRef` in fp32 master weights (``init``: a titan state dict to start from,
    :func:`load_released`), each decoder and ViT layer compiled and fully_shard-ed (``mp``), then the root. Its step
    takes titan's host rows and the step number: ``objective`` (the titan stack's: sampler, shift, seed) draws t and
    the noise as the trainer does at that step; the loss is CE / label tokens + MSE / latent elements."""
    with torch.device(device):
        model = BagelRef(cfg, attn).float()
    if init is not None:
        load_released(model, init)
    blocks = [*model.language_model.model.layers, *model.vit_model.vision_model.encoder.layers]
    for block in blocks:
        if compile_layers:
            block.compile()
        fully_shard(block, mp_policy=mp)
    # the root keeps the host's fp32 inputs (timesteps, targets): the forward casts what meets a bf16 weight
    fully_shard(model, mp_policy=dataclasses.replace(mp, cast_forward_inputs=False))

    def step(host_batch: dict, step_index: int) -> torch.Tensor:
        mb = objective.prepare([host_batch], step_index)[0]
        ce, mse = model(step_inputs(mb, cfg, device, attn))
        loss = ce / max(int(mb["num_label_tokens"]), 1) + mse / max(int(mb["num_latent_elements"]), 1)
        loss.backward()
        return loss.detach()

    return model, step
