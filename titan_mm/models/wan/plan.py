"""Wan parallelize plan (data; applied by titan_mm.parallel.apply): FSDP, AC and compile per block, tensor and
context parallel entries.

Tensor parallel: in every block the self- and cross-attention's ``to_q`` / ``to_k`` / ``to_v`` are colwise (H/tp
local heads; the cross-attention's k / v read the replicated text states) and ``to_out.0`` rowwise, the FFN's
``net.0.proj`` colwise and ``net.2`` rowwise. The q / k RMSNorms run over all heads' features: style
``colwise_norm`` shards their weights with the heads and all-reduces the sum of squares (a [*, 1] tensor).
The condition embedder's time and text MLPs are colwise then rowwise; ``time_proj`` (the 6 x D modulation, needed
whole by every block on every rank) and the patch embedding, the head and ``proj_out`` stay replicated: the
residual stream is replicated over tp, so the blocks' modulation tables and the cross-attention norm get identical
gradients on every rank.

Context parallel: the video tokens are cut over cp (titan_mm.parallel.cp.prepare_cp_batch cuts the BatchSchema's
sequence keys and flow matching's, ``grid_fhw`` with them, so each rank's RoPE angles are its own patches'); the
self-attention (``attn1``) attends across the shards (Ulysses, ring or all-gather); the cross-attention reads the
text states, which every cp rank holds whole.

Pipeline parallel: stages cut ``blocks``; stage 0 runs the patch embedding and the condition embedder, whose text
states, modulation and time embedding travel with the stream to every stage (``Stream.cond``); the last stage runs
the modulated output norm (``norm_out``) and ``proj_out``.
"""

from __future__ import annotations

from titan_mm.models.wan.config import WanConfig
from titan_mm.parallel.plan import ParallelizePlan

BLOCKS = ("blocks.?", "blocks.??", "blocks.???")


def plan(cfg: WanConfig) -> ParallelizePlan:
    tp = {}
    for attn in ("attn1", "attn2"):
        tp.update({f"blocks.*.{attn}.to_{x}": "colwise" for x in "qkv"})
        tp[f"blocks.*.{attn}.to_out.0"] = "rowwise"
        if cfg.qk_norm:
            tp.update({f"blocks.*.{attn}.norm_{x}": "colwise_norm" for x in "qk"})
    tp.update({"blocks.*.ffn.net.0.proj": "colwise", "blocks.*.ffn.net.2": "rowwise"})
    for mlp in ("time_embedder", "text_embedder"):
        tp.update({f"condition_embedder.{mlp}.linear_1": "colwise", f"condition_embedder.{mlp}.linear_2": "rowwise"})
    return ParallelizePlan(fsdp_units=BLOCKS, ac_units=BLOCKS, compile_units=BLOCKS, tp=tp,
                           cp={"blocks.*.attn1": "attention"}, pp_blocks="blocks",
                           pp_first=("patch_embedding", "condition_embedder"), pp_last=("norm_out", "proj_out"))
