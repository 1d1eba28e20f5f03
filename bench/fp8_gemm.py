"""fp8 against bf16 for a decode step's linears: where serving's fp8 weights lose their time (issue 49).

Workload A at 8B ran 0.87x bf16 with torchao's rowwise w8a8 on the H100 (docs/serving.md), where the halved weight
bytes allow up to 1.30x. This times each projection of one decoder layer (fused q/k/v, o, fused gate/up, down) at a
decode step's rows, each form inside a CUDA graph of ``--reps`` calls (the engine replays graphs: no launch gaps),
so the figures are GPU time per call:

  bf16            F.linear(x, w), the engine's bf16 path
  scaled_mm       torch._scaled_mm of pre-quantized e4m3 x (one scale per row) and w (one per output row): the fp8
                  GEMM alone, with fast accumulation
  quant_eager     the activation's per-row amax, scale and cast as torch ops, then scaled_mm: what a w8a8 linear
                  pays per call when the cast is not fused
  quant_compiled  the same with the cast under torch.compile (one fused kernel), then scaled_mm
  torchao_*       the linear as serve.quantization makes it (runner/weights.quantize: fp8_rowwise,
                  fp8_weight_only, int4_weight_only), called as the engine calls it (torchao_fp8_tensorwise in the
                  first run's results: a mode removed since)
  fp8_rowwise_fused  titan's rowwise w8a8 linear (serve.quantization fp8_rowwise_fused: weights.Fp8Linear, the
                  input's cast one Triton launch, kernels.fp8_rows), called as the engine calls it

Rows: (flavor, rows, projection, form) with microseconds a call and the weight's bytes over that time; a summary per
(flavor, rows, form) adds the layer's four projections and divides bf16's sum by it (the speedup a layer's GEMMs
could give). The copy bandwidth is measured in the same run (bench/ceilings.py; runs before 2026-12-07 04:00 UTC
timed a 1 GiB copy inside a CUDA graph, about 20% lower on the H100). On the CPU (``--cpu
--tiny``: the smoke) the forms run eagerly on small shapes and the torchao forms are skipped.

    python3 bench/fp8_gemm.py --out bench/results/fp8_gemm_<device>.json      # ~1 minute on an H100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devices import device_slug  # noqa: E402
from bench.ceilings import measure as ceilings  # noqa: E402
from bench.timing import graph_us  # noqa: E402
from titan_mm.nn.fp8 import fp8_rows as quant_rows  # noqa: E402
from titan_mm.nn.mlp import SwiGLU  # noqa: E402
from titan_mm.serve.runner.weights import quantize  # noqa: E402

# flavor -> (hidden, q/k/v rows of the fused projection, attention width, MLP width): Qwen3's
SHAPES = {"8B": (4096, 4096 + 2 * 1024, 4096, 12288), "1.7B": (2048, 2048 + 2 * 1024, 2048, 6144)}
TINY = {"tiny": (64, 128, 64, 192)}
ROWS = (1, 64, 256)
TORCHAO = ("fp8_rowwise", "fp8_weight_only", "int4_weight_only")


def projections(hidden: int, qkv: int, attn: int, mlp: int) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of one layer's linears as the engine runs them (q/k/v and gate/up fused)."""
    return {"qkv": (hidden, qkv), "o": (attn, hidden), "gate_up": (hidden, 2 * mlp), "down": (mlp, hidden)}


