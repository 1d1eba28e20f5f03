"""diffusers folders in and out: a Wan pipeline's ``transformer/`` (config.json + safetensors). The model keeps
diffusers' parameter names and shapes, so the mapping is the identity and a round trip is exact."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from titan_mm.models import hf_io
from titan_mm.models.wan.config import WanConfig, transformer_dir

DIFFUSERS_SINGLE = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a diffusers Wan transformer folder (or a pipeline folder with ``transformer/``; with the model's
    ``expert`` "low_noise", A14B's ``transformer_2/``) into ``model``; names and shapes are checked against the model
    first, from the safetensors headers."""
    d = transformer_dir(hf_dir, model.cfg.subfolder())
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    hf_io.check_tensors(hf_io.safetensors_shapes(d), want, d)
    hf_io.load_full_state_dict(model, hf_io.read_safetensors(d, want))


def save_hf(model_or_sd, cfg: WanConfig, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write ``out_dir`` as a diffusers transformer folder (WanTransformer3DModel.from_pretrained reads it)."""
    hf_io.save_hf_folder(model_or_sd, cfg, out_dir, lambda sd, _: sd, dtype, max_shard_bytes)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return  # rank 0 wrote the folder
    # diffusers reads its own file names (a sharded folder keeps its shard names: the index maps them)
    for ours, theirs in ((hf_io.SINGLE_NAME, DIFFUSERS_SINGLE), (hf_io.INDEX_NAME, DIFFUSERS_INDEX)):
        if os.path.exists(os.path.join(out_dir, ours)):
            os.replace(os.path.join(out_dir, ours), os.path.join(out_dir, theirs))
