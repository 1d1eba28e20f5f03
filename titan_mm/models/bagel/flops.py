"""Training FLOPs of BAGEL (the number MFU divides by), as docs/flops.md counts them:

  flops(cfg, doc_lens, vit_lens, token_kind) = 6 * T * P_tok + 6 * V * P_vit + 6 * N * P_lat
                                               + 12 * H * K * layers * sum_docs L (L + 1) / 2
                                               + 12 * D_vit * vit_layers * sum_images n^2

  T = sum(doc_lens) tokens; every token runs one expert's decoder weights (und or gen: the same sizes), the LM head
      and llm2vae (the objectives' hooks run over every position)
  V = sum(vit_lens) ViT patches: the patch embedding, the SigLIP layers, the connector
  N = latent tokens (``token_kind`` == VAE, the batch's [B, S] kinds): vae2llm and the timestep embedder
  attention: causal pairs per document (docs/flops.md's convention; a full or noise split's extra pairs are not
  counted) and full pairs per image in the ViT.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.model import TIMESTEP_FREQS
from titan_mm.models.bagel.spec import VAE


def matmul_params(cfg: BagelConfig) -> tuple[int, int, int]:
    """(P_tok, P_vit, P_lat) of the module docstring."""
    c, v = cfg.llm_config, cfg.vit_config
    D, K, P = c.hidden_size, c.head_dim, cfg.patch_latent_dim
    layer = D * K * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * D * c.intermediate_size
    tok = c.num_hidden_layers * layer + D * c.vocab_size + D * P
    Dv = v.hidden_size
    vit = v.patch_dim * Dv + v.num_hidden_layers * (4 * Dv * Dv + 2 * Dv * v.intermediate_size) + Dv * D + D * D
    lat = P * D + TIMESTEP_FREQS * D + D * D
    return tok, vit, lat


def flops(cfg: BagelConfig, doc_lens: Iterable[int], vit_lens: Iterable[int] = (), token_kind: torch.Tensor | None = None,
          **_) -> float:
    """``vit_lens`` / ``token_kind``: the batch's keys (observe.mfu.encoder_inputs hands them over)."""
    lens, images = [int(n) for n in doc_lens], [int(n) for n in vit_lens]
    vae_tokens = 0 if token_kind is None else int((token_kind == VAE).sum())
    tok, vit, lat = matmul_params(cfg)
    c, v = cfg.llm_config, cfg.vit_config
    attn = 12 * c.num_attention_heads * c.head_dim * c.num_hidden_layers * sum(n * (n + 1) // 2 for n in lens)
    vit_attn = 12 * v.hidden_size * v.num_hidden_layers * sum(n * n for n in images)
    return float(6 * sum(lens) * tok + 6 * sum(images) * vit + 6 * vae_tokens * lat + attn + vit_attn)
