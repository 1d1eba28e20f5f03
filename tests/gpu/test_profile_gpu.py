"""The sampled profiler window on CUDA (titan_mm/observe/profile.py): GPU idle % from real kernel intervals, with
record_function ranges on the GPU timeline left out, and the window's metrics in a short trainer run."""

from __future__ import annotations

import time

import pytest
import torch

from titan_mm.observe.metrics import read_metrics
from titan_mm.observe.profile import ProfileWindow
from titan_mm.launch.train import main

pytestmark = pytest.mark.gpu


def _window(work) -> dict[str, float]:
    dev = torch.device("cuda")
    w = ProfileWindow(every=2, steps=1, device=dev)  # step 2 is the window
    w.begin(2)
    work()
    torch.cuda.synchronize(dev)
    return w.end(2)


def test_idle_pct_follows_the_device():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm cuBLAS outside the window
        a @ a
    torch.cuda.synchronize()

    def saturated():
        for _ in range(400):
            a @ a

    def mostly_idle():
        with torch.profiler.record_function("host_wait"):  # mirrored on the GPU timeline as an annotation
            a @ a
            torch.cuda.synchronize()
            time.sleep(0.2)
            a @ a

    busy = _window(saturated)
    idle = _window(mostly_idle)
    assert busy["profile/compute_ms"] > 0 and busy["profile/comm_ms"] == 0.0
    assert 0.0 <= busy["profile/gpu_idle_pct"] < 25.0, busy
    assert 70.0 < idle["profile/gpu_idle_pct"] <= 100.0, idle  # the annotation over the sleep is not "busy"


def test_trainer_logs_the_window_on_cuda(tmp_path):
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "p", "--job.device", "cuda", "--training.steps", "4",
            "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
            "--data.seq_len", "64", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
            "--checkpoint.enable", "False", "--metrics.profile_every", "3", "--metrics.profile_steps", "2"]
    assert main(args) == 0
    rows = read_metrics(tmp_path / "p" / "metrics.jsonl")
    assert [s for s, r in rows.items() if "profile/gpu_idle_pct" in r] == [3]
    r = rows[3]
    print({k: v for k, v in r.items() if k.startswith("profile/")})
    assert 0.0 <= r["profile/gpu_idle_pct"] <= 100.0
    assert r["profile/compute_ms"] > 0 and r["profile/busy_ms"] <= r["profile/window_ms"] * 1.01
    assert r["profile/comm_ms"] == 0.0 and r["profile/comm_overlap_pct"] == 0.0  # one GPU: no collective kernel
    assert r["profile/steps"] == 2.0
