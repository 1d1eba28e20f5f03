"""Shared pure ops for every model family (norm, rope, attention, mlp, moe, loss, HF safetensors IO)."""

from titan_mm.models.common.attention import AttnMeta, build_attn_meta
from titan_mm.models.common.output import ModelOutput, Stream

__all__ = ["AttnMeta", "ModelOutput", "Stream", "build_attn_meta"]
