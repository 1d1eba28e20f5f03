"""Checkpoints with torch.distributed.checkpoint (DCP): async save, keep-last-K, auto-resume, fallback.

Layout of a run folder::

    <run>/checkpoints/step-00000040/     DCP files (*.distcp, .metadata)
                                         config.toml   the run's resolved config
                                         commit.json   written LAST (tmp file + atomic rename): step,
                                                       world size, parallel topology, time, and
                                                       "files": {name: {"size", "crc32"}} of every file

A checkpoint without commit.json is incomplete (a save interrupted by a crash): it is never loaded and is
deleted at the next start. Resume takes the newest committed checkpoint; if it fails to load (a file whose
size or CRC-32 differs from commit.json, or unreadable files), the previous one is tried and the fallback
is reported with the file and the reason.

Checksums: each rank hashes the files it wrote (``__<rank>_<n>.distcp``; rank 0 also ``.metadata`` and
config.toml) and rank 0 gathers them into commit.json. zlib.crc32 (stdlib, releases the GIL; the fastest stdlib
hash here: 1.4-2x sha256, 4x blake2b, bench/results/checkpoint_verify.json) detects accidental corruption, not
tampering.
With async save the hashing runs in the background after the write, off the training thread. On load the
ranks split the listed files between them, check size then CRC, and agree on the verdict before dcp.load.

State-dict items (see titan_mm.train.state): ``model`` and ``optimizer`` through
torch.distributed.checkpoint.state_dict (FSDP/TP shards are resharded on load: a checkpoint written by 2
processes loads in 1 and vice versa), ``train`` (step, scheduler, RNG; rank-independent) and
``data.slot<k>of<K>``: the data stream, per micro-batch slot k of the K in a global batch (training.global_batch_size
/ data.micro_batch_size), each written by the rank that reads it (titan_mm.data.loader.StreamLayout). A run with
another data-parallel world loads the slots it reads and continues the same samples. A checkpoint whose K differs
from the config's is refused (DataLayoutError, one line: resume with the saved batch sizes).

Async: ``dcp.async_save`` stages the state to CPU memory, then writes in a background thread while
training continues; on a multi-process run it uses its own gloo process group so its collectives never
interleave with the training ones. A new save (or the end of training) first waits for the previous one.

A save that fails on an OSError (a full disk, a quota, an I/O error; the async one when it is waited on) raises
CheckpointSaveError, one line: "no space left on device writing checkpoint step-N to DIR; the last good checkpoint
step-M is kept; ...". Its partial folder is removed at once (it holds the space the next try needs). Nothing else is
touched: older checkpoints are pruned only after a newer one is committed, and a save of a step that is already
committed (a run resumed with checkpoint.load_step before it) keeps the old folder as step-N.replaced until the new
one commits; a failed save puts it back, and so does the next start after a crash. DCP's writer is wrapped so that the
OSError itself reaches every rank: torch.save reports a full disk as "unexpected pos 704 vs 598", with the OSError
only in ``__context__``, which DCP's gather of the ranks' failures drops.

Reading a run folder (the committed step folders, commit.json's checksums, a model's weights alone) lives one room
down, in titan_mm.checkpoint_io, which the one model loader (titan_mm.loader) reads too; this module writes and resumes.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.stateful import Stateful

from titan_mm.checkpoint_io import (
    COMMIT_FILE,
    CONFIG_FILE,
    STEP_PREFIX,
    CheckpointError,
    ModelItem,
    file_record,
    list_checkpoints,
    rank0_log,
    read_commit,
    step_dir_name,
    step_of,
    verify_checkpoint,
)
from titan_mm.train.state import TrainState, from_bytes, to_bytes

_REPLACED = ".replaced"  # a committed step folder that a new save of the same step replaces once it commits
_BYTES_IO_BUFFER = type(io.BytesIO().getbuffer().obj)  # DCP writes a non-tensor item as its BytesIO's getbuffer()
_FAULT_ROOM = 64 << 10  # TITAN_MM_FAULT_ENOSPC_AT_STEP: tensor bytes written before the disk is "full" (in torch.save)


class CheckpointSaveError(CheckpointError):
    """A save failed on an OSError (one line naming the error, the step and the checkpoint that is kept)."""


def _aside(path: Path) -> Path:
    return path.with_name(path.name + _REPLACED)


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_HOW = ("foreach", "fused", "capturable")  # how this machine runs the step (optimizer.implementation, the device)


class _OptimItem(Stateful):
    """The optimizer state keyed by parameter FQN, param-group options included (``param_groups.<fqn>.lr``), so
    it loads under any layout: the group count and order depend on it (titan_mm.train.optim.split_dtensor_groups),
    and DCP's nested form keys the options by group index. ``flat=False`` reads a checkpoint written in the nested
    form (an older titan_mm) into the same group structure only. The options that say how the step runs
    (:data:`_HOW`) stay this run's: a CPU checkpoint resumes fused on CUDA, a CUDA one foreach on CPU."""

    def __init__(self, model, optimizer, flat: bool = True):
        self.model, self.optimizer, self.options = model, optimizer, _FLAT if flat else None

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, sd):
        how = [{k: g[k] for k in _HOW if k in g} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, sd, options=self.options)
        for g, h in zip(self.optimizer.param_groups, how, strict=True):
            g.update(h)


