"""Paged decode attention (titan_mm.kernels.paged_decode_attention): a one-token step that reads the keys in
place from the KV pool equals the gather path of titan_mm.nn.kv_cache (through plan_step and
attention, on the CPU reference), and the Triton kernel equals the reference through TRITON_INTERPRET=1
(GQA and MHA, block sizes 8 / 16 / 128, a sliding window, a head dim that is not a power of 2, an empty row, one
split and several (flash-decoding), tiles of 32, 64 and 128 keys; fp32 and
fp16: the interpreter of Triton 3.6 miscomputes bf16 tl.dot, so bf16 is checked on the GPU, in
tests/gpu/test_paged_decode_gpu.py)."""

from __future__ import annotations

import torch

from tests.triton_interp import run_interpreted

from titan_mm.kernels import paged_decode_attention
from titan_mm.nn.attention import attention, build_attn_meta
from titan_mm.nn.kv_cache import alloc_paged_cache, plan_step


def _step(cache, cached, tables, decode, window=None):
    return plan_step(cache, [1] * len(cached), cached_lens=cached, block_tables=tables, sliding_window=window,
                     decode_attention=paged_decode_attention if decode else None)


def test_in_place_decode_equals_the_gather_path():
    torch.manual_seed(0)
    B, H, G, K, BS, NB = 3, 8, 2, 16, 16, 12
    cached = [20, 0, 37]  # a fresh sequence (its first token) among cached ones
    tables = torch.tensor([[3, 7, 0], [5, 0, 0], [1, 9, 11]])
    outs, pools = [], []
    for decode in (False, True):
        for window in (None, 9):
            cache = alloc_paged_cache(1, NB, BS, G, K)
            g = torch.Generator().manual_seed(1)
            for pool in (cache.k[0], cache.v[0]):
                pool.copy_(torch.randn(pool.shape, generator=g))
            step = _step(cache, cached, tables, decode, window)
            assert (step.step.decode_attention is not None) == decode
            q, k, v = torch.randn(B, 1, H, K, generator=g), torch.randn(B, 1, G, K, generator=g), \
                torch.randn(B, 1, G, K, generator=g)
            meta = build_attn_meta({"input_ids": torch.zeros(B, 1, dtype=torch.long)}, "sdpa", "cpu", kv_cache=step,
                                   sliding_window=window)
            outs.append(attention(q, k, v, meta, window))
            pools.append((cache.k[0].clone(), cache.v[0].clone()))
    for i in (0, 1):  # gather vs in place, without and with the window
        torch.testing.assert_close(outs[2 + i], outs[i], rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(pools[2 + i], pools[i]))  # the same new k / v written


def test_prefill_steps_keep_the_gather_path():
    cache = alloc_paged_cache(1, 4, 16, 2, 8)
    step = plan_step(cache, [3, 1], cached_lens=[0, 5], block_tables=[[0, 1], [2, 3]],
                     decode_attention=paged_decode_attention)
    assert step.step.decode_attention is None and step.step.block_tables is None


_INTERP = r"""
import torch
from titan_mm.kernels.paged_decode import paged_decode
from titan_mm.nn.kv_cache import paged_decode_reference
torch.manual_seed(0)
bad = []
for H, G, K, BS, dt, window, P in [(8, 2, 64, 16, torch.float32, None, 1), (8, 2, 64, 16, torch.float32, None, 3),
                                   (4, 4, 80, 128, torch.float32, 20, 2), (6, 2, 32, 8, torch.float16, None, 5),
                                   (16, 2, 128, 16, torch.float16, 33, 1), (16, 2, 128, 16, torch.float16, 70, 4)]:
    B, NB, MB = 3, 40, 4 if BS > 8 else 12
    kp, vp = torch.randn(NB, BS, G, K).to(dt), torch.randn(NB, BS, G, K).to(dt)
    q = torch.randn(B, H, K).to(dt)
    tables = torch.randperm(NB)[: B * MB].view(B, MB).to(torch.int32)
    lens = torch.tensor([MB * BS - 3, 0, BS + 1], dtype=torch.int32)
    want = paged_decode_reference(q, kp, vp, tables, lens, window)
    for tile in (64, 32, 128):  # the default and bench/paged_decode.py's other tiles
        got = paged_decode(q, kp, vp, tables, lens, window, splits=P, tile=tile)
        err = float((got.float() - want.float()).abs().max())
        tol = 5e-3 if dt == torch.float16 else 1e-5
        if got.dtype != dt or got.shape != q.shape or not err <= tol or bool(got[1].abs().max() != 0):
            bad.append(f"H={H} G={G} K={K} BS={BS} {dt} window={window} splits={P} tile={tile}: max err {err}")
print("BAD" if bad else "OK", bad)
"""


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    run_interpreted(_INTERP)
