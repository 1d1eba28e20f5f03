"""Operable under faults, on CUDA (one GPU: the trainer starts a 1-rank NCCL group before it takes the run lock, and
DCP gathers the checkpoint writers' failures over its gloo group, which pickles them):
- a run folder held by a live process: one line, exit 2, nothing built;
- a full disk in the async save of step 4 (TITAN_MM_FAULT_ENOSPC_AT_STEP): one line, exit 1, step 2 kept, no lock
  left; the same command without the fault resumes from step 2 and finishes.

    pytest -q tests/gpu/test_checkpoint_faults_gpu.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from titan_mm.checkpoint_io import list_checkpoints
from titan_mm.train.run_lock import LOCK_FILE, _proc_start

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_lock_refusal_and_full_disk_on_cuda(tmp_path):
    run = tmp_path / "j"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = [str(ROOT / "run_train.sh"), "--config", "debug_qwen3", "--job.dump_folder", str(tmp_path), "--job.name",
            "j", "--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
            "--metrics.enable_tensorboard", "False", "--job.device", "cuda"]

    def train(**extra):
        return subprocess.run(args, capture_output=True, text=True, env=dict(env, **extra), cwd=ROOT, timeout=400)

    run.mkdir()
    now = time.time()
    (run / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now,
                                             "renewed": now, "token": "t", "proc_start": _proc_start(os.getpid())}))
    r = train()
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: run folder {run} is in use by another trainer: PID "
                                                        f"{os.getpid()} on host {socket.gethostname()} since ")
    assert "params" not in r.stdout + r.stderr
    (run / LOCK_FILE).unlink()

    r = train(TITAN_MM_FAULT_ENOSPC_AT_STEP="4")
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: no space left on device writing checkpoint step-00000004 to {run / 'checkpoints'}; the last good "
        "checkpoint step-00000002 is kept; free some space, then rerun the same command to resume"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert [p.name for p in list_checkpoints(run / "checkpoints", committed_only=False)] == ["step-00000002"]
    assert not (run / LOCK_FILE).exists()

    r = train()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step-00000002" in r.stderr
    assert [p.name for p in list_checkpoints(run / "checkpoints")][-1] == "step-00000006"
