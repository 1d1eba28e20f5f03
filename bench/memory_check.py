"""titan_mm's memory estimator (titan_mm.parallel.memory) against the peak memory measured on the H200.

bench/mfu.py records torch.cuda.max_memory_allocated() over a whole run (warmup + timed steps) on one H200
for each (case, stack, AC). This script builds the same model config (bench/mfu.py's CASES and
_titan_builder: registry flavor + overrides, kernels on, bf16 params via FSDP2 on a 1-GPU mesh, fp32
master weights and AdamW state), runs the estimator for the same batch, sequence, AC mode, compile and
float8 settings, and compares. CPU only, a few seconds; no GPU needed.

    python bench/memory_check.py                      # reads bench/results/mfu.json
    python bench/memory_check.py --out bench/results/memory_check.json

Writes bench/results/memory_check.json (per row: measured GiB, estimate GiB, relative error, the phase of
the step the estimate peaks in, the breakdown at that phase and the totals of the other phases) and
prints a markdown table (the one in docs/parallel.md, "Checked against the H200").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/mfu.py's CASES, model_config, vl_batch
os.environ.setdefault("OMP_NUM_THREADS", "1")

TOLERANCE = 0.15
# (case, stack, ac) rows of bench/results/mfu.json that run titan_mm; the first seven are issue 8's list
ROWS: tuple[tuple[str, str, str], ...] = (
    ("qwen3_1.7b", "titan", "none"),
    ("qwen3_1.7b", "titan", "full"),
    ("qwen3_1.7b", "titan", "selective:2"),  # activation_checkpoint.num_layers=2
    ("qwen3_1.7b", "titan_f8", "none"),
    ("qwen3_1.7b", "titan_eager", "none"),
    ("qwen3_4b", "titan", "none"),
    ("qwen3_30b_a3b_4l", "titan", "none"),
    ("qwen3_vl_2b", "titan", "none"),
    ("qwen3_vl_30b_a3b_4l", "titan", "none"),
)
# Runs of the trainer on the H200 pair (nvidia-h200-x2) whose peak (metrics.jsonl mem_peak_gb, bytes / 1e9, the
# largest over the run) is compared with the estimate for their topology: bench/results/scaling.json (runs) and the
# trainer logs of bench/multigpu_plans.py's loss-equality runs (2 rows x 4096 per step, eager, 20 steps; copied here
# from those logs: that version of the script did not keep the peak). Every run: kernels on, flex attention,
# bf16 params / fp32 master weights, fused AdamW. accum = micro-batches per step on each rank.
MULTI_GPU_ROWS: tuple[dict, ...] = (
    dict(run="scaling qwen3_1.7b_w1", model=("qwen3", "1.7B", {}), topo=dict(), mb=4, seq=4096, ac="none",
         compile=True, accum=2, measured_gb=62.567158784),
    dict(run="scaling qwen3_1.7b_w2", model=("qwen3", "1.7B", {}), topo=dict(dp_shard=2), mb=4, seq=4096, ac="none",
         compile=True, accum=1, measured_gb=45.361490432),
    dict(run="scaling qwen3_8b_w1", model=("qwen3", "8B", {}), topo=dict(), mb=1, seq=4096, ac="full",
         compile=True, accum=2, measured_gb=146.055201792),
    dict(run="scaling qwen3_8b_w2", model=("qwen3", "8B", {}), topo=dict(dp_shard=2), mb=1, seq=4096, ac="full",
         compile=True, accum=1, measured_gb=71.816723456),
    dict(run="plans ref_dense_w1", model=("qwen3", "1.7B", {}), topo=dict(), mb=1, seq=4096, ac="none",
         compile=False, accum=2, measured_gb=37.74),
    # tp2 ran before tied heads got loss parallel (the 1.7B ties its head): estimated with the plan's head unsharded
    dict(run="plans tp2_w2", model=("qwen3", "1.7B", {}), topo=dict(tp=2), mb=1, seq=4096, ac="none",
         compile=False, accum=2, measured_gb=22.81, plan_over=dict(loss_parallel=None)),
    dict(run="plans cp2_ulysses_w2", model=("qwen3", "1.7B", {}), topo=dict(cp=2), mb=1, seq=4096, ac="none",
         compile=False, accum=2, measured_gb=20.07),
    dict(run="plans ref_moe_w1", model=("qwen3_moe", "30B-A3B", {"num_hidden_layers": 4}), topo=dict(), mb=1,
         seq=4096, ac="none", compile=False, accum=2, measured_gb=61.63),
    dict(run="plans ep2_w2", model=("qwen3_moe", "30B-A3B", {"num_hidden_layers": 4}), topo=dict(dp_shard=2, ep=2),
         mb=1, seq=4096, ac="none", compile=False, accum=1, measured_gb=28.25),
)
# Rows of bench/results/mfu_reshard.json run with parallel.fsdp_reshard_after_forward = never (bench/mfu.py --reshard
# never): every block's gathered params live from its forward to its backward.
RESHARD_ROWS: tuple[tuple[str, str, str], ...] = (
    ("qwen3_1.7b", "titan", "none"),
    ("qwen3_1.7b", "titan", "selective:8"),
    ("qwen3_1.7b", "titan_f8_pre", "none"),
)
SHOWN_PHASES = ("forward_end", "backward_first_block", "backward_last_block", "backward_vision",
                "embedding_backward", "root_reduce_scatter", "optimizer_step")


def load_measured(path: str | Path, reshard: str = "always") -> dict[tuple[str, str, str], float]:
    """(case, stack, ac) -> measured peak GiB, from bench/mfu.py's JSON (``peak_mem_gb``, GiB: bytes / 2**30)
    or from this script's own output (``measured_gib``); the rows run through FSDP2 with ``reshard``
    (parallel.fsdp_reshard_after_forward; rows without the field ran with the default, always). Rows of the
    one-rank cast path (``mixed_precision: cast``, bench/mfu.py's titan rows from 2026-12-03) are left out: they
    hold what reshard never holds (1.7B: 54.6 GiB, against 54.2 through FSDP2 with never), and this script's
    estimates keep the fused CE chunk of the FSDP2-era rows. memory_check.json keeps those rows' FSDP2 peaks."""
    data = json.loads(Path(path).read_text())
    out = {}
    for r in data.get("rows", []):
        v = r.get("peak_mem_gb", r.get("measured_gib"))
        fsdp = r.get("mixed_precision", "fsdp") == "fsdp"
        if v and "error" not in r and fsdp and r.get("reshard", "always") == reshard:
            out[(r["case"], r["stack"], r.get("ac", "none"))] = float(v)
    return out


def liger_chunk(spec, mc, tokens: int) -> int:
    """The fused CE's chunk rows before 2026-12-02 (Liger's rule), with which the measured peaks were taken."""
    d = spec.dims(mc)
    return 1 << max(0, math.ceil(math.log2(math.ceil(tokens / math.ceil(d.vocab_size / d.hidden_size)))))


def titan_model_config(case_name: str, stack: str):
    """(spec, model config) as bench/mfu.py's _titan_builder made them for the measured rows (flex attention,
    kernels unless titan_nokernels). Those rows ran before 2026-12-02, when the fused CE chunked by Liger's rule
    (next_pow2(N / ceil(V / D)) rows) instead of the model's loss_chunk_size: they are estimated with that chunk."""
    from mfu import CASES, merge_overrides, model_config

    case = CASES[case_name]
    spec, mc = model_config(case)
    chunk = {"loss_chunk_size": liger_chunk(spec, mc, case["batch"] * case["seq"])}
    top = "loss_chunk_size" in {f.name for f in dataclasses.fields(mc)}  # Qwen3's; VL families keep it in .text
    spec, mc = model_config(dict(case, overrides=merge_overrides(case.get("overrides") or {},
                                                                 chunk if top else {"text": chunk})))
    return spec, spec.with_runtime(mc, attn_backend="flex", kernels=stack != "titan_nokernels")


def vision_patches(case_name: str, mc) -> int:
    """ViT patches in bench/mfu.py's VL batch (vl_batch: 32 x 32-patch images, each followed by 512 text
    tokens, until the row is full)."""
    from mfu import CASES, vl_batch

    case = CASES[case_name]
    if not case.get("vl"):
        return 0
    return int(vl_batch(mc, case["batch"], case["seq"])["pixel_values"].shape[0])


def estimate_row(case_name: str, stack: str, ac: str, reshard: str = "always") -> dict:
    """Run titan_mm.parallel.memory for one bench row; GiB values."""
    from mfu import CASES, parse_ac

    from titan_mm.parallel.memory import GiB, Topology, count_params, estimate_phases, peak_phase

    case = CASES[case_name]
    ac_mode, ac_layers = parse_ac(ac)
    spec, mc = titan_model_config(case_name, stack)
    plan = spec.plan(mc)
    counts = count_params(mc, plan)
    nv = vision_patches(case_name, mc)
    topo = Topology(ac=ac_mode, ac_layers=ac_layers, reshard=reshard)
    phases = estimate_phases(mc, plan, topo, case["seq"], case["batch"], 2, counts,
                             kernels=stack != "titan_nokernels", compile=stack != "titan_eager",
                             float8=stack in ("titan_f8", "titan_f8_pre"), vision_patches=nv)
    peak = peak_phase(phases)
    blocks = sorted((k for k in phases if k.startswith("backward_block_")), key=lambda k: -int(k.rsplit("_", 1)[1]))
    named = dict(phases)
    if blocks:  # the first block to run its backward (the top one) and the last (block 0)
        named["backward_first_block"] = phases[blocks[0]]
        named["backward_last_block"] = phases[blocks[-1]]
    return dict(
        case=case_name, stack=stack, ac=ac, reshard=reshard, batch=case["batch"], seq=case["seq"], vision_patches=nv,
        params_b=counts.total / 1e9, estimate_gib=phases[peak]["total"] / GiB, peak_phase=peak,
        breakdown_gib={k: round(v / GiB, 3) for k, v in phases[peak].items()},
        phases_gib={k: round(named[k]["total"] / GiB, 3) for k in SHOWN_PHASES if k in named},
    )


def check(measured: dict[tuple[str, str, str], float], rows=ROWS, reshard: str = "always") -> list[dict]:
    """Estimate every row that has a measurement; add measured GiB and the relative error (est / meas - 1)."""
    out = []
    for key in rows:
        if key not in measured:
            continue
        r = estimate_row(*key, reshard=reshard)
        r["measured_gib"] = measured[key]
        r["rel_error"] = r["estimate_gib"] / measured[key] - 1.0
        r["within_tolerance"] = abs(r["rel_error"]) <= TOLERANCE
        out.append(r)
    return out


def estimate_multi_gpu(row: dict) -> dict:
    """The estimate for one MULTI_GPU_ROWS run; GiB values."""
    from titan_mm.parallel.memory import GiB, Topology, count_params, estimate_phases, peak_phase
    from titan_mm.registry import get_model_spec

    name, flavor, over = row["model"]
    spec = get_model_spec(name)
    mc = dataclasses.replace(spec.flavor(flavor), **over)
    mc = spec.with_runtime(dataclasses.replace(mc, loss_chunk_size=liger_chunk(spec, mc, row["mb"] * row["seq"])),
                           attn_backend="flex", kernels=True)
    plan = dataclasses.replace(spec.plan(mc), **row.get("plan_over", {}))
    topo = Topology(ac=row["ac"], **row["topo"])
    phases = estimate_phases(mc, plan, topo, row["seq"], row["mb"], 2, count_params(mc, plan), kernels=True,
                             compile=row["compile"], grad_accum=row["accum"])
    peak = peak_phase(phases)
    measured = row["measured_gb"] * 1e9 / GiB
    est = phases[peak]["total"] / GiB
    return dict(row, topo=topo.describe(), world=topo.world, measured_gib=measured, estimate_gib=est,
                rel_error=est / measured - 1.0, within_tolerance=abs(est / measured - 1.0) <= TOLERANCE,
                peak_phase=peak, breakdown_gib={k: round(v / GiB, 3) for k, v in phases[peak].items()})


def render_multi_gpu(rows: list[dict]) -> str:
    lines = ["| run | GPUs | topology | micro-batch x seq (accum) | compile | measured GiB | estimate GiB | error | peak at |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['world']} | {r['topo']} | {r['mb']} x {r['seq']} ({r['accum']}) | "
                     f"{r['compile']} | {r['measured_gib']:.2f} | {r['estimate_gib']:.2f} | "
                     f"{100 * r['rel_error']:+.1f}% | {r['peak_phase']} |")
    return "\n".join(lines)


def render(rows: list[dict]) -> str:
    lines = ["| case | stack | AC | batch x seq | measured GiB | estimate GiB | error | peak at | "
             "params + AdamW | saved activations | loss | FSDP buffers + grads + workspace |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown_gib"]
        rest = b["fsdp_buffers"] + b["grads"] + b["workspace"]
        stack = r["stack"] + (f" (reshard {r['reshard']})" if r.get("reshard", "always") != "always" else "")
        lines.append(
            f"| {r['case']} | {stack} | {r['ac']} | {r['batch']} x {r['seq']} | {r['measured_gib']:.2f} | "
            f"{r['estimate_gib']:.2f} | {100 * r['rel_error']:+.1f}% | {r['peak_phase']} | "
            f"{b['params'] + b['optimizer']:.2f} | {b['activations']:.2f} | {b['loss']:.2f} | {rest:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", default=str(ROOT / "bench/results/mfu.json"), help="bench/mfu.py's JSON")
    ap.add_argument("--measured-reshard", default=str(ROOT / "bench/results/mfu_reshard.json"),
                    help="bench/mfu.py --reshard never rows (RESHARD_ROWS)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/memory_check.json"))
    args = ap.parse_args(argv)
    rows = check(load_measured(args.measured))
    if Path(args.measured_reshard).exists():
        rows += check(load_measured(args.measured_reshard, "never"), RESHARD_ROWS, "never")
    multi = [estimate_multi_gpu(r) for r in MULTI_GPU_ROWS]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "note": "titan_mm.parallel.memory vs torch.cuda.max_memory_allocated on one H200 (bench/mfu.py); "
                "GiB; rel_error = estimate / measured - 1; python bench/memory_check.py",
        "measured_from": os.path.relpath(args.measured, ROOT), "tolerance": TOLERANCE, "rows": rows,
        "multi_gpu_note": "trainer runs on the H200 pair (bench/scaling.py, bench/multigpu_plans.py); see MULTI_GPU_ROWS",
        "multi_gpu_rows": multi}, indent=1))
    print(render(rows))
    ok = sum(r["within_tolerance"] for r in rows)
    print(f"\n{ok} of {len(rows)} rows within {100 * TOLERANCE:.0f}% of the measured peak.\n")
    print(render_multi_gpu(multi))
    ok = sum(r["within_tolerance"] for r in multi)
    print(f"\n{ok} of {len(multi)} trainer runs within {100 * TOLERANCE:.0f}% of the measured peak.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
