"""FSDP2 weak scaling, loss equality and checkpoint resharding across GPUs (issue 7), through the real trainer.

For each model and each world size N in ``--nprocs`` this launches ``python -m titan_mm.launch.train``
(under ``torch.distributed.run --standalone`` when N > 1) on synthetic packed rows
(``data.dataset = synthetic``: row r of step t depends only on (seed, t, r), so every N sees the same
global batch) and reads the run's ``metrics.jsonl``:

* throughput: every run keeps ``micro_batch_size`` rows per GPU per micro-batch and the same global batch
  (``G = micro_batch_size x max(N)`` rows; smaller N accumulate ``max(N) / N`` micro-batches), so the work
  per GPU per micro-batch is constant (weak scaling). Tokens/s per GPU = median over the steps after
  ``--warmup`` of (global tokens / step time) / N; TFLOP/s per GPU from the registry FLOP counter over the
  step's real documents (recomputed here from the synthetic loader) / N; MFU against ``--peak-tflops``
  (989 = H100/H200 dense bf16); weak-scaling efficiency = tokens/s per GPU at N / at the smallest N.
* loss equality: steps 1..``--steps`` (20) of every N against the 1-GPU run (same weights, same global
  batch); loss and grad norm relative differences against the bounds below.
* resharding: the largest-N run of each ``--reshard-models`` model also writes a DCP checkpoint at step
  ``--steps / 2``; it is hard-linked into fresh run folders that resume on N/2 and on 1 process and train
  to ``--steps``; their losses must equal the writer's (same bounds).

Bounds (relative: |a - b| / |b|), GPU (bf16 compute, fp32 master weights, fp32 reductions):
  loss: step 1 <= 2e-3, steps 1..20 <= 1e-2; grad norm: step 1 <= 1e-2, steps 1..20 <= 5e-2.
  Why: at step 1 both runs hold the same weights and rows, so only the order of sums differs (sharded
  reductions, accumulation split) plus, under TP/CP, bf16 partial sums of split matmuls: each bf16 value
  moves by at most ~1 ulp (2^-8 = 3.9e-3 relative) and the loss, an fp32 mean over >= 32k tokens, averages
  those errors to well under one ulp. After an update the fp32 master weights differ in their last bits,
  their bf16 casts round differently here and there and AdamW normalizes tiny gradient differences into
  lr-sized ones, so differences grow with the steps; 1e-2 (about 2.5 bf16 ulps) over 20 steps leaves room
  for that and still catches real faults (a rank reading wrong rows, a missing or doubled gradient
  reduction, a wrong mask). Synthetic rows are uniform random tokens, so the loss stays near ln(vocab) and
  moves little: the grad norm (sensitive to every parameter) is the sharper check and is compared too.
CPU (--cpu: fp32 everywhere, gloo): both bounds are 1e-4 (fp32 reduction order only).

  python bench/scaling.py --nprocs 1,2,4,8                          # Qwen3-1.7B and Qwen3-8B, compile
  python bench/scaling.py --nprocs 1,2,4,8 --float8                 # + torchao float8 linears
  python bench/scaling.py --models qwen3_8b --nprocs 1,2            # one piece at a time (results merge)
  python bench/scaling.py --cpu                                     # gloo, tiny model, worlds 1,2 (tests)

Writes ``--out`` (bench/results/scaling.json; rows of earlier runs with other keys are kept) and prints
markdown tables. NCCL / NVLS / multicast environment variables are left as the machine has them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devices import device_label, device_of  # noqa: E402
PEAK_TFLOPS = 989.0

# GPU bounds (bf16) and CPU bounds (fp32); see the module docstring.
BOUNDS_GPU = dict(loss_step1=2e-3, loss=1e-2, gnorm_step1=1e-2, gnorm=5e-2)
BOUNDS_CPU = dict(loss_step1=1e-4, loss=1e-4, gnorm_step1=1e-4, gnorm=1e-4)

# name -> registry model, flavor, model.overrides, seq_len, micro_batch_size (rows per GPU), AC mode
MODELS = {
    "qwen3_1.7b": dict(name="qwen3", flavor="1.7B", overrides={}, seq=4096, mb=4, ac="none"),
    # 8B: fp32 master + AdamW states are ~122 GiB on one GPU; full AC and 1 row keep the 1-GPU run inside
    # an H200. If it still runs out of memory the efficiency is taken against the smallest N that ran.
    "qwen3_8b": dict(name="qwen3", flavor="8B", overrides={}, seq=4096, mb=1, ac="full"),
}
CPU_MODELS = {
    "debug": dict(name="qwen3", flavor="debug", overrides={"vocab_size": 512, "num_hidden_layers": 2},
                  seq=64, mb=2, ac="none"),
}


# ------------------------------------------------------------------------------------------------ launching
def launch(world: int, entry: list[str], argv: list[str], log: Path, timeout: float, cpu: bool,
           run_dir: Path | None = None) -> dict:
    """Run ``entry argv`` on ``world`` processes (torchrun --standalone when > 1); output goes to ``log``.

    ``entry`` is ``["-m", "module"]`` or ``["path/to/script.py"]``. Returns {rc, seconds, error?}. On CPU, a run
    that starts from nothing (``run_dir``, which the caller emptied) and dies in native code (faulthandler's "Fatal
    Python error": a gloo abort, a segfault) runs once more: such a crash came once in many CI runs of a plans case
    and in none of 80 runs here. The crashed log is kept beside ``log`` and the result names it (``crash_retried``)."""
    res = _launch_once(world, entry, argv, log, timeout, cpu)
    if not (cpu and run_dir is not None and "error" in res and "Fatal Python error" in log.read_text(errors="replace")):
        return res
    crashed = log.with_suffix(".crashed.log")
    log.replace(crashed)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"[launch] {log.stem}: native crash, run again once ({res['error'][:300]}; log kept: {crashed})", flush=True)
    return dict(_launch_once(world, entry, argv, log, timeout, cpu), crash_retried=f"{crashed}: {res['error'][:1500]}")


def _launch_once(world: int, entry: list[str], argv: list[str], log: Path, timeout: float, cpu: bool) -> dict:
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               *entry, *argv]
    else:
        cmd = [sys.executable, *entry, *argv]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return dict(rc=124, seconds=time.time() - t0, error=f"timeout after {timeout:.0f}s (log: {log})")
    out = dict(rc=rc, seconds=round(time.time() - t0, 1))
    if rc != 0:
        out["error"] = f"exit code {rc} (log: {log}): " + failure_lines(log.read_text(errors="replace"))
    return out


# What a failed child prints of its own (a Python traceback's last line, a C++ terminate, an abort):
# torchrun's summary that ends the log names only the signal.
_CAUSE = re.compile(r"Error|error:|Traceback|terminate called|what\(\)|enforce fail|Assertion|Abort|Segmentation|Fatal")
_SUMMARY = re.compile(r"ChildFailedError|^\s*(time|host|rank|exitcode|error_file|traceback)\s*:|^[=-]{10,}|Failures:|Root Cause")


def failure_lines(text: str, n: int = 12) -> str:
    """The child's first lines that name a cause (not torchrun's summary) and the stack faulthandler printed
    for a native crash (the trainer enables it), then the log's last lines."""
    lines = text.splitlines()
    cause = [ln for ln in lines if _CAUSE.search(ln) and not _SUMMARY.search(ln)][:n]
    fatal = next((i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")), None)
    if fatal is not None:
        cause += lines[fatal + 1: fatal + 16]
    tail = "\n".join(lines[-8:])
    return ("\n".join(cause) + "\n...\n" if cause else "") + tail[-1200:]


def read_metrics(run: Path) -> dict[int, dict]:
    """step -> metrics line (the last one written for a step: a resumed run may repeat steps)."""
    p = run / "metrics.jsonl"
    out: dict[int, dict] = {}
    if p.is_file():
        for line in p.read_text().splitlines():
            if line.strip():
                m = json.loads(line)
                out[int(m["step"])] = m
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def within(row: dict, bounds: dict) -> bool:
    """A comparison row's distances (``loss_rel_first`` / ``_max``, ``gnorm_rel_first`` / ``_max``) against
    ``bounds`` (``loss_step1``, ``loss``, ``gnorm_step1``, ``gnorm``)."""
    return bool(row["loss_rel_first"] <= bounds["loss_step1"] and row["loss_rel_max"] <= bounds["loss"]
                and row["gnorm_rel_first"] <= bounds["gnorm_step1"] and row["gnorm_rel_max"] <= bounds["gnorm"])


NOISE_FACTOR = 2.0
DEFAULT_LR = 3e-4  # AdamW lr of every run (constant after 2 warm-up steps); --lr overrides it


def control_of(c: dict) -> str | None:
    """The trainer overrides of a control row (1 process vs 1 process with other rounding), else None."""
    if c.get("kind") != "control":
        return None
    return c.get("control") or (c.get("parallel") or {}).get("control")


def apply_noise_floor(checks: list[dict], bounds: dict) -> list[dict]:
    """Re-judge each loss-equality row of a model (and float8 setting) that has a control row: step 1 against
    the fixed bounds, steps 1..N against max(fixed, NOISE_FACTOR x the control's max distance). ``ok_fixed``
    keeps the verdict against the fixed bounds alone."""
    floors = {(c["model"], c.get("float8")): c for c in checks if control_of(c) and "loss_rel_max" in c}
    for c in checks:
        f = floors.get((c["model"], c.get("float8")))
        if c.get("kind") != "loss_equality" or "loss_rel_max" not in c or "error" in c:
            continue
        c.setdefault("ok_fixed", c["ok"])
        if f is None:
            continue
        used = dict(bounds, loss=max(bounds["loss"], NOISE_FACTOR * f["loss_rel_max"]),
                    gnorm=max(bounds["gnorm"], NOISE_FACTOR * f["gnorm_rel_max"]))
        c["ok"] = within(c, used)
        c["bounds_used"] = dict(used, rule=f"max(fixed, {NOISE_FACTOR:g} x control {control_of(f)})")
    return checks


def verdict(c: dict) -> str:
    if control_of(c) and "error" not in c:
        return "(noise floor: 1 GPU vs 1 GPU)"
    if c.get("ok") and c.get("ok_fixed") is False:
        return f"yes (within {NOISE_FACTOR:g}x the noise floor; over the fixed bound)"
    return "yes" if c.get("ok") else "NO: " + str(c.get("error", "bound exceeded"))[:80]


def compare(run: dict[int, dict], ref: dict[int, dict], steps: list[int], bounds: dict) -> dict:
    """Loss / grad-norm relative differences of ``run`` against ``ref`` over ``steps`` with a verdict."""
    missing = [s for s in steps if s not in run or s not in ref]
    if missing or not steps:
        return dict(ok=False, error=f"missing steps {missing[:5]}{'...' if len(missing) > 5 else ''}")
    dl = [rel(run[s]["loss"], ref[s]["loss"]) for s in steps]
    dg = [rel(run[s]["grad_norm"], ref[s]["grad_norm"]) for s in steps]
    row = dict(loss_rel_first=dl[0], loss_rel_max=max(dl), gnorm_rel_first=dg[0], gnorm_rel_max=max(dg))
    return dict(ok=within(row, bounds), steps=[steps[0], steps[-1]], **row,
                loss=[run[s]["loss"] for s in steps], ref_loss=[ref[s]["loss"] for s in steps],
                grad_norm=[run[s]["grad_norm"] for s in steps], ref_grad_norm=[ref[s]["grad_norm"] for s in steps])


def case_model(model: dict):
    """(spec, model config) of a table entry (registry name, flavor, overrides: what the trainer's --model.name /
    --model.flavor / --model.overrides resolve to)."""
    from titan_mm.registry import resolve_model

    return resolve_model(model["name"], model["flavor"], overrides=model.get("overrides") or {})


def batch_flops(spec, mc, batch: dict, vision: bool = True) -> float:
    """Training FLOPs of one host batch from the registry counter over its documents (the batch's vision grids let a
    vision family count its tower, its ``audio_feature_lengths`` an Omni family its audio encoder; ``vision=False``:
    the LLM alone, no encoder)."""
    from titan_mm.observe.mfu import doc_lens_from_batch, encoder_inputs

    return float(spec.flops(mc, doc_lens_from_batch(batch), **encoder_inputs(batch, encoders=vision)))


def step_flops(model: dict, seq: int, rows: int, steps: list[int], seed: int = 0) -> dict[int, float]:
    """Training FLOPs of each step's global batch (registry counter over its real documents), rebuilt from
    the synthetic loader (its rows depend on (seed, step, row) only)."""
    from titan_mm.train.synthetic import SyntheticLoader

    spec, mc = case_model(model)
    loader = SyntheticLoader(vocab_size=spec.dims(mc).vocab_size, seq_len=seq, micro_batch_size=rows, n_micro=1,
                             seed=seed)
    # metrics step s is the update made at state step s - 1
    return {s: batch_flops(spec, mc, loader.batch(s - 1)) for s in steps}


def perf(metrics: dict[int, dict], world: int, warmup: int, flops: dict[int, float] | None, peak: float | None) -> dict:
    """Median throughput over the steps after ``warmup`` (compilation and first-step effects left out)."""
    steps = [s for s in sorted(metrics) if s > warmup] or sorted(metrics)
    if not steps:
        return {}
    tps = [metrics[s]["tokens"] / metrics[s]["step_time_s"] for s in steps]
    out = dict(timed_steps=len(steps), step_time_s=statistics.median(metrics[s]["step_time_s"] for s in steps),
               tokens_per_s=statistics.median(tps), tokens_per_s_per_gpu=statistics.median(tps) / world,
               mem_peak_gb=max(metrics[s].get("mem_peak_gb", 0.0) for s in steps),
               mfu_trainer_metric=statistics.median(metrics[s].get("mfu", 0.0) for s in steps))
    if flops:
        tf = [flops[s] / metrics[s]["step_time_s"] / world / 1e12 for s in steps if s in flops]
        if tf:
            out["tflops_per_gpu"] = statistics.median(tf)
            out["mfu"] = out["tflops_per_gpu"] / peak if peak else None
    return out


def trainer_argv(model: dict, *, seq: int, mb: int, global_batch: int, steps: int, name: str, dump: Path,
                 cpu: bool, compile_: bool, float8: bool, ac: str, ckpt_interval: int = 0,
                 parallel: dict | None = None, lr: float = DEFAULT_LR, extra: list[str] | None = None) -> list[str]:
    """CLI overrides of titan_mm.launch.train for one run (no TOML: JobConfig defaults + these)."""
    a = ["--model.name", model["name"], "--model.flavor", model["flavor"],
         "--data.dataset", "synthetic", "--data.seq_len", str(seq), "--data.micro_batch_size", str(mb),
         "--training.global_batch_size", str(global_batch), "--training.steps", str(steps), "--training.seed", "0",
         "--training.param_dtype", "float32" if cpu else "bfloat16", "--training.reduce_dtype", "float32",
         "--training.nan_policy", "stop", "--training.max_norm", "1.0",
         "--optimizer.lr", str(lr), "--lr_scheduler.name", "constant", "--lr_scheduler.warmup_steps", "2",
         "--compile.enable", str(compile_), "--float8.enable", str(float8), "--activation_checkpoint.mode", ac,
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "False",
         "--job.dump_folder", str(dump), "--job.name", name]
    if model.get("overrides"):
        a += ["--model.overrides", json.dumps(model["overrides"])]
    if cpu:
        a += ["--job.device", "cpu"]
    if ckpt_interval:
        a += ["--checkpoint.enable", "True", "--checkpoint.interval", str(ckpt_interval), "--checkpoint.keep_last", "0",
              "--checkpoint.async_mode", "async"]
    else:
        a += ["--checkpoint.enable", "False"]
    for k, v in (parallel or {}).items():
        a += [f"--parallel.{k}", str(v)]
    return a + list(extra or [])


def _repo_rel(path: Path) -> str:
    """``path`` relative to the repo when it is inside it (results files name no machine paths), else as given;
    ``ROOT / result`` reads it back either way."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def link_checkpoint(src: Path, dst_run: Path) -> Path:
    """Hard-link a committed step folder into a fresh run's checkpoints/ (no disk; DCP files are never
    rewritten in place). Falls back to a copy across file systems."""
    dst = dst_run / "checkpoints" / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    return dst


def merge_rows(old: list[dict], new: list[dict], key) -> list[dict]:
    keys = {key(r) for r in new}
    return [r for r in old if key(r) not in keys] + new


def env_info(cpu: bool) -> dict:
    import torch

    info = dict(torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    if not cpu and torch.cuda.device_count():
        # nvidia-smi, not torch.cuda.get_device_name: the driver process must not hold a CUDA context on GPU 0
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            names = []
        info.update(gpu=names[0].strip() if names and names[0].strip() else "cuda", gpus=torch.cuda.device_count())
    else:
        info.update(gpu="cpu (gloo)", gpus=0)
    info["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    return info


def default_nprocs(cpu: bool) -> list[int]:
    if cpu:
        return [1, 2]
    import torch

    n = torch.cuda.device_count()
    return [w for w in (1, 2, 4, 8) if w <= n] or [1]


def stamp_device(rows: list[dict], device: str) -> list[dict]:
    """This run's rows with the device they ran on (a merged file holds rows of several runs, its meta the last's)."""
    return [dict(r, device=device_of(r, device)) for r in rows]


def fmt(x, spec: str = ".3g") -> str:
    return "" if x is None else format(x, spec)


# ------------------------------------------------------------------------------------------------ driver
def analyze(runs: list[dict], bounds: dict) -> list[dict]:
    """Weak-scaling efficiency and loss equality over all rows with the same settings (rows of earlier
    commands included: their metrics are read back from their run folders). Annotates ``runs`` in place and
    returns the loss-equality checks."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(json.dumps([r["model"], r["float8"], r.get("settings")], sort_keys=True), []).append(r)
    checks = []
    for rows in groups.values():
        ok = [r for r in rows if "tokens_per_s_per_gpu" in r and "error" not in r]
        if not ok:
            continue
        base = min(ok, key=lambda r: r["world"])
        base_m = read_metrics(ROOT / base.get("run_dir", "-"))
        for r in ok:
            r["weak_scaling_base_world"] = base["world"]
            r["weak_scaling_eff"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            if r is base:
                r.pop("loss_equal", None)
                continue
            steps = list(range(1, r["settings"]["steps"] + 1))
            run_m = read_metrics(ROOT / r.get("run_dir", "-"))
            if not run_m or not base_m:  # run folders of an earlier machine: keep the check computed there
                continue
            c = compare(run_m, base_m, steps, bounds)
            checks.append(dict(kind="loss_equality", model=r["model"], float8=r["float8"], world=r["world"],
                               ref_world=base["world"], **c))
            r["loss_equal"] = c["ok"]
    return checks


def run_model(key: str, model: dict, nprocs: list[int], args, bounds: dict, dump: Path) -> tuple[list, list]:
    suffix = "_f8" if args.float8 else ""
    mb = args.micro_batch or model["mb"]
    ac = args.ac or model["ac"]
    seq = args.seq or model["seq"]
    # the same global batch for every world size, also across separate commands (--nprocs 1,2 then 4,8)
    G = args.global_rows or mb * max(max(nprocs), 1 if args.cpu else 8)
    half = args.steps // 2
    reshard = key in args.reshard_models.split(",") and max(nprocs) > 1
    flops = step_flops(model, seq, G, list(range(1, args.steps + 1))) if not args.no_flops else None
    peak = None if args.cpu else args.peak_tflops
    settings = dict(seq=seq, micro_batch=mb, global_batch_rows=G, ac=ac, compile=args.compile, steps=args.steps)
    if args.lr != DEFAULT_LR:
        settings["lr"] = args.lr
    runs, metrics, equal = [], {}, []
    for n in nprocs:
        name = f"{key}{suffix}_w{n}"
        shutil.rmtree(dump / name, ignore_errors=True)
        src_ckpt = reshard and n == max(nprocs)
        if G % (mb * n):
            runs.append(dict(model=key, flavor=model["flavor"], world=n, float8=args.float8, settings=settings,
                             error=f"global batch {G} rows is not a multiple of {mb} rows x {n} GPUs"))
            continue
        argv = trainer_argv(model, seq=seq, mb=mb, global_batch=G, steps=args.steps, name=name, dump=dump,
                            cpu=args.cpu, compile_=args.compile, float8=args.float8, ac=ac, lr=args.lr,
                            ckpt_interval=half if src_ckpt else 0)
        print(f"[scaling] {name}: {n} process(es), {G} rows x {seq} per step ({G // (mb * n)} micro-batches of "
              f"{mb} per GPU), {args.steps} steps", flush=True)
        res = launch(n, ["-m", "titan_mm.launch.train"], argv, dump / f"{name}.log", args.timeout, args.cpu)
        m = read_metrics(dump / name)
        metrics[n] = m
        row = dict(model=key, flavor=model["flavor"], world=n, float8=args.float8, compile=args.compile, ac=ac, seq=seq,
                   micro_batch=mb, global_batch_rows=G, grad_accum=G // (mb * n), steps_done=len(m),
                   wall_s=res["seconds"], run_dir=_repo_rel(dump / name), settings=settings)
        if "error" in res:
            row["error"] = res["error"]
        row.update(perf(m, n, args.warmup, flops, peak))
        runs.append(row)
        args.save(runs, [])  # partial results survive a killed command
        print(f"[scaling] {name}: " + (f"FAILED {res['error'][:1500]}" if "error" in res else
              f"{row.get('tokens_per_s_per_gpu', 0):,.0f} tok/s/GPU, MFU {fmt(row.get('mfu'), '.1%') or 'n/a'}, "
              f"{res['seconds']:.0f}s"), flush=True)
    if args.control:  # the noise floor: 1 process again, with other trainer overrides (other rounding)
        name = f"control_{key}{suffix}_w1"
        shutil.rmtree(dump / name, ignore_errors=True)
        row = dict(kind="control", model=key, float8=args.float8, world=1, ref_world=1, control=args.control)
        if not metrics.get(1):
            row.update(ok=False, error="no 1-process run in this command to compare the control with (add 1 to --nprocs)")
        else:
            argv = trainer_argv(model, seq=seq, mb=mb, global_batch=G, steps=args.steps, name=name, dump=dump,
                                cpu=args.cpu, compile_=args.compile, float8=args.float8, ac=ac, lr=args.lr,
                                extra=args.control.split())
            print(f"[scaling] {name}: 1 process, {args.control} (noise floor)", flush=True)
            res = launch(1, ["-m", "titan_mm.launch.train"], argv, dump / f"{name}.log", args.timeout, args.cpu)
            row.update(compare(read_metrics(dump / name), metrics[1], list(range(1, args.steps + 1)), bounds))
            if "error" in res:
                row.update(ok=False, error=res["error"])
        equal.append(row)
        args.save(runs, equal)
    # resharding: written on max N at step `half`, resumed on N/2 and 1
    if reshard:
        n = max(nprocs)
        src_run = dump / f"{key}{suffix}_w{n}"
        ck = src_run / "checkpoints" / f"step-{half:08d}"
        for mres in sorted({n // 2, 1} - {n}, reverse=True):
            name = f"{key}{suffix}_w{n}_to_w{mres}"
            row = dict(kind="resharding", model=key, float8=args.float8, written_world=n, resumed_world=mres,
                       from_step=half)
            if not (ck / "commit.json").is_file():
                row.update(ok=False, error=f"no committed checkpoint {ck}")
                equal.append(row)
                continue
            shutil.rmtree(dump / name, ignore_errors=True)
            link_checkpoint(ck, dump / name)
            argv = trainer_argv(model, seq=seq, mb=mb, global_batch=G, steps=args.steps, name=name, dump=dump,
                                cpu=args.cpu, compile_=args.compile, float8=args.float8, ac=ac, lr=args.lr, ckpt_interval=half)
            print(f"[scaling] {name}: resume step {half} on {mres} process(es)", flush=True)
            res = launch(mres, ["-m", "titan_mm.launch.train"], argv, dump / f"{name}.log", args.timeout, args.cpu)
            m = read_metrics(dump / name)
            later = list(range(half + 1, args.steps + 1))
            logtxt = (dump / f"{name}.log").read_text(errors="replace")
            row["resumed_log_line"] = "resumed from" in logtxt
            c = compare(m, metrics.get(n, {}), later, bounds)
            row.update(c)
            if "error" in res:
                row.update(ok=False, error=res["error"])
            elif not row["resumed_log_line"]:
                row.update(ok=False, error="the trainer did not report a resume")
            if mres != 1 and 1 in metrics and metrics[1]:  # also against the 1-GPU reference
                row["vs_ref_world"] = compare(m, metrics[1], later, bounds)
            equal.append(row)
            args.save(runs, equal)
            print(f"[scaling] {name}: {'ok' if row.get('ok') else 'FAILED'} (loss rel max "
                  f"{fmt(row.get('loss_rel_max'))})", flush=True)
            if not args.keep_checkpoints:
                shutil.rmtree(dump / name / "checkpoints", ignore_errors=True)
        if not args.keep_checkpoints:
            shutil.rmtree(src_run / "checkpoints", ignore_errors=True)
    args.save(runs, equal)
    return runs, equal


def render(runs: list[dict], checks: list[dict], device: str | None = None) -> str:
    """The runs and checks tables; ``device``: the file's (meta gpu), for rows written before they named theirs."""
    out = ["| model | device | float8 | GPUs | tok/s/GPU | TFLOP/s/GPU | MFU | weak-scaling eff. | peak GB | loss = 1 GPU |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        dev = device_label(device_of(r, device))
        if "error" in r and "tokens_per_s_per_gpu" not in r:
            out.append(f"| {r['model']} | {dev} | {r['float8']} | {r['world']} | failed: {r['error'][:60]!r} | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a (CPU)"
        eq = {True: "yes", False: "NO"}.get(r.get("loss_equal"), "ref" if r.get("weak_scaling_base_world") == r["world"] else "")
        out.append(f"| {r['model']} | {dev} | {r['float8']} | {r['world']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                   f"{fmt(r.get('tflops_per_gpu'), '.1f')} | {mfu} | {100 * r.get('weak_scaling_eff', 0):.1f}% | "
                   f"{r.get('mem_peak_gb', 0):.1f} | {eq} |")
    out += ["", "| check | model | device | float8 | runs | steps | loss rel. (step 1 / max) | grad-norm rel. (step 1 / max) "
            "| ok |", "|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        runs_s = (f"{c['world']} vs {c['ref_world']} GPU" if c["kind"] == "loss_equality"
                  else f"1 vs 1 GPU, `{control_of(c)}`" if control_of(c)
                  else f"written on {c['written_world']}, resumed on {c['resumed_world']}")
        st = f"{c['steps'][0]}-{c['steps'][1]}" if c.get("steps") else ""
        out.append(f"| {c['kind']} | {c['model']} | {device_label(device_of(c, device))} | {c['float8']} | {runs_s} | {st} | "
                   f"{fmt(c.get('loss_rel_first'), '.1e')} / {fmt(c.get('loss_rel_max'), '.1e')} | "
                   f"{fmt(c.get('gnorm_rel_first'), '.1e')} / {fmt(c.get('gnorm_rel_max'), '.1e')} | "
                   f"{verdict(c)} |")
    return "\n".join(out)


def add_render_args(ap: argparse.ArgumentParser, marker: str) -> None:
    ap.add_argument("--render", default="", help="print the markdown tables of this results JSON and exit")
    ap.add_argument("--doc", default="", help=f"with --render: replace the tables between the {marker} markers here")


def render_into(table: str, doc: str, marker: str) -> str:
    """Replace the text between ``<!-- {marker}:begin -->`` and ``<!-- {marker}:end -->`` in ``doc`` (if given)."""
    if doc:
        text = Path(doc).read_text()
        a, b = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
        Path(doc).write_text(text[: text.index(a) + len(a)] + "\n" + table + "\n" + text[text.index(b):])
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help=f"comma list of {list(MODELS)} (default: all; --cpu: debug)")
    ap.add_argument("--nprocs", default="", help="world sizes, e.g. 1,2,4,8 (default: powers of 2 up to the GPU count)")
    ap.add_argument("--steps", type=int, default=20, help="steps per run (loss equality over all of them)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput median")
    ap.add_argument("--float8", action="store_true", help="torchao float8 linears (float8.enable)")
    ap.add_argument("--compile", type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                    help="torch.compile per block (default: True on GPU, False with --cpu)")
    ap.add_argument("--ac", default="", help="activation checkpointing override: none | selective | full")
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per GPU per micro-batch override")
    ap.add_argument("--seq", type=int, default=0, help="sequence length override")
    ap.add_argument("--global-rows", type=int, default=0,
                    help="rows per step for every world (default: micro-batch x 8 on GPU, x max(--nprocs) with --cpu)")
    ap.add_argument("--reshard-models", default="qwen3_1.7b,debug",
                    help="models whose largest-N run writes a checkpoint that is resumed on N/2 and 1 "
                         "(an 8B checkpoint with AdamW state is ~100 GB: add qwen3_8b only with the disk for it)")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR,
                    help="AdamW learning rate of every run (a lower one keeps a short run out of unstable phases)")
    ap.add_argument("--control", default="",
                    help="trainer overrides of a second 1-process run, e.g. \"--kernels.ops linear_cross_entropy\" "
                         "(other bf16 rounding): its distance to the 1-process run is the noise floor; loss-equality "
                         "bounds over the steps widen to max(fixed, 2 x that distance); needs 1 in --nprocs")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep the checkpoints (deleted by default)")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--no-flops", action="store_true", help="skip the FLOP count (no TFLOP/s, no MFU)")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per launched run")
    ap.add_argument("--dump", default=str(ROOT / "outputs/bench_scaling"), help="run folders and logs")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/scaling.json; --cpu: scaling_cpu.json)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes, tiny model, fp32 (tests)")
    add_render_args(ap, "scaling")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        print(render_into(render(doc["runs"], doc["checks"], doc["meta"].get("gpu")), args.doc, "scaling"))
        return 0
    if args.compile is None:
        args.compile = not args.cpu
    catalog = CPU_MODELS if args.cpu else MODELS
    keys = args.models.split(",") if args.models else list(catalog)
    unknown = [k for k in keys if k not in catalog]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {list(catalog)}")
    nprocs = sorted({int(x) for x in args.nprocs.split(",")}) if args.nprocs else default_nprocs(args.cpu)
    if not args.cpu:
        import torch

        have = torch.cuda.device_count()
        if max(nprocs) > have:
            print(f"[scaling] only {have} GPU(s): dropping world sizes {[n for n in nprocs if n > have]}", flush=True)
            nprocs = [n for n in nprocs if n <= have]
        if not nprocs:
            ap.error("no GPU visible; use --cpu")
    bounds = BOUNDS_CPU if args.cpu else BOUNDS_GPU
    dump = Path(args.dump)
    dump.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or ROOT / f"bench/results/scaling{'_cpu' if args.cpu else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(env_info(args.cpu), mode="cpu" if args.cpu else "gpu", peak_tflops=None if args.cpu else args.peak_tflops,
                bounds=bounds, bounds_note="relative |a-b|/|b| of loss and grad norm; see bench/scaling.py",
                command="python bench/scaling.py " + " ".join(sys.argv[1:] if argv is None else argv))

    def save(runs: list[dict], checks: list[dict]) -> dict:
        """Merge rows into --out (rows of other models / worlds / float8 settings are kept), then recompute
        efficiencies and loss equality over the merged rows."""
        prev = json.loads(out.read_text()) if out.exists() else {}
        runs, checks = stamp_device(runs, meta["gpu"]), stamp_device(checks, meta["gpu"])
        merged = merge_rows(prev.get("runs", []), runs, lambda r: (r["model"], r["float8"], r["world"]))
        eq = analyze(merged, bounds)
        key = lambda c: (c["kind"], c["model"], c["float8"], c.get("world"), c.get("written_world"),  # noqa: E731
                         c.get("resumed_world"))
        # loss-equality checks are recomputed where both run folders exist; the others are kept as written
        doc = dict(meta=meta, runs=merged, checks=apply_noise_floor(
            merge_rows(merge_rows(prev.get("checks", []), eq, key), checks, key), bounds))
        out.write_text(json.dumps(doc, indent=1))
        return doc

    args.save = save
    all_runs, all_checks = [], []
    for k in keys:
        r, c = run_model(k, catalog[k], nprocs, args, bounds, dump)
        all_runs += r
        all_checks += c
    doc = save([], [])
    print(render(doc["runs"], doc["checks"], meta["gpu"]))
    failed = [r for r in all_runs if "error" in r] + [c for c in doc["checks"] if not c.get("ok") and c["model"] in keys]
    print(f"[scaling] wrote {out}; {len(failed)} failed run(s)/check(s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
