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
                  input's cast one Triton launch, kernels.fp8_rows, then kernels.fp8_mm), called as the engine calls it
  scaled_mm_swapped  y.T = w8 @ x8.T through torch._scaled_mm, then y made row-major (cuBLAS's tiles for the other
                  orientation; slower at every row count measured)
  fp8_mm          kernels.fp8_mm on pre-quantized operands: titan's Triton GEMM (kernels/fp8_gemm.py) where its
                  launch_config has a launch, else torch._scaled_mm
  fp8_mm[cfg]     (--sweep, CUDA) the Triton GEMM at each launch config of sweep_configs

Rows: (flavor, rows, projection, form) with microseconds a call and the weight's bytes over that time; a summary per
(flavor, rows, form) adds the layer's four projections and divides bf16's sum by it (the speedup a layer's GEMMs
could give). With ``--l2_bytes`` each call takes the next of enough weight copies that their fp8 bytes reach it
(2e8: four times the H100's L2), so weights come from HBM as in a serving step; without, one weight is replayed
from L2 (small projections then look faster than any step runs them). The copy bandwidth is measured in the same
run (bench/ceilings.py; runs before 2026-12-07 04:00 UTC timed a 1 GiB copy inside a CUDA graph, about 20% lower on
the H100). On the CPU (``--cpu --tiny``: the smoke) the forms run eagerly on small shapes and the torchao forms are
skipped.

    python3 bench/fp8_gemm.py --out bench/results/fp8_gemm_<device>.json      # ~1 minute on an H100
    python3 bench/fp8_gemm.py --flavors 8B --rows 64,128,256 --sweep --l2_bytes 2e8 \
        --forms scaled_mm,scaled_mm_swapped,fp8_mm,fp8_rowwise_fused               # ~2 minutes: the launch sweep
"""

from __future__ import annotations

import argparse
import itertools
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
from titan_mm import kernels  # noqa: E402
from titan_mm.kernels.fp8_gemm import fp8_mm as triton_fp8_mm  # noqa: E402
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


def forms(k: int, n: int, m: int, device: torch.device, with_torchao: bool, copies: int = 1,
          sweep: tuple[dict, ...] = (), only: tuple[str, ...] = ()) -> dict:
    """form -> a call of the projection (in k, out n) on m rows; each call takes the next of ``copies`` weights (a
    decode step reads each layer's weights from HBM, not from L2: copies that outgrow L2 time that); ``only``: just
    these forms and bf16."""
    dt = torch.bfloat16
    nxt = itertools.cycle(range(copies)).__next__
    ws = [torch.randn(n, k, device=device, dtype=dt) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=device, dtype=dt)
    wq, ws_t = zip(*((q, s.t().contiguous()) for q, s in map(quant_rows, ws)))  # scales [1, N]
    xq, xs = quant_rows(x)
    compiled = torch.compile(quant_rows, dynamic=False) if device.type == "cuda" else quant_rows
    wanted = (lambda form: not only or form == "bf16" or form.split("[")[0] in only)

    def mm(a, s):
        i = nxt()
        return torch._scaled_mm(a, wq[i].t(), scale_a=s, scale_b=ws_t[i], out_dtype=dt, use_fast_accum=True)

    def swapped():  # y.T = w8 @ x8.T: cuBLAS sees n rows and m columns (its tiles differ), then y made row-major
        i = nxt()
        return torch._scaled_mm(wq[i], xq.t(), scale_a=ws_t[i].t(), scale_b=xs.t(), out_dtype=dt,
                                use_fast_accum=True).t().contiguous()

    out = {"bf16": lambda: F.linear(x, ws[nxt()]), "scaled_mm": lambda: mm(xq, xs),
           "scaled_mm_swapped": swapped, "quant_eager": lambda: mm(*quant_rows(x)),
           "quant_compiled": lambda: mm(*compiled(x))}
    def picked():  # kernels.fp8_mm: the Triton launch of launch_config, or cuBLAS where that says so
        i = nxt()
        return kernels.fp8_mm(xq, xs, wq[i], ws_t[i], None, dt)

    out["fp8_mm"] = picked
    if device.type == "cuda":
        for cfg in sweep:

            def tri(cfg=cfg):
                i = nxt()
                return triton_fp8_mm(xq, xs, wq[i], ws_t[i], None, dt, cfg)
            out[f"fp8_mm[{config_name(cfg)}]"] = tri
    served = {f"torchao_{mode}": mode for mode in (TORCHAO if with_torchao else ())}
    for form, mode in {**served, "fp8_rowwise_fused": "fp8_rowwise_fused"}.items():
        if not wanted(form):
            continue
        holders = []
        for w in ws:
            holder = SwiGLU(n, k).to(device, dt)  # its w2 is a (k -> n) linear where runner/weights.quantize finds it
            with torch.no_grad():
                holder.w2.weight.copy_(w)
            try:
                quantize(holder, mode)
            except Exception as e:  # a mode this GPU or torchao build lacks is its row's error
                holders = f"{type(e).__name__}: {e}"[:200]
                break
            holders.append(holder)
        out[form] = holders if isinstance(holders, str) else (lambda hs=holders: hs[nxt()].w2(x))
    return {f: fn for f, fn in out.items() if wanted(f)}


def config_name(cfg: dict) -> str:
    return f"{cfg['BM']}x{cfg['BN']}x{cfg['BK']} s{cfg['num_stages']} w{cfg['num_warps']}"


def sweep_configs() -> tuple[dict, ...]:
    """fp8_mm launch configs the ``--sweep`` times beside launch_config's pick."""
    return tuple(dict(BM=bm, BN=bn, BK=bk, num_stages=st, num_warps=wp)
                 for bm in (64, 128) for bn in (32, 64, 128) for bk in (128, 256) for st in (3, 4, 5)
                 for wp in (4, 8) if not (bk == 256 and bn == 128 and st > 3) and not (bm == 64 and wp == 8))


@torch.no_grad()
def run(flavors: dict, rows: tuple[int, ...], device: torch.device, reps: int, with_torchao: bool,
        l2_bytes: int = 0, sweep: bool = False, only: tuple[str, ...] = ()) -> dict:
    cuda = device.type == "cuda"
    out = []
    for flavor, dims in flavors.items():
        for m in rows:
            for proj, (k, n) in projections(*dims).items():
                copies = max(1, -(-l2_bytes // (k * n)))  # fp8 bytes of the copies at least l2_bytes
                for form, fn in forms(k, n, m, device, with_torchao, copies, sweep_configs() if sweep else (),
                                      only).items():
                    row = dict(flavor=flavor, rows=m, proj=proj, k=k, n=n, form=form, copies=copies)
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
    return dict(device=name, torch=torch.__version__, reps=reps, copy_gbs=copy, l2_bytes=l2_bytes, rows=out,
                summary=summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (eager; with --tiny: the smoke)")
    ap.add_argument("--tiny", action="store_true", help="one small layer shape")
    ap.add_argument("--flavors", default="8B,1.7B", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="a decode step's rows (sequences)")
    ap.add_argument("--reps", type=int, default=50, help="calls per CUDA graph")
    ap.add_argument("--l2_bytes", type=float, default=0, help="rotate copies of each weight whose fp8 bytes reach "
                    "this (e.g. 2e8, four times the H100's L2), so that weights come from HBM as in a serving step")
    ap.add_argument("--sweep", action="store_true", help="also time every launch config of sweep_configs for fp8_mm")
    ap.add_argument("--forms", default="", help="comma list: only these forms (with --sweep: fp8_mm[...] too)")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/fp8_gemm_<device>.json)")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device here: run on the GPU machine, or give --cpu (with --tiny for the smoke)")
    unknown = [f for f in args.flavors.split(",") if f not in SHAPES]
    if unknown and not args.tiny:
        ap.error(f"--flavors: unknown {unknown}; choose from {list(SHAPES)}")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    flavors = TINY if args.tiny else {f: SHAPES[f] for f in args.flavors.split(",")}
    res = run(flavors, tuple(int(r) for r in args.rows.split(",")), device, args.reps, with_torchao=not args.cpu,
              l2_bytes=int(args.l2_bytes), sweep=args.sweep, only=tuple(f for f in args.forms.split(",") if f))
    out = Path(args.out) if args.out else ROOT / "bench/results" / f"fp8_gemm_{device_slug(res['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    for s in res["summary"]:
        print(f"{s['flavor']:>5} rows {s['rows']:>4} {s['form']:<28} {s['layer_us']:>9.1f} us  "
              f"{s['vs_bf16'] if s['vs_bf16'] is not None else '-'}x bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
