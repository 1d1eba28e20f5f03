"""A sampled profiler window: every ``every`` steps, torch.profiler records the last ``steps`` steps, and the
kernel intervals become two numbers.

    window = ProfileWindow(every=100, steps=2, device=device)     # steps 99-100, 199-200, ...
    window.begin(step)                     # before the step's data fetch; starts the profiler on a window's first step
    ... train step, cuda synchronize ...
    metrics.update(window.end(step))       # {} except on a window's last step: stops and measures

- ``profile/comm_overlap_pct``: the share of collective time hidden under compute,
  |union(collective) & union(compute)| / |union(collective)| (0 when the window ran no collective);
- ``profile/gpu_idle_pct``: 1 - |union(collective + compute)| / window wall time (data wait and host gaps count
  as idle),

with the raw milliseconds beside them (``profile/window_ms``, ``busy_ms``, ``comm_ms``, ``compute_ms``,
``overlap_ms``, ``exposed_comm_ms``, ``copy_ms``). On CUDA the intervals are the device kernels: collective = a kernel
whose name says NCCL (or another collective, ``is_collective``); compute = every other kernel; memcpy /
memset count as neither (copy engines, not SMs). On CPU there are no kernels: the same numbers come
from the CPU ops (compute = ``aten::`` ops on any thread, collective = gloo / c10d ops), so "idle" there is
the host time outside any op (Python, data, framework overhead).

Every rank profiles its window (the same overhead everywhere keeps the ranks in step at the collectives);
each rank returns its own numbers and the logger writes rank 0's. Outside a window the cost is two integer
comparisons a step: no profiler object exists.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

_COLLECTIVE = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
               "reducescatter", "all_to_all", "alltoall")
_COPY = ("memcpy", "memset")


# ------------------------------------------------------------------------------------ interval arithmetic
def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points as ``intervals`` ((start, end) pairs)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(merged: list[tuple[float, float]]) -> float:
    """Total length of disjoint intervals (the output of :func:`union`)."""
    return sum((b - a for a, b in merged), 0.0)


def intersection_length(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the points in both of two disjoint, sorted interval lists (a two-pointer sweep)."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def window_stats(comm, compute, wall: float, *, copies=()) -> dict[str, float]:
    """The window's numbers from collective and compute intervals and its wall time, all in one unit (ms).

    Copies (memcpy / memset) are only reported (``copy_ms``): they run on copy engines, so they neither
    hide a collective nor keep the SMs busy.
    """
    c, k = union(comm), union(compute)
    busy = length(union([*c, *k]))
    comm_t, overlap = length(c), intersection_length(c, k)
    return {
        "profile/comm_overlap_pct": 100.0 * overlap / comm_t if comm_t > 0 else 0.0,
        "profile/gpu_idle_pct": min(100.0, max(0.0, 100.0 * (1.0 - busy / wall))) if wall > 0 else 0.0,
        "profile/window_ms": wall, "profile/busy_ms": busy, "profile/comm_ms": comm_t,
        "profile/compute_ms": length(k), "profile/overlap_ms": overlap, "profile/exposed_comm_ms": comm_t - overlap,
        "profile/copy_ms": length(union(copies)),
    }


def is_collective(name: str) -> bool:
    n = name.lower()
    return any(s in n for s in _COLLECTIVE)


def split_events(events, device: torch.device):
    """(collective, compute, copy) intervals in ms from profiler events (docs at the top of this module)."""
    comm, compute, copies = [], [], []
    on_gpu = device.type == "cuda"
    for e in events:
        if on_gpu:
            if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation:
                continue  # CPU ops, and record_function ranges mirrored on the GPU timeline
        elif e.device_type != torch.autograd.DeviceType.CPU or e.is_async:
            continue
        span = (e.time_range.start / 1e3, e.time_range.end / 1e3)  # us -> ms
        name = e.name
        if is_collective(name):
            comm.append(span)
        elif on_gpu and name.lower().startswith(_COPY):
            copies.append(span)
        elif on_gpu or name.startswith("aten::"):
            compute.append(span)
    return comm, compute, copies


def write_trace(prof, folder: Path, step: int, device: torch.device) -> None:
    """``prof``'s window as ``folder``/step<N>.json (Chrome trace) and step<N>.txt (the ops by device time on CUDA,
    then by host time)."""
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / f"step{step}.json"))
    ops = prof.key_averages()
    sorts = (["self_device_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
    (folder / f"step{step}.txt").write_text("\n\n".join(ops.table(sort_by=k, row_limit=40) for k in sorts))


# ------------------------------------------------------------------------------------------ the window
class ProfileWindow:
    """Profiles steps ``k*every - steps + 1 .. k*every`` for k = 1, 2, ... (never step 1: warmup and compile)."""

    def __init__(self, every: int, steps: int, device: torch.device, traces: Path | None = None):
        """``traces``: a folder that receives each window as step<N>.json (Chrome trace) and step<N>.txt (op
        tables); None writes nothing."""
        self.every, self.steps, self.device, self.traces = every, steps, device, traces
        self._prof = None
        self._t0 = 0.0
        self._n = 0  # steps profiled in the open window (fewer than ``steps`` when a resume lands inside one)

    def in_window(self, step: int) -> bool:
        return self.every > 0 and (step - 1) % self.every >= self.every - self.steps

    def begin(self, step: int) -> None:
        """Called before step ``step`` (counting from 1) starts; opens the profiler on a window's first step."""
        if not self.in_window(step):
            return
        self._n += 1
        if self._prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)  # the window starts with an idle device
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.start()
        self._t0 = time.perf_counter()

    def end(self, step: int) -> dict[str, float]:
        """Called after step ``step`` finished; on a window's last step, stops the profiler and returns its numbers."""
        if self._prof is None or step % self.every:
            return {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.stop()
        if self.traces is not None:
            write_trace(prof, self.traces, step, self.device)
        comm, compute, copies = split_events(prof.events(), self.device)
        n, self._n = self._n, 0
        return {**window_stats(comm, compute, wall_ms, copies=copies), "profile/steps": float(n)}

    def close(self) -> None:
        """Stops a window left open (the loop raised or ended inside it)."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
            self._n = 0
