"""Wan 2.1 / 2.2 video diffusion transformer (diffusers' WanTransformer3DModel). Importing registers "wan"."""

from titan_mm.models.wan import flops, hf, memory, plan, spec, synthetic
from titan_mm.models.wan.config import FLAVORS, WanConfig
from titan_mm.models.wan.model import WanModel, build, patchify, unpatchify
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    register(ModelSpec(
        name="wan", config_cls=WanConfig, flavors=FLAVORS, build=build, config_from_hf=WanConfig.from_hf,
        load_hf=hf.load_hf, save_hf=hf.save_hf, flops=flops.flops, plan=plan.plan, dims=spec.dims,
        runtime=spec.runtime, with_runtime=spec.with_runtime, data_needs=spec.data_needs,
        kernel_shapes=spec.kernel_shapes, memory_terms=memory.memory_terms, batch_schema=spec.SCHEMA,
        hf_model_types=("WanTransformer3DModel",), kv_cache=False, objectives=("flow_matching",),
        objective_options=spec.objective_options, synthetic=synthetic.synthetic,
        prepare_batch=spec.prepare_batch))


_register()

__all__ = ["FLAVORS", "WanConfig", "WanModel", "build", "patchify", "unpatchify"]
