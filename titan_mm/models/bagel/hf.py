"""BAGEL-7B-MoT folders (``llm_config.json``, ``vit_config.json``, ``ema.safetensors``, ``ae.safetensors``): the
config is read (titan_mm.models.bagel.config); the weights in and out are the next slice of issue 47."""

from __future__ import annotations

LATER = ("BAGEL weights in and out (ema.safetensors / ae.safetensors) are not built yet (issue 47, slice 2); train "
         "from a random init (no model.hf_path) or wait for the loader")


def load_hf(model, hf_dir) -> None:
    raise NotImplementedError(f"load_hf({hf_dir}): {LATER}")


def save_hf(model_or_sd, cfg, out_dir, dtype=None, max_shard_bytes: int = 0) -> None:
    raise NotImplementedError(f"save_hf({out_dir}): {LATER}")
