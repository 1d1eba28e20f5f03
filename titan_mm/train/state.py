"""TrainState: everything a run needs to continue exactly where it stopped.

    state = TrainState(model, optimizer, scheduler, dataloader)
    state.step                 # optimizer steps done (0 before the first)

The checkpoint module turns a TrainState into DCP state-dict items:
``model`` / ``optimizer`` (through torch.distributed.checkpoint.state_dict, so FSDP/TP shards reshard on
load), ``train`` (step, scheduler, RNG, NaN counters, the float16 loss scale; the same on every rank) and
``data.slot<k>of<K>`` (the loader state of each micro-batch slot this data-parallel rank reads).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn


def get_rng_state() -> dict[str, Any]:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(b: bytes) -> Any:
    return torch.load(io.BytesIO(b), weights_only=False)


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataloader: Any = None
    """An iterable of micro-batches whose state_dict() / load_state_dict() use the per-slot loader state of
    titan_mm.data.loader.StreamLayout (TitanDataLoader, SyntheticLoader)."""
    step: int = 0
    """Optimizer steps done (skipped non-finite steps count: they consumed their data)."""
    nan_count: int = 0
    """Non-finite steps seen over the whole run (resumes included)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Small picklable values that must survive a resume (saved with the ``train`` item)."""
    scaler: Any = None
    """titan_mm.train.step.LossScaler with training.param_dtype = "float16" (else None); its scale and growth
    tracker are saved with the ``train`` item."""

    def train_state_dict(self) -> dict[str, Any]:
        """The rank-independent part: step, scheduler, RNG, counters, loss scale."""
        return {
            "step": self.step,
            "blob": to_bytes(
                {
                    "scheduler": self.scheduler.state_dict(),
                    "rng": get_rng_state(),
                    "nan_count": self.nan_count,
                    "extra": self.extra,
                    "scaler": None if self.scaler is None else self.scaler.state_dict(),
                }
            ),
        }

    def load_train_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        blob = from_bytes(sd["blob"])
        self.scheduler.load_state_dict(blob["scheduler"])
        set_rng_state(blob["rng"])
        self.nan_count = int(blob["nan_count"])
        self.extra = dict(blob["extra"])
        # a checkpoint without a scale (not float16, or older) leaves a float16 run at training.loss_scale_init
        if self.scaler is not None and blob.get("scaler") is not None:
            self.scaler.load_state_dict(blob["scaler"])
