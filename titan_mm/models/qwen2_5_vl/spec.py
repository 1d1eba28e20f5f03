"""The Qwen2.5-VL answers to the family contract (titan_mm.registry.ModelSpec): the Qwen2 decoder's
(titan_mm/models/qwen2/spec.py), plus the vision tower's shapes, M-RoPE positions and the visual tokens
(Qwen3-VL's tokens and chat template: <|vision_start|><|image_pad|><|vision_end|>; Qwen2.5-VL's image and video
processing, :data:`VISION_LAYOUT`)."""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen2 import spec as text_spec
from titan_mm.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from titan_mm.models.qwen3_vl import spec as vl_spec
from titan_mm.nn.media import VisionLayout
from titan_mm.registry import DataNeeds, FusedRows, KernelShapes, ModelDims, Runtime, VisionDims

# Qwen2VLVideoProcessor + Qwen2_5_VLProcessor: OpenAI CLIP's mean / std; a multiple of 2 frames sampled at
# data.video_fps, each frame within the pixel bounds; one run of pads per video, timed by the sampled fps
VISION_LAYOUT = VisionLayout(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711),
                             frames="strided", pixel_bounds="frame", video_time="sampled_fps")


def dims(cfg: Qwen2_5_VLConfig) -> ModelDims:
    v = cfg.vision
    vision = VisionDims(depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads,
                        intermediate_size=v.intermediate_size, patch_dim=v.patch_dim, merge_size=v.spatial_merge_size)
    return dataclasses.replace(text_spec.dims(cfg.text), vision=vision)


def runtime(cfg: Qwen2_5_VLConfig) -> Runtime:
    return Runtime(attn_backend=cfg.attn_backend, kernels=cfg.kernels, sliding_window=None)


def with_runtime(cfg: Qwen2_5_VLConfig, attn_backend: str, kernels: bool | str) -> Qwen2_5_VLConfig:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def data_needs(cfg: Qwen2_5_VLConfig) -> DataNeeds:
    # the patch / merge sizes and token ids are read as Qwen3-VL's; the processing is Qwen2.5-VL's (CLIP mean /
    # std, one run of video pads per video, time ids from second_per_grid_ts)
    return dataclasses.replace(vl_spec.data_needs(cfg), vision_layout=VISION_LAYOUT,
                               video_tokens_per_second=cfg.vision.tokens_per_second)


def kernel_shapes(cfg: Qwen2_5_VLConfig, tp: int = 1, encoder_tp: bool = False) -> KernelShapes:
    """The decoder's, plus the ViT's RMSNorm, SwiGLU and RoPE (SwiGLU and RoPE sharded over tp only with
    encoder_tp)."""
    v = cfg.vision
    return text_spec.kernel_shapes(cfg.text, tp).plus(
        rms_norm=(v.hidden_size,), swiglu=(v.intermediate_size // (tp if encoder_tp else 1),),
        rope=(vl_spec.vision_rope(v, tp, encoder_tp),))


def fused_params(cfg: Qwen2_5_VLConfig) -> dict[str, FusedRows]:
    """The ViT's fused q/k/v projection: head-major rows [H, 3, Dh] (Qwen3-VL's VisionAttention)."""
    return vl_spec.fused_params(cfg)
