"""Qwen2 / Qwen2.5 parallelize plan: the Qwen3 plan (titan_mm/models/qwen3/plan.py) of the derived decoder
config, which has no qk-norm entries (qk_norm=False). The q / k / v projections stay "colwise": torch's
ColwiseParallel shards their biases with the weights (Shard(0)), so each tp rank adds the bias of its own
heads; o_proj has no bias."""

from __future__ import annotations

from titan_mm.models.qwen2.config import Qwen2Config, as_decoder
from titan_mm.models.qwen3 import plan as qwen3_plan
from titan_mm.parallel.plan import ParallelizePlan


def plan(cfg: Qwen2Config) -> ParallelizePlan:
    return qwen3_plan.plan(as_decoder(cfg))
