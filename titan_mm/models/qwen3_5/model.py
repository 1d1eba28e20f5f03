"""Qwen3.5 / Qwen3.5-MoE: a hybrid decoder (Gated DeltaNet blocks and gated full-attention blocks, 3 : 1 in the
released models) under the Qwen3-VL vision tower without DeepStack. Parameters live in plain modules; the forward is
a pure function of its inputs.

What is Qwen3-VL's here (reused, not copied): the vision tower, the placement of visual tokens by the host-built
``visual_index``, interleaved M-RoPE (``mrope_cos_sin``), ``embed`` / ``trunk`` / ``head`` / ``forward`` and the
training modes (``Qwen3VLModel``, ``Qwen3Model``, ``param_groups``). What is new: the blocks below.

Legend: B batch, S sequence, D hidden, H / G full-attention query / kv heads, K their head dim, R = K x
partial_rotary_factor rotated channels, Hk / Hv linear-attention key / value heads (Hv a multiple of Hk), Dk / Dv
their head dims, W conv width, F MLP width, E experts.

Parameter names (titan; HF names in hf.py):
  language_model.tok_embeddings.weight [V, D], norm.weight [D], output.weight [V, D] (absent when tied)
  language_model.layers.{i}.attn_norm.weight, ffn_norm.weight [D]        zero-centred: the scale is 1 + weight
  full attention:   layers.{i}.attn.wq.weight [H*2K, D] (rows per head: K query then K gate rows), attn.wk / wv
                    [G*K, D], attn.wo [D, H*K], attn.q_norm / k_norm.weight [K] (zero-centred)
  Gated DeltaNet:   layers.{i}.linear_attn.in_proj_qkv.weight [Hk*(2Dk + r*Dv), D] (r = Hv/Hk; rows per key head:
                    its q, its k, the v of its r value heads) and .conv_weight [Hk*(2Dk + r*Dv), W] (the depthwise
                    conv over those channels), in_proj_z [Hv*Dv, D], in_proj_b [Hv, D], in_proj_a.weight [Hv, D]
                    with .dt_bias, .A_log [Hv], norm.weight [Dv] (gated RMSNorm), out_proj [D, Hv*Dv]
  dense:            layers.{i}.mlp.w1 / w3 [F, D], w2 [D, F]
  MoE:              layers.{i}.moe.router [E, D], moe.experts.w1 / w3 [E, F, D], w2 [E, D, F],
                    moe.shared_expert.w1 / w3 / w2, moe.shared_expert_gate.weight [1, D]
  visual.*          Qwen3-VL's tower (titan_mm/models/qwen3_vl/vision.py)

Rows are laid out head by head (q with its gate; each key head's q, k and v) so that tensor parallelism splits every
projection by heads as plain colwise rows. Per-head vectors and the conv weight sit in the projection whose rows
they follow (:class:`RowLinear`), so they are split with those rows.

Forward (no host syncs; the documents of packed rows come from :func:`prepare_batch`, on the host):
    batch = prepare_batch(cfg, batch, device)   # + vision_meta, visual_index (pixels), linear_meta (documents)
    out = model(input_ids, position_ids=pos_3BS, attn=attn_meta, labels=labels, linear_meta=..., pixel_values=...)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_mm.nn import init
from titan_mm.nn.attention import AttnMeta, attention
from titan_mm.nn.kv_cache import KVCache
from titan_mm.nn.linear_attention import (LinearMeta, build_linear_meta, causal_conv1d, causal_conv1d_cached,
                                                     gated_delta_rule, gated_delta_rule_cached, prefetch)
from titan_mm.nn.mlp import SwiGLU
from titan_mm.nn.moe import MoE
from titan_mm.nn.norm import RMSNorm, rms_norm
from titan_mm.nn.rope import apply_rope, rope_inv_freq
from titan_mm.models.qwen3.model import Ops, Qwen3Model, select_ops
from titan_mm.models.qwen3_5.config import Qwen3_5Config, Qwen3_5TextConfig
from titan_mm.models.qwen3_vl.model import (GRID_KEYS, EmbedOutput, Qwen3VLModel, apply_freeze, consume,
                                            mrope_cos_sin, param_groups, vision_inputs)
from titan_mm.models.qwen3_vl.vision import VisionTower

__all__ = ["HybridAttnMeta", "Qwen3_5Model", "Qwen3_5TextModel", "build", "param_groups", "prepare_batch",
           "with_linear"]


# ------------------------------------------------------------------------------------------------ norms
def rms_norm_1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (HF Qwen3_5RMSNorm): (x / rms(x)) * (1 + w), all in fp32, cast back at the end."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def add_rms_norm_1p(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    h = residual + x
    return rms_norm_1p(h, w, eps), h


def norms_1p(ops: Ops):
    """(norm, add + norm) with the scale 1 + w: the exact reference, or the Triton RMSNorm given 1 + w in fp32 when
    the config's kernels include it (it rounds the normalized x before the scale, as Qwen3's norm does)."""
    if ops.rms_norm is rms_norm:
        return rms_norm_1p, add_rms_norm_1p

    def norm(x, w, eps):
        return ops.rms_norm(x, 1.0 + w.float(), eps)

    def add_norm(x, residual, w, eps):
        return ops.add_rms_norm(x, residual, 1.0 + w.float(), eps)

    return norm, add_norm


class RMSNorm1p(RMSNorm):
    """A zero-centred RMSNorm's weight (initialized to 0: the scale 1 + weight starts at 1)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


