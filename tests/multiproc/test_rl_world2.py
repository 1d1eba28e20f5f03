"""RL over 2 gloo processes with FSDP2 (dp 2) equals 1 process: each rank samples its own prompts' groups on the
weights gathered to its engine (full tensors copied in place each step), and the step's statistics are the global
batch's. Step 1 samples from the same initial weights: the same rollouts and rewards exactly, the loss to float
rounding (FSDP's sums over 2 ranks)."""

import os
import subprocess
from pathlib import Path

import pytest

from titan_mm.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SMALL = ['--model.overrides', '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, '
         '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}',
         "--data.seq_len", "32", "--data.micro_batch_size", "4", "--training.global_batch_size", "8",
         "--rl.prompts_per_step", "2", "--rl.group_size", "4", "--rl.max_tokens", "4",
         "--rl.rewards", '{"operator:lt": 1.0}', "--metrics.enable_tensorboard", "False",
         "--checkpoint.enable", "False", "--training.steps", "2"]


@pytest.mark.slow  # two launches, ~40 s on 2 cores
def test_fsdp2_rollouts_match_one_process(tmp_path):
    rows = {}
    for name, n in (("w1", 1), ("dp2", 2)):
        env = dict(os.environ, OMP_NUM_THREADS="1", NPROC=str(n), PYTHONPATH=str(ROOT))
        r = subprocess.run([str(ROOT / "run_train.sh"), "--config", "debug_rl_qwen3.toml", *SMALL,
                            "--job.dump_folder", str(tmp_path), "--job.name", name], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        rows[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    one, two = rows["w1"][1], rows["dp2"][1]
    for key in ("data/rl/reward_mean", "data/rl/reward_std", "data/rl/completion_len", "count/pg"):
        assert one[key] == two[key], (key, one[key], two[key])
    # on-policy step 1: ratio 1, so the loss is -mean(A) ~ 0 up to fp32 rounding of 32 terms of |A| ~ 1; the
    # gradient is not: sum A grad log p, reduced over 2 ranks in another order (fp32, relative 1e-5)
    assert abs(one["loss"] - two["loss"]) <= 1e-6
    assert one["grad_norm"] > 0 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5 * one["grad_norm"]
    assert one["data/rl/sync_bytes"] == 0 < two["data/rl/sync_bytes"]  # one rank shares, FSDP gathers and copies
