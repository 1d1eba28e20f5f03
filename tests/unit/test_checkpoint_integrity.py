"""Checkpoint integrity: commit.json records every file's size and CRC-32, and a load checks them first.

4 KiB overwritten inside a .distcp (same size) used to load without an error; now the resume falls back to the
previous checkpoint and names the file, and export refuses it (or, given a run folder, takes the previous one).
"""

import json
import os

import pytest
import torch

from titan_mm.checkpoint_io import COMMIT_FILE, CheckpointError, file_record, read_commit, verify_checkpoint
from titan_mm.export import main as export_main
from titan_mm.launch.train import main
from titan_mm.train.checkpoint import CheckpointManager

TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
        "--lr_scheduler.warmup_steps", "2", "--training.deterministic", "True"]


def overwrite_4k(ck):
    """4 KiB of random bytes in the middle of the checkpoint's largest .distcp; the size stays the same."""
    f = max(ck.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = f.stat().st_size
    with open(f, "r+b") as h:
        h.seek(size // 2)
        h.write(os.urandom(4096))
    assert f.stat().st_size == size
    return f


def test_commit_records_every_file_blocking_and_async(tmp_path):
    from test_checkpoint import make_state, run_steps  # pytest puts tests/unit on sys.path

    st = make_state()
    for mode in ("disabled", "async"):
        mgr = CheckpointManager(tmp_path / mode, interval=1, async_mode=mode)
        run_steps(st, 1)
        ck = mgr.save(st)
        mgr.close()
        files = read_commit(ck)["files"]
        on_disk = sorted(p.name for p in ck.iterdir() if p.name != COMMIT_FILE)
        assert sorted(files) == on_disk and any(n.endswith(".distcp") for n in on_disk), (files, on_disk)
        for name, rec in files.items():
            assert rec == file_record(ck / name) and rec["size"] == (ck / name).stat().st_size
        assert mgr.hash_seconds > 0
        verify_checkpoint(ck)


def test_overwritten_4k_is_caught_and_resume_falls_back(tmp_path, capsys):
    from test_checkpoint import make_state, run_steps, snapshot

    st = make_state()
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=0, async_mode="disabled")
    run_steps(st, 2)
    mgr.save(st)
    good = snapshot(st)
    run_steps(st, 2)
    bad = mgr.save(st)
    mgr.close()
    want = read_commit(bad)["files"]
    f = overwrite_4k(bad)
    with pytest.raises(CheckpointError, match=rf"{f.name}: checksum mismatch \(crc32 expected {want[f.name]['crc32']}, "
                                              rf"got [0-9a-f]{{8}}\)"):
        verify_checkpoint(bad)
    capsys.readouterr()
    fresh = make_state(seed=3)
    assert CheckpointManager(tmp_path, interval=1).resume(fresh) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {bad} is corrupt or unreadable (CheckpointError: {f.name}: checksum mismatch" in err
    assert "falling back to the previous one" in err and "resumed from" in err and "step-00000002" in err
    for k, v in snapshot(fresh).items():
        assert torch.equal(v, good[k]), k

    # a file cut short or gone is named too, by size or by its error, before any tensor is read
    with open(f, "r+b") as h:
        h.truncate(100)
    with pytest.raises(CheckpointError, match=rf"{f.name}: size 100 != {want[f.name]['size']} bytes"):
        verify_checkpoint(bad)
    f.unlink()
    with pytest.raises(CheckpointError, match=rf"{f.name}: FileNotFoundError"):
        verify_checkpoint(bad)


def test_checkpoint_without_checksums_loads_with_one_warning(tmp_path, capsys):
    from test_checkpoint import make_state, run_steps

    st = make_state()
    mgr = CheckpointManager(tmp_path, interval=1, async_mode="disabled")
    run_steps(st, 1)
    ck = mgr.save(st)
    meta = read_commit(ck)
    del meta["files"]  # as written before checksums were recorded
    (ck / COMMIT_FILE).write_text(json.dumps(meta))
    capsys.readouterr()
    assert CheckpointManager(tmp_path, interval=1).resume(make_state(seed=1)) == 1
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "records no checksums" in ln]
    assert warned == [f"[titan_mm] WARNING: {ck} records no checksums (written by an older titan_mm): "
                      "loading it unverified"]


def test_trainer_and_export_reject_a_corrupt_checkpoint(tmp_path, capsys):
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "c", "--checkpoint.interval", "2",
            "--checkpoint.keep_last", "0", *TINY]
    assert main([*args, "--training.steps", "4"]) == 0
    run = tmp_path / "c"
    ck4 = run / "checkpoints" / "step-00000004"
    f = overwrite_4k(ck4)
    capsys.readouterr()

    # an explicit step folder: one error line naming the file, nothing exported
    assert export_main(["--checkpoint", str(ck4), "--out", str(tmp_path / "hf4")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {f.name}: checksum mismatch (crc32 expected "), err
    assert not (tmp_path / "hf4").exists()
    # a run folder: the newest checkpoint that passes, and the log says which one was skipped and why
    assert export_main(["--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr()
    assert f"checkpoint {ck4} is corrupt ({f.name}: checksum mismatch" in out.err
    assert f"exported {run / 'checkpoints' / 'step-00000002'} -> {tmp_path / 'hf'}" in out.out

    # the trainer resumes from step 2 and says which file failed
    assert main([*args, "--training.steps", "5"]) == 0
    err = capsys.readouterr().err
    assert f"{ck4} is corrupt or unreadable (CheckpointError: {f.name}: checksum mismatch" in err
    assert "resumed from" in err and "(step 2)" in err
