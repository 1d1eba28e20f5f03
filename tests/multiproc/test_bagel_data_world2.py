"""train_configs/debug_bagel_digits.toml (BAGEL rows from builtin:digits through the packed loader) on 2 gloo
processes: its global batch of 2 micro-batch slots is read as 2 micro-batches by one process or one per rank by two,
so dp 2 gives the losses of one process; a dp-2 run stopped at its step-2 checkpoint and resumed by one process
continues the straight run (the loader's state is per slot, so another world reads what the straight run reads).
data.balance is off: the flat ViT keys cannot move between ranks (preflight refuses the default)."""

import os
import subprocess
from pathlib import Path

import pytest

from titan_mm.observe.metrics import read_metrics

pytestmark = pytest.mark.slow  # three launcher runs, one of spawned processes: ~60 s on 2 shared cores
ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--config", "debug_bagel_digits", "--training.global_batch_size", "4", "--data.micro_batch_size", "2",
        "--data.balance", "none", "--lr_scheduler.name", "constant", "--checkpoint.interval", "2",
        "--checkpoint.async_mode", "disabled", "--metrics.enable_tensorboard", "False", "--metrics.log_freq", "1"]


def train(nproc: int, folder: Path, name: str, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC=str(nproc))
    r = subprocess.run([str(ROOT / "run_train.sh"), *ARGS, "--training.steps", str(steps), "--job.dump_folder",
                        str(folder), "--job.name", name], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"world {nproc} (dp {nproc}, grad accum {2 // nproc})" in r.stdout, r.stdout[-2000:]
    return read_metrics(folder / name / "metrics.jsonl")


def test_two_processes_equal_one_and_resume_on_one(tmp_path):
    one = train(1, tmp_path, "one", 4)
    two = train(2, tmp_path, "two", 2)
    resumed = train(1, tmp_path, "two", 4)  # the dp-2 run's step-2 checkpoint, continued by one process
    assert sorted(one) == sorted(resumed) == [1, 2, 3, 4] and sorted(two) == [1, 2]
    for s in (1, 2, 3, 4):  # the same rows; dp 2 sums the gradients over the ranks in another order
        got = (two if s <= 2 else resumed)[s]
        for k, tol in (("loss", 1e-5), ("loss/ce", 1e-5), ("loss/mse", 1e-5), ("grad_norm", 1e-4)):
            assert abs(got[k] - one[s][k]) <= tol * abs(one[s][k]), (s, k, one[s][k], got[k])
