"""A checkpoint saved under tensor parallelism resumes in one process, and one saved under FSDP resumes under tp 2,
through the trainer (run_train.sh, gloo): the optimizer state is saved by parameter name (param-group options per
parameter) and the schedule without its per-group lists, so the number and order of parameter groups, which
depends on the layout (titan_mm.train.optim.split_dtensor_groups), does not matter.

Cases: debug_qwen3 (AdamW, and Muon: its Muon and AdamW groups both split under tp) and debug_wan tp 2 -> 1,
debug_qwen3 fsdp 2 -> tp 2. Each case trains the straight run A for 4 steps (checkpoint at 2) in layout X, and resumes A's step-2 checkpoint
for steps 3-4 in layout Y. The comparison is with A itself: at step 3 both runs hold the same parameters, optimizer
state and data, and differ only in how the matmuls and the gradient reductions are split (tp's row-parallel
partial sums, FSDP's reduce-scatter): a few fp32 roundings per reduction, ~1e-6 relative on a loss of ~12 over a
few hundred terms. 1e-5 relative on the loss, 1e-4 on the grad norm (a sum of squares over ranks in another order;
the step-4 update adds Adam's normalised step of gradients that differ by those roundings) - the tolerances of
tests/multiproc/test_trainer_world_change.py, which checks the same promise for dp. Without the fix the load
itself fails (KeyError 'betas' / a zip() length error in the optimizer load)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from titan_mm.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--metrics.enable_tensorboard", "False", "--checkpoint.interval", "2", "--checkpoint.keep_last", "0",
          "--checkpoint.async_mode", "disabled", "--training.steps", "4"]
MODELS = {
    "qwen3": ["--config", "debug_qwen3.toml", "--model.overrides", '{"num_hidden_layers": 1}', "--data.seq_len",
              "64"],
    "wan": ["--config", "debug_wan.toml"],
}
MODELS["qwen3_muon"] = [*MODELS["qwen3"], "--optimizer.name", "muon"]  # Muon and AdamW groups, split under tp
TP2 = ("2", ["--parallel.tp", "2"])
FSDP2 = ("2", ["--parallel.dp_shard", "2"])
ONE = ("1", [])


def train(model: str, layout: tuple, folder: Path, name: str) -> subprocess.CompletedProcess:
    nproc, args = layout
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC=nproc)
    r = subprocess.run([str(ROOT / "run_train.sh"), *MODELS[model], *COMMON, *args, "--job.dump_folder",
                        str(folder), "--job.name", name], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def curve(run: Path) -> dict[int, tuple[float, float]]:
    return {s: (m["loss"], m["grad_norm"]) for s, m in read_metrics(run / "metrics.jsonl").items()}


def resume_and_compare(tmp_path: Path, model: str, saved: tuple, resumed: tuple) -> None:
    train(model, saved, tmp_path, "straight")
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-00000002",
                    tmp_path / "resumed" / "checkpoints" / "step-00000002")
    r = train(model, resumed, tmp_path, "resumed")
    assert "resumed from" in r.stderr and "step-00000002" in r.stderr, r.stderr[-2000:]
    got, ref = curve(tmp_path / "resumed"), curve(tmp_path / "straight")
    assert sorted(got) == [3, 4], sorted(got)
    for s in (3, 4):
        (loss, gn), (ref_loss, ref_gn) = got[s], ref[s]
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (s, got[s], ref[s])
        assert abs(gn - ref_gn) <= 1e-4 * abs(ref_gn), (s, got[s], ref[s])


@pytest.mark.parametrize("model", ["qwen3", "wan", "qwen3_muon"])
def test_tp2_checkpoint_resumes_in_one_process(tmp_path, model):
    resume_and_compare(tmp_path, model, TP2, ONE)


def test_fsdp2_checkpoint_resumes_under_tp2(tmp_path):
    resume_and_compare(tmp_path, "qwen3", FSDP2, TP2)
