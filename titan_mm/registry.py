"""Model registry: name -> ModelSpec. A family registers itself with one call to :func:`register`.

Built-in families are registered lazily on first lookup (importing titan_mm.registry stays cheap).
"qwen3" and "qwen3_moe" are the same spec (one config class covers dense and MoE; the flavor or the
HF config.json decides); both names list every Qwen3 flavor.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_cls: type
    flavors: dict[str, Any]
    build: Callable[[Any], Any]
    """build(cfg) -> nn.Module, under the caller's device context (meta in the trainer)."""
    config_from_hf: Callable[..., Any]
    """config_from_hf(hf_dir, **runtime_overrides) -> config."""
    load_hf: Callable[[Any, str], None]
    """load_hf(model, hf_dir): checks names/shapes/model_type, loads full tensors (plain, meta or FSDP model)."""
    save_hf: Callable[..., None]
    """save_hf(model_or_state_dict, cfg, out_dir, dtype=None): safetensors + config.json for transformers."""
    flops: Callable[[Any, Any], float]
    """flops(cfg, doc_lens) -> training FLOPs of a batch with these document lengths (docs/flops.md)."""
    plan: Callable[[Any], Any]
    """plan(cfg) -> titan_mm.parallel.plan.ParallelizePlan."""
    hf_model_types: tuple[str, ...] = ()
    """HF config.json model_type values this spec reads."""

    def flavor(self, name: str):
        if name not in self.flavors:
            raise KeyError(f"model {self.name!r} has no flavor {name!r}; known: {sorted(self.flavors)}")
        return self.flavors[name]


_REGISTRY: dict[str, ModelSpec] = {}
# name -> module whose import registers it (built-in families; others call register() themselves)
_BUILTIN = {
    "qwen3": "titan_mm.models.qwen3",
    "qwen3_moe": "titan_mm.models.qwen3",
    "qwen3_vl": "titan_mm.models.qwen3_vl",
    "qwen3_vl_moe": "titan_mm.models.qwen3_vl",
}


def register(spec: ModelSpec, *aliases: str) -> ModelSpec:
    """Register ``spec`` under its name (and aliases, as copies named after the alias). Re-registering
    the same name replaces it (module reloads)."""
    _REGISTRY[spec.name] = spec
    for a in aliases:
        _REGISTRY[a] = dataclasses.replace(spec, name=a)
    return spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; registered: {sorted(set(_REGISTRY) | set(_BUILTIN))}")
    return _REGISTRY[name]


def spec_for_hf_dir(hf_dir: str) -> ModelSpec:
    """The spec whose hf_model_types contains config.json's model_type."""
    from titan_mm.models.common.hf_io import read_hf_config

    mt = read_hf_config(hf_dir).get("model_type")
    for n in _BUILTIN:
        try:
            get_model_spec(n)
        except (ImportError, KeyError):
            continue
    for spec in _REGISTRY.values():
        if mt in spec.hf_model_types:
            return spec
    raise KeyError(f"no registered model reads model_type={mt!r} ({hf_dir}/config.json)")


def list_models() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))
