"""Qwen2.5-VL (HF Qwen2_5_VLForConditionalGeneration, model_type "qwen2_5_vl"). Importing registers "qwen2_5_vl".

The Qwen2 decoder with chunked M-RoPE, and the window-attention ViT of vision.py; the model, the visual-token
scatter, freezing and per-part learning rates are Qwen3-VL's (titan_mm/models/qwen3_vl), imported."""

from titan_mm.models.qwen2_5_vl import flops, hf, memory, plan, spec
from titan_mm.models.qwen2_5_vl.config import FLAVORS, Qwen2_5_VLConfig, VisionConfig
from titan_mm.models.qwen2_5_vl.model import Qwen2_5_VLModel, build, prepare_batch
from titan_mm.models.qwen3_vl.model import param_groups
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    register(ModelSpec(name="qwen2_5_vl", config_cls=Qwen2_5_VLConfig, flavors=FLAVORS, build=build,
                       config_from_hf=Qwen2_5_VLConfig.from_hf, load_hf=hf.load_hf, save_hf=hf.save_hf,
                       flops=flops.flops, plan=plan.plan, dims=spec.dims, runtime=spec.runtime,
                       with_runtime=spec.with_runtime, data_needs=spec.data_needs, kernel_shapes=spec.kernel_shapes,
                       memory_terms=memory.memory_terms, prepare_batch=prepare_batch, seq_keys=("visual_index",),
                       param_groups=param_groups, fused_params=spec.fused_params, hf_model_types=("qwen2_5_vl",)))


_register()

__all__ = ["FLAVORS", "Qwen2_5_VLConfig", "Qwen2_5_VLModel", "VisionConfig", "build", "prepare_batch"]
