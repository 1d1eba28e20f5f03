"""The training loop: ``python -m titan_mm.train.trainer --config debug_qwen3.toml [--section.key value ...]``.

    config -> process group + ParallelDims meshes -> ModelSpec (registry) -> build on meta ->
    parallelize (AC / compile / float8 / FSDP2) -> materialize (init or HF weights) -> optimizer, schedule ->
    data loader -> resume from the newest complete checkpoint -> loop: train_step, metrics, async checkpoint.

Run folder ``<job.dump_folder>/<job.name>/``: config.toml (resolved), metrics.jsonl, tb/, checkpoints/.

Fault injection for tests (environment): ``TITAN_MM_FAULT_KILL_AT_STEP=k`` sends SIGKILL to this process in
the middle of step k+1 (after its data is fetched, before its update) - a crash, not a clean exit;
``TITAN_MM_FAULT_NAN_AT_STEP=k`` makes step k's loss NaN (exercises training.nan_policy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_mm.config import ConfigError, JobConfig, load_config, resolved_toml, run_dir, save_config
from titan_mm.observe.health import NanGuard, NonFiniteError, StepTimes, peak_memory_gb, reset_peak_memory
from titan_mm.observe.metrics import MetricsLogger
from titan_mm.observe.mfu import doc_lens_from_batch, mfu, peak_tflops
from titan_mm.train.checkpoint import CheckpointError, CheckpointManager, Topology
from titan_mm.train.optim import build_lr_scheduler, build_optimizer
from titan_mm.train.state import TrainState
from titan_mm.train.step import StepContext, train_step


# ------------------------------------------------------------------------------------------------ setup
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
    from titan_mm.parallel.mesh import init_distributed

    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    if backend is None and device.type == "cpu":
        backend = "gloo"
    return init_distributed(backend)


def seed_everything(seed: int, deterministic: bool) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def resolve_model(cfg: JobConfig, device: torch.device):
    """(ModelSpec, model config) from the registry, with model.overrides / attn backend / kernels applied."""
    from titan_mm.registry import get_model_spec

    try:
        spec = get_model_spec(cfg.model.name)
    except KeyError as e:
        raise ConfigError(f"model.name: {e.args[0]}") from None
    m = cfg.model
    if m.hf_path:
        p = Path(m.hf_path)
        if not p.is_dir():
            raise ConfigError(f"model.hf_path {m.hf_path!r} is not a directory; give a local HF model folder "
                              "(config.json + *.safetensors), or drop model.hf_path to use a flavor")
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.hf_path {m.hf_path!r} has no config.json; it must be an HF model folder")
        model_cfg = spec.config_from_hf(str(p))
    else:
        if m.flavor not in spec.flavors:
            import difflib

            near = difflib.get_close_matches(m.flavor, list(spec.flavors), n=3, cutoff=0.4)
            raise ConfigError(f"model.flavor {m.flavor!r} is not a flavor of {m.name!r}; "
                              f"{'did you mean ' + ' or '.join(map(repr, near)) + '? ' if near else ''}"
                              f"available: {', '.join(spec.flavors)}")
        model_cfg = spec.flavors[m.flavor]
    fields = {f.name for f in dataclasses.fields(model_cfg)}
    kw: dict[str, Any] = json.loads(m.overrides) if m.overrides else {}
    unknown = [k for k in kw if k not in fields]
    if unknown:
        import difflib

        hints = {k: difflib.get_close_matches(k, list(fields), n=2) for k in unknown}
        raise ConfigError(f"model.overrides has unknown model-config fields {hints} (key: closest valid names)")
    if "attn_backend" in fields:
        backend = m.attn_backend
        if backend == "auto":
            backend = "flex" if device.type == "cuda" else "sdpa"
        kw.setdefault("attn_backend", backend)
    if "kernels" in fields:
        mode = cfg.kernels.mode
        from titan_mm.kernels import resolve_ops

        try:  # checked on every device, so a typo fails on the CPU too
            resolve_ops(cfg.kernels.ops)
        except ValueError as e:
            raise ConfigError(f"kernels.ops={cfg.kernels.ops!r}: {e}") from None
        on = mode == "triton" or (mode == "auto" and device.type == "cuda")
        kw.setdefault("kernels", cfg.kernels.ops if on else False)
    if kw:
        model_cfg = dataclasses.replace(model_cfg, **kw)
    return spec, model_cfg


def build_model(cfg: JobConfig, spec, model_cfg, parallel_dims, device: torch.device):
    """Meta build -> parallelize -> materialize (to_empty + init_weights), then HF weights if asked.

    Random init gives the same weights for every world size and layout (CPU or CUDA): under
    ``seeded_init`` each draw fills the full tensor from its own seeded generator and keeps the local shard
    (titan_mm/models/common/init.py). HF weights are loaded by the registry's load_hf, which fills plain or
    FSDP-sharded models."""
    from titan_mm.models.common.init import seeded_init
    from titan_mm.parallel.apply import parallelize

    with torch.device("meta"):
        model = spec.build(model_cfg)
    model = parallelize(model, spec.plan(model_cfg), parallel_dims, cfg)
    model.to_empty(device=device)
    from_hf = bool(cfg.model.hf_path and cfg.model.init_from_hf)
    torch.manual_seed(cfg.training.seed)
    # with HF weights the random values are overwritten: a plain (local, sharding-dependent) draw is enough
    with torch.no_grad(), (contextlib.nullcontext() if from_hf else seeded_init(cfg.training.seed)):
        model.init_weights(buffer_device=device)
    if from_hf:
        spec.load_hf(model, cfg.model.hf_path)
    torch.manual_seed(cfg.training.seed + 1)
    return model


def tune_kernels(cfg: JobConfig, model_cfg, pd, device: torch.device) -> dict | None:
    """Pick the Triton kernels' launch configs for this model's shapes once, before the first step.

    The forward never tunes (timing synchronizes the GPU, and the forward must stay sync-free): a key it
    meets untuned runs the kernel's first config. CUDA with kernels on only; TITAN_KERNELS_TUNE=0 skips the
    timing. Every rank tunes its own shapes (heads and MLP width per tp rank), then takes rank 0's picks, so
    replicated computations launch the same configs (and round alike) on every rank. None when skipped."""
    if device.type != "cuda" or not getattr(model_cfg, "kernels", False):
        return None
    from titan_mm import kernels as K

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.training.param_dtype]
    tokens = cfg.data.micro_batch_size * cfg.data.seq_len // max(1, pd.cp)  # this rank's rows of a micro-batch
    encoder_tp = bool(getattr(cfg.parallel, "encoder_tp", False)) and pd.tp > 1
    report = K.tune_for_model(model_cfg, tokens, dtype, device, tp=pd.tp, encoder_tp=encoder_tp)
    K.share_picks(src=0)  # a no-op in a single process
    return report


def check_parallel(cfg: JobConfig, pd, model_cfg) -> None:
    """Reject degrees the model's shapes cannot take (ParallelDims.check_model) before anything is built: tp vs
    heads, ep on a dense model or not dividing the experts, seq_len vs tp * 2 * cp, Ulysses heads vs cp * tp."""
    text = getattr(model_cfg, "text", model_cfg)  # Qwen3-VL: the LLM's shapes
    try:
        pd.check_model(num_heads=text.num_attention_heads, num_kv_heads=text.num_key_value_heads,
                       num_experts=text.num_experts, seq_len=cfg.data.seq_len,
                       cp_ulysses=getattr(cfg.parallel, "cp_mode", "ulysses") == "ulysses")
    except ValueError as e:
        raise ConfigError(f"[parallel] {e}") from None


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
    g = cfg.training.global_batch_size or per_pass
    if g % per_pass:
        raise ConfigError(
            f"training.global_batch_size={g} is not a multiple of data.micro_batch_size "
            f"({cfg.data.micro_batch_size}) x data-parallel degree ({dp_world}) = {per_pass}"
        )
    return g // per_pass


def build_data(cfg: JobConfig, model_cfg, dp_rank: int, dp_world: int, n_micro: int):
    if cfg.data.dataset == "synthetic":
        from titan_mm.train.synthetic import SyntheticLoader

        vocab = getattr(model_cfg, "vocab_size", None) or model_cfg.text.vocab_size
        return SyntheticLoader(vocab_size=vocab, seq_len=cfg.data.seq_len,
                               micro_batch_size=cfg.data.micro_batch_size, n_micro=n_micro,
                               dp_rank=dp_rank, dp_world=dp_world, seed=cfg.training.seed)
    from titan_mm.data.loader import build_dataloader

    tok = cfg.data.tokenizer_path
    if tok is None and cfg.model.hf_path and (Path(cfg.model.hf_path) / "tokenizer.json").is_file():
        tok = cfg.model.hf_path
    mrope = bool(getattr(cfg.data, "mrope", False)) or hasattr(model_cfg, "mrope_section")  # VL: 3-D positions
    return build_dataloader(cfg.data, dp_rank=dp_rank, dp_world=dp_world, seed=cfg.training.seed,
                            tokenizer_path=tok, mrope=mrope)


class _Batches:
    """Endless micro-batches from a loader (a finite loader starts a new pass when it runs out)."""

    def __init__(self, loader):
        self.loader = loader
        self.it = iter(loader)

    def take(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            try:
                out.append(next(self.it))
            except StopIteration:
                self.it = iter(self.loader)
                out.append(next(self.it))
        return out


# ------------------------------------------------------------------------------------------------ loop
def train(cfg: JobConfig) -> dict[str, Any]:
    """Run the job; returns a summary (final step, last loss, run folder)."""
    device = pick_device(cfg)
    rank, world = setup_distributed(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seed_everything(cfg.training.seed, cfg.training.deterministic)

    from titan_mm.parallel.apply import float8_after_optimizer
    from titan_mm.parallel.mesh import ParallelDims

    try:
        pd = ParallelDims.from_config(cfg.parallel, world)
    except ValueError as e:
        raise ConfigError(f"[parallel] {e}") from None
    dp_rank, dp_world, loss_group, count_group, loss_world = data_parallel_groups(pd)

    spec, model_cfg = resolve_model(cfg, device)
    check_parallel(cfg, pd, model_cfg)
    out_dir = run_dir(cfg)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.toml")
        if cfg.job.print_config:
            print(resolved_toml(cfg))
    model = build_model(cfg, spec, model_cfg, pd, device)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    n_micro = grad_accum_steps(cfg, dp_world)
    loader = build_data(cfg, model_cfg, dp_rank, dp_world, n_micro)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)

    topo = Topology(world_size=world, dp_rank=dp_rank, dp_world=dp_world,
                    parallel={"dp_replicate": pd.dp_replicate, "dp_shard": pd.dp_shard, "cp": pd.cp, "tp": pd.tp,
                              "ep": pd.ep})
    ckpt = CheckpointManager(out_dir / cfg.checkpoint.folder, interval=cfg.checkpoint.interval,
                             keep_last=cfg.checkpoint.keep_last, async_mode=cfg.checkpoint.async_mode,
                             topology=topo, config_toml=resolved_toml(cfg), enable=cfg.checkpoint.enable)
    if cfg.checkpoint.resume:
        ckpt.resume(state, cfg.checkpoint.load_step)

    logger = MetricsLogger(out_dir, total_steps=cfg.training.steps, log_freq=cfg.metrics.log_freq,
                           enable_jsonl=cfg.metrics.enable_jsonl, enable_tensorboard=cfg.metrics.enable_tensorboard,
                           rank=rank)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"model {cfg.model.name}/{cfg.model.flavor if not cfg.model.hf_path else cfg.model.hf_path}: "
                f"{n_params / 1e6:.2f}M params; world {world} (dp {dp_world}, grad accum {n_micro}); device {device}; "
                f"run folder {out_dir}; starting at step {state.step}/{cfg.training.steps}")

    tune_report = tune_kernels(cfg, model_cfg, pd, device)
    if tune_report is not None:
        tuned = sum(len(v) for v in tune_report["tuned"].values())
        logger.info(f"kernels: tuned {tuned} launch configs in {tune_report['seconds']:.1f}s"
                    + "".join(f"; {r}" for r in tune_report["skipped"]))
    check_untuned = bool(tune_report and tune_report["tuned"])
    guard = NanGuard(cfg.training.nan_policy, cfg.training.max_skipped_steps)
    guard.nan_count = state.nan_count
    ctx = StepContext(device=device, attn_backend=getattr(model_cfg, "attn_backend", "sdpa"),
                      sliding_window=getattr(model_cfg, "attn_sliding_window", None),
                      max_norm=cfg.training.max_norm, loss_group=loss_group, count_group=count_group,
                      dp_world=dp_world, loss_world=loss_world, nan_guard=guard, parallel_dims=pd,
                      cp_mode=getattr(cfg.parallel, "cp_mode", "ulysses"),
                      after_optimizer=float8_after_optimizer(model, cfg))
    peak = peak_tflops(device, cfg.metrics.peak_tflops)
    times = StepTimes()
    batches = _Batches(loader)
    kill_at = int(os.environ.get("TITAN_MM_FAULT_KILL_AT_STEP", "-1"))
    inject_nan = int(os.environ.get("TITAN_MM_FAULT_NAN_AT_STEP", "-1"))
    if cfg.training.gc_freq > 0:
        gc.disable()
        gc.collect()

    last: dict[str, Any] = {}
    try:
        while state.step < cfg.training.steps:
            ckpt.poll()
            reset_peak_memory(device)
            t0 = time.perf_counter()
            micro = batches.take(n_micro)
            data_wait = time.perf_counter() - t0
            if state.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            ctx.inject_nan = state.step + 1 == inject_nan
            res = train_step(state, micro, ctx)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if check_untuned:  # after the first step: keys the model met that tune_kernels did not cover
                check_untuned = False
                from titan_mm.kernels import untuned_keys

                if untuned_keys():
                    logger.info(f"kernels: these launch-config keys ran untuned (first config): {untuned_keys()}")
            step_time = time.perf_counter() - t0
            times.add(step_time)
            flops = sum(spec.flops(model_cfg, doc_lens_from_batch(mb),  # VL: grids let the vision tower count
                                   **{k: mb[k] for k in ("image_grid_thw", "video_grid_thw") if k in mb})
                        for mb in micro) if hasattr(spec, "flops") else 0.0
            flops /= pd.tp * pd.cp  # this rank's rows are shared by its tp x cp group: per-GPU FLOPs
            m = {
                "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm, "tokens": res.tokens,
                "label_tokens": res.label_tokens, "tokens_per_s": res.tokens / step_time,
                "mfu": mfu(flops, step_time, peak), "step_time_s": step_time, "data_wait_s": data_wait,
                "step_time_p50_s": times.p50, "step_time_p90_s": times.p90,
                "mem_peak_gb": peak_memory_gb(device), "nan_count": guard.nan_count, "skipped": int(res.skipped),
            }
            if res.aux_loss:
                m["aux_loss"] = res.aux_loss
            if hasattr(loader, "metrics"):
                m.update({f"data/{k}": v for k, v in loader.metrics().items() if isinstance(v, (int, float))})
            state.nan_count = guard.nan_count
            logger.log(state.step, m)
            last = m
            if ckpt.should_save(state.step, cfg.training.steps):
                ckpt.save(state)
            if cfg.training.gc_freq > 0 and state.step % cfg.training.gc_freq == 0:
                gc.collect()
    finally:
        ckpt.close()
        logger.close()
        if cfg.training.gc_freq > 0:
            gc.enable()
    logger.info(f"done: step {state.step}, loss {last.get('loss', float('nan')):.4f}, "
                f"step time p50 {times.p50:.3f}s p90 {times.p90:.3f}s; run folder {out_dir}")
    return {"step": state.step, "loss": last.get("loss"), "run_dir": str(out_dir)}


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except (ConfigError, CheckpointError, NonFiniteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
