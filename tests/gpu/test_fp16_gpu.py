"""float16 with dynamic loss scaling on CUDA (training.param_dtype = "float16"): the trainer on debug_qwen3 (FSDP2
on a 1-GPU mesh with float16 params, fused AdamW's device-decided skip, the Triton kernels in float16) starting
at a loss scale of 2**32, which overflows float16 for certain. The overflow steps are skipped and halve the
scale (not NaN-policy events: nan_policy is "stop"), then the run trains: finite, falling losses, and
loss_scale in metrics.jsonl every step.

    pytest -q tests/gpu/test_fp16_gpu.py
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_fp16_loss_scaling_trains_on_cuda(tmp_path):
    from titan_mm.observe.metrics import read_metrics

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = ["--config", "debug_qwen3", "--job.dump_folder", str(tmp_path), "--job.name", "fp16",
            "--training.steps", "36", "--training.param_dtype", "float16", "--training.loss_scale_init",
            str(2.0**32), "--training.loss_scale_growth_interval", "4", "--training.nan_policy", "stop",
            "--checkpoint.enable", "False", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "False"]
    r = subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path / "fp16" / "metrics.jsonl")
    steps = sorted(rows)
    assert steps == list(range(1, 37))
    scale = [rows[s]["loss_scale"] for s in steps]
    skipped = [rows[s]["skipped"] for s in steps]
    loss = [rows[s]["loss"] for s in steps]
    print("loss_scale:", scale, "\nskipped:", skipped, "\nloss:", [round(x, 3) for x in loss])
    assert scale[0] == 2.0**32 and skipped[0] == 1  # 2**32 x the gradients leaves float16's range
    for a, b, sk in zip(scale, scale[1:], skipped):  # an overflow halves; a good step keeps or doubles (growth)
        assert b == a / 2 if sk else b in (a, 2 * a), (scale, skipped)
    assert rows[steps[-1]]["nan_count"] == 0
    good = [x for x, sk in zip(loss, skipped) if not sk]
    assert len(good) >= 10 and all(math.isfinite(x) for x in loss), (loss, skipped)
    assert good[-1] < good[0] - 0.5, good
