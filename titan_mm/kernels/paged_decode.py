"""Paged decode attention: one new query token per sequence against its keys read in place from the KV pool.

The serving engine's decode step (one token per sequence) is memory-bound: every cached key and value is read
once. The gather path of titan_mm.nn.kv_cache copies them into a dense [B, L, G, K] tensor first and
then runs SDPA, reading them twice and writing them once. This kernel walks each sequence's block table instead
(vLLM's paged attention, flash-decoding's split online softmax), so the pool is read once and nothing is written.

Grid (sequence, kv head, split). A program loads the group's H / G query heads once (padded to 16 rows for
tl.dot) and walks its split of the sequence's keys in tiles of TB tokens; a tile may span several blocks (each
token looks up its own block id), so small blocks (16) still give tl.dot 64-token tiles (128 over fp8 pools in
one-split launches: the same bytes a tile). Per tile: keys [TB, K] -> scores [heads, TB] (masked past the
sequence's length and before its sliding window) -> running max / sum -> values; fp32 accumulation, bf16 / fp16
pools multiplied in their dtype, fp32 pools in IEEE fp32 (no TF32), and fp8 (e4m3) pools under bf16 queries in
fp16: e4m3 -> fp16 is one exact conversion where bf16 takes two (1.11x on the H100, bench/paged_decode.py), and
fp16 holds q x K^-0.5 below 65,504 (|q| under 7e5 at K = 128).

The loop bounds are the sequence's own length, read by the program from device memory, so a program reads only
its keys, nothing is host-known but the grid, and no host sync happens. ``SPLITS`` (flash-decoding) cuts each
sequence into that many spans when B x G programs would leave the GPU idle (small batches); each split writes
its unnormalized partial (max, sum, acc) and ``_combine`` merges them. SPLITS depends on B and G only, so a CUDA
graph captured for a batch size stays valid whatever the lengths.

A sequence of length 0 (a padded decode row) gets zeros. Legend: B sequences, H query heads, G kv heads,
K head dim, NB pool blocks, BS block size, MB blocks per table row, P splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

TILE = 64
"""Keys per tile: a multiple of 16 for tl.dot, small enough that fp32 tiles fit Hopper's shared memory."""
FP8_TILE = 128
"""Keys per tile over fp8 pools in one-split launches (the bytes of a bf16 tile of TILE): on the H100 at workload
A's shape 256 us against 278 at 64 keys (bf16 pools: 399 against 400; bench/results/paged_decode_h100_sweep.json)."""
PROGRAMS_PER_SM = 4
"""Target programs per SM when choosing the split count."""
MAX_SPLITS = 32
STAGES = 5
"""Software-pipelining stages of the key loop (triton's num_stages). Fewer leave one K / V buffer (the block-id
gather takes a stage of its own), so a program waits out each tile's loads: on the H100 at workload A's shape 5
gave fp8 pools 1.10x over 3 and bf16 1.01x (bench/results/paged_decode_h100.json)."""


def keys_a_tile(k_pool: torch.Tensor, splits: int) -> int:
    """The decode kernel's tile: FP8_TILE for fp8 pools in one-split launches (where it was measured), else TILE
    (a split's span is whole tiles: wider tiles would leave more of a small batch's splits empty)."""
    return FP8_TILE if k_pool.dtype == torch.float8_e4m3fn and splits == 1 else TILE


