"""Load-time transforms of the weights an engine owns (Engine.from_pretrained's, or Engine(owns_weights=True)); the
training model keeps its layout.

- :func:`fuse_projections`: each ``nn.attention.Attention``'s wq, wk, wv become one [q+k+v, D] linear ``wqkv`` and
  each ``nn.mlp.SwiGLU``'s w1, w3 one [2F, D] linear ``w13`` (rows stacked, so each output is the same dot product
  as before), so a layer launches one GEMM where it launched three and two. Under tensor parallel each rank stacks
  its own shards: rank r's wqkv is [q_r; k_r; v_r] (the plan split wq, wk, wv colwise by heads), so q, k and v are
  each split over tp inside the fused weight and the GEMM's input and output stay the rank's local ones.
- :func:`quantize`: weight quantization (``serve.quantization``) of those projections (and wo, w2): torchao's modes,
  and :class:`Fp8Linear` (rowwise w8a8 on kernels.fp8_mm, its input cast by titan_mm.kernels.fp8_rows in one
  launch: bench/fp8_gemm.py measured torchao's rowwise linear at 0.69x bf16 for an 8B layer at 256 rows on the H100,
  the fp8 GEMM alone at 1.62x), a fused SwiGLU of two of them an :class:`Fp8SwiGLU` (its product cast in the
  activation's launch). The head, embeddings, MoE routers and experts, and vision towers keep the serving
  dtype.
- :func:`perplexity`: exp of the mean next-token NLL of a model on token ids (the quantization's quality check:
  bench/serve.py and the tests).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_mm import kernels
from titan_mm.config import ConfigError
from titan_mm.nn.attention import Attention, build_attn_meta
from titan_mm.nn.fp8 import fp8_rows
from titan_mm.nn.kv_cache import alloc_paged_cache, plan_step
from titan_mm.nn.mlp import SwiGLU, silu_mul


def _local(t: torch.Tensor, what: str) -> torch.Tensor:
    """A rank's rows of a colwise-split (Shard(0)) DTensor weight or bias, or the plain tensor."""
    if not isinstance(t, DTensor):
        return t
    if not all(p.is_shard(0) for p in t.placements):
        raise ValueError(f"{what}: cannot fuse a projection placed {t.placements}; only rows split over tp "
                         "(colwise, Shard(0)) or whole weights fuse")
    return t.to_local()


