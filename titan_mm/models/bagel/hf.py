"""BAGEL-7B-MoT folders in and out: ``ema.safetensors`` (the model's weights under the names of ByteDance-Seed/Bagel's
``Bagel`` module: modeling/bagel/{bagel,qwen2_navit,siglip_navit,modeling_utils}.py), ``llm_config.json`` and
``vit_config.json`` (the config: titan_mm.models.bagel.config). ``ae.safetensors`` (the FLUX VAE) is vae.py's.

Names (titan -> BAGEL; ``{g}`` is ``_moe_gen`` for the generation expert ``gen``, empty for ``und``):
  tok_embeddings / norm / norm_gen / output -> language_model.model.embed_tokens / .norm / .norm_moe_gen,
      language_model.lm_head (absent when tied)
  layers.{i}.{und,gen}.attn_norm / ffn_norm -> language_model.model.layers.{i}.input_layernorm{g} /
      post_attention_layernorm{g}
  layers.{i}.{und,gen}.wq / wk / wv / wo / q_norm / k_norm -> ...layers.{i}.self_attn.q_proj{g} / k_proj{g} /
      v_proj{g} / o_proj{g} / q_norm{g} / k_norm{g}
  layers.{i}.{und,gen}.mlp.w1 / w3 / w2 -> ...layers.{i}.mlp{g}.gate_proj / up_proj / down_proj
  the MLP-only split (``Qwen2MoEDecoderLayer``): layers.{i}.shared.* as und's names above (no {g} copies),
      layers.{i}.{und,gen}.w1 / w3 / w2 -> ...layers.{i}.mlp{g}.gate_proj / up_proj / down_proj
  vit.embeddings.* / vit.blocks.{i}.* / vit.post_layernorm -> vit_model.vision_model.embeddings.* /
      .encoder.layers.{i}.* / .post_layernorm (the patch embedding as BAGEL's convert_conv2d_to_linear leaves it:
      a Linear over (row, column, channel) patches, which is ours)
  connector.0 / .2 -> connector.fc1 / fc2;  time_embedder.0 / .2 -> time_embedder.mlp.0 / .2;  vae2llm, llm2vae
The frozen sin-cos tables BAGEL keeps as parameters (``latent_pos_embed.pos_embed``, ``vit_pos_embed.pos_embed``) are
written from our buffers and, on load, checked by shape only (our buffers are computed, not loaded).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titan_mm.models import hf_io
from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.model import sincos_table
from titan_mm.models.hf_io import HFCheckpointError

WEIGHTS = "ema.safetensors"
LLM = "language_model.model."
VIT = "vit_model.vision_model."
TOP = {"tok_embeddings": LLM + "embed_tokens", "norm": LLM + "norm", "norm_gen": LLM + "norm_moe_gen",
       "output": "language_model.lm_head", "connector.0": "connector.fc1", "connector.2": "connector.fc2",
       "time_embedder.0": "time_embedder.mlp.0", "time_embedder.2": "time_embedder.mlp.2", "vae2llm": "vae2llm",
       "llm2vae": "llm2vae", "vit.embeddings.patch_embedding": VIT + "embeddings.patch_embedding",
       "vit.embeddings.position_embedding": VIT + "embeddings.position_embedding",
       "vit.post_layernorm": VIT + "post_layernorm"}
EXPERT = {"attn_norm": "input_layernorm{g}", "ffn_norm": "post_attention_layernorm{g}", "wq": "self_attn.q_proj{g}",
          "wk": "self_attn.k_proj{g}", "wv": "self_attn.v_proj{g}", "wo": "self_attn.o_proj{g}",
          "q_norm": "self_attn.q_norm{g}", "k_norm": "self_attn.k_norm{g}", "mlp.w1": "mlp{g}.gate_proj",
          "mlp.w3": "mlp{g}.up_proj", "mlp.w2": "mlp{g}.down_proj"}
TABLES = ("latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed")


def hf_name(name: str) -> str:
    """BAGEL's name of our parameter ``name`` (module docstring)."""
    module, leaf = name.rsplit(".", 1)
    parts = module.split(".")
    if parts[0] == "layers":  # layers.{i}.{und,gen,shared}.<module>
        g = "_moe_gen" if parts[2] == "gen" else ""
        key = ".".join(parts[3:])
        key = key if key in EXPERT else f"mlp.{key}"  # the MLP-only split's und / gen are the MLPs themselves
        return f"{LLM}layers.{parts[1]}.{EXPERT[key].format(g=g)}.{leaf}"
    if parts[:2] == ["vit", "blocks"]:
        return f"{VIT}encoder.layers.{'.'.join(parts[2:])}.{leaf}"
    return f"{TOP[module]}.{leaf}"


