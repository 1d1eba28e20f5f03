"""Export a DCP checkpoint to an HF model folder (safetensors + config.json) that transformers loads.

    python -m titan_mm.export --checkpoint outputs/debug_qwen3 --out /tmp/debug_qwen3_hf [--dtype bfloat16]

``--checkpoint`` is a step folder (``.../checkpoints/step-00000100``), a checkpoints folder or a run folder
(its newest committed checkpoint is taken). The model architecture comes from the config.toml saved inside
the checkpoint; only the model weights are read (no optimizer state), in one process, whatever the number
of processes that wrote the checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from titan_mm.config import ConfigError, load_toml
from titan_mm.dtypes import DTYPES, torch_dtype
from titan_mm.train.checkpoint import CONFIG_FILE, CheckpointError, resolve_checkpoint


def load_model_from_checkpoint(checkpoint: str | Path):
    """(model on CPU with the checkpoint's weights, model config, ModelSpec, checkpoint folder)."""
    import torch.distributed.checkpoint as dcp

    from titan_mm.train.setup import model_from_config

    ck = resolve_checkpoint(checkpoint)
    cfg_file = ck / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"{ck} has no {CONFIG_FILE}; cannot tell which model it holds")
    cfg = load_toml(cfg_file)
    spec, model_cfg = model_from_config(cfg, torch.device("cpu"))
    with torch.device("cpu"):
        model = spec.build(model_cfg)
    with torch.no_grad():
        model.init_weights()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(ck))
    model.load_state_dict(sd["model"])
    return model, model_cfg, spec, ck


def export(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    model, model_cfg, spec, ck = load_model_from_checkpoint(checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kw = {"dtype": torch_dtype(dtype)} if dtype else {}
    spec.save_hf(model, model_cfg, str(out), **kw)
    print(f"[titan_mm] exported {ck} -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="step folder, checkpoints folder or run folder")
    ap.add_argument("--out", required=True, help="output HF folder (created)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="dtype of the saved tensors (default: as trained, float32)")
    a = ap.parse_args(argv)
    try:
        export(a.checkpoint, a.out, a.dtype)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
