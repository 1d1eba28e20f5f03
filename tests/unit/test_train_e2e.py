"""End to end: the debug configs train, checkpoint and export; exact resume after SIGKILL; bad input.

Every registered family's debug config runs, shortened to 4 steps to keep the suite fast; the full runs and their
timings are in docs/training.md.
"""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from titan_mm.checkpoint_io import list_checkpoints
from titan_mm.config import load_config
from titan_mm.launch.train import main
from titan_mm.observe.metrics import read_metrics
from titan_mm.registry import list_models
from titan_mm.train.setup import model_from_config

ROOT = Path(__file__).resolve().parents[2]
# a fast model for the mechanics tests: synthetic tokens over a 256-token vocabulary
TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
        "--training.deterministic", "True"]


def run_sh(args, env_extra=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(env_extra or {})
    return subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def losses(run_dir):
    return {s: r["loss"] for s, r in read_metrics(Path(run_dir) / "metrics.jsonl").items()}


@pytest.mark.parametrize("name", list_models())
def test_debug_config_trains_checkpoints_and_exports(tmp_path, name):
    """Every registered family's train_configs/debug_<name>.toml: 4 steps on built-in data, the loss falls, two
    checkpoints, and the export loads in transformers with our logits (a new family is covered by registering
    it and shipping its debug config)."""
    config = f"debug_{name}"
    assert (ROOT / "train_configs" / f"{config}.toml").is_file(), f"family {name!r} ships no {config}.toml"
    spec, mcfg = model_from_config(load_config(["--config", config]), torch.device("cpu"))
    if not spec.schema().tokens:  # no tokens, no transformers export: tests/unit/test_wan.py trains and resumes it
        pytest.skip(f"{name} has no tokens to export to transformers")
    if not spec.hf_model_types:  # no transformers model (BAGEL): tests/unit/test_bagel.py trains and resumes it
        pytest.skip(f"{name} has no transformers model to export to")
    r = run_sh(["--config", config, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                "--lr_scheduler.warmup_steps", "2", "--checkpoint.interval", "2", "--metrics.log_freq", "1",
                "--training.global_batch_size", "0"])  # one micro-batch per step: the mechanics, not the recipe
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / config
    rows = read_metrics(run / "metrics.jsonl")
    assert sorted(rows) == [1, 2, 3, 4]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "step_time_s", "data_wait_s",
                "host_prepare_s", "mem_peak_gb", "nan_count", "step_time_p50_s", "step_time_p90_s", "data/packing_efficiency"):
        assert key in rows[4], key
    assert rows[4]["loss"] < rows[1]["loss"] - 0.5, [rows[s]["loss"] for s in rows]
    if spec.dims(mcfg).is_moe:
        assert rows[4]["aux_loss"] > 0
    assert "step 4/4 (100%)" in r.stdout and "eta" in r.stdout
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "config.toml").is_file()
    cks = list_checkpoints(run / "checkpoints")
    assert [p.name for p in cks] == ["step-00000002", "step-00000004"]

    out = tmp_path / "hf"
    import transformers

    from titan_mm.export import main as export_main
    from titan_mm.loader import load_model

    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0  # = python -m titan_mm.export ...

    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, arch).from_pretrained(out).eval()
    ours = load_model(run).model
    ids = torch.randint(0, 1000, (1, 16))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        mine = ours(ids, position_ids=torch.arange(16)[None]).logits
    torch.testing.assert_close(mine.float(), ref.float(), rtol=1e-4, atol=1e-4)


def test_exact_resume_after_sigkill(tmp_path):
    common = ["--job.dump_folder", str(tmp_path), "--training.steps", "8", "--checkpoint.interval", "2",
              "--lr_scheduler.warmup_steps", "2", *TINY]
    a = run_sh([*common, "--job.name", "straight"])
    assert a.returncode == 0, a.stderr[-3000:]
    # killed (SIGKILL) in the middle of step 6, right after the async save of step 4 was started
    b = run_sh([*common, "--job.name", "killed"], env_extra={"TITAN_MM_FAULT_KILL_AT_STEP": "5"})
    assert b.returncode == -signal.SIGKILL, (b.returncode, b.stderr[-2000:])
    done = [p.name for p in list_checkpoints(tmp_path / "killed" / "checkpoints")]
    assert done and done[-1] in ("step-00000002", "step-00000004")
    c = run_sh([*common, "--job.name", "killed"])
    assert c.returncode == 0, c.stderr[-3000:]
    assert "resumed from" in c.stderr
    la, lc = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    resumed_at = int(done[-1].split("-")[1])
    for s in range(resumed_at + 1, 9):
        assert la[s] == lc[s], (s, la[s], lc[s])  # bitwise
    assert sorted(lc) == list(range(1, 9))


