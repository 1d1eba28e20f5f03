"""A full disk during an async save with NPROC=2: both ranks learn it from DCP's gather (the writer's OSError, pickled
whole) and report it at the same step (the next save or the end, which every rank reaches together), so each prints
the one line (torchrun may stop the second rank once the first exits 1, after its line) and no rank dies with a
traceback in a collective its peer left. The last good checkpoint is kept."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from titan_mm.checkpoint_io import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_both_ranks_report_the_full_disk_in_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC="2", TITAN_MM_FAULT_ENOSPC_AT_STEP="4")
    r = subprocess.run([str(ROOT / "run_train.sh"), "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}',
                        "--data.dataset", "synthetic", "--data.seq_len", "32", "--data.micro_batch_size", "2",
                        "--metrics.enable_tensorboard", "False", "--job.dump_folder", str(tmp_path), "--job.name", "j",
                        "--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    ck = tmp_path / "j" / "checkpoints"
    want = (f"error: no space left on device writing checkpoint step-00000004 to {ck}; the last good checkpoint "
            "step-00000002 is kept; free some space, then rerun the same command to resume")
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [want, want], r.stderr[-4000:]
    assert r.returncode == 1 and not re.search(r"\[rank\d\]: Traceback", r.stderr), r.stderr[-4000:]
    assert [p.name for p in list_checkpoints(ck, committed_only=False)] == ["step-00000002"]
