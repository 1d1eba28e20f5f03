"""HF <-> titan_mm tensor names for Qwen3.5 / Qwen3.5-MoE, and load / save of local HF folders.

HF names (transformers Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration):
  model.visual.*                                             Qwen3-VL's tower names (titan_mm/models/qwen3_vl/hf.py)
  model.language_model.{embed_tokens, norm}.weight, lm_head.weight, and per layer i, under
  model.language_model.layers.{i}.:
    input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
    mlp.{gate,up,down}_proj, mlp.gate (router)              Qwen3's names (titan_mm/models/qwen3/hf.py)
    mlp.experts.{gate_up_proj [E, 2F, D], down_proj [E, D, F]} (transformers' layout; the [1, 2] transposes and
        per-expert mlp.experts.{e}.{gate,up,down}_proj.weight are read too)
    mlp.shared_expert.{gate,up,down}_proj.weight          <-> moe.shared_expert.{w1,w3,w2}.weight
    mlp.shared_expert_gate.weight                          <-> moe.shared_expert_gate.weight
    linear_attn.in_proj_qkv.weight [2 Hk Dk + Hv Dv, D], rows (q of every key head, k of every key head, v of
        every value head)                                  <-> linear_attn.in_proj_qkv.weight, rows per key head
                                                               (its q, its k, the v of its Hv/Hk value heads)
    linear_attn.conv1d.weight [C, 1, W]                    <-> linear_attn.in_proj_qkv.conv_weight [C, W], same
                                                               row order as in_proj_qkv
    linear_attn.dt_bias, linear_attn.A_log [Hv]            <-> linear_attn.in_proj_a.dt_bias, .A_log
    linear_attn.{in_proj_z, in_proj_b, in_proj_a, norm, out_proj}.weight   <-> the same names
  mtp.*: the multi-token-prediction head of the released checkpoints; not part of the model, skipped on load.
"""

from __future__ import annotations

import os
import re

import torch

from titan_mm.models import hf_io
from titan_mm.models.qwen3 import hf as qwen3_hf
from titan_mm.models.qwen3_5.config import Qwen3_5Config
from titan_mm.models.qwen3_5.model import Qwen3_5Model
from titan_mm.models.qwen3_vl import hf as vl_hf

_LM = "model.language_model."
_LIN_RE = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(.+)$")
_SHARED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(shared_expert\.(gate|up|down)_proj|shared_expert_gate)\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_T_LIN_RE = re.compile(r"^layers\.(\d+)\.linear_attn\.(.+)$")
_T_SHARED_RE = re.compile(r"^layers\.(\d+)\.moe\.(shared_expert\.w[123]|shared_expert_gate)\.weight$")
_LIN_NAMES = {  # HF linear_attn.<name> -> titan linear_attn.<name> (conv1d and the rows of in_proj_qkv: see below)
    "in_proj_qkv.weight": "in_proj_qkv.weight", "conv1d.weight": "in_proj_qkv.conv_weight",
    "dt_bias": "in_proj_a.dt_bias", "A_log": "in_proj_a.A_log", "in_proj_z.weight": "in_proj_z.weight",
    "in_proj_b.weight": "in_proj_b.weight", "in_proj_a.weight": "in_proj_a.weight", "norm.weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
}
_LIN_NAMES_INV = {v: k for k, v in _LIN_NAMES.items()}
_SHARED = {"shared_expert.gate_proj": "shared_expert.w1", "shared_expert.up_proj": "shared_expert.w3",
           "shared_expert.down_proj": "shared_expert.w2", "shared_expert_gate": "shared_expert_gate"}
_SHARED_INV = {v: k for k, v in _SHARED.items()}


def qkv_row_order(cfg: Qwen3_5Config) -> torch.Tensor:
    """titan row r of in_proj_qkv (and of the conv) is HF row ``order[r]``: per key head h, its q rows, its k rows,
    then the v rows of value heads h*Hv/Hk .. (h+1)*Hv/Hk - 1."""
    t = cfg.text
    Hk, dk, dv, r = t.linear_num_key_heads, t.linear_key_head_dim, t.linear_value_head_dim, \
        t.linear_num_value_heads // t.linear_num_key_heads
    kd = Hk * dk
    rows = []
    for h in range(Hk):
        rows += [torch.arange(h * dk, (h + 1) * dk), kd + torch.arange(h * dk, (h + 1) * dk),
                 2 * kd + torch.arange(h * r * dv, (h + 1) * r * dv)]
    return torch.cat(rows)


def _inmem_shape(kind: str, cfg: Qwen3_5Config) -> tuple[int, int, int]:
    E, D, F_ = cfg.text.num_experts, cfg.text.hidden_size, cfg.text.moe_intermediate_size
    return (E, 2 * F_, D) if kind == "gate_up_proj" else (E, D, F_)


