"""Small helpers shared by the kernel files."""

from __future__ import annotations

import torch


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x as [rows, last_dim] with unit stride on the last dim (copies only when it must)."""
    if x.dim() == 0:
        x = x.reshape(1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs exercise the multi-program reduction paths


import os as _os

# Tests set TITAN_KERNELS_POISON=1: every output buffer starts NaN-filled, so an element a kernel forgets
# to write shows up as NaN instead of stale memory that happens to look right.
POISON = _os.environ.get("TITAN_KERNELS_POISON", "0") == "1"


def new_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)
