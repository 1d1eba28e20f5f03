"""Qwen3-VL parallelize plan (data; applied by titan_mm.parallel.apply).

The LLM part is the Qwen3 plan with every pattern under ``language_model.``; the vision tower adds its
ViT blocks as FSDP / AC / compile units and is replicated over TP (it is small next to the LLM: 0.4-0.6B)
and never split over experts or context: under CP every cp rank runs it on all of the micro-batch's images
and keeps the visual embeddings of its own sequence shard (titan_mm.parallel.cp.prepare_cp_batch,
Qwen3VLModel.embed). The mergers and embeddings stay in the root FSDP unit.
"""

from __future__ import annotations

from titan_mm.models.qwen3 import plan as qwen3_plan
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig
from titan_mm.parallel.plan import ParallelizePlan

VISION_BLOCKS = ("visual.blocks.?", "visual.blocks.??")


def plan(cfg: Qwen3VLConfig) -> ParallelizePlan:
    p = qwen3_plan.plan(cfg.text)
    pre = lambda pats: tuple("language_model." + x for x in pats)  # noqa: E731
    return ParallelizePlan(
        fsdp_units=VISION_BLOCKS + pre(p.fsdp_units),
        ac_units=VISION_BLOCKS + pre(p.ac_units),
        compile_units=VISION_BLOCKS + pre(p.compile_units),
        tp={"language_model." + k: v for k, v in p.tp.items()},
        ep={"language_model." + k: v for k, v in p.ep.items()},
        cp={"language_model." + k: v for k, v in p.cp.items()},
    )
