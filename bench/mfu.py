"""Training throughput, MFU and peak memory: titan_mm next to its peers, measured in one run on one GPU.

Every (case, stack) pair runs in a fresh subprocess (its own CUDA context, compile caches and memory peak),
with the same synthetic data (random tokens, one document per row, every position a label), the same
optimizer (fused AdamW, fp32 master weights), bf16 params / fp32 gradients (the peers: FSDP2 on a 1-GPU mesh), and
the same timing: ``--warmup`` steps (compilation) then ``--steps`` timed steps run back to back, each step's time
the span between CUDA events recorded after each (no sync between steps: the peers read their loss once, after the
timed steps, as their trainers read it at log steps; titan's step reads its statistics every step). Rows timed so
carry ``timing: "events"``; rows without it synchronized after each step.
MFU is computed for every stack from titan_mm's FLOP counter (docs/flops.md) against 989 TFLOP/s (the H100 SXM's
and the H200's dense bf16 datasheet peak). The run first measures this machine's ceilings (bench/ceilings.py:
bf16 matmul, copy bandwidth; in the JSON's ``ceilings``), and every row names its device and its TFLOP/s as a
fraction of the measured matmul (``frac_of_matmul``). A case's ``over_80gb`` names the stacks whose peak on the
H200 was above what an H100 holds; on a smaller GPU those rows are recorded as not fitting instead of run.

Stacks:
  titan            titan_mm's trainer path: titan_mm.train.setup.setup(cfg) (meshes, registry model -> parallelize
                   -> materialize, optimizer, schedule, step context) -> train_step, on a JobConfig made from the
                   case (titan_argv), compile per block, Triton kernels on (the trainer's kernels.ops: all)
  titan_f8         the same + torchao float8 linears (tensorwise scales)
  titan_f8_pre     titan_f8 + float8.precompute_scale (one batched scale computation after each optimizer step)
  titan_f8_experts titan + float8.moe_experts (the MoE experts' grouped GEMMs in float8, torchao rowwise; the
                   linears stay bf16). MoE cases only. The trainer refuses float8.moe_experts (0.70x bf16 so far);
                   these two stacks set TITAN_MEASURE_FLOAT8_EXPERTS=1 in their worker to measure it anyway
  titan_opt        titan with parallel.one_rank_mixed_precision = optimizer: the bf16 copies kept between steps,
                   the large gradients kept in bf16, and AdamW's step (titan_mm.train.cast_adamw) writes both
  titan_opt_f8     titan_opt + float8.moe_experts
  titan_opt_f8_tensorwise, titan_opt_f8_rowwise, titan_opt_f8_rowwise_with_gw_hp
                   titan_opt + float8 linears (float8.enable) with that float8.recipe: dense float8 without the
                   cast path's per-step widening copies
  titan_opt_f8_rowwise_titan
                   titan_opt_f8_rowwise on titan_mm's casts (float8.rowwise_casts = titan: titan_mm.quant.rowwise)
  titan_fsdp       titan through FSDP2 on the one-GPU mesh (parallel.one_rank_mixed_precision = fsdp). The other
                   titan stacks run the one-rank cast path (titan_mm.parallel.apply) since 2026-12-03; a row says
                   which in ``mixed_precision`` (rows without it ran through FSDP2)
  titan_eager      no compile, kernels on
  titan_nokernels  compile, pure-PyTorch ops (the reference path)
  titan_plain      titan_mm's model and train_step, but compile + fully_shard applied by hand to the blocks
                   and the root (setup(cfg, model_fn=...): no plan, no parallelize): the plan path must cost
                   nothing against it
  torchtitan       torchtitan 0.2.2's Qwen3 with per-block compile, full-logit CE
  hf_liger         HF transformers (sdpa) + Liger 0.8.5 kernels
  hf               HF transformers (sdpa)
  diffusers        Wan cases: diffusers' WanTransformer3DModel, per-block compile, FSDP2 per block (bf16 params,
                   fp32 reduce), AdamW, the titan stack's flow-matching loss on the same clips and noise (issue 48's
                   peer; bench/peers.py build_diffusers_wan); ``--ac full[:N]``: torch's checkpoint_wrapper on
                   the first N blocks (every block without N), as titan's full AC
  bagel_ref        BAGEL cases: BAGEL's step from its reference components (its repository is not installable):
                   transformers' Qwen3DecoderLayer pairs routed per token (MoT), flex attention under BAGEL's
                   create_sparse_mask (sdpa on the CPU), SigLIP layers over the packed images, per-layer compile,
                   FSDP2, titan's initial weights, the same CE + velocity MSE (bench/bagel_peer.py)
  bagel_ref_eager  the same step as BAGEL's repository trains it: no layer compile (its pretrain_unified_navit.py
                   wraps FSDP around eager layers; flex attention is compiled inside transformers' flex path)
Cases set the model shape, batch and sequence; the VL ones (``vl``) build image+text rows through their family's
synthetic module (``synthetic``; the Omni thinkers': image + 10-30 s audio clip + text groups, vl_batch), and their
MFU counts the ViT and the audio encoder ("MFU (LLM only)": the decoder alone); ``rows`` cases (BAGEL) take a
family's own packed rows (its module's bench_rows). ``--ac`` switches activation checkpointing for titan and ``--reshard`` its ``parallel.fsdp_reshard_after_forward`` (titan_fsdp: the one stack
that runs FSDP2 on one GPU; a row run with ``never`` records it). With TITAN_BENCH_SKIP_GUARD_EVAL=1 in the environment the timed steps run under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (an experiment: the row records it; the trainer never
does this).

  python bench/mfu.py --cases qwen3_1.7b --stacks titan,titan_f8,torchtitan,hf_liger --out bench/results/mfu.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devices import device_label, device_of  # noqa: E402

PEAK_TFLOPS = 989.0

# name -> registry model, flavor, overrides of the flavor's config (JSON-able: --model.overrides; a dict reaches
# into a nested config: Qwen3-VL's layer cuts apply to its text model), batch, seq; vl: image+text rows (vl_batch);
# over_80gb: {stack: peak GiB on the H200} of the stacks that do not fit an H100 (79.2 GiB); the other stacks fit
# both (qwen3_4b's titan peaked at 77.7 GiB: tight). Batches stay as recorded, to compare with the earlier rows.
CASES: dict[str, dict] = {
    "debug": dict(model="qwen3", flavor="debug", overrides={}, batch=2, seq=64),  # CPU smoke tests (--cpu)
    "debug_vl": dict(model="qwen3_vl", flavor="debug", overrides={}, batch=1, seq=1024, vl=True),
    "debug_qwen3_5": dict(model="qwen3_5", flavor="debug", overrides={}, batch=1, seq=1024, vl=True),
    "qwen3_1.7b": dict(model="qwen3", flavor="1.7B", overrides={}, batch=4, seq=4096, over_80gb={"torchtitan": 83.2}),
    "qwen3_4b": dict(model="qwen3", flavor="4B", overrides={}, batch=2, seq=4096),
    "qwen3_8b_12l": dict(model="qwen3", flavor="8B", overrides={"num_hidden_layers": 12}, batch=2, seq=4096),
    "qwen3_30b_a3b_4l": dict(model="qwen3_moe", flavor="30B-A3B", overrides={"num_hidden_layers": 4}, batch=4,
                             seq=4096, over_80gb={"torchtitan": 80.1}),
    # the same at a batch the peer may fit on an 80 GB H100 (torchtitan peaked at 80.1 GiB at batch 4)
    "qwen3_30b_a3b_4l_b3": dict(model="qwen3_moe", flavor="30B-A3B", overrides={"num_hidden_layers": 4}, batch=3,
                                seq=4096),
    "qwen3_vl_2b": dict(model="qwen3_vl", flavor="2B", overrides={}, batch=1, seq=8192, vl=True),
    "qwen3_vl_8b_12l": dict(model="qwen3_vl", flavor="8B", overrides={"text": {"num_hidden_layers": 12}}, batch=1,
                            seq=8192, vl=True, over_80gb={"titan": 79.6, "titan_opt": 79.6}),
    # the same cut to 8 decoder layers, to fit an 80 GB H100 (the 12-layer case peaked at 79.6 GiB)
    "qwen3_vl_8b_8l": dict(model="qwen3_vl", flavor="8B", overrides={"text": {"num_hidden_layers": 8}}, batch=1,
                           seq=8192, vl=True),
    "qwen3_vl_30b_a3b_4l": dict(model="qwen3_vl_moe", flavor="30B-A3B", overrides={"text": {"num_hidden_layers": 4}},
                                batch=1, seq=8192, vl=True),
    # Qwen3.5: both block kinds (3 Gated DeltaNet : 1 gated attention) and the ViT, cut to fit one H200
    "qwen3_5_9b_8l": dict(model="qwen3_5", flavor="9B", overrides={"text": {
        "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"]}}, batch=1, seq=8192, vl=True, over_80gb={"titan": 83.9, "hf": 107.9}),
    "qwen3_5_35b_a3b_4l": dict(model="qwen3_5_moe", flavor="35B-A3B", overrides={"text": {
        "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}, batch=1, seq=8192,
        vl=True),
}
# the module whose make_sample / pack build the VL cases' synthetic image+text samples (titan_mm's data contract);
# a case's ``synthetic`` entry names another (the Omni thinkers': image + audio + text)
VL_SYNTHETIC = "titan_mm.models.qwen3_vl.synthetic"
OMNI_SYNTHETIC = "titan_mm.models.qwen2_5_omni.synthetic"
# what each group of a VL row holds (vl_batch): an image of h x w patches, an audio clip of lo..hi seconds (random
# per clip, 100 mel frames a second; only with audio_s), then text tokens
VL_MEDIA = dict(image=(32, 32), audio_s=None, text=512)
OMNI_MEDIA = dict(image=(32, 32), audio_s=(10, 30), text=512)
# Omni thinkers, measured against transformers on the same packed image + audio + text batches (no Liger: 0.8.5 has
# no Omni patch, bench/peers.py): full ViT and audio tower, the decoder cut to 4 layers
CASES.update({
    "debug_qwen2_5_omni": dict(model="qwen2_5_omni", flavor="debug", overrides={}, batch=1, seq=1024, vl=True,
                               synthetic=OMNI_SYNTHETIC, media=dict(image=(16, 16), audio_s=(10, 12), text=128)),
    "debug_qwen3_omni_moe": dict(model="qwen3_omni_moe", flavor="debug", overrides={}, batch=1, seq=1024, vl=True,
                                 synthetic=OMNI_SYNTHETIC, media=dict(image=(16, 16), audio_s=(10, 12), text=128)),
    "qwen2_5_omni_7b_4l": dict(model="qwen2_5_omni", flavor="7B", overrides={"text": {"num_hidden_layers": 4}},
                               batch=1, seq=8192, vl=True, synthetic=OMNI_SYNTHETIC, media=OMNI_MEDIA,
                               over_80gb={"hf": 83.2}),
    "qwen3_omni_30b_a3b_4l": dict(model="qwen3_omni_moe", flavor="30B-A3B",
                                  overrides={"text": {"num_hidden_layers": 4}}, batch=1, seq=8192, vl=True,
                                  synthetic=OMNI_SYNTHETIC, media=OMNI_MEDIA, over_80gb={"hf": 84.2}),
})


# Wan video DiTs: one clip a row of ``clip`` = latent frames, (height, width) in latent pixels and UMT5 text states
# (clip_batch); the FLOPs are flow matching's (the bidirectional mask's pairs, docs/flops.md). 33 frames at 480p
# (832 x 480) are 9 latent frames of 60 x 104 (Wan2.1's VAE: 4x in time, 8x in space): 14,040 patches of 1x2x2.
CASES.update({
    "debug_wan": dict(model="wan", flavor="debug", overrides={}, batch=1, seq=48, clip=dict(frames=3, hw=(8, 8),
                                                                                          text=512)),
    "wan2.1_1.3b": dict(model="wan", flavor="1.3B", overrides={}, batch=1, seq=14040,
                        clip=dict(frames=9, hw=(60, 104), text=512)),
})
# 81 frames at 480p: 21 latent frames, 32,760 patches. Wan2.1-T2V-14B's transformer (5120 wide: 40 heads x 128, FFN
# 13824, 40 blocks) cut to 4 blocks: by models/wan/memory.py's terms a 14B block holds 5.2 GiB of bf16 weights, fp32
# master, grads and AdamW state plus 3.7 (33 frames) / 8.7 GiB (81 frames) of saved activations, so 4 blocks fit an
# H100 at both lengths. The whole 1.3B at 81 frames needs about 30 x 3.6 = 108 GiB without AC: an H200, or
# ``--ac selective`` (about 65 GiB) on an H100.
WAN_480P_81F = dict(frames=21, hw=(60, 104), text=512)
WAN2_1_14B_4L = {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 4}
CASES.update({
    "wan2.1_1.3b_81f": dict(model="wan", flavor="1.3B", overrides={}, batch=1, seq=32760, clip=WAN_480P_81F),
    "wan2.1_14b_4l": dict(model="wan", flavor="1.3B", overrides=WAN2_1_14B_4L, batch=1, seq=14040,
                          clip=dict(frames=9, hw=(60, 104), text=512)),
    "wan2.1_14b_4l_81f": dict(model="wan", flavor="1.3B", overrides=WAN2_1_14B_4L, batch=1, seq=32760,
                              clip=WAN_480P_81F),
})

# BAGEL (docs/bagel.md): packed rows of understanding samples (prompt, a ViT image of image = (h, w) patches, an
# answer) and generation samples (prompt, a noised VAE image of latent = (h, w) latent patches), the rest text
# (``rows``: the family module whose bench_rows builds them); the MFU counts both experts, the ViT and the segment
# mask's pairs. 7B-MoT's widths, the decoder cut to 4 MoT layers; 32 x 32 ViT patches (448 px at /14) and 32 x 32
# latent patches (512 px: FLUX's 8x, patch 2).
CASES.update({
    "debug_bagel": dict(model="bagel", flavor="debug", overrides={}, batch=1, seq=256,
                        rows="titan_mm.models.bagel.synthetic", media=dict(image=(4, 4), latent=(4, 4), prompt=8,
                                                                           answer=16)),
    "bagel_7b_mot_4l": dict(model="bagel", flavor="7B-MoT", overrides={"llm_config": {"num_hidden_layers": 4}}, batch=1,
                            seq=8192, rows="titan_mm.models.bagel.synthetic",
                            media=dict(image=(32, 32), latent=(32, 32), prompt=64, answer=256)),
})
# BAGEL's recipe packs ~44K tokens a GPU a step (expected_num_tokens 44032, max_num_tokens 46080 in its training
# scripts); 5 micro-batches of the 8,192-token rows (40,960 tokens, gradient accumulation) give that step's work
# where one 40K row would not fit 80 GB without checkpointing
CASES["bagel_7b_mot_4l_x5"] = dict(CASES["bagel_7b_mot_4l"], micro=5)
# the recipe's own shape: one packed row of 40,960 tokens a GPU a step (no accumulation: no fp32 gradient sums between
# micro-batches); an H200's (the 8,192-token row peaked at 60.5 GB on the H100, about 10 GB of it the row's)
CASES["bagel_7b_mot_4l_40k"] = dict(CASES["bagel_7b_mot_4l"], seq=40960)
CASES["debug_bagel_x2"] = dict(CASES["debug_bagel"], micro=2)  # the accumulation path, on the CPU


def parse_ac(ac: str) -> tuple[str, int]:
    """--ac MODE[:N] -> (activation_checkpoint.mode, num_layers): 'selective:2' = selective AC on the first 2
    blocks only, 'none' / 'full' / 'selective' = that mode on every block."""
    mode, _, n = ac.partition(":")
    if mode not in ("none", "selective", "full") or (n and not n.isdigit()):
        raise SystemExit(f"--ac {ac!r}: expected none | selective | full, optionally :N (the first N blocks)")
    return mode, int(n or 0)


def model_config(case: dict, attn_backend: str = "sdpa", kernels: bool | str = False):
    """(spec, model config) of a case: the registry flavor with the case's overrides and these runtime fields."""
    from titan_mm.registry import resolve_model

    return resolve_model(case["model"], case["flavor"], overrides=case.get("overrides") or {},
                         attn_backend=attn_backend, kernels=kernels)


