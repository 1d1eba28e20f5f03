"""HF <-> titan_mm tensor names for Qwen3 / Qwen3-MoE, and load/save of local HF directories.

HF names (transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM):
  model.embed_tokens.weight, model.norm.weight, lm_head.weight
  model.layers.{i}.input_layernorm.weight, post_attention_layernorm.weight
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight(/.bias), self_attn.{q,k}_norm.weight
  dense:  model.layers.{i}.mlp.{gate,up,down}_proj.weight
  MoE:    model.layers.{i}.mlp.gate.weight [E, D]
          per-expert (hub layout, what we write):  mlp.experts.{e}.{gate,up,down}_proj.weight
          fused (transformers 5 in-memory layout, also read): mlp.experts.gate_up_proj [E, 2F, D],
                                                              mlp.experts.down_proj [E, D, F]
Titan MoE experts are stacked: w1 = gate [E, F, D], w3 = up [E, F, D], w2 = down [E, D, F].
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

from titan_mm.models import hf_io
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3.model import Qwen3Model

_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.q_proj.bias": "attn.wq.bias",
    "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.bias": "attn.wv.bias",
    "self_attn.o_proj.bias": "attn.wo.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.gate.weight": "moe.router.weight",
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_TOP_MAP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
            "lm_head.weight": "output.weight"}
_TOP_MAP_INV = {v: k for k, v in _TOP_MAP.items()}
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PROJ_TO_W = {"gate": "w1", "up": "w3", "down": "w2"}


def hf_to_titan(sd: dict[str, torch.Tensor], cfg: Qwen3Config) -> dict[str, torch.Tensor]:
    """Rename HF tensors to titan names and stack per-expert weights. Unknown names raise (naming them)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unknown = []
    for k, v in sd.items():
        if k in _TOP_MAP:
            if k == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head (some tied checkpoints still store it)
            out[_TOP_MAP[k]] = v
            continue
        m = _EXPERT_RE.match(k)
        if m:
            experts.setdefault((int(m[1]), _PROJ_TO_W[m[3]]), {})[int(m[2])] = v
            continue
        m = _FUSED_RE.match(k)
        if m:
            i = int(m[1])
            if m[2] == "gate_up_proj":  # [E, 2F, D]: first half gate, second half up
                F_ = v.shape[1] // 2
                out[f"layers.{i}.moe.experts.w1"] = v[:, :F_]
                out[f"layers.{i}.moe.experts.w3"] = v[:, F_:]
            else:
                out[f"layers.{i}.moe.experts.w2"] = v
            continue
        m = _LAYER_RE.match(k)
        if m and m[2] in _LAYER_MAP:
            out[f"layers.{m[1]}.{_LAYER_MAP[m[2]]}"] = v
            continue
        unknown.append(k)
    for (i, w), per in experts.items():
        E = cfg.num_experts
        miss = [e for e in range(E) if e not in per]
        if miss or len(per) != E:
            proj = {v: k for k, v in _PROJ_TO_W.items()}[w]
            raise hf_io.HFCheckpointError(
                f"layer {i}: expert tensors mlp.experts.{{e}}.{proj}_proj.weight missing for experts {miss[:10]} "
                f"(config num_experts={E}, found {len(per)}); check config.json matches the weights"
            )
        shapes = {tuple(t.shape) for t in per.values()}
        if len(shapes) != 1:
            raise hf_io.HFCheckpointError(f"layer {i}: experts' {w} tensors have different shapes {sorted(shapes)}")
        out[f"layers.{i}.moe.experts.{w}"] = torch.stack([per[e] for e in range(E)])
    if unknown:
        raise hf_io.HFCheckpointError(
            f"unexpected tensor(s) for a {cfg.model_type} model: {', '.join(sorted(unknown)[:20])}; "
            "is this the right model type / config.json?"
        )
    return out


