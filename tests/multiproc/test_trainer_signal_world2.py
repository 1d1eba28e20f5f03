"""SIGTERM to torchrun (NPROC=2, gloo): torchrun forwards it to both workers, which agree on the stop step (one
all-reduce per step), save one checkpoint together and exit; rank 0 prints the one line and the launcher
(titan_mm.launch.torchrun) exits 128 + SIGTERM without a traceback."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from titan_mm.checkpoint_io import list_checkpoints, read_commit, verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_one_checkpoint_on_both_ranks(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC="2")
    err = open(tmp_path / "err", "w")
    p = subprocess.Popen([str(ROOT / "run_train.sh"), "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}',
                          "--data.dataset", "synthetic", "--data.seq_len", "32", "--data.micro_batch_size", "2",
                          "--metrics.enable_tensorboard", "False", "--job.dump_folder", str(tmp_path),
                          "--job.name", "j", "--training.steps", "100000", "--checkpoint.interval", "1000"],
                         stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
    metrics = tmp_path / "j" / "metrics.jsonl"
    end = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert p.poll() is None and time.monotonic() < end, (tmp_path / "err").read_text()[-3000:]
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)  # run_train.sh execs torchrun: this is torchrun's pid
    rc = p.wait(timeout=120)
    text = (tmp_path / "err").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("interrupted at step")]
    assert len(lines) == 1, text[-3000:]  # rank 0 only
    n = int(lines[0].split()[3].rstrip(";"))
    assert lines[0] == f"interrupted at step {n}; checkpoint step-{n:08d} saved; rerun the same command to resume"
    assert rc == 128 + signal.SIGTERM, text[-3000:]  # titan_mm.launch.torchrun: no SignalException traceback
    assert "Traceback" not in text, text[-3000:]
    ck = list_checkpoints(tmp_path / "j" / "checkpoints")[-1]
    meta = read_commit(ck)
    assert ck.name == f"step-{n:08d}" and meta["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])  # both ranks' files, hashed by their writers
    verify_checkpoint(ck)