def shape_of(spec, mc, seq: int) -> dict:
    """Peer-facing shape dict of a titan model config: the decoder's dims (spec.dims), RoPE theta from its HF
    config.json dict (what the HF peers are built from)."""
    d = spec.dims(mc)
    hf = mc.to_hf_dict()
    rope = hf.get("text_config", hf)["rope_parameters"]
    return dict(
        vocab_size=d.vocab_size, dim=d.hidden_size, n_layers=d.num_layers, n_heads=d.num_heads,
        n_kv_heads=d.num_kv_heads, head_dim=d.head_dim, ffn_dim=d.intermediate_size, rope_theta=rope["rope_theta"],
        tied=d.tie_word_embeddings, seq_len=seq, num_experts=d.num_experts, top_k=d.experts_per_tok,
        moe_ffn_dim=d.moe_intermediate_size,
    )


def text_batch(vocab: int, batch: int, seq: int, device, seed: int = 0) -> dict:
    """Full rows, one document each: every stack sees the same causal attention work."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    labels = ids[:, 1:].clone()
    ids = ids[:, :-1].contiguous()
    pos = torch.arange(seq).expand(batch, seq).contiguous()
    return {
        "input_ids": ids, "labels": labels, "position_ids": pos,
        "doc_ids": torch.zeros(batch, seq, dtype=torch.int32),
        "cu_seqlens": torch.arange(0, batch * seq + 1, seq, dtype=torch.int32),
        "max_seqlen": torch.tensor(seq), "num_label_tokens": torch.tensor(batch * seq),
    }


# ------------------------------------------------------------------------------------------------ worker
def merge_overrides(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, nested dicts merged key by key (a VL case's {"text": {...}} keeps its layer cut)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge_overrides(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# the stacks that run float8.moe_experts, which the config refuses unless MEASURE_FLOAT8_EXPERTS is set (bench only)
F8_EXPERT_STACKS = ("titan_f8_experts", "titan_opt_f8")

# parallel.one_rank_mixed_precision of the titan stacks that do not run the default (cast)
MIXED_PRECISION = {"titan_fsdp": "fsdp", "titan_plain": "fsdp", "titan_opt": "optimizer", "titan_opt_f8": "optimizer",
                   "titan_opt_f8_tensorwise": "optimizer", "titan_opt_f8_rowwise": "optimizer",
                   "titan_opt_f8_rowwise_with_gw_hp": "optimizer", "titan_opt_f8_rowwise_titan": "optimizer"}

# the stacks with float8 linears (float8.enable), and their float8.recipe
FLOAT8_RECIPE = {"titan_f8": "tensorwise", "titan_f8_pre": "tensorwise", "titan_opt_f8_tensorwise": "tensorwise",
                 "titan_opt_f8_rowwise": "rowwise", "titan_opt_f8_rowwise_with_gw_hp": "rowwise_with_gw_hp",
                 "titan_opt_f8_rowwise_titan": "rowwise"}


def titan_argv(case: dict, stack: str, args) -> list[str]:
    """The trainer's command-line overrides for a titan stack on a case (JobConfig defaults + these)."""
    ac_mode, ac_layers = parse_ac(args.ac)
    argv = [
        "--model.name", case["model"], "--model.flavor", case["flavor"],
        # auto: the trainer's choice (flex on CUDA, sdpa on the CPU)
        "--model.attn_backend", args.attn,
        "--job.device", "cpu" if args.cpu else "cuda",
        "--data.seq_len", str(case["seq"]), "--data.micro_batch_size", str(case["batch"]),
        "--training.global_batch_size", str(case["batch"] * case.get("micro", 1)),
        "--compile.enable", str(stack != "titan_eager"),
        "--float8.enable", str(stack in FLOAT8_RECIPE), "--float8.recipe", FLOAT8_RECIPE.get(stack, "tensorwise"),
        "--float8.precompute_scale", str(stack == "titan_f8_pre"),
        "--float8.rowwise_casts", "titan" if stack == "titan_opt_f8_rowwise_titan" else "torchao",
        "--float8.moe_experts", str(stack in F8_EXPERT_STACKS),
        # kernels on CUDA: the trainer's default op set, or --kernel-ops (e.g. "all,-rope": which op helps or
        # hurts end to end); titan_nokernels runs the PyTorch references
        "--kernels.mode", "reference" if stack == "titan_nokernels" else "auto",
        "--activation_checkpoint.mode", ac_mode, "--activation_checkpoint.num_layers", str(ac_layers),
        "--training.param_dtype", "bfloat16", "--training.reduce_dtype", "float32", "--training.max_norm", "1.0",
        "--checkpoint.enable", "False",
        "--parallel.fsdp_reshard_after_forward", args.reshard,
        "--parallel.one_rank_mixed_precision", MIXED_PRECISION.get(stack, "cast"),
    ]
    overrides = merge_overrides(case.get("overrides") or {}, json.loads(args.model_overrides or "{}"))
    if overrides:
        argv += ["--model.overrides", json.dumps(overrides)]
    if args.kernel_ops and stack != "titan_nokernels":
        argv += ["--kernels.ops", args.kernel_ops]
    return argv


