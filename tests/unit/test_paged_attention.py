"""Paged attention over mixed rows (titan_mm.kernels.paged_attention): a packed batch of sequences with q_len >= 1
new queries each (decode rows, prefill chunks with and without a cached prefix, a row of length 0) attending
causally to its paged context equals a plain PyTorch reference (each sequence's keys gathered from its blocks, SDPA
with the causal-with-prefix mask): the library's reference (nn.kv_cache.paged_attention_reference, the CPU path)
on the CPU, and the Triton kernel through TRITON_INTERPRET=1 (GQA and MHA, a sliding window, block sizes 8 / 16, a
head dim that is not a power of 2; fp32 and fp16: the interpreter of Triton 3.6 miscomputes bf16 tl.dot, so bf16
is checked on the GPU, tests/gpu/test_paged_attention_gpu.py). A packed step planned with paged_attention gives
the gather path's outputs and writes the same k/v.

Tolerances from the arithmetic (outputs are averages of randn values, |o| <= max|v| < 6): fp32 differs from the
reference in summation order only (IEEE dots, fp32 online softmax): a few ulp per term over <= 64 keys,
64 x 2^-24 x 6 < 3e-5; fp16 rounds q x scale and the probabilities to fp16 before the dots (2^-11 relative each),
2 x 2^-11 x 6 < 6e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import run_interpreted

from titan_mm.kernels import paged_attention
from titan_mm.nn.attention import attention, build_attn_meta
from titan_mm.nn.kv_cache import alloc_paged_cache, paged_attention_reference, plan_step

FP32_TOL, FP16_TOL = 3e-5, 6e-3


def sdpa_reference(q, k_pool, v_pool, tables, seq_lens, cu, window=None):
    """Per sequence: its keys gathered from its blocks, SDPA (fp32) with the causal-with-prefix mask (its q_len
    queries are its last positions); a sequence of length 0 has no queries."""
    T, H, K = q.shape
    BS, G = k_pool.shape[1], k_pool.shape[2]
    out = torch.zeros(T, H, K)
    for b in range(len(seq_lens)):
        a, e, n = int(cu[b]), int(cu[b + 1]), int(seq_lens[b])
        if e == a:
            continue
        slots = tables[b].long()[torch.arange(n) // BS] * BS + torch.arange(n) % BS
        k, v = (p.reshape(-1, G, K)[slots].float().transpose(0, 1) for p in (k_pool, v_pool))  # [G, n, K]
        qpos = torch.arange(n - (e - a), n)
        keep = torch.arange(n)[None] <= qpos[:, None]
        if window is not None:
            keep &= qpos[:, None] - torch.arange(n)[None] < window
        o = F.scaled_dot_product_attention(q[a:e].float().transpose(0, 1), k, v, attn_mask=keep, enable_gqa=True)
        out[a:e] = o.transpose(0, 1)
    return out.to(q.dtype)


def mixed_batch(H, G, K, BS, dtype, seed=0):
    """Decode rows (one with a 1-token context), a prefill chunk without a cached prefix, one after a prefix, an
    idle row: (q, k_pool, v_pool, tables, seq_lens, cu_seqlens_q)."""
    g = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = [1, 5, 0, 19, 1, 3], [9, 5, 3, 40, 1, 7]
    MB, NB = -(-max(seq_lens) // BS), 40
    kp, vp = (torch.randn(NB, BS, G, K, generator=g).to(dtype) for _ in "kv")
    tables = torch.randperm(NB, generator=g)[: len(q_lens) * MB].view(-1, MB).to(torch.int32)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), H, K, generator=g).to(dtype)
    return q, kp, vp, tables, torch.tensor(seq_lens, dtype=torch.int32), cu


@pytest.mark.parametrize("H,G,window", [(8, 2, None), (4, 4, 6), (6, 2, 1)])
def test_reference_equals_sdpa_per_sequence(H, G, window):
    batch = mixed_batch(H, G, 16, 8, torch.float32)
    got = paged_attention(*batch, window)  # on the CPU: the library's reference
    torch.testing.assert_close(got, sdpa_reference(*batch, window), rtol=0, atol=FP32_TOL)
    torch.testing.assert_close(got, paged_attention_reference(*batch, window), rtol=0, atol=0)


def test_packed_step_reading_the_pool_equals_the_gather_path():
    torch.manual_seed(0)
    H, G, K, BS, NB = 4, 2, 8, 4, 24
    new, cached = [1, 6, 1, 3], [9, 0, 4, 5]  # decode rows beside a fresh prompt and a chunk after its prefix
    tables = torch.randperm(NB)[:16].view(4, 4)
    T = sum(new)
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, G, K), torch.randn(1, T, G, K)
    outs, pools = [], []
    for window in (None, 3):
        for paged in (None, paged_attention):
            cache = alloc_paged_cache(1, NB, BS, G, K)
            g = torch.Generator().manual_seed(1)
            for pool in (cache.k[0], cache.v[0]):
                pool.copy_(torch.randn(pool.shape, generator=g))
            step = plan_step(cache, new, cached_lens=cached, block_tables=tables, sliding_window=window, packed=True,
                             paged_attention=paged)
            assert (step.step.kv_slots is None) == (paged is not None)
            meta = build_attn_meta({"input_ids": torch.zeros(1, T, dtype=torch.long)}, "sdpa", "cpu", kv_cache=step,
                                   sliding_window=window)
            outs.append(attention(q, k, v, meta, window))
            pools.append((cache.k[0].clone(), cache.v[0].clone()))
    for i in (0, 2):
        torch.testing.assert_close(outs[i + 1], outs[i], rtol=0, atol=FP32_TOL)
        assert all(torch.equal(a, b) for a, b in zip(pools[i + 1], pools[i]))  # the same new k / v written


def test_paged_attention_plans_packed_steps_of_paged_caches_only():
    cache = alloc_paged_cache(1, 4, 4, 2, 8)
    with pytest.raises(ValueError, match="packed=True"):
        plan_step(cache, [2, 1], cached_lens=[0, 3], block_tables=[[0, 1], [2, 3]], paged_attention=paged_attention)
    q = torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match="B \\+ 1 offsets"):
        paged_attention(q, cache.k[0], cache.v[0], torch.zeros(2, 2, dtype=torch.int32),
                        torch.ones(2, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))


_INTERP = r"""
import torch
from tests.unit.test_paged_attention import FP16_TOL, FP32_TOL, mixed_batch, sdpa_reference
from titan_mm.kernels.paged_attention import paged_mixed
CASES = [(h, g, k, bs, getattr(torch, dt), w) for h, g, k, bs, dt, w in CASES]
bad = []
for H, G, K, BS, dt, window in CASES:
    batch = mixed_batch(H, G, K, BS, dt)
    got = paged_mixed(*batch, window)
    want = sdpa_reference(*batch, window)
    err = float((got.float() - want.float()).abs().max())
    if got.dtype != dt or got.shape != batch[0].shape or not err <= (FP32_TOL if dt == torch.float32 else FP16_TOL):
        bad.append(f"H={H} G={G} K={K} BS={BS} {dt} window={window}: max err {err}")
