"""Wan parallelize plan (data; applied by titan_mm.parallel.apply): FSDP, AC and compile per block. Tensor,
context and pipeline parallel entries are a later slice (docs/wan.md)."""

from __future__ import annotations

from titan_mm.models.wan.config import WanConfig
from titan_mm.parallel.plan import ParallelizePlan

BLOCKS = ("blocks.?", "blocks.??", "blocks.???")


def plan(cfg: WanConfig) -> ParallelizePlan:
    return ParallelizePlan(fsdp_units=BLOCKS, ac_units=BLOCKS, compile_units=BLOCKS)
