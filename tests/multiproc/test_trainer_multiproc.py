"""The trainer over 2 CPU processes (torchrun, gloo, FSDP2): same loss curve as 1 process for the same
global batch, and checkpoints that reshard 2 -> 1 and 1 -> 2 processes."""

import os
import shutil
import subprocess
from pathlib import Path

from titan_mm.checkpoint_io import list_checkpoints, read_commit
from titan_mm.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# synthetic rows depend only on (seed, step, global row), so 1 process x 2 micro-batches and 2 processes
# x 1 micro-batch see the same global batch of 4 rows
COMMON = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
          "--data.seq_len", "32", "--data.micro_batch_size", "2", "--training.global_batch_size", "4",
          "--metrics.enable_tensorboard", "False", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
          "--lr_scheduler.name", "constant",  # runs of different lengths share one schedule
          "--checkpoint.keep_last", "0", "--checkpoint.interval", "3"]


def run(nproc, args, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC=str(nproc))
    r = subprocess.run([str(ROOT / "run_train.sh"), *COMMON, *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def curve(run_dir):
    return {s: (r["loss"], r["grad_norm"]) for s, r in read_metrics(Path(run_dir) / "metrics.jsonl").items()}


def close(a, b, tol=1e-5):
    return abs(a - b) <= tol * max(1.0, abs(b))


def test_two_processes_match_one_and_reshard(tmp_path):
    d = ["--job.dump_folder", str(tmp_path)]
    run(1, [*d, "--job.name", "one", "--training.steps", "7"])
    r2 = run(2, [*d, "--job.name", "two", "--training.steps", "5"])
    assert "world 2 (dp 2, grad accum 1)" in r2.stdout
    one, two = curve(tmp_path / "one"), curve(tmp_path / "two")
    for s in range(1, 6):
        assert close(two[s][0], one[s][0]) and close(two[s][1], one[s][1], 1e-4), (s, one[s], two[s])
    assert read_commit(list_checkpoints(tmp_path / "two" / "checkpoints")[-1])["world_size"] == 2

    # 2 -> 1: the 2-process run continues in 1 process (from step 5) and follows the 1-process curve
    r = run(1, [*d, "--job.name", "two", "--training.steps", "7"])
    assert "resumed from" in r.stderr and "step-00000005" in r.stderr
    two = curve(tmp_path / "two")
    for s in (6, 7):
        assert close(two[s][0], one[s][0]), (s, one[s], two[s])

    # 1 -> 2: the 1-process checkpoint of step 3 continues in 2 processes
    (tmp_path / "from_one" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "one" / "checkpoints" / "step-00000003",
                    tmp_path / "from_one" / "checkpoints" / "step-00000003")
    r = run(2, [*d, "--job.name", "from_one", "--training.steps", "7"])
    assert "resumed from" in r.stderr and "step-00000003" in r.stderr
    f1 = curve(tmp_path / "from_one")
    assert sorted(f1) == [4, 5, 6, 7]
    for s in f1:
        assert close(f1[s][0], one[s][0]), (s, one[s], f1[s])
