"""HF <-> titan_mm tensor names for Qwen2.5-VL, and load / save of local HF directories.

The names follow Qwen3-VL's map (titan_mm/models/qwen3_vl/hf.py), which this file calls:
  model.visual.patch_embed.proj.weight [Dv, C, T, ps, ps] (Conv3d, no bias) <-> visual.patch_embed.weight [Dv, P]
  model.visual.blocks.{i}.attn.qkv.* rows (3, H, Dh) <-> visual.blocks.{i}.attn.wqkv.* rows (H, 3, Dh)
  model.visual.{blocks.{i}.{norm1,norm2,attn.proj,mlp.{gate,up,down}_proj}, merger.{ln_q,mlp.0,mlp.2}}.*
      <-> visual.{same}
  model.language_model.*, lm_head.weight <-> language_model.* (the Qwen2 decoder's names, qwen3/hf.py)
Those are transformers' in-memory names. The released checkpoints, and transformers' save_pretrained, store
``visual.*`` and ``model.{embed_tokens,layers,norm}.*``: both are read, and save_hf writes the stored layout.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from titan_mm.models import hf_io
from titan_mm.models.qwen2_5_vl.config import Qwen2_5_VLConfig, VisionConfig
from titan_mm.models.qwen2_5_vl.model import Qwen2_5_VLModel
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3_vl import hf as vl_hf


class _MapView(NamedTuple):
    """What Qwen3-VL's name map reads of a config: the decoder, the vision shapes, the model type."""

    text: Qwen3Config
    vision: VisionConfig
    model_type: str


def _view(cfg: Qwen2_5_VLConfig) -> _MapView:
    return _MapView(cfg.decoder, cfg.vision, cfg.model_type)


def _in_memory(k: str) -> str:
    """A stored (hub) name -> transformers' in-memory name; in-memory names pass unchanged."""
    if k.startswith("visual."):
        return "model." + k
    if k.startswith("model.") and not k.startswith(("model.visual.", "model.language_model.")):
        return "model.language_model." + k[len("model."):]
    return k


def _stored(k: str) -> str:
    for mem, disk in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if k.startswith(mem):
            return disk + k[len(mem):]
    return k


def hf_to_titan(sd: dict[str, torch.Tensor], cfg: Qwen2_5_VLConfig) -> dict[str, torch.Tensor]:
    return vl_hf.hf_to_titan({_in_memory(k): v for k, v in sd.items()}, _view(cfg))


def titan_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen2_5_VLConfig) -> dict[str, torch.Tensor]:
    """Titan names -> the stored layout (``visual.*``, ``model.*``, ``lm_head.weight``)."""
    return {_stored(k): v for k, v in vl_hf.titan_to_hf(sd, _view(cfg)).items()}


def expected_titan_shapes(cfg: Qwen2_5_VLConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = Qwen2_5_VLModel(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def read_hf_state_dict(hf_dir: str | os.PathLike, cfg: Qwen2_5_VLConfig) -> dict[str, torch.Tensor]:
    """A local HF dir as full CPU tensors with titan names; model_type, every name and shape checked."""
    mt = hf_io.read_hf_config(hf_dir).get("model_type")
    if mt != cfg.model_type:
        raise hf_io.HFCheckpointError(f"{hf_dir}/config.json has model_type={mt!r} but the model is "
                                      f"{cfg.model_type!r}; use the registry entry for it (spec_for_hf_dir).")
    sd = hf_to_titan(hf_io.read_safetensors(hf_dir), cfg)
    hf_io.check_tensors({k: tuple(v.shape) for k, v in sd.items()}, expected_titan_shapes(cfg), str(hf_dir),
                        describe=vl_hf.describe,
                        hint="check that config.json matches the weights (same flavor, tie_word_embeddings, vision "
                        "depth) and that the download is complete")
    return sd


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a local HF directory into ``model`` (plain, meta-built, or FSDP-sharded)."""
    sd = read_hf_state_dict(hf_dir, model.cfg)
    hf_io.load_full_state_dict(model, {k: sd[k] for k in model.state_dict()})
    lm = model.language_model
    if lm.rope_inv_freq.is_meta:
        lm.init_buffers(lm.tok_embeddings.weight.device)


def save_hf(model_or_sd, cfg: Qwen2_5_VLConfig, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write HF safetensors + config.json that transformers' Qwen2_5_VLForConditionalGeneration loads
    (collective for a sharded model: every rank calls it, rank 0 writes)."""
    hf_io.save_hf_folder(model_or_sd, cfg, out_dir, titan_to_hf, dtype, max_shard_bytes)
