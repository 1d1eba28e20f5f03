"""One trainer per run folder (titan_mm.train.run_lock): a second trainer is refused with one line naming the holder
and exits 2 before it builds anything; a stale lock (a dead process here, or another host's expired lease) is taken
over with one line; the lock goes away on every exit path."""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_mm.observe.metrics import read_metrics
from titan_mm.train.run_lock import LOCK_FILE, RunLock, RunLockError, _proc_start, hold_run_folder
from titan_mm.launch.train import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
        "--lr_scheduler.warmup_steps", "2"]
HOST = socket.gethostname()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_lock(run: Path, **fields) -> dict:
    now = time.time()
    body = {"pid": dead_pid(), "host": HOST, "since": now - 60, "renewed": now - 60, "token": "t",
            "proc_start": None, **fields}
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK_FILE).write_text(json.dumps(body))
    return body


def since(body) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(body["since"]))


def test_a_held_lock_refuses_a_second_taker_and_release_removes_it(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    body = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (body["pid"], body["host"], body["proc_start"]) == (os.getpid(), HOST, _proc_start(os.getpid()))
    with pytest.raises(RunLockError) as e:
        RunLock(tmp_path).acquire()
    assert str(e.value).startswith(f"run folder {tmp_path} is in use by another trainer: PID {os.getpid()} on host "
                                   f"{HOST} since {since(body)}, renewed ")
    assert str(e.value).endswith(f"(lock {tmp_path / LOCK_FILE}); wait for it to finish or stop it, or use another "
                                 "--job.name")
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    first.release()  # idempotent
    assert sorted(os.listdir(tmp_path)) == []  # no private or stale files left behind


@pytest.mark.parametrize("case", ["dead_pid", "reused_pid", "other_host_expired"])
def test_a_stale_lock_is_taken_over_with_one_line(tmp_path, capsys, case):
    start = _proc_start(os.getpid())
    if case == "reused_pid" and start is None:
        pytest.skip("no /proc: a reused PID is not detectable here")
    fields = {"dead_pid": {}, "reused_pid": {"pid": os.getpid(), "proc_start": (start or 0) + 1},
              "other_host_expired": {"host": "elsewhere", "renewed": 1.0e9}}[case]  # renewed in 2001
    old = write_lock(tmp_path, **fields)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.body["token"]
    err = capsys.readouterr().err.strip().splitlines()
    head = (f"[titan_mm] taking over the stale lock {tmp_path / LOCK_FILE}: PID {old['pid']} on host {old['host']} "
            f"since {since(old)} ")
    if case == "other_host_expired":  # the idle time counts on while the test runs
        assert len(err) == 1 and err[0].startswith(head), err
        idle = re.fullmatch(r"has not renewed it for (\d+) s \(lease 300 s\)", err[0][len(head):])
        assert idle and int(idle.group(1)) >= 1000, err
    else:
        assert err == [head + "is no longer running"]
    lock.release()
    assert sorted(os.listdir(tmp_path)) == []


def test_another_hosts_lock_within_its_lease_is_held(tmp_path):
    write_lock(tmp_path, host="elsewhere", renewed=time.time() - 5)
    with pytest.raises(RunLockError, match=r"in use by another trainer: PID \d+ on host elsewhere since .*, "
                                           r"renewed \d+ s ago"):
        RunLock(tmp_path).acquire()


def test_an_unreadable_lock_is_held_briefly_then_taken_over(tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_text("{not json")
    with pytest.raises(RunLockError, match=r"in use by another trainer: an unreadable lock less than 10 s old"):
        RunLock(tmp_path).acquire()
    old = time.time() - 100
    os.utime(tmp_path / LOCK_FILE, (old, old))
    lock = RunLock(tmp_path)
    lock.acquire()
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"\[titan_mm\] taking over the stale lock {re.escape(str(tmp_path / LOCK_FILE))}: its body is "
                        r"unreadable and 1\d\d s old", err), err
    lock.release()


def test_the_holder_renews_and_a_taken_over_lock_is_not_deleted(tmp_path, capsys):
    lock = RunLock(tmp_path, renew_s=0.05)
    lock.acquire()
    first = lock.body["renewed"]
    end = time.monotonic() + 60
    while json.loads((tmp_path / LOCK_FILE).read_text())["renewed"] == first:
        assert time.monotonic() < end, "the lock was never renewed"
        time.sleep(0.05)
    other = write_lock(tmp_path, pid=os.getpid(), token="someone else")  # as if another trainer took it over
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == other


def test_hold_run_folder_one_process(tmp_path):
    lock = hold_run_folder(tmp_path / "run")  # creates the folder
    with pytest.raises(RunLockError, match="is in use by another trainer"):
        hold_run_folder(tmp_path / "run")
    lock.release()


def test_a_run_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunLockError, match=r"cannot take the run lock .*/file/run/run.lock: Not a directory; check "
                                           "that the run folder is writable"):
        hold_run_folder(tmp_path / "file" / "run")


