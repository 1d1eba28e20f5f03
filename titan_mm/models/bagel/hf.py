"""BAGEL-7B-MoT folders (``llm_config.json``, ``vit_config.json``, ``ema.safetensors``, ``ae.safetensors``): the
config is read (titan_mm.models.bagel.config); the weights in and out are the next slice of issue 47."""

from __future__ import annotations

from titan_mm.models.hf_io import HFCheckpointError

LATER = ("BAGEL weights in and out (ema.safetensors / ae.safetensors) are not built yet (issue 47, slice 2); train "
         "from a random init (--model.init_from_hf False takes only the folder's configs)")


def load_hf(model, hf_dir) -> None:
    raise HFCheckpointError(f"{hf_dir}: {LATER}")


def save_hf(model_or_sd, cfg, out_dir, dtype=None, max_shard_bytes: int = 0) -> None:
    raise HFCheckpointError(f"{out_dir}: {LATER}")
