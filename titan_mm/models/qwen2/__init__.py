"""Qwen2 / Qwen2.5 dense decoders (HF Qwen2ForCausalLM, model_type "qwen2"). Importing registers "qwen2".

The model is the Qwen3 decoder of titan_mm/models/qwen3 built from the Qwen3Config that
Qwen2Config.decoder() derives (no qk-norm, q/k/v bias, no o_proj bias); this folder holds the config, the HF
names and config.json, and the contract's answers, each delegating to Qwen3's on that decoder config.
"""

from titan_mm.models.qwen2 import flops, hf, memory, plan, spec
from titan_mm.models.qwen2.config import FLAVORS, Qwen2Config
from titan_mm.models.qwen2.model import build
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    register(
        ModelSpec(
            name="qwen2",
            config_cls=Qwen2Config,
            flavors=FLAVORS,
            build=build,
            config_from_hf=Qwen2Config.from_hf,
            load_hf=hf.load_hf,
            save_hf=hf.save_hf,
            flops=flops.flops,
            plan=plan.plan,
            dims=spec.dims,
            runtime=spec.runtime,
            with_runtime=spec.with_runtime,
            data_needs=spec.data_needs,
            kernel_shapes=spec.kernel_shapes,
            memory_terms=memory.memory_terms,
            hf_model_types=("qwen2",),
        ),
    )


_register()

__all__ = ["FLAVORS", "Qwen2Config", "build"]
