"""Rowwise float8 (e4m3) quantization: one fp32 scale per row, amax x (1 / 448), so that each row fills e4m3's range.
The reference of titan_mm.kernels.fp8_rows, and how serving's fp8 linears quantize their weights (per output row)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(FP8).max
MIN_SCALE = 1e-12  # an all-zero row: its scale stays finite, its values 0
INV_FP8_MAX = 1.0 / FP8_MAX
"""The scale is amax times this, one fp32 multiply rounded alike in torch and Triton (torch divides by a Python
scalar through its reciprocal on CUDA and truly on the CPU, so ``amax / 448`` would differ between them)."""


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): x ~= e4m3 * scale."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
