"""Bias + GELU (tanh approximation) for the ViT MLP, forward and backward, as triton_ops.

gelu_tanh(z) = 0.5 z (1 + tanh(u)) = z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3): one exp and one
division per element (triton 3.6 has no tl.math.tanh import path that works everywhere), and the same
sigmoid gives the derivative in the backward: s + 2 z s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 z^2).
Forward: [BR, BD] tiles, 1-D grid in row-major order (consecutive programs stream consecutive memory).
Backward: programs = (ranges of ROWS consecutive rows) x (column blocks), row-range-major, so programs
running side by side cover whole rows; each walks its rows tile by tile, keeps the column sums of dx for db
in fp32 registers and writes one db partial; the partials ([row ranges, D] fp32, about 1 MB at the ViT
shape) are summed by one more launch (`_tl.col_sums`). With PREFETCH the next tile's loads are issued before the current tile is
computed and stored (a `while` loop is not pipelined by the compiler). Tiles, warps, programs per SM and
prefetch are picked per width and dtype by `_utils.Tuner`.
Legend: N rows (patch tokens), D width.
"""


import torch
import triton
import triton.language as tl

from ._tl import col_sums, load_tile_pair
from ._utils import Tuner, as_rows, new_empty, next_pow2, sm_count, two_input_op, wrap_triton, writes

# module-level constexprs: inductor copies them next to the kernel source when it compiles the traced launch
_GELU_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_A = tl.constexpr(0.044715)


