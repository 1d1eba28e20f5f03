"""A full disk during a checkpoint save is one line, and the last good checkpoint survives for the resume.

The fault (TITAN_MM_FAULT_ENOSPC_AT_STEP=k) makes the DCP writer's file raise OSError(ENOSPC) once 64 KiB of the save
of step k are written: inside torch.save, which turns it into "unexpected pos 704 vs 598" (the message a real full
tmpfs gave), with the OSError only in its __context__.
"""

import errno
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import make_state, run_steps, snapshot  # pytest puts tests/unit on sys.path
from test_checkpoint_integrity import TINY
from torch.distributed.checkpoint.api import CheckpointException

from titan_mm.checkpoint_io import ModelItem, list_checkpoints, verify_checkpoint
from titan_mm.launch.train import main
from titan_mm.observe.metrics import read_metrics
from titan_mm.train.checkpoint import CheckpointManager, CheckpointSaveError, _os_error, _Writer
from titan_mm.train.run_lock import LOCK_FILE


def line(step, folder, kept):
    return (f"no space left on device writing checkpoint step-{step:08d} to {folder}; "
            + (f"the last good checkpoint step-{kept:08d} is kept" if kept else "there is no earlier checkpoint")
            + "; free some space, then rerun the same command to resume")


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_full_disk_is_one_line_and_the_last_good_checkpoint_loads(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("TITAN_MM_FAULT_ENOSPC_AT_STEP", "4")
    st = make_state()
    mgr = CheckpointManager(tmp_path, interval=2, keep_last=1, async_mode=mode)
    run_steps(st, 2)
    mgr.save(st)
    good = snapshot(st)
    run_steps(st, 2)
    with pytest.raises(CheckpointSaveError) as e:
        mgr.save(st)  # blocking: fails here; async: the write fails in the background ...
        mgr.wait()  # ... and is reported when the save is waited on
    assert str(e.value) == line(4, tmp_path, 2)
    assert "unexpected pos" in repr(e.value.__cause__.failures[0][0].__cause__)  # what torch.save made of it
    mgr.close()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]  # the partial step-4 is gone, step-2 kept
    verify_checkpoint(tmp_path / "step-00000002")
    fresh = make_state(seed=3)
    assert CheckpointManager(tmp_path, interval=2).resume(fresh) == 2
    for k, v in snapshot(fresh).items():
        assert torch.equal(v, good[k]), k


def test_a_failed_or_interrupted_resave_of_a_committed_step_keeps_it(tmp_path, monkeypatch, capsys):
    """Resumed with load_step=2 while step 4 is committed: the new save of step 4 keeps the old one aside until it
    commits; a full disk puts it back, and so does the next start after a crash mid-save."""
    st = make_state()
    mgr = CheckpointManager(tmp_path, interval=2, keep_last=0, async_mode="disabled")
    run_steps(st, 2)
    mgr.save(st)
    run_steps(st, 2)
    mgr.save(st)
    old4 = snapshot(st)
    old_commit = (tmp_path / "step-00000004" / "commit.json").read_bytes()
    mgr.close()

    monkeypatch.setenv("TITAN_MM_FAULT_ENOSPC_AT_STEP", "4")
    branch = make_state(seed=3)
    mgr = CheckpointManager(tmp_path, interval=2, keep_last=0, async_mode="disabled")
    assert mgr.resume(branch, load_step=2) == 2
    branch.optimizer.param_groups[0]["lr"] *= 3  # another trajectory from step 2
    run_steps(branch, 2)
    with pytest.raises(CheckpointSaveError, match="^" + line(4, tmp_path, 2) + "$"):
        mgr.save(branch)
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004"]
    assert (tmp_path / "step-00000004" / "commit.json").read_bytes() == old_commit  # the old step 4, whole
    verify_checkpoint(tmp_path / "step-00000004")

    # a crash in the middle of the new save: an uncommitted step-4 beside the old one set aside
    (tmp_path / "step-00000004").rename(tmp_path / "step-00000004.replaced")
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "__0_0.distcp").write_bytes(b"partial")
    capsys.readouterr()
    fresh = make_state(seed=4)
    assert CheckpointManager(tmp_path, interval=2).resume(fresh) == 4
    assert f"restored {tmp_path / 'step-00000004'}: the save that was replacing it was interrupted" in (
        capsys.readouterr().err)
    for k, v in snapshot(fresh).items():
        assert torch.equal(v, old4[k]), k

    monkeypatch.delenv("TITAN_MM_FAULT_ENOSPC_AT_STEP")  # and a save that commits replaces it
    mgr = CheckpointManager(tmp_path, interval=2, keep_last=0, async_mode="disabled")
    mgr.resume(branch, load_step=2)
    run_steps(branch, 2)
    mgr.save(branch)
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004"]
    assert (tmp_path / "step-00000004" / "commit.json").read_bytes() != old_commit


def test_a_full_disk_at_the_first_save_says_there_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_MM_FAULT_ENOSPC_AT_STEP", "1")
    st = make_state()
    run_steps(st, 1)
    mgr = CheckpointManager(tmp_path, interval=1, async_mode="disabled")
    with pytest.raises(CheckpointSaveError, match="^" + line(1, tmp_path, None) + "$"):
        mgr.save(st)
    mgr.close()
    assert list(tmp_path.iterdir()) == []


def test_the_writer_raises_a_picklable_os_error(tmp_path):
    """DCP gathers the ranks' failures by pickling them, which drops __context__: the writer's OSError survives."""
    w = _Writer(tmp_path / "ck", fault_room=1000)
    with pytest.raises(CheckpointException) as e:
        dcp.save({"model": ModelItem(make_state().model)}, storage_writer=w)
    inner = e.value.failures[0][0]
    assert isinstance(inner, OSError) and inner.errno == errno.ENOSPC  # not the RuntimeError torch.save raised
    back = pickle.loads(pickle.dumps(inner))
    assert _os_error(back).errno == errno.ENOSPC and back.strerror == "No space left on device"


def test_trainer_reports_a_full_disk_in_one_line_and_resumes_from_the_kept_checkpoint(tmp_path, monkeypatch, capsys):
    run = tmp_path / "job"
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "job", *TINY, "--checkpoint.interval", "2",
            "--checkpoint.async_mode", "async"]
    assert main([*args, "--training.steps", "6"]) == 0  # the reference losses
    ref = {s: r["loss"] for s, r in read_metrics(run / "metrics.jsonl").items()}
    run.rename(tmp_path / "ref")
    capsys.readouterr()

    monkeypatch.setenv("TITAN_MM_FAULT_ENOSPC_AT_STEP", "4")
    assert main([*args, "--training.steps", "6"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "error: " + line(4, run / "checkpoints", 2), err[-3000:]
    assert "Traceback" not in err and "unexpected pos" not in err, err[-3000:]
    assert [p.name for p in list_checkpoints(run / "checkpoints", committed_only=False)] == ["step-00000002"]
    assert not (run / LOCK_FILE).exists()

    monkeypatch.delenv("TITAN_MM_FAULT_ENOSPC_AT_STEP")
    assert main([*args, "--training.steps", "6"]) == 0
    assert "resumed from" in capsys.readouterr().err
    got = read_metrics(run / "metrics.jsonl")
    for s in (3, 4, 5, 6):  # the resumed steps: the uninterrupted run's losses, bit for bit (deterministic CPU)
        assert got[s]["loss"] == ref[s], (s, got[s]["loss"], ref[s])
