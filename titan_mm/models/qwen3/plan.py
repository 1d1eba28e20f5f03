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
    }
    if cfg.qk_norm:  # qk-norm weights act on the local heads: replicated, gradients summed over tp (parallel/tp.py)
        tp.update({"layers.*.attn.q_norm": "grad_sum", "layers.*.attn.k_norm": "grad_sum"})
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):  # dense SwiGLU layers
        tp.update({"layers.*.mlp.w1": "colwise", "layers.*.mlp.w3": "colwise", "layers.*.mlp.w2": "rowwise"})
    if cfg.tie_word_embeddings:  # the head reads the embedding weight: whole, unless loss parallel shards both
        del tp["tok_embeddings"]
    # sequence parallel (parallel.sequence_parallel): residual stream split over tp along the sequence
    sp = {
        "tok_embeddings": "seq_scatter_output" if cfg.tie_word_embeddings else "embedding_rowwise_seq",
        "layers.*.attn_norm": "grad_sum",
        "layers.*.ffn_norm": "grad_sum",
        "layers.*.attn": "seq_gather",
        "layers.*.attn.wo": "rowwise_seq",
        "norm": "seq_gather_output",
    }
    if "layers.*.mlp.w2" in tp:
        sp.update({"layers.*.mlp": "seq_gather", "layers.*.mlp.w2": "rowwise_seq"})
    if cfg.is_moe:
        sp["layers.*.moe"] = "seq_gather_local"
    ep = {"layers.*.moe.experts": "experts"} if cfg.is_moe else {}
    return ParallelizePlan(
        fsdp_units=BLOCKS,
        ac_units=BLOCKS,
        compile_units=BLOCKS,
        tp=tp,
        sequence_parallel=sp,
        # tied: the embedding holds the head weight; loss parallel makes it embedding_rowwise(_seq) (parallel/tp.py)
        loss_parallel="tok_embeddings" if cfg.tie_word_embeddings else "output",
        ep=ep,
        cp={"layers.*.attn": "attention"},
        pp_blocks="layers",
        pp_first=("tok_embeddings",),
        pp_last=("norm",) + (() if cfg.tie_word_embeddings else ("output",)),
    )
