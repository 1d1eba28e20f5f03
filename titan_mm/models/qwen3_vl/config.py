"""Qwen3-VL / Qwen3-VL-MoE configuration: a frozen vision config + the Qwen3 text config + VL fields.

Read from an HF ``config.json`` (``Qwen3VLConfig`` / ``Qwen3VLMoeConfig``: ``text_config`` +
``vision_config``) with :func:`config_from_hf`, or pick a named flavor from :data:`FLAVORS` /
:data:`MOE_FLAVORS` (real HF numbers for the released sizes, plus tiny debug flavors).

Training-mode fields (freezing, separate learning rates) live here too, so a TOML can set them through
``--model.overrides '{"freeze_vision": true, "vision_lr": 2e-6}'``; :func:`titan_mm.models.qwen3_vl.model.param_groups`
reads them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_mm.models.qwen3.config import Qwen3Config


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    """Number of ViT blocks."""
    hidden_size: int = 1152
    """ViT width."""
    intermediate_size: int = 4304
    """ViT MLP width."""
    num_heads: int = 16
    """ViT attention heads."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 16
    """Spatial patch size in pixels."""
    temporal_patch_size: int = 2
    """Frames per temporal patch (an image is repeated to fill it)."""
    spatial_merge_size: int = 2
    """merge x merge patches become one LLM token."""
    out_hidden_size: int = 2048
    """Merger output width (= the LLM hidden size)."""
    num_position_embeddings: int = 2304
    """Learned position table size (a square grid, 48 x 48 for the released models)."""
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    """ViT blocks whose outputs feed the DeepStack mergers, added into LLM layers 0, 1, 2, ..."""
    hidden_act: str = "gelu_pytorch_tanh"
    """ViT MLP activation."""
    rope_theta: float = 10000.0
    """2-D rotary base."""
    layer_norm_eps: float = 1e-6
    """LayerNorm epsilon (fixed at 1e-6 in HF)."""
    initializer_range: float = 0.02
    """Std of the random init."""

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class Qwen3VLConfig:
    text: Qwen3Config = field(default_factory=Qwen3Config)
    """The LLM (dense or MoE Qwen3 text config); its rope is interleaved M-RoPE over ``mrope_section``."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """The vision tower."""
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    """Rotary frequency pairs per axis (t, h, w); sums to head_dim / 2. Interleaved as in HF Qwen3-VL."""
    image_token_id: int = 151655
    """<|image_pad|>: one per merged image token in input_ids."""
    video_token_id: int = 151656
    """<|video_pad|>: one per merged video token."""
    vision_start_token_id: int = 151652
    """<|vision_start|>."""
    vision_end_token_id: int = 151653
    """<|vision_end|>."""
    vision_attn_backend: str = "auto"
    """Vision attention: auto (varlen on CUDA, sdpa on CPU), sdpa, flex or varlen."""
    # ---- training modes ----
    freeze_vision: bool = False
    """Freeze the ViT (patch embed, position embed, blocks); the mergers follow freeze_merger."""
    freeze_merger: bool = False
    """Freeze the patch merger and the DeepStack mergers."""
    freeze_llm: bool = False
    """Freeze the language model (embeddings, blocks, final norm, output head)."""
    vision_lr: float | None = None
    """Learning rate of the ViT parameters (None: the optimizer's lr)."""
    merger_lr: float | None = None
    """Learning rate of the mergers (None: vision_lr if set, else the optimizer's lr)."""
    llm_lr: float | None = None
    """Learning rate of the language model (None: the optimizer's lr)."""

    @property
    def is_moe(self) -> bool:
        return getattr(self.text, "num_experts", 0) > 0

    def __post_init__(self):
        hd = self.text.head_dim
        if sum(self.mrope_section) * 2 != hd:
            raise ValueError(
                f"mrope_section={self.mrope_section} sums to {sum(self.mrope_section)}, but head_dim/2 = {hd // 2}; "
                "fix mrope_section (t, h, w frequency pairs) or head_dim."
            )
        if self.vision.out_hidden_size != self.text.dim:
            raise ValueError(
                f"vision out_hidden_size={self.vision.out_hidden_size} must equal the LLM hidden size {self.text.dim}."
            )


def with_overrides(cfg: Qwen3VLConfig, overrides: dict[str, Any]) -> Qwen3VLConfig:
    """A copy of ``cfg`` with fields replaced; ``{"text": {...}, "vision": {...}}`` reach inside.
    Unknown keys raise with the valid names."""
    top = {}
    for k, v in overrides.items():
        if k in ("text", "vision"):
            sub = getattr(cfg, k)
            names = {f.name for f in dataclasses.fields(sub)}
            bad = set(v) - names
            if bad:
                raise ValueError(f"unknown {k} config fields {sorted(bad)}; valid: {sorted(names)}")
            v = {kk: tuple(vv) if isinstance(vv, list) else vv for kk, vv in v.items()}
            top[k] = dataclasses.replace(sub, **v)
        else:
            top[k] = tuple(v) if isinstance(v, list) else v
    names = {f.name for f in dataclasses.fields(cfg)}
    bad = set(top) - names
    if bad:
        raise ValueError(f"unknown Qwen3-VL config fields {sorted(bad)}; valid: {sorted(names)}")
    return dataclasses.replace(cfg, **top)
