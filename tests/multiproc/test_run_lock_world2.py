"""NPROC=2 on a run folder held by a live process: rank 0 is refused and broadcasts the verdict, so both ranks exit 2
with the same one line before the model build (no rank waits in a collective for a rank that left)."""

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from titan_mm.train.run_lock import LOCK_FILE, _proc_start

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_both_ranks_are_refused_with_the_same_line(tmp_path):
    run = tmp_path / "j"
    run.mkdir()
    now = time.time()
    body = {"pid": os.getpid(), "host": socket.gethostname(), "since": now, "renewed": now, "token": "this test",
            "proc_start": _proc_start(os.getpid())}  # held by this (live) test process
    (run / LOCK_FILE).write_text(json.dumps(body))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC="2")
    r = subprocess.run([str(ROOT / "run_train.sh"), "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}',
                        "--data.dataset", "synthetic", "--data.seq_len", "32", "--data.micro_batch_size", "2",
                        "--metrics.enable_tensorboard", "False", "--job.dump_folder", str(tmp_path), "--job.name", "j",
                        "--training.steps", "2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: run folder")]
    assert len(lines) == 2 and lines[0] == lines[1], r.stderr[-4000:]  # one per rank, the same
    assert lines[0].startswith(f"error: run folder {run} is in use by another trainer: PID {os.getpid()} on host "
                               f"{socket.gethostname()} since "), lines[0]
    assert r.returncode in (1, 2) and not re.search(r"\[rank\d\]: Traceback", r.stderr), r.stderr[-4000:]
    assert "params" not in r.stdout + r.stderr  # refused before the model build
    assert json.loads((run / LOCK_FILE).read_text()) == body  # the holder's lock is untouched
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
