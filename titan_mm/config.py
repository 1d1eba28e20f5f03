"""The job configuration: nested dataclasses, TOML files, command-line overrides.

A run is described by one :class:`JobConfig`. Its sections are plain dataclasses whose fields carry
a docstring each (tyro turns them into ``--help``). A TOML file in ``train_configs/`` maps onto the
sections (``[training] steps = 100``); command-line flags override it (``--training.steps 10``).

    cfg = load_config(["--config", "debug_qwen3.toml", "--training.steps", "10"])

Rules:
- An unknown key (in TOML or on the command line) is an error that names the key and the closest
  valid ones; a value of the wrong type is an error that names the key, the value and the type.
- Booleans take a value on the command line (``--compile.enable True``; true/false/yes/no/on/off/1/0 in any
  case too), like in TOML.
- ``resolved_toml(cfg)`` renders the resolved config; the trainer saves it in the run folder, and the
  saved file can be fed back with ``--config``.

Section ownership (several people edit this file): ``DataConfig`` belongs to the data pipeline,
``ParallelConfig`` to titan_mm/parallel; everything else to the trainer.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import json
import logging
import math
import os
import sys
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "train_configs"
MEASURE_FLOAT8_EXPERTS = "TITAN_MEASURE_FLOAT8_EXPERTS"
"""Set to 1 in the environment, bench/mfu.py's float8-expert stacks let float8.moe_experts through the config
check that refuses it (the benches measure what the trainer refuses; no training run sets it)."""
log = logging.getLogger("titan_mm.config")


class ConfigError(ValueError):
    """A configuration problem the user must fix (unknown key, wrong type, missing file, ...)."""


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclass
class Job:
    dump_folder: str = "outputs"
    """Root folder for runs; a run writes into <dump_folder>/<name>/."""
    name: str = ""
    """Run name (the run folder's name). Empty: the config file's stem (for example debug_qwen3)."""
    description: str = ""
    """Free text describing the job; saved with the config."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: cuda when available under auto, else cpu."""
    print_config: bool = False
    """Print the resolved config at start-up."""


@dataclass
class Model:
    name: str = "qwen3"
    """Model family in titan_mm.registry (qwen3, qwen3_moe, qwen3_vl, ...)."""
    flavor: str = "debug"
    """Named size in the family's flavors (for example debug, 0.6B, 1.7B). Ignored when hf_path is set."""
    hf_path: str | None = None
    """Local HF model directory (config.json + *.safetensors), or a Hub repo id such as Qwen/Qwen3-1.7B
    (downloaded into the huggingface-hub cache). Set: the architecture comes from its config.json and the
    weights are loaded from it (unless init_from_hf is False)."""
    init_from_hf: bool = True
    """With hf_path: load the HF weights (True) or only take the architecture and init randomly (False)."""
    attn_backend: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """Attention backend handed to build_attn_meta: auto picks the fastest that works on the device (flex on CUDA
    in bf16 / fp16, sdpa in fp32 and on the CPU)."""
    overrides: str = ""
    """JSON object of model-config fields to override on the chosen flavor, e.g. '{"num_hidden_layers": 2}'."""


@dataclass
class Data:
    dataset: str = "builtin"
    """Dataset name or path understood by titan_mm.data (builtin = the small corpus inside the package).
    Given on the command line, it replaces the TOML's [data.mixture] (the mixture is cleared)."""
    seq_len: int = 512
    """Tokens per packed row (rows are padded to the next multiple of 16: titan_mm.data.packing.padded_seq_len)."""
    micro_batch_size: int = 2
    """Packed rows per micro-batch on each data-parallel rank."""
    num_workers: int = 0
    """DataLoader worker processes (0 = load in the main process)."""
    tokenizer_path: str | None = None
    """Folder with tokenizer.json, or builtin:NAME (builtin:qwen3, builtin:qwen2_5_omni: Qwen3's with Qwen2.5-Omni's
    audio / vision token names); None: the model's HF dir if given, else the built-in Qwen3 tokenizer."""
    mixture: dict[str, float] = field(default_factory=dict)
    """Weighted mixture of sources, {path-or-URL-or-builtin:name: positive weight}; replaces `dataset` when
    given. TOML: [data.mixture] "data/a.jsonl" = 0.7  "s3://b/*.parquet" = 0.3. Command line: one JSON
    object that replaces the TOML's mixture whole, --data.mixture '{"a/*.jsonl": 0.7, "b.parquet": 0.3}'."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (num_workers > 0)."""
    pin_memory: bool = True
    """Pin batch memory (only when CUDA is available)."""
    open_rows: int = 32
    """Rows the best-fit packer keeps open per packed stream (more: denser packing, more memory in the state)."""
    max_patches_per_row: int = 0
    """Cap on vision patches per packed row (0: no cap)."""
    split_long_text: bool = False
    """Split plain-text documents longer than seq_len into chunks instead of skipping them."""
    chat_template: str = ""
    """Chat template of chat samples: empty = the model family's; 'chatml' (as Qwen3-VL Instruct's, no think
    block) or 'chatml_think' (Qwen3's: empty <think></think> on the last turn) override it."""
    image_min_pixels: int = 65536
    """Smallest image area after smart resize (pixels)."""
    image_max_pixels: int = 16777216
    """Largest image area after smart resize (pixels)."""
    video_min_pixels: int = 131072
    """Smallest total video volume (frames x pixels) after smart resize."""
    video_max_pixels: int = 786432
    """Largest total video volume (frames x pixels) after resize."""
    video_fps: float = 2.0
    """Frames sampled per second of video."""
    video_min_frames: int = 4
    """Fewest frames sampled from a video."""
    video_max_frames: int = 768
    """Most frames sampled from a video."""
    media_root: str = ""
    """Base folder/URL for relative media paths (empty: the folder of the shard that names them)."""
    max_error_rate: float = 0.05
    """Stop with an error when more than this fraction of samples is skipped (after error_min_samples)."""
    error_min_samples: int = 200
    """Samples seen before max_error_rate is enforced."""
    shuffle_buffer: int = 256
    """Per source and packed stream: samples read ahead and drawn from at random (saved as references in the
    loader state); 0 or 1: stream order."""
    streams_per_slot: int = 1
    """Packed streams behind each micro-batch of the global batch, taking turns step by step (docs/data.md).
    A stream is read by one worker, so a rank uses at most (its micro-batches per step) x streams_per_slot
    workers. Part of the data order, like global_batch_size: changing it changes the samples."""
    balance: Literal["none", "lpt", "kk"] = "kk"
    """Re-place each step's global batch across data-parallel ranks and micro-batches to even out the ranks'
    predicted cost (titan_mm.data.balance; docs/data.md, "Workload balancing"): kk (balanced Karmarkar-Karp),
    lpt, or none (the loader's order). Same rows and loss, only placement; a no-op with one dp rank."""
    encoders: str = ""
    """Families trained on captioned clips (Wan; docs/wan.md "Data"): the folder of the frozen encoders (a diffusers
    pipeline folder with tokenizer/, text_encoder/ and vae/) that encode data.dataset's raw clips in the data
    pipeline. Unused with a latent cache (python -m titan_mm.tools.cache), which holds their output. BAGEL
    (docs/bagel.md "Data"): its image codec, "pixels" or a FLUX VAE (ae.safetensors, or a diffusers folder)."""
    prompt_dropout: float = 0.0
    """Families trained on captioned clips: the probability that a row's text states are zeros (an empty prompt,
    for classifier-free guidance), drawn from (training.seed, micro-batch, row), so resumes are exact. BAGEL: the
    probability that a sample's caption / instruction is left out (BAGEL's text_cond_dropout_prob)."""
    vit_cond_dropout: float = 0.0
    """BAGEL (docs/bagel.md "Data"): the probability that an editing source's ViT split is left out (BAGEL's
    vit_cond_dropout_prob; 0.4 in its DataConfig), drawn from (training.seed, sample, epoch): image guidance's
    training half."""
    vae_cond_dropout: float = 0.0
    """BAGEL: the probability that an editing source's clean VAE split is left out (BAGEL's vae_cond_dropout_prob;
    0.1 in its DataConfig), drawn as vit_cond_dropout."""


@dataclass
class Training:
    steps: int = 100
    """Optimizer steps to train for (counted from step 0, resumes included)."""
    global_batch_size: int = 0
    """Rows per optimizer step over all data-parallel ranks. 0: micro_batch_size x dp degree (no
    gradient accumulation). Must be a multiple of micro_batch_size x dp degree. It fixes the data stream
    (global_batch_size / micro_batch_size micro-batch slots): set it for runs that must give the same samples,
    or resume, on another number of ranks (0 ties it to the dp degree)."""
    max_norm: float = 1.0
    """Clip the global gradient norm (over every mesh axis) to this value; 0 disables clipping."""
    seed: int = 0
    """Seed for model init, data order and dropout-like randomness."""
    deterministic: bool = False
    """Use deterministic algorithms (bitwise-reproducible on CPU; slower on GPU)."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype parameters are computed in (FSDP mixed precision); master weights stay fp32. float16 (GPUs without
    bf16) turns on dynamic loss scaling (loss_scale_init, loss_scale_growth_interval). On CPU bfloat16 and float16
    compute in float32; the float16 loss scaler still runs there."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of gradient reductions across data-parallel ranks (float16 only with param_dtype=float16, whose loss
    scaler catches a reduction that overflows)."""
    loss_scale_init: float = 65536.0
    """param_dtype=float16: the first loss scale. The backward runs on loss x scale; a step whose gradients are
    not finite on any rank is skipped (logged as skipped, not a NaN-policy event) and halves the scale. A power of
    two keeps scaling exact."""
    loss_scale_growth_interval: int = 2000
    """param_dtype=float16: finite steps in a row after which the loss scale doubles."""
    nan_policy: Literal["skip", "stop"] = "stop"
    """A non-finite loss or grad norm: skip (drop the update, count it, go on) or stop with an error."""
    max_skipped_steps: int = 10
    """With nan_policy=skip: stop after this many skipped steps in a row."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (0: leave it to Python)."""


@dataclass
class Optimizer:
    name: Literal["adamw", "muon"] = "adamw"
    """Optimizer: adamw, or muon (Muon for the matrices inside the model's blocks, AdamW for embeddings, the
    output head, norms and biases; one optimizer, one schedule; docs/optimizers.md)."""
    lr: float = 3e-4
    """Peak learning rate. Muon's too, scaled per matrix by muon_adjust_lr."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay for matrices."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to norm weights and biases."""
    decay_embeddings: bool = False
    """Also apply weight decay to the token embedding (and a tied output head)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW kernel: auto = fused on CUDA, foreach on CPU."""
    muon_momentum: float = 0.95
    """Muon: momentum of the gradient buffer (0 <= m < 1)."""
    muon_nesterov: bool = True
    """Muon: orthogonalize the Nesterov direction g + m * buffer instead of the buffer."""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations (quintic, Keller Jordan's coefficients)."""
    muon_adjust_lr: Literal["moonlight", "original", "none"] = "moonlight"
    """Muon: per-matrix lr scale of the orthogonalized update of an A x B matrix: moonlight = 0.2 * sqrt(max(A, B))
    (the update's RMS matches AdamW's, so AdamW's lr and weight decay carry over), original = sqrt(max(1, A / B))
    (Keller Jordan's; wants a larger lr, ~0.02), none = 1."""
    muon_split_fused: bool = True
    """Muon: orthogonalize a fused weight (the family's fused q/k/v or gate/up, ModelSpec.fused_params) part by part,
    as if the projections were separate; false: the fused matrix whole."""


@dataclass
class LRScheduler:
    name: Literal["cosine", "wsd", "constant", "linear"] = "cosine"
    """Shape after warmup: cosine decay, warmup-stable-decay, constant, or linear decay."""
    warmup_steps: int = 0
    """Linear warmup from lr x warmup_start_factor to lr over this many steps."""
    warmup_start_factor: float = 0.0
    """Learning-rate multiplier at step 0 of the warmup."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of lr (cosine, linear, wsd)."""
    decay_ratio: float = 0.2
    """WSD: fraction of the steps spent decaying at the end."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """WSD: shape of the final decay."""


@dataclass
class Parallel:
    dp_replicate: int = 1
    """Data-parallel replicate degree (HSDP outer axis)."""
    dp_shard: int = -1
    """Data-parallel shard (FSDP) degree; -1 = whatever the world size leaves after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree."""
    cp: int = 1
    """Context-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (MoE)."""
    sequence_parallel: bool = True
    """With tp > 1: keep the residual stream split over tp along the sequence (norms on sequence shards,
    all-gather before attention / MLP, reduce-scatter after), when the model's plan supports it."""
    loss_parallel: bool = True
    """With tp > 1: split the output head over the vocabulary and compute the cross-entropy vocab-parallel,
    when the model's plan names its head (plan.loss_parallel; a tied head shards the token embedding too)."""
    encoder_tp: bool = False
    """With tp > 1: shard the modality encoders (Qwen3-VL: ViT attention / MLP, patch and DeepStack mergers)
    over tp as well; false: they are replicated over tp (every tp rank runs them on all images)."""
    encoder_balance: bool = False
    """Spread the vision tower's images over the data-parallel ranks by all-to-all (and send the features back)
    so that each rank's ViT work is about equal when its rows' images are not; same loss and gradients
    (titan_mm/parallel/encoder_balance.py, docs/parallel.md). Works with FSDP / HSDP and tp (also encoder_tp); not
    with pp > 1 or cp > 1."""
    cp_mode: Literal["ulysses", "ring", "allgather"] = "ulysses"
    """Context-parallel attention: ulysses (all-to-all sequence<->heads; cp x tp must divide the heads), ring
    (k/v blocks passed around the cp ranks, online softmax; one remote block in memory) or allgather
    (all-gather k/v). Batches are sharded load-balanced (titan_mm/parallel/cp.py)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto = nccl on CUDA, gloo on CPU."""
    fsdp_reshard_after_forward: Literal["always", "never"] = "always"
    """When FSDP2 frees the gathered (bf16) params of a block. always: after its forward, gathered again for
    its backward (the least memory). never: kept from its forward through its backward, so the backward
    gathers nothing (ZeRO-2-like): one unsharded copy of the weights more at the peak, one all-gather (and,
    with float8, one weight cast) less per block and step. Qwen3-1.7B on one H200: float8 +2.2 to +2.8% tokens/s
    for +1.1 GiB; bf16 +1.7% for +2.5 GiB (docs/benchmarks.md)."""
    fsdp_prefetch: int = 0
    """All-gathers FSDP2 issues ahead: block i's pre-forward prefetches blocks i+1 .. i+N, its pre-backward blocks
    i-1 .. i-N (the plan's FSDP units in model order). 0: FSDP2's own overlap (the next block, issued when the
    CPU reaches it). N >= 2 overlaps more communication for N-1 more gathered blocks in memory; it matters on
    several GPUs only (not measured yet: one GPU has nothing to gather)."""
    one_rank_mixed_precision: Literal["cast", "optimizer", "fsdp"] = "cast"
    """A one-process job with training.param_dtype below float32 (and no pipeline): how the compute copies of the
    fp32 master weights are made. cast: once per forward, in the autograd graph (the backward casts each gradient
    back into the fp32 .grad); the copies live as with fsdp_reshard_after_forward = never. fsdp: FSDP2 on a
    one-rank mesh, whose all-gather and reduce-scatter there are copies (63 ms of a 329 ms Qwen3-8B 12-layer step
    on the H200). The same losses and gradients bit for bit; with float8, close (tensorwise weights reach float8
    through the bf16 copy). optimizer: as cast, but the copies are kept between steps and the large parameters'
    gradients stay bfloat16; AdamW (titan_mm.train.cast_adamw) reads them and writes the fp32 weights and the next
    copies in one pass, so the backward's widening copy and the next forward's cast go (adamw, bfloat16 only;
    close to cast, not bit-equal: its own update kernel). titan_mm/parallel/apply.py, docs/benchmarks.md."""
    pp: int = 1
    """Pipeline-parallel degree: the trunk's blocks are cut into stages run on pp groups of ranks (the outermost
    mesh axis; world = pp x dp_replicate x dp_shard x cp x tp). Stage 0 also runs the embedding (and the vision
    tower), the last stage the final norm, head and loss (titan_mm/parallel/pipeline.py, docs/parallel.md)."""
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                         "DualPipeV"] = "1F1B"
    """torch.distributed.pipelining schedule. GPipe and 1F1B run one stage per rank; Interleaved1F1B, LoopedBFS and
    InterleavedZeroBubble run pp_virtual_stages stages per rank (looped placement); ZBVZeroBubble and DualPipeV
    run two stages per rank in a V (rank r holds stages r and 2 pp - 1 - r)."""
    pp_microbatches: int = 0
    """Micro-batches per step through the pipeline (the gradient-accumulation count under pp). 0: what
    training.global_batch_size / (data.micro_batch_size x dp) gives; with training.global_batch_size = 0 a
    value N sets the global batch to N x data.micro_batch_size x dp. At least pp (every stage busy)."""
    pp_virtual_stages: int = 0
    """Stages per rank; 0: the schedule's own (1 for GPipe / 1F1B, 2 for the others). The V schedules need 2."""
    pp_layers_per_stage: list[int] = field(default_factory=list)
    """Trunk blocks of each stage, in stage order (pp x pp_virtual_stages numbers summing to the block count;
    the first and last stage may take 0: the embedding or the head alone). Empty: pp_split_points, or the
    memory-balanced split (titan_mm.parallel.pipeline.balanced_split)."""
    pp_split_points: list[int] = field(default_factory=list)
    """Alternative to pp_layers_per_stage: the block index where each stage after the first begins
    (pp x pp_virtual_stages - 1 increasing numbers)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing of the plan's AC units: none, full, or selective."""
    selective_option: str = "op"
    """Selective AC: 'op' (save matmul outputs, recompute the rest) or an integer N (every N-th block)."""
    num_layers: int = 0
    """Apply the mode to the first N AC units only, in module order (Qwen3-VL: its vision blocks come before
    the decoder blocks); 0 = all. Every block's activations are alive when the backward starts (the peak
    without AC), so N blocks save N blocks' worth whichever they are; the first ones are recomputed last,
    when memory is lowest. E.g. mode=selective, num_layers=2 trims a step that is just over its memory
    budget for ~2 blocks of recomputed norms / RoPE / SwiGLU."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each compile unit of the plan (per transformer block)."""
    fullgraph: bool = False
    """Require one graph per compiled unit."""


@dataclass
class Float8:
    enable: bool = False
    """float8 (torchao) training for the linears (CUDA SM>=89 only)."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao float8 scaling recipe (rowwise_with_gw_hp: rowwise, with the weight-gradient GEMM in high precision,
    so without rowwise's column-wise casts of its operands). Qwen3-8B (12 layers, one H100, optimizer-owned copies):
    tensorwise 1.18x bf16, rowwise 0.95x (its casts cost more than its GEMMs save there; docs/benchmarks.md)."""
    rowwise_casts: Literal["torchao", "titan"] = "torchao"
    """recipe rowwise: torchao's Float8Linear, or titan: titan_mm.quant.rowwise's linear (the same three float8
    GEMMs, torch._scaled_mm, with titan_mm's Triton casts instead of torchao's compiled ones, which cost rowwise its
    gain on the 8B; not measured on a GPU yet). Single-device or FSDP; no tensor parallelism."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router", "gate"])
    """Linears with a dot-separated FQN component equal to one of these stay in high precision
    ("output" = lm head, "router"/"gate" = MoE routers; "gate_proj"-style names are not matched)."""
    precompute_scale: bool = True
    """tensorwise + FSDP: after each optimizer step compute every float8 weight's scale in one batched op
    (torchao precompute_float8_dynamic_scale_for_fsdp) instead of one amax per weight inside every FSDP
    all-gather (Qwen3-1.7B on the H200: 43.4k vs 36.5k tokens/s, same losses). The rowwise recipe has no
    per-tensor weight scale to precompute: there it is not used."""
    moe_experts: bool = False
    """The MoE experts' grouped GEMMs in float8 too (torchao's rowwise-scaled float8 grouped GEMM, forward and
    backward; the experts carry most of a MoE model's FLOPs and are no nn.Linear, so float8.enable leaves them in
    bf16). Independent of enable and recipe. The routing then pads each expert's token group to a multiple of 16
    rows on the device (no host sync). Needs a MoE model, a CUDA SM>=90 GPU, training.param_dtype bfloat16 and
    torchao with prototype.moe_training (>= 0.17); titan_mm/nn/moe.py, docs/kernels.md. Refused for now (a config
    error): it ran at 0.70x bf16; bench/mfu.py measures it (TITAN_MEASURE_FLOAT8_EXPERTS=1)."""


@dataclass
class Checkpoint:
    enable: bool = True
    """Write checkpoints and auto-resume from the newest complete one in the run folder."""
    folder: str = "checkpoints"
    """Sub-folder of the run folder holding step-NNNNNNNN checkpoints."""
    interval: int = 50
    """Save every N steps (the last step is always saved)."""
    keep_last: int = 2
    """Keep the newest K complete checkpoints; older ones are deleted (0 = keep all)."""
    async_mode: Literal["disabled", "async"] = "async"
    """async: dcp.async_save, training continues while it writes; disabled: blocking save."""
    load_step: int = -1
    """Resume from this step's checkpoint; -1 = newest complete one."""
    resume: bool = True
    """Auto-resume when the run folder holds a checkpoint."""
    save_on_signal: bool = True
    """On SIGTERM / SIGINT (Slurm preemption, Ctrl-C): finish the current step, save a checkpoint (blocking),
    exit with code 128 + signal (143 / 130). After it a SIGINT exits at once without saving; a repeated SIGTERM
    is ignored (a preempted torchrun worker gets two)."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Print a console line every N steps (metrics.jsonl gets every step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard events to <run>/tb."""
    enable_jsonl: bool = True
    """Write one JSON line per step to <run>/metrics.jsonl."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one device for MFU; 0 = look it up by device name (989 for H100/H200)."""
    wandb: bool = False
    """Also log the step metrics to Weights & Biases from rank 0 (needs `pip install wandb`); the resolved
    config becomes the wandb run's config, and a resumed run continues the same wandb run (<run>/wandb_id)."""
    wandb_project: str = "titan_mm"
    """The wandb project of the run (the wandb run's name is job.name)."""
    wandb_mode: Literal["online", "offline"] = "online"
    """online: stream to the wandb server; offline: write <run>/wandb/ only (upload later with `wandb sync`)."""
    prometheus_port: int = 0
    """Serve the latest step metrics at http://<rank-0 host>:PORT/metrics for Prometheus (gauges
    titan_mm_<metric>, names with / as _, plus titan_mm_step); 0 = off."""
    profile_every: int = 0
    """Every N steps, profile the last metrics.profile_steps steps of the N with torch.profiler and log
    profile/comm_overlap_pct and profile/gpu_idle_pct (docs/training.md); 0 = off (no profiler cost)."""
    profile_steps: int = 2
    """Steps in each profiler window (must be < metrics.profile_every)."""
    profile_traces: bool = False
    """Also write each window of rank 0 as <run>/profile/step<N>.json (a Chrome / Perfetto trace) and step<N>.txt
    (the ops by device time, then by host time)."""


