"""Checkpoints with torch.distributed.checkpoint (DCP): async save, keep-last-K, auto-resume, fallback.

Layout of a run folder::

    <run>/checkpoints/step-00000040/     DCP files (*.distcp, .metadata)
                                         config.toml   the run's resolved config
                                         commit.json   written LAST (tmp file + atomic rename): step,
                                                       world size, parallel topology, time

A checkpoint without commit.json is incomplete (a save interrupted by a crash): it is never loaded and is
deleted at the next start. Resume takes the newest committed checkpoint; if it fails to load (corrupt
files), the previous one is tried and the fallback is reported.

State-dict items (see titan_mm.train.state): ``model`` and ``optimizer`` through
torch.distributed.checkpoint.state_dict (FSDP/TP shards are resharded on load: a checkpoint written by 2
processes loads in 1 and vice versa), ``train`` (step, scheduler, RNG; rank-independent) and
``data.dp<R>of<W>`` (the loader state of data-parallel rank R of W). When the data-parallel world changes
between save and load, the loader state cannot be mapped rank for rank: the loader restarts from its
seed position and a warning says so.

Async: ``dcp.async_save`` stages the state to CPU memory, then writes in a background thread while
training continues; on a multi-process run it uses its own gloo process group so its collectives never
interleave with the training ones. A new save (or the end of training) first waits for the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.stateful import Stateful

from titan_mm.train.state import TrainState, from_bytes, to_bytes

COMMIT_FILE = "commit.json"
CONFIG_FILE = "config.toml"
_PREFIX = "step-"

# DCP warns on every single-process call that it "assumes the intent is to save/load in a single process".
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")


class CheckpointError(RuntimeError):
    pass


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _step_of(p: Path) -> int | None:
    if not p.name.startswith(_PREFIX):
        return None
    try:
        return int(p.name[len(_PREFIX):])
    except ValueError:
        return None


def list_checkpoints(folder: str | Path, committed_only: bool = True) -> list[Path]:
    """Checkpoint folders sorted by step, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        s = _step_of(p)
        if s is None or not p.is_dir():
            continue
        if committed_only and not (p / COMMIT_FILE).is_file():
            continue
        out.append((s, p))
    return [p for _, p in sorted(out)]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint step folder, or a run / checkpoints folder (-> its newest committed checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(p)!r} does not exist; give a step-NNNNNNNN folder or a run folder")
    if (p / COMMIT_FILE).is_file():
        return p
    if (p / ".metadata").is_file():
        raise CheckpointError(
            f"{p} has DCP files but no {COMMIT_FILE}: the save did not finish, so it may be incomplete; "
            "use an earlier checkpoint"
        )
    for cand in (p, p / "checkpoints"):
        cks = list_checkpoints(cand)
        if cks:
            return cks[-1]
    raise CheckpointError(f"no committed checkpoint (a step-NNNNNNNN folder with {COMMIT_FILE}) under {p}")


def read_commit(ckpt_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(ckpt_dir) / COMMIT_FILE).read_text())


class _ModelItem(Stateful):
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=True))


class _OptimItem(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.optimizer, sd)


class _TrainItem(Stateful):
    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self):
        return self.state.train_state_dict()

    def load_state_dict(self, sd):
        self.state.load_train_state_dict(sd)


class _DataItem(Stateful):
    def __init__(self, dataloader):
        self.dataloader = dataloader

    def state_dict(self):
        return {"blob": to_bytes(self.dataloader.state_dict())}

    def load_state_dict(self, sd):
        self.dataloader.load_state_dict(from_bytes(sd["blob"]))


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


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[titan_mm] {msg}", file=sys.stderr, flush=True)