def dot_in_fp16(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether q and the loaded keys / values meet in fp16 rather than q's dtype: bf16 queries over an fp8 pool."""
    return k_pool.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


@triton.jit
def attend_tile(q, m, s_sum, acc, Kp, Vp, bt, pos, ok, keep, g, skn, skt, skg, svn, svt, svg, d, dm,
                BS: tl.constexpr, IEEE: tl.constexpr):
    """One tile of keys at positions ``pos`` [TB] (``ok``: inside the table row ``bt``) for the query rows ``q``
    [M, DP] of kv head ``g``: -> the online softmax's running max, sum and fp32 accumulator after it. ``keep``
    [M, TB] or [1, TB]: which (row, key) pairs attend (the caller's causal / window / length mask)."""
    blk = tl.load(bt + pos // BS, mask=ok, other=0).to(tl.int64)
    off = blk * skn + (pos % BS) * skt + g * skg
    k = tl.load(Kp + off[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0).to(q.dtype)  # fp8 pools
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # m starts finite (-1e30): a row with no key kept stays at sum 0
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    s_sum = s_sum * alpha + tl.sum(p, 1)
    voff = blk * svn + (pos % BS) * svt + g * svg
    v = tl.load(Vp + voff[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0).to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, s_sum, acc


@triton.jit
def _paged_decode(Q, Kp, Vp, O, M, L, BT, LENS, scale, window,
                  sqb, sqh, skn, skt, skg, svn, svt, svg, sob, soh, sop, smb, smh, sbt,
                  HPG: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
                  F16: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(LENS + b)
    h = tl.arange(0, BH)
    d = tl.arange(0, DP)
    t = tl.arange(0, TB)
    hm = h < HPG
    dm = d < D
    heads = g * HPG + h
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    q = (q.to(tl.float32) * scale).to(tl.float16 if F16 else Q.dtype.element_ty)  # attend_tile: k / v to q's
    m = tl.full([BH], -1e30, tl.float32)  # finite: a split with no key leaves the sums at 0, not NaN
    s_sum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DP], tl.float32)
    lo = 0
    if WINDOW:
        lo = tl.maximum(n - window, 0)
    chunk = tl.cdiv(tl.cdiv(n - lo, SPLITS), TB) * TB  # this split's span, whole tiles
    start = lo + sp * chunk
    end = tl.minimum(start + chunk, n)
    for s0 in range(start, end, TB):
        pos = s0 + t
        ok = pos < end
        m, s_sum, acc = attend_tile(q, m, s_sum, acc, Kp, Vp, BT + b * sbt, pos, ok, ok[None, :], g,
                                    skn, skt, skg, svn, svt, svg, d, dm, BS, IEEE)
    out = hm[:, None] & dm[None, :]
    if SPLITS == 1:
        o = acc / tl.maximum(s_sum, 1e-30)[:, None]
        tl.store(O + b * sob + heads[:, None] * soh + d[None, :], o.to(O.dtype.element_ty), mask=out)
    else:  # partials [B, H, P, DP] (acc) and [B, H, P] (max, sum), fp32
        tl.store(O + b * sob + heads[:, None] * soh + sp * sop + d[None, :], acc, mask=out)
        tl.store(M + b * smb + heads * smh + sp, m, mask=hm)
        tl.store(L + b * smb + heads * smh + sp, s_sum, mask=hm)


@triton.jit
def _combine(ACC, M, L, O, sab, sah, sap, smb, smh, sob, soh,
             D: tl.constexpr, DP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr):
    b = tl.program_id(0)
    hd = tl.program_id(1)
    p = tl.arange(0, PP)
    d = tl.arange(0, DP)
    pm = p < P
    m = tl.load(M + b * smb + hd * smh + p, mask=pm, other=-float("inf"))
    s = tl.load(L + b * smb + hd * smh + p, mask=pm, other=0.0)
    acc = tl.load(ACC + b * sab + hd * sah + p[:, None] * sap + d[None, :], mask=pm[:, None] & (d < D)[None, :],
                  other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # empty splits carry max -1e30: weight 0 next to any real one
    o = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(s * w, 0), 1e-30)
    tl.store(O + b * sob + hd * soh + d, o.to(O.dtype.element_ty), mask=d < D)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def num_splits(B: int, G: int, device: torch.device) -> int:
    """Splits per sequence so that B x G x P programs fill the GPU (1 for large batches): a function of the
    batch shape only, never of the lengths."""
    return max(1, min(MAX_SPLITS, -(-_sms(device) * PROGRAMS_PER_SM // (B * G))))


def paged_decode(q_BHK: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, window: int | None = None, splits: int | None = None,
                 stages: int = STAGES, f16: bool | None = None, warps: int = 4,
                 tile: int | None = None) -> torch.Tensor:
    """The launch (titan_mm.kernels.paged_decode_attention checks the shapes and picks it): -> [B, H, K].
    ``stages``, ``f16`` (default ``dot_in_fp16``), ``warps`` and ``tile`` (keys a tile, a multiple of 16; default
    ``keys_a_tile``) are bench/paged_decode.py's knobs."""
    B, H, K = q_BHK.shape
    G = k_pool.shape[2]
    q = q_BHK.contiguous()
    o = torch.empty_like(q)
    P = num_splits(B, G, q.device) if splits is None else splits
    DP = max(16, next_pow2(K))
    if P > 1:
        part = torch.empty(B, H, P, DP, device=q.device, dtype=torch.float32)
        ml = torch.empty(2, B, H, P, device=q.device, dtype=torch.float32)
        dst, m, lsum = part, ml[0], ml[1]
    else:
        dst, m, lsum = o, o, o  # M / L unused
    hpg = H // G
    _paged_decode[(B, G, P)](
        q, k_pool, v_pool, dst, m, lsum, block_tables, seq_lens, K ** -0.5, window or 0,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2) if P > 1 else 0, m.stride(0), m.stride(1),
        block_tables.stride(0),
        HPG=hpg, BH=max(16, next_pow2(hpg)), BS=k_pool.shape[1], TB=tile or keys_a_tile(k_pool, P), D=K, DP=DP,
        SPLITS=P,
        WINDOW=window is not None, IEEE=q.dtype == torch.float32,
        F16=dot_in_fp16(q, k_pool) if f16 is None else f16,
        num_warps=warps, num_stages=stages,
    )
    if P > 1:
        _combine[(B, H)](part, m, lsum, o, part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
                         o.stride(0), o.stride(1), D=K, DP=DP, P=P, PP=next_pow2(P), num_warps=4)
    return o