@dataclass
class Kernels:
    mode: Literal["auto", "triton", "reference"] = "auto"
    """auto: Triton kernels on CUDA SM>=80, PyTorch reference elsewhere; triton forces them; reference disables them."""
    ops: str = "all"
    """Which ops come from titan_mm.kernels when kernels are on: "all", "none", a comma list (rms_norm,
    add_rms_norm, swiglu, rope, linear_cross_entropy, bias_gelu, moe_moves, moe_routing, norm_rope_cache) or "all,-op"
    (docs/kernels.md)."""


@dataclass
class Objective:
    kind: Literal["causal", "masked_diffusion", "shifted_diffusion", "block_diffusion"] = "causal"
    """What the model learns (docs/dllm.md). causal: the next token, causal attention. masked_diffusion (LLaDA):
    per document t ~ U[eps, 1], each maskable token becomes objective.mask_token with probability t, attention is
    bidirectional within the document, loss = sum over masked tokens of CE / t over the global count of maskable
    tokens. shifted_diffusion (Dream): the same, but hidden state i predicts token i + 1 (an autoregressive HF
    checkpoint is a good init). block_diffusion (SDAR / BD3-style): t per block of block_size tokens, block-causal
    attention (autoregressive across blocks, diffusion within one)."""
    eps: float = 1e-3
    """Smallest mask probability: t = eps + (1 - eps) * u with u ~ U[0, 1) (LLaDA's eps); the loss weight is 1/t."""
    block_size: int = 32
    """block_diffusion: tokens per block; blocks restart at every document's first token."""
    mask_token: str = "auto"
    """The token masked positions become. auto: the tokenizer's <|mask|> (or <|MASK|>) when it has one, else the
    first id after the tokenizer's last one when the embedding has that row (Qwen3: 151669 of 151936, SDAR's
    choice), with synthetic data vocab_size - 1. Or a token of the tokenizer ("<|mask|>"), or a decimal id."""
    sft: bool = False
    """Diffusion SFT: only the tokens the data marks as targets (assistant turns) are masked and scored, prompts
    stay clean, and the loss is normalized by the global count of target tokens. False: every token of a document
    may be masked (pre-training)."""
    flow_sampler: str = ""
    """Flow matching (the latents of Wan, BAGEL): how t is drawn, "uniform", "logit_normal" or "shifted"
    (titan_mm/objectives/flow_matching.py); empty: the family's choice."""
    flow_shift: float = 0.0
    """Flow matching: the timestep shift t' = s t / (1 + (s - 1) t) after the sampler (diffusers'
    FlowMatchEulerDiscreteScheduler shift; Wan samples with 3 to 5 at 480p); 0: the family's (1: none)."""
    flow_weighting: str = ""
    """Flow matching: the loss weight w(t), "none", "cosmap" (SD3), "sigma_sqrt" (diffusers': 1 / t^2) or "bell"
    (DiffSynth-Studio's Wan weight, mean 1 over its shifted sigmas); empty: the family's."""


