"""HF <-> titan_mm tensor names for the Qwen3-Omni-MoE thinker, and load / save of local HF directories.

Stored layout (what the hub files and transformers' save_pretrained hold; a full Omni checkpoint prefixes it with
``thinker.`` and adds ``talker.*`` / ``code2wav.*``, which are skipped with one log line):
  audio_tower.{conv2d1..3, conv_out, ln_post, proj1, proj2}.*    <->  audio_tower.{same}
  audio_tower.layers.{i}.*                                       <->  audio_tower.blocks.{i}.*
  visual.merger.{ln_q, mlp.0, mlp.2}.*                           <->  visual.merger.{norm, linear_fc1, linear_fc2}.*
  visual.merger_list.{j}.{ln_q, mlp.0, mlp.2}.*                  <->  visual.deepstack_merger_list.{j}.{same as above}
  visual.* (the rest)                                            <->  Qwen3-VL's map (qwen3_vl/hf.py: Conv3d patch
                                                                      embedding, head-major fused qkv rows)
  model.{embed_tokens, layers, norm}.*, lm_head.weight           <->  language_model.*: Qwen3-MoE's map
                                                                      (qwen3/hf.py; per-expert or fused experts)
transformers' in-memory names (``model.audio_tower.*``, ``model.visual.*``, ``model.language_model.*``) are read
too. save_hf writes the stored layout of a thinker folder, experts per expert (what transformers' qwen2_moe
conversion reads).
"""

from __future__ import annotations

import logging
import os
import re

import torch

from titan_mm.models import hf_io
from titan_mm.models.qwen3 import hf as qwen3_hf
from titan_mm.models.qwen3_omni_moe.config import FULL_MODEL_TYPE, MODEL_TYPE, Qwen3OmniMoeConfig
from titan_mm.models.qwen3_omni_moe.model import Qwen3OmniMoeModel
from titan_mm.models.qwen3_vl import hf as vl_hf

logger = logging.getLogger(__name__)

_AUDIO = "audio_tower."
_OTHER_PARTS = ("talker.", "code2wav.")  # a full Omni checkpoint's speech parts
_HF_MERGER = {"ln_q": "norm", "mlp.0": "linear_fc1", "mlp.2": "linear_fc2"}  # HF merger parts -> Qwen3-VL's
_TO_VL = re.compile(r"^(merger|merger_list\.(\d+))\.(ln_q|mlp\.0|mlp\.2)\.(\w+)$")
_TO_HF = re.compile(r"^(merger|deepstack_merger_list\.(\d+))\.(norm|linear_fc1|linear_fc2)\.(\w+)$")


def _merger_name(rest: str, to_titan: bool) -> str:
    """A ``visual.``-relative name with the merger parts renamed between HF's and Qwen3-VL's (others unchanged)."""
    m = (_TO_VL if to_titan else _TO_HF).match(rest)
    if m is None:
        return rest
    part = _HF_MERGER[m[3]] if to_titan else {v: k for k, v in _HF_MERGER.items()}[m[3]]
    head = "merger" if m[2] is None else (f"deepstack_merger_list.{m[2]}" if to_titan else f"merger_list.{m[2]}")
    return f"{head}.{part}.{m[4]}"


def _audio_name(rest: str, to_titan: bool) -> str:
    a, b = ("layers.", "blocks.") if to_titan else ("blocks.", "layers.")
    return _AUDIO + (b + rest[len(a):] if rest.startswith(a) else rest)


def hf_to_titan(sd: dict[str, torch.Tensor], cfg: Qwen3OmniMoeConfig) -> dict[str, torch.Tensor]:
    """A thinker's HF tensors (stored or in-memory names, ``thinker.`` already removed) -> titan names."""
    out, vl = {}, {}
    for k, v in sd.items():
        stored = k[len("model."):] if k.startswith(("model.audio_tower.", "model.visual.")) else k
        if stored.startswith(_AUDIO):
            out[_audio_name(stored[len(_AUDIO):], to_titan=True)] = v
        elif stored.startswith("visual."):
            vl["model.visual." + _merger_name(stored[len("visual."):], to_titan=True)] = v
        elif k.startswith("model.") and not k.startswith("model.language_model."):
            vl["model.language_model." + k[len("model."):]] = v
        else:
            vl[k] = v
    return {**vl_hf.hf_to_titan(vl, cfg), **out}


