"""Where a training step's GPU time goes: a torch.profiler chrome trace split into GEMM / attention / MoE routing
/ permute / norms / loss / optimizer / copies / elementwise / communication / other kernels, and idle time.

Each GPU event (kernel, memcpy, memset) goes to the first category whose rule matches its name (``CATEGORIES``,
case-insensitive substrings; Inductor's ``triton_*`` kernels are named after the ops they fuse, so the same
rules read them). Idle is the span from the first GPU event to the last minus the union of their intervals
(bench/trace_gaps.py says what the host did then). All figures are per step: the traced steps' totals over
``steps``. Overlapping kernels (several streams) count in full in their categories, so the categories can add
up to more than the busy time.

bench/mfu.py --profile DIR computes the split of each (case, stack) it runs into the row (``profile_ms``) and
writes the largest kernels of each category to DIR/split_CASE_STACK.json.

  python bench/profile_split.py trace.json --steps 2          # print one trace's split
  python bench/profile_split.py --render bench/results/mfu.json --doc docs/benchmarks.md   # the table of rows
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.devices import device_label, device_of  # noqa: E402
from bench.trace_gaps import GPU_CATS, gpu_busy, load_events  # noqa: E402

# first match wins: communication and attention before GEMMs (cuDNN's attention kernels name their wgmma tiles),
# the optimizer's multi-tensor kernels before the norms (torch's _foreach_norm of the clip), the loss before routing
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("comm", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn", "paged")),  # titan_mm's paged kernels: serving
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "_grouped_fwd", "_grouped_wgrad", "splitk", "cublas",
              "_fp8_mm")),  # titan_mm's fp8 GEMM at serving's decode rows
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("loss", ("_ce_", "cross_entropy", "log_softmax", "nll", "cunn_softmax")),  # aten's softmax kernels: a full-logit CE
    ("moe_routing", ("topk", "sort", "radix", "scan", "searchsorted", "bincount", "scatter_add", "histogram",
                     "softmax", "cumsum")),
    ("moe_permute", ("index", "gather", "scatter", "_combine_bwd")),  # titan_mm's _gather_sum / _combine_bwd too
    ("norms", ("rms", "layer_norm", "layernorm", "rsqrt")),
    ("copies", ("memcpy", "memset", "copy_kernel", "direct_copy", "upcast", "chunk_cat", "split_with_sizes",
                "fill_kernel")),
    ("elementwise", ("triton_", "elementwise", "reduce_kernel", "swiglu", "rope", "gelu", "silu", "_kernel")),
)
ORDER = tuple(c for c, _ in CATEGORIES) + ("other", "idle")


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def split(events: list[dict], steps: int, top: int = 8) -> tuple[dict, dict]:
    """(ms per step by category, including idle and ``step``; the ``top`` largest kernels of each category as
    [name, ms per step, calls per step])."""
    per_cat: dict = defaultdict(float)
    per_kernel: dict = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            name = e.get("name", "")
            per_cat[category(name)] += e.get("dur", 0)
            k = per_kernel[name]
            k[0] += e.get("dur", 0)
            k[1] += 1
    busy = gpu_busy(events)
    if not busy:
        raise ValueError("no GPU events (kernel / memcpy / memset) in the trace")
    span = busy[-1][1] - busy[0][0]
    idle = span - sum(b - a for a, b, _ in busy)
    ms = {c: round(per_cat.get(c, 0.0) / 1e3 / steps, 3) for c in ORDER[:-1]}
    ms["idle"] = round(idle / 1e3 / steps, 3)
    ms["step"] = round(span / 1e3 / steps, 3)
    kernels: dict = defaultdict(list)
    for name, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
        cat = category(name)
        if len(kernels[cat]) < top:
            kernels[cat].append([name[:160], round(us / 1e3 / steps, 3), n / steps])
    return ms, dict(kernels)


def render(rows: list[dict]) -> str:
    """Markdown: one line per profiled row, ms per step by category."""
    cols = [c for c in ORDER if any(r["profile_ms"].get(c, 0) >= 0.05 for r in rows)]
    out = ["| case | device | stack | step ms | " + " | ".join(cols) + " |", "|---|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        p = r["profile_ms"]
        label = r["stack"] + (f" ({r['model_overrides']})" if r.get("model_overrides") else "") \
            + (f", {r['profile_label']}" if r.get("profile_label") else "")
        out.append(f"| {r['case']} | {device_label(device_of(r))} | {label} | {p['step']:.1f} | " + " | ".join(f"{p.get(c, 0):.1f}" for c in cols)
                   + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", help="a torch.profiler chrome trace")
    ap.add_argument("--steps", type=int, default=2, help="training steps in the trace")
    ap.add_argument("--render", default="", help="a bench/mfu.py results JSON: the table of its profiled rows")
    ap.add_argument("--doc", default="", help="with --render: replace the table between the --marker markers here")
    ap.add_argument("--marker", default="profile-split")
    args = ap.parse_args(argv)
    if args.render:
        rows = [r for r in json.loads(Path(args.render).read_text())["rows"] if "profile_ms" in r]
        if not rows:
            ap.error(f"{args.render} has no profiled rows: run bench/mfu.py with --profile DIR first")
        table = render(rows)
        if args.doc:
            doc = Path(args.doc).read_text()
            a, b = f"<!-- {args.marker}:begin -->", f"<!-- {args.marker}:end -->"
            if a not in doc or b not in doc:
                ap.error(f"{args.doc} has no {a} ... {b} markers; add them where the table goes")
            Path(args.doc).write_text(doc[: doc.index(a) + len(a)] + "\n" + table + "\n" + doc[doc.index(b):])
        print(table)
        return 0
    if not args.trace:
        ap.error("give a trace file, or --render RESULTS.json")
    ms, kernels = split(load_events(args.trace), args.steps)
    print(" ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    for cat, ks in kernels.items():
        print(f"\n{cat}:")
        for name, m, n in ks:
            print(f"  {m:8.2f} ms  x{n:<6g} {name[:120]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
