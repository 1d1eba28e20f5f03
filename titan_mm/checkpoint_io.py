"""Reading a run folder's DCP checkpoints: the committed step folders, their checksums, and a model's weights.

The room below both the trainer (titan_mm.train.checkpoint, which writes checkpoints and resumes from them) and the
one model loader (titan_mm.loader, which reads a run's weights for export, serving and eval), so neither imports the
other for it. The layout of a run folder and commit.json are described in titan_mm/train/checkpoint.py.
"""

from __future__ import annotations

import json
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

COMMIT_FILE = "commit.json"
CONFIG_FILE = "config.toml"
STEP_PREFIX = "step-"
_HASH = "crc32"
_CHUNK = 8 << 20

# DCP warns on every single-process call that it "assumes the intent is to save/load in a single process".
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")


class CheckpointError(RuntimeError):
    pass


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(p: Path) -> int | None:
    """The step of a ``step-NNNNNNNN`` folder; None for any other name."""
    if not p.name.startswith(STEP_PREFIX):
        return None
    try:
        return int(p.name[len(STEP_PREFIX):])
    except ValueError:
        return None


def list_checkpoints(folder: str | Path, committed_only: bool = True) -> list[Path]:
    """Checkpoint folders sorted by step, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        s = step_of(p)
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


def committed_step(folder: str | Path, load_step: int = -1) -> int | None:
    """The step a resume from ``folder`` would start at, from commit.json alone (no tensor is read):
    ``load_step`` if that checkpoint is committed, else the newest committed one; None when there is none."""
    cks = list_checkpoints(folder)
    if load_step >= 0:
        cks = [p for p in cks if step_of(p) == load_step]
    return read_commit(cks[-1])["step"] if cks else None


def file_record(path: str | Path) -> dict[str, Any]:
    """{"size": bytes, "crc32": hex} of one file, read in 8 MiB chunks."""
    crc, size, buf = 0, 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, _HASH: f"{crc:08x}"}


def _file_problem(ckpt_dir: Path, name: str, want: dict[str, Any]) -> str | None:
    p = ckpt_dir / name
    try:
        size = p.stat().st_size
        if size != want["size"]:  # the cheap check first: a truncated or extended file
            return f"{name}: size {size} != {want['size']} bytes recorded in {COMMIT_FILE}"
        got = file_record(p)[_HASH]
    except OSError as e:
        return f"{name}: {type(e).__name__}: {e.strerror or e}"
    if got != want[_HASH]:
        return f"{name}: checksum mismatch ({_HASH} expected {want[_HASH]}, got {got})"
    return None


def verify_checkpoint(ckpt_dir: str | Path, group=None) -> None:
    """Check every file listed in commit.json (size, then CRC-32); raise CheckpointError naming the first bad
    one. With a process ``group`` the ranks split the files and all raise together (call it on every rank).
    A checkpoint from before checksums were recorded is loaded unverified, with one warning line."""
    ckpt_dir = Path(ckpt_dir)
    files = read_commit(ckpt_dir).get("files")
    if files is None:
        rank0_log(f"WARNING: {ckpt_dir} records no checksums (written by an older titan_mm): loading it unverified")
        return
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    names = sorted(files, key=lambda n: (-files[n]["size"], n))[rank::world]  # big files spread over the ranks
    problems = [m for m in (_file_problem(ckpt_dir, n, files[n]) for n in names) if m]
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, problems, group=group)
        problems = [m for r in every for m in r]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)


def resolve_verified(path: str | Path) -> Path:
    """resolve_checkpoint, then verify_checkpoint. A step folder that fails its check is an error; for a run or
    checkpoints folder the newest checkpoint that passes is taken, and each skipped one is reported."""
    ck = resolve_checkpoint(path)
    if (Path(path) / COMMIT_FILE).is_file():
        verify_checkpoint(ck)
        return ck
    failures = []
    for cand in list_checkpoints(ck.parent)[::-1]:
        try:
            verify_checkpoint(cand)
        except (CheckpointError, OSError, ValueError) as e:  # ValueError: an unreadable commit.json
            failures.append(f"{cand.name}: {e}")
            rank0_log(f"WARNING: checkpoint {cand} is corrupt ({e}); falling back to the previous one")
            continue
        if failures:
            rank0_log(f"using {cand} after skipping {len(failures)} corrupt checkpoint(s)")
        return cand
    raise CheckpointError(f"every checkpoint under {ck.parent} failed its check: " + "; ".join(failures))


class ModelItem(Stateful):
    """The ``model`` item of a checkpoint (full or sharded state dict through DCP's state_dict API)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=True))


def load_model_weights(model, ckpt_dir: str | Path) -> int:
    """Only the model of a verified checkpoint folder into ``model`` (built as the run built it); -> its step."""
    verify_checkpoint(ckpt_dir)
    dcp.load({"model": ModelItem(model)}, checkpoint_id=str(ckpt_dir))
    return read_commit(ckpt_dir)["step"]


def rank0_log(msg: str) -> None:
    """A message on stderr, once per job (rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[titan_mm] {msg}", file=sys.stderr, flush=True)
