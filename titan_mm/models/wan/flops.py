"""Training FLOPs of the Wan transformer (the number MFU divides by), as docs/flops.md counts them:

  flops(cfg, doc_lens, text_len) = 6 * T * P_tok  +  6 * R * (L * P_text + P_time)  +  3 * 4 * D * layers *
                                   (sum_docs L_doc (L_doc + 1) / 2  +  T * L)

  T       = sum(doc_lens), video tokens (patches); R = len(doc_lens) clips, L = text_len text tokens each
  P_tok   = weights multiplied per video token: patch embedding, per block q/k/v/o of self-attention, q/o of
            cross-attention, the FFN, the output head
  P_text  = per text token: the text embedder and each block's cross-attention k/v
  P_time  = per clip: the time embedder and projection (the forward runs them once per clip when its patches
            share t; a t per patch, Wan2.2 TI2V, runs them per token: 6 (T - R) P_time more than counted)
  attention: the clip's causal pairs (the convention of docs/flops.md: the objective's "bidirectional" mask adds
  the other half, titan_mm.objectives.base.Objective.flops) and every text token of the row.
"""

from __future__ import annotations

from collections.abc import Iterable

from titan_mm.models.wan.config import WanConfig

TEXT_LEN = 512
"""UMT5 states per prompt in Wan pipelines (padded to 512)."""


def matmul_params(cfg: WanConfig) -> tuple[int, int, int]:
    """(P_tok, P_text, P_time) of the module docstring."""
    D, P_in = cfg.dim, cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    block = 6 * D * D + 2 * D * cfg.ffn_dim
    tok = P_in * D + cfg.num_layers * block + D * cfg.patch_dim
    text = cfg.text_dim * D + D * D + cfg.num_layers * 2 * D * D
    return tok, text, cfg.freq_dim * D + D * D + 6 * D * D


def flops(cfg: WanConfig, doc_lens: Iterable[int], text_len: int = TEXT_LEN, **_) -> float:
    lens = [int(n) for n in doc_lens]
    T, R = sum(lens), len(lens)
    tok, text, time = matmul_params(cfg)
    attn = 3 * 4 * cfg.dim * cfg.num_layers * (sum(n * (n + 1) // 2 for n in lens) + T * text_len)
    return float(6 * T * tok + 6 * R * (text_len * text + time) + attn)
