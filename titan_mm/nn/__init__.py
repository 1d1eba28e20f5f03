"""Shared pure ops for every model family (norm, rope, attention, mlp, moe, loss, HF safetensors IO)."""

from titan_mm.nn.attention import AttnMeta, build_attn_meta
from titan_mm.nn.output import ModelOutput, Stream

__all__ = ["AttnMeta", "ModelOutput", "Stream", "build_attn_meta"]