def tables(cfg: BagelConfig) -> dict[str, torch.Tensor]:
    """The two frozen sin-cos tables as BAGEL stores them ([side^2, hidden] fp32)."""
    D = cfg.llm_config.hidden_size
    return {TABLES[0]: sincos_table(D, cfg.max_latent_size), TABLES[1]: sincos_table(D, cfg.vit_max_num_patch_per_side)}


def config_dicts(cfg: BagelConfig) -> tuple[dict, dict]:
    """(llm_config.json, vit_config.json) as the released folder holds them: Qwen2Config's fields plus BAGEL's
    ``qk_norm`` / ``layer_module``, and SiglipVisionConfig's with the layer BAGEL drops counted back in."""
    llm = {"model_type": "qwen2", **dataclasses.asdict(cfg.llm_config)}
    vit = {"model_type": "siglip_vision_model", **dataclasses.asdict(cfg.vit_config)}
    vit["num_hidden_layers"] += 1
    return llm, vit


def load_hf(model, hf_dir) -> None:
    """Load ``hf_dir``'s ``ema.safetensors`` into ``model`` (plain, meta-built or sharded): every name and shape is
    checked from the header first, one HFCheckpointError naming what differs."""
    path = os.path.join(os.fspath(hf_dir), WEIGHTS)
    names = {hf_name(k): k for k in model.state_dict()}
    want = {hf: tuple(model.state_dict()[k].shape) for hf, k in names.items()}
    want.update({k: tuple(t.shape) for k, t in tables(model.cfg).items()})
    try:
        with safe_open(path, framework="pt") as f:
            got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            hf_io.check_tensors(got, want, path, hint="check that llm_config.json / vit_config.json and the flavor's "
                                "max_latent_size / vit_max_num_patch_per_side match the weights")
            sd = {k: f.get_tensor(hf) for hf, k in names.items()}
    except (OSError, SafetensorError) as e:
        raise HFCheckpointError(f"{path} cannot be read ({e}); a BAGEL folder holds {WEIGHTS}, llm_config.json and "
                                "vit_config.json") from None
    hf_io.load_full_state_dict(model, sd)


def save_hf(model_or_sd, cfg: BagelConfig, out_dir, dtype=None, max_shard_bytes: int = 0) -> None:
    """Write ``out_dir`` in the released layout: one ``ema.safetensors`` (BAGEL's loaders read that one file; no
    shards, ``max_shard_bytes`` is ignored), ``llm_config.json``, ``vit_config.json``. Collective for a sharded
    model (every rank calls it, rank 0 writes)."""
    sd = hf_io.full_state_dict(model_or_sd) if isinstance(model_or_sd, torch.nn.Module) else dict(model_or_sd)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    out = {hf_name(k): v if dtype is None else v.to(dtype) for k, v in sd.items()}
    out.update(tables(cfg))  # fp32 as BAGEL keeps them
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in out.items()}, os.path.join(out_dir, WEIGHTS),
              metadata={"format": "pt"})
    for name, d in zip(("llm_config.json", "vit_config.json"), config_dicts(cfg)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)