# ------------------------------------------------------------------------------------------------ blocks
class RowLinear(nn.Linear):
    """A bias-free nn.Linear that also holds parameters with one entry per output row (``extras``: name -> trailing
    shape): the Gated DeltaNet conv weight, per-head decays. Tensor parallelism's colwise style splits every
    parameter of a Linear along dim 0, so these stay aligned with the weight's rows; the block reads them itself."""

    def __init__(self, in_features: int, out_features: int, **extras: tuple[int, ...]):
        super().__init__(in_features, out_features, bias=False)
        for name, shape in extras.items():
            self.register_parameter(name, nn.Parameter(torch.empty(out_features, *shape)))


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local rows (its tensor-parallel shard), as the projection's local outputs are."""
    return p.to_local() if isinstance(p, DTensor) else p


def apply_partial_rope(rope_impl, q, k, cos, sin):
    """RoPE on the first R = cos.shape[-1] channels of each head; the rest pass through (HF Qwen3.5)."""
    R = cos.shape[-1]
    if R == q.shape[-1]:
        return rope_impl(q, k, cos, sin)
    qr, kr = apply_rope(q[..., :R], k[..., :R], cos, sin)
    return torch.cat([qr, q[..., R:]], -1), torch.cat([kr, k[..., R:]], -1)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate per channel (its rows interleaved with the queries' per head),
    zero-centred q / k norms and partial RoPE; the attention itself is titan_mm.nn.attention's."""

    def __init__(self, cfg: Qwen3_5TextConfig, layer_id: int, ops: Ops):
        super().__init__()
        D, H, G, K = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim, self.layer_id, self.rope_impl = K, layer_id, ops.apply_rope
        self.wq = nn.Linear(D, H * 2 * K, bias=cfg.attention_bias)
        self.wk = nn.Linear(D, G * K, bias=cfg.attention_bias)
        self.wv = nn.Linear(D, G * K, bias=cfg.attention_bias)
        self.wo = nn.Linear(H * K, D, bias=cfg.attention_bias)
        norm, _ = norms_1p(ops)
        self.q_norm = RMSNorm1p(K, cfg.rms_norm_eps, norm)
        self.k_norm = RMSNorm1p(K, cfg.rms_norm_eps, norm)

    def forward(self, x_BSD, cos_BSR, sin_BSR, meta: AttnMeta | None):
        B, S, _ = x_BSD.shape
        K = self.head_dim
        qg = self.wq(x_BSD).view(B, S, -1, 2 * K)
        q, gate = self.q_norm(qg[..., :K]), qg[..., K:]
        k = self.k_norm(self.wk(x_BSD).view(B, S, -1, K))
        v = self.wv(x_BSD).view(B, S, -1, K)
        q, k = apply_partial_rope(self.rope_impl, q, k, cos_BSR, sin_BSR)
        o = attention(q, k, v, meta, None, self.layer_id)
        return self.wo((o * torch.sigmoid(gate)).reshape(B, S, -1))

    def reset_parameters(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            init.normal_(lin.weight, mean=0.0, std=std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class GatedDeltaNet(nn.Module):
    """Linear attention: projections -> depthwise causal conv + SiLU over q / k / v -> the gated delta rule
    (titan_mm.nn.linear_attention) -> gated RMSNorm (times SiLU(z)) -> output projection."""

    def __init__(self, cfg: Qwen3_5TextConfig, layer_id: int, ops: Ops):
        super().__init__()
        D, Hk, Hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv, self.r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk
        self.layer_id, self.impl = layer_id, cfg.linear_attn_backend
        prefetch(self.impl)
        self.in_proj_qkv = RowLinear(D, Hk * (2 * self.dk + self.r * self.dv),
                                     conv_weight=(cfg.linear_conv_kernel_dim,))
        self.in_proj_z = nn.Linear(D, Hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(D, Hv, bias=False)
        self.in_proj_a = RowLinear(D, Hv, dt_bias=(), A_log=())
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps, ops.rms_norm)
        self.out_proj = nn.Linear(Hv * self.dv, D, bias=False)

    def forward(self, x_BSD, meta: LinearMeta | None, cache: KVCache | None = None):
        """``cache`` (serving): each row continues its sequence from the cache's state slot and writes the state
        after its last real token back; ``meta`` is then None (one sequence per row)."""
        B, S, _ = x_BSD.shape
        dk, dv = self.dk, self.dv
        x_qkv, w = self.in_proj_qkv(x_BSD), _local(self.in_proj_qkv.conv_weight)
        if cache is None:
            qkv = causal_conv1d(x_qkv, w, None if meta is None else meta.doc_pos)
        else:
            conv0, rec0 = cache.linear_state(self.layer_id)
            qkv, conv1 = causal_conv1d_cached(x_qkv, w, conv0, cache.step.valid.sum(1))
        qkv = F.silu(qkv.float()).to(qkv.dtype).view(B, S, -1, 2 * dk + self.r * dv)  # [B, S, Hk (local), .]
        q, k = qkv[..., :dk], qkv[..., dk : 2 * dk]
        v = qkv[..., 2 * dk :].reshape(B, S, -1, dv)
        z = self.in_proj_z(x_BSD).view(B, S, -1, dv)
        beta = self.in_proj_b(x_BSD).sigmoid()
        a = self.in_proj_a(x_BSD)
        g = -_local(self.in_proj_a.A_log).float().exp() * F.softplus(a.float() + _local(self.in_proj_a.dt_bias))
        if cache is None:
            o = gated_delta_rule(q, k, v, g, beta, meta, self.impl)
        else:
            o, rec1 = gated_delta_rule_cached(q, k, v, g, beta, cache.step.valid, rec0, self.impl)
            cache.write_linear_state(self.layer_id, conv1, rec1)
        o = (self.norm(o) * F.silu(z.float())).to(o.dtype)
        return self.out_proj(o.reshape(B, S, -1))

    def reset_parameters(self, std: float) -> None:
        for w in (self.in_proj_qkv.weight, self.in_proj_qkv.conv_weight, self.in_proj_z.weight, self.in_proj_b.weight,
                  self.in_proj_a.weight, self.out_proj.weight):
            init.normal_(w, mean=0.0, std=std)
        nn.init.ones_(self.in_proj_a.dt_bias)
        init.uniform_(self.in_proj_a.A_log, 0.01, 16.0)  # A ~ U(0.01, 16), stored as log A (HF)
        self.in_proj_a.A_log.log_()
        self.norm.reset_parameters()


class SharedExpertMoE(MoE):
    """Routed experts (titan_mm.nn.moe, top-k renormalized) plus a shared SwiGLU expert whose output is
    scaled by sigmoid(shared_expert_gate(x)) per token."""

    def __init__(self, cfg: Qwen3_5TextConfig, ops: Ops):
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         norm_topk_prob=True, moves=ops.moe_moves, float8=ops.moe_float8, routing=ops.moe_routing)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size, ops.act_mul)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def shared_term(self, x_ND: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x_ND)) * self.shared_expert(x_ND)

    def reset_parameters(self, std: float) -> None:
        super().reset_parameters(std)
        self.shared_expert.reset_parameters(std)
        init.normal_(self.shared_expert_gate.weight, mean=0.0, std=std)


