"""The exact-resume check of a debug config through the launcher (the family tests share it).

    from tests.resume_check import assert_resumes_exactly
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from titan_mm.observe.metrics import read_metrics

STOP, STEPS = 4, 8
RESUME_ARGS = ["--checkpoint.interval", str(STOP), "--lr_scheduler.name", "constant"]
"""A checkpoint at the stop step, and a constant lr: a 4-step run's schedule is the 8-step one's start."""


def assert_resumes_exactly(run: Callable[[str, int], int], folder: Path,
                           read: Callable[[dict], object] = lambda r: r["loss"]) -> dict[int, object]:
    """``run(name, steps)`` trains the job ``name`` for ``steps`` (RESUME_ARGS among its flags) under ``folder``
    and returns its exit code. A straight run and one stopped at its step-STOP checkpoint and resumed log the same
    ``read(record)`` at every step, bit for bit. Returns the straight run's values."""
    assert run("straight", STEPS) == 0
    assert run("stopped", STOP) == 0 and run("stopped", STEPS) == 0  # the second call resumes at the checkpoint
    a, b = ({s: read(r) for s, r in read_metrics(folder / n / "metrics.jsonl").items()} for n in ("straight", "stopped"))
    assert sorted(b) == list(range(1, STEPS + 1)) and all(a[s] == b[s] for s in b), (a, b)
    return a
