"""One ``setup(cfg)`` for the trainer and every bench script: device, process group, meshes, the model from the
registry (built on meta, parallelized, materialized), the optimizer and schedule, and the step context.

    run = setup(cfg)                       # cfg: titan_mm.config.JobConfig, read here and nowhere deeper
    result = train_step(run.state, micro_batches, run.ctx)

Everything a family decides comes from its ModelSpec (titan_mm.registry); nothing here names a family.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from titan_mm import kernels as K
from titan_mm.config import ConfigError, Data, JobConfig
from titan_mm.data.clips import build_clip_loader
from titan_mm.data.loader import build_dataloader
from titan_mm.data.packing import padded_seq_len
from titan_mm.data.tokenizer import tokenizer_for
from titan_mm.dtypes import torch_dtype
from titan_mm.loader import load_weights, model_from_config
from titan_mm.models.hf_io import local_hf_dir
from titan_mm.nn.init import seeded_init
from titan_mm.objectives import build_objective
from titan_mm.observe.health import NanGuard
from titan_mm.parallel.apply import cast_copies, parallelize
from titan_mm.parallel.clip import clip_grad_norm_
from titan_mm.parallel.encoder_balance import balance_group, balance_planner, check_family
from titan_mm.parallel.memory import pp_balance
from titan_mm.parallel.mesh import ParallelDims, init_distributed
from titan_mm.parallel.pipeline import StageBuilder, make_layout
from titan_mm.quant.float8 import float8_after_optimizer
from titan_mm.registry import ModelSpec
from titan_mm.train.optim import build_lr_scheduler, build_optimizer
from titan_mm.train.state import TrainState
from titan_mm.train.step import LossScaler, StepContext
from titan_mm.train.synthetic import SyntheticLoader


@dataclass
class Run:
    """What setup() built. ``state`` has no data loader yet: the trainer adds it (benches bring batches)."""

    device: torch.device
    rank: int
    world: int
    pd: Any
    """titan_mm.parallel.mesh.ParallelDims with its meshes built."""
    spec: ModelSpec
    model_cfg: Any
    model: torch.nn.Module
    state: Any
    """titan_mm.train.state.TrainState (model, optimizer, scheduler)."""
    ctx: Any
    """titan_mm.train.step.StepContext."""
    dp_rank: int
    dp_world: int
    n_micro: int
    """Micro-batches per optimizer step on this rank (gradient accumulation)."""


def pick_device(cfg: JobConfig) -> torch.device:
    want = cfg.job.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("job.device='cuda' but no CUDA device is visible; use --job.device auto or cpu")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def setup_distributed(cfg: JobConfig, device: torch.device) -> tuple[int, int]:
    """A process group for world > 1 (torchrun) and for CUDA (FSDP2 mixed precision on one GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and device.type == "cpu":
        return 0, 1

    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    if backend is None and device.type == "cpu":
        backend = "gloo"
    return init_distributed(backend)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def parallel_dims(cfg: JobConfig, world: int):
    """titan_mm.parallel.mesh.ParallelDims of ``[parallel]`` for ``world`` processes (meshes not built yet)."""
    try:
        return ParallelDims.from_config(cfg.parallel, world)
    except ValueError as e:
        raise ConfigError(f"[parallel] {e}") from None


def check_parallel(cfg: JobConfig, pd, spec: ModelSpec, model_cfg) -> None:
    """Reject degrees the model's shapes cannot take (ParallelDims.check_model) before anything is built: tp vs
    heads, ep on a dense model or not dividing the experts, the padded row length vs tp * 2 * cp, Ulysses heads
    vs cp * tp, cp on a model whose plan declares no context-parallel attention."""
    d = spec.dims(model_cfg)
    if cfg.parallel.encoder_balance:
        check_family(spec, model_cfg)
    if pd.cp > 1 and not spec.plan(model_cfg).cp:
        raise ConfigError(f"[parallel] cp={pd.cp}, but model {spec.name!r} does not support context parallelism "
                          "(its plan declares no CP attention: see its docs page); set parallel.cp = 1")
    try:
        pd.check_model(num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, num_experts=d.num_experts,
                       seq_len=padded_seq_len(cfg.data), cp_ulysses=cfg.parallel.cp_mode == "ulysses")
    except ValueError as e:
        raise ConfigError(f"[parallel] {e}") from None


def build_model(cfg: JobConfig, spec: ModelSpec, model_cfg, parallel_dims, device: torch.device, stages=None):
    """Meta build -> parallelize -> materialize (to_empty + init_weights), then HF weights if asked.

    Random init gives the same weights for every world size and layout (CPU or CUDA): under
    ``seeded_init`` each draw fills the full tensor from its own seeded generator and keeps the local shard
    (titan_mm/nn/init.py). HF weights come through titan_mm.loader.load_weights (the family's load_hf, which fills
    plain or FSDP-sharded models). ``stages`` (parallel.pp > 1): the titan_mm.parallel.pipeline.StageBuilder that
    prunes the meta model to this rank's pipeline stages, roots FSDP at them and draws the init in the full
    model's order."""
    with torch.device("meta"):
        model = spec.build(model_cfg)
    plan = spec.plan(model_cfg) if stages is None else stages.prune(model)  # pipeline: this rank's part of the plan
    model = parallelize(model, plan, parallel_dims, cfg, fsdp_roots=stages.modules if stages is not None else None)
    if stages is None:
        model.to_empty(device=device)
    else:
        stages.materialize(device)
    from_hf = bool(cfg.model.hf_path and cfg.model.init_from_hf)
    torch.manual_seed(cfg.training.seed)
    # with HF weights the random values are overwritten: a plain (local, sharding-dependent) draw is enough
    with torch.no_grad(), (contextlib.nullcontext() if from_hf else seeded_init(cfg.training.seed)):
        if stages is None:
            model.init_weights(buffer_device=device)
        else:
            with torch.device("meta"):
                full = spec.build(model_cfg)
            stages.init_weights(full, device)
    if from_hf:
        load_weights(model, spec, cfg.model.hf_path)
    torch.manual_seed(cfg.training.seed + 1)
    return model


def tune_kernels(cfg: JobConfig, spec: ModelSpec, model_cfg, pd, device: torch.device,
                 vision_tokens: int | None = None, picks: dict | None = None) -> dict | None:
    """Pick the Triton kernels' launch configs for this model's shapes once, before the first step.

    The forward never tunes (timing synchronizes the GPU, and the forward must stay sync-free): a key it
    meets untuned runs the kernel's first config. CUDA with kernels on only; TITAN_KERNELS_TUNE=0 skips the
    timing. Every rank tunes its own shapes (heads and MLP width per tp rank), then takes rank 0's picks, so
    replicated computations launch the same configs (and round alike) on every rank. None when skipped.

    ``picks``: the configs a resumed run launched before (its checkpoint's, ``KERNEL_PICKS`` in TrainState.extra),
    taken before any timing, so only keys without one are timed. Timed picks can differ between processes, and
    with them a reduction's rounding: two tuned runs of one config differed by one ulp in a loss on the H200."""
    kernels = spec.runtime(model_cfg).kernels
    if device.type != "cuda" or not kernels:
        return None

    if picks:
        K.load_picks(K.current_picks(picks))  # a checkpoint of an older titan_mm may hold configs it no longer has

    tokens = cfg.data.micro_batch_size * padded_seq_len(cfg.data) // max(1, pd.cp)  # this rank's rows of a micro-batch
    shapes = spec.kernel_shapes(model_cfg, tp=pd.tp, encoder_tp=cfg.parallel.encoder_tp and pd.tp > 1)
    report = K.tune_for_model(shapes, kernels, tokens, torch_dtype(cfg.training.param_dtype), device,
                              vision_tokens=vision_tokens)
    K.share_picks(src=0)  # a no-op in a single process
    return report


KERNEL_PICKS = "kernel_picks"
"""The TrainState.extra key of the kernels' launch configs (titan_mm.kernels.export_picks), saved with every
checkpoint so that a resumed run launches what the run before it launched (tune_kernels)."""


def data_parallel_groups(pd) -> tuple[int, int, Any, Any, int]:
    """(dp_rank, dp_world, loss_group, count_group, loss_world) of this rank, building the meshes: the "batch"
    mesh holds the ranks that read different rows (label counts are summed over it), the "loss" mesh the ranks
    whose loss sums add up. Without a process group: one rank, no groups."""
    if not pd.build_meshes():
        return 0, 1, None, None, 1
    batch_mesh, loss_mesh = pd.mesh("batch"), pd.mesh("loss")
    return (batch_mesh.get_local_rank(), batch_mesh.size(), loss_mesh.get_group(), batch_mesh.get_group(),
            loss_mesh.size())


def grad_accum_steps(cfg: JobConfig, dp_world: int) -> int:
    per_pass = cfg.data.micro_batch_size * dp_world
    pp_micro = cfg.parallel.pp_microbatches
    g = cfg.training.global_batch_size or per_pass * max(1, pp_micro)
    if g % per_pass:
        raise ConfigError(
            f"training.global_batch_size={g} is not a multiple of data.micro_batch_size "
            f"({cfg.data.micro_batch_size}) x data-parallel degree ({dp_world}) = {per_pass}"
        )
    if pp_micro and g // per_pass != pp_micro:
        raise ConfigError(f"parallel.pp_microbatches={pp_micro} but training.global_batch_size={g} gives "
                          f"{g // per_pass} micro-batches of {cfg.data.micro_batch_size} rows per dp rank; set one of "
                          "them only.")
    return g // per_pass


def pipeline_stages(cfg: JobConfig, spec: ModelSpec, model_cfg, pd, n_micro: int):
    """This rank's titan_mm.parallel.pipeline.StageBuilder (parallel.pp > 1): the configured split, else the
    memory-balanced one (titan_mm.parallel.memory.pp_balance)."""
    dims = spec.dims(model_cfg)
    try:
        layout = make_layout(cfg.parallel, dims.num_layers, n_micro,
                             balance=None if spec.memory_terms is None else  # no estimate: an even split
                             functools.partial(pp_balance, cfg, model_cfg, spec.plan(model_cfg), pd, n_micro),
                             fsdp=pd.fsdp_enabled or pd.ep_enabled or cfg.training.param_dtype != "float32")
        return StageBuilder(spec.plan(model_cfg), layout, pd.mesh("pp").get_local_rank(), dims)
    except ValueError as e:
        raise ConfigError(f"[parallel] {e}") from None


def build_data(cfg: JobConfig, spec: ModelSpec, model_cfg, dp_rank: int, dp_world: int, n_micro: int, *,
               data: Data | None = None, epochs: int = 0):
    """This dp rank's loader of the one global stream: n_micro x dp_world micro-batch slots per step, of which
    the rank reads its n_micro (titan_mm.data.loader.StreamLayout), so the steps' rows do not depend on the world.
    ``data``: another [data] section (held-out eval sources) in place of cfg.data; ``epochs`` > 0: a finite pass."""
    data = data or cfg.data
    if data.dataset == "synthetic":
        try:  # a family without tokens draws its own rows (ModelSpec.synthetic)
            make = spec.synthetic(model_cfg, data.seq_len) if spec.synthetic else None
        except ValueError as e:
            raise ConfigError(f"[data] {e}") from None
        return SyntheticLoader(vocab_size=spec.dims(model_cfg).vocab_size, seq_len=data.seq_len,
                               micro_batch_size=data.micro_batch_size, n_micro=n_micro,
                               dp_rank=dp_rank, dp_world=dp_world, seed=cfg.training.seed, make_batch=make)

    needs = spec.data_needs(model_cfg)
    if needs.clips is not None:  # captioned clips through the family's frozen encoders (titan_mm.data.clips)
        try:
            return build_clip_loader(data, needs.clips, dp_rank=dp_rank, dp_world=dp_world, n_micro=n_micro,
                                     seed=cfg.training.seed, epochs=epochs, device=str(pick_device(cfg)))
        except ValueError as e:
            raise ConfigError(f"[data] {e}") from None
    tok = tokenizer_for(data.tokenizer_path, local_hf_dir(cfg.model.hf_path) if cfg.model.hf_path else None)
    return build_dataloader(data, needs=spec.data_needs(model_cfg), dp_rank=dp_rank, dp_world=dp_world,
                            n_micro=n_micro, seed=cfg.training.seed, tokenizer_path=tok, epochs=epochs,
                            encode_device=str(pick_device(cfg)))  # a family's frozen encoder runs on the device


def setup(cfg: JobConfig, model_fn=None) -> Run:
    """Device, process group, meshes, model, optimizer, schedule and step context from ``cfg``.
    ``model_fn(spec, model_cfg, pd, device) -> nn.Module`` replaces build_model (bench/mfu.py's hand-built
    baseline); the rest is the same for it."""
    device = pick_device(cfg)
    rank, world = setup_distributed(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seed_everything(cfg.training.seed, cfg.training.deterministic)
    pd = parallel_dims(cfg, world)
    dp_rank, dp_world, loss_group, count_group, loss_world = data_parallel_groups(pd)
    spec, model_cfg = model_from_config(cfg, device)
    check_parallel(cfg, pd, spec, model_cfg)
    objective = build_objective(cfg, spec, model_cfg)  # the family's or [objective]'s; mistakes checked here
    n_micro = grad_accum_steps(cfg, dp_world)
    stages = pipeline_stages(cfg, spec, model_cfg, pd, n_micro) if pd.pp_enabled else None
    if stages is not None and model_fn is not None:
        raise ConfigError("parallel.pp > 1 builds the pipeline stages itself; run without model_fn (a hand-built "
                          "model).")
    model = (model_fn or functools.partial(build_model, cfg, stages=stages))(spec, model_cfg, pd, device)
    split = functools.partial(spec.param_groups, model, model_cfg) if spec.param_groups else None
    copies = cast_copies(model)  # parallel.one_rank_mixed_precision = optimizer: CastAdamW writes them
    optimizer = build_optimizer(model, cfg, split=split, plan=spec.plan(model_cfg),
                                fused=spec.fused_params(model_cfg) if spec.fused_params else None, copies=copies)
    t = cfg.training
    scaler = LossScaler(device, t.loss_scale_init, t.loss_scale_growth_interval) if t.param_dtype == "float16" else None
    state = TrainState(model=model, optimizer=optimizer, scheduler=build_lr_scheduler(optimizer, cfg), scaler=scaler)
    rt = spec.runtime(model_cfg)
    ctx = StepContext(
        device=device, attn_backend=rt.attn_backend, sliding_window=rt.sliding_window,
        max_norm=cfg.training.max_norm, loss_group=loss_group, count_group=count_group, dp_world=dp_world,
        loss_world=loss_world, nan_guard=NanGuard(cfg.training.nan_policy, cfg.training.max_skipped_steps),
        parallel_dims=pd, cp_mode=cfg.parallel.cp_mode,
        prepare_batch=functools.partial(spec.prepare_batch, model_cfg) if spec.prepare_batch else None,
        seq_keys=spec.schema().seq,  # with their trailing dims: the CP split cuts latents [B, S, C] on S
        after_optimizer=float8_after_optimizer(model, cfg.float8), objective=objective, dp_rank=dp_rank,
        encoder_balance=balance_planner(balance_group(pd)) if cfg.parallel.encoder_balance else None,
    )
    if copies is not None:  # the large gradients are held by the cast path, not in .grad
        ctx.clip_fn = functools.partial(clip_grad_norm_, grads_of=copies.grads_of)
    if stages is not None:  # the step runs the schedule; the grad norm covers every stage
        ctx.pipeline = stages.pipeline(pd.mesh("pp").get_group(), device)
        ctx.clip_fn = functools.partial(clip_grad_norm_, pp_group=pd.mesh("pp").get_group())
    return Run(device=device, rank=rank, world=world, pd=pd, spec=spec, model_cfg=model_cfg, model=model,
               state=state, ctx=ctx, dp_rank=dp_rank, dp_world=dp_world, n_micro=n_micro)
