"""Training FLOPs of Qwen3.5 / Qwen3.5-MoE (what MFU divides by); docs/qwen3_5.md "FLOPs" has the derivation.

    flops = 6 * T * P_active                                       every weight in a matmul: 2 fwd + 4 bwd per token
          + 12 * H * K * n_full * sum_docs pairs(L_doc)            full attention: QK^T + PV per causal pair, x3
          + 3 * n_linear * T * (gdn_per_token + 2 * W * C)         Gated DeltaNet's chunked rule and its conv, x3
          + the vision tower (Qwen3-VL's count, titan_mm/models/qwen3_vl/flops.py, without DeepStack)

  P_active   per full-attention layer: D*2HK (q + gate) + 2*D*G*K (k, v) + HK*D (o)
             per Gated DeltaNet layer: D*C (q/k/v, C = 2*Hk*Dk + Hv*Dv) + D*Hv*Dv (z) + 2*D*Hv (b, a) + Hv*Dv*D (out)
             per layer: 3*D*F (dense MLP), or D*E (router) + top_k*3*D*F_moe + 3*D*F_shared + D (shared expert + gate)
             + V*D, the LM head (counted even when tied)
  gdn_per_token = Hv * (6*Dk*Dv + 6*L*Dk + 4*L*Dv), the forward of the chunked rule per token, chunks of L = 64
             (per value head: K K^T, Q K^T and the (I + A)^-1 (beta K) product, 2*L*Dk each; the (I + A)^-1 (beta V)
             and (Q K^T) U products, 2*L*Dv each; the state read by the pseudo-values and by the queries and the
             state update, 2*Dk*Dv each). The triangular solve itself (~L^2/3 per token and head) and the
             elementwise work (decays, l2 norms, gates) are left out, as norms are elsewhere.
  2*W*C      the depthwise conv's multiply-adds per token (W taps over C channels).

The linear layers' cost is linear in the tokens, whatever the document lengths; only full attention depends on them.
Training = 3 x forward for every term (the usual convention; fla's backward of the chunked rule recomputes part of
its forward, which is not counted: MFU, not HFU).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan_mm.models.qwen3 import flops as qwen3_flops
from titan_mm.models.qwen3_5.config import Qwen3_5Config, Qwen3_5TextConfig
from titan_mm.models.qwen3_5.model import Qwen3_5Model
from titan_mm.models.qwen3_vl import flops as vl_flops
from titan_mm.nn.linear_attention import CHUNK


def conv_channels(t: Qwen3_5TextConfig) -> int:
    return 2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * t.linear_value_head_dim


def layer_matmul_params(t: Qwen3_5TextConfig, i: int, active: bool = True) -> int:
    D = t.hidden_size
    if t.is_linear(i):
        vd = t.linear_num_value_heads * t.linear_value_head_dim
        mixer = D * conv_channels(t) + D * vd + 2 * D * t.linear_num_value_heads + vd * D
    else:
        HK, GK = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
        mixer = D * 2 * HK + 2 * D * GK + HK * D
    if t.is_moe:
        n = t.num_experts_per_tok if active else t.num_experts
        ffn = D * t.num_experts + n * 3 * D * t.moe_intermediate_size + 3 * D * t.shared_expert_intermediate_size + D
    else:
        ffn = 3 * D * t.intermediate_size
    return mixer + ffn


def matmul_params(t: Qwen3_5TextConfig, active: bool = True) -> int:
    """Weights multiplied per token (active experts only when ``active``), LM head included."""
    return sum(layer_matmul_params(t, i, active) for i in range(t.num_hidden_layers)) + t.vocab_size * t.hidden_size


def gdn_flops_per_token(t: Qwen3_5TextConfig, chunk: int = CHUNK) -> float:
    """Forward FLOPs per token of one Gated DeltaNet layer's rule and conv (the module docstring)."""
    dk, dv, L = t.linear_key_head_dim, t.linear_value_head_dim, chunk
    rule = t.linear_num_value_heads * (6 * dk * dv + 6 * L * dk + 4 * L * dv)
    return rule + 2 * t.linear_conv_kernel_dim * conv_channels(t)


def text_flops(t: Qwen3_5TextConfig, doc_lens: Iterable[int]) -> float:
    lens = [int(x) for x in (doc_lens.tolist() if hasattr(doc_lens, "tolist") else doc_lens)]
    T = sum(lens)
    n_full = t.num_hidden_layers - t.n_linear
    attn = 12.0 * t.num_attention_heads * t.head_dim * n_full * sum(qwen3_flops.causal_pairs(L) for L in lens)
    return 6.0 * T * matmul_params(t) + attn + 3.0 * t.n_linear * T * gdn_flops_per_token(t)


def flops_breakdown(cfg: Qwen3_5Config, doc_lens, image_grid_thw=None, video_grid_thw=None) -> dict:
    """{"llm", "vision", "total"} training FLOPs of one batch."""
    llm = text_flops(cfg.text, doc_lens)
    vis = vl_flops.vision_flops(cfg.vision, image_grid_thw) + vl_flops.vision_flops(cfg.vision, video_grid_thw)
    return {"llm": llm, "vision": vis, "total": llm + vis}


def flops(cfg: Qwen3_5Config, doc_lens, image_grid_thw=None, video_grid_thw=None, **_) -> float:
    """Total training FLOPs (decoder + vision tower); ``doc_lens`` may also be a batch dict (its ``cu_seqlens``,
    ``doc_ids`` and grids)."""
    if isinstance(doc_lens, dict):
        b = doc_lens
        return flops_breakdown(cfg, qwen3_flops.doc_lens_from_batch(b), b.get("image_grid_thw"),
                               b.get("video_grid_thw"))["total"]
    return flops_breakdown(cfg, doc_lens, image_grid_thw, video_grid_thw)["total"]


def num_params(cfg: Qwen3_5Config) -> dict:
    """Parameter counts as stored (tied head once), from a meta-device build: llm, vision, total."""
    with torch.device("meta"):
        m = Qwen3_5Model(cfg)
    llm = sum(p.numel() for p in m.language_model.parameters())
    vis = sum(p.numel() for p in m.visual.parameters())
    return {"llm": llm, "vision": vis, "total": llm + vis}
