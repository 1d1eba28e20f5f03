"""Capability guards: when may an op run its Triton kernel?

Triton runs on CUDA devices with compute capability >= 8.0 (Ampere, Hopper, ...) for bf16/fp16/fp32
inputs. Everything else (CPU, older GPUs, float64, a missing triton) takes the PyTorch reference.
With TRITON_INTERPRET=1 in the environment (set before triton is imported) CPU tensors also take the
Triton path, through the interpreter; the CPU kernel tests use this.
"""

from __future__ import annotations

import os

import torch

try:  # triton is optional on CPU machines
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Eager calls go through plain autograd.Functions around the same kernels (the torch.library dispatcher
# costs tens of microseconds per op in eager, comparable to a memory-bound kernel at training shapes);
# under torch.compile the custom ops are used, so graphs hold them as single nodes. Tests set PREFER_OPS
# to run the custom ops eagerly too.
PREFER_OPS = os.environ.get("TITAN_KERNELS_PREFER_OPS", "0") == "1"


def use_ops() -> bool:
    """True: call the torch.library custom ops; False: the eager autograd.Function fast path."""
    return PREFER_OPS or torch.compiler.is_compiling()
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# KV-cache pools may also hold float8 (serve.kv_cache_dtype): the paged kernels convert on load and store
KV_POOL_DTYPES = (*TRITON_DTYPES, torch.float8_e4m3fn)


_CAP_OK: dict = {}


@torch.compiler.assume_constant_result
def _cuda_capability_ok(index) -> bool:
    # A constant under torch.compile (evaluated at trace time); a dict lookup in eager.
    if index is None:
        index = torch.cuda.current_device()
    ok = _CAP_OK.get(index)
    if ok is None:
        ok = _CAP_OK[index] = torch.cuda.get_device_capability(index) >= (8, 0)
    return ok


def device_ok(device: torch.device) -> bool:
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return _cuda_capability_ok(device.index)
    return INTERPRET and device.type == "cpu"


try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover - builds without distributed
    DTensor = ()


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every tensor may go through the Triton kernels (same device, supported dtype).

    DTensors take the reference path (DTensor runs its aten ops); a caller with DTensor shards passes
    their local tensors (``to_local()``), as loss parallel does for the vocab-parallel CE."""
    t0 = tensors[0]
    if any(isinstance(t, DTensor) for t in tensors):
        return False
    if not device_ok(t0.device):
        return False
    return all(t.dtype in TRITON_DTYPES and t.device == t0.device for t in tensors)


def use_triton_kv(pools: tuple[torch.Tensor, ...], *tensors: torch.Tensor) -> bool:
    """:func:`use_triton` for a paged kernel: ``tensors`` as there, the KV ``pools`` on their device in any of
    KV_POOL_DTYPES."""
    return use_triton(*tensors) and all(p.dtype in KV_POOL_DTYPES and p.device == tensors[0].device for p in pools)