def _tiles(d, cands):
    out = []
    for br, bd, warps, *bwd in cands:
        bd = min(bd, max(16, next_pow2(d)))
        c = dict(BR=br, BD=bd, num_warps=max(1, min(warps, br * bd // 256)))
        if bwd:  # backward: programs per SM (not a kernel argument) and prefetch
            c["PPS"], c["PREFETCH"] = bwd
        if c not in out:
            out.append(c)
    return out


def _fwd_configs(key):
    # BD 256 / 512 waste little on widths that are not powers of two (4304 = 16 x 269: 1% / 7% masked)
    return _tiles(key[0], [(8, 256, 4), (4, 512, 4), (16, 256, 8), (2, 1024, 4)])


def _bwd_configs(key):
    # PPS: about as many programs per SM as fit at once by registers (~72 per thread: 7 x 4 warps, 3 x 8).
    # Without prefetch (8, 256, 4 warps, PPS 6) was the pick at the ViT shape on the H200 (74% of the copy
    # ceiling fwd+bwd); prefetch holds two tiles, so fewer programs may fit per SM.
    return _tiles(key[0], [(4, 512, 4, 6, False), (8, 256, 4, 6, False), (8, 512, 8, 3, False),
                           (8, 256, 4, 6, True), (4, 512, 4, 4, True), (8, 256, 4, 3, True)])


_FWD = Tuner("bias_gelu_fwd", _fwd_configs)
_BWD = Tuner("bias_gelu_bwd", _bwd_configs)


@triton.jit
def _bias_gelu_fwd_kernel(X, stride_x, B, Y, N, D, NCB, BR: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    rb = pid // NCB
    cols = (pid - rb * NCB) * BD + tl.arange(0, BD)
    row0 = rb.to(tl.int64) * BR
    r = tl.arange(0, BR)
    mc = cols < D
    m = (r < N - row0)[:, None] & mc[None, :]
    x = tl.load(X + row0 * stride_x + r[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    z = x + tl.load(B + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    y = z / (1.0 + tl.exp(-2.0 * _GELU_C * (z + _GELU_A * z * z * z)))
    tl.store(Y + row0 * D + r[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=m)


writes(_bias_gelu_fwd_kernel, 'Y')


@triton.jit
def _bias_gelu_bwd_kernel(
    DY, stride_dy, X, stride_x, B, DX, DB_PART, N, D, NCB, ROWS,
    BR: tl.constexpr, BD: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    rr = pid // NCB  # row range (ROWS rows) and column block of this program, row-range-major
    cols = (pid - rr * NCB) * BD + tl.arange(0, BD)
    start = rr.to(tl.int64) * ROWS
    n_here = N - start
    X += start * stride_x
    DY += start * stride_dy
    DX += start * D
    r = tl.arange(0, BR)
    mc = cols < D
    bias = tl.load(B + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    if PREFETCH:  # the next tile's loads are in flight while this tile is computed and stored
        x_next, dy_next = load_tile_pair(X, stride_x, DY, stride_dy, r, cols, (r < n_here)[:, None] & mc[None, :])
    i = 0
    while i < ROWS:  # ROWS is a multiple of BR (a `while`: the CPU interpreter cannot run a runtime `range`)
        rows = i + r
        m = (rows < n_here)[:, None] & mc[None, :]
        if PREFETCH:
            z, dy = x_next.to(tl.float32) + bias, dy_next.to(tl.float32)
            nxt = rows + BR
            mn = ((nxt < n_here) & (nxt < ROWS))[:, None] & mc[None, :]
            x_next, dy_next = load_tile_pair(X, stride_x, DY, stride_dy, nxt, cols, mn)
        else:
            x_t, dy_t = load_tile_pair(X, stride_x, DY, stride_dy, rows, cols, m)
            z, dy = x_t.to(tl.float32) + bias, dy_t.to(tl.float32)
        z2 = z * z
        s = 1.0 / (1.0 + tl.exp(-2.0 * _GELU_C * (z + _GELU_A * z2 * z)))
        dgelu = s + 2.0 * _GELU_C * z * s * (1.0 - s) * (1.0 + 3.0 * _GELU_A * z2)
        dx = tl.where(m, dy * dgelu, 0.0)
        tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
        acc += dx
        i += BR
    tl.store(DB_PART + rr.to(tl.int64) * D + cols, tl.sum(acc, axis=0), mask=mc)


writes(_bias_gelu_bwd_kernel, 'DX', 'DB_PART')


def bias_gelu_fwd(x, b, op=False):
    """op=True: from the triton_op body (traceable launches through `wrap_triton`); False: eager Function."""
    kern = wrap_triton(_bias_gelu_fwd_kernel) if op else _bias_gelu_fwd_kernel
    x2 = as_rows(x)
    b = b.contiguous()
    n, d = x2.shape
    y = new_empty(x.shape, x.dtype, x.device)
    if n * d > 0:
        def launch(c):
            assert c["BR"] * max(x2.stride(0), d) < 2**31
            ncb = triton.cdiv(d, c["BD"])
            kern[(triton.cdiv(n, c["BR"]) * ncb,)](x2, x2.stride(0), b, y, n, d, ncb, **c)

        traced = kern is not _bias_gelu_fwd_kernel  # no timing while traced: the pick goes into the graph
        launch(_FWD.pick((int(d), x.dtype), None if traced else launch))
    return y


def bias_gelu_bwd(dy, x, b, op=False):
    kern = wrap_triton(_bias_gelu_bwd_kernel) if op else _bias_gelu_bwd_kernel
    x2, d2 = as_rows(x), as_rows(dy)
    b = b.contiguous()
    n, d = x2.shape
    dx = new_empty(x.shape, x.dtype, x.device)
    if n * d == 0:
        return dx, torch.zeros_like(b)
    sms = sm_count(x.device)

    def launch(c):
        c = dict(c)
        ncb = triton.cdiv(d, c["BD"])
        # programs = row ranges x column blocks, about PPS per SM; one fp32 row of db partials per row range
        n_rr = max(1, c.pop("PPS") * sms // ncb)
        rows = triton.cdiv(triton.cdiv(n, n_rr), c["BR"]) * c["BR"]  # per range, whole tiles
        n_rr = triton.cdiv(n, rows)
        assert rows * max(x2.stride(0), d2.stride(0), d) < 2**31
        db_part = new_empty((n_rr, d), torch.float32, x.device)
        kern[(n_rr * ncb,)](
            d2, d2.stride(0), x2, x2.stride(0), b, dx, db_part, n, d, ncb, rows, **c,
        )
        return db_part

    traced = kern is not _bias_gelu_bwd_kernel
    db_part = launch(_BWD.pick((int(d), x.dtype), None if traced else launch))
    return dx, col_sums(db_part, b.dtype, op)


bias_gelu_op, BiasGeluFunction = two_input_op("bias_gelu", bias_gelu_fwd, bias_gelu_bwd, "BiasGeluFunction")
