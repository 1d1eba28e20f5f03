"""HF <-> titan_mm tensor names for the Qwen2.5-Omni thinker, and load / save of local HF directories.

Stored layout (what the hub files and transformers' save_pretrained hold; a full Omni checkpoint prefixes it with
``thinker.`` and adds ``talker.*`` / ``token2wav.*``, which are skipped with one log line):
  audio_tower.{conv1, conv2, audio_bos_eos_token, ln_post, proj}.*  <->  audio_tower.{same}
  audio_tower.layers.{i}.*                                        <->  audio_tower.blocks.{i}.*
  visual.blocks.{i}.attn.{q, k, v}.{weight, bias}                  <->  visual.blocks.{i}.attn.wqkv.* (head-major rows)
  visual.*, model.{embed_tokens, layers, norm}.*, lm_head.weight   <->  Qwen2.5-VL's map (qwen2_5_vl/hf.py)
transformers' in-memory names (``model.audio_tower.*``, ``model.visual.*``, ``model.language_model.*``) are read
too. save_hf writes the stored layout of a thinker folder.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from titan_mm.models import hf_io
from titan_mm.models.qwen2_5_omni.config import FULL_MODEL_TYPE, MODEL_TYPE, Qwen2_5OmniConfig
from titan_mm.models.qwen2_5_omni.model import Qwen2_5OmniModel
from titan_mm.models.qwen2_5_vl import hf as vl_hf
from titan_mm.models.qwen3_vl import hf as vl3_hf

logger = logging.getLogger(__name__)

_AUDIO = "audio_tower."
_QKV_RE = re.compile(r"^visual\.blocks\.(\d+)\.attn\.(q|k|v)\.(weight|bias)$")
_FUSED_RE = re.compile(r"^visual\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_OTHER_PARTS = ("talker.", "token2wav.")  # a full Omni checkpoint's speech parts


def _audio_name(rest: str, to_titan: bool) -> str:
    a, b = ("layers.", "blocks.") if to_titan else ("blocks.", "layers.")
    return _AUDIO + (b + rest[len(a):] if rest.startswith(a) else rest)


def hf_to_titan(sd: dict[str, torch.Tensor], cfg: Qwen2_5OmniConfig) -> dict[str, torch.Tensor]:
    out, rest, qkv = {}, {}, {}
    for k, v in sd.items():
        stored = k[len("model."):] if k.startswith(("model.audio_tower.", "model.visual.")) else k
        if stored.startswith(_AUDIO):
            out[_audio_name(stored[len(_AUDIO):], to_titan=True)] = v
        elif m := _QKV_RE.match(stored):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = v
        else:
            rest[k] = v
    for (i, kind), parts in qkv.items():  # HF Omni keeps q / k / v apart; Qwen2.5-VL's map reads them fused
        if len(parts) != 3:
            raise hf_io.HFCheckpointError(f"visual.blocks.{i}.attn has only {sorted(parts)} of q / k / v {kind}s")
        rest[f"visual.blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return {**vl_hf.hf_to_titan(rest, cfg), **out}


def titan_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen2_5OmniConfig) -> dict[str, torch.Tensor]:
    """Titan names -> a thinker folder's stored layout."""
    out = {_audio_name(k[len(_AUDIO):], to_titan=False): v for k, v in sd.items() if k.startswith(_AUDIO)}
    for k, v in vl_hf.titan_to_hf({k: v for k, v in sd.items() if not k.startswith(_AUDIO)}, cfg).items():
        if m := _FUSED_RE.match(k):
            for part, t in zip("qkv", v.chunk(3, 0)):
                out[f"visual.blocks.{m[1]}.attn.{part}.{m[2]}"] = t.contiguous()
        else:
            out[k] = v
    return out


def describe(titan_name: str) -> str:
    if titan_name.startswith(_AUDIO):
        return f"{_audio_name(titan_name[len(_AUDIO):], to_titan=False)} (titan {titan_name})"
    return vl3_hf.describe(titan_name).replace(".attn.qkv.", ".attn.{q,k,v}.")


def expected_titan_shapes(cfg: Qwen2_5OmniConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = Qwen2_5OmniModel(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def read_hf_state_dict(hf_dir: str | os.PathLike, cfg: Qwen2_5OmniConfig) -> dict[str, torch.Tensor]:
    """A local thinker or full Omni folder as full CPU tensors with titan names (talker / token2wav skipped and
    logged); model_type, every name and shape checked."""
    mt = hf_io.read_hf_config(hf_dir).get("model_type")
    if mt not in (MODEL_TYPE, FULL_MODEL_TYPE):
        raise hf_io.HFCheckpointError(f"{hf_dir}/config.json has model_type={mt!r} but the model is a Qwen2.5-Omni "
                                      f"thinker ({MODEL_TYPE!r} or {FULL_MODEL_TYPE!r}); use the registry entry for it "
                                      "(spec_for_hf_dir).")
    sd = hf_to_titan(hf_io.read_thinker(hf_dir, _OTHER_PARTS, logger), cfg)
    hf_io.check_tensors({k: tuple(v.shape) for k, v in sd.items()}, expected_titan_shapes(cfg), str(hf_dir),
                        describe=describe,
                        hint="check that config.json matches the weights (same flavor, tie_word_embeddings, vision "
                        "depth, audio encoder_layers) and that the download is complete")
    return sd


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a local HF directory into ``model`` (plain, meta-built, or FSDP-sharded)."""
    sd = read_hf_state_dict(hf_dir, model.cfg)
    hf_io.load_full_state_dict(model, {k: sd[k] for k in model.state_dict()})
    if any(b.is_meta for b in model.buffers()):  # non-persistent buffers (rope, audio positions) of a meta build
        model.init_buffers(model.language_model.tok_embeddings.weight.device)


def save_hf(model_or_sd, cfg: Qwen2_5OmniConfig, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write a thinker folder (safetensors + config.json) that transformers'
    Qwen2_5OmniThinkerForConditionalGeneration loads (collective for a sharded model: every rank calls it)."""
    hf_io.save_hf_folder(model_or_sd, cfg, out_dir, titan_to_hf, dtype, max_shard_bytes)