def forms(k: int, n: int, m: int, device: torch.device, with_torchao: bool) -> dict:
    """form -> a call of the projection (in k, out n) on m rows."""
    dt = torch.bfloat16
    w = torch.randn(n, k, device=device, dtype=dt) * k ** -0.5
    x = torch.randn(m, k, device=device, dtype=dt)
    wq, ws = quant_rows(w)
    xq, xs = quant_rows(x)
    ws_t = ws.t().contiguous()  # [1, N]
    compiled = torch.compile(quant_rows, dynamic=False) if device.type == "cuda" else quant_rows

    def mm(a, s):
        return torch._scaled_mm(a, wq.t(), scale_a=s, scale_b=ws_t, out_dtype=dt, use_fast_accum=True)

    out = {"bf16": lambda: F.linear(x, w), "scaled_mm": lambda: mm(xq, xs),
           "quant_eager": lambda: mm(*quant_rows(x)), "quant_compiled": lambda: mm(*compiled(x))}
    served = {f"torchao_{mode}": mode for mode in (TORCHAO if with_torchao else ())}
    for form, mode in {**served, "fp8_rowwise_fused": "fp8_rowwise_fused"}.items():
        holder = SwiGLU(n, k).to(device, dt)  # its w2 is a (k -> n) linear where runner/weights.quantize finds it
        with torch.no_grad():
            holder.w2.weight.copy_(w)
        try:
            quantize(holder, mode)
        except Exception as e:  # a mode this GPU or torchao build lacks is its row's error
            out[form] = f"{type(e).__name__}: {e}"[:200]
            continue
        out[form] = (lambda h=holder: h.w2(x))
    return out


@torch.no_grad()
def run(flavors: dict, rows: tuple[int, ...], device: torch.device, reps: int, with_torchao: bool) -> dict:
    cuda = device.type == "cuda"
    out = []
    for flavor, dims in flavors.items():
        for m in rows:
            for proj, (k, n) in projections(*dims).items():
                for form, fn in forms(k, n, m, device, with_torchao).items():
                    row = dict(flavor=flavor, rows=m, proj=proj, k=k, n=n, form=form)
                    if isinstance(fn, str):
                        out.append(dict(row, error=fn))
                        continue
                    try:
                        us = graph_us(fn, reps, cuda)
                    except Exception as e:  # a form that cannot run here (no fp8 GEMM on this GPU) says why
                        out.append(dict(row, error=f"{type(e).__name__}: {e}"[:200]))
                        continue
                    out.append(dict(row, us=round(us, 3), weight_gbs=round(2 * k * n / us / 1e3, 1)))
    summary = []
    for flavor in flavors:
        for m in rows:
            sums = {}
            for r in out:
                if r["flavor"] == flavor and r["rows"] == m and "us" in r:
                    sums.setdefault(r["form"], []).append(r["us"])
            base = sum(sums.get("bf16", [0.0]))
            for form, us in sums.items():
                if len(us) == 4:  # all four projections ran
                    summary.append(dict(flavor=flavor, rows=m, form=form, layer_us=round(sum(us), 3),
                                        vs_bf16=round(base / sum(us), 3) if base else None))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    copy = ceilings(device)["copy_tb_s"] * 1e3 if cuda else None
    return dict(device=name, torch=torch.__version__, reps=reps, copy_gbs=copy, rows=out,
                summary=summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (eager; with --tiny: the smoke)")
    ap.add_argument("--tiny", action="store_true", help="one small layer shape")
    ap.add_argument("--flavors", default="8B,1.7B", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="a decode step's rows (sequences)")
    ap.add_argument("--reps", type=int, default=50, help="calls per CUDA graph")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/fp8_gemm_<device>.json)")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device here: run on the GPU machine, or give --cpu (with --tiny for the smoke)")
    unknown = [f for f in args.flavors.split(",") if f not in SHAPES]
    if unknown and not args.tiny:
        ap.error(f"--flavors: unknown {unknown}; choose from {list(SHAPES)}")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    flavors = TINY if args.tiny else {f: SHAPES[f] for f in args.flavors.split(",")}
    res = run(flavors, tuple(int(r) for r in args.rows.split(",")), device, args.reps, with_torchao=not args.cpu)
    out = Path(args.out) if args.out else ROOT / "bench/results" / f"fp8_gemm_{device_slug(res['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    for s in res["summary"]:
        print(f"{s['flavor']:>5} rows {s['rows']:>4} {s['form']:<28} {s['layer_us']:>9.1f} us  "
              f"{s['vs_bf16'] if s['vs_bf16'] is not None else '-'}x bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
