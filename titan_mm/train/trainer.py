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

import gc
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_mm.config import ConfigError, JobConfig, load_config, resolved_toml, run_dir, save_config
from titan_mm.observe.health import NonFiniteError, StepTimes, peak_memory_gb, reset_peak_memory
from titan_mm.observe.metrics import MetricsLogger
from titan_mm.observe.mfu import doc_lens_from_batch, mfu, peak_tflops
from titan_mm.train.checkpoint import CheckpointError, CheckpointManager, Topology
from titan_mm.train.setup import setup, tune_kernels
from titan_mm.train.step import train_step


# ------------------------------------------------------------------------------------------------ data
def build_data(cfg: JobConfig, spec, model_cfg, dp_rank: int, dp_world: int, n_micro: int):
    if cfg.data.dataset == "synthetic":
        from titan_mm.train.synthetic import SyntheticLoader

        return SyntheticLoader(vocab_size=spec.dims(model_cfg).vocab_size, seq_len=cfg.data.seq_len,
                               micro_batch_size=cfg.data.micro_batch_size, n_micro=n_micro,
                               dp_rank=dp_rank, dp_world=dp_world, seed=cfg.training.seed)
    from titan_mm.data.loader import build_dataloader

    tok = cfg.data.tokenizer_path
    if tok is None and cfg.model.hf_path and (Path(cfg.model.hf_path) / "tokenizer.json").is_file():
        tok = cfg.model.hf_path
    return build_dataloader(cfg.data, needs=spec.data_needs(model_cfg), dp_rank=dp_rank, dp_world=dp_world,
                            seed=cfg.training.seed, tokenizer_path=tok)


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
    out_dir = run_dir(cfg)
    run = setup(cfg)
    device, rank, world, pd, spec, model_cfg = run.device, run.rank, run.world, run.pd, run.spec, run.model_cfg
    state, ctx, n_micro = run.state, run.ctx, run.n_micro
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.toml")
        if cfg.job.print_config:
            print(resolved_toml(cfg))
    loader = build_data(cfg, spec, model_cfg, run.dp_rank, run.dp_world, n_micro)
    state.dataloader = loader
    model = state.model

    topo = Topology(world_size=world, dp_rank=run.dp_rank, dp_world=run.dp_world,
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
                f"{n_params / 1e6:.2f}M params; world {world} (dp {run.dp_world}, grad accum {n_micro}); "
                f"device {device}; run folder {out_dir}; starting at step {state.step}/{cfg.training.steps}")

    tune_report = tune_kernels(cfg, spec, model_cfg, pd, device)
    if tune_report is not None:
        tuned = sum(len(v) for v in tune_report["tuned"].values())
        logger.info(f"kernels: tuned {tuned} launch configs in {tune_report['seconds']:.1f}s"
                    + "".join(f"; {r}" for r in tune_report["skipped"]))
    check_untuned = bool(tune_report and tune_report["tuned"])
    guard = ctx.nan_guard
    guard.nan_count = state.nan_count
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
                        for mb in micro)
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
