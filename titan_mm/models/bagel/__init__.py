"""BAGEL (ByteDance-Seed/Bagel): unified understanding and image generation, a Qwen2 Mixture-of-Transformers decoder
with a SigLIP NaViT tower and flow matching on VAE latents. Importing registers "bagel"."""

from titan_mm.models.bagel import data, flops, hf, memory, plan, spec, synthetic
from titan_mm.models.bagel.config import FLAVORS, BagelConfig
from titan_mm.models.bagel.model import BagelModel, build
from titan_mm.registry import ModelSpec, register


def _register() -> None:
    register(ModelSpec(
        name="bagel", config_cls=BagelConfig, flavors=FLAVORS, build=build, config_from_hf=BagelConfig.from_hf,
        load_hf=hf.load_hf, save_hf=hf.save_hf, flops=flops.flops, plan=plan.plan, dims=spec.dims,
        runtime=spec.runtime, with_runtime=spec.with_runtime, data_needs=data.data_needs,
        kernel_shapes=spec.kernel_shapes, memory_terms=memory.memory_terms, prepare_batch=spec.prepare_batch,
        batch_schema=spec.SCHEMA, objectives=("causal", "flow_matching"),
        objective_options=spec.objective_options, param_groups=spec.param_groups, synthetic=synthetic.synthetic))


_register()

__all__ = ["FLAVORS", "BagelConfig", "BagelModel", "build"]
