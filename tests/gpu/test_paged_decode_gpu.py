"""The paged-decode kernel on CUDA (run on the H200): bf16 and fp32 pools equal the reference (GQA, block sizes 16
and 256, a sliding window, empty rows; batches of 1, 8 and 96, so split and unsplit launches), with no host sync (torch.cuda.set_sync_debug_mode("error")) once compiled.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_paged_decode_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from titan_mm.kernels import paged_decode_attention
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
