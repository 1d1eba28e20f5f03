"""Random parameter init that gives the same weights for every world size and parallel layout.

Sharded parameters (FSDP2 / TP / EP DTensors) drawn with the global RNG get values that depend on the
sharding: DTensor's offset-based RNG only keeps shards from repeating each other, and a CUDA kernel's
philox layout depends on the tensor it fills. Inside :func:`seeded_init`, every draw instead fills the
*full* tensor from its own generator (seeded by the run seed and the draw's index; models draw in a fixed
order) on the parameter's device and keeps the local shard (``distribute_tensor(..., src_data_rank=None)``
slices locally, no communication). One full tensor exists at a time, so the transient cost is the largest
parameter, not the model. Outside the context the helpers are plain ``torch.nn.init`` calls on the global
RNG (``torch.manual_seed`` + ``init_weights()`` as before).

    with seeded_init(cfg.training.seed):
        model.init_weights()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["seeded_init", "normal_", "trunc_normal_", "uniform_"]

_state: dict | None = None  # {"seed": int, "draws": int} while a seeded_init context is open


@contextlib.contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Draws inside use per-draw generators seeded from ``seed`` on full tensors (see the module doc)."""
    global _state
    prev, _state = _state, {"seed": int(seed), "draws": 0}
    try:
        yield
    finally:
        _state = prev


def _draw(t: torch.Tensor, fill: Callable[[torch.Tensor, torch.Generator | None], None]) -> torch.Tensor:
    if _state is None:
        fill(t, None)
        return t
    k = _state["draws"]
    _state["draws"] += 1
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.device.type == "meta":  # counted, not filled (a pipeline rank draws the other stages' weights so)
        return t
    g = torch.Generator(device=local.device).manual_seed((_state["seed"] * 1_000_003 + k) % (2**63))
    full = torch.empty(t.shape, dtype=t.dtype, device=local.device)
    fill(full, g)
    with torch.no_grad():
        if isinstance(t, DTensor):
            t.copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None))
        else:
            t.copy_(full)
    return t


def normal_(t: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    return _draw(t, lambda x, g: nn.init.normal_(x, mean=mean, std=std, generator=g))


def trunc_normal_(t: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> torch.Tensor:
    return _draw(t, lambda x, g: nn.init.trunc_normal_(x, mean=mean, std=std, a=a, b=b, generator=g))


def uniform_(t: torch.Tensor, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    return _draw(t, lambda x, g: nn.init.uniform_(x, a=a, b=b, generator=g))