def hf_to_titan(sd: dict[str, torch.Tensor], cfg: Qwen3_5Config) -> dict[str, torch.Tensor]:
    """Rename (and re-order) HF tensors to titan names; ``mtp.*`` is dropped, other unknown names raise."""
    vis = {k: v for k, v in sd.items() if k.startswith("model.visual.")}
    out = {k: v for k, v in vl_hf.hf_to_titan(vis, cfg).items()}  # the ViT's names; no text tensors in it
    order = qkv_row_order(cfg)
    text: dict[str, torch.Tensor] = {}
    unknown = []
    for k, v in sd.items():
        if k in vis or k.startswith("mtp."):
            continue
        if k == "lm_head.weight":
            text[k] = v
            continue
        if not k.startswith(_LM):
            unknown.append(k)
            continue
        tk = "model." + k[len(_LM):]
        if (m := _LIN_RE.match(tk)) and m[2] in _LIN_NAMES:
            name = _LIN_NAMES[m[2]]
            if m[2] == "conv1d.weight":
                v = v.reshape(v.shape[0], -1)
            if name.startswith("in_proj_qkv.") and v.shape[0] == order.numel():  # else the shape check names it
                v = v[order]
            out[f"language_model.layers.{m[1]}.linear_attn.{name}"] = v
        elif m := _SHARED_RE.match(tk):
            out[f"language_model.layers.{m[1]}.moe.{_SHARED[m[2]]}.weight"] = v
        else:
            if (m := _FUSED_RE.match(tk)) and tuple(v.shape) != _inmem_shape(m[2], cfg):
                v = v.transpose(1, 2)  # the [E, D, 2F] / [E, F, D] layout -> transformers' in-memory one
            text[tk] = v
    if unknown:
        raise hf_io.HFCheckpointError(f"unexpected tensor(s) for a {cfg.model_type} model: "
                                      f"{', '.join(sorted(unknown)[:20])}; is this the right model type / config.json?")
    try:
        for k, v in qwen3_hf.hf_to_titan(text, cfg.text).items():  # embeddings, norms, attention, MLP / MoE names
            out["language_model." + k] = v
    except hf_io.HFCheckpointError as e:
        raise hf_io.HFCheckpointError(str(e).replace("model.layers.", _LM + "layers.")) from None
    return {k: v.contiguous() for k, v in out.items()}


def titan_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen3_5Config) -> dict[str, torch.Tensor]:
    inv = torch.argsort(qkv_row_order(cfg))
    out = vl_hf.titan_to_hf({k: v for k, v in sd.items() if k.startswith("visual.")}, cfg)
    text: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith("visual."):
            continue
        if not k.startswith("language_model."):
            raise KeyError(f"titan tensor {k!r} has no HF name in titan_mm/models/qwen3_5/hf.py")
        tk = k[len("language_model."):]
        if (m := _T_LIN_RE.match(tk)) and m[2] in _LIN_NAMES_INV:
            if m[2].startswith("in_proj_qkv."):
                v = v[inv]
            if m[2] == "in_proj_qkv.conv_weight":
                v = v[:, None]
            out[f"{_LM}layers.{m[1]}.linear_attn.{_LIN_NAMES_INV[m[2]]}"] = v
        elif m := _T_SHARED_RE.match(tk):
            out[f"{_LM}layers.{m[1]}.mlp.{_SHARED_INV[m[2]]}.weight"] = v
        else:
            text[tk] = v
    for k, v in qwen3_hf.titan_to_hf(text, cfg.text, fused_experts=True).items():
        out[_LM + k[len("model."):] if k.startswith("model.") else k] = v
    return {k: v.contiguous() for k, v in out.items()}


def expected_titan_shapes(cfg: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = Qwen3_5Model(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def describe(titan_name: str) -> str:
    """'HF name (titan name)' for error messages."""
    if m := re.match(r"^language_model\.layers\.(\d+)\.linear_attn\.(.+)$", titan_name):
        if m[2] in _LIN_NAMES_INV:
            return f"{_LM}layers.{m[1]}.linear_attn.{_LIN_NAMES_INV[m[2]]} (titan {titan_name})"
    if m := re.match(r"^language_model\.layers\.(\d+)\.moe\.(shared_expert\.w[123]|shared_expert_gate)\.weight$",
                     titan_name):
        return f"{_LM}layers.{m[1]}.mlp.{_SHARED_INV[m[2]]}.weight (titan {titan_name})"
    return vl_hf.describe(titan_name)


def read_hf_state_dict(hf_dir: str | os.PathLike, cfg: Qwen3_5Config) -> dict[str, torch.Tensor]:
    """A local HF folder as full CPU tensors with titan names; model_type, every name and shape checked."""
    mt = hf_io.read_hf_config(hf_dir).get("model_type")
    if mt != cfg.model_type:
        raise hf_io.HFCheckpointError(
            f"{hf_dir}/config.json has model_type={mt!r} but the model is {cfg.model_type!r}; use model.name "
            "qwen3_5 for dense and qwen3_5_moe for MoE checkpoints (or spec_for_hf_dir)")
    sd = hf_to_titan(hf_io.read_safetensors(hf_dir), cfg)
    hf_io.check_tensors({k: tuple(v.shape) for k, v in sd.items()}, expected_titan_shapes(cfg), str(hf_dir),
                        describe=describe,
                        hint="check that config.json matches the weights (same flavor, tie_word_embeddings, "
                        "num_experts, layer_types, linear_* head counts) and that the download is complete")
    return sd


def load_hf(model, hf_dir: str | os.PathLike) -> None:
    """Load a local HF folder into ``model`` (plain, meta-built or FSDP-sharded)."""
    hf_io.load_full_state_dict(model, read_hf_state_dict(hf_dir, model.cfg))
    lm = model.language_model
    if lm.rope_inv_freq.is_meta:
        lm.init_buffers(lm.tok_embeddings.weight.device)


def save_hf(model_or_sd, cfg: Qwen3_5Config, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write safetensors + config.json that transformers' Qwen3_5(Moe)ForConditionalGeneration loads.
    ``model_or_sd``: a Qwen3_5Model (a sharded one too: collective, every rank calls it, rank 0 writes) or a full
    state dict with titan names."""
    hf_io.save_hf_folder(model_or_sd, cfg, out_dir, titan_to_hf, dtype, max_shard_bytes)
