"""Model FLOPs utilization: achieved training FLOP/s over the device's peak dense bf16 FLOP/s.

The FLOPs of a step come from the registry (``spec.flops(cfg, doc_lens)``: 6 x active params per token
plus attention by real document lengths), so packing and MoE sparsity are counted correctly.
"""

from __future__ import annotations

import torch

# Peak dense bf16 tensor-core TFLOP/s (datasheet, no sparsity) by device-name substring.
_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "4090": 165.0,
}


def peak_tflops(device: torch.device, override: float = 0.0) -> float:
    """Peak TFLOP/s of one device; ``override`` > 0 wins. 0.0 when unknown (CPU): MFU is then reported as 0."""
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    for key, v in _PEAK_TFLOPS.items():
        if key in name:
            return v
    return 0.0


def doc_lens_from_batch(batch: dict) -> list[int]:
    """Document lengths of a micro-batch from its cu_seqlens (CPU tensor) - padding segments included."""
    cu = batch["cu_seqlens"].tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]


ENCODER_KEYS = ("image_grid_thw", "video_grid_thw", "audio_feature_lengths", "vit_lens")
"""The keys that make a FLOP counter count an encoder (a ViT, the Omni audio encoder)."""


def encoder_inputs(batch: dict, encoders: bool = True) -> dict:
    """The batch's keys that let a family's FLOP counter count its encoders and its head: the vision grids (ViT),
    the audio clips' frame counts (the Omni audio encoder), packed ViT lengths and per-token kinds (text / ViT /
    latent), the attention kind "segments"' splits (their bidirectional pairs) and the labels (a family whose head
    runs on the labeled tokens only counts those). A counter takes the keys it counts and ignores the rest.
    ``encoders=False``: all but ENCODER_KEYS, so that the count is the decoder's alone ("MFU (LLM only)")."""
    keys = (*ENCODER_KEYS, "token_kind", "seg_ids", "seg_kinds", "labels")
    return {k: batch[k] for k in keys if k in batch and (encoders or k not in ENCODER_KEYS)}


def mfu(flops: float, seconds: float, peak_tflops_per_device: float) -> float:
    """Fraction (0..1) of peak for ``flops`` done by one device in ``seconds``."""
    if seconds <= 0 or peak_tflops_per_device <= 0:
        return 0.0
    return flops / seconds / (peak_tflops_per_device * 1e12)