def titan_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen3OmniMoeConfig) -> dict[str, torch.Tensor]:
    """Titan names -> a thinker folder's stored layout."""
    out = {}
    vis, text = {}, {}
    for k, v in sd.items():
        if k.startswith(_AUDIO):
            out[_audio_name(k[len(_AUDIO):], to_titan=False)] = v
        elif k.startswith("visual."):
            vis[k] = v
        elif k.startswith("language_model."):
            text[k[len("language_model."):]] = v
        else:
            raise KeyError(f"titan tensor {k!r} has no HF name in titan_mm/models/qwen3_omni_moe/hf.py")
    for k, v in vl_hf.titan_to_hf(vis, cfg).items():  # the ViT part only: "model.visual.*"
        out["visual." + _merger_name(k[len("model.visual."):], to_titan=False)] = v
    out.update(qwen3_hf.titan_to_hf(text, cfg.text))  # "model.*" / "lm_head.weight", experts per expert
    return out


def describe(titan_name: str) -> str:
    if titan_name.startswith(_AUDIO):
        return f"{_audio_name(titan_name[len(_AUDIO):], to_titan=False)} (titan {titan_name})"
    if titan_name.startswith("visual."):
        rest = vl_hf.describe(titan_name).removeprefix("model.visual.")
        return "visual." + _merger_name(rest, to_titan=False)
    if titan_name.startswith("language_model."):
        return qwen3_hf.describe(titan_name[len("language_model."):])
    return titan_name


def expected_titan_shapes(cfg: Qwen3OmniMoeConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = Qwen3OmniMoeModel(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def read_hf_state_dict(hf_dir: str | os.PathLike, cfg: Qwen3OmniMoeConfig) -> dict[str, torch.Tensor]:
    """A local thinker or full Omni folder as full CPU tensors with titan names (talker / code2wav skipped and
    logged in one line); model_type, every name and shape checked."""
    mt = hf_io.read_hf_config(hf_dir).get("model_type")
    if mt not in (MODEL_TYPE, FULL_MODEL_TYPE):
        raise hf_io.HFCheckpointError(f"{hf_dir}/config.json has model_type={mt!r} but the model is a Qwen3-Omni-MoE "
                                      f"thinker ({MODEL_TYPE!r} or {FULL_MODEL_TYPE!r}); use the registry entry for "
                                      "it (spec_for_hf_dir).")
    sd = hf_to_titan(hf_io.read_thinker(hf_dir, _OTHER_PARTS, logger), cfg)
    hf_io.check_tensors({k: tuple(v.shape) for k, v in sd.items()}, expected_titan_shapes(cfg), str(hf_dir),
                        describe=describe,
                        hint="check that config.json matches the weights (same flavor, num_experts, vision depth / "
                        "deepstack_visual_indexes, audio encoder_layers) and that the download is complete")
    return sd


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a local HF directory into ``model`` (plain, meta-built, or FSDP-sharded)."""
    sd = read_hf_state_dict(hf_dir, model.cfg)
    hf_io.load_full_state_dict(model, {k: sd[k] for k in model.state_dict()})  # a pipeline stage holds a part
    if any(b.is_meta for b in model.buffers()):  # non-persistent buffers (rope, audio positions) of a meta build
        model.init_buffers(model.language_model.tok_embeddings.weight.device)


def save_hf(model_or_sd, cfg: Qwen3OmniMoeConfig, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write a thinker folder (safetensors + config.json) that transformers'
    Qwen3OmniMoeThinkerForConditionalGeneration loads (collective for a sharded model: every rank calls it)."""
    hf_io.save_hf_folder(model_or_sd, cfg, out_dir, titan_to_hf, dtype, max_shard_bytes)