@dataclass
class HybridAttnMeta(AttnMeta):
    """The full-attention metadata plus the documents the Gated DeltaNet layers read (:func:`with_linear`)."""

    linear: LinearMeta | None = None


def with_linear(attn: AttnMeta | None, linear: LinearMeta | None) -> AttnMeta | None:
    """``attn`` carrying ``linear`` (host-built by titan_mm.nn.linear_attention.build_linear_meta) for the
    trunk's linear-attention blocks; ``attn`` itself when there is none."""
    if linear is None:
        return attn
    if attn is None:
        raise ValueError("linear_meta was given without attn: build both from the batch (build_attn_meta and "
                         "prepare_batch), so that both block kinds see the same documents")
    return HybridAttnMeta(**{f.name: getattr(attn, f.name) for f in dataclasses.fields(AttnMeta)}, linear=linear)


def _linear_meta(attn: AttnMeta | None) -> LinearMeta | None:
    """The documents a Gated DeltaNet block reads (None: every row one document); refuses what it cannot run."""
    if attn is None or attn.kv_cache is not None:  # decoding: one sequence per row, its state in the cache
        return None
    if attn.cp is not None:
        raise ValueError("Qwen3.5's Gated DeltaNet layers do not run under context parallelism (no state passing "
                         "between ranks); set parallel.cp = 1")
    lin = attn.linear if isinstance(attn, HybridAttnMeta) else None
    if lin is None and attn.packed:
        raise ValueError("packed rows reach Qwen3.5's Gated DeltaNet layers without their documents; pass "
                         "linear_meta=build_linear_meta(batch, device) to the model (the family's prepare_batch "
                         "adds it to the batch)")
    return lin


