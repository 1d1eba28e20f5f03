"""Paged attention over a packed batch of mixed rows: each sequence brings q_len >= 1 new query tokens (decode rows
1, prefill chunks more, an idle row 0), laid back to back in [T, H, K] by ``cu_seqlens_q``, and attends causally
to its whole context read in place from the KV pool (its cached prefix, then its own new tokens, written there
before the call). One launch for a serving step's decode and prefill rows alike (vLLM's unified attention).

Grid (query tile, kv head). A query tile is BQ consecutive tokens of one sequence times the H / G query heads of
the kv head, BM = BQ x H / G rows of tl.dot; sequence b owns tiles cu_q[b] // BQ + b .. cu_q[b + 1] // BQ + b,
so T // BQ + B tiles cover any batch of T tokens in B sequences: the grid is a function of those two host-known
sizes only. A program finds its sequence by binary search over ``cu_seqlens_q`` (device memory), reads its
length from ``seq_lens`` and walks its keys up to the tile's last query position in tiles of TB tokens
(titan_mm/kernels/paged_decode.py's ``attend_tile``: per-token block lookup, online softmax, fp32 accumulation,
IEEE fp32 for fp32 pools, fp16 dots for fp8 pools under bf16 queries, its ``STAGES``); a key is kept where it is at or before the row's position (and inside its sliding
window). Tiles past a sequence's tokens return at once. No host sync.

Pure decode steps keep titan_mm/kernels/paged_decode.py: it splits each sequence's keys over several programs
(flash-decoding) when the batch is small, which a batch-1 decode step needs to fill the GPU; this kernel gives a
one-token row one program per kv head. Legend: T tokens, B sequences, H query heads, G kv heads, K head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2
from .paged_decode import STAGES, TILE, attend_tile, dot_in_fp16


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
def _paged_mixed(Q, Kp, Vp, O, BT, LENS, CUQ, scale, window, B,
                 sqt, sqh, skn, skt, skg, svn, svt, svg, sot, soh, sbt,
                 HPG: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr):
    tile = tl.program_id(0)
    g = tl.program_id(1)
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
    q = (q.to(tl.float32) * scale).to(tl.float16 if F16 else Q.dtype.element_ty)  # attend_tile: k / v to q's
    m = tl.full([BM], -1e30, tl.float32)
    s_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    end = tl.minimum(first + BQ, n)  # keys past the tile's last query position are never seen
    lo = 0
    if WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    t = tl.arange(0, TB)
    for s0 in range(lo, end, TB):
        pos = s0 + t
        ok = pos < end
        keep = live[:, None] & ok[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW:
            keep = keep & (qpos[:, None] - pos[None, :] < window)
        m, s_sum, acc = attend_tile(q, m, s_sum, acc, Kp, Vp, BT + b * sbt, pos, ok, keep, g,
                                    skn, skt, skg, svn, svt, svg, d, dm, BS, IEEE)
    o = acc / tl.maximum(s_sum, 1e-30)[:, None]
    tl.store(O + tok[:, None] * sot + head[:, None] * soh + d[None, :], o.to(O.dtype.element_ty),
             mask=live[:, None] & dm[None, :])


def tile_rows(T: int, B: int, hpg: int, narrow: bool) -> tuple[int, int]:
    """(BM, BQ): tl.dot rows per program and the query tokens they hold. A step of one-token rows (T <= B) takes
    16 rows (the least tl.dot takes); one with longer rows 64, so a prefill chunk's keys are read once per 64 / hpg
    queries, but 16 for ``narrow`` (fp32) pools, whose tiles would not fit in shared memory. Host-known sizes only."""
    bm = max(16 if T <= B or narrow else 64, next_pow2(hpg))
    return bm, bm // hpg


def paged_mixed(q_THK: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The launch (titan_mm.kernels.paged_attention checks the shapes and picks it): -> [T, H, K]."""
    T, H, K = q_THK.shape
    B = cu_seqlens_q.shape[0] - 1
    G = k_pool.shape[2]
    q = q_THK.contiguous()
    o = torch.empty_like(q)
    hpg = H // G
    bm, bq = tile_rows(T, B, hpg, q.dtype == torch.float32)
    _paged_mixed[(T // bq + B, G)](
        q, k_pool, v_pool, o, block_tables, seq_lens, cu_seqlens_q, K ** -0.5, window or 0, B,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), o.stride(0), o.stride(1), block_tables.stride(0),
        HPG=hpg, BQ=bq, BM=bm, BS=k_pool.shape[1], TB=TILE, D=K, DP=max(16, next_pow2(K)),
        WINDOW=window is not None, IEEE=q.dtype == torch.float32, F16=dot_in_fp16(q, k_pool), num_warps=4,
        num_stages=STAGES,
    )
    return o
