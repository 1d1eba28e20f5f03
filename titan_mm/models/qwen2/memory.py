"""Qwen2 / Qwen2.5 activation terms for the memory estimator: Qwen3's (titan_mm/models/qwen3/memory.py) on
the derived decoder config (qk_norm=False: no qk-norm inputs or rstd counted). The q/k/v biases save nothing
extra for the backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_mm.models.qwen2.config import Qwen2Config, as_decoder
from titan_mm.models.qwen3 import memory as qwen3_memory
from titan_mm.registry import MemoryTerms

if TYPE_CHECKING:
    from titan_mm.parallel.memory import Topology


def memory_terms(cfg: Qwen2Config, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    """The estimator's per-token terms (``kernels``: None = the config's)."""
    return qwen3_memory.memory_terms(as_decoder(cfg), topo, act_bytes, kernels=kernels, compile=compile,
                                     float8=float8)
