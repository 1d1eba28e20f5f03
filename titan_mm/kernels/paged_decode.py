"""Paged decode attention: one new query token per sequence against its keys read in place from the KV pool.

The serving engine's decode step (one token per sequence) is memory-bound: every cached key and value is read
once. The gather path of titan_mm.models.common.kv_cache copies them into a dense [B, L, G, K] tensor first and
then runs SDPA, reading them twice and writing them once. This kernel walks each sequence's block table instead
(vLLM's paged attention, flash-decoding's online softmax), so the pool is read once and nothing is written.

One program per (sequence, kv head): it loads the group's H / G query heads once (padded to 16 rows for tl.dot),
then for each block of the sequence's table, in tiles of up to 64 tokens: keys [TB, K] -> scores [heads, TB]
(masked past the sequence's length and outside the sliding window) -> running max / sum -> values. fp32
accumulation; bf16 / fp16 pools are multiplied in their dtype, fp32 pools in IEEE fp32 (no TF32). The sequence's length, read by the program
from device memory, masks the blocks; the loop runs over the table's columns (the planner cuts them to the
step's longest sequence, host-known), rounded up to a power of 2 so a growing batch compiles a few times only.
No host sync.

A sequence of length 0 (a padded decode row) gets zeros. Legend: B sequences, H query heads, G kv heads,
K head dim, NB pool blocks, BS block size, MB blocks per table row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2


@triton.jit
def _paged_decode(Q, Kp, Vp, O, BT, LENS, scale, window,
                  sqb, sqh, skn, skt, skg, svn, svt, svg, sob, soh, sbt,
                  HPG: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr,
                  N_BLOCKS: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    n = tl.load(LENS + b)
    h = tl.arange(0, BH)
    d = tl.arange(0, DP)
    t = tl.arange(0, TB)
    hm = h < HPG
    dm = d < D
    heads = g * HPG + h
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    q = (q.to(tl.float32) * scale).to(Kp.dtype.element_ty)
    m = tl.full([BH], -1e30, tl.float32)  # finite: a block with no key left leaves the sums unchanged, not NaN
    s_sum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DP], tl.float32)
    lo = 0
    if WINDOW:
        lo = n - window
    # N_BLOCKS: the step's longest sequence in blocks, rounded up to a power of 2 (a compile per doubling); tiles
    # past this sequence's length or before its window load nothing (masked), so they cost no memory traffic.
    # A block is read in tiles of TB tokens, so large blocks (256) fit in shared memory.
    for i in range(0, N_BLOCKS * (BS // TB)):
        col = i // (BS // TB)
        tok = (i % (BS // TB)) * TB + t
        pos = col * BS + tok
        ok = (pos < n) & (pos >= lo)
        live = (col * BS + (i % (BS // TB)) * TB < n) & (col * BS + (i % (BS // TB) + 1) * TB > lo)
        blk = tl.load(BT + b * sbt + col, mask=live, other=0).to(tl.int64)
        k = tl.load(Kp + blk * skn + tok[:, None] * skt + g * skg + d[None, :], mask=ok[:, None] & dm[None, :],
                    other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        v = tl.load(Vp + blk * svn + tok[:, None] * svt + g * svg + d[None, :], mask=ok[:, None] & dm[None, :],
                    other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    o = acc / tl.maximum(s_sum, 1e-30)[:, None]
    tl.store(O + b * sob + heads[:, None] * soh + d[None, :], o.to(O.dtype.element_ty), mask=hm[:, None] & dm[None, :])


def paged_decode(q_BHK: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The launch (titan_mm.kernels.paged_decode_attention checks the shapes and picks it): -> [B, H, K]."""
    B, H, K = q_BHK.shape
    G = k_pool.shape[2]
    q = q_BHK.contiguous()
    o = torch.empty_like(q)
    k, v = k_pool, v_pool
    hpg = H // G
    _paged_decode[(B, G)](
        q, k, v, o, block_tables, seq_lens, K ** -0.5, window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), block_tables.stride(0),
        HPG=hpg, BH=max(16, next_pow2(hpg)), BS=k.shape[1], TB=min(k.shape[1], 64), D=K, DP=max(16, next_pow2(K)),
        N_BLOCKS=next_pow2(block_tables.shape[1]), WINDOW=window is not None,
        IEEE=k.dtype == torch.float32, num_warps=4,
    )
    return o
