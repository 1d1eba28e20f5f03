"""The MoE router's work after its GEMM as one Triton pass per block of token rows (kernel op ``moe_routing``).

    forward   logits [N, E] -> p = softmax(logits) in fp32; the top-k of each row (K passes of one (max, lowest
              index of the max) reduction over the row in registers); top_w = p at those experts (divided by their
              sum with norm_topk_prob) in the logits' dtype, top_i int64; and each program's [2, E] partials of the
              aux statistics (assignment counts, prob sums; rows weighted by ``valid``), summed over the programs
              by one more launch in a fixed order (no float atomics: the same bits every run)
    backward  d logits = p * (dp - <dp, p>), dp = valid * d(prob sums) plus, at each row's K experts, the top-k
              weights' gradient (through the renormalization); p is recomputed from the saved logits, so the
              forward writes no [N, E] probabilities

The reference is titan_mm.nn.moe.route_stats (softmax, torch.topk, renormalization, aux_stats: 6-8
kernels); the kernels agree with it up to fp32 rounding. Ties: the lower expert index first (torch.topk leaves
the order of equal values unspecified), so the indices equal the reference's whenever a row's values are
distinct. The top-k runs on the logits (softmax is monotonic): probabilities equal in fp32 but from distinct
logits rank by the logits. A row with a NaN logit, or fewer than K finite ones, gets indices in [0, E) but
otherwise unspecified. Launches: ROWS rows per forward program (one partial row each, its row tiles in a loop), TILE
elements per register tile, WARPS warps; no tuner.
Legend: N tokens, E experts, K top-k.
"""

import torch
import triton
import triton.language as tl

from ._tl import _col_sum_kernel
from ._utils import new_empty, next_pow2, wrap_triton, writes

ROWS = 64  # rows per forward program: 256 [2, E] partial rows at 16,384 tokens (tests set fewer)
TILE = 1024  # fp32 elements of one [rows, E] register tile: 4 a thread at 8 warps
WARPS = 8  # with TILE: no spills for sm_90 at E 8-2048 (ptxas -v: 80-146 registers forward, 32-148 backward)
MAX_E = 2048  # wider routers take the reference


