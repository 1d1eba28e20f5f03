"""Qwen3 and Qwen3-MoE (one family: num_experts == 0 is dense). Importing registers "qwen3" and "qwen3_moe"."""

from titan_mm.models.qwen3 import flops, hf, memory, plan, spec
from titan_mm.models.qwen3.config import FLAVORS, Qwen3Config
from titan_mm.models.qwen3.model import Qwen3Model, build
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    register(
        ModelSpec(
            name="qwen3",
            config_cls=Qwen3Config,
            flavors=FLAVORS,
            build=build,
            config_from_hf=Qwen3Config.from_hf,
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
            hf_model_types=("qwen3", "qwen3_moe"),
        ),
        "qwen3_moe",
    )


_register()

__all__ = ["FLAVORS", "Qwen3Config", "Qwen3Model", "build"]
