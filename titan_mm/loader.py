"""The one model loader: a path -> the built model with its weights, its spec and config, and what decodes it.

    got = load_model("outputs/debug_qwen3", device)   # or an HF folder, a Hub id (org/name), a step folder
    got.model, got.spec, got.model_cfg, got.tokenizer, got.data, got.eos_ids, got.job, got.path

What a path names (:func:`resolve_source`):
- an HF model folder (config.json + safetensors), or a Hub repo id fetched into the HF cache
  (titan_mm.models.hf_io.local_hf_dir): the family its config.json names, its tokenizer, the image resize bounds of
  its preprocessor_config.json, the video bounds and frame sampling of its video_preprocessor_config.json and the
  stop ids of its generation_config.json;
- a titan_mm run folder, checkpoints folder or step folder: the newest committed checkpoint whose files pass their
  checksums (titan_mm.checkpoint_io.resolve_verified); the architecture from the config.toml saved inside it,
  only the model's weights read from DCP (one process, whatever the world that wrote them), the run's tokenizer.

Export, the serving engine, eval and the tools call :func:`load_model`. The trainer builds its model itself (on
meta, parallelized) and fills it through :func:`load_weights`; :func:`model_from_config` is the one
``[model]`` -> (spec, config) resolution of all of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_mm.checkpoint_io import CONFIG_FILE, CheckpointError, load_model_weights, resolve_verified
from titan_mm.config import ConfigError, Data, JobConfig, load_toml
from titan_mm.data.tokenizer import load_tokenizer, tokenizer_for
from titan_mm.kernels import resolve_ops
from titan_mm.models.hf_config import HFConfigError, conforms
from titan_mm.models.hf_io import HFCheckpointError, HFPathNotFound, local_hf_dir
from titan_mm.quant.float8 import check_float8_experts  # imports torchao itself only when float8 is asked for
from titan_mm.registry import ModelSpec, SpecError, resolve_model, spec_for_hf_dir


@dataclass
class Source:
    """A resolved path: an HF folder, or a verified checkpoint step folder with the config of the run that wrote it."""

    path: Path
    """The local HF folder (a Hub id's cache folder), or the checkpoint step folder."""
    job: JobConfig | None = None
    """The run's config.toml (a checkpoint); None for an HF folder."""

    @property
    def is_hf(self) -> bool:
        return self.job is None


@dataclass
class Loaded:
    model: torch.nn.Module
    spec: ModelSpec
    model_cfg: Any
    data: Data
    """The [data] the model trained with (a checkpoint), else defaults with the HF folder's image / video processing."""
    tokenizer: Any
    """titan_mm.data.tokenizer.Tokenizer: the run's, or the HF folder's."""
    eos_ids: list[int] | None
    """The HF folder's generation_config.json stop ids; None: the tokenizer's (a run)."""
    job: JobConfig | None
    path: Path
    """The HF folder or the checkpoint step folder that was read."""


def checkpoint_config(ck: Path) -> JobConfig:
    """The run's resolved config saved inside checkpoint folder ``ck``."""
    cfg_file = Path(ck) / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"{ck} has no {CONFIG_FILE}; cannot tell which model it holds")
    return load_toml(cfg_file)


def resolve_source(path: str | os.PathLike) -> Source:
    """What ``path`` names (module docstring). Raises ConfigError / CheckpointError (one line) for a path that
    is none of them, before any weight is read."""
    p = Path(path)
    if (p / "model_index.json").is_file():  # a diffusers pipeline folder: its transformer/ (hf_io.local_hf_dir)
        p = Path(local_hf_dir(str(p)))
    if (p / "config.json").is_file():
        return Source(p)
    if p.exists():
        ck = resolve_verified(p)
        return Source(ck, checkpoint_config(ck))
    if p.is_absolute() or str(path).startswith((".", "~")):
        raise ConfigError(f"{p} does not exist; pass an HF model folder (with config.json), a Hub repo id (org/name) "
                          "or a titan_mm run or checkpoint folder")
    try:
        return Source(Path(local_hf_dir(str(path), weights=True)))
    except HFPathNotFound as e:  # its words are model.hf_path's: say first what was looked for here
        raise ConfigError(f"{path} is no local run, checkpoint or HF folder, nor a Hub model that can be fetched: "
                          f"{e}") from None


def model_from_config(cfg: JobConfig, device: torch.device) -> tuple[ModelSpec, Any]:
    """(spec, model config) for ``[model]`` with the runtime choices of ``[model]`` / ``[kernels]`` / ``[float8]``
    on ``device``: attention backend (auto: flex on CUDA in bf16 / fp16, sdpa otherwise), kernel ops (auto: on
    CUDA) and float8 experts (float8.moe_experts: a MoE model on an SM>=90 GPU with torchao's MoE training, checked
    here)."""
    m = cfg.model
    try:  # checked on every device, so a typo fails on the CPU too
        resolve_ops(cfg.kernels.ops)
    except ValueError as e:
        raise ConfigError(f"kernels.ops={cfg.kernels.ops!r}: {e}") from None
    on = cfg.kernels.mode == "triton" or (cfg.kernels.mode == "auto" and device.type == "cuda")
    # auto: flex on CUDA in bf16 / fp16; fp32's flex backward at head dim 128 finds no kernel config that fits
    # shared memory (torch 2.11, H200: bench/rl.py's 1.7B run), so fp32 takes sdpa
    flex = device.type == "cuda" and cfg.training.param_dtype != "float32"
    backend = m.attn_backend if m.attn_backend != "auto" else ("flex" if flex else "sdpa")
    try:
        resolved = resolve_model(m.name, m.flavor, m.hf_path, m.overrides, attn_backend=backend,
                                 kernels=cfg.kernels.ops if on else False, moe_float8=cfg.float8.moe_experts)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    if cfg.float8.moe_experts:
        check_float8_experts(device)
    return resolved


