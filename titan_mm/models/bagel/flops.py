"""Training FLOPs of BAGEL (the number MFU divides by), as docs/flops.md counts them:

  flops(cfg, doc_lens, vit_lens, token_kind, seg_ids, seg_kinds, labels)
      = 6 * T * P_tok + 6 * C * P_head + 6 * V * P_vit + 6 * N * P_lat
        + 12 * H * K * layers * (sum_docs L (L + 1) / 2 + segment pairs) + 12 * D_vit * vit_layers * sum_images n^2

  T = sum(doc_lens) tokens; every token runs one expert's decoder weights (und or gen: the same sizes) and llm2vae
      (flow matching's hook runs over every position)
  C = the labeled tokens (``labels`` != -100; without labels: T): the LM head (D x vocab) runs on them alone (the
      family's prepare_batch hands the causal LM their positions, as BAGEL's ``ce_loss_indexes``)
  V = sum(vit_lens) ViT patches: the patch embedding, the SigLIP layers, the connector
  N = latent tokens (``token_kind`` == VAE, the batch's [B, S] kinds): vae2llm and the timestep embedder
  attention: the (query, key) pairs the segment mask computes (docs/flops.md's convention, as the objective's
      "bidirectional" kind counts L^2): the causal pairs of each document, plus n (n - 1) / 2 per full or noise split
      of n tokens (bidirectional within the split: its keys after the query), minus n x (the document's tokens after
      a noise split), which never see its noised tokens; the splits come from the batch's ``seg_ids`` / ``seg_kinds``
      (without them: causal pairs only). Full pairs per image in the ViT.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.model import TIMESTEP_FREQS
from titan_mm.models.bagel.spec import VAE
from titan_mm.nn.attention import FULL, NOISE


def matmul_params(cfg: BagelConfig) -> tuple[int, int, int, int]:
    """(P_tok, P_head, P_vit, P_lat) of the module docstring."""
    c, v = cfg.llm_config, cfg.vit_config
    D, K, P = c.hidden_size, c.head_dim, cfg.patch_latent_dim
    layer = D * K * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * D * c.intermediate_size
    tok = c.num_hidden_layers * layer + D * P
    vit = vit_tower_params(cfg) + v.hidden_size * D + D * D  # the tower, then the connector
    lat = P * D + TIMESTEP_FREQS * D + D * D
    return tok, D * c.vocab_size, vit, lat


def vit_tower_params(cfg: BagelConfig) -> int:
    """The SigLIP tower's matmul weights per patch: the patch embedding and the encoder layers."""
    v = cfg.vit_config
    Dv = v.hidden_size
    return v.patch_dim * Dv + v.num_hidden_layers * (4 * Dv * Dv + 2 * Dv * v.intermediate_size)


def vit_attention_flops(cfg: BagelConfig, vit_lens: Iterable[int]) -> int:
    """The ViT's attention over its images, each bidirectional over its own patches (training: 12 per pair)."""
    v = cfg.vit_config
    return 12 * v.hidden_size * v.num_hidden_layers * sum(int(n) ** 2 for n in vit_lens)


def vit_flops(cfg: BagelConfig, vit_lens: Iterable[int]) -> float:
    """Training FLOPs of the SigLIP tower alone over images of ``vit_lens`` patches (bench/towers.py's MFU): its
    matmuls per patch and its attention; the connector is the decoder's side."""
    lens = [int(n) for n in vit_lens]
    return float(6 * sum(lens) * vit_tower_params(cfg) + vit_attention_flops(cfg, lens))


def segment_pairs(doc_lens: Iterable[int], seg_ids: torch.Tensor, seg_kinds: torch.Tensor) -> int:
    """The segment mask's (query, key) pairs beyond each document's causal L (L + 1) / 2 (module docstring):
    ``doc_lens`` tile the flat B*S tokens (padding included, as cu_seqlens cuts them)."""
    seg, kind = seg_ids.reshape(-1).numpy(), seg_kinds.reshape(-1).numpy()
    doc_end = np.cumsum(np.asarray(list(doc_lens), dtype=np.int64))
    if doc_end.size == 0 or doc_end[-1] != seg.size:
        raise ValueError(f"doc_lens sum to {int(doc_end[-1]) if doc_end.size else 0}, the batch has {seg.size} tokens")
    cut = np.zeros(seg.size, dtype=bool)
    cut[0] = True
    cut[1:] = seg[1:] != seg[:-1]
    cut[doc_end[:-1]] = True  # a split never crosses a document
    start = np.flatnonzero(cut)
    n = np.diff(np.append(start, seg.size))
    k = kind[start]
    after = doc_end[np.searchsorted(doc_end, start, side="right")] - (start + n)  # the document's tokens after it
    extra = np.where((k == FULL) | (k == NOISE), n * (n - 1) // 2, 0) - np.where(k == NOISE, n * after, 0)
    return int(extra.sum())


def flops(cfg: BagelConfig, doc_lens: Iterable[int], vit_lens: Iterable[int] = (),
          token_kind: torch.Tensor | None = None, seg_ids: torch.Tensor | None = None,
          seg_kinds: torch.Tensor | None = None, labels: torch.Tensor | None = None, **_) -> float:
    """``vit_lens`` / ``token_kind`` / ``seg_ids`` / ``seg_kinds`` / ``labels``: the batch's keys
    (observe.mfu.encoder_inputs hands them over)."""
    lens, images = [int(n) for n in doc_lens], [int(n) for n in vit_lens]
    vae_tokens = 0 if token_kind is None else int((token_kind == VAE).sum())
    head_tokens = sum(lens) if labels is None else int((labels != -100).sum())
    tok, head, vit, lat = matmul_params(cfg)
    c = cfg.llm_config
    pairs = sum(n * (n + 1) // 2 for n in lens)
    if seg_ids is not None and seg_kinds is not None:
        pairs += segment_pairs(lens, seg_ids, seg_kinds)
    attn = 12 * c.num_attention_heads * c.head_dim * c.num_hidden_layers * pairs
    vit_attn = vit_attention_flops(cfg, images)
    return float(6 * sum(lens) * tok + 6 * head_tokens * head + 6 * sum(images) * vit + 6 * vae_tokens * lat + attn
                 + vit_attn)
