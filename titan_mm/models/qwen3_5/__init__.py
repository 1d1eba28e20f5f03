"""Qwen3.5 and Qwen3.5-MoE: hybrid Gated DeltaNet + gated attention decoders under the Qwen3-VL vision tower (without
DeepStack). Importing registers "qwen3_5" (dense flavors) and "qwen3_5_moe" (MoE flavors); both read either kind of
HF config.json. docs/qwen3_5.md says what differs from Qwen3-VL."""

from titan_mm.models.qwen3_5 import flops, hf, memory, plan, spec
from titan_mm.models.qwen3_5.config import FLAVORS, MOE_FLAVORS, Qwen3_5Config, Qwen3_5TextConfig
from titan_mm.models.qwen3_5.model import Qwen3_5Model, build, param_groups, prepare_batch
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    common = dict(config_cls=Qwen3_5Config, build=build, config_from_hf=Qwen3_5Config.from_hf, load_hf=hf.load_hf,
                  save_hf=hf.save_hf, flops=flops.flops, plan=plan.plan, dims=spec.dims, runtime=spec.runtime,
                  with_runtime=spec.with_runtime, data_needs=spec.data_needs, kernel_shapes=spec.kernel_shapes,
                  memory_terms=memory.memory_terms, prepare_batch=prepare_batch, seq_keys=("visual_index",),
                  param_groups=param_groups, fused_params=spec.fused_params)
    register(ModelSpec(name="qwen3_5", flavors=FLAVORS, hf_model_types=("qwen3_5",), **common))
    register(ModelSpec(name="qwen3_5_moe", flavors=MOE_FLAVORS, hf_model_types=("qwen3_5_moe",), **common))


_register()

__all__ = ["FLAVORS", "MOE_FLAVORS", "Qwen3_5Config", "Qwen3_5Model", "Qwen3_5TextConfig", "build", "param_groups",
           "prepare_batch"]