def _stack(lins: list[nn.Linear], what: str) -> tuple[nn.Linear, tuple[int, ...]]:
    """One linear whose weight (and bias) rows are ``lins``' local rows, in order, and each one's row count."""
    ws = [_local(lin.weight, what) for lin in lins]
    fused = nn.Linear(ws[0].shape[1], sum(w.shape[0] for w in ws), bias=lins[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([w.detach() for w in ws]), requires_grad=False)
    if lins[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([_local(lin.bias, what).detach() for lin in lins]), requires_grad=False)
    return fused, tuple(w.shape[0] for w in ws)


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up in place (idempotent); -> GEMMs per forward saved (2 per attention, 1 per SwiGLU)."""
    saved = 0
    for name, m in list(model.named_modules()):
        if isinstance(m, Attention) and m.wqkv is None:
            m.wqkv, m.qkv_sizes = _stack([m.wq, m.wk, m.wv], f"{name}.wq/wk/wv")
            del m.wq, m.wk, m.wv
            saved += 2
        elif isinstance(m, SwiGLU) and m.w13 is None:
            m.w13, _ = _stack([m.w1, m.w3], f"{name}.w1/w3")
            del m.w1, m.w3
            saved += 1
    return saved


def _torchao_config(mode: str):
    """torchao's config of a serve.quantization mode (ServeConfig.check names them). torchao is imported here: only
    serve.quantization needs it, and importing it costs ~0.6 s and logs its missing CUDA extensions on CPU."""
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                                      Int4WeightOnlyConfig, Int8WeightOnlyConfig, PerRow)

    # set_inductor_config off: torchao would change torch._inductor's global settings for the whole process
    return {
        "int8_weight_only": lambda: Int8WeightOnlyConfig(set_inductor_config=False),  # per-row symmetric int8
        "fp8_weight_only": lambda: Float8WeightOnlyConfig(set_inductor_config=False),  # per-row e4m3
        "fp8_rowwise": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(),
                                                                         set_inductor_config=False),
        # tinygemm's packing (torch's own int4 GEMM on CUDA); torchao's default "plain" needs the mslk package
        "int4_weight_only": lambda: Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d",
                                                         set_inductor_config=False),
    }[mode]()


class Fp8Linear(nn.Module):
    """A linear in rowwise w8a8 float8: the weight in e4m3 with one scale per output row (quantized once, here),
    the input cast per row at each call (kernels.fp8_rows: one launch), one fp8 GEMM (kernels.fp8_mm) with the bias
    and the output in the input's dtype. Input and output sizes must be multiples of 16 (the fp8 GEMM's)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        w8, scale = fp8_rows(lin.weight.detach())
        self.register_buffer("weight_fp8", w8)
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]: one per output column of x @ w.T
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(*kernels.fp8_rows(x.reshape(-1, self.in_features)), x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def gemm(self, x8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer on an input cast already: x8 [M, in] e4m3 with its row scales [M, 1] -> [M, out] in dtype."""
        return kernels.fp8_mm(x8, x_scale, self.weight_fp8, self.weight_scale, self.bias, dtype)


class Fp8SwiGLU(nn.Module):
    """A SwiGLU whose fused gate / up (``w13``) and down (``w2``) projections are Fp8Linears, silu(gate) * up and
    the down projection's input cast in one launch (kernels.swiglu_fp8_rows: the bf16 product is never written);
    outputs equal the SwiGLU's with those linears and kernels.swiglu (one rounding of the fp32 product; torch's
    silu_mul on bf16 CUDA tensors rounds twice, so there they may differ in the last bit of a product)."""

    def __init__(self, w13: Fp8Linear, w2: Fp8Linear):
        super().__init__()
        self.w13, self.w2 = w13, w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h8, h_scale = kernels.swiglu_fp8_rows(self.w13(x).reshape(-1, self.w13.out_features))
        return self.w2.gemm(h8, h_scale, x.dtype).view(*x.shape[:-1], self.w2.out_features)


def _fp8_linears(model: nn.Module, targets: set[int]) -> int:
    """Each target linear whose sizes the fp8 GEMM takes becomes an Fp8Linear in its parent; -> how many."""
    done = 0
    for parent in list(model.modules()):
        for name, lin in list(parent.named_children()):
            if id(lin) in targets and lin.in_features % 16 == 0 and lin.out_features % 16 == 0:
                setattr(parent, name, Fp8Linear(lin))
                done += 1
    return done


def _fp8_swiglus(model: nn.Module) -> int:
    """Each SwiGLU of the silu product whose w13 (fused) and w2 are Fp8Linears becomes an Fp8SwiGLU; -> how many."""
    done = 0
    for parent in list(model.modules()):
        for name, mlp in list(parent.named_children()):
            if (isinstance(mlp, SwiGLU) and isinstance(mlp.w13, Fp8Linear) and isinstance(mlp.w2, Fp8Linear)
                    and mlp.act_mul in (silu_mul, kernels.swiglu)):
                setattr(parent, name, Fp8SwiGLU(mlp.w13, mlp.w2))
                done += 1
    return done


def quantize(model: nn.Module, mode: str) -> int:
    """Quantize the attention and dense-MLP projections in place by ``mode`` (a serve.quantization value other than
    "none"); -> how many linears were quantized. A ConfigError when there were some and none took it (int4 skips a
    weight whose input size is not a multiple of its group of 128, fp8_rowwise_fused sizes not a multiple of 16)."""
    targets = {id(lin) for m in model.modules() if isinstance(m, (Attention, SwiGLU))
               for lin in m.children() if isinstance(lin, nn.Linear)}
    if not targets:
        return 0
    if mode == "fp8_rowwise_fused":
        done = _fp8_linears(model, targets)
        _fp8_swiglus(model)
    else:
        done = _torchao(model, mode, targets)
    if not done:
        raise ConfigError(f"serve.quantization={mode!r} quantized none of the model's {len(targets)} projections "
                          "(int4 takes input sizes that are a multiple of 128, fp8_rowwise_fused sizes that are a "
                          "multiple of 16); pick another mode or none")
    return done


def _torchao(model: nn.Module, mode: str, targets: set[int]) -> int:
    """torchao's ``mode`` on the target linears; -> how many took it."""
    from torchao.quantization import quantize_  # torchao only for serve.quantization (_torchao_config says why)

    quantize_(model, _torchao_config(mode), filter_fn=lambda mod, fqn: id(mod) in targets)
    return sum(type(m.weight) is not nn.Parameter for m in model.modules() if id(m) in targets)


def prepare(model: nn.Module, fuse: bool, quantization: str) -> dict:
    """The transforms a ServeConfig asks for, on an engine's own model (in the serving dtype, on its device, after
    any tensor-parallel split): fusion first, so a fused weight is quantized whole (per-row scales are those of its
    rows either way). -> what was done, for the engine's start-up line."""
    done = {}
    if fuse:
        done["fused_gemms_saved"] = fuse_projections(model)
    if quantization != "none":
        done["quantized_linears"] = quantize(model, quantization)
    return done


@torch.inference_mode()
def perplexity(model: nn.Module, ids: list[int], window: int = 256, *, spec=None, model_cfg=None,
               kv_dtype: torch.dtype | None = None) -> float:
    """exp(mean NLL) of every next token of ``ids`` under ``model``, read in windows of ``window`` tokens (each
    window starts a fresh context; the last one may be shorter). ``kv_dtype`` (with the family's ``spec`` and
    ``model_cfg``): each window is one prefill step through a paged KV cache of that dtype, so every key and value
    the attention reads carries the cache's rounding (serve.kv_cache_dtype's), as a served request's do."""
    dev = next(model.parameters()).device
    total, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[s: s + window + 1], device=dev)
        if len(chunk) < 2:
            break
        x = chunk[None, :-1]
        through = {} if kv_dtype is None else _prefill_through_cache(x, spec, model_cfg, kv_dtype)
        out = model(x, labels=chunk[None, 1:], **through)
        total += float(out.loss_sum)
        count += len(chunk) - 1
    return math.exp(total / count)


def _prefill_through_cache(x: torch.Tensor, spec, model_cfg, kv_dtype: torch.dtype, block_size: int = 16) -> dict:
    """The forward arguments of ``x`` [1, S] as one prefill step into a fresh paged cache of ``kv_dtype``."""
    if spec is None or model_cfg is None:
        raise ValueError("perplexity(kv_dtype=...) needs the family's spec and model_cfg (the cache's layout)")
    dims, rt = spec.dims(model_cfg), spec.runtime(model_cfg)
    if dims.linear is not None:
        raise ConfigError("perplexity through the KV cache: linear-attention layers keep a state, not k/v; measure "
                          "this family without kv_dtype")
    n = x.shape[1]
    blocks = -(-n // block_size)
    cache = alloc_paged_cache(dims.num_layers, blocks, block_size, dims.num_kv_heads, dims.head_dim, kv_dtype,
                              x.device)
    cache = plan_step(cache, [n], cached_lens=[0], block_tables=[list(range(blocks))],
                      sliding_window=rt.sliding_window)
    meta = build_attn_meta({"input_ids": x}, rt.attn_backend, x.device, rt.sliding_window, kv_cache=cache)
    return dict(position_ids=cache.step.positions, attn=meta)
