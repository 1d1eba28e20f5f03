"""Per-step metrics: <run>/metrics.jsonl (one JSON line per step), TensorBoard events, a console line.

Only rank 0 writes. The jsonl file is appended to, so a resumed run continues the same file (a step that
was re-run after a crash appears twice; the later line wins).
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=int(seconds)))


def _fmt_num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, total_steps: int, log_freq: int = 1, enable_jsonl: bool = True,
                 enable_tensorboard: bool = True, rank: int = 0, stream=None):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.log_freq = max(1, log_freq)
        self.rank = rank
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._tb = None
        self._t0 = time.perf_counter()
        self._first_step: int | None = None
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if enable_jsonl:
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one finished optimizer step (``step`` counts from 1)."""
        if self.rank != 0:
            return
        if self._first_step is None:
            self._first_step = step - 1
            self._t0 = time.perf_counter() - float(metrics.get("step_time_s", 0.0))
        row = {"step": step, **metrics, "time": time.time()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row, default=float) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if step % self.log_freq == 0 or step == self.total_steps:
            self.stream.write(self.console_line(step, metrics) + "\n")
            self.stream.flush()

    def console_line(self, step: int, m: dict[str, Any]) -> str:
        done = step - (self._first_step or 0)
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        width = len(str(self.total_steps))
        parts = [
            f"step {step:>{width}}/{self.total_steps} ({100.0 * step / max(self.total_steps, 1):3.0f}%)",
            f"loss {m.get('loss', float('nan')):.4f}",
            f"lr {m.get('lr', 0.0):.2e}",
            f"gnorm {m.get('grad_norm', float('nan')):.3f}",
            f"{_fmt_num(m.get('tokens_per_s', 0.0))} tok/s",
        ]
        if m.get("mfu", 0.0) > 0:
            parts.append(f"mfu {100 * m['mfu']:.1f}%")
        parts.append(
            f"step {m.get('step_time_s', 0.0):.2f}s (p50 {m.get('step_time_p50_s', 0.0):.2f} "
            f"p90 {m.get('step_time_p90_s', 0.0):.2f}, data {m.get('data_wait_s', 0.0):.2f})"
        )
        parts.append(f"mem {m.get('mem_peak_gb', 0.0):.2f}GB")
        if m.get("nan_count"):
            parts.append(f"nan {m['nan_count']}")
        parts.append(f"eta {_fmt_eta(eta)}")
        return " | ".join(parts)

    def info(self, msg: str) -> None:
        if self.rank == 0:
            self.stream.write(f"[titan_mm] {msg}\n")
            self.stream.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl -> {step: row}; for steps logged more than once (re-run after a crash) the last wins."""
    out: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                out[int(row["step"])] = row
    return out
