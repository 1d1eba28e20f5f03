"""The training loop: ``train(cfg, make_eval, make_data)`` (the command is titan_mm.launch.train).

    config -> process group + ParallelDims meshes -> ModelSpec (registry) -> build on meta ->
    parallelize (AC / compile / float8 / FSDP2) -> materialize (init or HF weights) -> optimizer, schedule ->
    data loader -> resume from the newest complete checkpoint -> loop: train_step, [eval] (a callback), metrics,
    async checkpoint.

Run folder ``<job.dump_folder>/<job.name>/``: config.toml (resolved), metrics.jsonl, tb/, checkpoints/.
A run whose folder is already at or past ``training.steps`` stops before anything is built or written.
One trainer per run folder: rank 0 holds ``run.lock`` (titan_mm.train.run_lock) from before the model build to the
end; a second trainer is refused with one line naming the holder and exits 2. A failed checkpoint write (a full
disk) is one line (``error: no space left on device writing checkpoint ...``) and exit 1; the last good one is kept.

SIGTERM / SIGINT (Slurm preemption, Ctrl-C; torchrun forwards them to every worker): the current step finishes,
a checkpoint is saved (``checkpoint.save_on_signal``), and the process exits with 128 + the signal number
(143 / 130) after one line ``interrupted at step N; checkpoint step-N saved; rerun the same command to resume``.
After it, Ctrl-C (SIGINT) ends the process at once (a save it cuts short stays uncommitted and the next start removes
it); a repeated SIGTERM is ignored (Slurm and torchrun each deliver one to a preempted worker).

Fault injection for tests (environment): ``TITAN_MM_FAULT_KILL_AT_STEP=k`` sends SIGKILL to this process in
the middle of step k+1 (after its data is fetched, before its update) - a crash, not a clean exit;
``TITAN_MM_FAULT_NAN_AT_STEP=k`` makes step k's loss NaN (exercises training.nan_policy);
``TITAN_MM_FAULT_HOLD_SAVE_AT_STEP=k`` makes the async save of step k hang before its commit;
``TITAN_MM_FAULT_ENOSPC_AT_STEP=k`` makes the save of step k find the disk full in the middle of its write.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from titan_mm.checkpoint_io import committed_step, step_dir_name
from titan_mm.config import ConfigError, JobConfig, resolved_toml, run_dir, save_config, to_dict
from titan_mm.kernels import export_picks, untuned_keys
from titan_mm.observe.health import StepTimes, peak_memory_gb, reset_peak_memory
from titan_mm.observe.metrics import build_logger
from titan_mm.observe.mfu import doc_lens_from_batch, encoder_inputs, mfu, peak_tflops
from titan_mm.observe.profile import ProfileWindow
from titan_mm.parallel.balance_dispatch import Rebalancer
from titan_mm.train.checkpoint import CheckpointManager, Topology
from titan_mm.train.preflight import preflight
from titan_mm.train.run_lock import hold_run_folder
from titan_mm.train.setup import KERNEL_PICKS, Run, build_data, pick_device, setup, setup_distributed, tune_kernels
from titan_mm.train.step import train_step


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


# ------------------------------------------------------------------------------------------------ signals
class Interrupted(Exception):
    """SIGTERM / SIGINT stopped the run after a step; ``code`` is the exit code (128 + the signal number)."""

    def __init__(self, msg: str, code: int):
        super().__init__(msg)
        self.code = code


class _StopSignals:
    """SIGTERM / SIGINT while installed: the first only sets a flag the loop reads after the step. Then SIGINT
    gets the default action: Ctrl-C again ends the process at once (even inside a hung save) and the save it cut
    short stays uncommitted. A repeated SIGTERM is ignored: under Slurm a preempted torchrun worker gets it twice,
    from Slurm and forwarded by torchrun, and must still save. Data-loader workers forked meanwhile inherit the
    handler and ignore SIGINT (a Ctrl-C reaches the whole process group); torch gives its workers their own
    SIGTERM handler (docs/training.md, "Checkpoint integrity, preemption, fresh starts")."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, rank: int):
        self.rank, self.signum, self._old, self._pid = rank, 0, {}, os.getpid()
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            self._old = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked loader worker
            return
        self.signum = signum
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.rank == 0:  # os.write: print() may be mid-write on this thread
            os.write(2, f"[titan_mm] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint; "
                        "Ctrl-C (SIGINT) again exits at once without saving\n".encode())

    def requested(self, world: int, device: torch.device) -> int:
        """The signal to stop for, the same on every rank (0: none): one tiny all-reduce per step when world > 1."""
        if world == 1:
            return self.signum
        flag = torch.tensor([self.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _interrupt(signum: int, state, ckpt: CheckpointManager, cfg: JobConfig) -> Interrupted:
    """Save (blocking) if configured, and the exception that carries the one closing line and the exit code."""
    head = f"interrupted at step {state.step}"
    if not cfg.checkpoint.enable:
        msg = f"{head}; no checkpoint saved (checkpoint.enable is false)"
    elif cfg.checkpoint.save_on_signal:
        msg = f"{head}; checkpoint {ckpt.ensure_saved(state).name} saved; rerun the same command to resume"
    else:
        ckpt.wait()
        prev = committed_step(ckpt.folder)
        msg = (f"{head}; no checkpoint saved (checkpoint.save_on_signal is false); rerun the same command to resume "
               + (f"from {step_dir_name(prev)}" if prev is not None else "from the start"))
    return Interrupted(msg, 128 + signum)


def check_resume_step(cfg: JobConfig, out_dir) -> None:
    """A resume at or past training.steps would train nothing: refuse it from commit.json alone, before anything is
    built or written (config.toml, tb/ and metrics.jsonl stay as they are)."""
    if not (cfg.checkpoint.enable and cfg.checkpoint.resume):
        return
    step = committed_step(out_dir / cfg.checkpoint.folder, cfg.checkpoint.load_step)
    if step is not None and step >= cfg.training.steps:
        raise ConfigError(f"run folder {out_dir} is already at step {step} >= training.steps {cfg.training.steps}; "
                          "raise --training.steps or use a new --job.name")


# ------------------------------------------------------------------------------------------------ loop
def train(cfg: JobConfig, make_eval: Callable[[Run], Any] | None = None,
          make_data: Callable[[Run], Any] | None = None) -> dict[str, Any]:
    """Run the job; returns a summary (final step, last loss, run folder). ``make_eval(run)``: the [eval] callback,
    an object with ``due(step) -> bool`` and ``(step, n_saved) -> metrics``, called after the step's update and
    before its save (titan_mm.eval.evaluator.online_eval builds it; train/ does not import eval/).
    ``make_data(run)``: the micro-batches in place of [data]'s loader (an [rl] job's rollouts: titan_mm.rl.rl_data),
    with the loader's state_dict / load_state_dict (and optionally metrics)."""
    preflight(cfg)  # every cheap user-error check, before the process group, the model and the run folder
    out_dir = run_dir(cfg)
    check_resume_step(cfg, out_dir)
    setup_distributed(cfg, pick_device(cfg))  # the process group first: the lock's verdict reaches every rank
    lock = hold_run_folder(out_dir)  # before anything heavy; RunLockError names the trainer that holds it
    try:
        return _train_locked(cfg, out_dir, make_eval, make_data)
    finally:
        lock.release()


def _train_locked(cfg: JobConfig, out_dir, make_eval, make_data=None) -> dict[str, Any]:
    """train() once the run folder is held: everything heavy."""
    run = setup(cfg)
    device, rank, world, pd, spec, model_cfg = run.device, run.rank, run.world, run.pd, run.spec, run.model_cfg
    state, ctx, n_micro = run.state, run.ctx, run.n_micro
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.toml")
        if cfg.job.print_config:
            print(resolved_toml(cfg))
    loader = make_data(run) if make_data else build_data(cfg, spec, model_cfg, run.dp_rank, run.dp_world, n_micro)
    state.dataloader = loader
    # after the loader: its state stays; a data callback places its own rows ([rl]: whole groups, one length)
    rebalance = None if make_data else Rebalancer.for_run(cfg.data.balance, run, cfg.model.flavor)
    model = state.model

    topo = Topology(world_size=world, dp_rank=run.dp_rank, dp_world=run.dp_world,
                    parallel={"dp_replicate": pd.dp_replicate, "dp_shard": pd.dp_shard, "cp": pd.cp, "tp": pd.tp,
                              "ep": pd.ep})
    ckpt = CheckpointManager(out_dir / cfg.checkpoint.folder, interval=cfg.checkpoint.interval,
                             keep_last=cfg.checkpoint.keep_last, async_mode=cfg.checkpoint.async_mode,
                             topology=topo, config_toml=resolved_toml(cfg), enable=cfg.checkpoint.enable)
    if cfg.checkpoint.resume:
        ckpt.resume(state, cfg.checkpoint.load_step)
    else:
        ckpt.set_aside()

    logger = build_logger(cfg.metrics, out_dir, total_steps=cfg.training.steps, rank=rank, run_name=out_dir.name,
                          run_config=to_dict(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"model {cfg.model.name}/{cfg.model.flavor if not cfg.model.hf_path else cfg.model.hf_path}: "
                f"{n_params / 1e6:.2f}M params; world {world} (dp {run.dp_world}, grad accum {n_micro}); "
                f"device {device}; run folder {out_dir}; starting at step {state.step}/{cfg.training.steps}")

    tune_report = tune_kernels(cfg, spec, model_cfg, pd, device, picks=state.extra.get(KERNEL_PICKS))
    if tune_report is not None:
        state.extra[KERNEL_PICKS] = export_picks()  # checkpointed with the train state: a resume launches the same
        tuned = sum(len(v) for v in tune_report["tuned"].values())
        logger.info(f"kernels: tuned {tuned} launch configs in {tune_report['seconds']:.1f}s"
                    + "".join(f"; {r}" for r in tune_report["skipped"]))
    check_untuned = bool(tune_report and tune_report["tuned"])
    evaluator = make_eval(run) if make_eval is not None else None
    n_saved = 0
    guard = ctx.nan_guard
    guard.nan_count = state.nan_count
    peak = peak_tflops(device, cfg.metrics.peak_tflops)
    times = StepTimes()
    window = ProfileWindow(cfg.metrics.profile_every, cfg.metrics.profile_steps, device,
                           out_dir / "profile" if cfg.metrics.profile_traces and rank == 0 else None)
    kill_at = int(os.environ.get("TITAN_MM_FAULT_KILL_AT_STEP", "-1"))
    inject_nan = int(os.environ.get("TITAN_MM_FAULT_NAN_AT_STEP", "-1"))
    if cfg.training.gc_freq > 0:
        gc.disable()
        gc.collect()

    last: dict[str, Any] = {}
    stop = _StopSignals(rank)
    try:
        batches = _Batches(loader)  # after the handlers: loader workers forked from here on inherit (and ignore) them
        while state.step < cfg.training.steps:
            ckpt.poll()
            reset_peak_memory(device)
            window.begin(state.step + 1)
            t0 = time.perf_counter()
            micro = batches.take(n_micro)
            if rebalance is not None:
                micro = rebalance(micro)
            data_wait = time.perf_counter() - t0
            if state.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            ctx.inject_nan = state.step + 1 == inject_nan
            res = train_step(state, micro, ctx)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if check_untuned:  # after the first step: keys the model met that tune_kernels did not cover
                check_untuned = False

                if untuned_keys():
                    logger.info(f"kernels: these launch-config keys ran untuned (first config): {untuned_keys()}")
            step_time = time.perf_counter() - t0
            times.add(step_time)
            # the family's FLOPs, plus the attention pairs the objective's mask adds (bidirectional / block-causal)
            flops = sum(ctx.objective.flops(spec, model_cfg, doc_lens_from_batch(mb), **encoder_inputs(mb))
                        for mb in micro)
            flops /= pd.tp * pd.cp  # this rank's rows are shared by its tp x cp group: per-GPU FLOPs
            m = {
                "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm, "tokens": res.tokens,
                "tokens_per_s": res.tokens / step_time,
                "mfu": mfu(flops, step_time, peak), "step_time_s": step_time, "data_wait_s": data_wait,
                "host_prepare_s": res.prepare_s,
                "step_time_p50_s": times.p50, "step_time_p90_s": times.p90,
                "mem_peak_gb": peak_memory_gb(device), "nan_count": guard.nan_count, "skipped": int(res.skipped),
            }
            m.update({f"loss/{t}": v for t, v in res.terms.items()})  # each term's global mean, and its count
            m.update({f"count/{t}": n for t, n in res.counts.items()})
            if res.aux_loss:
                m["aux_loss"] = res.aux_loss
            if rebalance is not None:  # measured: the ranks' step times, gathered at log steps
                m.update(rebalance.metrics(res.compute_s, measure=state.step % cfg.metrics.log_freq == 0))
            if res.loss_scale is not None:  # param_dtype float16
                m["loss_scale"] = res.loss_scale
            m.update(window.end(state.step))
            if evaluator is not None and evaluator.due(state.step):  # before the save: the checkpoint's weights
                m.update(evaluator(state.step, n_saved))
            if hasattr(loader, "metrics"):
                m.update({f"data/{k}": v for k, v in loader.metrics().items() if isinstance(v, (int, float))})
            state.nan_count = guard.nan_count
            logger.log(state.step, m)
            last = m
            if ckpt.should_save(state.step, cfg.training.steps):
                ckpt.save(state)
                n_saved += 1
            if cfg.training.gc_freq > 0 and state.step % cfg.training.gc_freq == 0:
                gc.collect()
            signum = stop.requested(world, device)
            if signum and state.step < cfg.training.steps:
                raise _interrupt(signum, state, ckpt, cfg)
    finally:
        window.close()
        try:
            ckpt.close()  # waits for the last async save: a failed one raises CheckpointSaveError here
        finally:
            logger.close()
            if cfg.training.gc_freq > 0:
                gc.enable()
            stop.restore()  # after close(): a signal during the last save's wait still gets the two-signal rule
    logger.info(f"done: step {state.step}, " + (f"loss {last['loss']:.4f}, " if last else "no step run, ")
                + f"step time p50 {times.p50:.3f}s p90 {times.p90:.3f}s; run folder {out_dir}")
    return {"step": state.step, "loss": last.get("loss"), "run_dir": str(out_dir)}
