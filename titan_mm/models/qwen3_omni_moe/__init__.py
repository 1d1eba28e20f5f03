"""Qwen3-Omni-MoE thinker (HF Qwen3OmniMoeThinkerForConditionalGeneration, model_type "qwen3_omni_moe_thinker"; a
full "qwen3_omni_moe" checkpoint loads its thinker). Importing registers "qwen3_omni_moe".

Qwen3-VL-MoE's model (titan_mm/models/qwen3_vl: the Qwen3-MoE decoder, the DeepStack ViT, interleaved M-RoPE) plus
the Qwen3-Omni audio encoder of audio.py and HF's Qwen3-Omni positions built on the host (model.prepare_batch).
Batch keys: model.py's docstring."""

from titan_mm.models.qwen3_omni_moe import flops, hf, memory, plan, spec
from titan_mm.models.qwen3_omni_moe.config import FLAVORS, AudioConfig, Qwen3OmniMoeConfig
from titan_mm.models.qwen3_omni_moe.model import Qwen3OmniMoeModel, build, param_groups, prepare_batch
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    register(ModelSpec(name="qwen3_omni_moe", config_cls=Qwen3OmniMoeConfig, flavors=FLAVORS, build=build,
                       config_from_hf=Qwen3OmniMoeConfig.from_hf, load_hf=hf.load_hf, save_hf=hf.save_hf,
                       flops=flops.flops, plan=plan.plan, dims=spec.dims, runtime=spec.runtime,
                       with_runtime=spec.with_runtime, data_needs=spec.data_needs, kernel_shapes=spec.kernel_shapes,
                       memory_terms=memory.memory_terms, prepare_batch=prepare_batch, seq_keys=("mm_index",),
                       param_groups=param_groups, fused_params=spec.fused_params,
                       hf_model_types=("qwen3_omni_moe_thinker", "qwen3_omni_moe")))


_register()

__all__ = ["FLAVORS", "AudioConfig", "Qwen3OmniMoeConfig", "Qwen3OmniMoeModel", "build", "param_groups",
           "prepare_batch"]
