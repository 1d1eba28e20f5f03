"""python -m titan_mm.serve --model PATH: the OpenAI-compatible server (entrypoints/server.py) under uvicorn.

    python -m titan_mm.serve --model outputs/debug_qwen3 --port 8000 --device cpu
    python -m titan_mm.serve --model /models/Qwen3-0.6B --serve.max_model_len 4096 --serve.block_size 16
    torchrun --nproc-per-node 2 -m titan_mm.serve --model /models/Qwen3-8B --tensor-parallel-size 2

``--model`` is an HF folder or a titan_mm run / checkpoint folder; the engine's settings are the
``--serve.FIELD`` flags (titan_mm/serve/config.py). The engine is loaded before the port opens, so a wrong path
or setting is one line on stderr and exit code 2. Under tensor parallelism rank 0 serves HTTP and the other ranks
follow its engine steps (titan_mm/serve/runner/tp.py).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import tyro
import uvicorn

from titan_mm.config import ConfigError, _closest, _normalize_bools
from titan_mm.loader import CheckpointError
from titan_mm.models.hf_io import HFCheckpointError
from titan_mm.registry import SpecError
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.entrypoints.server import build_app


@dataclass
class ServerArgs:
    model: str
    """An HF model folder, or a titan_mm run / checkpoint folder."""
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port."""
    served_model_name: str = ""
    """The name clients give as "model" (default: the model folder's name)."""
    device: str = ""
    """torch device; empty: cuda when there is one, else cpu."""
    log_level: str = "info"
    """uvicorn's log level (debug, info, warning, error)."""
    serve: ServeConfig = field(default_factory=ServeConfig)


def _check_flags(argv: list[str]) -> None:
    """Unknown flags and a missing --model as one line with a hint (before tyro's multi-line box)."""
    known = [f"--{f.name}" for f in fields(ServerArgs) if f.name != "serve"]
    known += [f"--serve.{f.name}" for f in fields(ServeConfig)]
    given = ["--" + a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")]
    if "-h" in argv or "--help" in argv:
        return
    for flag in given:
        if flag not in known:
            raise ConfigError(f"unknown flag {flag}; {_closest(flag, known)}")
    if "--model" not in given:
        raise ConfigError("--model is required: an HF model folder or a titan_mm run / checkpoint folder")


def _aliases(argv: list[str]) -> list[str]:
    """vLLM's --tensor-parallel-size is --serve.tensor_parallel_size."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        out.append("--serve.tensor_parallel_size" + eq + value if flag.replace("-", "_") == "__tensor_parallel_size"
                   else a)
    return out


def parse_args(argv: list[str]) -> ServerArgs:
    argv = _aliases(argv)
    _check_flags(argv)
    return tyro.cli(ServerArgs, args=_normalize_bools(argv), prog="python -m titan_mm.serve",
                    description="titan_mm's OpenAI-compatible server.", config=(tyro.conf.FlagConversionOff,))


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(list(sys.argv[1:] if argv is None else argv))
        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if not Path(a.model).exists():
            raise ConfigError(f"--model {a.model}: no such folder; give an HF model folder or a titan_mm run / "
                              "checkpoint folder")
        a.serve.check()
        engine = Engine.from_pretrained(a.model, a.serve, device=device)
    except (ConfigError, SpecError, CheckpointError, HFCheckpointError) as e:  # HF weights that do not fit config.json
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = a.served_model_name or Path(a.model).resolve().name
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not engine.tp_rank:  # whatever the log level: what runs, before the port opens
        print(f"{engine.describe(a.model)}; serving it as {name!r} on http://{a.host}:{a.port}", file=sys.stderr,
              flush=True)
    if engine.tp_rank:  # tensor parallel: rank 0 serves; this rank follows its steps until it shuts down
        engine.run_worker()
        return 0
    try:
        uvicorn.run(build_app(engine, name), host=a.host, port=a.port, log_level=a.log_level)
    finally:
        engine.shutdown()
    return 0
