"""Paged attention: the new query tokens of a serving step against their keys read in place from the KV pool. One
kernel for decode steps (one query per sequence) and mixed steps (each sequence brings q_len >= 1 new queries:
decode rows 1, prefill chunks more, an idle row 0, laid back to back in [T, H, K] by ``cu_seqlens_q``), each query
attending causally to its sequence's whole context (its cached prefix, then its own new tokens, written to the
pool before the call). vLLM's paged / unified attention, with flash-decoding's split online softmax.

A decode step is memory-bound: every cached key and value is read once. The gather path of titan_mm.nn.kv_cache
copies them into a dense [B, L, G, K] tensor first and then runs SDPA, reading them twice and writing them once;
this kernel walks each sequence's block table instead, so the pool is read once and nothing is written.

Grid (query tile, kv head, split). A query tile is BQ consecutive tokens of one sequence times the H / G query
heads of the kv head, BM = BQ x H / G rows of tl.dot (padded to 16 at least). Decode steps (``ONE_PER_ROW``): tile
b is sequence b's one token. Mixed steps: sequence b owns tiles cu_q[b] // BQ + b .. cu_q[b + 1] // BQ + b, so
T // BQ + B tiles cover any step of T tokens in B sequences, and a program finds its sequence by binary search over
``cu_seqlens_q`` (device memory); tiles past a sequence's tokens return at once. A program reads its sequence's
length from ``seq_lens`` and walks its keys up to the tile's last query position in tiles of TB tokens; a tile may
span several blocks (each token looks up its own block id), so small blocks (16) still give tl.dot 64-token tiles.
Per tile (``attend_tile``): keys [TB, K] -> scores [BM, TB], kept where the key is at or before the row's
position (and inside its sliding window) -> running max / sum -> values; fp32 accumulation, bf16 / fp16 pools
multiplied in their dtype, fp32 pools in IEEE fp32 (no TF32).

Nothing is host-known but the grid (T, B, G and the split count), so no host sync happens and a CUDA graph captured
for a batch size stays valid whatever the lengths. ``SPLITS`` (flash-decoding) cuts each tile's keys into that many
spans when the tiles x G programs would leave the GPU idle (small decode batches); each split writes its
unnormalized partial (max, sum, acc) and ``_combine`` merges them. The split count depends on B and G only.

A query with no key (a padded decode row of length 0) gets zeros. Legend: T query tokens, B sequences, H query
heads, G kv heads, K head dim, NB pool blocks, BS block size, MB blocks per table row, P splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._utils import next_pow2

TILE = 64
"""Keys per tile: a multiple of 16 for tl.dot, small enough that fp32 tiles fit Hopper's shared memory."""
PROGRAMS_PER_SM = 4
"""Target programs per SM when choosing the split count."""
MAX_SPLITS = 32


