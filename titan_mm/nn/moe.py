"""Mixture of experts: softmax top-k router, grouped SwiGLU experts, HF load-balancing loss.

Legend: N tokens (flattened B*S), D model dim, F expert hidden dim, E experts, K top-k,
A = N*K token->expert assignments (sorted by expert).

Expert weights are stacked (torchtitan layout, nn.Linear [out, in] per expert):
  w1 [E, F, D] (gate), w3 [E, F, D] (up), w2 [E, D, F] (down).
On CUDA with bf16 the experts run as three ``torch._grouped_mm`` calls with group offsets computed on device
(no host sync); in other dtypes on CUDA as titan_mm.kernels.grouped_mm (a Triton grouped GEMM whose tile
schedule is built on the device: no host sync either). On CPU a loop over experts runs, exact in fp32.
Tokens move to expert order and back by gathers in both directions (expand_rows / combine): no index_add;
titan_mm.kernels' fused versions (TokenMoves, kernel op ``moe_moves``) do each sum in one pass with the weights.
The routing after the router's GEMM (route_stats: softmax, top-k, renormalization, aux_stats) has one fused
Triton version too (titan_mm.kernels.moe_routing, kernel op ``moe_routing``).

float8 experts (``float8=True``; the trainer's float8.moe_experts): the three GEMMs run through torchao's
rowwise-scaled float8 grouped GEMM, whose token groups must be multiples of 16 rows. The routing then lays the
rows out padded (sort_by_expert(..., align=16)): P = round_up(A + 15 E, 16) rows, a bound of the shapes (static,
no host sync), each expert's group padded to a multiple of 16 on the device. Pad rows are zeros in the expanded
activations and get zero gradients, so they add nothing to the weight gradients, and the combine never reads them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_mm.nn import init


def route(x_ND: torch.Tensor, router_w_ED: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """-> probs_NE (fp32 softmax), top_w_NK (in x dtype), top_i_NK (int64). Same math as HF Qwen3MoeTopKRouter."""
    return route_logits(F.linear(x_ND, router_w_ED), top_k, norm_topk_prob)


def route_logits(logits_NE: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """route after the router's GEMM: -> probs_NE (fp32), top_w_NK (in the logits' dtype), top_i_NK (int64)."""
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    top_w_NK, top_i_NK = torch.topk(probs_NE, top_k, dim=-1)
    if norm_topk_prob:
        top_w_NK = top_w_NK / top_w_NK.sum(dim=-1, keepdim=True)
    return probs_NE, top_w_NK.to(logits_NE.dtype), top_i_NK


GROUPED_MM: bool | None = None
"""None: torch._grouped_mm on CUDA bf16, loop elsewhere. True/False force it (tests run the grouped path
on CPU, where torch >= 2.9 also implements _grouped_mm)."""


def _use_grouped_mm(x: torch.Tensor) -> bool:
    if GROUPED_MM is not None:
        return GROUPED_MM
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


FLOAT8_ALIGN = 16
"""Rows per token group of the float8 grouped GEMM (torch._scaled_grouped_mm takes group sizes in multiples of 16)."""


def grouped_swiglu(
    x_AD: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
    float8: bool = False, mm: Callable | None = None,
) -> torch.Tensor:
    """SwiGLU of each expert over its contiguous group of rows (rows sorted by expert, ``counts_E`` per group).
    ``float8``: on CUDA, torchao's float8 grouped GEMMs (every group a multiple of FLOAT8_ALIGN rows: the padded
    layout of sort_by_expert); on CPU the loop below runs on that layout (the tests' exact reference).
    ``mm``: a grouped GEMM for CUDA dtypes torch._grouped_mm lacks (TokenMoves.grouped_mm: titan_mm.kernels'
    grouped_mm, which reads no group size on the host); None: the loop."""
    if float8 and x_AD.is_cuda:
        offs = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        w1, w3, w2 = (w.to(x_AD.dtype) for w in (w1_EFD, w3_EFD, w2_EDF))
        h = F.silu(float8_grouped_mm(x_AD, w1, offs)) * float8_grouped_mm(x_AD, w3, offs)
        return float8_grouped_mm(h, w2, offs)
    if _use_grouped_mm(x_AD):
        offs = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        w1, w3, w2 = (w.to(x_AD.dtype) for w in (w1_EFD, w3_EFD, w2_EDF))
        h1 = torch._grouped_mm(x_AD, w1.transpose(-2, -1), offs=offs)
        h3 = torch._grouped_mm(x_AD, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(F.silu(h1) * h3, w2.transpose(-2, -1), offs=offs).to(x_AD.dtype)
    if x_AD.is_cuda and mm is not None:  # not in the CPU interpreter: the loop is its reference
        h = F.silu(mm(x_AD, w1_EFD, counts_E)) * mm(x_AD, w3_EFD, counts_E)
        return mm(h, w2_EDF, counts_E)
    # CPU: a loop over experts; reads the group sizes on the host
    outs = []
    for e, x_e in enumerate(torch.split(x_AD, counts_E.tolist(), dim=0)):
        outs.append(F.linear(F.silu(F.linear(x_e, w1_EFD[e])) * F.linear(x_e, w3_EFD[e]), w2_EDF[e]))
    return torch.cat(outs, dim=0)


def float8_grouped_mm(x_AD: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """x's rows of group e times w[e]^T through torchao's float8 grouped GEMM (rowwise scales, float8 backward too;
    CUDA SM>=90) -> [A, N] in x's dtype. ``offs_E``: the int32 group ends, every group a multiple of FLOAT8_ALIGN
    rows (torchao 0.17 / 0.18 pad nothing themselves: their forward asserts that its padding flag is off)."""
    # deferred: only float8.moe_experts needs torchao (~0.6 s to import), and its prototype may be absent
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # w [E, N, K] contiguous: its transpose is the column-major B that torchao takes
    return _to_fp8_rowwise_then_scaled_grouped_mm(x_AD, w_ENK.transpose(-2, -1), offs_E, out_dtype=x_AD.dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def grouped_linear(x_AD: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """x's rows of expert e times w[e]^T (rows sorted by expert, ``counts_E`` per group): the reference of
    titan_mm.kernels.grouped_mm (a loop over experts; reads the group sizes on the host)."""
    return torch.cat([F.linear(x_e, w_ENK[e]) for e, x_e in enumerate(torch.split(x_AD, counts_E.tolist(), dim=0))])


class Routing(NamedTuple):
    """The N*K assignments sorted by expert (stable): ``src_A`` the token of each sorted assignment, ``inv_NK``
    the sorted positions of each token's K assignments (ascending, so in increasing expert id), ``order_A`` the
    flat (token, slot) index of each sorted assignment, ``counts_E`` assignments per expert (all on the device).
    Padded (sort_by_expert's ``align`` > 1): P > N*K rows, each expert's group ``counts_E`` rows (a multiple of
    align); a pad row's ``src_A`` is N (it reads as zeros, take_rows) and its ``order_A`` 0."""

    src_A: torch.Tensor
    inv_NK: torch.Tensor
    order_A: torch.Tensor
    counts_E: torch.Tensor


def sort_by_expert(top_i_NK: torch.Tensor, num_experts: int, align: int = 1) -> Routing:
    """``align`` > 1: the padded layout (Routing), every expert's group a multiple of ``align`` rows."""
    N, K = top_i_NK.shape
    flat_e_A = top_i_NK.reshape(-1)
    order_A = torch.argsort(flat_e_A, stable=True)
    pos_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(N * K, device=order_A.device))
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_e_A.device).scatter_add_(
        0, flat_e_A, torch.ones_like(flat_e_A))
    inv_NK = pos_A.view(N, K).sort(dim=1).values
    if align == 1:
        return Routing(order_A // K, inv_NK, order_A, counts_E)
    at_A, sizes_E, P = pad_groups(flat_e_A[order_A], counts_E, align)
    src_P = torch.full((P,), N, dtype=order_A.dtype, device=order_A.device).scatter_(0, at_A, order_A // K)
    order_P = torch.zeros(P, dtype=order_A.dtype, device=order_A.device).scatter_(0, at_A, order_A)
    return Routing(src_P, at_A[inv_NK], order_P, sizes_E)


def pad_groups(e_S: torch.Tensor, counts_E: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows sorted by expert (``e_S`` the expert of each, ``counts_E`` per expert) laid out with every group padded
    to a multiple of ``align`` rows -> (each row's position [S], the group sizes [E], rows P). P = round_up(S +
    E (align - 1), align) is a bound of the shapes, so the layout is static (no host sync); the last group takes the
    rows the others leave."""
    S, E = e_S.numel(), counts_E.numel()
    P = -(-(S + E * (align - 1)) // align) * align
    sizes_E = (counts_E + align - 1) // align * align
    sizes_E[-1] += P - sizes_E.sum()
    pad_E = sizes_E - counts_E
    return torch.arange(S, device=e_S.device) + (torch.cumsum(pad_E, 0) - pad_E)[e_S], sizes_E, P


def take_rows(x: torch.Tensor, src: torch.Tensor, padded: bool) -> torch.Tensor:
    """x[src]; ``padded``: ``src`` also holds len(x), the pad rows of a padded layout, which read as zeros."""
    return F.pad(x, (0, 0, 0, 1))[src] if padded else x[src]


def is_padded(src: torch.Tensor, inv: torch.Tensor) -> bool:
    """A padded layout has more rows (``src``) than assignments (``inv``); a shape test, so no host sync."""
    return src.numel() > inv.numel()


class _ExpandRows(torch.autograd.Function):
    """out[a] = x[src_A[a]], each row of x taken by the rows ``inv_NK`` lists for it. Its backward sums those
    rows back by a gather: plain indexing's backward scatters with atomics (bench/floor.py's permute rows)."""

    @staticmethod
    def forward(ctx, x, src_A, inv_NK):
        ctx.save_for_backward(src_A, inv_NK)
        return take_rows(x, src_A, is_padded(src_A, inv_NK))

    @staticmethod
    def backward(ctx, g):
        src_A, inv_NK = ctx.saved_tensors
        return g[inv_NK].sum(1), None, None


class _ReduceRows(torch.autograd.Function):
    """The adjoint of _ExpandRows: out[n] = sum of y's rows ``inv_NK[n]``, in that order; backward g[src_A]."""

    @staticmethod
    def forward(ctx, y, inv_NK, src_A):
        ctx.save_for_backward(src_A, inv_NK)
        return y[inv_NK].sum(1)

    @staticmethod
    def backward(ctx, g):
        src_A, inv_NK = ctx.saved_tensors
        return take_rows(g, src_A, is_padded(src_A, inv_NK)), None, None  # pad rows: zero gradients


def expand_rows(x: torch.Tensor, src_A: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """x[src_A] with a gather backward; ``inv_NK`` lists, for each row of x, the output rows that copy it."""
    return _ExpandRows.apply(x, src_A, inv_NK)


def reduce_rows(y: torch.Tensor, inv_NK: torch.Tensor, src_A: torch.Tensor) -> torch.Tensor:
    """The sum of y's rows ``inv_NK[n]`` for each n, with a gather backward (expand_rows' adjoint)."""
    return _ReduceRows.apply(y, inv_NK, src_A)


def combine(y_AD: torch.Tensor, top_w_NK: torch.Tensor, r: Routing, dtype: torch.dtype) -> torch.Tensor:
    """Each token's expert outputs weighted by its router weights and summed in increasing expert id (as HF)."""
    y_AD = y_AD * top_w_NK.reshape(-1)[r.order_A, None]
    return _ReduceRows.apply(y_AD.to(dtype), r.inv_NK, r.src_A)


class TokenMoves(NamedTuple):
    """How tokens reach their experts and come back: ``expand(x_ND, src_A, inv_NK) -> x_AD`` and
    ``combine(y_AD, top_w_NK, r, dtype) -> y_ND``. These are PyTorch's gathers; titan_mm.kernels has fused ones with
    the same signatures (the ``moe_moves`` kernel op). ``grouped_mm(x_AD, w_ENK, counts_E) -> y_AN``: the experts'
    GEMMs where torch._grouped_mm lacks the dtype on CUDA (grouped_swiglu's ``mm``; None: a loop)."""

    expand: Callable = expand_rows
    combine: Callable = combine
    grouped_mm: Callable | None = None


class GroupedExperts(nn.Module):
    """``float8``: float8 grouped GEMMs on the padded layout (module docstring)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, moves: TokenMoves = TokenMoves(),
                 float8: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.moves = moves
        self.float8 = float8
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x_ND: torch.Tensor, top_w_NK: torch.Tensor, top_i_NK: torch.Tensor,
                extra: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:
        """The routed experts' output, plus ``extra()`` when it gives a tensor (a shared expert's term [N, D]: the
        expert-parallel version computes it while the tokens travel)."""
        r = sort_by_expert(top_i_NK, self.num_experts, FLOAT8_ALIGN if self.float8 else 1)
        y_AD = grouped_swiglu(self.moves.expand(x_ND, r.src_A, r.inv_NK), r.counts_E, self.w1, self.w3, self.w2,
                              self.float8, self.moves.grouped_mm)
        return add_extra(self.moves.combine(y_AD, top_w_NK, r, x_ND.dtype), extra() if extra is not None else None)

    def reset_parameters(self, std: float) -> None:
        for w in (self.w1, self.w3, self.w2):
            init.normal_(w, mean=0.0, std=std)


def add_extra(y_ND: torch.Tensor, extra_ND: torch.Tensor | None) -> torch.Tensor:
    return y_ND if extra_ND is None else y_ND + extra_ND


def aux_stats(probs_NE: torch.Tensor, top_i_NK: torch.Tensor, valid_N: torch.Tensor | None) -> torch.Tensor:
    """Per-layer load-balancing statistics [2, E] fp32: (top-k assignment counts, router prob sums), padding excluded."""
    E = probs_NE.shape[-1]
    K = top_i_NK.shape[-1]
    w_N = (
        torch.ones(probs_NE.shape[0], dtype=torch.float32, device=probs_NE.device)
        if valid_N is None
        else valid_N.to(torch.float32)
    )
    counts = torch.zeros(E, dtype=torch.float32, device=probs_NE.device).scatter_add_(
        0, top_i_NK.reshape(-1), w_N[:, None].expand(-1, K).reshape(-1)
    )
    psum = (probs_NE.float() * w_N[:, None]).sum(0)
    return torch.stack([counts, psum])


def route_stats(logits_NE: torch.Tensor, top_k: int, norm_topk_prob: bool, valid_N: torch.Tensor | None = None):
    """The MoE layer's routing from its router logits: -> (top_w_NK, top_i_NK, aux stats [2, E]), i.e. route_logits
    then aux_stats. The reference of titan_mm.kernels.moe_routing (kernel op ``moe_routing``: one pass that keeps
    no [N, E] probabilities)."""
    probs_NE, top_w_NK, top_i_NK = route_logits(logits_NE, top_k, norm_topk_prob)
    return top_w_NK, top_i_NK, aux_stats(probs_NE, top_i_NK, valid_N)


def load_balancing_loss(stats_2E: torch.Tensor, rows: torch.Tensor | float, num_experts: int) -> torch.Tensor:
    """HF load_balancing_loss_func from statistics summed over MoE layers; ``rows`` = layers * valid tokens."""
    tokens_per_expert = stats_2E[0] / rows
    prob_per_expert = stats_2E[1] / rows
    return (tokens_per_expert * prob_per_expert).sum() * num_experts


class MoE(nn.Module):
    """Router + grouped experts. forward -> (y_BSD, aux stats [2, E]). ``moves``: the token moves (TokenMoves);
    ``float8``: the experts' GEMMs in float8 (GroupedExperts); ``routing``: the work after the router's GEMM,
    ``(logits_NE, top_k, norm_topk_prob, valid_N) -> (top_w_NK, top_i_NK, stats_2E)`` (route_stats, or
    titan_mm.kernels.moe_routing: kernel op ``moe_routing``)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 moves: TokenMoves = TokenMoves(), float8: bool = False, routing: Callable = route_stats):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.num_experts = top_k, norm_topk_prob, num_experts
        self.routing = routing
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, moves, float8)

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor | None = None):
        B, S, D = x_BSD.shape
        x_ND = x_BSD.reshape(-1, D)
        top_w_NK, top_i_NK, stats = self.routing(F.linear(x_ND, self.router.weight), self.top_k, self.norm_topk_prob,
                                                 None if valid_BS is None else valid_BS.reshape(-1))
        y_ND = self.experts(x_ND, top_w_NK, top_i_NK, extra=lambda: self.shared_term(x_ND))
        return y_ND.view(B, S, D), stats

    def shared_term(self, x_ND: torch.Tensor) -> torch.Tensor | None:
        """What a shared expert adds to the routed output [N, D]; none here (families with one override this)."""
        return None

    def reset_parameters(self, std: float) -> None:
        init.normal_(self.router.weight, mean=0.0, std=std)
        self.experts.reset_parameters(std)
