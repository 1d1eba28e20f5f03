"""The sampled profiler window (titan_mm/observe/profile.py): the interval arithmetic on synthetic intervals (exact
values), the kernel classification, the schedule, no profiler outside the window, and a real CPU window in a run."""

from __future__ import annotations

import json

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from titan_mm.observe.metrics import read_metrics
from titan_mm.observe.profile import (ProfileWindow, intersection_length, is_collective, length, split_events, union,
                                      window_stats)
from titan_mm.launch.train import main

TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
        "--checkpoint.enable", "False"]


def test_union_merges_overlapping_touching_and_nested_intervals():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4), (7, 9), (7.5, 8), (10, 10)]) == [(0, 4), (5, 6), (7, 9)]
    assert union([]) == [] and length([]) == 0.0
    assert length(union([(0, 4), (2, 6), (10, 12)])) == 8


def test_intersection_length_two_pointer_sweep():
    a = union([(0, 6), (10, 12)])
    b = union([(1, 3), (5, 11), (20, 30)])
    assert intersection_length(a, b) == 4  # (1,3) + (5,6) + (10,11)
    assert intersection_length(b, a) == 4
    assert intersection_length(a, []) == 0
    assert intersection_length([(0, 1)], [(1, 2)]) == 0  # touching is not overlapping


def test_window_stats_exact():
    comm = [(0, 4), (2, 6), (10, 12)]           # union 8 ms
    compute = [(1, 3), (5, 11), (20, 30)]       # union 2 + 6 + 10 = 18 ms; 4 ms of it under a collective
    got = window_stats(comm, compute, 44.0, copies=[(30, 33), (31, 32)])
    assert got == {
        "profile/comm_overlap_pct": 50.0,       # 4 / 8
        "profile/gpu_idle_pct": 50.0,           # busy = (0,12) + (20,30) = 22 of 44 (copies keep no SM busy)
        "profile/window_ms": 44.0, "profile/busy_ms": 22.0, "profile/comm_ms": 8.0, "profile/compute_ms": 18.0,
        "profile/overlap_ms": 4.0, "profile/exposed_comm_ms": 4.0, "profile/copy_ms": 3.0,
    }
    fully_hidden = window_stats([(2, 3)], [(0, 10)], 20.0)
    assert fully_hidden["profile/comm_overlap_pct"] == 100.0 and fully_hidden["profile/gpu_idle_pct"] == 50.0
    none = window_stats([], [(0, 5)], 10.0)
    assert none["profile/comm_overlap_pct"] == 0.0 and none["profile/comm_ms"] == 0.0  # no collective ran
    assert window_stats([], [(0, 12)], 10.0)["profile/gpu_idle_pct"] == 0.0  # clock skew never goes below 0


def _ev(name, start_us, end_us, device=DeviceType.CUDA, annotation=False):
    return FunctionEvent(id=0, name=name, thread=0, start_us=start_us, end_us=end_us, device_type=device,
                         is_user_annotation=annotation)


def test_split_events_classifies_kernels():
    events = [
        _ev("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0, 4000),
        _ev("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 1000, 3000),
        _ev("Memcpy HtoD (Pinned -> Device)", 5000, 6000),
        _ev("Memset (Device)", 6000, 6500),
        _ev("## forward ##", 0, 9000, annotation=True),                 # a record_function range on the GPU
        _ev("aten::mm", 0, 9000, device=DeviceType.CPU),                # the host side of a launch
    ]
    comm, compute, copies = split_events(events, torch.device("cuda"))
    assert comm == [(0.0, 4.0)] and compute == [(1.0, 3.0)] and copies == [(5.0, 6.0), (6.0, 6.5)]
    cpu_events = [_ev("aten::mm", 0, 2000, DeviceType.CPU), _ev("gloo:all_reduce", 1000, 3000, DeviceType.CPU),
                  _ev("c10d::allreduce_", 1000, 1100, DeviceType.CPU), _ev("Optimizer.step", 0, 9000, DeviceType.CPU)]
    comm, compute, copies = split_events(cpu_events, torch.device("cpu"))
    assert comm == [(1.0, 3.0), (1.0, 1.1)] and compute == [(0.0, 2.0)] and copies == []
    assert not is_collective("aten::broadcast_tensors") and is_collective("ncclKernel_ReduceScatter_Sum_bf16")


def test_schedule_and_no_profiler_outside_the_window():
    w = ProfileWindow(every=5, steps=2, device=torch.device("cpu"))
    assert [s for s in range(1, 13) if w.in_window(s)] == [4, 5, 9, 10]
    assert not any(ProfileWindow(0, 2, torch.device("cpu")).in_window(s) for s in range(1, 20))
    x = torch.randn(64, 64)
    enabled, out = [], {}
    for step in range(1, 6):
        w.begin(step)
        enabled.append(torch.autograd._profiler_enabled())
        x = torch.tanh(x @ x)
        got = w.end(step)
        if got:
            out[step] = got
    w.close()
    assert enabled == [False, False, False, True, True] and not torch.autograd._profiler_enabled()
    assert list(out) == [5] and out[5]["profile/steps"] == 2.0
    assert out[5]["profile/compute_ms"] > 0 and 0.0 <= out[5]["profile/gpu_idle_pct"] <= 100.0


def test_cpu_window_in_a_tiny_run(tmp_path):
    """metrics.profile_every 3 / profile_steps 2 over 4 steps: steps 2-3 are profiled, step 3's row has the numbers
    (from the CPU ops on CPU), the others have none."""
    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "p", "--training.steps", "4", *TINY,
                 "--metrics.profile_every", "3", "--metrics.profile_steps", "2"]) == 0
    rows = read_metrics(tmp_path / "p" / "metrics.jsonl")
    assert [s for s, r in rows.items() if "profile/gpu_idle_pct" in r] == [3]
    r = rows[3]
    assert 0.0 <= r["profile/gpu_idle_pct"] <= 100.0 and r["profile/comm_overlap_pct"] == 0.0  # one rank: no comm
    assert r["profile/steps"] == 2.0 and r["profile/compute_ms"] > 0
    assert r["profile/busy_ms"] <= r["profile/window_ms"] * 1.01
    assert r["profile/window_ms"] >= 1e3 * (rows[2]["step_time_s"] + rows[3]["step_time_s"]) * 0.99


def test_traces_of_each_window(tmp_path):
    """metrics.profile_traces: each window as a Chrome trace and its op tables under <run>/profile/, named by the
    window's last step."""
    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "p", "--training.steps", "4", *TINY,
                 "--metrics.profile_every", "2", "--metrics.profile_steps", "1", "--metrics.profile_traces",
                 "True"]) == 0
    folder = tmp_path / "p" / "profile"
    assert sorted(f.name for f in folder.iterdir()) == ["step2.json", "step2.txt", "step4.json", "step4.txt"]
    assert json.loads((folder / "step4.json").read_text())["traceEvents"]
    assert "aten::" in (folder / "step4.txt").read_text()
