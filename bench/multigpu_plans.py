"""TP / EP / CP plans on several GPUs (issue 9): loss equality against one GPU, and MFU runs, through the trainer.

Part 1, loss equality (``--cases``). Every case launches ``python -m titan_mm.launch.train`` with
``data.dataset = synthetic`` (the global batch depends only on (seed, step, row)) on its world size and
compares steps 1..``--steps`` (20) of loss and grad norm with the 1-process run of the same model and the
same global batch (8 rows; 1 row per data-parallel rank per micro-batch, the rest is accumulation):

  case           model   world   parallel flags
  tp2            dense   2       --parallel.tp 2           (sequence parallel and loss parallel on: the defaults)
  tp2_plain      dense   2       --parallel.tp 2 --parallel.sequence_parallel False --parallel.loss_parallel False
  cp2_ulysses    dense   2       --parallel.cp 2 --parallel.cp_mode ulysses   (likewise cp2_ring, cp2_allgather)
  ep2            moe     2       --parallel.ep 2           (ep borrows the 2 FSDP ranks: ep_fsdp 1)
  hsdp           dense   W       --parallel.dp_replicate 2 (dp_shard W/2)
  tp2_fsdp       dense   W       --parallel.tp 2           (dp_shard W/2)
  cp2_fsdp       dense   W       --parallel.cp 2 (ulysses) (FSDP over dp_shard W/2 x cp 2; also cp2_ring_fsdp)
  ep2_fsdp       moe     W       --parallel.ep 2           (experts FSDP-sharded over ep_fsdp W/2)
  epW            moe     W       --parallel.ep W
  tp2_ep2        moe     W       --parallel.tp 2 --parallel.ep 2
  cp2_ep2        moe     W       --parallel.cp 2 --parallel.ep 2
  pp2            dense_pp 2      --parallel.pp 2           (1F1B; likewise pp2_interleaved, pp2_zbv)
  pp2_fsdp       dense_pp W      --parallel.pp 2           (dp_shard W/2 inside each stage; also pp2_tp2)
  pp2_ep2        moe     W       --parallel.pp 2 --parallel.ep 2
W = all GPUs (cases marked W need W >= 4). GPU models: dense = Qwen3-1.7B, moe = Qwen3-30B-A3B cut to 4
layers (128 experts top-8), dense_pp = Qwen3-1.7B untied and cut to 8 layers (pipeline stages cannot share a tied
head), seq 4096, bf16 params / fp32 master + reductions, per-block compile.
Bounds: those of bench/scaling.py (relative, loss step 1 <= 2e-3 and steps 1..20 <= 1e-2; grad norm
step 1 <= 1e-2 and <= 5e-2; the reasoning is in its docstring). MoE routing adds one more source: a token
whose top-8 router scores tie within bf16 rounding may pick another expert on another split; it changes
one token's output, which the token-mean loss averages away.

``--control "--kernels.mode reference"`` adds a 1-process run per model with other trainer overrides (here the
PyTorch ops instead of the Triton kernels: same math, other bf16 rounding): its distance from the reference is the
noise floor that a parallel case's distance is read against. Where a model has a control row, the bound over
steps 1..20 becomes max(fixed bound, NOISE_FACTOR (2) x the control's max distance): on the H200 two 1-GPU runs
that differ only in bf16 rounding drift 5.0e-4 (loss) and 5.0e-2 (grad norm) apart by step 20, so the fixed 5%
grad-norm bound fails the 1-GPU run against itself. The step-1 bounds stay fixed (same weights, same rows): they
are what catches a real fault early (the ring-CP document-mask bug gave a step-1 grad norm 3.1e-2 off, and 0.67
by step 20). ``ok_fixed`` keeps the verdict against the fixed bounds alone.

Part 2, MFU (``--mfu-cases``), all GPUs, ``--mfu-steps`` steps, median after ``--warmup``:
  moe_ep      Qwen3-30B-A3B-shaped MoE (48 layers on 8 GPUs; 6 x W layers on fewer so memory per GPU is
              the same), EP = W over the FSDP ranks, seq 4096 x 2 rows per GPU, full AC. Anchor: 277-299
              TFLOP/s per GPU on H100 (NeMo AutoModel, Megatron-Bridge).
  vl_moe_ep   Qwen3-VL-30B-A3B-shaped (same layer rule), EP = W + FSDP, synthetic packed image+text rows
              of 8192 tokens (512x512-pixel images + 512 text tokens per sample,
              titan_mm/models/qwen3_vl/synthetic.py), full AC. The trainer's synthetic source is text-only,
              so this case runs a worker of this script under torchrun that builds its run with the trainer's
              own setup(cfg) (titan_mm.train.setup) and drives train_step on those batches.
  cp_32k      Qwen3-8B, CP = W (Ulysses), one row of 32768 tokens, full AC.   Anchor: VeOmni 41-44% MFU
  cp_128k     the same at 131072 tokens.                                        at 32K-128K.
TFLOP/s per GPU = registry FLOPs of the step's real documents (6 x active params + attention, vision tower
included) / step time / W; MFU against 989 TFLOP/s.

  python bench/multigpu_plans.py                                   # all cases that fit the GPUs
  python bench/multigpu_plans.py --cases tp2,ep2 --mfu-cases none  # a piece (results merge by key)
  python bench/multigpu_plans.py --cases none --mfu-cases moe_ep,vl_moe_ep
  python bench/multigpu_plans.py --cpu                             # gloo, tiny flavors, world 2 (tests)
  python bench/multigpu_plans.py --cpu --world 4                   # + the pairs with FSDP

Writes ``--out`` (bench/results/multigpu_plans.json) and prints markdown tables.
NCCL / NVLS / multicast environment variables are left as the machine has them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devices import device_label, device_of  # noqa: E402
from bench.scaling import (  # noqa: E402
    BOUNDS_CPU, BOUNDS_GPU, PEAK_TFLOPS, add_render_args, apply_noise_floor, batch_flops, case_model, compare, env_info,
    fmt, launch, merge_rows, perf, read_metrics, render_into, stamp_device, step_flops, trainer_argv, verdict,
)

GPU_MODELS = {
    "dense": dict(name="qwen3", flavor="1.7B", overrides={}, seq=4096),
    "moe": dict(name="qwen3_moe", flavor="30B-A3B", overrides={"num_hidden_layers": 4}, seq=4096),
    # pipeline cases: an untied head (pp refuses tied embeddings), 8 blocks so that pp 2 x 2 stages get 2 each
    "dense_pp": dict(name="qwen3", flavor="1.7B", overrides={"tie_word_embeddings": False, "num_hidden_layers": 8},
                     seq=4096),
}
CPU_MODELS = {
    "dense": dict(name="qwen3", flavor="debug", overrides={"vocab_size": 512, "num_hidden_layers": 2}, seq=64),
    "moe": dict(name="qwen3_moe", flavor="debug_moe", overrides={"vocab_size": 512, "num_hidden_layers": 2}, seq=64),
    "dense_pp": dict(name="qwen3", flavor="debug", overrides={"vocab_size": 512, "num_hidden_layers": 4,
                                                              "tie_word_embeddings": False}, seq=64),
}

# name -> (model, parallel flags (W = all processes), world: an int or "W")
CASES = {
    "tp2": ("dense", {"tp": 2}, 2),
    "tp2_plain": ("dense", {"tp": 2, "sequence_parallel": False, "loss_parallel": False}, 2),
    "cp2_ulysses": ("dense", {"cp": 2, "cp_mode": "ulysses"}, 2),
    "cp2_ring": ("dense", {"cp": 2, "cp_mode": "ring"}, 2),
    "cp2_allgather": ("dense", {"cp": 2, "cp_mode": "allgather"}, 2),
    "ep2": ("moe", {"ep": 2}, 2),
    "hsdp": ("dense", {"dp_replicate": 2}, "W"),
    "tp2_fsdp": ("dense", {"tp": 2}, "W"),
    "cp2_fsdp": ("dense", {"cp": 2, "cp_mode": "ulysses"}, "W"),
    "cp2_ring_fsdp": ("dense", {"cp": 2, "cp_mode": "ring"}, "W"),
    "ep2_fsdp": ("moe", {"ep": 2}, "W"),
    "epW": ("moe", {"ep": "W"}, "W"),
    "tp2_ep2": ("moe", {"tp": 2, "ep": 2}, "W"),
    "cp2_ep2": ("moe", {"cp": 2, "cp_mode": "ulysses", "ep": 2}, "W"),
    # pipeline parallelism (titan_mm/parallel/pipeline.py; docs/parallel.md): bf16 on GPU applies FSDP2, which the
    # split-backward schedules need with its gathered parameters kept (fsdp_reshard_after_forward = never)
    "pp2": ("dense_pp", {"pp": 2}, 2),
    "pp2_interleaved": ("dense_pp", {"pp": 2, "pp_schedule": "Interleaved1F1B"}, 2),
    "pp2_zbv": ("dense_pp", {"pp": 2, "pp_schedule": "ZBVZeroBubble", "fsdp_reshard_after_forward": "never"}, 2),
    "pp2_fsdp": ("dense_pp", {"pp": 2}, "W"),
    "pp2_tp2": ("dense_pp", {"pp": 2, "tp": 2}, "W"),
    "pp2_ep2": ("moe", {"pp": 2, "ep": 2}, "W"),
}


# the module whose synthetic_vl_batch makes the VL MFU case's packed image+text rows
VL_SYNTHETIC = "titan_mm.models.qwen3_vl.synthetic"


def mfu_cases(cpu: bool, W: int) -> dict[str, dict]:
    """MFU case -> model (registry name, flavor, model.overrides: a dict reaches into a nested config, as the VL
    text model's layer cut), parallel flags, seq, rows per GPU, AC, worker ('trainer' or 'vl': the latter with
    image_hw, text tokens per sample and its synthetic module)."""
    if cpu:
        return {
            "moe_ep": dict(model=dict(name="qwen3_moe", flavor="debug_moe",
                                      overrides={"vocab_size": 512, "num_hidden_layers": 2}),
                           parallel={"ep": W}, seq=64, mb=2, ac="none", worker="trainer"),
            "vl_moe_ep": dict(model=dict(name="qwen3_vl_moe", flavor="debug",
                                         overrides={"text": {"num_hidden_layers": 2}}),
                              parallel={"ep": W}, seq=128, mb=1, ac="none", worker="vl", image_hw=(4, 4), text=26,
                              synthetic=VL_SYNTHETIC),
            "cp_long": dict(model=dict(name="qwen3", flavor="debug",
                                       overrides={"vocab_size": 512, "num_hidden_layers": 2}),
                            parallel={"cp": W, "cp_mode": "ulysses"}, seq=512, mb=1, ac="none", worker="trainer"),
        }
    layers = 48 if W >= 8 else 6 * W
    return {
        "moe_ep": dict(model=dict(name="qwen3_moe", flavor="30B-A3B", overrides={"num_hidden_layers": layers}),
                       parallel={"ep": W}, seq=4096, mb=2, ac="full", worker="trainer"),
        "vl_moe_ep": dict(model=dict(name="qwen3_vl_moe", flavor="30B-A3B",
                                     overrides={"text": {"num_hidden_layers": layers}}),
                          parallel={"ep": W}, seq=8192, mb=1, ac="full", worker="vl", image_hw=(32, 32), text=512,
                          synthetic=VL_SYNTHETIC),
        "cp_32k": dict(model=dict(name="qwen3", flavor="8B", overrides={}),
                       parallel={"cp": W, "cp_mode": "ulysses"}, seq=32768, mb=1, ac="full", worker="trainer"),
        "cp_128k": dict(model=dict(name="qwen3", flavor="8B", overrides={}),
                        parallel={"cp": W, "cp_mode": "ulysses"}, seq=131072, mb=1, ac="full", worker="trainer"),
    }


def _resolve(flags: dict, W: int) -> dict:
    return {k: (W if v == "W" else v) for k, v in flags.items()}


def dp_degree(parallel: dict, world: int) -> int:
    """Ranks that read different rows: world / (tp x cp x pp) (ep borrows its ranks from dp x cp)."""
    return world // (int(parallel.get("tp", 1)) * int(parallel.get("cp", 1)) * int(parallel.get("pp", 1)))


# ------------------------------------------------------------------------------------------------ VL worker
def vl_worker(args) -> int:
    """One rank of the VL MFU run (under torchrun): the trainer's setup(cfg) (meshes, model, optimizer, step
    context) and train_step on synthetic packed image+text micro-batches; rank 0 writes <run>/metrics.jsonl like
    the trainer."""
    import importlib

    import torch
    import torch.distributed as dist

    from titan_mm.config import load_config, run_dir
    from titan_mm.observe.health import peak_memory_gb, reset_peak_memory
    from titan_mm.train.setup import setup, tune_kernels
    from titan_mm.train.step import train_step

    cfg = load_config(args.trainer_args)
    run = setup(cfg)
    spec, mc, pd, device = run.spec, run.model_cfg, run.pd, run.device
    state, ctx, n_micro = run.state, run.ctx, run.n_micro
    hw = tuple(int(x) for x in args.image_hw.split("x"))
    make = importlib.import_module(args.synthetic).synthetic_vl_batch
    # two different packed micro-batches per rank, reused (random pixels are slow to make on the host)
    batches = [make(mc, num_tokens=cfg.data.seq_len, rows=cfg.data.micro_batch_size, image_hw=hw,
                    text_per_sample=args.text_per_sample, seed=1000 * i + run.dp_rank) for i in range(2)]
    flops = [batch_flops(spec, mc, b) for b in batches]
    pv = batches[0].get("pixel_values")
    # the kernels' launch configs, before the first step (as the trainer), at this batch's vision token count
    tune_kernels(cfg, spec, mc, pd, device, vision_tokens=int(pv.shape[0]) if pv is not None else None)
    out = run_dir(cfg)
    f = None
    if run.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / "metrics.jsonl", "a")
    for step in range(cfg.training.steps):
        reset_peak_memory(device)
        t0 = time.perf_counter()
        idx = [(step * n_micro + i) % 2 for i in range(n_micro)]
        res = train_step(state, [batches[i] for i in idx], ctx)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        fl = sum(flops[i] for i in idx) / (pd.tp * pd.cp)  # this rank's share (dp ranks hold same-shaped rows)
        if f is not None:
            m = dict(step=state.step, loss=res.loss, grad_norm=res.grad_norm, tokens=res.tokens, step_time_s=dt,
                     tokens_per_s=res.tokens / dt, tflops_per_gpu=fl / dt / 1e12, mem_peak_gb=peak_memory_gb(device))
            f.write(json.dumps(m) + "\n")
            f.flush()
            print(f"step {state.step} loss {res.loss:.4f} {res.tokens / dt:,.0f} tok/s {fl / dt / 1e12:.1f} TFLOP/s/GPU",
                  flush=True)
    if f is not None:
        f.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ driver
def run_equality(args, models: dict, bounds: dict, dump: Path, W: int) -> list[dict]:
    names = list(CASES) if args.cases == "all" else [c for c in args.cases.split(",") if c and c != "none"]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(CASES)}")
    todo = []
    for c in names:
        model_key, flags, world = CASES[c]
        world = W if world == "W" else world
        if args.refs_only:  # only the 1-process references of these cases' models (one GPU is enough)
            todo.append((c, model_key, {}, world))
            continue
        if world > W or (CASES[c][2] == "W" and W < 4):
            print(f"[plans] skip {c}: needs {'>= 4' if CASES[c][2] == 'W' else world} processes, have {W}", flush=True)
            continue
        todo.append((c, model_key, _resolve(flags, W), world))
    G, mb = (args.global_rows or (4 if args.cpu else 8)), 1
    common = dict(global_batch=G, mb=mb, steps=args.steps, dump=dump, cpu=args.cpu, compile_=args.compile,
                  float8=False, ac="none")
    refs = {}
    for mk in sorted({t[1] for t in todo}):
        name = f"ref_{mk}_w1"
        if args.reuse_refs and len(read_metrics(dump / name)) >= args.steps:
            print(f"[plans] {name}: reusing the reference run in {dump / name}", flush=True)
            refs[mk] = (dict(rc=0), read_metrics(dump / name))
            continue
        shutil.rmtree(dump / name, ignore_errors=True)
        argv = trainer_argv(models[mk], seq=models[mk]["seq"], name=name, **common)
        print(f"[plans] {name}: 1 process, {G} rows x {models[mk]['seq']}", flush=True)
        res = launch(1, ["-m", "titan_mm.launch.train"], argv, dump / f"{name}.log", args.timeout, args.cpu)
        refs[mk] = (res, read_metrics(dump / name))
    rows = []
    if args.control:  # the noise floor: the same model and batch on 1 process, another exact attention kernel
        for mk in sorted(refs):
            name = f"control_{mk}_w1"
            shutil.rmtree(dump / name, ignore_errors=True)
            argv = trainer_argv(models[mk], seq=models[mk]["seq"], name=name, **common, extra=args.control.split())
            print(f"[plans] {name}: 1 process, {args.control} (noise floor)", flush=True)
            res = launch(1, ["-m", "titan_mm.launch.train"], argv, dump / f"{name}.log", args.timeout, args.cpu)
            row = dict(kind="control", case="control", model=mk, flavor=models[mk]["flavor"], world=1,
                       parallel={"control": args.control}, dp=1, global_batch_rows=G, wall_s=res["seconds"])
            ref_res, ref_m = refs[mk]
            if "error" in ref_res or "error" in res:
                row.update(ok=False, error=res.get("error") or ref_res.get("error"))
            else:
                row.update(compare(read_metrics(dump / name), ref_m, list(range(1, args.steps + 1)), bounds))
            rows.append(row)
            print(f"[plans] {name}: loss rel max {fmt(row.get('loss_rel_max'))}, grad-norm rel max "
                  f"{fmt(row.get('gnorm_rel_max'))}", flush=True)
    if args.refs_only:
        return rows
    steps = list(range(1, args.steps + 1))
    for c, mk, flags, world in todo:
        name = f"{c}_w{world}"
        shutil.rmtree(dump / name, ignore_errors=True)
        argv = trainer_argv(models[mk], seq=models[mk]["seq"], name=name, parallel=flags, **common)
        print(f"[plans] {name}: {world} processes, {flags}", flush=True)
        res = launch(world, ["-m", "titan_mm.launch.train"], argv, dump / f"{name}.log", args.timeout, args.cpu,
                     run_dir=dump / name)
        m = read_metrics(dump / name)
        row = dict(kind="loss_equality", case=c, model=mk, flavor=models[mk]["flavor"], world=world, parallel=flags,
                   dp=dp_degree(flags, world), global_batch_rows=G, wall_s=res["seconds"])
        if "crash_retried" in res:
            row["crash_retried"] = res["crash_retried"]
        ref_res, ref_m = refs[mk]
        if "error" in ref_res:
            row.update(ok=False, error="1-process reference failed: " + ref_res["error"])
        elif "error" in res:
            row.update(ok=False, error=res["error"])
        else:
            row.update(compare(m, ref_m, steps, bounds))
        if m:  # the trainer's peak per GPU (GB = 1e9 bytes), for bench/memory_check.py
            row["mem_peak_gb"] = max(v.get("mem_peak_gb", 0.0) for v in m.values())
        rows.append(row)
        print(f"[plans] {name}: {'ok' if row.get('ok') else 'FAILED ' + str(row.get('error', ''))[:1500]} "
              f"(loss rel max {fmt(row.get('loss_rel_max'))}, grad-norm rel max {fmt(row.get('gnorm_rel_max'))})"
              + ("; ran again after a native crash" if "crash_retried" in row else ""), flush=True)
    return rows


def run_mfu(args, dump: Path, W: int) -> list[dict]:
    cases = mfu_cases(args.cpu, W)
    names = list(cases) if args.mfu_cases == "all" else [c for c in args.mfu_cases.split(",") if c and c != "none"]
    unknown = [c for c in names if c not in cases]
    if unknown:
        raise SystemExit(f"unknown MFU cases {unknown}; choose from {list(cases)}")
    if names and W < 2:
        print("[plans] MFU cases need >= 2 processes (EP / CP); skipped", flush=True)
        return []
    rows = []
    for c in names:
        spec = cases[c]
        name = f"mfu_{c}_w{W}"
        shutil.rmtree(dump / name, ignore_errors=True)
        par = spec["parallel"]
        dp = dp_degree(par, W)
        model = spec["model"]
        argv = trainer_argv(model, seq=spec["seq"], mb=spec["mb"],
                            global_batch=0, steps=args.mfu_steps, name=name, dump=dump, cpu=args.cpu,
                            compile_=args.compile, float8=args.float8, ac=args.ac or spec["ac"], parallel=par)
        print(f"[plans] {name}: {W} processes, {par}, {spec['mb']} x {spec['seq']} tokens per data-parallel rank",
              flush=True)
        if spec["worker"] == "vl":
            entry = [str(Path(__file__).resolve()), "--vl-worker", "--synthetic", spec["synthetic"],
                     "--image-hw", "x".join(map(str, spec["image_hw"])), "--text-per-sample", str(spec["text"]), "--trainer-flags"]
        else:
            entry = ["-m", "titan_mm.launch.train"]
        res = launch(W, entry, argv, dump / f"{name}.log", args.timeout, args.cpu)
        m = read_metrics(dump / name)
        flops = None
        if spec["worker"] == "trainer" and m:
            flops = step_flops(model, spec["seq"], spec["mb"] * dp, sorted(m))
        mspec, mc = case_model(model)  # layers: the decoder depth of a cut model (None: the flavor's, uncut)
        layers = mspec.dims(mc).num_layers if model.get("overrides") else None
        row = dict(case=c, model=model["name"], flavor=model["flavor"], layers=layers, world=W, parallel=par,
                   seq=spec["seq"], rows_per_dp_rank=spec["mb"],
            ac=args.ac or spec["ac"], float8=args.float8, compile=args.compile, steps_done=len(m), wall_s=res["seconds"])
        peak = None if args.cpu else args.peak_tflops
        row.update(perf(m, W, args.warmup, flops, peak))
        if spec["worker"] == "vl" and m:
            timed = [s for s in sorted(m) if s > args.warmup] or sorted(m)
            row["tflops_per_gpu"] = statistics.median(m[s]["tflops_per_gpu"] for s in timed)
            row["mfu"] = row["tflops_per_gpu"] / peak if peak else None
        if "error" in res:
            row["error"] = res["error"]
        rows.append(row)
        print(f"[plans] {name}: " + (f"FAILED {res['error'][:1500]}" if "error" in res else
              f"{row.get('tokens_per_s_per_gpu', 0):,.0f} tok/s/GPU, {fmt(row.get('tflops_per_gpu'), '.1f')} "
              f"TFLOP/s/GPU, MFU {fmt(row.get('mfu'), '.1%') or 'n/a'}"), flush=True)
    return rows


def render(checks: list[dict], mfu: list[dict], device: str | None = None) -> str:
    """The checks and MFU tables; ``device``: the file's (meta gpu), for rows written before they named theirs."""
    out = ["| case | model | device | GPUs | parallel | loss rel. (step 1 / max) | grad-norm rel. (step 1 / max) | ok |",
           "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        out.append(f"| {c['case']} | {c['flavor']} | {device_label(device_of(c, device))} | {c['world']} | {c['parallel']} | "
                   f"{fmt(c.get('loss_rel_first'), '.1e')} / {fmt(c.get('loss_rel_max'), '.1e')} | "
                   f"{fmt(c.get('gnorm_rel_first'), '.1e')} / {fmt(c.get('gnorm_rel_max'), '.1e')} | "
                   f"{verdict(c)} |")
    out += ["", "| MFU case | model (layers) | device | GPUs | parallel | seq | tok/s/GPU | TFLOP/s/GPU | MFU | peak GB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in mfu:
        where = f"{r['flavor']} ({r['layers'] or 'all'}) | {device_label(device_of(r, device))}"
        if "tokens_per_s_per_gpu" not in r:
            out.append(f"| {r['case']} | {where} | {r['world']} | {r['parallel']} | {r['seq']} | "
                       f"failed: {r.get('error', '')[:60]!r} | | | |")
            continue
        mfu_s = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a (CPU)"
        out.append(f"| {r['case']} | {where} | {r['world']} | {r['parallel']} | {r['seq']} | "
                   f"{r['tokens_per_s_per_gpu']:,.0f} | {fmt(r.get('tflops_per_gpu'), '.1f')} | {mfu_s} | "
                   f"{r.get('mem_peak_gb', 0):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--vl-worker" in argv:  # torchrun entry: --vl-worker WORKER_FLAGS --trainer-flags TRAINER_FLAGS
        wp = argparse.ArgumentParser()
        wp.add_argument("--vl-worker", action="store_true")
        wp.add_argument("--synthetic", default=VL_SYNTHETIC, help="module with synthetic_vl_batch(model_cfg, ...)")
        wp.add_argument("--image-hw", default="32x32")
        wp.add_argument("--text-per-sample", type=int, default=512)
        cut = argv.index("--trainer-flags") if "--trainer-flags" in argv else len(argv)
        wargs = wp.parse_args(argv[:cut])
        wargs.trainer_args = argv[cut + 1:]
        return vl_worker(wargs)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="all", help=f"loss-equality cases, comma list or all / none: {list(CASES)}")
    ap.add_argument("--mfu-cases", default="all", help="MFU cases, comma list or all / none "
                    "(GPU: moe_ep, vl_moe_ep, cp_32k, cp_128k; --cpu: moe_ep, vl_moe_ep, cp_long)")
    ap.add_argument("--world", type=int, default=0, help="processes for W cases and MFU runs (default: all GPUs; --cpu: 2)")
    ap.add_argument("--steps", type=int, default=20, help="steps of each loss-equality run")
    ap.add_argument("--global-rows", type=int, default=0,
                    help="rows per step of the loss-equality runs (default 8; --cpu: 4); 1 row per data-parallel rank "
                         "per micro-batch, the rest accumulation")
    ap.add_argument("--refs-only", action="store_true",
                    help="run only the 1-process references of --cases (e.g. on one GPU while another is busy)")
    ap.add_argument("--control", default="",
                    help="trainer overrides for a second 1-process run of each reference model, e.g. "
                         "'--kernels.mode reference' (PyTorch ops instead of the Triton kernels on GPU): the same math "
                         "with other bf16 rounding, so its distance from the reference is the noise floor the parallel "
                         "cases can be read against")
    ap.add_argument("--reuse-refs", action="store_true",
                    help="reuse reference runs already complete in --dump (written by --refs-only)")
    ap.add_argument("--mfu-steps", type=int, default=12, help="steps of each MFU run")
    ap.add_argument("--warmup", type=int, default=4, help="MFU steps left out of the median")
    ap.add_argument("--compile", type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                    help="torch.compile per block (default: True on GPU, False with --cpu)")
    ap.add_argument("--float8", action="store_true", help="float8 linears in the MFU runs")
    ap.add_argument("--ac", default="", help="AC override for the MFU runs: none | selective | full")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per launched run")
    ap.add_argument("--dump", default=str(ROOT / "outputs/bench_multigpu_plans"))
    ap.add_argument("--out", default="", help="results JSON (default bench/results/multigpu_plans.json; "
                                               "--cpu: multigpu_plans_cpu.json)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes, tiny flavors, fp32 (tests)")
    add_render_args(ap, "multigpu-plans")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        print(render_into(render(doc["checks"], doc["mfu"], doc["meta"].get("gpu")), args.doc, "multigpu-plans"))
        return 0
    if args.compile is None:
        args.compile = not args.cpu
    if args.cpu:
        W = args.world or 2
    else:
        import torch

        W = args.world or torch.cuda.device_count()
        if (W < 1 and not args.refs_only) or W > torch.cuda.device_count():
            ap.error(f"--world {W}: {torch.cuda.device_count()} GPU(s) visible (use --cpu without GPUs)")
    bounds = BOUNDS_CPU if args.cpu else BOUNDS_GPU
    dump = Path(args.dump)
    dump.mkdir(parents=True, exist_ok=True)
    checks = run_equality(args, CPU_MODELS if args.cpu else GPU_MODELS, bounds, dump, W)
    mfu = run_mfu(args, dump, W)
    out = Path(args.out or ROOT / f"bench/results/multigpu_plans{'_cpu' if args.cpu else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(out.read_text()) if out.exists() else {}
    info = env_info(args.cpu)
    checks, mfu = stamp_device(checks, info["gpu"]), stamp_device(mfu, info["gpu"])
    doc = dict(
        meta=dict(info, mode="cpu" if args.cpu else "gpu", world=W, bounds=bounds,
                  peak_tflops=None if args.cpu else args.peak_tflops,
                  bounds_note="relative |a-b|/|b| of loss and grad norm vs the 1-process run; see bench/scaling.py",
                  command="python bench/multigpu_plans.py " + " ".join(argv)),
        checks=apply_noise_floor(merge_rows(prev.get("checks", []), checks, lambda r: (r["case"], r["world"])), bounds),
        mfu=merge_rows(prev.get("mfu", []), mfu, lambda r: (r["case"], r["world"], r["float8"])),
    )
    out.write_text(json.dumps(doc, indent=1))
    print(render(doc["checks"], doc["mfu"], doc["meta"]["gpu"]))
    failed = [c for c in doc["checks"] if c in checks and not c.get("ok")
              and (c.get("kind") != "control" or "error" in c)] + \
        [r for r in mfu if "error" in r]
    print(f"[plans] wrote {out}; {len(failed)} failed check(s)/run(s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