@dataclass
class Eval:
    interval: int = 0
    """Evaluate every N training steps and at the last step (docs/eval.md); 0 = no online eval."""
    dataset: str = ""
    """Held-out loss source, in [data]'s syntax (path, glob, URL, builtin:<name>); empty with no mixture: none."""
    mixture: dict[str, float] = field(default_factory=dict)
    """Several held-out sources, {source: weight}; each is scored on its own (eval/<name>/loss) and eval/loss is
    their weighted mean. Replaces ``dataset`` when given."""
    max_batches: int = 4
    """Global batches (training.global_batch_size rows) scored per source, the same ones at every eval."""
    tasks: list[str] = field(default_factory=list)
    """Generation tasks run through the serving engine on the live weights: digits (VL: held-out digit images),
    qa (held-out text QA, exact match), dtmf / dtmf_digits / dtmf_seq (Omni: held-out key tones, one key alone or
    with a digits image, or 1-6 keys), or a JSONL file
    of {"messages" | "prompt", "reference"} lines, scored by exact match or by "FILE.jsonl|pkg.module:function"
    (function(prediction, reference) -> float)."""
    task_limit: int = 64
    """Prompts per generation task (0: all)."""
    max_new_tokens: int = 16
    """Greedy tokens generated per prompt."""
    tasks_every_checkpoints: int = 0
    """Run the generation tasks at an eval only when this many checkpoints were saved since they last ran (and
    always at the last step); 0 = at every eval."""


