"""BAGEL parallelize plan (data; applied by titan_mm.parallel.apply): FSDP, AC and compile per decoder layer (both
experts in one unit: every layer runs both); FSDP and AC per ViT layer and the whole ViT compiled as one graph
(``VIT``); tensor parallel colwise / rowwise inside each expert (q/k/v colwise, o rowwise, the SwiGLU's w1 / w3
colwise and w2 rowwise; the per-head q/k norms replicated with summed gradients); the MLP-only split's shared
attention as one expert's, its two MLPs as theirs. Pipeline stages cut ``layers``: stage 0 runs the token embedding,
the ViT and its connector and the latent embedding (vae2llm, the time MLP); the last stage the experts' final norms,
the LM head and llm2vae; every stage routes by the host-built permutation (``spec.ROUTING_KEYS``; the pipeline hands
them to ``trunk`` and ``head``). Sequence and context parallel entries are a later slice (docs/bagel.md)."""

from __future__ import annotations

from titan_mm.models.bagel.config import BagelConfig
from titan_mm.parallel.plan import ParallelizePlan

LAYERS = ("layers.?", "layers.??", "layers.???")
VIT_LAYERS = ("vit.blocks.?", "vit.blocks.??")
# One compiled graph for the ViT: compiled per block, its 26 blocks a micro-batch each paid dynamo's guards and the
# wrappers' host time, which blocks over a few 1,024-patch images do not hide (the H100 profile of bagel_7b_mot_4l_x5:
# the largest idle share, under those calls). FSDP hooks of its blocks (several ranks) split the graph at the blocks.
VIT = ("vit",)
EXPERT_TP = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise", "q_norm": "grad_sum",
             "k_norm": "grad_sum", "mlp.w1": "colwise", "mlp.w3": "colwise", "mlp.w2": "rowwise"}


def plan(cfg: BagelConfig) -> ParallelizePlan:
    if cfg.llm_config.layer_module == "Qwen2MoEDecoderLayer":  # the MLP-only split: one attention, two MLPs
        tp = {f"layers.*.shared.{name}": style for name, style in EXPERT_TP.items() if not name.startswith("mlp.")}
        tp |= {f"layers.*.{e}.{name[4:]}": style for e in ("und", "gen") for name, style in EXPERT_TP.items()
               if name.startswith("mlp.")}
    else:
        tp = {f"layers.*.{e}.{name}": style for e in ("und", "gen") for name, style in EXPERT_TP.items()}
    units = LAYERS + VIT_LAYERS
    head = ("norm", "norm_gen", "llm2vae") + (() if cfg.llm_config.tie_word_embeddings else ("output",))
    return ParallelizePlan(fsdp_units=units, ac_units=units, compile_units=LAYERS + VIT, tp=tp, pp_blocks="layers",
                           pp_first=("tok_embeddings", "vit", "connector", "time_embedder", "vae2llm"), pp_last=head)
