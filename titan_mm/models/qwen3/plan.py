"""Qwen3 / Qwen3-MoE parallelize plan (data; applied by titan_mm.parallel.apply).

Patterns are fnmatch patterns over module FQNs; ``*`` also matches dots, so block patterns are written
with ``?`` per digit ("layers.?", "layers.??", "layers.???") to match the blocks and not their children.
"""

from __future__ import annotations

from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.parallel.plan import ParallelizePlan

BLOCKS = ("layers.?", "layers.??", "layers.???")


def plan(cfg: Qwen3Config) -> ParallelizePlan:
    tp = {
        "tok_embeddings": "embedding_rowwise",
        "layers.*.attn.wq": "colwise",
        "layers.*.attn.wk": "colwise",
        "layers.*.attn.wv": "colwise",
        "layers.*.attn.wo": "rowwise",
        "layers.*.mlp.w1": "colwise",
        "layers.*.mlp.w3": "colwise",
        "layers.*.mlp.w2": "rowwise",
        "output": "colwise",
    }
    ep = {"layers.*.moe.experts": "experts"} if cfg.is_moe else {}
    return ParallelizePlan(
        fsdp_units=BLOCKS,
        ac_units=BLOCKS,
        compile_units=BLOCKS,
        tp=tp,
        ep=ep,
        cp={"layers.*.attn": "attention"},
    )