class Qwen3_5Block(nn.Module):
    """Pre-norm block: token mixer (Gated DeltaNet or gated attention, as layer_types says) then a dense MLP or the
    shared-expert MoE. forward(h, cos, sin, attn) -> (h, moe stats [2, E] or None), Qwen3Block's interface."""

    def __init__(self, cfg: Qwen3_5TextConfig, layer_id: int, ops: Ops):
        super().__init__()
        norm, self.add_norm = norms_1p(ops)
        self.attn_norm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps, norm)
        self.linear_attn = GatedDeltaNet(cfg, layer_id, ops) if cfg.is_linear(layer_id) else None
        self.attn = None if cfg.is_linear(layer_id) else GatedAttention(cfg, layer_id, ops)
        self.ffn_norm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps, norm)
        self.moe = SharedExpertMoE(cfg, ops) if cfg.is_moe else None
        self.mlp = None if cfg.is_moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size, ops.act_mul)

    def forward(self, h_BSD: torch.Tensor, cos_BSR: torch.Tensor, sin_BSR: torch.Tensor, attn: AttnMeta | None):
        x_BSD = self.attn_norm(h_BSD)
        if self.linear_attn is not None:
            a_BSD = self.linear_attn(x_BSD, _linear_meta(attn), None if attn is None else attn.kv_cache)
        else:
            a_BSD = self.attn(x_BSD, cos_BSR, sin_BSR, attn)
        # ffn_norm's weight is read here (not by calling the module) so the fused add + norm can take it; the TP
        # plan's grad_sum hooks sit on this block
        x_BSD, h_BSD = self.add_norm(a_BSD, h_BSD, self.ffn_norm.weight, self.ffn_norm.eps)
        if self.moe is not None:
            y_BSD, stats = self.moe(x_BSD, None if attn is None else attn.valid_BS)
            return h_BSD + y_BSD, stats
        return h_BSD + self.mlp(x_BSD), None

    def reset_parameters(self, std: float) -> None:
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        (self.linear_attn if self.linear_attn is not None else self.attn).reset_parameters(std)
        (self.moe if self.moe is not None else self.mlp).reset_parameters(std)