class _TrainItem(Stateful):
    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self):
        return self.state.train_state_dict()

    def load_state_dict(self, sd):
        self.state.load_train_state_dict(sd)


class DataLayoutError(CheckpointError):
    """The checkpoint's data stream has another number of micro-batch slots than the config: a config mismatch,
    not a damaged file, so resume does not fall back to an older checkpoint (it has the same layout)."""


class _DataItem(Stateful):
    """Slot ``k`` of a loader state ``{"num_slots", "slots": {k: ...}}`` that the rank's data items share; after a
    load the loader takes the whole filled-in state."""

    def __init__(self, loader_state: dict, k: int):
        self.loader_state, self.k = loader_state, k

    def state_dict(self):
        return {"blob": to_bytes(self.loader_state["slots"][self.k])}

    def load_state_dict(self, sd):
        self.loader_state["slots"][self.k] = from_bytes(sd["blob"])


@dataclass
class Topology:
    world_size: int = 1
    dp_rank: int = 0
    dp_world: int = 1
    parallel: dict | None = None


def _short_error(e: BaseException) -> str:
    """One line for a load failure; DCP wraps the real error (per rank) in a CheckpointException."""
    if isinstance(e, CheckpointException):
        for fail in getattr(e, "failures", {}).values():
            inner = fail[0] if isinstance(fail, tuple) else fail
            if isinstance(inner, BaseException):
                return _short_error(inner)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError under ``e``: itself, one that a CheckpointException collected from a rank, or one in its chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            for fail in e.failures.values():
                found = _os_error(fail[0] if isinstance(fail, tuple) else fail)
                if found is not None:
                    return found
        e = e.__cause__ or e.__context__
    return None


class _Writer(FileSystemWriter):
    """DCP's file writer; a failed write raises the OSError under it (picklable: it reaches every rank whole)."""

    def __init__(self, path: Path, fault_room: int | None = None):
        super().__init__(path)
        if fault_room is not None:
            self.fs = _FullDisk(fault_room)

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as e:  # noqa: BLE001 - re-raised: as its OSError when it has one
            _reraise_os_error(e)
            raise

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:  # noqa: BLE001 - re-raised: as its OSError when it has one
            _reraise_os_error(e)
            raise


def _reraise_os_error(e: BaseException) -> None:
    err = _os_error(e)
    if err is not None and err is not e:
        raise OSError(err.errno, err.strerror, err.filename) from e


class _FullDisk(FileSystem):
    """Fault injection (TITAN_MM_FAULT_ENOSPC_AT_STEP): the disk is full after ``room`` more bytes."""

    def __init__(self, room: int):
        self.room = room

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as f:
            yield _FillingStream(f, self)


class _FillingStream:
    def __init__(self, f, disk: _FullDisk):
        self._f, self._disk = f, disk

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if isinstance(b, memoryview) and isinstance(b.obj, _BYTES_IO_BUFFER):  # a whole non-tensor item (they go
            return self._f.write(b)  # first): the room is counted inside torch.save, whatever the options weigh
        if n > self._disk.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.room -= n
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)


