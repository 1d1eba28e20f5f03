"""Where the GPU waits: GPU idle gaps in a torch.profiler chrome trace, and what the host was doing then.

GPU activity is the union of the trace's kernel, memcpy and memset events; a gap is a stretch between them
longer than ``--min-us``. For each gap the host side is described by the CPU ops and CUDA runtime calls open at
the gap's midpoint (outermost first) on the busiest host threads (the main thread; autograd's device thread in the
backward): the thread that entered its innermost open op last. Gaps are summed by those ops, so the idle time splits
into what kept the host busy (an optimizer, a hook, a Python loop) and blocking calls (a host read).

  python bench/trace_gaps.py trace.json [--min-us 20] [--top 20] [--depth 3] [--json out.json]

Writes a summary (total, busy, idle; idle by host op) and the longest gaps, each with its outermost host ops
(``host``) and its innermost four (``host_inner``, innermost first: with a trace recorded with_stack, the Python
frames the host was in).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# the runtime calls name a blocking host op's cause (cudaMalloc / cudaFree in the allocator, a stream sync)
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")


def load_events(path: str | Path) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def gpu_busy(events: list[dict]) -> list[tuple[float, float, str]]:
    """Merged GPU busy intervals [(start_us, end_us, name of the last event in it)]."""
    iv = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
                if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    out: list[list] = []
    for s, e, n in iv:
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1], out[-1][2] = e, n
        else:
            out.append([s, e, n])
    return [tuple(x) for x in out]


def gaps(busy, min_us: float) -> list[tuple[float, float, str]]:
    """(start, end, last GPU event before it) for every idle stretch longer than ``min_us``."""
    return [(e0, s1, n0) for (_, e0, n0), (s1, _, _) in zip(busy, busy[1:]) if s1 - e0 > min_us]


class HostStacks:
    """CPU ops of the busiest host threads (the main thread, and autograd's device thread, which runs the
    backward), to ask which ops were open at given times (outermost first)."""

    def __init__(self, events: list[dict], threads: int = 2):
        by_tid: dict = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in HOST_CATS:
                by_tid[e.get("tid")].append((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")))
        self.tids = sorted(by_tid, key=lambda t: -len(by_tid[t]))[:threads]
        self.ops = {t: sorted(by_tid[t]) for t in self.tids}

    def stacks_at(self, times: list[float]) -> list[list[str]]:
        """For each time (any order): the open ops of the thread that entered its innermost open op last
        (the one running then), outermost first; [] when no op is open on any of them."""
        order = sorted(range(len(times)), key=lambda i: times[i])
        best: list[tuple[float, list[str]]] = [(-1.0, []) for _ in times]
        for tid in self.tids:
            ops, j, open_ops = self.ops[tid], 0, []
            for i in order:  # sweep the sorted times: push ops that started, drop the ones that ended
                t = times[i]
                while j < len(ops) and ops[j][0] <= t:
                    open_ops.append(ops[j])
                    j += 1
                open_ops = [o for o in open_ops if o[1] >= t]
                if open_ops and open_ops[-1][0] > best[i][0]:
                    best[i] = (open_ops[-1][0], [o[2] for o in open_ops])
        return [b[1] for b in best]


def summarize(path: str | Path, min_us: float = 20.0, top: int = 20, depth: int = 3) -> dict:
    events = load_events(path)
    busy = gpu_busy(events)
    if not busy:
        raise SystemExit(f"{path}: no GPU events (kernel / memcpy / memset) in the trace")
    idle = gaps(busy, min_us)
    host = HostStacks(events)
    t0, t1 = busy[0][0], busy[-1][1]
    busy_us = sum(e - s for s, e, _ in busy)
    by_op: dict = defaultdict(float)
    rows = []
    stacks = host.stacks_at([(s + e) / 2 for s, e, _ in idle])
    for (s, e, before), stack in zip(idle, stacks):
        key = " > ".join(stack[:depth]) or "(no host op open)"
        by_op[key] += e - s
        rows.append(dict(at_ms=round((s - t0) / 1e3, 3), gap_us=round(e - s, 1), gpu_before=before[:80],
                         host=" > ".join(stack[:6])[:300], host_inner=" < ".join(stack[::-1][:4])[:300]))
    rows.sort(key=lambda r: -r["gap_us"])
    return dict(
        trace=str(path), span_ms=(t1 - t0) / 1e3, gpu_busy_ms=busy_us / 1e3,
        idle_ms=sum(e - s for s, e, _ in idle) / 1e3, min_gap_us=min_us, gaps=len(idle),
        idle_by_host_op_ms={k: round(v / 1e3, 3) for k, v in sorted(by_op.items(), key=lambda x: -x[1])},
        longest=rows[:top],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0, help="shortest gap counted (us)")
    ap.add_argument("--top", type=int, default=20, help="longest gaps listed")
    ap.add_argument("--depth", type=int, default=3, help="host ops (outermost first) that name a gap's group")
    ap.add_argument("--json", default="", help="also write the summary here")
    args = ap.parse_args(argv)
    r = summarize(args.trace, args.min_us, args.top, args.depth)
    print(f"{r['trace']}: span {r['span_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms "
          f"in {r['gaps']} gaps > {r['min_gap_us']:g} us")
    print("\nidle by host op (outermost first):")
    for k, v in list(r["idle_by_host_op_ms"].items())[:25]:
        print(f"  {v:9.3f} ms  {k[:160]}")
    print("\nlongest gaps:")
    for g in r["longest"]:
        print(f"  {g['gap_us']:9.1f} us at {g['at_ms']:9.3f} ms after [{g['gpu_before'][:50]}]  host: {g['host'][:200]}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