# ------------------------------------------------------------------------------------------------ models
class Qwen3_5TextModel(Qwen3Model):
    """The hybrid decoder. ``embed``, ``trunk`` (any contiguous slice of blocks), ``head``, ``forward`` and
    ``init_weights`` are Qwen3Model's; the blocks, the zero-centred final norm and the RoPE (interleaved M-RoPE over
    the first R channels of each head) are Qwen3.5's."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.ops = select_ops(cfg.kernels, cfg.moe_float8)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Qwen3_5Block(cfg, i, self.ops) for i in range(cfg.num_hidden_layers)})
        self.norm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps, norms_1p(self.ops)[0])
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.n_moe_layers = cfg.num_hidden_layers if cfg.is_moe else 0

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        if buffer_device is None:
            buffer_device = self.tok_embeddings.weight.device
            if buffer_device.type == "meta":
                buffer_device = "cpu"
        self.rope_inv_freq, self.rope_scale = rope_inv_freq(self.cfg.rotary_dim, self.cfg.rope_theta,
                                                            device=buffer_device)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [B, S, R] from M-RoPE positions [3, B, S] (or [B, S]: t = h = w)."""
        return mrope_cos_sin(position_ids, self.rope_inv_freq, self.cfg.mrope_section, dtype)


class Qwen3_5Model(Qwen3VLModel):
    """Vision tower + hybrid decoder. ``embed`` (visual tokens placed by ``visual_index``), ``trunk``, ``head`` and the
    training modes are Qwen3VLModel's; the forward also takes ``linear_meta`` (the batch's documents for the Gated
    DeltaNet layers, from :func:`prepare_batch`) and hands it to the trunk inside ``attn``."""

    def __init__(self, cfg: Qwen3_5Config):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.visual = VisionTower(cfg.vision, select_ops(cfg.kernels))
        self.language_model = Qwen3_5TextModel(cfg.text)
        self.embed_out = EmbedOutput()
        apply_freeze(self, cfg)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.language_model.rope(position_ids, dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, attn: AttnMeta | None = None,
                labels: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                vision_meta: Any = None, visual_index: torch.Tensor | None = None,
                loss_weights: torch.Tensor | None = None, linear_meta: LinearMeta | None = None,
                loss: Callable | None = None):
        """As Qwen3VLModel.forward, plus ``linear_meta`` (None: every row one document, which ``attn`` must agree
        with)."""
        return super().forward(input_ids, position_ids=position_ids, attn=with_linear(attn, linear_meta),
                               labels=labels, logits_at=logits_at, pixel_values=pixel_values,
                               pixel_values_videos=pixel_values_videos, vision_meta=vision_meta,
                               visual_index=visual_index, loss_weights=loss_weights, loss=loss)


def prepare_batch(cfg: Qwen3_5Config, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The family's ModelSpec.prepare_batch, on the host before the batch moves to the device: Qwen3-VL's vision
    inputs (``vision_meta``, ``visual_index``) in place of the grids (GRID_KEYS) and ``linear_meta``, the documents
    of packed rows."""
    out = {**consume(batch, GRID_KEYS), **vision_inputs(cfg, batch, device)}
    lin = build_linear_meta(batch, device)
    if lin is not None:
        out["linear_meta"] = lin
    return out


def build(cfg: Qwen3_5Config) -> Qwen3_5Model:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen3_5Model(cfg)
