"""A checkpoint resumes into an optimizer whose parameter groups are split differently (what a layout change does:
titan_mm.train.optim.split_dtensor_groups splits a group into its DTensor and plain halves under tp without FSDP),
and a checkpoint in DCP's nested optimizer form (an older titan_mm) still resumes. One process: the per-parameter
AdamW arithmetic does not depend on the grouping, so the resumed losses equal the straight run's exactly. The
multi-process form (tp 2 -> 1, fsdp 2 -> tp 2 through the trainer) is tests/multiproc/test_resume_layout_change.py."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import make_state, run_steps  # pytest puts tests/unit on sys.path

import titan_mm.train.checkpoint as ckpt
from titan_mm.config import JobConfig
from titan_mm.train.checkpoint import CheckpointManager
from titan_mm.train.optim import build_lr_scheduler, build_optimizer, build_param_groups


def regroup(state, halves: bool) -> None:
    """Give ``state`` a fresh optimizer and schedule over the same model; ``halves``: every group split in two with
    the same options (name included), as split_dtensor_groups does."""
    cfg = JobConfig()
    cfg.training.steps = 20
    cfg.lr_scheduler.warmup_steps = 3  # make_state's schedule
    groups = build_param_groups(state.model, cfg)
    if halves:
        groups = [{**g, "params": ps} for g in groups for ps in (g["params"][::2], g["params"][1::2]) if ps]
    state.optimizer = build_optimizer(state.model, cfg, param_groups=groups)
    state.scheduler = build_lr_scheduler(state.optimizer, cfg)


@pytest.mark.parametrize("saved_halves", [False, True])
def test_resume_into_other_param_groups_is_exact(tmp_path, saved_halves):
    straight = make_state()
    regroup(straight, saved_halves)
    run_steps(straight, 3)
    CheckpointManager(tmp_path, interval=1, async_mode="disabled").save(straight)
    ref = run_steps(straight, 3)  # warmup ends at step 3: the resumed schedule must pick up the step count

    resumed = make_state(seed=1)
    regroup(resumed, not saved_halves)
    assert len(resumed.optimizer.param_groups) != len(straight.optimizer.param_groups)
    assert CheckpointManager(tmp_path, interval=1).resume(resumed) == 3
    assert run_steps(resumed, 3) == ref
    for a, b in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_in_the_nested_optimizer_form_still_resumes(tmp_path, monkeypatch):
    straight = make_state()
    run_steps(straight, 2)
    monkeypatch.setattr(ckpt, "_FLAT", None)  # save as an older titan_mm did
    CheckpointManager(tmp_path, interval=1, async_mode="disabled").save(straight)
    monkeypatch.undo()
    keys = dcp.FileSystemReader(str(tmp_path / "step-00000002")).read_metadata().state_dict_metadata
    assert "optimizer.param_groups.0.params" in keys  # the nested form: options keyed by group index
    ref = run_steps(straight, 2)

    resumed = make_state(seed=1)
    assert CheckpointManager(tmp_path, interval=1).resume(resumed) == 2
    assert run_steps(resumed, 2) == ref


def test_checkpoints_key_group_options_by_parameter(tmp_path):
    st = make_state()
    run_steps(st, 1)
    CheckpointManager(tmp_path, interval=1, async_mode="disabled").save(st)
    keys = dcp.FileSystemReader(str(tmp_path / "step-00000001")).read_metadata().state_dict_metadata
    names = [n for n, _ in st.model.named_parameters()]
    assert {f"optimizer.param_groups.{n}.lr" for n in names} <= set(keys)
    assert not any(k.startswith("optimizer.param_groups.0.") for k in keys)


def test_how_the_step_runs_stays_this_runs(tmp_path):
    """A checkpoint's foreach / fused flags come from the machine that wrote it: a CUDA run's fused=True would
    break a CPU resume, a CPU run's foreach would slow a CUDA one (and turn off the device-decided skip)."""
    st = make_state()
    run_steps(st, 2)
    CheckpointManager(tmp_path, interval=1, async_mode="disabled").save(st)
    resumed = make_state(seed=1)
    for g in resumed.optimizer.param_groups:
        g["foreach"] = False  # another implementation than the saved foreach=True
    assert CheckpointManager(tmp_path, interval=1).resume(resumed) == 2
    assert [g["foreach"] for g in resumed.optimizer.param_groups] == [False] * len(resumed.optimizer.param_groups)
    assert all(g["lr"] == h["lr"] for g, h in zip(resumed.optimizer.param_groups, st.optimizer.param_groups))