@dataclass
class Rl:
    """GRPO-style post-training on rollouts of titan_mm's own serving engine on the live weights (docs/rl.md)."""

    enable: bool = False
    """Train a policy on sampled completions (the objective "policy" replaces the family's causal LM); the batches
    come from rollouts, not from [data] (whose seq_len bounds prompt + completion)."""
    prompts: str = "builtin:qa"
    """Prompts with references: builtin:qa (built-in QA, its training part; [eval] tasks = ["qa"] scores the held-out
    part), builtin:<name> of another built-in chat set, or a JSONL file of {"messages" | "prompt", "reference"}."""
    prompts_per_step: int = 4
    """Prompts per optimizer step (global); training.global_batch_size must be prompts_per_step x group_size."""
    group_size: int = 4
    """G: completions sampled per prompt; advantages are normalized within each group."""
    max_tokens: int = 8
    """Most tokens sampled per completion (prompt + completion must fit data.seq_len)."""
    temperature: float = 1.0
    """Sampling temperature (> 0). The importance ratio uses the model's own logprobs (temperature 1), as the
    engine reports them."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens whose probability reaches top_p."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends before the first one (besides the model's EOS tokens)."""
    rewards: dict[str, float] = field(default_factory=lambda: {"exact_match": 1.0})
    """{reward: weight}, summed: exact_match (stripped completion == reference), numeric (the completion's first
    number equals the reference's), format (the completion ended by itself and matches rl.format_regex), or a
    function "pkg.module:function"(completion, reference) -> float."""
    format_regex: str = r"\s*-?\d+(\.\d+)?\s*"
    """The whole completion must match it (Python re.fullmatch) for the format reward."""
    std_normalize: bool = True
    """Advantage = (reward - group mean) / (group std + 1e-6); false: reward - group mean (Dr. GRPO)."""
    negative_scale: float = 1.0
    """Multiplies the negative advantages (completions below their group's mean): 1 is GRPO; below 1 weakens the
    push-down on wrong answers, whose freed probability goes to the whole vocabulary; 0 reinforces only the good ones."""
    loss_norm: Literal["token", "sequence"] = "token"
    """token: the loss is the mean over every completion token of the global batch (DAPO); sequence: each
    completion's token mean, averaged over completions (the original GRPO)."""
    eps_low: float = 0.2
    """Clip the importance ratio below at 1 - eps_low."""
    eps_high: float = 0.2
    """Clip it above at 1 + eps_high (DAPO's clip-higher: 0.28)."""
    kl_coef: float = 0.0
    """Weight of the KL term to the frozen reference (k3 estimator); 0: no reference model."""
    reference: str = "init"
    """The frozen reference of the KL term: init (model.hf_path, the weights this run started from) or a path of an
    HF folder or a titan_mm run / checkpoint."""
    staleness: int = 0
    """k: the rollouts a step trains on come from weights at most k steps old; 0: on-policy (made right before the
    step); k >= 1: the rollouts of step s + k are made at step s (what an asynchronous rollout worker allows)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallel: Parallel = field(default_factory=Parallel)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    kernels: Kernels = field(default_factory=Kernels)
    objective: Objective = field(default_factory=Objective)
    eval: Eval = field(default_factory=Eval)
    rl: Rl = field(default_factory=Rl)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _closest(key: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    if near:
        return "did you mean " + " or ".join(repr(n) for n in near) + "?"
    return "valid keys: " + ", ".join(sorted(valid))


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _check_type(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return all(_check_type(v, args[0]) for v in value) if args else True
    if origin is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any) -> Any:
    # TOML has no tuples; ints are fine where floats are expected.
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    return value


def from_dict(d: dict[str, Any], cls=JobConfig, where: str = "") -> Any:
    """Build a config dataclass from a nested dict; unknown keys and wrong types raise ConfigError."""
    if not isinstance(d, dict):
        raise ConfigError(f"[{where or 'root'}] must be a table of keys, got {d!r}")
    hints = _hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in d.items():
        path = f"{where}.{key}" if where else key
        if key not in hints:
            valid_paths = [f"{where}.{v}" if where else v for v in valid]
            raise ConfigError(f"unknown config key {path!r}: {_closest(path, valid_paths)}")
        tp = hints[key]
        if _is_section(tp):
            kwargs[key] = from_dict(value, tp, path)
            continue
        if not _check_type(value, tp):
            raise ConfigError(
                f"config key {path!r} has the wrong type: got {value!r} ({type(value).__name__}), "
                f"expected {_type_name(tp)}"
            )
        kwargs[key] = _coerce(value, tp)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def all_keys(cls=JobConfig, prefix: str = "") -> list[str]:
    """Every leaf key as a dotted path (``training.steps``, ...)."""
    out = []
    for name, tp in _hints(cls).items():
        path = f"{prefix}{name}"
        if _is_section(tp):
            out += all_keys(tp, path + ".")
        else:
            out.append(path)
    return out


def _leaf_type(key: str, cls=None) -> Any:
    cls = cls or JobConfig
    head, _, rest = key.partition(".")
    tp = _hints(cls).get(head)
    return _leaf_type(rest, tp) if rest and tp is not None and _is_section(tp) else tp


_BOOL_WORDS = {"true": "True", "false": "False", "yes": "True", "no": "False", "on": "True", "off": "False",
               "1": "True", "0": "False"}


def _normalize_bools(argv: list[str]) -> list[str]:
    """``--checkpoint.resume false`` as well as ``False`` (tyro takes only the capitalized spelling)."""
    out = list(argv)
    for i, a in enumerate(out):
        if not a.startswith("--"):
            continue
        flag, eq, value = a[2:].partition("=")
        if _leaf_type(flag.replace("-", "_")) is not bool:
            continue
        if eq:
            out[i] = f"--{flag}={_BOOL_WORDS.get(value.lower(), value)}"
        elif i + 1 < len(out) and not out[i + 1].startswith("--"):
            out[i + 1] = _BOOL_WORDS.get(out[i + 1].lower(), out[i + 1])
    return out


def resolve_config_path(name_or_path: str) -> Path:
    """A name in train_configs/ (with or without .toml) or a path to a TOML file."""
    p = Path(name_or_path)
    candidates = [p, CONFIG_DIR / p]
    if p.suffix != ".toml":  # "debug_qwen3" or "qwen3_1.7b" (whose ".7b" is not a suffix to replace)
        candidates += [Path(str(p) + ".toml"), CONFIG_DIR / (p.name + ".toml")]
    for c in candidates:
        if c.is_file():
            return c
    known = sorted(x.name for x in CONFIG_DIR.glob("*.toml")) if CONFIG_DIR.is_dir() else []
    hint = _closest(p.name, known) if known else f"no TOML files in {CONFIG_DIR}"
    raise ConfigError(
        f"config file {name_or_path!r} not found (looked in the current directory and {CONFIG_DIR}); "
        f"{hint.replace('valid keys', 'available configs')}"
    )


def load_toml(path: str | os.PathLike) -> JobConfig:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    try:
        return from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    config, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" or a == "--job.config_file":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a value: a name in train_configs/ or a path to a TOML file")
            config = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            config = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return config, rest


def _check_cli_args(argv: list[str]) -> None:
    """Unknown ``--section.key`` flags (with a difflib hint), stray words and values that do not parse as the
    field's type fail here in one line, before tyro (whose errors are boxes of a dozen lines)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a in ("--help", "-h"):
            continue
        if not a.startswith("--"):
            hint = (f"pass the config file as --config {a}" if a.endswith(".toml")
                    else "options take the form --section.key VALUE (--help lists them)")
            raise ConfigError(f"unexpected argument {a!r}: {hint}")
        flag, eq, text = a.partition("=")
        key = _cli_key(flag)
        values = [text] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        _check_cli_value(flag, _leaf_type(key), values)


