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
    ("qwen3_1.7b", "titan_f8", "none"),
    ("qwen3_1.7b", "titan_eager", "none"),
    ("qwen3_4b", "titan", "none"),
    ("qwen3_30b_a3b_4l", "titan", "none"),
    ("qwen3_vl_2b", "titan", "none"),
    ("qwen3_vl_30b_a3b_4l", "titan", "none"),
)
SHOWN_PHASES = ("forward_end", "backward_first_block", "backward_last_block", "backward_vision",
                "embedding_backward", "root_reduce_scatter", "optimizer_step")


def load_measured(path: str | Path) -> dict[tuple[str, str, str], float]:
    """(case, stack, ac) -> measured peak GiB, from bench/mfu.py's JSON (``peak_mem_gb``, GiB: bytes / 2**30)
    or from this script's own output (``measured_gib``)."""
    data = json.loads(Path(path).read_text())
    out = {}
    for r in data.get("rows", []):
        v = r.get("peak_mem_gb", r.get("measured_gib"))
        if v and "error" not in r:
            out[(r["case"], r["stack"], r.get("ac", "none"))] = float(v)
    return out


def titan_model_config(case_name: str, stack: str):
    """(spec, model config) as bench/mfu.py's _titan_builder makes them (flex attention, kernels unless
    titan_nokernels)."""
    from mfu import CASES, model_config

    spec, mc = model_config(CASES[case_name])
    kw = {k: v for k, v in (("attn_backend", "flex"), ("kernels", stack != "titan_nokernels")) if hasattr(mc, k)}
    return spec, dataclasses.replace(mc, **kw)


def vision_patches(case_name: str, mc) -> int:
    """ViT patches in bench/mfu.py's VL batch (vl_batch: 32 x 32-patch images, each followed by 512 text
    tokens, until the row is full)."""
    from mfu import CASES, vl_batch

    case = CASES[case_name]
    if not case.get("vl"):
        return 0
    return int(vl_batch(mc, case["batch"], case["seq"])["pixel_values"].shape[0])


def estimate_row(case_name: str, stack: str, ac: str) -> dict:
    """Run titan_mm.parallel.memory for one bench row; GiB values."""
    from mfu import CASES

    from titan_mm.parallel.memory import GiB, Topology, count_params, estimate_phases, peak_phase

    case = CASES[case_name]
    spec, mc = titan_model_config(case_name, stack)
    plan = spec.plan(mc)
    counts = count_params(mc, plan)
    nv = vision_patches(case_name, mc)
    # the VL rows of bench/results/mfu.json were measured while Qwen3-VL still computed its loss with the
    # chunked PyTorch CE and its final norm with the reference RMSNorm (it has used the text model's fused CE
    # and norm op since): estimate what was measured (kernels=False models both)
    measured_fused_ce = stack != "titan_nokernels" and not case.get("vl")
    phases = estimate_phases(mc, plan, Topology(ac=ac), case["seq"], case["batch"], 2, counts,
                             kernels=measured_fused_ce, compile=stack != "titan_eager",
                             float8=stack == "titan_f8", vision_patches=nv)
    peak = peak_phase(phases)
    blocks = sorted((k for k in phases if k.startswith("backward_block_")), key=lambda k: -int(k.rsplit("_", 1)[1]))
    named = dict(phases)
    if blocks:  # the first block to run its backward (the top one) and the last (block 0)
        named["backward_first_block"] = phases[blocks[0]]
        named["backward_last_block"] = phases[blocks[-1]]
    return dict(
        case=case_name, stack=stack, ac=ac, batch=case["batch"], seq=case["seq"], vision_patches=nv,
        params_b=counts.total / 1e9, estimate_gib=phases[peak]["total"] / GiB, peak_phase=peak,
        breakdown_gib={k: round(v / GiB, 3) for k, v in phases[peak].items()},
        phases_gib={k: round(named[k]["total"] / GiB, 3) for k in SHOWN_PHASES if k in named},
    )


def check(measured: dict[tuple[str, str, str], float], rows=ROWS) -> list[dict]:
    """Estimate every row that has a measurement; add measured GiB and the relative error (est / meas - 1)."""
    out = []
    for key in rows:
        if key not in measured:
            continue
        r = estimate_row(*key)
        r["measured_gib"] = measured[key]
        r["rel_error"] = r["estimate_gib"] / measured[key] - 1.0
        r["within_tolerance"] = abs(r["rel_error"]) <= TOLERANCE
        out.append(r)
    return out


def render(rows: list[dict]) -> str:
    lines = ["| case | stack | AC | batch x seq | measured GiB | estimate GiB | error | peak at | "
             "params + AdamW | saved activations | loss | FSDP buffers + grads + workspace |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown_gib"]
        rest = b["fsdp_buffers"] + b["grads"] + b["workspace"]
        lines.append(
            f"| {r['case']} | {r['stack']} | {r['ac']} | {r['batch']} x {r['seq']} | {r['measured_gib']:.2f} | "
            f"{r['estimate_gib']:.2f} | {100 * r['rel_error']:+.1f}% | {r['peak_phase']} | "
            f"{b['params'] + b['optimizer']:.2f} | {b['activations']:.2f} | {b['loss']:.2f} | {rest:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", default=str(ROOT / "bench/results/mfu.json"), help="bench/mfu.py's JSON")
    ap.add_argument("--out", default=str(ROOT / "bench/results/memory_check.json"))
    args = ap.parse_args(argv)
    rows = check(load_measured(args.measured))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "note": "titan_mm.parallel.memory vs torch.cuda.max_memory_allocated on one H200 (bench/mfu.py); "
                "GiB; rel_error = estimate / measured - 1; python bench/memory_check.py",
        "measured_from": os.path.relpath(args.measured, ROOT), "tolerance": TOLERANCE, "rows": rows}, indent=1))
    print(render(rows))
    ok = sum(r["within_tolerance"] for r in rows)
    print(f"\n{ok} of {len(rows)} rows within {100 * TOLERANCE:.0f}% of the measured peak.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
