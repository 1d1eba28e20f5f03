"""Optimizer-step time of Muon (optimizer.name = "muon": Muon on the blocks' matrices, AdamW on the rest) against
fused AdamW on the same parameter set, one device: how much does Muon add to a step?

The parameters are those of a registry flavor (default Qwen3 1.7B, fp32 master weights as FSDP2 keeps them) with
random fp32 gradients; both optimizers come from titan_mm.train.optim.build_optimizer, so this times what the
trainer runs. Rows: fused AdamW; Muon with the NS compiled (the CUDA default) and eager; the Muon NS alone
(orthogonalized_updates on every Muon matrix, bf16 on CUDA). Median of CUDA-event times (perf_counter on CPU).
NS FLOPs: 2 x (2 m^2 n + m^3) per iteration of an m x n matrix (m <= n), so ns_tflops says how close the NS runs
to the bf16 matmul rate.

    PYTHONPATH=$PWD python3 bench/optim_step.py [--flavor 1.7B --iters 20] [--out bench/results/optim_step.json]
    PYTHONPATH=$PWD python3 bench/optim_step.py --cpu [--out x.json]   # smoke test: the debug flavor on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median time of fn() in ms: CUDA events (bench/attention.py's timer, as bench/floor.py), perf_counter on CPU."""
    if device.type == "cuda":
        from bench.attention import bench as cuda_ms

        return cuda_ms(fn, iters=iters, warmup=warmup)
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def build(model_name: str, flavor: str, device: torch.device):
    from titan_mm.registry import get_model_spec

    spec = get_model_spec(model_name)
    cfg = spec.flavor(flavor)
    with torch.device("meta"):
        model = spec.build(cfg)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
            p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    return spec, cfg, model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--flavor", default="1.7B")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="smoke test: the debug flavor on the CPU, 2 iterations")
    ap.add_argument("--out", default=None, help="JSON file (default: bench/results/optim_step.json on CUDA; "
                    "the CPU smoke run writes only where --out says)")
    a = ap.parse_args(argv)
    if a.cpu:
        a.flavor, a.iters, a.warmup = "debug", 2, 1
    device = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")

    from titan_mm.config import JobConfig
    from titan_mm.train.muon import ns_cost, orthogonalized_updates
    from titan_mm.train.optim import build_optimizer

    spec, mcfg, model = build(a.model, a.flavor, device)
    plan = spec.plan(mcfg)
    fused = spec.fused_params(mcfg) if spec.fused_params else None
    cfg = JobConfig()
    rows: dict[str, float] = {}

    cfg.optimizer.name = "adamw"
    opt = build_optimizer(model, cfg)
    rows["adamw_ms"] = timed(opt.step, device, a.iters, a.warmup)
    impl = "fused" if opt.param_groups[0].get("fused") else "foreach"
    del opt
    if device.type == "cuda":
        torch.cuda.empty_cache()

    cfg.optimizer.name = "muon"
    opt = build_optimizer(model, cfg, plan=plan, fused=fused)
    muon_params = [p for g in opt.param_groups if g["algo"] == "muon" for p in g["params"]]
    n_muon = sum(p.numel() for p in muon_params)
    ns_flops = 2 * cfg.optimizer.muon_ns_steps * sum(ns_cost(p.shape) for p in muon_params)
    for compile_ns in ((True, False) if device.type == "cuda" else (False,)):
        opt.compile_ns = compile_ns
        rows[f"muon_{'compiled' if compile_ns else 'eager'}_ms"] = timed(opt.step, device, a.iters, a.warmup)
        directions = [(p.grad, p, cfg.optimizer.muon_ns_steps, opt.layouts.get(id(p)), cfg.optimizer.muon_adjust_lr)
                      for p in muon_params]  # plain parameters here: the gradient is the local tensor
        rows[f"ns_only_{'compiled' if compile_ns else 'eager'}_ms"] = timed(
            lambda: orthogonalized_updates(directions, None, compile_ns), device, a.iters, a.warmup)
    muon_ms = rows.get("muon_compiled_ms", rows["muon_eager_ms"])
    ns_ms = rows.get("ns_only_compiled_ms", rows["ns_only_eager_ms"])
    result = {
        "question": "optimizer-step time of Muon (optimizer.name=muon) vs fused AdamW on the same parameters",
        "model": f"{a.model}/{a.flavor}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "adamw_impl": impl,
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_muon": n_muon,
        "ns_dtype": "bfloat16" if device.type == "cuda" else "float32",
        "ns_tflop_per_step": ns_flops / 1e12,
        **rows,
        "ratio_muon_over_adamw": muon_ms / rows["adamw_ms"],
        "ns_tflops": ns_flops / (ns_ms * 1e-3) / 1e12,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "iters": a.iters,
        "command": "PYTHONPATH=$PWD python3 bench/optim_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps(result, indent=1))
    out = a.out or (str(ROOT / "bench/results/optim_step.json") if device.type == "cuda" else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