def _cli_key(flag: str) -> str:
    """The field a ``--section.key`` flag sets (dashes or underscores); an unknown one raises with a hint."""
    key = flag[2:].replace("-", "_")
    if key not in all_keys():
        raise ConfigError(f"unknown command-line option {flag}: {_closest(key, all_keys())}")
    return key


def _check_cli_value(flag: str, tp: Any, values: list[str]) -> None:
    """``values`` (the words after ``flag``) parse as ``tp`` the way tyro will parse them."""
    if typing.get_origin(tp) is list:  # any number of words, each one element
        for v in values:
            _check_cli_value(flag, typing.get_args(tp)[0], [v])
        return
    if not values:
        raise ConfigError(f"{flag} needs a value ({'true or false' if tp is bool else _type_name(tp)})")
    if len(values) > 1:
        raise ConfigError(f"{flag} takes one value ({_type_name(tp)}), got {len(values)}: {' '.join(values)}")
    text = values[0]
    if typing.get_origin(tp) is dict:
        _json_object(text, flag)
        return
    if tp is bool:
        ok = text in ("True", "False") or text.lower() in _BOOL_WORDS
    elif tp in (int, float):
        try:
            tp(text)
            ok = True
        except ValueError:
            ok = False
    elif typing.get_origin(tp) is Literal:
        ok = text in [str(c) for c in typing.get_args(tp)]
    else:  # str, str | None: any word
        ok = True
    if not ok:
        want = "true or false" if tp is bool else _type_name(tp)
        raise ConfigError(f"{flag} expects {want}, got {text!r}")


