"""The Qwen2 / Qwen2.5 model is titan_mm's Qwen3 decoder (titan_mm/models/qwen3/model.py) built from the
derived Qwen3Config (no qk-norm, q/k/v bias, no o_proj bias): embed -> trunk -> head, the same parameter
names (``layers.{i}.attn.wq.bias`` ...), kernels, attention backends and KV-cache path. The built model's
``cfg`` is that decoder config; the family's functions take the Qwen2Config (or the decoder config)."""

from __future__ import annotations

from titan_mm.models.qwen2.config import Qwen2Config, as_decoder
from titan_mm.models.qwen3.model import Qwen3Model


def build(cfg: Qwen2Config) -> Qwen3Model:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen3Model(as_decoder(cfg))