@triton.jit
def attend_tile(q, m, s_sum, acc, Kp, Vp, bt, pos, ok, keep, g, skn, skt, skg, svn, svt, svg, d, dm,
                BS: tl.constexpr, IEEE: tl.constexpr):
    """One tile of keys at positions ``pos`` [TB] (``ok``: inside the table row ``bt``) for the query rows ``q``
    [M, DP] of kv head ``g``: -> the online softmax's running max, sum and fp32 accumulator after it. ``keep``
    [M, TB]: which (row, key) pairs attend (the caller's causal / window / length mask)."""
    blk = tl.load(bt + pos // BS, mask=ok, other=0).to(tl.int64)
    off = blk * skn + (pos % BS) * skt + g * skg
    k = tl.load(Kp + off[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
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
    v = tl.load(Vp + voff[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, s_sum, acc


@triton.jit
def _sequence_of(CUQ, tile, B, BQ: tl.constexpr):
    """The sequence whose query tiles hold ``tile``: the last b with cu_q[b] // BQ + b <= tile."""
    lo = tl.full([], 0, tl.int32)  # int32 tensors from the start: loop-carried values keep one type
    hi = tl.full([], 0, tl.int32) + B
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(CUQ + mid) // BQ + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention(Q, Kp, Vp, O, M, L, BT, LENS, CUQ, scale, window, B,
                     sqt, sqh, skn, skt, skg, svn, svt, svg, sot, soh, sop, smt, smh, sbt,
                     HPG: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr,
                     D: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr, ONE_PER_ROW: tl.constexpr,
                     WINDOW: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    if ONE_PER_ROW:  # a decode step: tile b is sequence b's one query
        b = tile
        q0 = tile
        q1 = tile + 1
        t0 = tile
    else:
        b = _sequence_of(CUQ, tile, B, BQ)
        q0 = tl.load(CUQ + b)
        q1 = tl.load(CUQ + b + 1)
        t0 = q0 + (tile - (q0 // BQ + b)) * BQ  # this tile's first token
        if t0 >= q1:
            return
    n = tl.load(LENS + b)
    first = n - (q1 - q0) + (t0 - q0)  # the tile's first query position
    r = tl.arange(0, BM)
    d = tl.arange(0, DP)
    tok = t0 + r // HPG
    head = g * HPG + r % HPG
    live = (r < BQ * HPG) & (tok < q1)
    qpos = first + r // HPG
    dm = d < D
    q = tl.load(Q + tok[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=live[:, None] & dm[None, :],
                other=0.0)
    q = (q.to(tl.float32) * scale).to(Kp.dtype.element_ty)
    m = tl.full([BM], -1e30, tl.float32)
    s_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    end = tl.minimum(first + BQ, n)  # keys past the tile's last query position are never seen
    lo = 0
    if WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(end - lo, SPLITS), TB) * TB  # this split's span, whole tiles
    start = lo + sp * chunk
    stop = tl.minimum(start + chunk, end)
    t = tl.arange(0, TB)
    for s0 in range(start, stop, TB):
        pos = s0 + t
        ok = pos < stop
        keep = live[:, None] & ok[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW:
            keep = keep & (qpos[:, None] - pos[None, :] < window)
        m, s_sum, acc = attend_tile(q, m, s_sum, acc, Kp, Vp, BT + b * sbt, pos, ok, keep, g,
                                    skn, skt, skg, svn, svt, svg, d, dm, BS, IEEE)
    out = live[:, None] & dm[None, :]
    if SPLITS == 1:
        o = acc / tl.maximum(s_sum, 1e-30)[:, None]
        tl.store(O + tok[:, None] * sot + head[:, None] * soh + d[None, :], o.to(O.dtype.element_ty), mask=out)
    else:  # partials [T, H, P, DP] (acc) and [T, H, P] (max, sum), fp32
        tl.store(O + tok[:, None] * sot + head[:, None] * soh + sp * sop + d[None, :], acc, mask=out)
        tl.store(M + tok * smt + head * smh + sp, m, mask=live)
        tl.store(L + tok * smt + head * smh + sp, s_sum, mask=live)


@triton.jit
def _combine(ACC, M, L, O, sat, sah, sap, smt, smh, sot, soh,
             D: tl.constexpr, DP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr):
    t = tl.program_id(0)
    hd = tl.program_id(1)
    p = tl.arange(0, PP)
    d = tl.arange(0, DP)
    pm = p < P
    m = tl.load(M + t * smt + hd * smh + p, mask=pm, other=-float("inf"))
    s = tl.load(L + t * smt + hd * smh + p, mask=pm, other=0.0)
    acc = tl.load(ACC + t * sat + hd * sah + p[:, None] * sap + d[None, :], mask=pm[:, None] & (d < D)[None, :],
                  other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # empty splits carry max -1e30: weight 0 next to any real one
    o = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(s * w, 0), 1e-30)
    tl.store(O + t * sot + hd * soh + d, o.to(O.dtype.element_ty), mask=d < D)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def num_splits(B: int, G: int, device: torch.device) -> int:
    """Splits per sequence so that B x G x P programs fill the GPU (1 for large batches): a function of the
    batch shape only, never of the lengths."""
    return max(1, min(MAX_SPLITS, -(-_sms(device) * PROGRAMS_PER_SM // (B * G))))


def tile_rows(T: int, B: int, hpg: int, narrow: bool) -> tuple[int, int]:
    """(BM, BQ) of a mixed step: tl.dot rows per program and the query tokens they hold. A step of one-token rows
    (T <= B) takes 16 rows (the least tl.dot takes); one with longer rows 64, so a prefill chunk's keys are read
    once per 64 / hpg queries, but 16 for ``narrow`` (fp32) pools, whose tiles would not fit in shared memory.
    Host-known sizes only."""
    bm = max(16 if T <= B or narrow else 64, next_pow2(hpg))
    return bm, bm // hpg


def _launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None, window: int | None, tiles: int, bm: int,
            bq: int, P: int) -> torch.Tensor:
    """The kernel over ``tiles`` query tiles of ``bq`` tokens (``cu_seqlens_q`` None: one query per sequence),
    ``P`` splits merged by _combine when more than 1. -> [T, H, K]."""
    T, H, K = q.shape
    G = k_pool.shape[2]
    q = q.contiguous()
    o = torch.empty_like(q)
    DP = max(16, next_pow2(K))
    if P > 1:
        part = torch.empty(T, H, P, DP, device=q.device, dtype=torch.float32)
        ml = torch.empty(2, T, H, P, device=q.device, dtype=torch.float32)
        dst, m, lsum = part, ml[0], ml[1]
    else:
        dst, m, lsum = o, o, o  # M / L unused
    _paged_attention[(tiles, G, P)](
        q, k_pool, v_pool, dst, m, lsum, block_tables, seq_lens, seq_lens if cu_seqlens_q is None else cu_seqlens_q,
        K ** -0.5, window or 0, block_tables.shape[0],
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2) if P > 1 else 0, m.stride(0), m.stride(1), block_tables.stride(0),
        HPG=H // G, BQ=bq, BM=bm, BS=k_pool.shape[1], TB=TILE, D=K, DP=DP, SPLITS=P,
        ONE_PER_ROW=cu_seqlens_q is None, WINDOW=window is not None, IEEE=k_pool.dtype == torch.float32,
        num_warps=4,
    )
    if P > 1:
        _combine[(T, H)](part, m, lsum, o, part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
                         o.stride(0), o.stride(1), D=K, DP=DP, P=P, PP=next_pow2(P), num_warps=4)
    return o


def paged_decode(q_BHK: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, window: int | None = None, splits: int | None = None) -> torch.Tensor:
    """A decode step (titan_mm.kernels.paged_decode_attention checks the shapes and picks it): one query per
    sequence, split over the keys as num_splits says (or ``splits``). -> [B, H, K]."""
    B, H, _ = q_BHK.shape
    G = k_pool.shape[2]
    P = num_splits(B, G, q_BHK.device) if splits is None else splits
    return _launch(q_BHK, k_pool, v_pool, block_tables, seq_lens, None, window, B, max(16, next_pow2(H // G)), 1, P)


def paged_mixed(q_THK: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """A mixed step (titan_mm.kernels.paged_attention checks the shapes and picks it): q_len >= 1 queries per
    sequence, packed by ``cu_seqlens_q``; no split (its query tiles fill the GPU). -> [T, H, K]."""
    T, H, _ = q_THK.shape
    B = block_tables.shape[0]
    bm, bq = tile_rows(T, B, H // k_pool.shape[2], k_pool.dtype == torch.float32)
    return _launch(q_THK, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, window, T // bq + B, bm, bq, 1)
