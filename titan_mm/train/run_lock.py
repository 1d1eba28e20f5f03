"""One trainer per run folder: ``<run>/run.lock``, a JSON body naming its holder, created atomically.

    lock = hold_run_folder(run_dir)   # rank 0 takes it, every rank learns the verdict; RunLockError if refused
    try: ... finally: lock.release()

The body is ``{"pid", "host", "since", "renewed", "token", "proc_start"}``. It is written to a private file first and
then hard-linked to ``run.lock`` (``os.link`` fails when the name exists, on local disks and NFS alike), so a reader
never sees a half-written lock. While the run goes on, a daemon thread rewrites ``renewed`` every ``RENEW_S``.

A lock is stale, and is taken over with one line, when its holder is a process of this host that is gone (its PID
is not running, or runs a process started at another time: a reused PID), or when it comes from another host and
was not renewed for ``LEASE_S`` (a host cannot see another host's processes). A takeover renames the stale file
away first: of two trainers racing for one stale lock, one rename succeeds and the other trainer finds the
winner's fresh lock.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import torch.distributed as dist

LOCK_FILE = "run.lock"
LEASE_S = 300.0
"""Another host's lock not renewed for this long is stale (the holder renews it every RENEW_S)."""
RENEW_S = 30.0
_YOUNG_S = 10.0  # an unreadable lock (bodies are written whole, so a damaged file) is stale after this long


class RunLockError(RuntimeError):
    """The run folder is held by a live trainer, or its lock cannot be taken (one line; the trainer exits 2)."""


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # the fields after "(comm)" start at field 3


def _alive(pid: int, proc_start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return proc_start is None or _proc_start(pid) in (None, proc_start)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _holder(body: dict) -> str:
    return f"PID {body['pid']} on host {body['host']} since {_when(body['since'])}"


class RunLock:
    """The lock of one run folder (``acquire`` / ``release``); ``lease_s`` / ``renew_s`` are for tests."""

    def __init__(self, run_dir: str | Path, lease_s: float = LEASE_S, renew_s: float = RENEW_S):
        self.path = Path(run_dir) / LOCK_FILE
        self.lease_s, self.renew_s = lease_s, renew_s
        self.host = socket.gethostname()
        self.body: dict | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------ take
    def acquire(self) -> None:
        """Take the lock, taking over a stale one; RunLockError naming the holder of a live one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        body = {"pid": os.getpid(), "host": self.host, "since": now, "renewed": now, "token": uuid.uuid4().hex,
                "proc_start": _proc_start(os.getpid())}
        while True:
            if self._create(body):
                self.body = body
                self._renewer = threading.Thread(target=self._renew_loop, name="titan_mm_run_lock", daemon=True)
                self._renewer.start()
                return
            seen, raw = self._read()
            if seen is None and raw is None:  # released meanwhile
                continue
            why = self._stale(seen)
            if why is None:
                raise RunLockError(self._refusal(seen))
            if self._take_over(raw):
                _log(f"taking over the stale lock {self.path}: {why}")

    def _create(self, body: dict) -> bool:
        """Write ``body`` to a private file and link it to the lock's name; False when the name exists."""
        tmp = self.path.with_name(f"{LOCK_FILE}.{body['token']}")
        try:
            tmp.write_text(json.dumps(body))
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)  # also a partial one (a full disk)

    def _read(self) -> tuple[dict | None, bytes | None]:
        """(body or None if unreadable, raw bytes or None if the file is gone)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None, None
        try:
            body = json.loads(raw)
            return (body if {"pid", "host", "since", "renewed"} <= set(body) else None), raw
        except ValueError:
            return None, raw

    def _stale(self, body: dict | None) -> str | None:
        """Why the lock with ``body`` is stale, or None while its holder may be running."""
        if body is None:
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return "it was removed"
            return f"its body is unreadable and {age:.0f} s old" if age > _YOUNG_S else None
        if body["host"] == self.host:
            if _alive(int(body["pid"]), body.get("proc_start")):
                return None
            return f"{_holder(body)} is no longer running"
        idle = time.time() - float(body["renewed"])
        if idle > self.lease_s:
            return f"{_holder(body)} has not renewed it for {idle:.0f} s (lease {self.lease_s:.0f} s)"
        return None

    def _take_over(self, raw: bytes) -> bool:
        """Move the stale lock (the bytes ``raw`` judged stale) out of the way; False if another trainer was first."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            if aside.read_bytes() == raw:
                return True
            try:  # a fresh lock replaced the stale one between our read and the rename: put it back
                os.link(aside, self.path)
            except FileExistsError:
                pass
            return False
        finally:
            aside.unlink()

    def _refusal(self, body: dict | None) -> str:
        what = (f"{_holder(body)}, renewed {time.time() - float(body['renewed']):.0f} s ago" if body is not None
                else f"an unreadable lock less than {_YOUNG_S:.0f} s old")
        return (f"run folder {self.path.parent} is in use by another trainer: {what} (lock {self.path}); wait for it "
                "to finish or stop it, or use another --job.name")

    # ------------------------------------------------------------------ hold
    def _owned(self) -> bool:
        body, _ = self._read()
        return body is not None and self.body is not None and body.get("token") == self.body["token"]

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            if not self._owned():
                _log(f"WARNING: the run lock {self.path} was taken over by another trainer (this one did not renew "
                     f"it for {self.lease_s:.0f} s); two trainers now write to {self.path.parent}")
                return
            self.body["renewed"] = time.time()
            tmp = self.path.with_name(f"{LOCK_FILE}.{self.body['token']}")
            try:
                tmp.write_text(json.dumps(self.body))
                os.replace(tmp, self.path)
            except OSError as e:  # a full disk must not end the run: the lease only runs out sooner
                tmp.unlink(missing_ok=True)
                _log(f"WARNING: could not renew the run lock {self.path}: {e}")

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still ours. Idempotent."""
        if self.body is None:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self._owned():
            self.path.unlink(missing_ok=True)
        self.body = None


class _NoLock:
    """What ranks other than 0 hold: nothing to release."""

    def release(self) -> None:
        pass


def hold_run_folder(run_dir: str | Path) -> RunLock | _NoLock:
    """Rank 0 takes ``run_dir``'s lock and broadcasts the verdict (needs the process group when world > 1): every
    rank raises the same RunLockError when it is refused."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))  # never two holders
    lock: RunLock | _NoLock = _NoLock()
    refusal = None
    if rank == 0:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunLockError as e:
            refusal = str(e)
        except OSError as e:
            fix = "free some space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "check that the run folder is writable"
            refusal = f"cannot take the run lock {lock.path}: {e.strerror or e}; {fix}"
    if world > 1:
        verdict = [refusal]
        dist.broadcast_object_list(verdict, src=0)
        refusal = verdict[0]
    if refusal is not None:
        raise RunLockError(refusal)
    return lock


def _log(msg: str) -> None:
    print(f"[titan_mm] {msg}", file=sys.stderr, flush=True)