def titan_config(case: dict, stack: str, args):
    """The JobConfig of a titan stack on a case (titan_argv). The float8-expert stacks first set
    MEASURE_FLOAT8_EXPERTS in this (worker) process: the config refuses float8.moe_experts otherwise."""
    from titan_mm.config import MEASURE_FLOAT8_EXPERTS, load_config

    if stack in F8_EXPERT_STACKS:  # measure what the trainer refuses (each (case, stack) is its own process)
        os.environ[MEASURE_FLOAT8_EXPERTS] = "1"
    return load_config(titan_argv(case, stack, args))


def _titan_builder(case, stack, args, device):
    """The trainer's setup(cfg) (titan_mm.train.setup: meshes, registry model -> parallelize -> materialize,
    optimizer, schedule, step context) for the case; titan_plain hands it its hand-built model."""
    import torch

    from titan_mm.train.setup import setup, tune_kernels
    from titan_mm.train.step import global_counts, host_prepare, to_device, train_step

    cfg = titan_config(case, stack, args)
    run = setup(cfg, model_fn=_plain_model if stack == "titan_plain" else None)
    spec, mc, device = run.spec, run.model_cfg, run.device
    batch = case_batch(case, spec, mc, device)
    if (case.get("vl") or case.get("rows")) and device.type == "cuda":  # host batches arrive pinned, as from the
        # trainer's loader (data.pin_memory): a pageable copy of the pixels each step would block the host (the
        # peers' batch stays on the GPU)
        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) and k not in ("cu_seqlens", "max_seqlen")
                 else v for k, v in batch.items()}
    # the kernels' launch configs, picked before the first step as the trainer does: the forward never tunes
    # (it must not synchronize)
    pv = batch.get("pixel_values")
    rep = tune_kernels(cfg, spec, mc, run.pd, device, vision_tokens=int(pv.shape[0]) if pv is not None else None)
    if rep is not None:
        print(f"[worker] kernels: tuned {sum(len(v) for v in rep['tuned'].values())} launch configs in "
              f"{rep['seconds']:.1f}s {'; '.join(rep['skipped'])}", file=sys.stderr, flush=True)

    def step():
        res = train_step(run.state, [batch] * case.get("micro", 1), run.ctx)
        extras["host_prepare_s"].append(res.prepare_s)
        return res.loss

    def host_step_s() -> float:
        """The host work before a step's first launch, alone (the GPU idle): the objective's preparation and
        counts, the family's and the attention metadata, the copy to the device."""
        ctx = run.ctx
        t0 = time.perf_counter()
        mbs = ctx.objective.prepare([batch], 0, ctx.dp_rank)
        global_counts(mbs, ctx)
        mb, _ = host_prepare(mbs[0], ctx)
        to_device(mb, device, ctx.objective.host_keys)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    extras = {"host_prepare_s": [], "host_step_s": host_step_s}
    return spec, mc, batch, step, extras


