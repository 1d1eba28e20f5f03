"""bench/rl.py in its CPU smoke (--cpu --tiny): the titan side launches the real [rl] trainer on a one-layer Qwen3
from the HF folder the bench writes, and TRL's GRPOTrainer runs on the same folder, prompts and G when trl imports
(scripts/fetch_wheels.sh carries it to the GPU machine; the row says "skipped" where it is missing). The JSON carries
the time split and the steps-per-hour ratio the GPU run reports."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # one trainer launch (+ TRL's run where it imports), ~1-3 min on 2 busy cores
def test_bench_rl_cpu_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = tmp_path / "rl.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench/rl.py"), "--cpu", "--tiny", "--dir", str(tmp_path / "w"),
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["shape"]["group"] == 8
    titan = res["sides"]["titan"]
    assert titan["steps_timed"] == 2 and titan["rollout_s"] > 0 and titan["train_s"] > 0
    assert titan["sync_s"] < titan["rollout_s"]  # one rank: the engine holds the trainer's tensors
    assert titan["rollout_tok_s"] > 0 and len(titan["reward_mean"]) == 3
    trl = res["sides"]["trl"]
    if importlib.util.find_spec("trl") is None:
        assert "skipped" in trl and "titan_over_trl_steps_per_hour" not in res
    else:
        assert trl["steps_timed"] == 2 and trl["rollout_s"] > 0 and res["titan_over_trl_steps_per_hour"] > 0


def test_bench_rl_mistakes_are_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "bench/rl.py"), "--cpu", "--sides", "titan,vllm"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--sides 'titan,vllm'" in p.stderr
