"""HF <-> titan_mm for Qwen2 / Qwen2.5: the Qwen3 name map (titan_mm/models/qwen3/hf.py), which already maps
the projection biases, on the derived decoder config; only the model_type and config.json are Qwen2's.

HF names (transformers Qwen2ForCausalLM) -> titan names:
  model.embed_tokens.weight -> tok_embeddings.weight     model.norm.weight -> norm.weight
  lm_head.weight -> output.weight (absent when tie_word_embeddings; a stored copy is skipped on load)
  model.layers.{i}.input_layernorm.weight -> layers.{i}.attn_norm.weight
  model.layers.{i}.post_attention_layernorm.weight -> layers.{i}.ffn_norm.weight
  model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias} -> layers.{i}.attn.{wq,wk,wv}.{weight,bias}
  model.layers.{i}.self_attn.o_proj.weight -> layers.{i}.attn.wo.weight (no bias)
  model.layers.{i}.mlp.{gate,up,down}_proj.weight -> layers.{i}.mlp.{w1,w3,w2}.weight
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from titan_mm.models import hf_io
from titan_mm.models.qwen2.config import MODEL_TYPE, Qwen2Config, as_decoder
from titan_mm.models.qwen3 import hf as qwen3_hf
from titan_mm.models.qwen3.config import Qwen3Config


def hf_to_titan(sd: dict[str, torch.Tensor], cfg: Qwen2Config | Qwen3Config) -> dict[str, torch.Tensor]:
    return qwen3_hf.hf_to_titan(sd, as_decoder(cfg))


def titan_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen2Config | Qwen3Config) -> dict[str, torch.Tensor]:
    return qwen3_hf.titan_to_hf(sd, as_decoder(cfg))


def check_hf_dir(hf_dir: str | os.PathLike, cfg: Qwen2Config | Qwen3Config) -> None:
    """model_type "qwen2", then every tensor's name and shape from the safetensors headers (no data read)."""
    qwen3_hf.check_hf_dir(hf_dir, as_decoder(cfg), model_type=MODEL_TYPE)


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a local HF Qwen2 directory into ``model`` (plain, meta-built, or FSDP / TP-sharded): Qwen3's loader
    with model_type "qwen2" expected."""
    qwen3_hf.load_hf(model, hf_dir, model_type=MODEL_TYPE)


def save_hf(model_or_sd, cfg: Qwen2Config, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write HF safetensors + a Qwen2 config.json that transformers' AutoModelForCausalLM loads.

    The tensors are written by Qwen3's save_hf (collective for a sharded model: every rank calls it, rank 0
    writes, one layer gathered at a time); config.json is then rewritten as Qwen2's, with the dtype written."""
    if not isinstance(cfg, Qwen2Config):
        raise TypeError(f"qwen2 save_hf needs the family's Qwen2Config (it writes model_type 'qwen2'), "
                        f"got {type(cfg).__name__}")
    qwen3_hf.save_hf(model_or_sd, cfg.decoder(), out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        written = hf_io.read_hf_config(out_dir)
        hf_io.write_config(cfg.to_hf_dict(dtype=written.get("torch_dtype")), out_dir)
