"""BAGEL (ByteDance-Seed/Bagel) as pure-function blocks: a Qwen2 decoder with QK-norm whose every layer holds two
experts (Mixture-of-Transformers: ``und`` for text and ViT tokens, ``gen`` for VAE latent tokens; self-attention over
the whole packed sequence), the SigLIP NaViT vision tower with its MLP connector, and the generation path (``vae2llm``
/ ``llm2vae``, a timestep embedder, a 2-D latent position table).

Legend: B batch, S sequence, T = B*S flat tokens, D model dim, H / G query / kv heads, K head_dim, V ViT patches (all
images of the batch side by side), P values per latent patch (latent_patch^2 x z_channels, (row, col, chan) order).

Routing is by a host-built permutation (:func:`titan_mm.models.bagel.spec.expert_routing`): ``expert_order`` puts
the understanding tokens first and the latent tokens (``gen_index``) after them, ``expert_inverse`` undoes it; a layer
gathers its input in that order, runs each expert on its contiguous part, and gathers the outputs back by the inverse
permutation. Each gather's backward is the other gather (no scatter, no zero fill), and the forward never syncs
with the host. Every token takes exactly one expert's weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_mm import kernels as K
from titan_mm.models.bagel.config import BagelConfig, BagelLLMConfig, BagelViTConfig
from titan_mm.models.bagel.spec import frozen_parts, param_part
from titan_mm.nn import init
from titan_mm.nn.attention import AttnMeta, attention
from titan_mm.nn.flow import timestep_embedding
from titan_mm.nn.loss import chunked_cross_entropy, head_rows
from titan_mm.nn.mlp import SwiGLU
from titan_mm.nn.norm import RMSNorm
from titan_mm.nn.output import ModelOutput, Stream
from titan_mm.nn.rope import apply_rope, rope_cos_sin, rope_inv_freq

TIMESTEP_FREQS = 256
"""Sinusoid width of BAGEL's timestep embedder (DiT's frequency_embedding_size)."""
INIT_STD = 0.02


def sincos_table(dim: int, side: int) -> torch.Tensor:
    """[side^2, dim] fp32, row h x side + w: [sin-cos of w, sin-cos of h] each over dim/2 (DiT's 2-D table, in
    fp64 and cast, as BAGEL's PositionEmbedding; its first half encodes the column)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    h, w = torch.meshgrid(torch.arange(side, dtype=torch.float64), torch.arange(side, dtype=torch.float64),
                          indexing="ij")

    def one(pos):
        a = pos.reshape(-1, 1) * omega
        return torch.cat([a.sin(), a.cos()], 1)

    return torch.cat([one(w), one(h)], 1).float()


class Expert(nn.Module):
    """One expert's copy of a decoder layer's per-token weights: the two RMSNorms, q/k/v (biased) / o, the q/k
    norms and the SwiGLU MLP (BAGEL's ``*`` or ``*_moe_gen`` weights); without ``mlp``, the MLP-only split's shared
    attention and norms."""

    def __init__(self, c: BagelLLMConfig, mlp: bool = True):
        super().__init__()
        D, H, G, K = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.attn_norm, self.ffn_norm = RMSNorm(D, c.rms_norm_eps), RMSNorm(D, c.rms_norm_eps)
        self.wq, self.wk, self.wv = nn.Linear(D, H * K), nn.Linear(D, G * K), nn.Linear(D, G * K)
        self.wo = nn.Linear(H * K, D, bias=False)
        self.q_norm, self.k_norm = RMSNorm(K, c.rms_norm_eps), RMSNorm(K, c.rms_norm_eps)
        self.mlp = SwiGLU(D, c.intermediate_size) if mlp else None
        self.heads = (H, G, K)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        """[N, (H + 2G) K]: q and k normed per head (before RoPE, which is position-only and shared), and v. A
        module call, so that tensor parallel's hooks on the expert (the q / k norms' summed gradients) run."""
        K = self.heads[2]
        x = self.attn_norm(x_ND)
        q = self.q_norm(self.wq(x).unflatten(-1, (-1, K))).flatten(-2)
        k = self.k_norm(self.wk(x).unflatten(-1, (-1, K))).flatten(-2)
        return torch.cat([q, k, self.wv(x)], -1)

    def ffn(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ffn_norm(x_ND))


