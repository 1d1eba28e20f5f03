"""Qwen3.5 / Qwen3.5-MoE activation terms for the memory estimator (titan_mm/parallel/memory.py).

The two block kinds save different tensors; ``decoder.kept`` is their mean over the layers (the estimator multiplies
it by the layer count), ``full`` and ``bwd_tmp`` the larger kind's. A full-attention block is Qwen3's
(titan_mm/models/qwen3/memory.py, on the same heads and FFN) plus the output gate (its logits and the gated
product, 2 H K). A Gated DeltaNet block saves per token: the two norm inputs (2 D) + fp32 rstd, the projections'
input (D), the q/k/v projection output and the conv output (2 C), the SiLU output read by the rule (C), z (Hv Dv),
beta / decay (2 Hv, fp32), fla's within-chunk matrix (64 Hv, fp32) and l2-norm statistics, the rule's output and the
gated norm's output (2 Hv Dv), then the same FFN as the full-attention block; heads divide by tp, D-terms by tp
with sequence parallel. The ViT is Qwen3-VL's without DeepStack."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from titan_mm.nn.linear_attention import CHUNK
from titan_mm.models.qwen3 import memory as qwen3_memory
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3_5.config import Qwen3_5Config
from titan_mm.models.qwen3_5.flops import conv_channels
from titan_mm.models.qwen3_vl import memory as vl_memory
from titan_mm.registry import BlockBytes, MemoryTerms

if TYPE_CHECKING:
    from titan_mm.parallel.memory import Topology


def _as_qwen3(cfg: Qwen3_5Config) -> Qwen3Config:
    """The Qwen3 decoder with this model's full-attention heads and FFN (routed experts; the shared expert is
    counted on top), for Qwen3's block terms."""
    t = cfg.text
    return Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                       num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                       num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, num_experts=t.num_experts,
                       num_experts_per_tok=t.num_experts_per_tok, moe_intermediate_size=t.moe_intermediate_size,
                       kernels=cfg.kernels, loss_chunk_size=t.loss_chunk_size)


def memory_terms(cfg: Qwen3_5Config, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    t = cfg.text
    a, tp = act_bytes, topo.tp
    st = tp if topo.sp else 1
    q3 = _as_qwen3(cfg)
    full = qwen3_memory.decoder_block_bytes(q3, topo, act_bytes, kernels=kernels, compile=compile, float8=float8)
    extra = 2 * a * t.num_attention_heads * t.head_dim / tp  # the output gate
    if t.is_moe:  # the shared expert: gate, up, SwiGLU output
        extra += 3 * a * t.shared_expert_intermediate_size / tp
    full = BlockBytes(full.kept + extra, full.full + extra, full.bwd_tmp)
    # the FFN and norms of a block are the same for both kinds: a linear block swaps Qwen3's attention terms
    H, G, K = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    attn_q3 = (a * (3 * H + 3 * G) * K + 4 * (2 * H + G)) / tp
    hv, vd = t.linear_num_value_heads, t.linear_num_value_heads * t.linear_value_head_dim
    C = conv_channels(t)
    mixer = a * t.hidden_size / st + (a * (3 * C + 3 * vd) + 4 * hv * (2 + CHUNK) + 8 * hv) / tp
    lin = BlockBytes(full.kept - attn_q3 + mixer, full.full - attn_q3 + mixer, max(full.bwd_tmp, 2 * a * C / tp))
    n_lin, L = t.n_linear, t.num_hidden_layers
    kept = (n_lin * lin.kept + (L - n_lin) * full.kept) / L
    text = qwen3_memory.memory_terms(q3, topo, act_bytes, kernels=kernels, compile=compile, float8=float8)
    decoder = BlockBytes(kept, max(lin.full, full.full), max(lin.bwd_tmp, full.bwd_tmp))
    return dataclasses.replace(
        text, decoder=decoder,
        vision=vl_memory.vision_block_bytes(cfg, topo, act_bytes, compile=compile),
        vision_stem=vl_memory.vision_stem_bytes(cfg, topo, act_bytes),
        vision_head=0.0,
    )
