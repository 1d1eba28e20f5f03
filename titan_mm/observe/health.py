"""Run health: non-finite loss / grad-norm handling, step-time percentiles, memory.

    guard = NanGuard(policy="skip", max_skipped=10)
    if not guard.check(step, loss, grad_norm):   # False: skip this update (policy "skip")
        ...                                       # policy "stop" raises NonFiniteError
"""

from __future__ import annotations

import math
import resource
import sys
from collections import deque

import torch


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm and the policy says stop."""


class NanGuard:
    """Decides what to do with a step whose loss or grad norm is not finite.

    ``policy="stop"`` raises :class:`NonFiniteError`; ``policy="skip"`` returns False (the caller drops
    the update) until ``max_skipped`` steps in a row were skipped, then raises. ``nan_count`` counts
    every non-finite step of this process's run.
    """

    def __init__(self, policy: str = "stop", max_skipped: int = 10):
        if policy not in ("stop", "skip"):
            raise ValueError(f"nan policy must be 'stop' or 'skip', got {policy!r}")
        self.policy = policy
        self.max_skipped = max_skipped
        self.nan_count = 0
        self.skipped_in_a_row = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.skipped_in_a_row = 0
            return True
        self.nan_count += 1
        self.skipped_in_a_row += 1
        what = f"loss={loss} grad_norm={grad_norm}"
        if self.policy == "stop":
            raise NonFiniteError(
                f"step {step}: non-finite {what}. Training stopped (training.nan_policy='stop'). "
                "Lower optimizer.lr, raise lr_scheduler.warmup_steps, check the data, or set "
                "training.nan_policy='skip' to drop such steps; the last checkpoint is intact."
            )
        if self.skipped_in_a_row > self.max_skipped:
            raise NonFiniteError(
                f"step {step}: non-finite {what} for {self.skipped_in_a_row} steps in a row "
                f"(training.max_skipped_steps={self.max_skipped}). Training stopped: the run is diverging; "
                "lower optimizer.lr or resume from an earlier checkpoint."
            )
        print(f"[titan_mm] step {step}: non-finite {what}; update skipped (training.nan_policy='skip')",
              file=sys.stderr, flush=True)
        return False


class StepTimes:
    """Rolling step-time percentiles over the last ``window`` steps (the first ``skip_first`` are warmup)."""

    def __init__(self, window: int = 100, skip_first: int = 1):
        self.times: deque[float] = deque(maxlen=window)
        self.skip_first = skip_first
        self.warmup: list[float] = []
        self.seen = 0

    def add(self, t: float) -> None:
        self.seen += 1
        (self.warmup if self.seen <= self.skip_first else self.times).append(t)

    def percentile(self, q: float) -> float:
        xs = sorted(self.times or self.warmup)
        if not xs:
            return 0.0
        k = (len(xs) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    @property
    def p50(self) -> float:
        return self.percentile(0.5)

    @property
    def p90(self) -> float:
        return self.percentile(0.9)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory since the last reset (CUDA), or the process's peak RSS (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1e9 if sys.platform == "darwin" else 1e6)
