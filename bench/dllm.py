"""Diffusion-LM training throughput next to the autoregressive run of the same shape, all in one process.

For each objective (default: causal, masked_diffusion, block_diffusion) the trainer's own setup(cfg) builds the run
from bench/mfu.py's titan argv for the case (per-block compile, Triton kernels, FSDP2 with bf16 params / fp32 reduce
on a 1-GPU mesh, fused AdamW) plus ``--objective.kind``; every objective trains on the same synthetic batch (full rows,
one document each, bench/mfu.py's text_batch), ``--warmup`` steps (compilation) then ``--steps`` timed steps with a
synchronize after each. The diffusion objectives corrupt the batch inside train_step as the trainer does (host side,
seeded per step). Between objectives the run is dropped and dynamo's caches are reset.

FLOPs are the objective's count (titan_mm.objectives.Objective.flops): the family's FLOPs plus the attention
pairs the objective's mask adds (bidirectional attends every pair of a document, block-causal every key of the
query's block), so MFU compares the work each objective really does. The table also gives each objective's MFU and
tokens/s relative to the causal run (the target: MFU >= 0.45 and within 5% of causal).

  python bench/dllm.py --case qwen3_1.7b --out bench/results/dllm.json          # one H200
  python bench/dllm.py --cpu --case debug --stack titan_eager --warmup 1 --steps 1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.mfu import CASES, PEAK_TFLOPS, text_batch, titan_argv  # noqa: E402

OBJECTIVES = ("causal", "masked_diffusion", "block_diffusion")


def measure(case: dict, kind: str, args) -> dict:
    import torch

    from titan_mm.config import load_config
    from titan_mm.observe.mfu import doc_lens_from_batch
    from titan_mm.train.setup import setup, tune_kernels
    from titan_mm.train.step import train_step

    argv = titan_argv(case, args.stack, args) + ["--objective.kind", kind,
                                                 "--objective.block_size", str(args.block_size)]
    cfg = load_config(argv)
    run = setup(cfg)
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batch = text_batch(run.spec.dims(run.model_cfg).vocab_size, case["batch"], case["seq"], run.device)
    tune_kernels(cfg, run.spec, run.model_cfg, run.pd, run.device)
    obj = run.ctx.objective
    count = run.spec.flops if obj is None else (lambda *a: obj.flops(run.spec, *a))
    flops = float(count(run.model_cfg, doc_lens_from_batch(batch)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0, losses = time.perf_counter(), []
    for _ in range(args.warmup):
        losses.append(train_step(run.state, [batch], run.ctx).loss)
    sync()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(train_step(run.state, [batch], run.ctx).loss)
        sync()
        times.append(time.perf_counter() - t)
    med = sorted(times)[len(times) // 2]
    n_tok = int(batch["input_ids"].numel())
    row = dict(case=args.case, objective=kind, stack=args.stack, block_size=args.block_size if kind == "block_diffusion"
               else None, mask_kind=run.ctx.objective.mask_kind, attn_backend=run.ctx.attn_backend, batch=case["batch"],
               seq=case["seq"], step_time_s=med, tokens_per_s=n_tok / med, tflops=flops / med / 1e12,
               mfu=flops / med / 1e12 / PEAK_TFLOPS,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
               warmup_s=warm, first_loss=losses[0], last_loss=losses[-1],
               gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    del run, batch
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def render(rows: list[dict]) -> str:
    base = next((r for r in rows if r["objective"] == "causal"), None)
    out = ["| case | objective | attention | tokens/s | TFLOP/s | MFU | MFU / causal | tokens/s / causal | peak GiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = (f"{r['mfu'] / base['mfu']:.3f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}") \
            if base and base["mfu"] else ("", "")
        att = r["mask_kind"] + (f" (b={r['block_size']})" if r.get("block_size") else "")
        out.append(f"| {r['case']} | {r['objective']} | {att} {r['attn_backend']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {rel[0]} | {rel[1]} | {r['peak_mem_gb']:.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="qwen3_1.7b", choices=sorted(CASES))
    ap.add_argument("--objectives", default=",".join(OBJECTIVES))
    ap.add_argument("--block-size", type=int, default=32, help="objective.block_size of block_diffusion")
    ap.add_argument("--stack", default="titan",
                    help="a titan stack of bench/mfu.py (titan, titan_eager, titan_f8, ...)")
    ap.add_argument("--attn", default="auto", help="model.attn_backend (auto: flex on CUDA, sdpa on the CPU)")
    ap.add_argument("--ac", default="none")
    ap.add_argument("--reshard", default="always", choices=("always", "never"))
    ap.add_argument("--kernel-ops", default="")
    ap.add_argument("--model-overrides", default="", help="JSON merged into the case's model overrides (bench/mfu.py's)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/results/dllm.json"))
    args = ap.parse_args()
    case = CASES[args.case]
    rows = []
    for kind in args.objectives.split(","):
        rows.append(measure(case, kind, args))
        r = rows[-1]
        print(f"{args.case} {kind}: {r['tokens_per_s']:,.0f} tok/s, {100 * r['mfu']:.1f}% MFU, "
              f"{r['peak_mem_gb']:.1f} GiB", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"peak_tflops": PEAK_TFLOPS, "rows": rows}, indent=1))
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
