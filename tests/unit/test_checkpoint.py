"""DCP checkpoints: async save of the whole TrainState, keep-last-K, commit marker, corrupt fallback."""

import json

import pytest
import torch

from titan_mm.checkpoint_io import COMMIT_FILE, CheckpointError, list_checkpoints, resolve_checkpoint
from titan_mm.config import JobConfig
from titan_mm.registry import get_model_spec
from titan_mm.train.checkpoint import CheckpointManager
from titan_mm.train.optim import build_lr_scheduler, build_optimizer
from titan_mm.train.state import TrainState
from titan_mm.train.step import StepContext, train_step
from titan_mm.train.synthetic import SyntheticLoader


def make_state(seed=0):
    spec = get_model_spec("qwen3")
    mcfg = spec.flavors["debug"].replace(vocab_size=128, num_hidden_layers=1, hidden_size=32,
                                         intermediate_size=64, head_dim=8)
    torch.manual_seed(seed)
    m = spec.build(mcfg)
    m.init_weights()
    cfg = JobConfig()
    cfg.training.steps = 20
    cfg.lr_scheduler.warmup_steps = 3
    opt = build_optimizer(m, cfg)
    loader = SyntheticLoader(vocab_size=128, seq_len=16, micro_batch_size=2, seed=0)
    return TrainState(model=m, optimizer=opt, scheduler=build_lr_scheduler(opt, cfg), dataloader=loader)


def run_steps(state, n):
    it = iter(state.dataloader)
    losses = []
    for _ in range(n):
        losses.append(train_step(state, [next(it)], StepContext(device=torch.device("cpu"))).loss)
    return losses


def snapshot(state):
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def test_async_save_is_a_snapshot_and_resume_is_exact(tmp_path):
    st = make_state()
    run_steps(st, 3)
    mgr = CheckpointManager(tmp_path, interval=1, async_mode="async")
    mgr.save(st)
    saved = snapshot(st)
    later = run_steps(st, 3)  # training goes on while the save is written
    mgr.close()
    assert (tmp_path / "step-00000003" / COMMIT_FILE).is_file()
    assert json.loads((tmp_path / "step-00000003" / COMMIT_FILE).read_text())["step"] == 3

    fresh = make_state(seed=1)
    assert CheckpointManager(tmp_path, interval=1).resume(fresh) == 3
    assert fresh.step == 3 and fresh.dataloader.served == 3
    for k, v in snapshot(fresh).items():
        assert torch.equal(v, saved[k]), k
    assert run_steps(fresh, 3) == later  # bitwise: optimizer moments, schedule, data position restored


def test_keep_last_and_incomplete_checkpoints(tmp_path, capsys):
    st = make_state()
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=2, async_mode="async")
    for _ in range(4):
        run_steps(st, 1)
        mgr.save(st)
    mgr.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    # a save interrupted before its commit marker: never loaded, removed at the next start
    partial = tmp_path / "step-00000005"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert resolve_checkpoint(tmp_path).name == "step-00000004"
    fresh = make_state()
    assert CheckpointManager(tmp_path, interval=1).resume(fresh) == 4
    assert not partial.exists()
    assert "removing incomplete checkpoint" in capsys.readouterr().err


def test_corrupt_latest_falls_back_and_says_so(tmp_path, capsys):
    st = make_state()
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=0, async_mode="disabled")
    run_steps(st, 2)
    mgr.save(st)
    good = snapshot(st)
    run_steps(st, 2)
    mgr.save(st)
    mgr.close()
    data = next((tmp_path / "step-00000004").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # truncated: committed but unreadable
    fresh = make_state(seed=3)
    assert CheckpointManager(tmp_path, interval=1).resume(fresh) == 2
    err = capsys.readouterr().err
    assert "checkpoint" in err and "step-00000004 is corrupt or unreadable" in err and "falling back" in err
    assert "resumed from" in err and "step-00000002" in err
    for k, v in snapshot(fresh).items():
        assert torch.equal(v, good[k])
    # every checkpoint corrupt: a clear error, not a silent fresh start
    (tmp_path / "step-00000002" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="every checkpoint failed to load"):
        CheckpointManager(tmp_path, interval=1).resume(make_state())


def test_resolve_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        resolve_checkpoint(tmp_path)
    st = make_state()
    mgr = CheckpointManager(tmp_path, interval=1, async_mode="disabled")
    run_steps(st, 1)
    mgr.save(st)
    with pytest.raises(CheckpointError, match="load_step=7.*available steps: \\[1\\]"):
        mgr.resume(make_state(), load_step=7)
