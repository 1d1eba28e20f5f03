"""Tracking sinks beside jsonl / TensorBoard: a Prometheus /metrics port (scraped over HTTP on localhost) and wandb
(an offline run of the trainer, read back from its .wandb file)."""

from __future__ import annotations

import importlib.util
import json
import socket
import struct
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from titan_mm.config import ConfigError, Metrics, load_config
from titan_mm.observe.metrics import build_logger, prometheus_name, read_metrics
from titan_mm.launch.train import main

TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
        "--training.deterministic", "True", "--checkpoint.enable", "False"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The samples of a Prometheus text exposition: {metric name: value} (comment lines dropped)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_prometheus_exporter_serves_the_latest_step(tmp_path):
    port = free_port()
    cfg = Metrics(enable_tensorboard=False, prometheus_port=port)
    logger = build_logger(cfg, tmp_path, total_steps=2, rank=0, run_name="p", run_config={})
    try:
        logger.log(1, {"loss": 3.5, "lr": 1e-3, "data/packing_efficiency": 0.5, "skipped": 0})
        logger.log(2, {"loss": 2.25, "lr": 2e-3, "data/packing_efficiency": 0.75, "skipped": 1, "note": "x"})
        got = scrape(port)
    finally:
        logger.close()
    assert prometheus_name("data/packing_efficiency") == "titan_mm_data_packing_efficiency"
    assert got["titan_mm_step"] == 2
    assert got["titan_mm_loss"] == 2.25 and got["titan_mm_lr"] == 2e-3 and got["titan_mm_skipped"] == 1
    assert got["titan_mm_data_packing_efficiency"] == 0.75
    assert not any("note" in k for k in got)  # strings are not gauges
    assert sorted(read_metrics(tmp_path / "metrics.jsonl")) == [1, 2]  # the other sinks got the same steps
    with pytest.raises(urllib.error.URLError):  # close() stopped the server
        scrape(port)


def test_prometheus_port_in_use_is_one_line_config_error(tmp_path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics.prometheus_port {port}: cannot serve /metrics .*pick a free"):
            build_logger(Metrics(enable_tensorboard=False, prometheus_port=port), tmp_path, total_steps=1, rank=0,
                         run_name="p", run_config={})
    assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""


def test_other_ranks_get_no_sinks(tmp_path):
    logger = build_logger(Metrics(prometheus_port=free_port()), tmp_path / "r1", total_steps=1, rank=1,
                          run_name="p", run_config={})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert logger.sinks == [] and not (tmp_path / "r1").exists()


def read_wandb_records(path: Path):
    """The protobuf records of a .wandb file (wandb's LevelDB-style log: 7-byte header, 32 KiB blocks of chunks
    with a crc32 / length / type header; types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunk, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if pos + n > len(data):  # a chunk still being written
            break
        if kind == 0 and n == 0:
            pos += left - 7
            continue
        chunk += data[pos:pos + n]
        pos += n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def test_wandb_offline_run_logs_metrics_and_config(tmp_path, monkeypatch):
    """The trainer with metrics.wandb on in offline mode (and the Prometheus exporter on): the run's .wandb file
    holds every step's metrics as metrics.jsonl has them, and the resolved config as the wandb config."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    for var in ("WANDB_SILENT", "WANDB_X_DISABLE_STATS", "WANDB_X_DISABLE_META", "WANDB_DISABLE_GIT"):
        monkeypatch.setenv(var, "true")  # quiet, and no system / git probes: the test is about our records
    port = free_port()
    args = ["--job.dump_folder", str(tmp_path), "--job.name", "wb", "--training.steps", "3", *TINY,
            "--metrics.wandb", "True", "--metrics.wandb_mode", "offline", "--metrics.wandb_project", "titan-test",
            "--metrics.prometheus_port", str(port)]
    assert main(args) == 0
    run = tmp_path / "wb"
    rows = read_metrics(run / "metrics.jsonl")
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    recs = read_wandb_records(files[0])
    deadline = time.monotonic() + 30
    while not any(r.WhichOneof("record_type") == "exit" for r in recs) and time.monotonic() < deadline:
        time.sleep(0.2)  # finish() can return before wandb's service process has flushed the file
        recs = read_wandb_records(files[0])
    history: dict[int, dict[str, float]] = {}
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            items = {_key(i): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert sorted(history) == [1, 2, 3], [r.WhichOneof("record_type") for r in recs]
    for s in (1, 2, 3):
        for k in ("loss", "lr", "grad_norm", "tokens_per_s", "data_wait_s"):
            assert history[s][k] == pytest.approx(rows[s][k], rel=1e-12), (s, k)
    (meta,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert meta.project == "titan-test" and meta.display_name == "wb"
    assert meta.run_id == (run / "wandb_id").read_text().strip()  # a resume of this folder continues this run
    config = {_key(i): json.loads(i.value_json) for i in meta.config.update}
    assert config["training"]["steps"] == 3 and config["metrics"]["wandb_mode"] == "offline"
    with pytest.raises(urllib.error.URLError):  # the exporter ran and was shut down with the run
        scrape(port)


def test_wandb_not_installed_is_one_line_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"metrics.wandb is on but wandb is not installed: pip install wandb"):
        load_config(["--metrics.wandb", "True"])
    assert load_config([]).metrics.wandb is False  # off (the default) needs no wandb


@pytest.mark.parametrize("flags, msg", [
    (["--metrics.prometheus_port", "70000"], "metrics.prometheus_port must be a TCP port"),
    (["--metrics.profile_every", "-1"], "metrics.profile_every must be >= 0"),
    (["--metrics.profile_every", "4", "--metrics.profile_steps", "4"], "metrics.profile_steps must be between 1 and"),
    (["--metrics.profile_every", "4", "--metrics.profile_steps", "0"], "metrics.profile_steps must be between 1 and"),
    (["--metrics.profile_traces", "True"], "metrics.profile_traces writes the profiler windows: set"),
])
def test_bad_tracking_flags(flags, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(flags)
