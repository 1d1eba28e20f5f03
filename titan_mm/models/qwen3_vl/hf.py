"""HF <-> titan_mm tensor names for Qwen3-VL / Qwen3-VL-MoE, and load/save of local HF directories.

HF names (transformers Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration, and the
released checkpoints):
  model.visual.patch_embed.proj.weight [Dv, C, T, ps, ps] (Conv3d)  <->  visual.patch_embed.weight [Dv, C*T*ps*ps]
  model.visual.patch_embed.proj.bias                                <->  visual.patch_embed.bias
  model.visual.blocks.{i}.attn.qkv.{weight,bias} [3 Dv(, Dv)], rows (3, H, Dh)  <->  visual.blocks.{i}.attn.wqkv.*,
      rows (H, 3, Dh): head-major, so that tensor parallelism splits the fused projection by heads
  model.visual.{pos_embed, blocks.*, merger.*, deepstack_merger_list.*}  <->  visual.{same}
  model.language_model.{embed_tokens, layers.*, norm}.*, lm_head.weight  <->  language_model.* (the Qwen3
      text names of titan_mm/models/qwen3/hf.py with "model." -> "model.language_model.")
  MoE experts are fused: mlp.experts.gate_up_proj and mlp.experts.down_proj. The released checkpoints
  store them as [E, D, 2F] / [E, F, D]; transformers 5 keeps [E, 2F, D] / [E, D, F] in memory and loads
  either (it transposes when the shape does not match, as we do). We write the released layout (what
  vLLM and every transformers version read), except where the two layouts have the same shape (D == 2F
  or D == F): then transformers cannot tell them apart and assumes its in-memory layout, so we write that.

The Conv3d has kernel == stride, so it is exactly a Linear over the flattened (C, T, ps, ps) patch; the
reshape of its weight is lossless (tests/parity/test_qwen3_vl_parity.py checks the equivalence).
"""

from __future__ import annotations

import os
import re

import torch
from einops import rearrange

from titan_mm.models import hf_io
from titan_mm.models.qwen3 import hf as qwen3_hf
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig
from titan_mm.models.qwen3_vl.model import Qwen3VLModel

_VIS = "model.visual."
_LM = "model.language_model."
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_QKV_RE = re.compile(r"^blocks\.(\d+)\.attn\.(qkv|wqkv)\.(weight|bias)$")


def _qkv_rows(v: torch.Tensor, heads: int, to_titan: bool) -> torch.Tensor:
    """Reorder the rows of the ViT's fused q/k/v weight / bias: HF (3, H, Dh) <-> titan (H, 3, Dh)."""
    a, b = (3, heads) if to_titan else (heads, 3)
    return rearrange(v, "(a b dh) ... -> (b a dh) ...", a=a, b=b).contiguous()


def _inmem_shape(kind: str, cfg: Qwen3VLConfig) -> tuple[int, int, int]:
    E, D, F_ = cfg.text.num_experts, cfg.text.hidden_size, cfg.text.moe_intermediate_size
    return (E, 2 * F_, D) if kind == "gate_up_proj" else (E, D, F_)


