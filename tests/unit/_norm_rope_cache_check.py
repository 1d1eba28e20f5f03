"""The fused decode prologue (titan_mm.kernels.norm_rope_cache) against the PyTorch ops it replaces, composed, case by
case; shared by tests/unit/test_norm_rope_cache.py (the Triton interpreter: import this only in its child process,
where TRITON_INTERPRET=1 is set) and tests/gpu/test_norm_rope_cache_gpu.py. The bounds are derived in the unit
test's docstring."""

from __future__ import annotations

import torch

from titan_mm import kernels as K
from titan_mm.kernels.norm_rope_cache import norm_rope_cache as launch
from titan_mm.models.qwen2_5_vl.model import chunked_mrope_cos_sin
from titan_mm.models.qwen3_vl.model import mrope_cos_sin
from titan_mm.nn.norm import rms_norm
from titan_mm.nn.rope import apply_rope, rope_cos_sin, rope_inv_freq

U = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
"""Unit roundoff per dtype."""

# H, G, K, block size, dtype, q/k norm, table ("1d", "half", "mrope3" interleaved, "mrope25" chunked), fused qkv row
CASES = [(8, 2, 64, 16, torch.float32, True, "1d", True), (4, 4, 128, 8, torch.float32, True, "half", False),
         (16, 2, 128, 128, torch.float32, False, "mrope3", True), (4, 2, 80, 16, torch.float32, True, "1d", True),
         (8, 1, 128, 16, torch.float32, True, "mrope25", True), (6, 2, 64, 16, torch.float16, True, "mrope25", True),
         (8, 1, 128, 16, torch.bfloat16, True, "1d", True), (16, 2, 128, 8, torch.bfloat16, True, "mrope3", False),
         (4, 4, 64, 16, torch.bfloat16, False, "1d", True)]


def _swap(y: torch.Tensor, D: int, sign: float) -> torch.Tensor:
    """(y1, y2) -> (sign * y2, y1): rotate_half for sign -1, the partner's magnitude for +1."""
    return torch.cat([sign * y[..., D // 2:], y[..., : D // 2]], -1)


def _inputs(H, G, D, BS, dt, norm, table, fused, B, device, g):
    N = (H + 2 * G) * D
    if fused:  # the fused wqkv output row: q, k, v are column views of it
        row = torch.randn(B, N + 3, generator=g).to(dt)[:, :N]
        q, k, v = (t.view(B, -1, D) for t in row.split([H * D, G * D, G * D], -1))
    else:
        q, k, v = (torch.randn(B, h, D, generator=g).to(dt) for h in (H, G, G))
    for t in (q, k, v):
        t[B - 1] = t[B - 2]  # two pad rows: the same inputs, the same scratch slot
    qw, kw = ((1 + 0.3 * torch.randn(D, generator=g)).to(dt) for _ in "qk") if norm else (None, None)
    inv, _ = rope_inv_freq(D, 10000.0)
    pos3 = torch.randint(0, 900, (3, B, 1), generator=g)
    pos3[:, B - 2:] = 0
    if table in ("1d", "half"):
        cos, sin = (t[:, 0] for t in rope_cos_sin(pos3[0], inv, 1.0, dt))
        if table == "half":
            cos, sin = cos[:, : D // 2], sin[:, : D // 2]
    else:
        sec = (24, 20, 20) if D == 128 else (16, 8, 8)
        mrope = mrope_cos_sin if table == "mrope3" else chunked_mrope_cos_sin
        cos, sin = (t[:, 0] for t in mrope(pos3, inv, sec, dt))
    NB = B // BS + 4
    kp, vp = torch.randn(NB, BS, G, D, generator=g).to(dt), torch.randn(NB, BS, G, D, generator=g).to(dt)
    slots = torch.randperm((NB - 1) * BS, generator=g)[:B]
    slots[B - 2:] = (NB - 1) * BS  # the scratch block's first slot
    ts = (q, k, v, qw, kw, cos, sin, kp, vp, slots)
    return tuple(None if t is None else t.to(device) for t in ts)


def check(case, B: int = 6, device: str = "cpu", interpreted: bool = False, seed: int = 0) -> list[str]:
    """Run one case of CASES with B rows (the last two pad rows); -> what failed (empty: passed). ``interpreted``:
    Triton 3.6's interpreter truncates its bf16 casts, a whole ulp per rounding (``_convert_float``)."""
    H, G, D, BS, dt, norm, table, fused = case
    name = f"B={B} H={H} G={G} K={D} BS={BS} {dt} norm={norm} {table} fused={fused}"
    g = torch.Generator().manual_seed(seed)
    q, k, v, qw, kw, cos, sin, kp0, vp0, slots = _inputs(H, G, D, BS, dt, norm, table, fused, B, device, g)
    eps, u, bad = 1e-6, U[dt], []
    kp, vp, kp2, vp2 = kp0.clone(), vp0.clone(), kp0.clone(), vp0.clone()
    got = K.norm_rope_cache(q, k, v, qw, kw, eps, cos, sin, kp, vp, slots)
    direct = launch(q, k, v, qw, kw, eps, cos, sin, kp2, vp2, slots)
    if not (torch.equal(got, direct) and torch.equal(kp, kp2) and torch.equal(vp, vp2)):
        bad.append(f"{name}: the dispatch did not take the kernel")
    # the references composed, as the unfused decode step runs them
    yq, yk = (rms_norm(q, qw, eps), rms_norm(k, kw, eps)) if norm else (q, k)
    rq, rk = apply_rope(yq, yk, cos, sin)
    kr, vr = kp0.clone(), vp0.clone()
    for pool, new in ((kr, rk), (vr, v)):
        pool.view(-1, G, D).index_copy_(0, slots, new.to(pool.dtype))
    if not torch.equal(vp, vr):
        bad.append(f"{name}: v pool differs")
    others = torch.ones(kp.shape[0] * BS, dtype=torch.bool, device=kp.device)
    others[slots] = False
    if not torch.equal(kp.view(-1, G, D)[others], kp0.view(-1, G, D)[others]):
        bad.append(f"{name}: a slot no row names changed")
    c2, s2 = (torch.cat([t[:, : D // 2]] * 2, -1).double()[:, None] for t in (cos, sin))
    wk = kp.view(-1, G, D)[slots]
    for out, x, w, y, ref in ((got, q, qw, yq, rq), (wk, k, kw, yk, rk)):
        if dt == torch.float32:
            y = y.double()
            tol = (D + 28) * u * ((y * c2).abs() + (_swap(y, D, 1) * s2).abs())
        else:  # the exact formula on the same inputs (norm included); kernel and references each within theirs
            y = x.double()
            if norm:
                y = w.double() * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
            A = (y * c2).abs() + (_swap(y, D, 1) * s2).abs()
            exact = y * c2 + _swap(y, D, -1) * s2
            r = 2 * u if interpreted and dt == torch.bfloat16 else u
            kern = (2 * r + (D + 16) * U[torch.float32]) * A + r * exact.abs()
            over = (out.double() - exact).abs() - kern
            if not bool((over <= 0).all()):
                bad.append(f"{name}: kernel vs exact over its bound by {float(over.max())}")
            tol = kern + (5 * u + (D + 16) * U[torch.float32]) * A + u * exact.abs()
        err = (out.double() - ref.double()).abs()
        if out.dtype != dt or not bool((err <= tol).all()):
            bad.append(f"{name}: kernel vs references max err {float(err.max())}, over by {float((err - tol).max())}")
    return bad