def _plain_model(spec, mc, pd, device):
    """setup()'s model_fn for titan_plain: the model prepared by hand, as a user without the plan registry would:
    per-block torch.compile, then fully_shard (bf16 params, fp32 reduce) per block and on the root of a 1-GPU mesh
    of its own (``pd``'s meshes are left unused). Text models only."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = spec.build(mc)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def vl_batch(mc, batch: int, seq: int, seed: int = 0, synthetic: str = VL_SYNTHETIC,
             media: dict | None = None) -> dict:
    """One document per row: groups of an image of ``media["image"]`` patches (default 32x32 = 512x512 px at patch
    16), an audio clip of ``media["audio_s"]`` = (lo, hi) seconds when given (the Omni cases: lo..hi s, random per
    clip), then ``media["text"]`` text tokens, while a whole group fits; the rest of the row is text. One document
    per row gives HF (no packed-document masking) the same attention work. ``synthetic``: the module whose
    make_sample / pack build the samples for ``mc``'s family (an audio one also has audio_tokens(mc, frames))."""
    import torch

    from titan_mm.registry import spec_for_config

    media = {**VL_MEDIA, **(media or {})}
    syn = importlib.import_module(synthetic)
    g = torch.Generator().manual_seed(seed)
    (h, w), n_text, audio_s = media["image"], media["text"], media["audio_s"]
    n_image = h * w // spec_for_config(mc).data_needs(mc).merge_size**2 + 2
    samples = []
    for _ in range(batch):
        segs, left = [], seq
        while True:
            group, n = [("image", (h, w))], n_image
            if audio_s:
                frames = int(torch.randint(int(audio_s[0] * 100), int(audio_s[1] * 100) + 1, (1,), generator=g))
                group.append(("audio", frames))
                n += syn.audio_tokens(mc, frames) + 2
            group.append(("text", n_text))
            n += n_text
            if n > left:
                break
            segs += group
            left -= n
        segs.append(("text", left))
        samples.append(syn.make_sample(mc, segs, g))
    return syn.pack(samples, mc, seq_len=seq, rows=batch)


