"""model.hf_path as a Hub repo id (titan_mm.models.hf_io.local_hf_dir): a pre-filled HF cache is used with
HF_HUB_OFFLINE=1 (no network at test time), and a cache miss offline is one line naming the id, HF_HUB_OFFLINE
and the local-folder option. huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE at import, so each case runs
in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_mm.registry import get_model_spec

ROOT = Path(__file__).resolve().parents[2]
REV = "0123456789abcdef0123456789abcdef01234567"


def _fill_cache(cache: Path, repo_id: str) -> tuple[Path, dict]:
    """A tiny HF Qwen3 (config.json + model.safetensors) in the hub cache layout
    models--org--name/{refs/main, snapshots/<rev>/...}; returns the snapshot folder and the weights."""
    spec = get_model_spec("qwen3")
    cfg = spec.flavors["debug"].replace(vocab_size=300, num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with torch.device("meta"):
        model = spec.build(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    with torch.no_grad():
        model.init_weights()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / REV
    spec.save_hf(model, cfg, str(snap))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return snap, {k: v.clone() for k, v in model.state_dict().items()}


def _python(code: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"),
             HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)


def test_hub_id_offline_cache_hit_and_miss(tmp_path):
    """One fresh process with HF_HUB_OFFLINE=1 and a pre-filled cache. Hit: the id resolves to the cached snapshot,
    the trainer's model comes from its config.json and weights, the memory estimator reads it. Miss (an id not
    cached): the trainer exits 2 with one line naming the id, HF_HUB_OFFLINE and the local-folder option, and
    writes no run folder."""
    snap, weights = _fill_cache(tmp_path / "hub", "tiny-org/tiny-qwen3")
    torch.save(weights, tmp_path / "want.pt")
    code = f"""
import json, sys, torch
from titan_mm.config import load_config
from titan_mm.models.hf_io import local_hf_dir
from titan_mm.parallel.mesh import ParallelDims
from titan_mm.train.setup import build_model, model_from_config
from titan_mm.launch.train import main
from titan_mm.tools.memory import main as memory
cfg = load_config(["--config", "debug_qwen3", "--model.hf_path", "tiny-org/tiny-qwen3"])
spec, mcfg = model_from_config(cfg, torch.device("cpu"))
model = build_model(cfg, spec, mcfg, ParallelDims(world_size=1), torch.device("cpu"))
want = torch.load({str(tmp_path / "want.pt")!r})
same = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
print(json.dumps({{"dir": local_hf_dir("tiny-org/tiny-qwen3", weights=True), "vocab": mcfg.vocab_size,
                  "hidden": mcfg.hidden_size, "same": same}}))
memory(["--config", "debug_qwen3", "--model.hf_path", "tiny-org/tiny-qwen3"])
sys.stdout.flush()
sys.exit(main(["--config", "debug_qwen3", "--job.dump_folder", {str(tmp_path / "runs")!r},
               "--model.hf_path", "tiny-org/not-cached"]))
"""
    r = _python(code, tmp_path)
    out = json.loads(r.stdout.splitlines()[0])
    assert out == {"dir": str(snap), "vocab": 300, "hidden": 16, "same": True}, r.stderr[-3000:]
    assert "model tiny-org/tiny-qwen3:" in r.stdout and "total" in r.stdout
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert line.startswith("config error: model.hf_path 'tiny-org/not-cached' is a Hub repo id that is not in the "
                           f"cache ({tmp_path / 'hub'})")
    assert "HF_HUB_OFFLINE=1" in line and "or pass a local folder to --model.hf_path" in line
    assert not (tmp_path / "runs").exists()


def test_not_a_folder_nor_an_id(tmp_path):
    from titan_mm.models.hf_io import HFPathNotFound, local_hf_dir

    for bad in (str(tmp_path / "missing"), "no-slash-name", "a/b/c"):
        with pytest.raises(HFPathNotFound, match=r"is not a directory nor a Hub repo id \(org/name\)"):
            local_hf_dir(bad)
    assert local_hf_dir(str(tmp_path)) == str(tmp_path)  # an existing folder is used as it is