class CheckpointManager:
    """Saves and restores a TrainState under ``<run>/<checkpoint.folder>``.

    ``config_toml`` (the resolved config) is written into every checkpoint; ``topology`` goes into
    commit.json. ``checksums=False`` records no file checksums (the baseline of bench/checkpoint_verify.py).
    """

    def __init__(self, folder: str | Path, *, interval: int, keep_last: int = 2, async_mode: str = "async",
                 topology: Topology | None = None, config_toml: str = "", enable: bool = True,
                 checksums: bool = True):
        self.folder = Path(folder)
        self.interval = interval
        self.keep_last = keep_last
        self.async_mode = async_mode
        self.topology = topology or Topology()
        self.config_toml = config_toml
        self.enable = enable
        self.checksums = checksums
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pg = None
        if enable and dist.is_initialized():
            # a separate group: the background writer's collectives must not interleave with training's
            self._pg = dist.new_group(backend="gloo")
        self._pending: tuple[Future, int, Path] | None = None
        self._background: ThreadPoolExecutor | None = None  # hashes an async save's files after the write
        self.last_saved_step: int | None = None
        self.hash_seconds = 0.0  # this rank's hashing time for the last save (off the training thread if async)
        # fault injection (tests): the async save of this step never finishes, as if its writer hung
        self._hold_at = int(os.environ.get("TITAN_MM_FAULT_HOLD_SAVE_AT_STEP", "-1"))
        # fault injection (tests): the save of this step finds the disk full after _FAULT_ROOM bytes
        self._enospc_at = int(os.environ.get("TITAN_MM_FAULT_ENOSPC_AT_STEP", "-1"))

    # ------------------------------------------------------------------ items
    def _items(self, state: TrainState) -> dict[str, Any]:
        items = {
            "model": ModelItem(state.model),
            "optimizer": _OptimItem(state.model, state.optimizer),
            "train": _TrainItem(state),
        }
        if state.dataloader is not None:
            ls = state.dataloader.state_dict()  # taken now: the state after the last consumed micro-batch
            items.update({f"data.slot{k}of{ls['num_slots']}": _DataItem(ls, k) for k in ls["slots"]})
        return items

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, final_step: int) -> bool:
        return self.enable and step > 0 and (step % self.interval == 0 or step == final_step)

    def save(self, state: TrainState, *, blocking: bool | None = None) -> Path:
        """Save ``state`` at ``state.step``; async unless ``blocking`` (or checkpoint.async_mode=disabled)."""
        self.wait()  # one save at a time; commits the previous one
        step = state.step
        path = self.folder / step_dir_name(step)
        blocking = (self.async_mode == "disabled") if blocking is None else blocking
        try:
            if self.rank == 0:
                if (path / COMMIT_FILE).is_file():  # a re-run step (resumed with load_step before it): kept aside
                    aside = _aside(path)  # until the new save commits, so a failed save does not cost it
                    shutil.rmtree(aside, ignore_errors=True)
                    path.rename(aside)
                elif path.exists():  # an earlier, uncommitted attempt at this step
                    shutil.rmtree(path)
                path.mkdir(parents=True)
                (path / CONFIG_FILE).write_text(self.config_toml)
            self._barrier()
            items = self._items(state)
            writer = _Writer(path, _FAULT_ROOM if step == self._enospc_at else None)
            if blocking:
                dcp.save(items, storage_writer=writer, process_group=self._pg)
                self._commit(step, path, self._record_files(path))
            else:
                fut = dcp.async_save(items, storage_writer=writer, process_group=self._pg)
                if self._background is None:
                    self._background = ThreadPoolExecutor(1, thread_name_prefix="titan_mm_ckpt_hash")
                self._pending = (self._background.submit(self._finish_async, fut, step, path), step, path)
        except (Exception, CheckpointException) as e:
            self._save_failed(step, path, e)
            raise
        return path

    def ensure_saved(self, state: TrainState) -> Path:
        """Block until ``state.step`` is committed: wait for its pending save, or save it now (blocking)."""
        self.wait()
        if self.last_saved_step != state.step:
            self.save(state, blocking=True)
        return self.folder / step_dir_name(state.step)

    def _finish_async(self, fut: Future, step: int, path: Path) -> dict | None:
        fut.result()
        if step == self._hold_at:
            time.sleep(3600)
        return self._record_files(path)

    def _record_files(self, path: Path) -> dict | None:
        """{name: file_record} of the whole checkpoint on rank 0 (None elsewhere, or without checksums): each
        rank hashes what it wrote; collective over the manager's group, like the DCP write before it."""
        if not self.checksums:
            return None
        t0 = time.perf_counter()
        mine = sorted(path.glob(f"__{self.rank}_*.distcp"))  # DCP's FileSystemWriter names files __<rank>_<n>
        if self.rank == 0:
            mine += [path / ".metadata", path / CONFIG_FILE]
        records = {p.name: file_record(p) for p in mine}
        self.hash_seconds = time.perf_counter() - t0
        if self._pg is None:
            return records
        every: list = [None] * dist.get_world_size(self._pg)
        dist.all_gather_object(every, records, group=self._pg)
        return {k: v for r in every for k, v in r.items()} if self.rank == 0 else None

    def poll(self) -> None:
        """Commit a finished async save (call once per step; cheap). A failed one raises here in a single process;
        with several, the ranks may see it done at different steps, so it raises at the next save, ensure_saved or
        close, which every rank reaches at the same step."""
        if self._pending is not None and self._pending[0].done():
            if self._pg is not None and dist.get_world_size(self._pg) > 1 and self._pending[0].exception() is not None:
                return
            self.wait()

    def wait(self) -> None:
        """Block until the pending async save (if any) is written, then commit it."""
        if self._pending is None:
            return
        fut, step, path = self._pending
        self._pending = None
        try:
            self._commit(step, path, fut.result())  # fut.result() re-raises a failed write
        except (Exception, CheckpointException) as e:
            self._save_failed(step, path, e)
            raise

    def _save_failed(self, step: int, path: Path, e: BaseException) -> None:
        """Remove the failed save's partial folder and put back the committed one it was replacing (rank 0); then
        raise CheckpointSaveError (one line) for a save that failed on an OSError, or return for any other error,
        which the caller re-raises as it is."""
        if self.rank == 0 and not (path / COMMIT_FILE).is_file():
            shutil.rmtree(path, ignore_errors=True)
            if _aside(path).is_dir():
                _aside(path).rename(path)
        err = _os_error(e)
        if err is None:
            return
        kept = [p for p in list_checkpoints(self.folder) if p != path]
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        what = (err.strerror or type(err).__name__).lower() if err.errno else f"{type(err).__name__}: {err}"
        raise CheckpointSaveError(
            f"{what} writing checkpoint {path.name} to {self.folder}; "
            + (f"the last good checkpoint {kept[-1].name} is kept" if kept else "there is no earlier checkpoint")
            + ("; free some space, then" if full else ";") + " rerun the same command to resume"
        ) from e

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _commit(self, step: int, path: Path, files: dict | None) -> None:
        # DCP's coordinator (rank 0) finishes only after every rank's data is written, so rank 0's
        # completion means the whole checkpoint is on disk.
        if self.rank == 0:
            t = self.topology
            meta = {
                "step": step,
                "world_size": t.world_size,
                "dp_world": t.dp_world,
                "parallel": t.parallel or {},
                "time": time.time(),
                "torch": torch.__version__,
            }
            if files is not None:
                meta["files"] = files
            tmp = path / (COMMIT_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path / COMMIT_FILE)
            shutil.rmtree(_aside(path), ignore_errors=True)
            self._prune()
        self.last_saved_step = step

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        cks = list_checkpoints(self.folder)
        for old in cks[: -self.keep_last]:
            (old / COMMIT_FILE).unlink(missing_ok=True)  # first: a half-deleted folder reads as incomplete
            shutil.rmtree(old, ignore_errors=True)

    def cleanup_incomplete(self) -> None:
        """Delete step folders without a commit marker (interrupted saves), and put back a committed one that an
        interrupted save was replacing. Rank 0 only; call at start."""
        if self.rank == 0:
            committed = set(list_checkpoints(self.folder))
            for p in list_checkpoints(self.folder, committed_only=False):
                if p not in committed:
                    rank0_log(f"removing incomplete checkpoint {p} (no {COMMIT_FILE}: its save was interrupted)")
                    shutil.rmtree(p, ignore_errors=True)
            for aside in self.folder.glob(f"{STEP_PREFIX}*{_REPLACED}") if self.folder.is_dir() else ():
                p = aside.with_name(aside.name[: -len(_REPLACED)])
                if p.exists():  # the new save committed: the old one is done with
                    shutil.rmtree(aside, ignore_errors=True)
                else:
                    aside.rename(p)
                    rank0_log(f"restored {p}: the save that was replacing it was interrupted")
        self._barrier()

    def set_aside(self) -> None:
        """For checkpoint.resume=false: rename a folder holding checkpoints to ``<folder>.before-<time>`` (rank 0),
        so a fresh run's saves neither mix with an earlier run's (higher) steps nor get pruned in their favour."""
        if self.enable and self.rank == 0 and list_checkpoints(self.folder, committed_only=False):
            dest = self.folder.with_name(f"{self.folder.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
            self.folder.rename(dest)
            rank0_log(f"checkpoint.resume is false: moved the earlier checkpoints to {dest}; starting from step 0")
        self._barrier()

    # ------------------------------------------------------------------ load
    def _candidates(self, load_step: int) -> list[Path]:
        names = [p.name for p in list_checkpoints(self.folder)]
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank must try the same list
            obj = [names]
            dist.broadcast_object_list(obj, src=0, group=self._pg)
            names = obj[0]
        cks = [self.folder / n for n in names]
        if load_step >= 0:
            want = self.folder / step_dir_name(load_step)
            if want not in cks:
                raise CheckpointError(
                    f"checkpoint.load_step={load_step}: no committed checkpoint {want}; "
                    f"available steps: {[step_of(p) for p in cks] or 'none'}"
                )
            return [want]
        return cks[::-1]

    def load_into(self, state: TrainState, ckpt_dir: Path) -> None:
        """Load one checkpoint folder into ``state`` (raises on any failure; DataLayoutError when its data stream
        has another number of micro-batch slots)."""
        verify_checkpoint(ckpt_dir, self._pg)
        metadata = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
        keys = set(metadata.state_dict_metadata)
        items = self._items(state)
        data = [n for n in items if n.startswith("data.")]
        if any(not any(k.startswith(n + ".") for k in keys) for n in data):
            saved = {k.split(".")[1] for k in keys if k.startswith("data.")}
            slots = "/".join(sorted({n.split("of")[-1] for n in saved if n.startswith("slot")}))
            here = f"this run has {data[0].split('of')[-1]} (training.global_batch_size / data.micro_batch_size)"
            raise DataLayoutError(
                f"{ckpt_dir}: its data stream has {slots} micro-batch slots per global batch, {here}; resume with "
                f"the saved global_batch_size and micro_batch_size ({ckpt_dir / CONFIG_FILE}; global_batch_size = 0 "
                "means micro_batch_size x dp degree, which changes with the world size)" if slots else
                f"{ckpt_dir}: its data state ({', '.join(sorted(saved)) or 'none'}) is not kept per micro-batch slot "
                f"(an older titan_mm), {here}; resume it with the titan_mm that wrote it, or start a new run folder")
        if any(k.startswith("optimizer.param_groups.") and k.endswith(".params") for k in keys):  # the nested form
            items["optimizer"] = _OptimItem(state.model, state.optimizer, flat=False)
        dcp.load(items, checkpoint_id=str(ckpt_dir), process_group=self._pg)
        if data:
            try:
                state.dataloader.load_state_dict(items[data[0]].loader_state)
            except ValueError as e:  # the loader's checks: other sources / streams_per_slot than the saved run
                raise DataLayoutError(f"{ckpt_dir}: {e}") from None

    def resume(self, state: TrainState, load_step: int = -1) -> int | None:
        """Load the newest loadable committed checkpoint; returns its step, or None when there is none.

        A checkpoint that fails to load is reported and the previous one is tried."""
        if not self.enable:
            return None
        self.cleanup_incomplete()
        failures = []
        for ck in self._candidates(load_step):
            try:
                self.load_into(state, ck)
            except DataLayoutError:
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported, then an older one is tried
                msg = _short_error(e)
                failures.append((ck, msg))
                rank0_log(f"WARNING: checkpoint {ck} is corrupt or unreadable ({msg}); falling back to the previous "
                          "one")
                continue
            step = read_commit(ck)["step"]
            self.last_saved_step = step  # ensure_saved at this step must not rewrite (delete first) the checkpoint
            if state.step != step:
                raise CheckpointError(f"{ck}: commit.json says step {step} but the saved train state says {state.step}")
            if failures:
                rank0_log(f"resumed from {ck} (step {step}) after skipping {len(failures)} unreadable checkpoint(s): "
                     + ", ".join(p.name for p, _ in failures))
            else:
                rank0_log(f"resumed from {ck} (step {step})")
            return step
        if failures:
            raise CheckpointError(
                "every checkpoint failed to load: "
                + "; ".join(f"{p}: {m}" for p, m in failures)
                + ". Move the run folder away to start fresh, or fix the files."
            )
        return None

    def close(self) -> None:
        """Wait for (and commit) the pending save, then free the writer thread and the group, also when it failed."""
        try:
            self.wait()
        finally:
            if self._background is not None:
                self._background.shutdown()
                self._background = None
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None