def clip_batch(mc, batch: int, clip: dict, seed: int = 0) -> dict:
    """Random latent clips and text states of the case's shape (one clip a row, every patch a flow-matching target);
    the channel and text widths from the diffusers config (what a diffusers peer is built from)."""
    import torch

    from titan_mm.models.wan.data import latent_batch

    hf = mc.to_hf_dict()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, hf["in_channels"], clip["frames"], *clip["hw"], generator=g)
    return latent_batch(mc, x, torch.randn(batch, clip["text"], hf["text_dim"], generator=g))


def case_batch(case: dict, spec, mc, device) -> dict:
    """The case's host batch: vl_batch through its synthetic module, clip_batch, a family's bench_rows, or text
    rows."""
    if case.get("rows"):
        return importlib.import_module(case["rows"]).bench_rows(mc, case["batch"], case["seq"], **case["media"])
    if case.get("clip"):
        return clip_batch(mc, case["batch"], case["clip"])
    if case.get("vl"):
        return vl_batch(mc, case["batch"], case["seq"], synthetic=case.get("synthetic", VL_SYNTHETIC),
                        media=case.get("media"))
    return text_batch(spec.dims(mc).vocab_size, case["batch"], case["seq"], device)


def _host_rows_step(model, fb, batch, n_micro: int = 1):
    """The timed step of a peer whose ``fb(host_batch, step_index)`` prepares titan's host rows itself (the
    objective's noise at that step): forward-backward over ``n_micro`` micro-batches (gradients accumulate; each
    micro-batch's loss is its own mean: the update's scale differs from titan's, its work does not), clip, AdamW."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    n_steps = [0]

    def step():
        loss = sum(fb(batch, n_steps[0] * n_micro + i) for i in range(n_micro)) / n_micro
        n_steps[0] += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # no host read a step: torchtitan's and HF's trainers read the loss at log steps

    return step


def _peer_builder(case, stack, args, device):
    import torch

    from bench import peers
    from bench.bagel_peer import build_bagel_ref
    from titan_mm.nn.init import seeded_init
    from titan_mm.objectives import build_objective

    spec, mc = model_config(case)
    batch = case_batch(case, spec, mc, device)
    if stack == "diffusers":  # Wan: the titan stack's flow matching (sampler, seed) on the same host clips
        if not case.get("clip"):
            raise SystemExit(f"the diffusers stack runs the Wan cases (clip cases); {args.case} is not one")
        ac_mode, ac_blocks = parse_ac(args.ac)
        if ac_mode == "selective":
            raise SystemExit(f"the diffusers stack runs --ac none or full[:N] (the first N blocks checkpointed), "
                             f"not {args.ac!r}")
        objective = build_objective(titan_config(case, "titan", args), spec, mc)
        model, fb = peers.build_diffusers_wan(mc.to_hf_dict(), device, objective,
                                              checkpoint_blocks=0 if ac_mode == "none" else ac_blocks or -1)
        return spec, mc, batch, _host_rows_step(model, fb, batch, case.get("micro", 1)), {}
    if stack.startswith("bagel_ref"):  # BAGEL: titan's initial weights and flow matching (sampler, shift, seed)
        if case.get("model") != "bagel":
            raise SystemExit(f"the {stack} stack runs the BAGEL cases; {args.case} is not one")
        cfg = titan_config(case, "titan", args)
        with torch.device(device):  # the titan stacks' random init (setup.build_model's seeded draws)
            titan = spec.build(mc)
        torch.manual_seed(cfg.training.seed)
        with torch.no_grad(), seeded_init(cfg.training.seed):
            titan.init_weights(buffer_device=device)
        model, fb = build_bagel_ref(mc, device, build_objective(cfg, spec, mc), attn="sdpa" if args.cpu else "flex",
                                    init=titan.state_dict(), compile_layers=stack == "bagel_ref")
        del titan
        return spec, mc, batch, _host_rows_step(model, fb, batch, case.get("micro", 1)), {}
    if stack == "torchtitan":
        model, fb = peers.build_torchtitan(shape_of(spec, mc, case["seq"]), device)
    else:
        model, fb = peers.build_hf(mc.to_hf_dict(), device, liger=stack == "hf_liger")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    # HF takes the audio as its processor gives it (padded clips + feature_attention_mask), built once here
    dev_batch = {k: v.to(device) for k, v in {**batch, **peers.hf_audio_inputs(batch)}.items()
                 if isinstance(v, torch.Tensor)}

    def step():
        loss = fb(dev_batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # no host read a step: torchtitan's and HF's trainers read the loss at log steps

    return spec, mc, batch, step, {}


def worker(args) -> dict:
    import torch
    import torch.distributed as dist

    case = CASES[args.case]
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if cuda:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    t_build = time.perf_counter()
    if args.stack.startswith("titan"):
        spec, mc, batch, step, extras = _titan_builder(case, args.stack, args, device)
    else:
        spec, mc, batch, step, extras = _peer_builder(case, args.stack, args, device)
    from bench.scaling import batch_flops
    from bench.timing import step_times, timing_label
    from titan_mm.config import JobConfig
    from titan_mm.nn.attention import batch_rows
    from titan_mm.objectives import build_objective
    from titan_mm.observe.mfu import doc_lens_from_batch, encoder_inputs

    # the trainer's FLOPs of the batch's documents (the family's count, vision tower and audio encoder included, with
    # its objective's mask: a video DiT's bidirectional pairs), and of the LLM alone
    objective = build_objective(JobConfig(), spec, mc)
    flops = objective.flops(spec, mc, doc_lens_from_batch(batch), **encoder_inputs(batch))
    flops_llm = batch_flops(spec, mc, batch, vision=False)
    rows, seq = batch_rows(batch)
    n_micro = case.get("micro", 1)  # micro-batches a step (gradient accumulation): the same rows, new noise each
    n_tok, flops, flops_llm = rows * seq * n_micro, flops * n_micro, flops_llm * n_micro
    print(f"[worker] {args.case} {args.stack}: built in {time.perf_counter() - t_build:.1f}s", file=sys.stderr, flush=True)
    t_compile = time.perf_counter()
    losses = []
    for i in range(args.warmup):
        losses.append(step())
        print(f"[worker] warm-up step {i + 1}: {time.perf_counter() - t_compile:.1f}s", file=sys.stderr, flush=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t_compile = time.perf_counter() - t_compile
    skip_guards = os.environ.get("TITAN_BENCH_SKIP_GUARD_EVAL") == "1"
    if skip_guards:  # experiment: after the warm-up, run only the guards that tell cached graphs apart
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    times, timed = step_times(step, args.steps, cuda)  # back to back, no sync between steps (bench/timing.py)
    losses = [float(x) for x in losses + timed]  # the peers hand back device losses: read once, after the timed steps
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.profile_stack) as prof:
            t_prof = time.perf_counter()
            for _ in range(2):
                step()
            sync()
            t_prof = time.perf_counter() - t_prof
        avg = prof.key_averages()
        table = avg.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=35,
                          max_name_column_width=70)
        if cuda:  # the kernels themselves, and how much of the wall time the GPU was busy
            table += "\n\nBy self CUDA time (kernels):\n" + avg.table(
                sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=110)
            busy_ms = sum(e.self_device_time_total for e in avg  # kernel events only (ops repeat their kernels' time)
                          if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
            table += f"\n\n2 steps: wall {t_prof * 1e3:.1f} ms, GPU kernel time {busy_ms:.1f} ms " \
                     f"({100 * busy_ms / (t_prof * 1e3):.0f}% of the wall time; steps timed above: " \
                     f"{1e3 * sorted(times)[len(times) // 2]:.1f} ms median)\n"
        Path(args.profile).write_text(table)
        # the timeline (bench/trace_gaps.py FILE lists where the GPU waits), and on CUDA its split by kernel category
        trace = Path(args.trace_file or Path(args.profile).with_suffix(".trace.json"))
        prof.export_chrome_trace(str(trace))
        if cuda:
            from bench.profile_split import split
            from bench.trace_gaps import load_events, summarize

            profile_ms, kernels = split(load_events(trace), steps=2)
            stem = Path(args.profile).stem.replace("profile_", "", 1)
            Path(args.profile).with_name(f"split_{stem}.json").write_text(
                json.dumps(dict(ms_per_step=profile_ms, kernels=kernels), indent=1))
            # where the GPU waited and what the host ran then (with --profile-stack: the Python frames too)
            gaps = summarize(trace, top=12)
            Path(args.profile).with_name(f"gaps_{stem}.json").write_text(json.dumps(gaps, indent=1))
            idle_top = dict(list(gaps["idle_by_host_op_ms"].items())[:5])
        if not args.trace_file:
            trace.unlink()
    times.sort()
    med = times[len(times) // 2]
    res = dict(
        case=args.case, stack=args.stack, ac=args.ac, batch=case["batch"], seq=case["seq"], tokens_per_step=n_tok,
        step_time_s=med, tokens_per_s=n_tok / med, tflops=flops / med / 1e12, mfu=flops / med / 1e12 / PEAK_TFLOPS,
        peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, warmup_s=t_compile, first_loss=losses[0],
        last_loss=losses[-1], gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
        timing=timing_label(cuda),
    )
    if n_micro > 1:
        res["micro_batches"] = n_micro
    res["mfu_llm_only"] = flops_llm / med / 1e12 / PEAK_TFLOPS
    if extras:  # titan: the objective's host preparation in the timed steps, and all host work before a launch alone
        prep = sorted(extras["host_prepare_s"][args.warmup:] or extras["host_prepare_s"])
        alone = sorted(extras["host_step_s"]() for _ in range(5))
        res["host_prepare_ms"], res["host_step_ms"] = round(1e3 * prep[len(prep) // 2], 2), round(1e3 * alone[2], 2)
    if skip_guards:
        res["skip_guard_eval_unsafe"] = True
    if args.profile and cuda:
        res["profile_ms"], res["profile_idle_by_host_op_ms"] = profile_ms, idle_top
    dist.destroy_process_group()
    return res


# ------------------------------------------------------------------------------------------------ driver
STACK_ORDER = ("titan", "titan_opt", "titan_fsdp", "titan_f8", "titan_f8_pre", "titan_opt_f8_tensorwise",
               "titan_opt_f8_rowwise", "titan_opt_f8_rowwise_with_gw_hp", "titan_opt_f8_rowwise_titan",
               "titan_f8_experts", "titan_opt_f8",
               "titan_eager", "titan_nokernels", "titan_plain", "torchtitan", "hf_liger", "hf", "diffusers",
               "bagel_ref", "bagel_ref_eager")


def _row_order(r: dict):
    """Table order: case (as in CASES), AC none first, stack, the default kernel ops before variants."""
    case = list(CASES).index(r["case"]) if r["case"] in CASES else len(CASES)
    stack = STACK_ORDER.index(r["stack"]) if r["stack"] in STACK_ORDER else len(STACK_ORDER)
    return (case, r.get("ac") != "none", r.get("ac") or "", stack, r.get("kernel_ops") or "", r.get("reshard") or "",
            r.get("model_overrides") or "")


def render(rows: list[dict]) -> str:
    out = ["| case | device | stack | AC | tokens/s | TFLOP/s | MFU | MFU (LLM only) | peak GiB | vs best peer |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=_row_order):
        dev = device_label(device_of(r))
        if "error" in r:
            out.append(f"| {r['case']} | {dev} | {r['stack']} | {r.get('ac', '')} | failed: {r['error'][:60]} | | | | | |")
            continue
        # a peer of the same call only (rows merged from several sessions carry which one ran them)
        peers = [p["tokens_per_s"] for p in rows if p["case"] == r["case"] and "error" not in p
                 and not p["stack"].startswith("titan") and device_of(p) == device_of(r)
                 and p.get("session") == r.get("session")]
        ratio = f"{r['tokens_per_s'] / max(peers):.2f}x" if peers else ""
        stack = r["stack"] + (f" (ops {r['kernel_ops']})" if r.get("kernel_ops") else "") \
            + (f" ({r['model_overrides']})" if r.get("model_overrides") else "") \
            + (f" (reshard {r['reshard']})" if r.get("reshard") else "") \
            + (" (guards skipped)" if r.get("skip_guard_eval_unsafe") else "")
        out.append(f"| {r['case']} | {dev} | {stack} | {r['ac']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
                   f"{100 * r['mfu']:.1f}% | {100 * r.get('mfu_llm_only', r['mfu']):.1f}% | {r['peak_mem_gb']:.1f} | {ratio} |")
    return "\n".join(out)


def machine_ceilings(cpu: bool) -> dict:
    """bench/ceilings.py in a process of its own: this driver holds no CUDA context while the workers run."""
    p = subprocess.run([sys.executable, str(ROOT / "bench/ceilings.py"), *(["--cpu"] if cpu else [])],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def does_not_fit(case: str, stack: str, ceil: dict) -> str | None:
    """Why (case, stack) cannot run on this device (its H200 peak above this device's memory, less 1 GiB for the
    CUDA context), or None."""
    need, have = CASES[case].get("over_80gb", {}).get(stack), ceil.get("memory_gib")
    if need and have and need > have - 1:
        return f"does not fit: peaked at {need} GiB on the H200; {ceil['device']} has {have} GiB"
    return None


def not_comparable(case: str, stack: str) -> str | None:
    """Why ``stack`` would not train ``case``'s model (a row under its name would compare another model), or None."""
    if stack == "torchtitan" and CASES[case].get("vl"):
        return ("not comparable: torchtitan 0.2.2 has no vision or audio model, so it would train the text decoder "
                "alone; hf_liger is this case's peer")
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="qwen3_1.7b")
    ap.add_argument("--stacks", default="titan,titan_f8,torchtitan,hf_liger")
    ap.add_argument("--ac", default="none", help="titan activation checkpointing: none | selective | full, "
                    "optionally :N for the first N blocks only (activation_checkpoint.num_layers), e.g. selective:2")
    ap.add_argument("--kernel-ops", default="", help="titan kernels.ops for the titan stacks with kernels "
                    "(default: the config's, 'all'); the row records it and keys on it")
    ap.add_argument("--reshard", default="always", choices=("always", "never"),
                    help="titan parallel.fsdp_reshard_after_forward; a row other than always (the default) records it and keys on it")
    ap.add_argument("--model-overrides", default="", help="JSON merged into the case's model overrides for the "
                    "titan stacks, e.g. '{\"loss_chunk_size\": 2048}' (an ablation); the row records it and keys on it")
    ap.add_argument("--attn", default="auto", help="titan model.attn_backend: auto (the trainer's: flex on CUDA, "
                    "sdpa on the CPU) | sdpa | flex | varlen")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per (case, stack) subprocess")
    ap.add_argument("--out", default=str(ROOT / "bench/results/mfu.json"))
    ap.add_argument("--profile", default="", help="folder: write a torch.profiler kernel table per (case, stack); on CUDA "
                    "the row gets its step split by kernel category (profile_ms; bench/profile_split.py)")
    ap.add_argument("--trace", action="store_true", help="with --profile: also a chrome trace per (case, stack) "
                    "(trace_CASE_STACK.json; bench/trace_gaps.py summarizes its GPU idle gaps)")
    ap.add_argument("--profile-stack", action="store_true", help="with --profile: record Python stacks, so that the "
                    "idle gaps (gaps_CASE_STACK.json) name the Python frames the host was in (slows the profiled steps)")
    ap.add_argument("--cpu", action="store_true", help="smoke-test on CPU (gloo; use --cases debug)")
    ap.add_argument("--render", default="", help="print the markdown table of this results JSON and exit")
    ap.add_argument("--doc", default="", help="with --render: replace the table between the --marker markers here")
    ap.add_argument("--marker", default="mfu-bench", help="with --doc: <!-- MARKER:begin --> ... <!-- MARKER:end -->")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--stack", help=argparse.SUPPRESS)
    ap.add_argument("--trace-file", default="", help=argparse.SUPPRESS)
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    try:
        if not isinstance(json.loads(args.model_overrides or "{}"), dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        ap.error(f"--model-overrides {args.model_overrides!r}: {e}; give a JSON object, e.g. '{{\"loss_chunk_size\": 2048}}'")
    if args.trace and not args.profile:
        ap.error("--trace writes its timeline next to the kernel tables: give --profile DIR too")
    if args.render:
        table = render(json.loads(Path(args.render).read_text())["rows"])
        if args.doc:
            doc = Path(args.doc).read_text()
            a, b = f"<!-- {args.marker}:begin -->", f"<!-- {args.marker}:end -->"
            doc = doc[: doc.index(a) + len(a)] + "\n" + table + "\n" + doc[doc.index(b):]
            Path(args.doc).write_text(doc)
        print(table)
        return 0
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)  # the tables, splits and logs go here
    ceil = machine_ceilings(args.cpu)
    print("ceilings: " + json.dumps(ceil), flush=True)
    rows, merged = [], []
    for case in args.cases.split(","):
        for stack in args.stacks.split(","):
            if reason := not_comparable(case, stack) or does_not_fit(case, stack, ceil):
                rows.append(dict(case=case, stack=stack, ac=args.ac, device=ceil["device"], error=reason))
                print(f"{case} {stack}: {reason}", flush=True)
                merged = _write(Path(args.out), rows, ceil)
                continue
            prof = str(Path(args.profile) / f"profile_{case}_{stack}.txt") if args.profile else ""
            cmd = [sys.executable, __file__, "--worker", "--case", case, "--stack", stack, "--ac", args.ac,
                   "--profile", prof, "--kernel-ops", args.kernel_ops, "--reshard", args.reshard,
                   "--model-overrides", args.model_overrides, *(["--profile-stack"] if args.profile_stack else []),
                   *(["--trace-file", str(Path(args.profile) / f"trace_{case}_{stack}.json")] if args.trace and prof else []),
                   "--attn", args.attn, *(["--cpu"] if args.cpu else []), "--warmup", str(args.warmup), "--steps", str(args.steps)]
            t0 = time.time()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                raised = error_lines(p.stderr)
                if args.profile:
                    (Path(args.profile) / f"log_{case}_{stack}.txt").write_text(
                        raised + p.stdout[-20000:] + p.stderr[-30000:])
                if lines:
                    rows.append(json.loads(lines[-1][7:]))
                else:
                    rows.append(dict(case=case, stack=stack, ac=args.ac, error=raised + (p.stderr or p.stdout)[-2000:]))
            except subprocess.TimeoutExpired as e:  # keep the worker's progress lines: where did the time go?
                tail = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                               for x in (e.stdout, e.stderr))[-1500:]
                rows.append(dict(case=case, stack=stack, ac=args.ac, error=f"timeout after {args.timeout}s; "
                                                                          f"worker output: {tail}"))
            r = rows[-1]
            r["device"] = r.get("gpu") or ceil.get("device")
            if "tflops" in r and ceil.get("bf16_tflops"):  # against this machine's measured bf16 matmul
                r["frac_of_matmul"] = round(r["tflops"] / ceil["bf16_tflops"], 3)
            if args.kernel_ops and stack.startswith("titan") and stack != "titan_nokernels":
                r["kernel_ops"] = args.kernel_ops
            if args.model_overrides and stack.startswith("titan") and stack != "titan_plain":
                r["model_overrides"] = args.model_overrides
            if stack.startswith("titan") and "error" not in r:  # rows before 2026-12-03 have none: fsdp
                r["mixed_precision"] = MIXED_PRECISION.get(stack, "cast")
            if args.reshard != "always" and stack == "titan_fsdp":  # the cast path holds its copies as never does
                r["reshard"] = args.reshard
            print(f"[{time.time() - t0:5.0f}s] {case} {stack}: "
                  + (f"{r['tokens_per_s']:,.0f} tok/s, {100 * r['mfu']:.1f}% MFU, {r['peak_mem_gb']:.1f} GB"
                     if "error" not in r else "FAILED\n" + r["error"][-1500:]), flush=True)
            merged = _write(Path(args.out), rows, ceil)  # after every row: a run cut short keeps what it measured
    print(render(merged))
    return 0


