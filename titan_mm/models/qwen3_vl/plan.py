"""Qwen3-VL parallelize plan (data; applied by titan_mm.parallel.apply).

The LLM part is the Qwen3 plan with every pattern under ``language_model.``; the vision tower adds its
ViT blocks as FSDP / AC / compile units. The mergers and embeddings stay in the root FSDP unit.

Tensor parallel:
  * vision tower + mergers: replicated over tp (default; every tp rank runs them on all images), or, with
    ``parallel.encoder_tp``, sharded: ViT ``wqkv`` (head-major rows) / ``mlp.linear_fc1`` and the mergers'
    ``linear_fc1`` colwise, ``proj`` / ``linear_fc2`` rowwise (all-reduced: the ViT's token stream stays
    replicated, images are bidirectional attention documents and are not sequence-split).
  * sequence parallel: the token embedding keeps its tp style (vocab-sharded and all-reduced, or replicated
    when tied), so that the visual tokens and DeepStack features are placed on the full sequence as without
    tp; then ``embed_out`` (Qwen3VLModel.embed_out) cuts the embeddings and every DeepStack addition to this
    rank's sequence shard, and the Qwen3 SP entries run the blocks on [B, S/tp, D] (the DeepStack additions
    after the first blocks are local too); the final norm gathers the sequence for the loss.
  * loss parallel: as Qwen3 (the untied ``output`` head, or the tied token embedding).
Context parallel: every cp rank runs the vision tower on all of the micro-batch's images and keeps the
visual embeddings of its own sequence shard (titan_mm.parallel.cp.prepare_cp_batch, Qwen3VLModel.embed);
with tp on top, ``embed_out`` then cuts that cp shard over tp.
"""

from __future__ import annotations

from titan_mm.models.qwen3 import plan as qwen3_plan
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig
from titan_mm.parallel.plan import ParallelizePlan

VISION_BLOCKS = ("visual.blocks.?", "visual.blocks.??")
LM = "language_model."


def plan(cfg: Qwen3VLConfig) -> ParallelizePlan:
    p = qwen3_plan.plan(cfg.text)
    pre = lambda pats: tuple(LM + x for x in pats)  # noqa: E731
    sp = {LM + k: v for k, v in p.sequence_parallel.items() if k != "tok_embeddings"}
    sp["embed_out"] = "seq_scatter_output"
    encoder_tp = {
        "visual.blocks.*.attn.wqkv": "colwise",
        "visual.blocks.*.attn.proj": "rowwise",
        "visual.blocks.*.mlp.linear_fc1": "colwise",
        "visual.blocks.*.mlp.linear_fc2": "rowwise",
        "visual.merger.linear_fc1": "colwise",
        "visual.merger.linear_fc2": "rowwise",
    }
    if cfg.vision.deepstack_visual_indexes:
        encoder_tp.update({"visual.deepstack_merger_list.*.linear_fc1": "colwise",
                           "visual.deepstack_merger_list.*.linear_fc2": "rowwise"})
    return ParallelizePlan(
        fsdp_units=VISION_BLOCKS + pre(p.fsdp_units),
        ac_units=VISION_BLOCKS + pre(p.ac_units),
        compile_units=VISION_BLOCKS + pre(p.compile_units),
        tp={LM + k: v for k, v in p.tp.items()},
        sequence_parallel=sp,
        encoder_tp=encoder_tp,
        loss_parallel=LM + p.loss_parallel if p.loss_parallel else None,
        ep={LM + k: v for k, v in p.ep.items()},
        cp={LM + k: v for k, v in p.cp.items()},
        pp_blocks=LM + p.pp_blocks,
        pp_first=("visual", "embed_out") + pre(p.pp_first),
        pp_last=pre(p.pp_last),
    )
