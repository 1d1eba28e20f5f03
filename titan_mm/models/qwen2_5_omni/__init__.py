"""Qwen2.5-Omni thinker (HF Qwen2_5OmniThinkerForConditionalGeneration, model_type "qwen2_5_omni_thinker"; a full
"qwen2_5_omni" checkpoint loads its thinker). Importing registers "qwen2_5_omni".

Qwen2.5-VL's model (titan_mm/models/qwen2_5_vl: the Qwen2 decoder, the window-attention ViT, chunked M-RoPE)
plus the Whisper-style audio encoder of audio.py and TMRoPE positions built on the host (model.prepare_batch).
Batch keys: model.py's docstring."""

from titan_mm.models.qwen2_5_omni import flops, hf, memory, plan, spec
from titan_mm.models.qwen2_5_omni.config import FLAVORS, AudioConfig, Qwen2_5OmniConfig
from titan_mm.models.qwen2_5_omni.model import Qwen2_5OmniModel, build, param_groups, prepare_batch
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    register(ModelSpec(name="qwen2_5_omni", config_cls=Qwen2_5OmniConfig, flavors=FLAVORS, build=build,
                       config_from_hf=Qwen2_5OmniConfig.from_hf, load_hf=hf.load_hf, save_hf=hf.save_hf,
                       flops=flops.flops, plan=plan.plan, dims=spec.dims, runtime=spec.runtime,
                       with_runtime=spec.with_runtime, data_needs=spec.data_needs, kernel_shapes=spec.kernel_shapes,
                       memory_terms=memory.memory_terms, prepare_batch=prepare_batch, seq_keys=("mm_index",),
                       param_groups=param_groups, fused_params=spec.fused_params,
                       hf_model_types=("qwen2_5_omni_thinker", "qwen2_5_omni"), tokenizer=spec.TOKENIZER))


_register()

__all__ = ["FLAVORS", "AudioConfig", "Qwen2_5OmniConfig", "Qwen2_5OmniModel", "build", "param_groups", "prepare_batch"]