def error_lines(stderr: str, most: int = 3) -> str:
    """The last ``most`` exception lines of a failed worker's stderr ("...Error: ..."), one per line: a compile
    error is followed by a graph dump that would push it out of the kept tail."""
    found = [ln.strip() for ln in stderr.splitlines()
             if re.match(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Failed)\b.*:", ln.strip())]
    return "".join(f"{ln[:500]}\n" for ln in found[-most:])


def _write(out: Path, rows: list[dict], ceil: dict) -> list[dict]:
    """Merge ``rows`` into the results JSON at ``out`` (a row replaces the earlier one of its case, stack, ac and
    device: an H100's rows stand beside an H200's); ``ceil``: this run's machine (``ceilings``: the last run's)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(out.read_text()) if out.exists() else {"rows": []}
    keep = [r for r in prev.get("rows", []) if not any(
        r["case"] == n["case"] and r["stack"] == n["stack"] and r.get("ac") == n.get("ac")
        and r.get("kernel_ops") == n.get("kernel_ops") and r.get("reshard") == n.get("reshard")
        and r.get("model_overrides") == n.get("model_overrides")
        and r.get("skip_guard_eval_unsafe") == n.get("skip_guard_eval_unsafe")
        and device_of(r) == device_of(n) for n in rows)]
    out.write_text(json.dumps({"peak_tflops": PEAK_TFLOPS, "ceilings": ceil, "rows": keep + rows}, indent=1))
    return keep + rows


if __name__ == "__main__":
    sys.exit(main())
