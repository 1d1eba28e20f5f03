"""Host time of the one-rank cast path (titan_mm.parallel.apply.apply_param_cast) per micro-batch, on the CPU.

The cast path narrows every fp32 parameter before the forward and widens its gradient in the backward. On the GPU
those copies run at the copy rate, but each costs host time to launch and to record in the autograd graph. With
about 1,000 parameters (Qwen3-VL-2B's tower and decoder) that host time left the H200 idle
(bench/results/trace_gaps_qwen3_vl_2b_titan_cast.json). This bench measures the host side alone. It builds the
bench/mfu.py case's model on the meta device, applies the cast path (which reads the shapes there), and then puts
an 8-element CPU parameter in each parameter's place (ties kept): the same slots and groups, no data to move. It times the forward pre-hook (the casts), the forward hook (the
swap back), and the backward of the casts. The backward is fed by one gradient per copy, as the
model's own backward would feed them.

  python3 bench/cast_host.py --cases qwen3_vl_2b,qwen3_8b_12l,qwen3_30b_a3b_4l --out bench/results/cast_host.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.mfu import CASES, model_config  # noqa: E402

from titan_mm.parallel.apply import apply_param_cast  # noqa: E402


def measure(case: str, reps: int = 5) -> dict:
    spec, mc = model_config(CASES[case])
    with torch.device("meta"):
        model = spec.build(mc)
    apply_param_cast(model, torch.bfloat16)  # it reads the shapes here (which parameters are cast alone)
    small: dict[int, torch.nn.Parameter] = {}  # then every parameter as 8 fp32 elements on the CPU, ties kept
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = small.setdefault(id(p), torch.nn.Parameter(torch.zeros(8), p.requires_grad))
    pre, post = model._forward_pre_hooks, model._forward_hooks
    swap_in, swap_out = next(iter(pre.values())), next(iter(post.values()))
    params = [p for p in model.parameters() if p.is_floating_point()]
    t_in, t_out, t_bwd = [], [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        swap_in(model, ())
        t1 = time.perf_counter()
        copies = [m._parameters[n] for m in model.modules() for n in m._parameters
                  if m._parameters[n] is not None and m._parameters[n].grad_fn is not None]
        seen = {}
        for c in copies:  # a tied parameter's copy once
            seen.setdefault(id(c), c)
        copies = list(seen.values())
        nodes = len({id(c.grad_fn) for c in copies})
        t2 = time.perf_counter()
        swap_out(model, (), None)
        t3 = time.perf_counter()
        torch.autograd.backward(copies, [torch.empty_like(c) for c in copies])
        t4 = time.perf_counter()
        t_in.append(t1 - t0)
        t_out.append(t3 - t2)
        t_bwd.append(t4 - t3)
        for p in params:
            p.grad = None
    med = lambda xs: round(1e3 * statistics.median(xs[1:]), 3)  # noqa: E731  (the first rep warms up)
    return dict(case=case, params=len(params), copies=len(copies), autograd_nodes=nodes, cast_ms=med(t_in),
                restore_ms=med(t_out),
                backward_ms=med(t_bwd), total_ms=round(med(t_in) + med(t_out) + med(t_bwd), 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="qwen3_vl_2b,qwen3_8b_12l,qwen3_30b_a3b_4l")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--label", default="", help="a name for this run's rows (e.g. the code version)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        r = measure(case, args.reps)
        r.update(label=args.label, cpu=platform.processor() or platform.machine(), torch=torch.__version__)
        rows.append(r)
        print(f"{case} {args.label}: {r['params']} params, {r['copies']} copies, {r['autograd_nodes']} cast nodes: "
              f"cast {r['cast_ms']} ms, restore "
              f"{r['restore_ms']} ms, backward {r['backward_ms']} ms (total {r['total_ms']} ms)", flush=True)
    if args.out:
        out = Path(args.out)
        prev = json.loads(out.read_text())["rows"] if out.exists() else []
        keep = [p for p in prev if (p["case"], p.get("label")) not in {(r["case"], r["label"]) for r in rows}]
        out.write_text(json.dumps(dict(rows=keep + rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
