"""Step timing shared by the benches: the timed steps run back to back, as in training.

On CUDA each step's time is the GPU-side span between events recorded after each step, with one synchronize after
the last: a stack's host work overlaps the GPU as far as its own step lets it, and nothing of the bench's is on
the clock. On the CPU the steps are timed on the host. The rows say which (``timing``: "events" or "host").
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def step_times(step: Callable[[], Any], n: int, cuda: bool) -> tuple[list[float], list[Any]]:
    """(seconds of each of ``n`` calls of ``step``, what each returned)."""
    outs = []
    if not cuda:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            outs.append(step())
            times.append(time.perf_counter() - t0)
        return times, outs
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    marks[0].record()
    for m in marks[1:]:
        outs.append(step())
        m.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])], outs


def timing_label(cuda: bool) -> str:
    return "events" if cuda else "host"


def graph_us(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    """Microseconds a call of ``fn``: on CUDA a graph of ``reps`` calls replayed (median of 10 replays: GPU time,
    no launch gaps, as the serving engine replays its steps), on the CPU the host time of one call."""
    fn()
    if not cuda:
        return statistics.median(step_times(fn, 3, False)[0]) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times, _ = step_times(graph.replay, 10, True)
    return statistics.median(times) / reps * 1e6