@triton.jit
def _probs(L, sl, rows, N, E: tl.constexpr, EP: tl.constexpr):
    """(p [BR, EP] fp32 softmax, the logits x with pad columns -inf, row max, row sum of exp, row mask)."""
    cols = tl.arange(0, EP)
    rm = rows < N
    m2 = rm[:, None] & (cols < E)[None, :]
    x = tl.load(L + rows.to(tl.int64)[:, None] * sl + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x = tl.where((cols < E)[None, :], x, float("-inf"))  # rows past N stay zeros: finite, never NaN
    mx = tl.max(x, axis=1)
    e = tl.exp(x - mx[:, None])
    s = tl.sum(e, axis=1)
    return e / s[:, None], x, mx, s, rm


@triton.jit
def _row_weights(V, rows, rm, HAS_V: tl.constexpr):
    """Each row's weight in the statistics: valid (bool or float), 1 without a mask, 0 past N."""
    if HAS_V:
        v = tl.load(V + rows.to(tl.int64), mask=rm, other=0).to(tl.float32)
    else:
        v = tl.where(rm, 1.0, 0.0)
    return v


@triton.jit
def _routing_fwd_kernel(L, sl, V, TW, TI, PART, N, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                        KP: tl.constexpr, NORM: tl.constexpr, HAS_V: tl.constexpr, BR: tl.constexpr,
                        ITERS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, EP)
    slots = tl.arange(0, KP)
    cnt = tl.zeros([BR, EP], tl.float32)
    psum = tl.zeros([BR, EP], tl.float32)
    for it in range(ITERS):  # a loop, not unrolled: one row tile live at a time
        rows = (pid * ITERS + it) * BR + tl.arange(0, BR)
        p, x, mx, s, rm = _probs(L, sl, rows, N, E, EP)
        v = _row_weights(V, rows, rm, HAS_V)
        psum += p * v[:, None]  # p is dead after this: the top-k weights are recomputed from the logits
        avail = tl.broadcast_to((cols < E)[None, :], [BR, EP])
        tw = tl.zeros([BR, KP], tl.float32)
        ti = tl.zeros([BR, KP], tl.int64)
        tsum = tl.zeros([BR], tl.float32)
        for k in tl.static_range(K):
            # one (max, lowest index of the max) reduction per slot
            mk, ik = tl.max(tl.where(avail, x, float("-inf")), axis=1, return_indices=True,
                            return_indices_tie_break_left=True)
            ik = tl.minimum(ik, E - 1)  # NaN / -inf rows: keep the index in range
            avail = avail & (cols[None, :] != ik[:, None])
            wk = tl.exp(mk - mx) / s  # p at ik, by the same operations
            tsum += wk
            tw = tl.where(slots[None, :] == k, wk[:, None], tw)
            ti = tl.where(slots[None, :] == k, ik[:, None].to(tl.int64), ti)
        if NORM:
            tw = tw / tsum[:, None]
        om = rm[:, None] & (slots < K)[None, :]
        out = rows.to(tl.int64)[:, None] * K + slots[None, :]
        tl.store(TW + out, tw.to(TW.dtype.element_ty), mask=om)
        tl.store(TI + out, ti, mask=om)
        cnt += tl.where(avail | (cols >= E)[None, :], 0.0, v[:, None])  # the K experts taken
    base = PART + pid.to(tl.int64) * (2 * E)
    tl.store(base + cols, tl.sum(cnt, axis=0), mask=cols < E)
    tl.store(base + E + cols, tl.sum(psum, axis=0), mask=cols < E)


writes(_routing_fwd_kernel, "TW", "TI", "PART")


@triton.jit
def _routing_bwd_kernel(L, sl, V, TI, GW, GS, DX, N, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                        NORM: tl.constexpr, HAS_V: tl.constexpr, HAS_GW: tl.constexpr, HAS_GS: tl.constexpr,
                        BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, EP)
    p, x, mx, s, rm = _probs(L, sl, rows, N, E, EP)
    dp = tl.zeros([BR, EP], tl.float32)
    if HAS_GS:  # the prob sums' row of the statistics' gradient, times each row's weight
        gs = tl.load(GS + E + cols, mask=cols < E, other=0.0).to(tl.float32)
        dp = gs[None, :] * _row_weights(V, rows, rm, HAS_V)[:, None]
    if HAS_GW:
        # per slot: the expert, its weight's gradient and its probability t_k, recomputed from the logit at the
        # expert (a gather from L1, not a reduction over the row) as the forward computed it
        r64 = rows.to(tl.int64)
        S = tl.zeros([BR], tl.float32)
        gsum = tl.zeros([BR], tl.float32)
        if NORM:  # w = t / S: dt_k = g_k / S + sum_j -g_j t_j / S^2 (autograd's form of the division)
            for k in tl.static_range(K):
                ik = tl.load(TI + r64 * K + k, mask=rm, other=0)
                S += tl.exp(tl.load(L + r64 * sl + ik, mask=rm, other=0.0).to(tl.float32) - mx) / s
            for k in tl.static_range(K):
                ik = tl.load(TI + r64 * K + k, mask=rm, other=0)
                tk = tl.exp(tl.load(L + r64 * sl + ik, mask=rm, other=0.0).to(tl.float32) - mx) / s
                gsum += (-tl.load(GW + r64 * K + k, mask=rm, other=0.0).to(tl.float32) * tk) / (S * S)
        for k in tl.static_range(K):
            ik = tl.load(TI + r64 * K + k, mask=rm, other=0)
            dk = tl.load(GW + r64 * K + k, mask=rm, other=0.0).to(tl.float32)
            if NORM:
                dk = dk / S + gsum
            dp = tl.where(cols[None, :] == ik[:, None], dp + dk[:, None], dp)
    dx = p * (dp - tl.sum(dp * p, axis=1)[:, None])
    m2 = rm[:, None] & (cols < E)[None, :]
    tl.store(DX + rows.to(tl.int64)[:, None] * E + cols[None, :], dx.to(DX.dtype.element_ty), mask=m2)


writes(_routing_bwd_kernel, "DX")


def _block(E: int) -> tuple[int, int, int]:
    """(padded width, rows per tile, tiles per forward program)."""
    ep = next_pow2(E)
    br = max(1, min(ROWS, TILE // ep))
    return ep, br, max(1, ROWS // br)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def routing_fwd(logits: torch.Tensor, valid: torch.Tensor | None, top_k: int, norm: bool,
                op: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top_w [N, K] in the logits' dtype, top_i [N, K] int64, stats [2, E] fp32). op: from a triton_op body."""
    kern = wrap_triton(_routing_fwd_kernel) if op else _routing_fwd_kernel
    sums = wrap_triton(_col_sum_kernel) if op else _col_sum_kernel
    logits = _rows_of(logits)
    N, E = logits.shape
    ep, br, iters = _block(E)
    progs = triton.cdiv(N, br * iters)
    top_w = new_empty((N, top_k), logits.dtype, logits.device)
    top_i = torch.empty((N, top_k), dtype=torch.int64, device=logits.device)  # an int: nothing to NaN-poison
    part = new_empty((progs, 2 * E), torch.float32, logits.device)
    stats = new_empty((2, E), torch.float32, logits.device)
    if N:
        v = logits if valid is None else valid.contiguous()
        kern[(progs,)](logits, logits.stride(0), v, top_w, top_i, part, N, E=E, EP=ep, K=top_k,
                       KP=next_pow2(top_k), NORM=norm, HAS_V=valid is not None, BR=br, ITERS=iters, num_warps=WARPS)
    sums[(triton.cdiv(2 * E, 64),)](part, progs, 2 * E, stats, BR=32, BD=64, num_warps=4)
    return top_w, top_i, stats


def routing_bwd(g_w: torch.Tensor | None, g_stats: torch.Tensor | None, logits: torch.Tensor,
                valid: torch.Tensor | None, top_i: torch.Tensor, norm: bool, op: bool = False) -> torch.Tensor:
    """d logits [N, E] (logits' dtype) from the gradients of top_w and of the statistics (None: zero)."""
    kern = wrap_triton(_routing_bwd_kernel) if op else _routing_bwd_kernel
    logits = _rows_of(logits)
    N, E = logits.shape
    K = top_i.shape[1]
    ep, br, _ = _block(E)
    dx = new_empty((N, E), logits.dtype, logits.device)
    if N:
        kern[(triton.cdiv(N, br),)](
            logits, logits.stride(0), logits if valid is None else valid.contiguous(), top_i.contiguous(),
            logits if g_w is None else g_w.contiguous(), logits if g_stats is None else g_stats.contiguous(), dx, N,
            E=E, EP=ep, K=K, NORM=norm, HAS_V=valid is not None, HAS_GW=g_w is not None,
            HAS_GS=g_stats is not None, BR=br, num_warps=WARPS)
    return dx


# triton_op: the body is the fake implementation too, and under torch.compile it is traced into the graph.
@torch.library.triton_op("titan_mm::moe_routing", mutates_args=())
def moe_routing_op(logits: torch.Tensor, valid: torch.Tensor | None, top_k: int,
                   norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return routing_fwd(logits, valid, top_k, norm, op=True)


@torch.library.triton_op("titan_mm::moe_routing_bwd", mutates_args=())
def moe_routing_bwd_op(g_w: torch.Tensor | None, g_stats: torch.Tensor | None, logits: torch.Tensor,
                       valid: torch.Tensor | None, top_i: torch.Tensor, norm: bool) -> torch.Tensor:
    return routing_bwd(g_w, g_stats, logits, valid, top_i, norm, op=True)


def _setup(ctx, inputs, output):
    logits, valid, _, norm = inputs
    ctx.save_for_backward(logits, valid, output[1])
    ctx.norm = norm


def _backward(ctx, g_w, g_i, g_stats):
    logits, valid, top_i = ctx.saved_tensors
    return moe_routing_bwd_op(g_w, g_stats, logits, valid, top_i, ctx.norm), None, None, None


moe_routing_op.register_autograd(_backward, setup_context=_setup)


class RoutingFunction(torch.autograd.Function):
    """The eager fast path of moe_routing_op (same kernels, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, logits, valid, top_k, norm):
        top_w, top_i, stats = routing_fwd(logits, valid, top_k, norm)
        ctx.save_for_backward(logits, valid, top_i)
        ctx.norm = norm
        ctx.mark_non_differentiable(top_i)
        ctx.set_materialize_grads(False)
        return top_w, top_i, stats

    @staticmethod
    def backward(ctx, g_w, g_i, g_stats):
        logits, valid, top_i = ctx.saved_tensors
        return routing_bwd(g_w, g_stats, logits, valid, top_i, ctx.norm), None, None, None
