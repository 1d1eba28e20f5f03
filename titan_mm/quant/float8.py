"""float8 training through torchao, configured by the ``[float8]`` section (titan_mm.config.Float8).

    apply_float8(model, cfg.float8, on_cuda)          # Float8Linear for the eligible nn.Linear (CUDA SM>=89)
    hook = float8_after_optimizer(model, cfg.float8)   # StepContext.after_optimizer, or None
    check_float8_experts(device)                       # float8.moe_experts can run here (or a ConfigError)

The float8 experts (float8.moe_experts) are no module swap: the model config's moe_float8 runtime field picks
them when the model is built (titan_mm/nn/moe.py).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from titan_mm.config import ConfigError, Float8
from titan_mm.quant.rowwise import to_rowwise

logger = logging.getLogger(__name__)

__all__ = ["apply_float8", "check_float8_experts", "float8_after_optimizer"]


def apply_float8(model: nn.Module, cfg: Float8, on_cuda: bool, fsdp: bool = True) -> None:
    """Swap eligible ``nn.Linear`` for torchao Float8Linear (tensorwise or rowwise scaling), or with
    ``rowwise_casts = "titan"`` for titan_mm.quant.rowwise's Float8RowwiseLinear. The caller decides
    whether float8 is on (``cfg.enable``); this checks that the device can run it. ``fsdp``: FSDP2 will gather the
    weights (tensorwise then gathers them in float8); false on the one-rank cast path (titan_mm.parallel.apply)."""
    if not on_cuda:
        raise RuntimeError("float8.enable=true needs a CUDA GPU with SM>=89 (H100/H200); this run is on CPU. "
                           "Set --float8.enable false for CPU runs.")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise RuntimeError(f"float8 training needs SM>=89; this GPU is SM{major}{minor}. Set --float8.enable false.")
    skip = set(cfg.filter_fqns)

    def keep(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear) or any(part in skip for part in fqn.split(".")):
            return False
        return mod.in_features % 16 == 0 and mod.out_features % 16 == 0  # float8 GEMM shape rule

    if cfg.rowwise_casts == "titan":  # the config allows it with recipe rowwise only
        logger.info(f"float8 rowwise on titan_mm's casts: {to_rowwise(model, keep)} linears")
        return
    # deferred: importing torchao costs ~0.6 s and logs warnings; only float8 runs need it
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.recipe == "tensorwise":
        f8cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    else:
        if cfg.recipe == "rowwise":
            logger.warning("float8.recipe=rowwise: on Qwen3-8B (one H100) it ran at 0.95x bf16, tensorwise at 1.18x "
                           "(torchao's rowwise casts; docs/benchmarks.md); use it for its accuracy, not its speed, "
                           "or try --float8.rowwise_casts titan (titan_mm's casts; not measured on a GPU yet)")
        f8cfg = Float8LinearConfig.from_recipe_name(cfg.recipe)
    convert_to_float8_training(model, config=f8cfg, module_filter_fn=keep)


def check_float8_experts(device: torch.device) -> None:
    """float8.moe_experts' device and library, before the model is built: torch._scaled_grouped_mm runs on SM>=90
    (H100 / H200), and the GEMM is torchao's (prototype.moe_training)."""
    if device.type != "cuda":
        raise ConfigError(f"float8.moe_experts needs a CUDA GPU with SM>=90 (H100/H200); this run is on "
                          f"{device.type}: set --float8.moe_experts false")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ConfigError(f"float8.moe_experts needs SM>=90 (float8 grouped GEMMs); this GPU is SM{major}{minor}: "
                          "set --float8.moe_experts false")
    try:
        import torchao.prototype.moe_training  # noqa: F401  (optional: a prototype some torchao builds lack)
    except ImportError as e:
        raise ConfigError(f"float8.moe_experts needs torchao's MoE training (torchao >= 0.17, "
                          f"torchao.prototype.moe_training): {e}; pip install torchao, or set --float8.moe_experts "
                          "false") from None


def float8_after_optimizer(model: nn.Module, cfg: Float8) -> Callable[[], None] | None:
    """The hook to run after each optimizer step (``StepContext.after_optimizer``), or None: with
    ``float8.precompute_scale`` (tensorwise), every float8 weight's scale for the next FSDP all-gathers in one
    batched computation, instead of an amax per weight inside each all-gather."""
    if not (cfg.enable and cfg.precompute_scale):
        return None
    if cfg.recipe != "tensorwise":
        logger.info(f"float8.precompute_scale is not used with float8.recipe={cfg.recipe!r}: the precomputed scales "
                    "are the per-tensor ones of the tensorwise FSDP float8 all-gather")
        return None
    # deferred: importing torchao costs ~0.6 s and logs warnings; only float8 runs need it
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    if not any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules()):
        return None  # apply_float8(fsdp=False), the one-rank cast path: no FSDP float8 all-gather to feed
    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
