"""diffusers folders in and out: a Wan pipeline's ``transformer/`` (config.json + safetensors). The model keeps
diffusers' parameter names and shapes but one: the output norm's ``scale_shift_table`` (a root parameter in diffusers)
is ``norm_out.scale_shift_table`` here, in a module the last pipeline stage owns. A round trip is exact."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from titan_mm.models import hf_io
from titan_mm.models.wan.config import WanConfig, transformer_dir

DIFFUSERS_SINGLE = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
RENAMED = {"norm_out.scale_shift_table": "scale_shift_table"}
"""Our name -> diffusers' name, where they differ."""


def to_diffusers(sd: dict) -> dict:
    """A state dict under diffusers' names."""
    return {RENAMED.get(k, k): v for k, v in sd.items()}


def from_diffusers(sd: dict) -> dict:
    """A diffusers state dict under this model's names."""
    back = {v: k for k, v in RENAMED.items()}
    return {back.get(k, k): v for k, v in sd.items()}


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a diffusers Wan transformer folder (or a pipeline folder with ``transformer/``; with the model's
    ``expert`` "low_noise", A14B's ``transformer_2/``) into ``model``; names and shapes are checked against the model
    first, from the safetensors headers."""
    d = transformer_dir(hf_dir, model.cfg.subfolder())
    want = to_diffusers({k: tuple(v.shape) for k, v in model.state_dict().items()})
    hf_io.check_tensors(hf_io.safetensors_shapes(d), want, d)
    hf_io.load_full_state_dict(model, from_diffusers(hf_io.read_safetensors(d, want)))


def save_hf(model_or_sd, cfg: WanConfig, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write ``out_dir`` as a diffusers transformer folder (WanTransformer3DModel.from_pretrained reads it)."""
    hf_io.save_hf_folder(model_or_sd, cfg, out_dir, lambda sd, _: to_diffusers(sd), dtype, max_shard_bytes)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return  # rank 0 wrote the folder
    # diffusers reads its own file names (a sharded folder keeps its shard names: the index maps them)
    for ours, theirs in ((hf_io.SINGLE_NAME, DIFFUSERS_SINGLE), (hf_io.INDEX_NAME, DIFFUSERS_INDEX)):
        if os.path.exists(os.path.join(out_dir, ours)):
            os.replace(os.path.join(out_dir, ours), os.path.join(out_dir, theirs))
