"""The trainer on debug_qwen3.toml's built-in data (the real tokenizer, packed text), shortened (1 layer, rows of
64 tokens, 2 or 4 steps): its global batch of 4 rows is 2 micro-batch slots, read as 2 micro-batches by one
process or one per rank by two, so NPROC=2 gives the losses of 1 process, and a checkpoint written by 2
processes continues on 1 (and 1 on 2) with the uninterrupted run's losses."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from titan_mm.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--config", "debug_qwen3.toml", "--model.overrides", '{"num_hidden_layers": 1}', "--data.seq_len", "64",
          "--metrics.enable_tensorboard", "False", "--lr_scheduler.name", "constant",  # one schedule for any length
          "--checkpoint.interval", "2", "--checkpoint.keep_last", "0"]


def train(nproc: int, folder: Path, name: str, steps: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC=str(nproc))
    r = subprocess.run([str(ROOT / "run_train.sh"), *COMMON, "--job.dump_folder", str(folder), "--job.name", name,
                        "--training.steps", str(steps)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def curve(run: Path) -> dict[int, tuple[float, float]]:
    return {s: (m["loss"], m["grad_norm"]) for s, m in read_metrics(run / "metrics.jsonl").items()}


def assert_follows(got: dict, ref: dict, steps) -> None:
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        (loss, gn), (ref_loss, ref_gn) = got[s], ref[s]
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (s, got[s], ref[s])
        assert abs(gn - ref_gn) <= 1e-4 * abs(ref_gn), (s, got[s], ref[s])  # summed over ranks in another order


def from_checkpoint(src: Path, folder: Path, name: str) -> None:
    (folder / name / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / "step-00000002", folder / name / "checkpoints" / "step-00000002")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 process for 4 steps (checkpoints at 2 and 4), and 2 processes for 2 steps."""
    folder = tmp_path_factory.mktemp("world_change")
    train(1, folder, "one", 4)
    two = train(2, folder, "two", 2)
    assert "world 2 (dp 2, grad accum 1)" in two.stdout
    return folder


def test_two_processes_equal_one_on_builtin_data(runs):
    one = read_metrics(runs / "one" / "metrics.jsonl")
    assert one[1]["data/tokens"] > 0 and one[1]["data/samples"] > 0  # the packed built-in text, not synthetic rows
    assert_follows(curve(runs / "two"), curve(runs / "one"), range(1, 3))


def test_two_process_checkpoint_resumes_on_one(runs):
    from_checkpoint(runs / "two", runs, "two_then_one")
    r = train(1, runs, "two_then_one", 4)
    assert "resumed from" in r.stderr and "step-00000002" in r.stderr
    assert_follows(curve(runs / "two_then_one"), curve(runs / "one"), range(3, 5))


def test_one_process_checkpoint_resumes_on_two(runs):
    from_checkpoint(runs / "one", runs, "one_then_two")
    r = train(2, runs, "one_then_two", 4)
    assert "resumed from" in r.stderr and "step-00000002" in r.stderr
    assert_follows(curve(runs / "one_then_two"), curve(runs / "one"), range(3, 5))