class CheckpointManager:
    """Saves and restores a TrainState under ``<run>/<checkpoint.folder>``.

    ``config_toml`` (the resolved config) is written into every checkpoint; ``topology`` goes into
    commit.json.
    """

    def __init__(self, folder: str | Path, *, interval: int, keep_last: int = 2, async_mode: str = "async",
                 topology: Topology | None = None, config_toml: str = "", enable: bool = True):
        self.folder = Path(folder)
        self.interval = interval
        self.keep_last = keep_last
        self.async_mode = async_mode
        self.topology = topology or Topology()
        self.config_toml = config_toml
        self.enable = enable
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pg = None
        if enable and dist.is_initialized():
            # a separate group: the background writer's collectives must not interleave with training's
            self._pg = dist.new_group(backend="gloo")
        self._pending: tuple[Future, int, Path] | None = None
        self.last_saved_step: int | None = None

    # ------------------------------------------------------------------ items
    def _items(self, state: TrainState) -> dict[str, Any]:
        items = {
            "model": _ModelItem(state.model),
            "optimizer": _OptimItem(state.model, state.optimizer),
            "train": _TrainItem(state),
        }
        if state.dataloader is not None and hasattr(state.dataloader, "state_dict"):
            t = self.topology
            items[f"data.dp{t.dp_rank}of{t.dp_world}"] = _DataItem(state.dataloader)
        return items

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, final_step: int) -> bool:
        return self.enable and step > 0 and (step % self.interval == 0 or step == final_step)

    def save(self, state: TrainState, *, blocking: bool | None = None) -> Path:
        """Save ``state`` at ``state.step``; async unless ``blocking`` (or checkpoint.async_mode=disabled)."""
        self.wait()  # one save at a time; commits the previous one
        step = state.step
        path = self.folder / step_dir_name(step)
        if self.rank == 0:
            if path.exists():  # an earlier, uncommitted attempt at this step (or a re-run step)
                shutil.rmtree(path)
            path.mkdir(parents=True)
            (path / CONFIG_FILE).write_text(self.config_toml)
        self._barrier()
        items = self._items(state)
        blocking = (self.async_mode == "disabled") if blocking is None else blocking
        if blocking:
            dcp.save(items, checkpoint_id=str(path), process_group=self._pg)
            self._commit(step, path)
        else:
            fut = dcp.async_save(items, checkpoint_id=str(path), process_group=self._pg)
            self._pending = (fut, step, path)
        return path

    def poll(self) -> None:
        """Commit a finished async save (call once per step; cheap)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending async save (if any) is written, then commit it."""
        if self._pending is None:
            return
        fut, step, path = self._pending
        self._pending = None
        fut.result()  # re-raises a failed write
        self._commit(step, path)

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _commit(self, step: int, path: Path) -> None:
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
            tmp = path / (COMMIT_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path / COMMIT_FILE)
            self._prune()
        self.last_saved_step = step

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        cks = list_checkpoints(self.folder)
        for old in cks[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def cleanup_incomplete(self) -> None:
        """Delete step folders without a commit marker (interrupted saves). Rank 0 only; call at start."""
        if self.rank == 0:
            committed = set(list_checkpoints(self.folder))
            for p in list_checkpoints(self.folder, committed_only=False):
                if p not in committed:
                    _log(f"removing incomplete checkpoint {p} (no {COMMIT_FILE}: its save was interrupted)")
                    shutil.rmtree(p, ignore_errors=True)
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
                    f"available steps: {[_step_of(p) for p in cks] or 'none'}"
                )
            return [want]
        return cks[::-1]

    def load_into(self, state: TrainState, ckpt_dir: Path) -> bool:
        """Load one checkpoint folder into ``state`` (raises on any failure); False when the data-loader
        state could not be restored (saved for another data-parallel world)."""
        metadata = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
        keys = set(metadata.state_dict_metadata)
        items = self._items(state)
        data_ok = True
        for name in [k for k in items if k.startswith("data.")]:
            if not any(k == name or k.startswith(name + ".") for k in keys):
                del items[name]
                data_ok = False
                saved = sorted({k.split(".")[1] for k in keys if k.startswith("data.")})
                seek = hasattr(state.dataloader, "seek_step")
                _log(
                    f"the data-loader state in {ckpt_dir.name} was saved for data-parallel ranks {saved}, not for "
                    f"{name.split('.')[1]}: "
                    + ("the loader is positioned by step (its order does not depend on the world size)" if seek else
                       "the data order restarts from the seed (the model and optimizer resume exactly)")
                )
        dcp.load(items, checkpoint_id=str(ckpt_dir), process_group=self._pg)
        if not data_ok and hasattr(state.dataloader, "seek_step"):
            state.dataloader.seek_step(state.step)
        return data_ok

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
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported, then an older one is tried
                msg = _short_error(e)
                failures.append((ck, msg))
                _log(f"WARNING: checkpoint {ck} is corrupt or unreadable ({msg}); falling back to the previous one")
                continue
            step = read_commit(ck)["step"]
            if state.step != step:
                raise CheckpointError(f"{ck}: commit.json says step {step} but the saved train state says {state.step}")
            if failures:
                _log(f"resumed from {ck} (step {step}) after skipping {len(failures)} unreadable checkpoint(s): "
                     + ", ".join(p.name for p, _ in failures))
            else:
                _log(f"resumed from {ck} (step {step})")
            return step
        if failures:
            raise CheckpointError(
                "every checkpoint failed to load: "
                + "; ".join(f"{p}: {m}" for p, m in failures)
                + ". Move the run folder away to start fresh, or fix the files."
            )
        return None

    def close(self) -> None:
        self.wait()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None
