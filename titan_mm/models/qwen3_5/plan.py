"""Qwen3.5 / Qwen3.5-MoE parallelize plan (data; applied by titan_mm.parallel.apply).

FSDP / AC / compile units: every decoder block (either kind) and every ViT block; the embeddings, the merger and the
head stay in the root unit.

Tensor parallel, by heads, for both block kinds (the rows of every projection are laid out head by head, model.py):
  * gated attention: wq (query + gate rows per head), wk, wv colwise, wo rowwise, q/k norms grad_sum (as Qwen3);
  * Gated DeltaNet: in_proj_qkv (per key head: q, k and its value heads' v; its conv weight rides along as a
    parameter of the same Linear, split with its rows), in_proj_z, in_proj_b, in_proj_a (with dt_bias and A_log)
    colwise: each rank runs the rule on its key heads and their value heads; out_proj rowwise; the gated norm's
    weight (per value-head channel) grad_sum;
  * dense MLP and the MoE's shared expert: w1 / w3 colwise, w2 rowwise; routed experts and the router stay
    replicated over tp (EP shards the experts: ``moe.experts``);
  * sequence parallel: as Qwen3-VL (``embed_out`` cuts the embeddings; the norms grad_sum; attention, linear
    attention and the MLP gather the sequence, their output projections reduce-scatter; the MoE runs on the
    gathered sequence on every tp rank); loss parallel as Qwen3.
  * the vision tower: replicated over tp, or with ``parallel.encoder_tp`` split as Qwen3-VL's (no DeepStack).
Context parallel: none. The Gated DeltaNet recurrence would need its state passed between cp ranks, which is not
implemented; the empty ``cp`` makes setup refuse parallel.cp > 1 before building anything.
"""

from __future__ import annotations

from titan_mm.models.qwen3.plan import BLOCKS
from titan_mm.models.qwen3_5.config import Qwen3_5Config
from titan_mm.models.qwen3_vl.plan import VISION_BLOCKS
from titan_mm.parallel.plan import ParallelizePlan

LM = "language_model."


def plan(cfg: Qwen3_5Config) -> ParallelizePlan:
    t = cfg.text
    blocks = tuple(LM + b for b in BLOCKS)
    tp: dict[str, str] = {}
    sp = {"layers.*.attn_norm": "grad_sum", "layers.*.ffn_norm": "grad_sum", "norm": "seq_gather_output"}
    if t.n_linear < t.num_hidden_layers:  # gated full attention
        tp.update({"layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise", "layers.*.attn.wv": "colwise",
                   "layers.*.attn.wo": "rowwise", "layers.*.attn.q_norm": "grad_sum",
                   "layers.*.attn.k_norm": "grad_sum"})
        sp.update({"layers.*.attn": "seq_gather", "layers.*.attn.wo": "rowwise_seq"})
    if t.n_linear:  # Gated DeltaNet
        tp.update({f"layers.*.linear_attn.{p}": "colwise" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                     "in_proj_a")})
        tp.update({"layers.*.linear_attn.out_proj": "rowwise", "layers.*.linear_attn.norm": "grad_sum"})
        sp.update({"layers.*.linear_attn": "seq_gather", "layers.*.linear_attn.out_proj": "rowwise_seq"})
    mlp = "moe.shared_expert" if t.is_moe else "mlp"
    tp.update({f"layers.*.{mlp}.w1": "colwise", f"layers.*.{mlp}.w3": "colwise", f"layers.*.{mlp}.w2": "rowwise"})
    if t.is_moe:
        sp["layers.*.moe"] = "seq_gather_local"
    else:
        sp.update({"layers.*.mlp": "seq_gather", "layers.*.mlp.w2": "rowwise_seq"})
    if not t.tie_word_embeddings:
        tp["tok_embeddings"] = "embedding_rowwise"
    sp = {LM + k: v for k, v in sp.items()}
    sp["embed_out"] = "seq_scatter_output"
    encoder_tp = {  # the Qwen3-VL ViT's split (titan_mm/models/qwen3_vl/plan.py), without DeepStack mergers
        "visual.blocks.*.attn.wqkv": "colwise", "visual.blocks.*.attn.proj": "rowwise",
        "visual.blocks.*.mlp.linear_fc1": "colwise", "visual.blocks.*.mlp.linear_fc2": "rowwise",
        "visual.merger.linear_fc1": "colwise", "visual.merger.linear_fc2": "rowwise",
    }
    return ParallelizePlan(
        fsdp_units=VISION_BLOCKS + blocks,
        ac_units=VISION_BLOCKS + blocks,
        compile_units=VISION_BLOCKS + blocks,
        tp={LM + k: v for k, v in tp.items()},
        sequence_parallel=sp,
        encoder_tp=encoder_tp,
        loss_parallel=LM + ("tok_embeddings" if t.tie_word_embeddings else "output"),
        ep={LM + "layers.*.moe.experts": "experts"} if t.is_moe else {},
        cp={},
        pp_blocks=LM + "layers",
        pp_first=("visual", "embed_out", LM + "tok_embeddings"),
        pp_last=(LM + "norm",) + (() if t.tie_word_embeddings else (LM + "output",)),
    )
