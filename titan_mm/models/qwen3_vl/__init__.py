"""Qwen3-VL and Qwen3-VL-MoE. Importing registers "qwen3_vl" (dense flavors) and "qwen3_vl_moe" (MoE flavors);
both read either kind of HF config.json."""

from titan_mm.models.qwen3_vl import flops, hf, memory, plan, spec
from titan_mm.models.qwen3_vl.config import FLAVORS, MOE_FLAVORS, Qwen3VLConfig, VisionConfig
from titan_mm.models.qwen3_vl.model import Qwen3VLModel, build, param_groups, prepare_batch
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    common = dict(config_cls=Qwen3VLConfig, build=build, config_from_hf=Qwen3VLConfig.from_hf, load_hf=hf.load_hf,
                  save_hf=hf.save_hf, flops=flops.flops, plan=plan.plan, dims=spec.dims, runtime=spec.runtime,
                  with_runtime=spec.with_runtime, data_needs=spec.data_needs, kernel_shapes=spec.kernel_shapes,
                  memory_terms=memory.memory_terms, prepare_batch=prepare_batch, seq_keys=("visual_index",),
                  param_groups=param_groups, fused_params=spec.fused_params, encoder_balance=True)
    register(ModelSpec(name="qwen3_vl", flavors=FLAVORS, hf_model_types=("qwen3_vl",), **common))
    register(ModelSpec(name="qwen3_vl_moe", flavors=MOE_FLAVORS, hf_model_types=("qwen3_vl_moe",), **common))


_register()

__all__ = ["FLAVORS", "MOE_FLAVORS", "Qwen3VLConfig", "Qwen3VLModel", "VisionConfig", "build", "param_groups",
           "prepare_batch"]