def titan_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen3Config, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Titan names -> HF names. Experts are written per expert (the hub layout every transformers version
    reads) unless ``fused_experts``."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k in _TOP_MAP_INV:
            out[_TOP_MAP_INV[k]] = v
            continue
        m = re.match(r"^layers\.(\d+)\.moe\.experts\.(w[123])$", k)
        if m:
            i, w = int(m[1]), m[2]
            if fused_experts:
                if w == "w1":
                    out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
                        [v, sd[f"layers.{i}.moe.experts.w3"]], dim=1)
                elif w == "w2":
                    out[f"model.layers.{i}.mlp.experts.down_proj"] = v
                continue
            proj = {"w1": "gate", "w3": "up", "w2": "down"}[w]
            for e in range(v.shape[0]):
                out[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"] = v[e]
            continue
        m = re.match(r"^layers\.(\d+)\.(.+)$", k)
        if m and m[2] in _LAYER_MAP_INV:
            out[f"model.layers.{m[1]}.{_LAYER_MAP_INV[m[2]]}"] = v
            continue
        raise KeyError(f"titan tensor {k!r} has no HF name in titan_mm/models/qwen3/hf.py")
    return out


def expected_titan_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Titan name -> shape for a config, without building the model."""
    with torch.device("meta"):
        m = Qwen3Model(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def describe(titan_name: str) -> str:
    """'HF name (titan name)' for error messages."""
    m = re.match(r"^layers\.(\d+)\.moe\.experts\.(w[123])$", titan_name)
    if m:
        proj = {"w1": "gate", "w3": "up", "w2": "down"}[m[2]]
        return f"model.layers.{m[1]}.mlp.experts.{{e}}.{proj}_proj.weight (titan {titan_name})"
    m = re.match(r"^layers\.(\d+)\.(.+)$", titan_name)
    if m and m[2] in _LAYER_MAP_INV:
        return f"model.layers.{m[1]}.{_LAYER_MAP_INV[m[2]]} (titan {titan_name})"
    if titan_name in _TOP_MAP_INV:
        return f"{_TOP_MAP_INV[titan_name]} (titan {titan_name})"
    return titan_name


def _check_model_type(hf_cfg: dict, cfg: Qwen3Config, hf_dir, model_type: str | None = None) -> None:
    want = model_type or cfg.model_type  # families built on this decoder (Qwen2) name their own
    mt = hf_cfg.get("model_type")
    if mt != want:
        raise hf_io.HFCheckpointError(
            f"{hf_dir}/config.json has model_type={mt!r} but the model is {want!r}; "
            f"load it with the matching registry entry / flavor (titan_mm.registry.get_model_spec)"
        )


def check_hf_dir(hf_dir: str | os.PathLike, cfg: Qwen3Config, model_type: str | None = None) -> None:
    """Check model_type (``model_type``: another family's, default the config's) and every tensor's name and
    shape without reading tensor data (header only)."""
    _check_model_type(hf_io.read_hf_config(hf_dir), cfg, hf_dir, model_type)
    # the same conversion as the real load, on meta tensors: names, expert stacking and shapes
    meta = {k: torch.empty(shape, device="meta") for k, shape in hf_io.safetensors_shapes(hf_dir).items()}
    got = {k: tuple(v.shape) for k, v in hf_to_titan(meta, cfg).items()}
    hf_io.check_tensors(got, expected_titan_shapes(cfg), str(hf_dir), describe=describe,
                        hint="check that config.json matches the weights (same flavor, tie_word_embeddings, "
                        "num_experts) and that the download is complete")


def _layer_of(hf_name: str) -> int:
    m = re.match(r"^model\.layers\.(\d+)\.", hf_name)
    return int(m[1]) if m else -1


def iter_hf_state_dict(hf_dir: str | os.PathLike, cfg: Qwen3Config):
    """Yield titan-named full CPU tensors one decoder layer at a time (then the embedding / norm / head),
    so loading a large checkpoint never holds more than one layer beyond the model itself."""
    groups: dict[int, list[str]] = {}
    for name in hf_io.safetensors_files(hf_dir):
        groups.setdefault(_layer_of(name), []).append(name)
    for layer in sorted(groups):
        yield hf_to_titan(hf_io.read_safetensors(hf_dir, groups[layer]), cfg)


def read_hf_state_dict(hf_dir: str | os.PathLike, cfg: Qwen3Config, model_type: str | None = None
                       ) -> dict[str, torch.Tensor]:
    """Read a local HF dir into full CPU tensors with titan names, checking model_type, every name and shape."""
    check_hf_dir(hf_dir, cfg, model_type)
    sd: dict[str, torch.Tensor] = {}
    for part in iter_hf_state_dict(hf_dir, cfg):
        sd.update(part)
    return sd


def load_hf(model, hf_dir: str | os.PathLike, model_type: str | None = None) -> None:
    """Load a local HF directory into ``model`` (plain, meta-built, or FSDP-sharded); ``model_type``: the
    config.json's expected one when another family builds this decoder (default: the model config's).

    Names and shapes are checked first from the safetensors headers. An FSDP-sharded model is filled one
    layer at a time through DCP's ``set_model_state_dict(full_state_dict=True)`` (every rank reads the
    files; peak extra memory is one layer); other models load the full state dict strictly."""
    cfg: Qwen3Config = model.cfg
    if hf_io.is_sharded(model):
        check_hf_dir(hf_dir, cfg, model_type)
        for part in iter_hf_state_dict(hf_dir, cfg):
            hf_io.load_full_state_dict(model, part, strict=False)
    else:  # names and shapes checked against the config; a model holding a part (a pipeline stage) takes its own
        sd = read_hf_state_dict(hf_dir, cfg, model_type)
        hf_io.load_full_state_dict(model, {k: sd[k] for k in model.state_dict()})
    if hasattr(model, "init_buffers") and model.rope_inv_freq.is_meta:
        model.init_buffers(model.tok_embeddings.weight.device)


def _titan_layer_of(name: str) -> int:
    m = re.match(r"^layers\.(\d+)\.", name)
    return int(m[1]) if m else -1


def save_hf(model_or_sd, cfg: Qwen3Config, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 1024**3, fused_experts: bool = False) -> None:
    """Write HF safetensors + config.json that transformers' AutoModelForCausalLM loads.

    ``model_or_sd``: a Qwen3Model or a full state dict with titan names. A sharded model (DTensor
    parameters: FSDP / TP / EP) is gathered one decoder layer at a time; the call is collective (every
    rank calls it), rank 0 writes, and host memory stays at about one shard file. ``dtype``: cast on
    export (default: keep)."""
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if isinstance(model_or_sd, torch.nn.Module):
        items = hf_io.iter_full_tensors(model_or_sd)
    else:  # group a plain dict's tensors by layer (stable), whatever order it came in
        items = iter(sorted(dict(model_or_sd).items(), key=lambda kv: _titan_layer_of(kv[0])))
    writer = hf_io.ShardedWriter(out_dir, max_shard_bytes) if rank0 else None
    dt = None

    def flush(group: dict[str, torch.Tensor]) -> None:
        nonlocal dt
        if rank0 and group:
            for k, v in titan_to_hf(group, cfg, fused_experts=fused_experts).items():
                writer.add(k, v)
                dt = v.dtype

    group: dict[str, torch.Tensor] = {}
    group_layer = None
    for name, t in items:  # state dicts list a layer's tensors together: convert one layer at a time
        layer = _titan_layer_of(name)
        if layer != group_layer:
            flush(group)
            group, group_layer = {}, layer
        if rank0:
            group[name] = (t.to(dtype) if dtype is not None else t).detach().to("cpu")
    flush(group)
    if rank0:
        writer.close()
        hf_io.write_config(cfg.to_hf_dict(dtype=str(dt).removeprefix("torch.")), out_dir)
