"""The Qwen3-VL / Qwen3-VL-MoE answers to the family contract (titan_mm.registry.ModelSpec): the text
model's, plus the vision tower's shapes, M-RoPE positions and the visual tokens."""

from __future__ import annotations

import dataclasses

from titan_mm.data.vision import mrope_positions
from titan_mm.models.qwen3 import spec as text_spec
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig
from titan_mm.nn.media import VisionLayout
from titan_mm.registry import DataNeeds, FusedRows, KernelShapes, ModelDims, Runtime, VisionDims

# Qwen3VLProcessor: mean / std 0.5; a video's frames by linspace, its whole volume within the pixel bounds, one
# <t seconds><|vision_start|>pads<|vision_end|> group per temporal patch
VISION_LAYOUT = VisionLayout(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def dims(cfg: Qwen3VLConfig) -> ModelDims:
    v = cfg.vision
    vision = VisionDims(depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads,
                        intermediate_size=v.intermediate_size, patch_dim=v.patch_dim, merge_size=v.spatial_merge_size,
                        deepstack_layers=len(v.deepstack_visual_indexes))
    return dataclasses.replace(text_spec.dims(cfg.text), vision=vision)


def runtime(cfg: Qwen3VLConfig) -> Runtime:
    return Runtime(attn_backend=cfg.attn_backend, kernels=cfg.kernels, sliding_window=None)


def with_runtime(cfg: Qwen3VLConfig, attn_backend: str, kernels: bool | str) -> Qwen3VLConfig:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def data_needs(cfg: Qwen3VLConfig) -> DataNeeds:
    v = cfg.vision
    return DataNeeds(
        positions="mrope", doc_positions=mrope_positions, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
        merge_size=v.spatial_merge_size, chat_template="chatml", vision_layout=VISION_LAYOUT,
        special_tokens={"image_pad": cfg.image_token_id, "video_pad": cfg.video_token_id,
                        "vision_start": cfg.vision_start_token_id, "vision_end": cfg.vision_end_token_id},
    )


def vision_rope(v, tp: int, encoder_tp: bool) -> tuple[int, int, int]:
    """The ViT attention's RoPE key (q heads, k heads, head dim): its heads per rank with encoder_tp. Qwen3-VL's
    and Qwen2.5-VL's VisionConfig (``num_heads``, ``hidden_size``) and the towers built on them."""
    h = v.num_heads // (tp if encoder_tp else 1)
    return h, h, v.hidden_size // v.num_heads


def kernel_shapes(cfg: Qwen3VLConfig, tp: int = 1, encoder_tp: bool = False) -> KernelShapes:
    """The text model's, plus the ViT's RoPE and its MLP's bias + tanh-GELU (both sharded over tp only with
    encoder_tp)."""
    v = cfg.vision
    gelu = (v.intermediate_size // (tp if encoder_tp else 1),) if v.hidden_act == "gelu_pytorch_tanh" else ()
    return text_spec.kernel_shapes(cfg.text, tp).plus(rope=(vision_rope(v, tp, encoder_tp),), bias_gelu=gelu)


def fused_params(cfg: Qwen3VLConfig) -> dict[str, FusedRows]:
    """The ViT's fused q/k/v projection: head-major rows [H, 3, Dh] (vision.py, VisionAttention)."""
    v = cfg.vision
    dh = v.hidden_size // v.num_heads
    return {"visual.blocks.*.attn.wqkv.weight": FusedRows(v.num_heads, (dh, dh, dh))}
