"""What the debug-task benches (bench/bagel_digits.py, bench/wan_digits.py) share: a train_configs/ job trained
through the launcher into a run folder, and the shared CPU named in the results."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch

from titan_mm.launch.train import main as train
from titan_mm.observe.metrics import read_metrics


def train_run(config: str, folder: Path, steps: int = 0, *extra: str) -> tuple[float, dict[int, dict]]:
    """(wall seconds, metrics by step) of ``config`` trained into ``folder``/run (``steps`` 0: the config's);
    exits the bench in one line when the run fails."""
    args = ["--config", config, "--job.dump_folder", str(folder), "--job.name", "run",
            "--metrics.enable_tensorboard", "False", "--checkpoint.async_mode", "disabled", *extra]
    if steps:
        args += ["--training.steps", str(steps)]
    t0 = time.perf_counter()
    if train(args) != 0:
        sys.exit("the training run failed")
    return time.perf_counter() - t0, read_metrics(folder / "run" / "metrics.jsonl")


def cpu_device() -> str:
    """This CPU, its threads and load: the machine is shared, so wall times carry the load they ran under."""
    return (f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"load average {os.getloadavg()[0]:.1f}: the shared machine)")
