"""The paged-decode kernel on CUDA: bf16 and fp32 pools equal the reference (GQA, block sizes 16 and 256, a sliding
window, empty rows; batches of 1, 8 and 96, so split and unsplit launches), with no host sync
(torch.cuda.set_sync_debug_mode("error")) once compiled; bf16 queries over fp8 pools in both dot dtypes.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_paged_decode_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from titan_mm.kernels import paged_decode_attention
from titan_mm.kernels.paged_decode import paged_decode
from titan_mm.nn.kv_cache import paged_decode_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B", [1, 8, 96], ids=lambda b: f"B{b}")  # many splits, a few, one (no combine)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("H,G,K,BS,window", [(16, 8, 128, 16, None), (32, 4, 128, 256, None), (14, 2, 64, 16, 100)])
def test_kernel_matches_reference_without_sync(B, dtype, tol, H, G, K, BS, window):
    torch.manual_seed(0)
    MB = 12
    NB = B * MB
    kp, vp = (torch.randn(NB, BS, G, K, device="cuda").to(dtype) for _ in "kv")
    q = torch.randn(B, H, K, device="cuda").to(dtype)
    tables = torch.randperm(NB, device="cuda")[: B * MB].view(B, MB).to(torch.int32)
    lens = torch.randint(0, MB * BS + 1, (B,), device="cuda", dtype=torch.int32)
    paged_decode_attention(q, kp, vp, tables, lens, window)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = paged_decode_attention(q, kp, vp, tables, lens, window)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = paged_decode_reference(q, kp, vp, tables, lens, window)
    assert float((got.float() - want.float()).abs().max()) <= tol


@pytest.mark.parametrize("B", [1, 96], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("pool,f16", [(torch.bfloat16, False), (torch.float8_e4m3fn, True),
                                      (torch.float8_e4m3fn, False)], ids=["bf16", "fp8_fp16dot", "fp8_bf16dot"])
@pytest.mark.parametrize("warps,tile", [(4, 64), (8, 128), (4, None)], ids=["w4t64", "w8t128", "w4_default"])
def test_launch_variants_match_the_reference(B, pool, f16, warps, tile):
    """bf16 queries over bf16 and e4m3 pools, in the launches bench/paged_decode.py times (an fp8 pool's dots in
    fp16, the default, or bf16; 4 or 8 warps; 64- or 128-key tiles, or the pool's default), against the fp32
    reference over the same pool values: bf16 output rounding (2^-9 x |o| <= 2^-9 x 4) plus bf16 rounding of q and
    the probabilities (2 x 2^-8 x 4 at most), < 5e-2."""

    torch.manual_seed(0)
    H, G, K, BS, MB = 32, 8, 128, 16, 12
    kp, vp = (torch.randn(B * MB, BS, G, K, device="cuda").to(pool) for _ in "kv")
    q = torch.randn(B, H, K, device="cuda").to(torch.bfloat16)
    tables = torch.randperm(B * MB, device="cuda").view(B, MB).to(torch.int32)
    lens = torch.randint(0, MB * BS + 1, (B,), device="cuda", dtype=torch.int32)
    got = paged_decode(q, kp, vp, tables, lens, f16=f16, warps=warps, tile=tile)
    want = paged_decode_reference(q.float(), kp.float(), vp.float(), tables, lens)
    assert got.dtype == torch.bfloat16 and float((got.float() - want).abs().max()) < 5e-2
