"""Serving's decode-step attention prologue in one launch: q/k RMSNorm, RoPE on q and k, and the paged KV-cache
write of k and v.

Unfused, a decode step runs per layer a q-norm, a k-norm and a RoPE kernel (the Triton ops of rms_norm.py and
rope.py with kernels on), then the cache write (titan_mm.nn.kv_cache.KVCache.write: an index_select and an
index_copy_ for each of k and v): at least 7 launches for a token's few kilobytes. Here one program per token
(row) loads its q, k and v heads once, through their strides (the fused wqkv output row q | k | v as column
views, or separate tensors alike), writes the normed, rotated q out, and stores k and v straight into their
cache slot (block slot // BS, offset slot % BS of the pools [NB, BS, G, K]).

Arithmetic, as the unfused Triton ops round (and the PyTorch references of titan_mm.nn): the norm's statistics in
fp32, the normalized value rounded to the input dtype before the weight multiply (HF), the product rounded to it;
the rotation in fp32 with one rounding, to q's / k's dtype (k then to the pool's dtype, as KVCache.write casts);
v is copied, cast to the pool's dtype. The tables cos / sin [B, X] (X = K, HF layout, or K / 2) are per token, so
M-RoPE's tables (interleaved or chunked axis sections), built once per step by the model, run through it
unchanged. No norm weights (a model without q/k norm): RoPE and the write only.

No autograd (decoding), no tuner: a fixed launch per head layout, so a captured CUDA graph replays it. Pad rows of a
decode step write their k / v to the scratch slot their table names, like any row.
Legend: B tokens (one per sequence), H query heads, G kv heads, K head dim, HALF = K / 2, X table width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2


@triton.jit
def _heads(X, sxb, sxh, b, H, HALF, W, eps, c, sn, HAS_NORM: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    """Row ``b``'s H heads of X, normed (HAS_NORM) and rotated: -> the halves (fp32, unrounded) and their mask."""
    h = tl.arange(0, BH)
    j = tl.arange(0, BD)
    m = (h < H)[:, None] & (j < HALF)[None, :]
    xp = X + b * sxb + (h * sxh)[:, None] + j[None, :]
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(W + j, mask=j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        dt = X.dtype.element_ty  # HF: normalized, cast to the input dtype, times the weight, in that dtype
        x1 = (w1[None, :] * (x1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2[None, :] * (x2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * sn[None, :]
    o2 = x2 * c[None, :] + x1 * sn[None, :]
    return o1, o2, h, j, m


@triton.jit
def _norm_rope_cache(Q, sqb, sqh, K, skb, skh, V, svb, svh, QO, QW, KW, COS, SIN, scb, SLOTS, KP, VP,
                     spn, spt, spg, svn, svt, svg, eps, HQ, G, HALF, BS,
                     HAS_NORM: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr,
                     BDV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BD)
    c = tl.load(COS + b * scb + j, mask=j < HALF, other=0.0).to(tl.float32)
    sn = tl.load(SIN + b * scb + j, mask=j < HALF, other=0.0).to(tl.float32)
    # q: normed, rotated, out contiguous [B, H, K]
    o1, o2, h, j, m = _heads(Q, sqb, sqh, b, HQ, HALF, QW, eps, c, sn, HAS_NORM, BHQ, BD)
    qp = QO + b * (HQ * 2 * HALF) + (h * (2 * HALF))[:, None] + j[None, :]
    tl.store(qp, o1.to(QO.dtype.element_ty), mask=m)
    tl.store(qp + HALF, o2.to(QO.dtype.element_ty), mask=m)
    # k: normed, rotated, rounded to k's dtype, then into its slot in the pool's dtype (KVCache.write's cast)
    slot = tl.load(SLOTS + b).to(tl.int64)
    blk = slot // BS
    off = slot - blk * BS
    o1, o2, h, j, m = _heads(K, skb, skh, b, G, HALF, KW, eps, c, sn, HAS_NORM, BHK, BD)
    kp = KP + blk * spn + off * spt + (h * spg)[:, None] + j[None, :]
    tl.store(kp, o1.to(K.dtype.element_ty).to(KP.dtype.element_ty), mask=m)
    tl.store(kp + HALF, o2.to(K.dtype.element_ty).to(KP.dtype.element_ty), mask=m)
    # v: copied whole into its slot
    d = tl.arange(0, BDV)
    mv = (h < G)[:, None] & (d < 2 * HALF)[None, :]
    v = tl.load(V + b * svb + (h * svh)[:, None] + d[None, :], mask=mv, other=0.0)
    tl.store(VP + blk * svn + off * svt + (h * svg)[:, None] + d[None, :], v.to(VP.dtype.element_ty), mask=mv)


def norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor | None,
                    k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The launch (titan_mm.kernels.norm_rope_cache checks the layouts and picks it): q [B, H, K], k / v [B, G, K]
    (unit last stride), cos / sin [B, X] (a stride-0 row dim broadcasts one table), pools [NB, BS, G, K] (unit last
    stride), slots [B] -> q normed and rotated, contiguous [B, H, K]; k and v written into their slots."""
    B, H, D = q.shape
    G = k.shape[1]
    qo = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return qo
    half = D // 2
    has_norm = q_w is not None
    _norm_rope_cache[(B,)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), qo,
        q_w if has_norm else q, k_w if has_norm else k, cos, sin, cos.stride(0), slots, k_pool, v_pool,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        float(eps), H, G, half, k_pool.shape[1],
        HAS_NORM=has_norm, BHQ=next_pow2(H), BHK=next_pow2(G), BD=next_pow2(half), BDV=next_pow2(D),
        num_warps=4 if next_pow2(H) * next_pow2(half) <= 2048 else 8,
    )
    return qo