def test_corrupt_latest_checkpoint_falls_back(tmp_path, capsys):
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "c", "--training.steps", "4",
            "--checkpoint.interval", "2", "--checkpoint.async_mode", "disabled", *TINY]
    assert main(args) == 0
    straight = losses(tmp_path / "c")
    data = next((tmp_path / "c" / "checkpoints" / "step-00000004").glob("*.distcp"))
    data.write_bytes(b"\0" * 64)
    capsys.readouterr()
    assert main([*args[:5], "6", *args[6:]]) == 0
    err = capsys.readouterr().err
    assert "step-00000004 is corrupt or unreadable" in err and "falling back" in err
    assert "resumed from" in err and "step-00000002" in err
    again = losses(tmp_path / "c")
    assert again[3] == straight[3] and again[4] == straight[4]  # steps 3-4 were re-run exactly


def test_nan_policies(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TITAN_MM_FAULT_NAN_AT_STEP", "2")
    args = ["--job.dump_folder", str(tmp_path), "--training.steps", "3", "--checkpoint.enable", "False", *TINY]
    assert main([*args, "--job.name", "stop"]) == 1
    err = capsys.readouterr().err
    assert "step 2: non-finite loss=nan" in err and "nan_policy='stop'" in err
    assert main([*args, "--job.name", "skip", "--training.nan_policy", "skip"]) == 0
    rows = read_metrics(tmp_path / "skip" / "metrics.jsonl")
    assert rows[2]["skipped"] == 1 and rows[3]["nan_count"] == 1 and rows[3]["skipped"] == 0
    assert "update skipped" in capsys.readouterr().err


def test_bad_input_messages(tmp_path, capsys):
    assert main(["--config", "debug_qwen3", "--training.stepz", "3"]) == 2
    assert "unknown command-line option --training.stepz: did you mean 'training.steps'" in capsys.readouterr().err
    assert main(["--config", "no_such_config.toml"]) == 2
    assert "config file 'no_such_config.toml' not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nlr = 'fast'\n")
    assert main(["--config", str(bad)]) == 2
    assert "'optimizer.lr' has the wrong type: got 'fast' (str), expected float" in capsys.readouterr().err
    assert main(["--job.dump_folder", str(tmp_path), "--model.hf_path", str(tmp_path / "missing_hf")]) == 2
    assert "model.hf_path" in capsys.readouterr().err
    assert main(["--model.flavor", "debgu", "--job.dump_folder", str(tmp_path)]) == 2
    assert "did you mean 'debug'" in capsys.readouterr().err
    assert main(["--model.overrides", '{"hiden_size": 8}', "--job.dump_folder", str(tmp_path)]) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_init_from_hf_dir(tmp_path):
    """--model.hf_path: the architecture comes from config.json and the weights from the safetensors."""
    from titan_mm.config import load_config
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.registry import get_model_spec
    from titan_mm.train.setup import build_model, model_from_config

    spec = get_model_spec("qwen3")
    src_cfg = spec.flavors["debug"].replace(vocab_size=300, num_hidden_layers=1, hidden_size=48,
                                            intermediate_size=96, head_dim=16)
    torch.manual_seed(123)
    src = spec.build(src_cfg)
    src.init_weights()
    spec.save_hf(src, src_cfg, str(tmp_path / "hf"))
    cfg = load_config(["--model.hf_path", str(tmp_path / "hf"), "--model.flavor", "ignored-with-hf-path"])
    s2, mcfg = model_from_config(cfg, torch.device("cpu"))
    assert (mcfg.vocab_size, mcfg.hidden_size, mcfg.num_hidden_layers) == (300, 48, 1)
    model = build_model(cfg, s2, mcfg, ParallelDims(world_size=1), torch.device("cpu"))
    ref = src.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_real_recipe_resolves():
    """qwen3_1.7b.toml: config, model spec, meta build, plan and FLOPs (the GPU run itself is on the H200)."""
    from titan_mm.config import load_config
    from titan_mm.train.setup import grad_accum_steps, model_from_config

    cfg = load_config(["--config", "qwen3_1.7b"])
    spec, mcfg = model_from_config(cfg, torch.device("cuda"))  # no CUDA needed: only picks cuda defaults
    assert mcfg.attn_backend == "flex" and mcfg.hidden_size == 2048 and mcfg.num_hidden_layers == 28
    with torch.device("meta"):
        model = spec.build(mcfg)
    n = sum(p.numel() for p in model.parameters())
    assert 1.6e9 < n < 2.1e9, n
    assert spec.plan(mcfg).fsdp_units
    assert spec.flops(mcfg, [4096] * 4) > 6 * 1.4e9 * 4 * 4096
    assert grad_accum_steps(cfg, 1) == 4 and grad_accum_steps(cfg, 4) == 1
