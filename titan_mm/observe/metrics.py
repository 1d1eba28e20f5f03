"""Per-step metrics, fanned out to sinks: <run>/metrics.jsonl, TensorBoard, wandb, a Prometheus /metrics port,
and a console line.

    logger = build_logger(cfg.metrics, run_dir, total_steps=100, rank=rank, run_name="job", run_config=to_dict(cfg))
    logger.log(step, {"loss": 2.3, "data/packing_efficiency": 0.97})   # every sink gets every step
    logger.close()                                                      # flushes files, stops the HTTP server

Only rank 0 has sinks (other ranks get none). A sink is anything with ``write(step, metrics)`` and
``close()``. The jsonl file is appended to, so a resumed run continues the same file (a step that was
re-run after a crash appears twice; the later line wins).
"""

from __future__ import annotations

import datetime
import json
import math
import re
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from titan_mm.config import ConfigError

if TYPE_CHECKING:
    from titan_mm.config import Metrics


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one finished optimizer step (``step`` counts from 1)."""

    def close(self) -> None:
        """Flush and release what the sink holds (files, servers, a wandb run)."""


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a scalar sink can take (numbers; bools and strings left out)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class JsonlSink:
    def __init__(self, path: Path):
        self._f = open(path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._f.write(json.dumps({"step": step, **metrics, "time": time.time()}, default=float) + "\n")

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # ~0.7 s to import; only a run that logs to TensorBoard

        self._tb = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in numeric(metrics).items():
            self._tb.add_scalar(f"train/{k}", v, step)

    def close(self) -> None:
        self._tb.close()


class WandbSink:
    """One wandb run per run folder: its id is kept in <run>/wandb_id, so a resumed job continues it."""

    def __init__(self, run_dir: Path, *, project: str, mode: str, name: str, config: dict[str, Any]):
        import wandb  # optional: config validation already said how to install it

        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=project, name=name, id=run_id, resume="allow", mode=mode,
                               dir=str(run_dir), config=config)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log(numeric(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def prometheus_name(key: str) -> str:
    """A metric key as a Prometheus metric name: ``data/packing_efficiency`` -> ``titan_mm_data_packing_efficiency``."""
    return "titan_mm_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class PrometheusSink:
    """A /metrics HTTP endpoint with one gauge per numeric step metric (the latest value) and ``titan_mm_step``.

    The gauges live in the sink's own registry, so several loggers in one process (tests) do not collide.
    """

    def __init__(self, port: int, addr: str = "0.0.0.0"):
        self._gauge_cls = Gauge
        self._registry = CollectorRegistry()
        self._gauges: dict[str, Any] = {}
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self._registry)
        except OSError as e:
            raise ConfigError(f"metrics.prometheus_port {port}: cannot serve /metrics on {addr} ({e.strerror}); "
                              "pick a free port, or 0 to turn the exporter off") from None
        self._step = self._gauge("step", "last finished optimizer step")

    def _gauge(self, key: str, doc: str):
        name = prometheus_name(key)
        if name not in self._gauges:
            self._gauges[name] = self._gauge_cls(name, doc, registry=self._registry)
        return self._gauges[name]

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in numeric(metrics).items():
            self._gauge(k, f"titan_mm step metric {k}").set(v)
        self._step.set(step)  # last, so a scrape that sees the step sees its metrics

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=int(seconds)))


def _fmt_num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


class ConsoleSink:
    """A progress line every ``log_freq`` steps, at the last step and at every eval step (whose scores it shows),
    with an ETA from this process's pace."""

    def __init__(self, stream, *, total_steps: int, log_freq: int = 1):
        self.stream = stream
        self.total_steps = total_steps
        self.log_freq = max(1, log_freq)
        self._t0 = time.perf_counter()
        self._first_step: int | None = None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if self._first_step is None:  # the pace counts from this process's first step (resumes too)
            self._first_step = step - 1
            self._t0 = time.perf_counter() - float(metrics.get("step_time_s", 0.0))
        if step % self.log_freq == 0 or step == self.total_steps or "eval/time_s" in metrics:  # eval ran
            self.stream.write(self.line(step, metrics) + "\n")
            self.stream.flush()

    def line(self, step: int, m: dict[str, Any]) -> str:
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
        scores = [f"{k[5:]} {v:.4g}" for k, v in m.items() if k.startswith("eval/") and k.count("/") == 2
                  and k.rsplit("/", 1)[1] not in ("ppl", "tokens", "n", "skipped")]
        if scores:  # an eval step (titan_mm.eval): its scores, the rest is in metrics.jsonl
            parts.append(f"eval {', '.join(scores)} ({m.get('eval/time_s', 0.0):.1f}s)")
        return " | ".join(parts)

    def close(self) -> None:
        self.stream.flush()


class MetricsLogger:
    """Fans each step's metrics out to its sinks; ``info`` prints a ``[titan_mm]`` line from rank 0."""

    def __init__(self, sinks: list[Sink], *, rank: int = 0, stream=None):
        self.sinks = sinks
        self.rank = rank
        self.stream = stream or sys.stdout

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(step, metrics)

    def info(self, msg: str) -> None:
        if self.rank == 0:
            self.stream.write(f"[titan_mm] {msg}\n")
            self.stream.flush()

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for s in sinks:
            s.close()


def build_logger(cfg: Metrics, run_dir: str | Path, *, total_steps: int, rank: int, run_name: str,
                 run_config: dict[str, Any], stream=None) -> MetricsLogger:
    """The logger of a run from its ``[metrics]`` section; ``run_config`` (the resolved config) goes to wandb."""
    stream = stream or sys.stdout
    if rank != 0:
        return MetricsLogger([], rank=rank, stream=stream)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[Sink] = [ConsoleSink(stream, total_steps=total_steps, log_freq=cfg.log_freq)]
    try:  # a sink that fails to start must not leave the others open (the HTTP server, a wandb run)
        if cfg.enable_jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if cfg.enable_tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        if cfg.prometheus_port:
            sinks.append(PrometheusSink(cfg.prometheus_port))
        if cfg.wandb:
            sinks.append(WandbSink(run_dir, project=cfg.wandb_project, mode=cfg.wandb_mode, name=run_name,
                                   config=run_config))
    except BaseException:
        for s in sinks:
            s.close()
        raise
    return MetricsLogger(sinks, rank=rank, stream=stream)


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