def hf_to_titan(sd: dict[str, torch.Tensor], cfg: Qwen3VLConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    text: dict[str, torch.Tensor] = {}
    unknown = []
    for k, v in sd.items():
        if k.startswith(_VIS):
            rest = k[len(_VIS):]
            if rest == "patch_embed.proj.weight":
                if v.dim() != 5:
                    raise hf_io.HFCheckpointError(f"{k} should be a Conv3d weight [D, C, T, ps, ps], got {tuple(v.shape)}")
                out["visual.patch_embed.weight"] = v.reshape(v.shape[0], -1)
            elif rest == "patch_embed.proj.bias":
                out["visual.patch_embed.bias"] = v
            elif (m := _QKV_RE.match(rest)) and m[2] == "qkv":
                out[f"visual.blocks.{m[1]}.attn.wqkv.{m[3]}"] = _qkv_rows(v, cfg.vision.num_heads, to_titan=True)
            else:
                out["visual." + rest] = v
        elif k.startswith(_LM):
            tk = "model." + k[len(_LM):]
            m = _FUSED_RE.match(tk)
            if m:
                want = _inmem_shape(m[2], cfg)
                if tuple(v.shape) != want:
                    if tuple(v.transpose(1, 2).shape) != want:
                        raise hf_io.HFCheckpointError(
                            f"{k} has shape {tuple(v.shape)}; expected {want} or its [1, 2] transpose for "
                            f"num_experts={cfg.text.num_experts}, hidden_size={cfg.text.hidden_size}, "
                            f"moe_intermediate_size={cfg.text.moe_intermediate_size}; check config.json")
                    v = v.transpose(1, 2)  # released layout -> transformers' in-memory layout
            text[tk] = v
        elif k == "lm_head.weight":
            text[k] = v
        else:
            unknown.append(k)
    if unknown:
        raise hf_io.HFCheckpointError(
            f"unexpected tensor(s) for a {cfg.model_type} model: {', '.join(sorted(unknown)[:20])}; "
            "is this the right model type / config.json?")
    for k, v in qwen3_hf.hf_to_titan(text, cfg.text).items():
        out["language_model." + k] = v.contiguous() if not v.is_contiguous() else v
    return out


def titan_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen3VLConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    text: dict[str, torch.Tensor] = {}
    v_cfg = cfg.vision
    for k, v in sd.items():
        if k == "visual.patch_embed.weight":
            out[_VIS + "patch_embed.proj.weight"] = v.reshape(
                v.shape[0], v_cfg.in_channels, v_cfg.temporal_patch_size, v_cfg.patch_size, v_cfg.patch_size)
        elif k == "visual.patch_embed.bias":
            out[_VIS + "patch_embed.proj.bias"] = v
        elif (m := _QKV_RE.match(k[len("visual."):])) and m[2] == "wqkv":
            out[f"{_VIS}blocks.{m[1]}.attn.qkv.{m[3]}"] = _qkv_rows(v, v_cfg.num_heads, to_titan=False)
        elif k.startswith("visual."):
            out[_VIS + k[len("visual."):]] = v
        elif k.startswith("language_model."):
            text[k[len("language_model."):]] = v
        else:
            raise KeyError(f"titan tensor {k!r} has no HF name in titan_mm/models/qwen3_vl/hf.py")
    for k, v in qwen3_hf.titan_to_hf(text, cfg.text, fused_experts=True).items():
        m = _FUSED_RE.match(k)
        if m and tuple(v.transpose(1, 2).shape) != tuple(v.shape):
            v = v.transpose(1, 2).contiguous()  # write the released layout when it is unambiguous
        out[_LM + k[len("model."):] if k.startswith("model.") else k] = v
    return out


def expected_titan_shapes(cfg: Qwen3VLConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = Qwen3VLModel(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def describe(titan_name: str) -> str:
    if titan_name.startswith("visual."):
        rest = titan_name[len("visual."):]
        if (m := _QKV_RE.match(rest)) and m[2] == "wqkv":
            rest = f"blocks.{m[1]}.attn.qkv.{m[3]}"
        return f"{_VIS}{rest} (titan {titan_name})"
    if titan_name.startswith("language_model."):
        d = qwen3_hf.describe(titan_name[len("language_model."):])
        return d.replace("model.", _LM, 1) if d.startswith("model.") else d
    return titan_name


def read_hf_state_dict(hf_dir: str | os.PathLike, cfg: Qwen3VLConfig) -> dict[str, torch.Tensor]:
    """Read a local HF dir into full CPU tensors with titan names, checking model_type, every name and shape."""
    hf_cfg = hf_io.read_hf_config(hf_dir)
    if hf_cfg.get("model_type") != cfg.model_type:
        raise hf_io.HFCheckpointError(
            f"{hf_dir}/config.json has model_type={hf_cfg.get('model_type')!r} but the model is {cfg.model_type!r}; "
            "use model.name qwen3_vl for dense and qwen3_vl_moe for MoE checkpoints (or spec_for_hf_dir).")
    sd = hf_to_titan(hf_io.read_safetensors(hf_dir), cfg)
    hf_io.check_tensors({k: tuple(v.shape) for k, v in sd.items()}, expected_titan_shapes(cfg), str(hf_dir),
                        describe=describe,
                        hint="check that config.json matches the weights (same flavor, tie_word_embeddings, "
                        "num_experts, vision depth / deepstack_visual_indexes) and that the download is complete")
    return sd


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a local HF directory into ``model`` (plain, meta-built, or FSDP-sharded)."""
    sd = read_hf_state_dict(hf_dir, model.cfg)  # every name and shape checked against the config
    hf_io.load_full_state_dict(model, {k: sd[k] for k in model.state_dict()})  # a pipeline stage holds a part
    lm = model.language_model
    if lm.rope_inv_freq.is_meta:
        lm.init_buffers(lm.tok_embeddings.weight.device)


def save_hf(model_or_sd, cfg: Qwen3VLConfig, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write HF safetensors + config.json that transformers' Qwen3VL(Moe)ForConditionalGeneration loads.
    ``model_or_sd``: a Qwen3VLModel (FSDP-sharded is fine: collective, call on every rank, rank 0 writes)
    or a full state dict with titan names."""
    hf_io.save_hf_folder(model_or_sd, cfg, out_dir, titan_to_hf, dtype, max_shard_bytes)