print("BAD" if bad else "OK", bad)
"""


def _cases(cases: list[tuple]) -> str:
    """The interpreter script over ``cases`` (H, G, K, block size, dtype name, window)."""
    return f"CASES = {cases!r}\n" + _INTERP


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    run_interpreted(_cases([(8, 2, 32, 8, "float32", None), (6, 2, 24, 16, "float16", 4)]))


@pytest.mark.parametrize("dtype,pool,rows,hpg,window", [("bf16", "bf16", 64, 8, True), ("fp32", "fp32", 16, 7, False),
                                                       ("bf16", "fp8e4nv", 64, 8, False)])
def test_kernel_compiles_for_hopper(dtype, pool, rows, hpg, window):
    """The interpreter runs the kernel as Python; the compiler (Triton's own ptxas, no GPU needed) checks what it
    does not: loop-carried types, the early return, shared memory on sm_90, float8 pools (serve.kv_cache_dtype)."""
    triton = pytest.importorskip("triton")  # optional: CPU machines without triton skip, hence the imports here
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from titan_mm.kernels.paged_attention import _paged_mixed

    const = dict(HPG=hpg, BQ=rows // hpg, BM=rows, BS=16, TB=64, D=128, DP=128, WINDOW=window, IEEE=dtype == "fp32")
    sig = {n: f"*{dtype}" for n in ("Q", "O")} | {n: f"*{pool}" for n in ("Kp", "Vp")}
    sig |= {n: "*i32" for n in ("BT", "LENS", "CUQ")}
    sig |= {"scale": "fp32"} | {n: "i32" for n in ("window", "B", "sqt", "sqh", "skn", "skt", "skg", "svn", "svt",
                                                    "svg", "sot", "soh", "sbt")} | dict.fromkeys(const, "constexpr")
    k = triton.compile(ASTSource(fn=_paged_mixed, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    assert 0 < k.metadata.shared <= 227 * 1024  # Hopper's shared memory per block


@pytest.mark.slow
def test_triton_kernel_sweep_in_the_interpreter():
    run_interpreted(_cases([(4, 4, 80, 16, "float32", 6), (16, 2, 64, 8, "float32", None),
                            (14, 2, 64, 16, "float16", None), (32, 2, 128, 16, "float16", 20)]))
