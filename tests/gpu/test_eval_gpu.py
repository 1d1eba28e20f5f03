"""Online eval on CUDA: the debug VL run with [eval] every 3 steps (held-out loss, digits through the engine in
bf16 on the gathered weights). The eval frees what it took: a step's peak is what is allocated when it starts plus
its own transient, so an eval that leaves nothing allocated (eval/kept_mem_gb <= 0, exact: the allocator's count
of live bytes) cannot raise a later step's peak. Before, the engine's CUDA-graph capture left cuBLAS's workspace
of its stream (32 MiB) allocated: 1.753 GB before the first eval, 1.786 GB after on the H200. The step peaks
themselves move with the data (images per row), so they are printed, not compared. Online equals
python -m titan_mm.eval on the final checkpoint.

    pytest -q tests/gpu/test_eval_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_eval_on_cuda_frees_its_memory_and_matches_offline(tmp_path):
    from titan_mm.observe.metrics import read_metrics

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = ["--config", "debug_qwen3_vl", "--job.dump_folder", str(tmp_path), "--training.steps", "9",
            "--eval.interval", "3", "--eval.task_limit", "32", "--checkpoint.interval", "9",
            "--metrics.enable_tensorboard", "False"]
    r = subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path / "debug_qwen3_vl" / "metrics.jsonl")
    assert [s for s in rows if "eval/time_s" in rows[s]] == [3, 6, 9]
    kept = [rows[s]["eval/kept_mem_gb"] for s in (3, 6, 9)]
    print("step peaks GB", [rows[s]["mem_peak_gb"] for s in sorted(rows)], "kept by the evals GB", kept)
    assert all(k <= 0 for k in kept), kept
    print({k: v for k, v in rows[9].items() if k.startswith("eval/")})
    r = subprocess.run([sys.executable, "-m", "titan_mm.eval", "--checkpoint", str(tmp_path / "debug_qwen3_vl")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    off = json.loads(r.stdout.strip().splitlines()[-1])
    assert off["eval/digits/accuracy"] == rows[9]["eval/digits/accuracy"]
    assert abs(off["eval/digits_test/loss"] - rows[9]["eval/digits_test/loss"]) <= 1e-4 * rows[9]["eval/digits_test/loss"]