class _Permute(torch.autograd.Function):
    """``x[order]`` for a permutation ``order`` of x's rows, ``inverse`` its inverse: the gradient is the gather
    ``g[inverse]`` (index_select's own backward is a scatter-add into zeros)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


class Routing(NamedTuple):
    """The two experts' tokens as one permutation of the T tokens: ``order`` the understanding tokens, then ``gen``
    (the latent tokens: their count is its length, symbolic under compile); ``inverse`` its inverse."""
    order: torch.Tensor
    inverse: torch.Tensor
    gen: torch.Tensor


def route(x_TX: torch.Tensor, index: Routing | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(und rows, gen rows) of ``x_TX``; ``index`` None (no latent tokens: text and ViT only): (x_TX, None)."""
    if index is None:
        return x_TX, None
    m = index.gen.shape[0]
    xu, xg = _Permute.apply(x_TX, index.order, index.inverse).split([x_TX.shape[0] - m, m])
    return xu, xg


def merge(und_NX: torch.Tensor, gen_MX: torch.Tensor | None, index: Routing | None,
          lead: tuple[int, ...]) -> torch.Tensor:
    """The rows back in sequence order, as a fresh [*lead, X] tensor (a base, not a view, so that FSDP's hooks on a
    block's output hold); ``index`` None: the und rows are all of them."""
    if index is None:
        return und_NX.view(*lead, und_NX.shape[-1])
    return _Permute.apply(torch.cat([und_NX, gen_MX]), index.inverse, index.order).view(*lead, und_NX.shape[-1])


def by_expert(und_fn, gen_fn, x_BSX: torch.Tensor, index) -> torch.Tensor:
    """[B, S, Y]: ``und_fn`` of the understanding tokens' rows and ``gen_fn`` of the latent tokens' rows, back in
    sequence order (``index`` None: every token is an understanding token; ``gen_fn`` does not run)."""
    B, S, X = x_BSX.shape
    xu, xg = route(x_BSX.reshape(B * S, X), index)
    return merge(und_fn(xu), None if xg is None else gen_fn(xg), index, (B, S))