def test_a_full_disk_at_the_lock_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(RunLockError, match=r"^cannot take the run lock .*/run.lock: No space left on device; free some "
                                           r"space$"):
        hold_run_folder(tmp_path)
    assert list(tmp_path.iterdir()) == []


def start(tmp_path, name, args, stderr_name):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([str(ROOT / "run_train.sh"), "--config", "debug_qwen3", "--job.dump_folder",
                             str(tmp_path), "--job.name", name, *TINY, *args],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / stderr_name, "w"), env=env, cwd=ROOT)


def test_second_trainer_is_refused_and_the_first_finishes_intact(tmp_path):
    """Two real trainers on one run folder: the second (started while the first holds the lock; the first is
    stopped with SIGSTOP meanwhile, so the overlap does not depend on timing) exits 2 with one line naming the
    first, before its model build; the first then finishes with every step logged once."""
    run = tmp_path / "job"
    args = ["--training.steps", "6", "--checkpoint.interval", "2"]
    first = start(tmp_path, "job", args, "first.err")
    end = time.monotonic() + 300
    while not (run / LOCK_FILE).is_file():
        assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
        assert time.monotonic() < end, "the first trainer never took the lock"
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGSTOP)  # run_train.sh execs python: this is the trainer
    try:
        held = json.loads((run / LOCK_FILE).read_text())
        second = start(tmp_path, "job", args, "second.err")
        assert second.wait(timeout=300) == 2
    finally:
        os.kill(first.pid, signal.SIGCONT)
    err = (tmp_path / "second.err").read_text()
    assert err.strip().splitlines()[-1].startswith(
        f"error: run folder {run} is in use by another trainer: PID {first.pid} on host {HOST} since {since(held)}, "
        "renewed "), err
    assert "Traceback" not in err and "params" not in err, err  # refused before the model build
    assert first.wait(timeout=300) == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert sorted(read_metrics(run / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 6  # nothing appended by the second
    assert not (run / LOCK_FILE).exists()


def test_trainer_takes_over_a_dead_trainers_lock(tmp_path, capsys):
    run = tmp_path / "job"
    old = write_lock(run)
    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "job", *TINY, "--training.steps", "2"]) == 0
    err = capsys.readouterr().err
    assert (f"[titan_mm] taking over the stale lock {run / LOCK_FILE}: PID {old['pid']} on host {HOST} since "
            f"{since(old)} is no longer running") in err
    assert sorted(read_metrics(run / "metrics.jsonl")) == [1, 2] and not (run / LOCK_FILE).exists()


def test_lock_is_released_on_a_failure_and_on_sigterm(tmp_path, monkeypatch):
    run = tmp_path / "job"
    monkeypatch.setenv("TITAN_MM_FAULT_NAN_AT_STEP", "1")  # the NaN policy stops the run: exit 1
    assert main(["--job.dump_folder", str(tmp_path), "--job.name", "job", *TINY, "--training.steps", "3",
                 "--training.nan_policy", "stop"]) == 1
    assert not (run / LOCK_FILE).exists()
    monkeypatch.delenv("TITAN_MM_FAULT_NAN_AT_STEP")
    p = start(tmp_path, "job", ["--training.steps", "100000", "--checkpoint.interval", "1000"], "term.err")
    end = time.monotonic() + 300
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
        assert p.poll() is None and time.monotonic() < end, (tmp_path / "term.err").read_text()[-3000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=300) == 128 + signal.SIGTERM, (tmp_path / "term.err").read_text()[-3000:]
    assert not (run / LOCK_FILE).exists()
