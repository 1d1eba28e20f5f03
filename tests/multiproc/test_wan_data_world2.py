"""train_configs/debug_wan_data.toml from a latent cache on 2 gloo processes: its global batch of 4 clips is 2
micro-batch slots (of one bucket each), read as 2 micro-batches by one process or one per rank by two, so NPROC=2
gives the losses of 1 process (data.balance stays on: the clips' loader leaves placement off, since a micro-batch
is one bucket's shape)."""

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("diffusers")  # the optional extra [diffusers]

from titan_mm.models.wan.toy import save_random_encoders, write_clip_rows  # noqa: E402
from titan_mm.observe.metrics import read_metrics  # noqa: E402
from titan_mm.tools.cache import main as cache  # noqa: E402

pytestmark = pytest.mark.slow  # two launcher runs of spawned processes: ~90 s on 2 shared cores
ROOT = Path(__file__).resolve().parents[2]
DATA = ["--config", "debug_wan_data.toml", "--data.video_fps", "0", "--data.video_min_frames", "1",
        "--data.video_max_frames", "9", "--data.video_max_pixels", "20000"]


def train(nproc: int, folder: Path, cache_dir: Path, name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC=str(nproc))
    r = subprocess.run([str(ROOT / "run_train.sh"), *DATA, "--data.dataset", str(cache_dir), "--training.steps", "3",
                        "--metrics.enable_tensorboard", "False", "--metrics.log_freq", "1", "--job.dump_folder",
                        str(folder), "--job.name", name], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def test_two_processes_equal_one_on_a_clip_cache(tmp_path):
    save_random_encoders(str(tmp_path / "pipe"), text_dim=16, z_dim=4)
    rows = write_clip_rows(str(tmp_path), 8, 9, ((16, 24), (24, 16)))
    cache([*DATA, "--data.dataset", rows, "--data.encoders", str(tmp_path / "pipe"), "--out", str(tmp_path / "cache")])
    train(1, tmp_path, tmp_path / "cache", "one")
    two = train(2, tmp_path, tmp_path / "cache", "two")
    assert "world 2 (dp 2, grad accum 1)" in two.stdout
    one, two = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert sorted(two) == [1, 2, 3]
    for s in (1, 2, 3):  # the same rows; the gradients are summed over the ranks in another order
        assert abs(two[s]["loss"] - one[s]["loss"]) <= 1e-5 * abs(one[s]["loss"]), (s, one[s], two[s])
        assert abs(two[s]["grad_norm"] - one[s]["grad_norm"]) <= 1e-4 * abs(one[s]["grad_norm"]), (s, one[s], two[s])