def attend(qkv_BSX: torch.Tensor, heads: tuple[int, int, int], rope, attn: AttnMeta | None,
           layer_id: int) -> torch.Tensor:
    """[B, S, h, K]: attention of the merged q / k / v [B, S, (h + 2g) K] (this rank's heads: all, or H / tp and
    G / tp under tensor parallelism), RoPE applied."""
    H, G, K = heads
    qkv = qkv_BSX.unflatten(-1, (-1, K))
    n = qkv.shape[2]
    q, k, v = qkv.split([n * H // (H + 2 * G), n * G // (H + 2 * G), n * G // (H + 2 * G)], dim=2)
    q, k = apply_rope(q, k, *rope)
    return attention(q, k, v, attn, None, layer_id)


class MoTLayer(nn.Module):
    """A decoder layer of two experts: each token's norms and projections are its expert's; attention is one over
    the packed sequence under the batch's segment mask (sampling: the new tokens over layer ``layer_id`` of the
    KV cache the metadata carries)."""

    def __init__(self, c: BagelLLMConfig, layer_id: int):
        super().__init__()
        self.und, self.gen = Expert(c), Expert(c)
        self.heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.layer_id = layer_id

    def forward(self, h_BSD: torch.Tensor, index, rope, attn: AttnMeta | None) -> torch.Tensor:
        qkv = by_expert(self.und, self.gen, h_BSD, index)
        o = attend(qkv, self.heads, rope, attn, self.layer_id).flatten(-2)
        h = h_BSD + by_expert(self.und.wo, self.gen.wo, o, index)
        return h + by_expert(self.und.ffn, self.gen.ffn, h, index)


class MoELayer(nn.Module):
    """BAGEL's MLP-only split (``Qwen2MoEDecoderLayer``): one attention with its two norms (``shared``) for every
    token, the MLP by expert: ``und`` for text and ViT tokens, ``gen`` for latent tokens."""

    def __init__(self, c: BagelLLMConfig, layer_id: int):
        super().__init__()
        self.shared = Expert(c, mlp=False)
        self.und, self.gen = SwiGLU(c.hidden_size, c.intermediate_size), SwiGLU(c.hidden_size, c.intermediate_size)
        self.heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.layer_id = layer_id

    def forward(self, h_BSD: torch.Tensor, index, rope, attn: AttnMeta | None) -> torch.Tensor:
        h = h_BSD + self.shared.wo(attend(self.shared(h_BSD), self.heads, rope, attn, self.layer_id).flatten(-2))
        return h + by_expert(self.und, self.gen, self.shared.ffn_norm(h), index)


LAYERS = {"Qwen2MoTDecoderLayer": MoTLayer, "Qwen2MoEDecoderLayer": MoELayer}
"""BAGEL's decoder layer kinds by ``llm_config.layer_module``."""


class ViTBlock(nn.Module):
    """A SigLIP encoder layer (transformers' SiglipEncoderLayer names): pre-LayerNorm attention and GELU(tanh) MLP."""

    def __init__(self, c: BagelViTConfig):
        super().__init__()
        D, eps = c.hidden_size, c.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(D, eps=eps), nn.LayerNorm(D, eps=eps)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            self.self_attn.register_module(name, nn.Linear(D, D))
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(D, c.intermediate_size), nn.Linear(c.intermediate_size, D)
        self.heads = c.num_attention_heads

    def forward(self, x_1VD: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        a, y = self.self_attn, self.layer_norm1(x_1VD)
        q, k, v = (p(y).unflatten(-1, (self.heads, -1)) for p in (a.q_proj, a.k_proj, a.v_proj))
        x = x_1VD + a.out_proj(attention(q, k, v, meta, None).flatten(-2))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))


@torch.no_grad()
def init_modules(modules) -> None:
    """Weights N(0, 0.02), biases 0, norms 1, in the order of ``modules``."""
    for m in modules:
        if isinstance(m, RMSNorm):
            m.reset_parameters()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            init.normal_(m.weight, std=INIT_STD)
        elif isinstance(m, nn.Linear):
            init.normal_(m.weight, std=INIT_STD)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class SiglipNaViT(nn.Module):
    """SigLIP over patches of images of any size packed side by side (BAGEL's NaViT tower, RoPE off): a linear patch
    embedding, a learned position table indexed by the flattened positions (row x vit_max_num_patch_per_side +
    column), the encoder under a bidirectional per-image mask, the post LayerNorm."""

    def __init__(self, c: BagelViTConfig):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Linear(c.patch_dim, c.hidden_size)
        self.embeddings.position_embedding = nn.Embedding(c.positions, c.hidden_size)
        # "blocks", not SigLIP's "encoder.layers": the decoder's layers.{i} are the family's trunk (model contract)
        self.blocks = nn.ModuleList(ViTBlock(c) for _ in range(c.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def init_weights(self) -> None:
        """The model's init of these modules (:func:`init_modules`): the tower alone (bench/towers.py)."""
        init_modules(self.modules())

    def forward(self, patches_VP: torch.Tensor, pos_V: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        e = self.embeddings
        x = (e.patch_embedding(patches_VP.to(e.patch_embedding.weight.dtype)) + e.position_embedding(pos_V))[None]
        for blk in self.blocks:
            x = blk(x, meta)
        return self.post_layernorm(x)[0]


def _mlp2(i: int, o: int, act: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, o), act, nn.Linear(o, o))


class BagelModel(nn.Module):
    """embed (text, ViT and latent tokens into one packed stream) -> trunk (MoT layers, any contiguous slice) ->
    head (each expert's final norm). Hooks: ``lm_loss`` (the causal LM) and ``predict_velocity`` (flow matching)."""

    def __init__(self, cfg: BagelConfig):
        super().__init__()
        self.cfg = cfg
        c, D = cfg.llm_config, cfg.llm_config.hidden_size
        self.fused_ce = "linear_cross_entropy" in K.resolve_ops(cfg.kernels)  # the LM loss's Triton kernel
        self.tok_embeddings = nn.Embedding(c.vocab_size, D)
        # a ModuleDict keyed "0".. (a ModuleList's names): pipeline stages drop the layers they do not run
        self.layers = nn.ModuleDict({str(i): LAYERS[c.layer_module](c, i) for i in range(c.num_hidden_layers)})
        self.norm, self.norm_gen = RMSNorm(D, c.rms_norm_eps), RMSNorm(D, c.rms_norm_eps)
        self.output = None if c.tie_word_embeddings else nn.Linear(D, c.vocab_size, bias=False)
        self.vit = SiglipNaViT(cfg.vit_config)
        self.connector = _mlp2(cfg.vit_config.hidden_size, D, nn.GELU(approximate="tanh"))
        self.time_embedder = _mlp2(TIMESTEP_FREQS, D, nn.SiLU())
        self.vae2llm, self.llm2vae = nn.Linear(cfg.patch_latent_dim, D), nn.Linear(D, cfg.patch_latent_dim)
        # BAGEL's frozen sin-cos tables, recomputed rather than checkpointed (non-persistent)
        self.register_buffer("vit_pos_embed", sincos_table(D, cfg.vit_max_num_patch_per_side), persistent=False)
        self.register_buffer("latent_pos_embed", sincos_table(D, cfg.max_latent_size), persistent=False)
        self.register_buffer("rope_inv_freq", rope_inv_freq(c.head_dim, c.rope_theta)[0], persistent=False)
        frozen = frozen_parts(cfg)  # freeze_und / freeze_vit: no gradient, hence in no optimizer group
        for name, p in self.named_parameters():
            if param_part(name) in frozen:
                p.requires_grad_(False)

    def init_weights(self, buffer_device=None) -> None:
        """Random init (under titan_mm.nn.init.seeded_init): weights N(0, 0.02), biases 0, norms 1, ``llm2vae`` 0
        (BAGEL's), then the buffers."""
        init_modules(self.modules())
        with torch.no_grad():
            nn.init.zeros_(self.llm2vae.weight)
            nn.init.zeros_(self.llm2vae.bias)
        self.init_buffers(buffer_device)

    def init_buffers(self, buffer_device=None) -> None:
        dev = buffer_device or self.tok_embeddings.weight.device
        dev = "cpu" if torch.device(dev).type == "meta" else dev
        cfg, c = self.cfg, self.cfg.llm_config
        self.vit_pos_embed = sincos_table(c.hidden_size, cfg.vit_max_num_patch_per_side).to(dev)
        self.latent_pos_embed = sincos_table(c.hidden_size, cfg.max_latent_size).to(dev)
        self.rope_inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, device=dev)[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(position_ids, self.rope_inv_freq, 1.0, dtype)

    def embed_vit(self, vit_patches, vit_pos, vit_attn) -> torch.Tensor:
        """[V, D]: the tower, the connector, plus the connector's 2-D position table."""
        return self.connector(self.vit(vit_patches, vit_pos, vit_attn)) + self.vit_pos_embed[vit_pos]

    def embed_latents(self, x_NP, t_N, pos_N) -> torch.Tensor:
        """[N, D]: vae2llm of the (noised or clean) latent patches + the timestep embedding + the 2-D position."""
        temb = self.time_embedder(timestep_embedding(t_N, TIMESTEP_FREQS).to(self.vae2llm.weight.dtype))
        return self.vae2llm(x_NP.to(self.vae2llm.weight.dtype)) + temb + self.latent_pos_embed[pos_N]

    def embed(self, input_ids, gen_index=None, noisy_latents=None, cond_latents=None, timesteps=None, latent_pos=None,
              vit_patches=None, vit_pos=None, vit_index=None, vit_attn=None) -> Stream:
        """Stream(h [B, S, D]): token embeddings, with the ViT tokens (at ``vit_index``) and the latent tokens (at
        ``gen_index``; None: there are none) put in their places. A clean conditioning image is in ``cond_latents``
        at t = 0."""
        B, S = input_ids.shape
        h = self.tok_embeddings(input_ids).flatten(0, 1)
        if vit_patches is not None:
            h = h.index_copy(0, vit_index, self.embed_vit(vit_patches, vit_pos, vit_attn).to(h.dtype))
        if gen_index is None:
            return Stream(h.view(B, S, -1))
        x = (noisy_latents + cond_latents).flatten(0, 1).index_select(0, gen_index)
        lat = self.embed_latents(x, timesteps.flatten().index_select(0, gen_index),
                                 latent_pos.flatten().index_select(0, gen_index))
        return Stream(h.index_copy(0, gen_index, lat.to(h.dtype)).view(B, S, -1))

    def trunk(self, stream: Stream, rope, attn, start: int = 0, stop: int | None = None, *, gen_index=None,
              expert_order=None, expert_inverse=None) -> Stream:
        """Layers start .. stop-1 (any contiguous slice), routing by the host-built permutation (``gen_index`` None:
        every token is an understanding token)."""
        h, index = stream.h, routing(gen_index, expert_order, expert_inverse)
        for i in range(start, len(self.layers) if stop is None else stop):
            h = self.layers[str(i)](h, index, rope, attn)
        return stream._replace(h=h)

    def head(self, stream: Stream, attn=None, logits_at=None, hidden: bool = False, *, gen_index=None,
             expert_order=None, expert_inverse=None) -> ModelOutput:
        """The final norm of each token's expert: as ``hidden`` (an objective's input), else the LM logits (at
        ``logits_at``)."""
        h = by_expert(self.norm, self.norm_gen, stream.h, routing(gen_index, expert_order, expert_inverse))
        zero = torch.zeros((), device=h.device)
        cache = None if attn is None else attn.kv_cache  # written in place by the layers; returned
        if hidden:
            return ModelOutput(None, None, zero, cache, hidden=h)
        if logits_at is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_at]
        return ModelOutput(F.linear(h, self.lm_head_weight), None, zero, cache)

    def forward(self, input_ids, position_ids=None, attn=None, logits_at=None, loss=None, *, gen_index=None,
                expert_order=None, expert_inverse=None, noisy_latents=None, cond_latents=None, timesteps=None,
                latent_pos=None, vit_patches=None, vit_pos=None, vit_index=None, vit_attn=None, **_):
        """A packed batch of spec.SCHEMA after prepare_batch; without ``gen_index`` (the serving engine's text rows)
        every token is an understanding token, and ``position_ids`` defaults to arange (the engine passes the KV
        cache's)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        index = {"gen_index": gen_index, "expert_order": expert_order, "expert_inverse": expert_inverse}
        stream = self.embed(input_ids, gen_index, noisy_latents, cond_latents, timesteps, latent_pos, vit_patches,
                            vit_pos, vit_index, vit_attn)
        stream = self.trunk(stream, self.rope(position_ids, stream.h.dtype), attn, **index)
        out = self.head(stream, attn, logits_at, hidden=loss is not None, **index)
        return out._replace(terms=loss(self, out)) if loss is not None else out

    def lm_loss(self, h_BSD: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None,
                index: torch.Tensor | None = None):
        """The causal LM's hook: fp32 sum of the LM head's cross-entropy over ``targets`` != -100 (no [N, V] logits).
        ``index``: prepare_batch's ``label_index``, the labeled positions: the head runs on those rows alone (a
        packed row of images labels a fifth of its tokens or fewer), as BAGEL's ``ce_loss_indexes``."""
        h_ND, labels_N, w_N = head_rows(h_BSD.flatten(0, 1), targets.reshape(-1),
                                        None if weights is None else weights.reshape(-1), index)
        if self.fused_ce:  # one pass over each logits tile; the eager chunks make several over fp32 [chunk, V]
            return K.linear_cross_entropy(h_ND, self.lm_head_weight, labels_N, chunk_size=self.cfg.loss_chunk_size,
                                          weights=w_N)
        return chunked_cross_entropy(h_ND, self.lm_head_weight, labels_N, self.cfg.loss_chunk_size, weights_N=w_N)

    def predict_velocity(self, out: ModelOutput, batch) -> torch.Tensor:
        """Flow matching's hook: llm2vae of every position's final hidden state, [B, S, P] (read at latent ones)."""
        return self.llm2vae(out.hidden)


def routing(gen_index, expert_order, expert_inverse) -> Routing | None:
    """The layers' routing (:class:`Routing`) from prepare_batch's keys, or None when there are no latent tokens."""
    return None if gen_index is None else Routing(expert_order, expert_inverse, gen_index)


def build(cfg: BagelConfig) -> BagelModel:
    return BagelModel(cfg)


def patchify(image_CHW: torch.Tensor, p: int) -> torch.Tensor:
    """[C, H, W] -> [H/p x W/p, p x p x C] patches, row-major, values in (row, column, channel) order (BAGEL's)."""
    C, H, W = image_CHW.shape
    if H % p or W % p:
        raise ValueError(f"an image of {H}x{W} does not divide into {p}x{p} patches; resize it to multiples of {p}")
    return image_CHW.reshape(C, H // p, p, W // p, p).permute(1, 3, 2, 4, 0).reshape(-1, p * p * C)


def flat_positions(h: int, w: int, side: int) -> torch.Tensor:
    """[h x w] positions row x side + column of a grid of h x w patches in a table of side x side (extrapolated)."""
    if h > side or w > side:
        raise ValueError(f"a grid of {h}x{w} patches exceeds the position table's {side} per side; use smaller "
                         "images or a config with a larger max_latent_size / vit_max_num_patch_per_side")
    return (torch.arange(h)[:, None] * side + torch.arange(w)).flatten()


__all__ = ["BagelModel", "build", "flat_positions", "patchify", "sincos_table"]