def tokenizer_path(job: JobConfig) -> str:
    """The tokenizer the run of ``job`` trains with: data.tokenizer_path, else its HF folder's, else the built-in."""
    return tokenizer_for(job.data.tokenizer_path, local_hf_dir(job.model.hf_path) if job.model.hf_path else None)


def load_weights(model: torch.nn.Module, spec: ModelSpec, source: Source | str) -> int | None:
    """Fill ``model`` (plain, materialized from meta, or FSDP / TP-sharded, built as the source's config says)
    with the source's weights: an HF folder through ``spec.load_hf``, a checkpoint's model from DCP.
    -> the checkpoint's step (None for an HF folder). A str is an HF folder or Hub id (``model.hf_path``)."""
    if isinstance(source, str):
        source = Source(Path(local_hf_dir(source, weights=True)))
    if source.is_hf:
        spec.load_hf(model, str(source.path))
        return None
    return load_model_weights(model, source.path)


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", *, shard=None,
               kernels: bool = False) -> Loaded:
    """The model of ``path`` (module docstring) on ``device``, in eval mode. ``shard(model, spec, config)``: tensor
    parallel (titan_mm.serve.runner.tp), applied to the meta-built model of an HF folder, so that each rank materialises
    and reads only its shards; a checkpoint is read whole, then sharded. ``kernels``: an HF folder's model runs
    the fused titan_mm.kernels ops on CUDA (a checkpoint keeps its run's [kernels] as resolved on the CPU)."""
    device = torch.device(device)
    src = resolve_source(path)
    if src.is_hf:
        spec, model_cfg = hf_model_config(src.path, attn_backend="sdpa", kernels=kernels and device.type == "cuda")
        data, eos, tok = _hf_media_bounds(src.path), _hf_eos(src.path), tokenizer_for(None, str(src.path))
    else:  # the architecture as the run resolved it, with the CPU's runtime defaults (sdpa; kernels as configured)
        spec, model_cfg = model_from_config(src.job, torch.device("cpu"))
        data, eos, tok = src.job.data, None, tokenizer_path(src.job)
    try:  # before any weight is read
        tok = load_tokenizer(tok)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the tokenizer of {src.path} cannot be loaded: {e}") from None
    with torch.device("meta"):
        model = spec.build(model_cfg)
    if shard is not None and src.is_hf:
        model = shard(model, spec, model_cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    load_weights(model, spec, src)
    if shard is not None and not src.is_hf:
        model = shard(model, spec, model_cfg)
    return Loaded(model.eval(), spec, model_cfg, data, tok, eos, src.job, src.path)


def hf_model_config(folder: Path, **runtime) -> tuple[ModelSpec, Any]:
    """(spec, config with the ``runtime`` fields) of an HF folder's config.json; every mistake in the file (a value of
    the wrong type, a missing key, what the family cannot run) is one ConfigError line, before any weight is read."""
    cfg_file = folder / "config.json"
    try:
        spec = spec_for_hf_dir(str(folder))
        return spec, spec.with_runtime(spec.config_from_hf(str(folder)), **runtime)
    except HFConfigError as e:  # a value of the wrong type, its key named from the top of the file
        why = str(e)
    except (SpecError, HFCheckpointError) as e:  # these name the file already
        raise ConfigError(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:  # the family's reader names what does not fit
        why = f"the key {e} is missing" if isinstance(e, KeyError) else str(e)
    raise ConfigError(f"{cfg_file}: {why}")


def _hf_json(f: Path) -> dict:
    """An HF folder's side file (preprocessor / generation config) as a dict; {} when absent; one line if broken."""
    if not f.is_file():
        return {}
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f} cannot be read as JSON ({e}); fix or delete it") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{f} holds a JSON {type(d).__name__}, not an object; fix or delete it")
    return d


_HF_PROCESSING = {
    "preprocessor_config.json": {("size", "shortest_edge"): "image_min_pixels",
                                 ("size", "longest_edge"): "image_max_pixels"},
    "video_preprocessor_config.json": {("size", "shortest_edge"): "video_min_pixels",
                                       ("size", "longest_edge"): "video_max_pixels", ("fps",): "video_fps",
                                       ("min_frames",): "video_min_frames", ("max_frames",): "video_max_frames"},
}
"""An HF folder's processor files -> (key path -> the [data] field the training processor reads it as)."""


def _hf_media_bounds(folder: Path) -> Data:
    """[data] image and video processing (resize bounds, frame sampling) from an HF folder's preprocessor_config.json
    and video_preprocessor_config.json (Data's defaults for what they do not say)."""
    kw = {}
    for name, keys in _HF_PROCESSING.items():
        f = folder / name
        d = _hf_json(f)
        for path, field in keys.items():
            v = d
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            if v is None:
                continue
            if not (conforms(v, float) and v > 0):
                raise ConfigError(f"{f}: {'.'.join(path)} = {v!r} must be a positive number")
            kw[field] = type(getattr(Data, field))(v)
    return Data(**kw)


def _hf_eos(folder: Path) -> list[int] | None:
    f = folder / "generation_config.json"
    e = _hf_json(f).get("eos_token_id")
    if not conforms(e, int | list[int] | None):
        raise ConfigError(f"{f}: eos_token_id = {e!r} must be an int, a list of ints or null")
    return None if e is None else ([e] if isinstance(e, int) else list(e))