def _cli_values(argv: list[str]) -> dict[str, str | None]:
    """{section.key: value} of the flags in ``argv`` (the last one wins, as in tyro); None: no value given."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            flag, eq, value = a[2:].partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[flag.replace("-", "_")] = value if eq else nxt
    return out


def _json_object(text: str, flag: str) -> dict:
    """A dict-typed field's command-line value: one JSON object (mixtures: '{"a/*.jsonl": 0.7, "b": 0.3}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} must be a JSON object like '{{\"a/*.jsonl\": 0.7, \"b.parquet\": 0.3}}', "
                          f"got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object like '{{\"a/*.jsonl\": 0.7}}', got {text!r}")
    return value


def _cli_registry():
    """tyro reads a dict-typed field (data.mixture) as one JSON-object flag, not one flag per default key."""
    registry = ConstructorRegistry()

    @registry.primitive_rule
    def _dict_as_json(info):
        if typing.get_origin(info.type) is not dict:
            return None
        return PrimitiveConstructorSpec(
            nargs=1, metavar="JSON", instance_from_str=lambda args: _json_object(args[0], "the value"),
            is_instance=lambda v: isinstance(v, dict), str_from_instance=lambda v: [json.dumps(v)])

    return registry


def _check_data_flags(given: dict[str, str | None]) -> None:
    """--S.dataset and --S.mixture (S: data, eval) each replace the TOML's source; both at once is ambiguous."""
    for sec in ("data", "eval"):
        if f"{sec}.dataset" in given and f"{sec}.mixture" in given:
            raise ConfigError(f"--{sec}.dataset and --{sec}.mixture are both given: pass one (--{sec}.dataset PATH "
                              f"for one source, or --{sec}.mixture '{{\"a/*.jsonl\": 0.7, \"b.parquet\": 0.3}}')")
        text = given.get(f"{sec}.mixture")
        if text is not None and not _json_object(text, f"--{sec}.mixture"):
            raise ConfigError(f"--{sec}.mixture '{{}}' names no source: give '{{\"a/*.jsonl\": 0.7, ...}}', or one "
                              f"source with --{sec}.dataset PATH")


def check_mixture(mixture: dict, key: str = "data.mixture") -> None:
    """Every ``key`` (a mixture) entry is a non-empty source name with a positive, finite weight."""
    for src, w in mixture.items():
        if not str(src).strip():
            raise ConfigError(f"{key} has an empty source name (weight {w!r}): name a path, URL or builtin:NAME")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"{key} entry {src!r}: {w!r} is not a positive number (weights are relative "
                              f"sampling rates, for example 0.3)")


