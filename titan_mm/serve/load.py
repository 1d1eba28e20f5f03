"""Models for the engine from disk: an HF folder (config.json + safetensors) or a titan_mm run / checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from titan_mm.config import ConfigError, Data


def load_model(path: str | os.PathLike, device: torch.device, shard=None, kernels: bool = False):
    """(model, spec, config, [data], tokenizer, EOS ids or None) of an HF folder or a titan_mm run / checkpoint.
    ``shard(model, spec, config)``: tensor parallel (titan_mm.serve.tp), applied to the meta-built model of an HF
    folder, so that each rank materialises and reads only its shards; a run / checkpoint loads whole first.
    ``kernels``: an HF folder's model runs the fused titan_mm.kernels ops on CUDA (a run keeps its recipe's)."""
    from titan_mm.data.tokenizer import load_tokenizer, tokenizer_for

    p = Path(path)
    if (p / "config.json").is_file():
        from titan_mm.registry import spec_for_hf_dir

        spec = spec_for_hf_dir(str(p))
        model_cfg = spec.with_runtime(spec.config_from_hf(str(p)), attn_backend="sdpa",
                                      kernels=kernels and device.type == "cuda")
        with torch.device("meta"):
            model = spec.build(model_cfg)
        if shard is not None:
            model = shard(model, spec, model_cfg)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
        spec.load_hf(model, str(p))
        data = _hf_image_bounds(p)
        tok = load_tokenizer(tokenizer_for(None, str(p)))
        eos = _hf_eos(p)
    else:
        from titan_mm.export import checkpoint_config, load_model_from_checkpoint
        from titan_mm.models.hf_io import local_hf_dir

        if not p.exists():
            raise ConfigError(f"{p} does not exist; pass an HF model folder (with config.json) or a titan_mm run "
                              "or checkpoint folder")
        model, model_cfg, spec, ck = load_model_from_checkpoint(p)
        if shard is not None:
            model = shard(model.to(device), spec, model_cfg)
        job = checkpoint_config(ck)
        data = job.data
        hf = local_hf_dir(job.model.hf_path) if job.model.hf_path else None
        tok = load_tokenizer(tokenizer_for(data.tokenizer_path, hf))
        eos = None
    return model, spec, model_cfg, data, tok, eos


def _hf_image_bounds(folder: Path) -> Data:
    """[data] image resize bounds from an exported folder's preprocessor_config.json (defaults otherwise)."""
    f = folder / "preprocessor_config.json"
    if not f.is_file():
        return Data()
    size = json.loads(f.read_text()).get("size") or {}
    kw = {}
    if "shortest_edge" in size:
        kw["image_min_pixels"] = int(size["shortest_edge"])
    if "longest_edge" in size:
        kw["image_max_pixels"] = int(size["longest_edge"])
    return Data(**kw)


def _hf_eos(folder: Path) -> list[int] | None:
    f = folder / "generation_config.json"
    if not f.is_file():
        return None
    e = json.loads(f.read_text()).get("eos_token_id")
    return None if e is None else ([e] if isinstance(e, int) else list(e))
