"""Preemption and runs that would do nothing, on a real ``python -m titan_mm.launch.train`` process.

SIGTERM / SIGINT: the step finishes, a checkpoint is saved, one line, exit 128 + signal, and the same command
resumes from it. A repeated SIGTERM is ignored (Slurm + torchrun deliver one each); a SIGINT after the first
signal ends the process at once and never touches the last committed checkpoint.
A resume at or past training.steps stops before anything is written.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_mm.checkpoint_io import COMMIT_FILE, list_checkpoints, read_commit, verify_checkpoint
from titan_mm.launch.train import main
from titan_mm.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
        "--lr_scheduler.warmup_steps", "2"]


def start(tmp_path, name, args, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "titan_mm.launch.train", "--job.dump_folder", str(tmp_path),
                             "--job.name", name, *TINY, *args], stdout=out, stderr=err, env=env, cwd=ROOT)


def wait_for(cond, proc, what, timeout=120):
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"trainer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def steps_logged(run):
    f = run / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.is_file() else 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_exits_with_one_line_and_resumes(tmp_path, sig, capsys):
    run = tmp_path / "job"
    p = start(tmp_path, "job", ["--training.steps", "100000", "--checkpoint.interval", "1000"])
    wait_for(lambda: steps_logged(run) >= 3, p, "step 3")
    p.send_signal(sig)
    assert p.wait(timeout=60) == 128 + sig
    err = (tmp_path / "job.err").read_text()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    n = int(last.split()[3].rstrip(";"))
    assert last == f"interrupted at step {n}; checkpoint step-{n:08d} saved; rerun the same command to resume"
    assert n >= 3 and max(read_metrics(run / "metrics.jsonl")) == n  # the step in flight was finished
    ck = list_checkpoints(run / "checkpoints")[-1]
    assert ck.name == f"step-{n:08d}" and read_commit(ck)["step"] == n
    verify_checkpoint(ck)

    # the same command (in this process, and with a reachable step count to keep the test short) resumes from it
    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "job", *TINY, "--training.steps", str(n + 2),
                 "--checkpoint.interval", "1000"]) == 0
    assert f"resumed from {ck} (step {n})" in capsys.readouterr().err
    assert max(read_metrics(run / "metrics.jsonl")) == n + 2


def test_second_signal_exits_at_once_and_keeps_the_last_checkpoint(tmp_path, capsys):
    run = tmp_path / "job"
    # the async save of step 4 hangs before its commit (as if its writer were stuck); step 6's save waits on it
    p = start(tmp_path, "job", ["--training.steps", "100000", "--checkpoint.interval", "2"],
              env_extra={"TITAN_MM_FAULT_HOLD_SAVE_AT_STEP": "4"})
    wait_for(lambda: steps_logged(run) >= 6, p, "step 6")
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "again exits at once" in (tmp_path / "job.err").read_text(), p, "the first signal's notice")
    p.send_signal(signal.SIGTERM)  # the duplicate a preempted torchrun worker gets: ignored
    time.sleep(1.0)
    assert p.poll() is None
    p.send_signal(signal.SIGINT)  # Ctrl-C again
    assert p.wait(timeout=30) == -signal.SIGINT  # the default action: no handler, no save, no commit
    cks = run / "checkpoints"
    assert [c.name for c in list_checkpoints(cks)] == ["step-00000002"]
    verify_checkpoint(cks / "step-00000002")  # untouched, every file as recorded
    held = cks / "step-00000004"
    assert held.is_dir() and any(held.glob("*.distcp")) and not (held / COMMIT_FILE).exists()

    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "job", *TINY, "--training.steps", "3",
                 "--checkpoint.interval", "2"]) == 0
    err = capsys.readouterr().err
    assert f"removing incomplete checkpoint {held}" in err and not held.exists()
    assert "resumed from" in err and "(step 2)" in err


def test_resume_at_or_past_steps_refuses_and_writes_nothing(tmp_path, capsys):
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "done", *TINY, "--checkpoint.interval", "2",
            "--metrics.enable_tensorboard", "True"]
    assert main([*args, "--training.steps", "4"]) == 0
    run = tmp_path / "done"
    before = {p: p.stat().st_mtime_ns for p in [run / "config.toml", run / "metrics.jsonl", *run.rglob("*")]}
    capsys.readouterr()
    for steps in ("4", "2"):
        assert main([*args, "--training.steps", steps]) != 0
        err = capsys.readouterr().err.strip()
        assert err.splitlines()[-1].endswith(
            f"run folder {run} is already at step 4 >= training.steps {steps}; "
            "raise --training.steps or use a new --job.name"), err
        assert "loss nan" not in err
    assert {p: p.stat().st_mtime_ns for p in [run / "config.toml", run / "metrics.jsonl", *run.rglob("*")]} == before
    # a higher step count continues the run
    assert main([*args, "--training.steps", "6"]) == 0
    assert max(read_metrics(run / "metrics.jsonl")) == 6


def test_resume_false_starts_fresh_and_sets_the_old_checkpoints_aside(tmp_path, capsys):
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "again", *TINY, "--checkpoint.interval", "2"]
    assert main([*args, "--training.steps", "4"]) == 0
    capsys.readouterr()
    assert main([*args, "--training.steps", "2", "--checkpoint.resume", "False"]) == 0
    err = capsys.readouterr().err
    run = tmp_path / "again"
    aside = [p for p in run.iterdir() if p.name.startswith("checkpoints.before-")]
    assert len(aside) == 1 and f"moved the earlier checkpoints to {aside[0]}" in err
    assert [c.name for c in list_checkpoints(aside[0])] == ["step-00000002", "step-00000004"]
    # the fresh run's own checkpoints, not pruned in favour of the earlier run's step 4
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == ["step-00000002"]


def test_sigterm_to_the_whole_process_group_with_loader_workers(tmp_path):
    """Slurm signals every process of the job: the loader workers must survive it so the trainer can save."""
    run = tmp_path / "job"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    err = open(tmp_path / "job.err", "w")
    args = ["--model.overrides", '{"num_hidden_layers": 1}', "--data.dataset", "builtin", "--data.seq_len", "64",
            "--data.micro_batch_size", "1", "--data.num_workers", "2", "--training.global_batch_size", "2",
            "--metrics.enable_tensorboard", "False", "--training.steps", "100000", "--checkpoint.interval", "1000"]
    p = subprocess.Popen([sys.executable, "-m", "titan_mm.launch.train", "--config", "debug_qwen3",
                          "--job.dump_folder", str(tmp_path), "--job.name", "job", *args],
                         stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT, start_new_session=True)
    wait_for(lambda: steps_logged(run) >= 2, p, "step 2")
    os.killpg(p.pid, signal.SIGTERM)  # the trainer and its workers, as scancel / preemption does
    assert p.wait(timeout=90) == 128 + signal.SIGTERM
    text = (tmp_path / "job.err").read_text()
    assert "Traceback" not in text and "killed by signal" not in text, text[-2000:]
    assert text.strip().splitlines()[-1].startswith("interrupted at step ")