def load_config(argv: list[str] | None = None) -> JobConfig:
    """TOML (``--config NAME_OR_PATH``, optional) then command-line overrides through tyro.

    The run name defaults to the config file's stem.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_name, rest = _split_config_arg(argv)
    if config_name is not None:
        path = resolve_config_path(config_name)
        cfg = load_toml(path)
        if not cfg.job.name:
            cfg.job.name = path.stem
    else:
        cfg = JobConfig()
    _check_cli_args(rest)
    rest = _normalize_bools(rest)
    given = _cli_values(rest)
    _check_data_flags(given)
    cfg = tyro.cli(
        JobConfig,
        default=cfg,
        args=rest,
        prog="run_train.sh --config NAME_OR_PATH",
        description="titan_mm trainer. TOML values (--config) are overridden by these flags.",
        config=(tyro.conf.FlagConversionOff,),
        registry=_cli_registry(),
    )
    for sec in (cfg.data, cfg.eval):
        name = "data" if sec is cfg.data else "eval"
        if f"{name}.dataset" in given and sec.mixture:
            log.warning(f"--{name}.dataset {sec.dataset!r} replaces the config file's [{name}.mixture] "
                        f"({len(sec.mixture)} sources)")
            sec.mixture = {}
    if not cfg.job.name:
        cfg.job.name = "run"
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that a type cannot express."""
    t, d = cfg.training, cfg.data
    if t.steps < 0:
        raise ConfigError(f"training.steps must be >= 0, got {t.steps}")
    if d.micro_batch_size < 1:
        raise ConfigError(f"data.micro_batch_size must be >= 1, got {d.micro_batch_size}")
    if d.seq_len < 1:
        raise ConfigError(f"data.seq_len must be >= 1, got {d.seq_len}")
    if d.streams_per_slot < 1:
        raise ConfigError(f"data.streams_per_slot must be >= 1, got {d.streams_per_slot}")
    if not 0 <= d.prompt_dropout <= 1:
        raise ConfigError(f"data.prompt_dropout must be in [0, 1], got {d.prompt_dropout}")
    if d.balance not in typing.get_args(_hints(Data)["balance"]):
        raise ConfigError(f"data.balance must be one of 'none', 'lpt', 'kk', got {d.balance!r}")
    if t.global_batch_size < 0:
        raise ConfigError(f"training.global_batch_size must be >= 0, got {t.global_batch_size}")
    if cfg.checkpoint.interval < 1:
        raise ConfigError(f"checkpoint.interval must be >= 1, got {cfg.checkpoint.interval}")
    if cfg.metrics.log_freq < 1:
        raise ConfigError(f"metrics.log_freq must be >= 1, got {cfg.metrics.log_freq}")
    if not 0 <= cfg.optimizer.muon_momentum < 1:
        raise ConfigError(f"optimizer.muon_momentum must be in [0, 1), got {cfg.optimizer.muon_momentum}")
    if cfg.optimizer.muon_ns_steps < 1:
        raise ConfigError(f"optimizer.muon_ns_steps must be >= 1, got {cfg.optimizer.muon_ns_steps}")
    check_mixture(d.mixture)
    _validate_eval(cfg.eval)
    _validate_metrics(cfg.metrics)
    _validate_precision(cfg)
    _validate_parallel(cfg.parallel)
    _validate_objective(cfg.objective)
    _validate_rl(cfg)
    if cfg.model.overrides:
        try:
            o = json.loads(cfg.model.overrides)
        except json.JSONDecodeError as e:
            raise ConfigError(f"model.overrides must be a JSON object, got {cfg.model.overrides!r}: {e}") from None
        if not isinstance(o, dict):
            raise ConfigError(f"model.overrides must be a JSON object, got {cfg.model.overrides!r}")


def _validate_eval(e: Eval) -> None:
    check_mixture(e.mixture, "eval.mixture")
    for name in ("interval", "max_batches", "task_limit", "tasks_every_checkpoints"):
        if getattr(e, name) < 0:
            raise ConfigError(f"eval.{name} must be >= 0, got {getattr(e, name)}")
    if e.max_new_tokens < 1:
        raise ConfigError(f"eval.max_new_tokens must be >= 1, got {e.max_new_tokens}")
    if (e.tasks or e.dataset or e.mixture) and not e.interval:
        log.warning("[eval] names sources or tasks but eval.interval is 0: no online eval (python -m titan_mm.eval "
                    "scores checkpoints)")


def _validate_objective(o: Objective) -> None:
    if not 0.0 < o.eps < 1.0:
        raise ConfigError(f"objective.eps must be in (0, 1) (the smallest mask probability), got {o.eps}")
    if o.block_size < 1:
        raise ConfigError(f"objective.block_size must be >= 1 (tokens per diffusion block), got {o.block_size}")
    if o.sft and o.kind == "causal":
        raise ConfigError("objective.sft applies to the diffusion kinds; the causal objective already scores only "
                          "the tokens the data labels: drop objective.sft or pick a diffusion objective.kind")


def _validate_rl(cfg: JobConfig) -> None:
    r = cfg.rl
    if not r.enable:
        return
    for name in ("prompts_per_step", "max_tokens"):
        if getattr(r, name) < 1:
            raise ConfigError(f"rl.{name} must be >= 1, got {getattr(r, name)}")
    if r.group_size < 2:
        raise ConfigError(f"rl.group_size must be >= 2 (advantages compare completions of one prompt), got "
                          f"{r.group_size}")
    if r.staleness < 0:
        raise ConfigError(f"rl.staleness must be >= 0 (0: on-policy), got {r.staleness}")
    if r.temperature <= 0 or not 0 < r.top_p <= 1:
        raise ConfigError(f"rl.temperature must be > 0 and rl.top_p in (0, 1], got {r.temperature} and {r.top_p}")
    if not (0 <= r.eps_low < 1 and r.eps_high >= 0) or r.kl_coef < 0:
        raise ConfigError(f"rl.eps_low must be in [0, 1), rl.eps_high and rl.kl_coef >= 0; got {r.eps_low}, "
                          f"{r.eps_high}, {r.kl_coef}")
    if r.negative_scale < 0:
        raise ConfigError(f"rl.negative_scale must be >= 0 (1: GRPO, 0: positive advantages only), got "
                          f"{r.negative_scale}")
    if not r.rewards:
        raise ConfigError("rl.rewards is empty; name at least one reward, e.g. {exact_match = 1.0}")
    rows = r.prompts_per_step * r.group_size
    if cfg.training.global_batch_size != rows:
        raise ConfigError(f"rl: training.global_batch_size ({cfg.training.global_batch_size}) must equal "
                          f"rl.prompts_per_step x rl.group_size = {rows} (one completion per row)")
    p = cfg.parallel
    if max(p.tp, p.cp, p.pp) > 1:
        raise ConfigError(f"rl.enable runs on data parallelism (FSDP / DDP) only for now (the policy hook reads "
                          f"whole-vocabulary logits); got parallel.tp={p.tp}, cp={p.cp}, pp={p.pp}: set them to 1")
    if cfg.objective.kind != "causal":
        raise ConfigError(f"rl.enable trains the policy objective; objective.kind={cfg.objective.kind!r} would "
                          "replace it: drop objective.kind")
    if cfg.eval.dataset or cfg.eval.mixture:
        raise ConfigError("rl.enable: a held-out loss (eval.dataset / eval.mixture) needs rollouts, which the held-out "
                          "text lacks; score the policy with eval.tasks (e.g. [\"qa\"]) instead")


