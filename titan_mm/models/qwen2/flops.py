"""Training FLOPs of Qwen2 / Qwen2.5: Qwen3's count (titan_mm/models/qwen3/flops.py, docs/flops.md) on the
derived decoder config, which is exact for Qwen2's matmuls:

  flops(cfg, doc_lens) = 6 * T * P_matmul  +  12 * H * K * sum_layers sum_docs pairs(L_doc, window_layer)

P_matmul counts q/k/v/o, the SwiGLU MLP and the LM head (also when tied); the window of each layer follows
HF's sliding-window rules. Not counted, as for Qwen3: the q/k/v bias adds ((H + 2G) K per token and layer,
against 2 D (H + 2G) K for the projections), RMSNorms, RoPE, SwiGLU's pointwise ops and the softmax.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan_mm.models.qwen2.config import Qwen2Config, as_decoder
from titan_mm.models.qwen2.model import build
from titan_mm.models.qwen3 import flops as qwen3_flops


def flops(cfg: Qwen2Config, doc_lens: Iterable[int], **_) -> float:
    """Training FLOPs (forward + backward) of one batch whose documents have these lengths."""
    return qwen3_flops.flops(as_decoder(cfg), doc_lens)


def flops_per_token(cfg: Qwen2Config, seq_len: int) -> float:
    return flops(cfg, [seq_len]) / seq_len


def num_params(cfg: Qwen2Config) -> int:
    """All parameters as stored (tied head once, q/k/v biases included), counted on a meta-built model."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(cfg).parameters())
