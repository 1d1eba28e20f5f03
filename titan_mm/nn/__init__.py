"""Shared pure ops for every model family, the ground floor (norm, rope, attention over segment descriptions, mlp, moe, loss, kv cache, media layouts)."""

from titan_mm.nn.attention import AttnMeta, build_attn_meta
from titan_mm.nn.output import ModelOutput, Stream

__all__ = ["AttnMeta", "ModelOutput", "Stream", "build_attn_meta"]