def _validate_parallel(p: Parallel) -> None:
    if p.encoder_balance:
        for name in ("pp", "cp"):
            if getattr(p, name) > 1:
                raise ConfigError(f"parallel.encoder_balance is not supported with parallel.{name} > 1 (got "
                                  f"{getattr(p, name)}): set parallel.encoder_balance = false")
    if p.fsdp_prefetch < 0:
        raise ConfigError(f"parallel.fsdp_prefetch must be >= 0 (0 = FSDP2's own overlap), got {p.fsdp_prefetch}")
    if p.fsdp_prefetch and p.pp > 1:
        raise ConfigError("parallel.fsdp_prefetch is not supported with parallel.pp > 1 (a pipeline schedule runs its "
                          "stages' blocks out of model order): set parallel.fsdp_prefetch = 0")


def _validate_precision(cfg: JobConfig) -> None:
    t = cfg.training
    if cfg.parallel.one_rank_mixed_precision == "optimizer":
        if cfg.optimizer.name != "adamw":
            raise ConfigError(f"parallel.one_rank_mixed_precision='optimizer' needs optimizer.name='adamw' (its step "
                              f"writes the compute copies), got {cfg.optimizer.name!r}: use "
                              "--parallel.one_rank_mixed_precision cast")
        if t.param_dtype != "bfloat16":
            raise ConfigError(f"parallel.one_rank_mixed_precision='optimizer' keeps bfloat16 gradients, got "
                              f"training.param_dtype={t.param_dtype!r}: use --training.param_dtype bfloat16 or "
                              "--parallel.one_rank_mixed_precision cast")
    if cfg.model.attn_backend == "varlen" and t.param_dtype == "float32":
        raise ConfigError("model.attn_backend='varlen' runs flash kernels, which take bfloat16 / float16 only; use "
                          "--training.param_dtype bfloat16, or attn_backend flex / sdpa for float32")
    if cfg.float8.moe_experts and os.environ.get(MEASURE_FLOAT8_EXPERTS) != "1":
        # refused until a measurement pays: Qwen3-30B-A3B's titan_opt_f8 ran 80,732 tok/s against titan_opt's
        # 115,557 in the same H200 call (docs/benchmarks.md); it opens at >= 1.2x
        raise ConfigError("float8.moe_experts is refused: the float8 MoE experts ran at 0.70x the bf16 experts' "
                          "tokens/s (Qwen3-30B-A3B on the H200, docs/benchmarks.md) and stay off until a measurement "
                          "shows >= 1.2x; drop --float8.moe_experts (bf16 experts; --float8.enable still puts the "
                          "dense linears in float8)")
    if cfg.float8.moe_experts and t.param_dtype != "bfloat16":
        raise ConfigError(f"float8.moe_experts needs training.param_dtype='bfloat16' (the float8 grouped GEMMs take "
                          f"bf16 inputs), got {t.param_dtype!r}: use --training.param_dtype bfloat16 with it")
    if cfg.float8.rowwise_casts == "titan" and cfg.float8.recipe != "rowwise":
        raise ConfigError(f"float8.rowwise_casts='titan' is for float8.recipe='rowwise', got recipe="
                          f"{cfg.float8.recipe!r}: use --float8.recipe rowwise, or drop --float8.rowwise_casts")
    if cfg.float8.enable and cfg.float8.rowwise_casts == "titan" and cfg.parallel.tp > 1:
        raise ConfigError("float8.rowwise_casts='titan' has no tensor-parallel linear (its GEMMs take whole "
                          "tensors): use --parallel.tp 1, or --float8.rowwise_casts torchao")
    if t.param_dtype == "float16" and cfg.float8.enable:
        raise ConfigError("training.param_dtype='float16' with float8.enable: float8 needs an SM>=89 GPU, which has "
                          "bfloat16; use --training.param_dtype bfloat16 with float8")
    if t.reduce_dtype == "float16" and t.param_dtype != "float16":
        raise ConfigError(f"training.reduce_dtype='float16' needs training.param_dtype='float16' (its loss scaler "
                          f"catches an overflowing reduction), got param_dtype={t.param_dtype!r}; use float32")
    if not 0 < t.loss_scale_init < float("inf"):
        raise ConfigError(f"training.loss_scale_init must be a positive finite number, got {t.loss_scale_init}")
    if t.loss_scale_growth_interval < 1:
        raise ConfigError(f"training.loss_scale_growth_interval must be >= 1, got {t.loss_scale_growth_interval}")


def _validate_metrics(m: Metrics) -> None:
    if m.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.wandb is on but wandb is not installed: pip install wandb "
                          "(or pip install -e '.[wandb]'), or set --metrics.wandb False")
    if not 0 <= m.prometheus_port <= 65535:
        raise ConfigError(f"metrics.prometheus_port must be a TCP port (1-65535) or 0 for off, got {m.prometheus_port}")
    if m.profile_every < 0:
        raise ConfigError(f"metrics.profile_every must be >= 0 (0 = off), got {m.profile_every}")
    if m.profile_every and not 1 <= m.profile_steps < m.profile_every:
        raise ConfigError(f"metrics.profile_steps must be between 1 and metrics.profile_every - 1 "
                          f"({m.profile_every - 1}), got {m.profile_steps}")
    if m.profile_traces and not m.profile_every:
        raise ConfigError("metrics.profile_traces writes the profiler windows: set metrics.profile_every too")


# --------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} to TOML")


def resolved_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (None values are left out: they are the defaults)."""
    lines = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def save_config(cfg: JobConfig, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(resolved_toml(cfg))
    os.replace(tmp, path)


def run_dir(cfg: JobConfig) -> Path:
    return Path(cfg.job.dump_folder) / cfg.job.name


def field_docs(cls) -> dict[str, str]:
    """{field: docstring} of a section class, read from its source (the string after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
            out[a.target.id] = " ".join(b.value.value.split())
    return out


def markdown_reference() -> str:
    """docs/configs.md's field tables, generated from the dataclasses (``python -m titan_mm.config --markdown``)."""
    lines = []
    for sec in dataclasses.fields(JobConfig):
        cls = _hints(JobConfig)[sec.name]
        docs = field_docs(cls)
        lines += [f"### [{sec.name}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        default = cls()
        for f in dataclasses.fields(cls):
            tp = _type_name(_hints(cls)[f.name]).replace("|", "\\|")
            val = getattr(default, f.name)
            lines.append(f"| `{f.name}` | {tp} | `{_toml_value(val) if val is not None else 'None'}` | "
                         f"{docs.get(f.name, '').replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown_reference())
        raise SystemExit(0)
    try:
        c = load_config()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(resolved_toml(c))
