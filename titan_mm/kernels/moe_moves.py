"""The MoE token moves' sums as Triton kernels, with the router weights fused into the combine.

    combine   out[n] = sum_k w[n, k] * y[idx[n, k]]       y [A, D] rows in expert order, idx [N, K] a permutation
                                                         of the A rows, w [N, K] the router weight of each slot
    backward  dy[idx[n, k]] = w[n, k] * g[n],  dw[n, k] = <g[n], y[idx[n, k]]>: one program per token reads g[n]
              once and writes each of its rows of dy once (no atomics)
    expand    x[src_A] (torch's gather); its backward is the combine without weights, dx[n] = sum_k g[idx[n, k]]

The rows may be a padded layout (float8 experts: titan_mm.nn.moe.sort_by_expert(align=16)), more rows
than N K: the expand writes its pad rows as zeros and the combine's backward gives them zero gradients.

The PyTorch forms (titan_mm.nn.moe.expand_rows / combine) weight, gather and sum in separate passes;
inside a compiled block Inductor fuses them, but its gather-sums ran at about a fifth of the copy rate at
Qwen3-30B-A3B's shape (bench/results/profiles/profile_qwen3_30b_a3b_4l_titan_before_moves.txt). Here each
program reads its token's K rows whole. Sums run in fp32 in slot order (increasing expert id, the order HF's loop over the experts
adds them); the product with the weight is not rounded first (PyTorch's combine rounds it to y's dtype).
Legend: N tokens, K slots per token (top-k), A = N K rows, D width.
"""

import torch
import triton
import triton.language as tl

from titan_mm.nn.moe import is_padded, take_rows

from ._utils import new_empty, next_pow2, wrap_triton, writes


@triton.jit
def _gather_sum_kernel(Y, IDX, W, OUT, D, sy, so, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(K):
        a = tl.load(IDX + n * K + k).to(tl.int64)
        row = tl.load(Y + a * sy + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            row = row * tl.load(W + n * K + k).to(tl.float32)
        acc += row
    tl.store(OUT + n * so + cols, acc.to(OUT.dtype.element_ty), mask=m)


writes(_gather_sum_kernel, "OUT")


@triton.jit
def _combine_bwd_kernel(G, Y, IDX, W, DY, DW, sg, sy, sdy, D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                        BLOCK: tl.constexpr):
    # D is a compile-time constant (a model width): the loop over its blocks has host-known bounds
    n = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KP)
    dw = tl.zeros([KP], tl.float32)
    for c0 in range(0, D, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < D
        g = tl.load(G + n * sg + cols, mask=m, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            a = tl.load(IDX + n * K + k).to(tl.int64)
            w = tl.load(W + n * K + k).to(tl.float32)
            y = tl.load(Y + a * sy + cols, mask=m, other=0.0).to(tl.float32)
            dw += tl.where(slots == k, tl.sum(g * y, 0), 0.0)
            tl.store(DY + a * sdy + cols, (w * g).to(DY.dtype.element_ty), mask=m)
    tl.store(DW + n * K + slots, dw.to(DW.dtype.element_ty), mask=slots < K)


writes(_combine_bwd_kernel, "DY", "DW")


def _block(d: int) -> tuple[int, int]:
    block = min(next_pow2(d), 2048)
    return block, 8 if block >= 2048 else 4


def gather_sum(y: torch.Tensor, idx: torch.Tensor, w: torch.Tensor | None, op: bool = False) -> torch.Tensor:
    """sum_k w[n, k] y[idx[n, k]] -> [N, D] in y's dtype (w None: weights 1). op: launched from a triton_op body."""
    kern = wrap_triton(_gather_sum_kernel) if op else _gather_sum_kernel
    y = y if y.stride(-1) == 1 else y.contiguous()
    idx = idx.contiguous()
    N, K = idx.shape
    D = y.shape[1]
    out = new_empty((N, D), y.dtype, y.device)
    if N and D:
        block, warps = _block(D)
        kern[(N, triton.cdiv(D, block))](y, idx, idx if w is None else w.contiguous(), out, D, y.stride(0),
                                         out.stride(0), K=K, HAS_W=w is not None, BLOCK=block, num_warps=warps)
    return out


def combine_bwd(g: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                op: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy [A, D] in y's dtype, dw [N, K] in w's dtype) of gather_sum with weights."""
    kern = wrap_triton(_combine_bwd_kernel) if op else _combine_bwd_kernel
    g = g if g.stride(-1) == 1 else g.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    idx, w = idx.contiguous(), w.contiguous()
    N, K = idx.shape
    D = y.shape[1]
    # a padded layout's pad rows (float8 experts) are never read, so their gradient is zero, not left unwritten
    padded = y.shape[0] > idx.numel()
    dy = torch.zeros(y.shape, dtype=y.dtype, device=y.device) if padded else new_empty(y.shape, y.dtype, y.device)
    dw = new_empty((N, K), w.dtype, w.device)
    if N:
        block, warps = _block(D)
        kern[(N,)](g, y, idx, w, dy, dw, g.stride(0), y.stride(0), dy.stride(0), D=D, K=K, KP=next_pow2(K),
                   BLOCK=block, num_warps=warps)
    return dy, dw


# triton_op: the body is the fake implementation too, and under torch.compile it is traced into the graph.
@torch.library.triton_op("titan_mm::moe_combine", mutates_args=())
def moe_combine_op(y: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gather_sum(y, idx, w, op=True)


@torch.library.triton_op("titan_mm::moe_combine_bwd", mutates_args=())
def moe_combine_bwd_op(g: torch.Tensor, y: torch.Tensor, idx: torch.Tensor,
                       w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return combine_bwd(g, y, idx, w, op=True)


@torch.library.triton_op("titan_mm::moe_sum_rows", mutates_args=())
def moe_sum_rows_op(g: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return gather_sum(g, idx, None, op=True)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):
    y, idx, w = ctx.saved_tensors
    dy, dw = moe_combine_bwd_op(g, y, idx, w)
    return dy, None, dw


moe_combine_op.register_autograd(_backward, setup_context=_setup)


class CombineFunction(torch.autograd.Function):
    """The eager fast path of moe_combine_op (same kernels, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, y, idx, w):
        ctx.save_for_backward(y, idx, w)
        return gather_sum(y, idx, w)

    @staticmethod
    def backward(ctx, g):
        y, idx, w = ctx.saved_tensors
        dy, dw = combine_bwd(g, y, idx, w)
        return dy, None, dw


class ExpandFunction(torch.autograd.Function):
    """x[src_A]; backward: each row of x gets the sum of its K copies' gradients (the kernel above, unweighted)."""

    @staticmethod
    def forward(ctx, x, src_A, inv_NK, op: bool):
        ctx.save_for_backward(inv_NK)
        ctx.op = op
        return take_rows(x, src_A, is_padded(src_A, inv_NK))  # padded: the pad rows are zeros

    @staticmethod
    def backward(ctx, g):
        (inv_NK,) = ctx.saved_tensors
        return (moe_sum_rows_op(g, inv_NK) if ctx.op else gather_sum(g, inv_NK, None)), None, None, None
