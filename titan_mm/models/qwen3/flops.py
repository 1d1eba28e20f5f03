"""Training FLOPs of Qwen3 / Qwen3-MoE (the number MFU divides by). Formula in docs/flops.md.

  flops(cfg, doc_lens) = 6 * T * P_active  +  3 * 4 * H * K * sum_layers sum_docs pairs(L_doc, window_layer)

  T         = sum(doc_lens), the tokens of the batch
  P_active  = weights used in matmuls per token: q/k/v/o, dense MLP or (router + top_k experts) per layer,
              and the LM head (counted even when tied; embedding lookups and norms are not matmuls)
  pairs(L, w) = sum_{q=0}^{L-1} min(q + 1, w): causal (query, key) pairs of one document, w = inf if no window
  4*H*K*pairs = QK^T (2 H K per pair) + PV (2 H K per pair) in the forward; training = 3x forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from titan_mm.models.qwen3.config import Qwen3Config


def layer_matmul_params(cfg: Qwen3Config, i: int, active: bool = True) -> int:
    D, H, G, K = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = D * H * K + 2 * D * G * K + H * K * D
    if cfg.is_moe_layer(i):
        n = cfg.num_experts_per_tok if active else cfg.num_experts
        ffn = D * cfg.num_experts + n * 3 * D * cfg.moe_intermediate_size
    else:
        ffn = 3 * D * cfg.intermediate_size
    return attn + ffn


def matmul_params(cfg: Qwen3Config, active: bool = True) -> int:
    """Weights multiplied per token (active experts only when ``active``), LM head included."""
    return sum(layer_matmul_params(cfg, i, active) for i in range(cfg.num_hidden_layers)) + (
        cfg.vocab_size * cfg.hidden_size
    )


def num_params(cfg: Qwen3Config) -> int:
    """All parameters (as stored: tied head counted once), for reporting."""
    D, K = cfg.hidden_size, cfg.head_dim
    n = matmul_params(cfg, active=False) + cfg.vocab_size * D * (0 if cfg.tie_word_embeddings else 1)
    n += cfg.num_hidden_layers * (2 * D + 2 * K) + D  # norms
    if cfg.attention_bias:
        n += cfg.num_hidden_layers * ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * K + D)
    return n


def causal_pairs(L: int, window: int | None = None) -> int:
    """Number of (query, key) pairs a causal (optionally windowed) document of length L attends."""
    if window is None or window >= L:
        return L * (L + 1) // 2
    return window * (window + 1) // 2 + (L - window) * window


def flops(cfg: Qwen3Config, doc_lens: Iterable[int], **_) -> float:
    """Training FLOPs (forward + backward) of one batch whose documents have these lengths."""
    lens = [int(x) for x in (doc_lens.tolist() if hasattr(doc_lens, "tolist") else doc_lens)]
    T = sum(lens)
    dense = 6.0 * T * matmul_params(cfg, active=True)
    HK = cfg.num_attention_heads * cfg.head_dim
    attn = 0.0
    for i in range(cfg.num_hidden_layers):
        w = cfg.layer_window(i)
        attn += sum(causal_pairs(L, w) for L in lens)
    return dense + 12.0 * HK * attn


def flops_per_token(cfg: Qwen3Config, seq_len: int) -> float:
    """Training FLOPs per token for unpacked sequences of ``seq_len`` tokens."""
    return flops(cfg, [seq_len]) / seq_len


def doc_lens_from_batch(batch) -> list[int]:
    """Document lengths of a packed batch from ``cu_seqlens`` (host-side; padding segment excluded when
    ``doc_ids`` marks it with -1)."""
    cu = batch["cu_seqlens"].tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    doc = batch.get("doc_ids")
    if doc is not None:
        pad = int((doc < 0).sum())
        if pad and lens and lens[-1] == pad:
            lens = lens[:-1]
    return lens
