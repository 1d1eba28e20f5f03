"""titan_mm.kernels: Triton kernels on the hot path, as torch.library custom ops, with PyTorch references.

Public functional API (each dispatches to Triton on CUDA SM >= 80 for bf16/fp16/fp32 inputs and to the
PyTorch op of titan_mm.nn elsewhere, which is also the reference the kernels are tested against;
see docs/kernels.md):

    rms_norm(x, w, eps) -> y
    add_rms_norm(x, residual, w, eps) -> (normed, new_residual)
    swiglu(gate, up) -> silu(gate) * up
    apply_rope(q, k, cos, sin) -> (q, k)                       q/k [B, S, H, Dh]; cos/sin [S|B,S, Dh|Dh/2]
    linear_cross_entropy(h, weight, labels, ignore_index=-100, z_loss=0.0, weights=None) -> loss_sum (fp32)
        (weights: optional per-token loss weights)
    vocab_parallel_linear_cross_entropy(h, weight_shard, labels, vocab_start, group, ...) -> loss_sum
        (loss parallel: the head's rows are split over the ranks of ``group``; Triton only; the PyTorch
        version is titan_mm.nn.loss.chunked_cross_entropy(..., group=group))
    bias_gelu(x, b) -> gelu_tanh(x + b)
    paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, window=None) -> o
        (serving's one-token decode step over a paged KV pool, keys read in place; no backward)
    paged_attention(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, window=None) -> o
        (serving's mixed step: q [T, H, K] of sequences with q_len >= 1 new tokens each, packed by cu_seqlens_q,
        attending causally to their paged context; no backward)
    norm_rope_cache(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots) -> q
        (serving's decode step before that attention: q/k RMSNorm, RoPE, k and v written into their cache slots;
        one launch; no backward)
    grouped_mm(x, w, counts) -> y     x [A, K] rows sorted by expert, w [E, N, K], counts [E] on the device
        (the MoE experts in the dtypes torch._grouped_mm lacks on CUDA, no host sync; eager autograd)
    upcast(x, dtype) -> x in a wider dtype (bf16 / fp16 -> fp32: a vectorized copy; no autograd)
    accumulate(acc, g, dtype) -> acc + g in dtype, in place when acc is dtype already (fp32 += bf16 in one
        vectorized pass: the cast path's gradient sum over micro-batches; no autograd)
    fp8_rows(x) -> (e4m3 x, fp32 scale per row)   x [M, K]: amax x (1 / 448) a row, then the cast, in one launch
        (serving's rowwise w8a8 linears quantize their inputs with it; no autograd)
    fp8_cols(x) -> fp8_rows(x.T), written as [C, M] without writing x.T (amax, then cast; no autograd)
    fp8_cast(x, cols) -> fp8_rows(x), or fp8_cols(x) with cols: either as one opaque node under torch.compile
        (titan_mm.quant.rowwise's training linear casts its GEMMs' operands with it)
    swiglu_fp8_rows(gate_up) -> fp8_rows(swiglu(gate, up))   gate_up [M, 2F]: the product and its cast in one launch
        (serving's w8a8 SwiGLU: the down projection's input; no autograd)
    fp8_mm(x8, sx, w8, sw, bias, out_dtype) -> (x8 @ w8.T) x sx x sw (+ bias)   x8 [M, K], w8 [N, K] e4m3, sx [M, 1],
        sw [1, N] fp32 (a rowwise w8a8 linear's GEMM: Triton at a decode step's rows, else torch._scaled_mm)
    greedy_pick(logits) -> (tokens, logprobs)   per row of [R, V]: the argmax and its log-probability in one pass
        (serving's greedy rows; no autograd)
    adamw_step_(p, g, m, v, copy, step, lr, ...) -> None   (one AdamW update that also writes p's narrow copy;
        the one-rank cast path's optimizer, titan_mm.train.cast_adamw)
    moe_expand(x, src_A, inv_NK) -> x[src_A], moe_combine(y_AD, top_w_NK, routing, dtype) -> y_ND
        (the MoE token moves of titan_mm.nn.moe.TokenMoves: each sum one pass, the weights fused)
    moe_routing(logits_NE, top_k, norm_topk_prob, valid_N=None) -> (top_w_NK, top_i_NK, stats_2E)
        (the MoE router after its GEMM: softmax, top-k, renormalization and the aux statistics in one pass;
        titan_mm.nn.moe.route_stats)

Launch configs (titan_mm.kernels._utils.Tuner): picked per key (width / head layout, dtype) outside the
model's forward, which must not synchronize the GPU:

    tune_for_model(shapes, kernels, tokens, dtype, device) -> report   # once, after building the model (shapes: ModelSpec.kernel_shapes)
    share_picks()               # every rank takes rank 0's picks (a collective)
    export_picks(), load_picks(picks)   # the picks as a picklable dict, and back (the trainer checkpoints them)
    current_picks(picks)        # the picks this version can launch (a checkpoint's may be older)
    with tuning(): ...          # calls inside time the candidates of keys not tuned yet (synchronizes)
    tuned_configs(), untuned_keys()                                     # what was picked / what ran untuned

A key the forward meets untuned runs its first (default) config, without timing.

The ops live in the `titan_mm` torch.library namespace (torch.ops.titan_mm.*) with registered autograd, so
torch.compile(fullgraph=True) traces them without breaks: the block ops are torch.library.triton_ops (the
compiler traces their bodies; the kernel launches become graph nodes that inductor launches itself), the
fused CE is an opaque custom_op with a fake implementation (see docs/kernels.md).
In eager mode the same kernels run through plain autograd.Functions (no dispatcher overhead).
"""

from __future__ import annotations

import torch

from titan_mm.nn.fp8 import fp8_rows as _fp8_rows_ref
from titan_mm.nn.kv_cache import copy_rows, paged_attention_reference, paged_decode_reference
from titan_mm.nn.loss import chunked_cross_entropy
from titan_mm.nn.mlp import bias_gelu as _bias_gelu_ref
from titan_mm.nn.mlp import silu_mul
from titan_mm.nn.moe import combine as _combine_ref
from titan_mm.nn.moe import expand_rows as _expand_rows_ref
from titan_mm.nn.moe import grouped_linear as _grouped_linear_ref
from titan_mm.nn.moe import route_stats as _route_stats_ref
from titan_mm.nn.norm import add_rms_norm as _add_rms_norm_ref
from titan_mm.nn.norm import rms_norm as _rms_norm_ref
from titan_mm.nn.rope import apply_rope as _apply_rope_ref

from . import _dispatch
from ._dispatch import HAS_TRITON, use_triton, use_triton_kv
from ._tuning import share_picks, tune_for_model
from ._utils import current_picks, export_picks, load_picks, tuned_configs, tuning, untuned_keys

__all__ = [
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "apply_rope",
    "linear_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "bias_gelu",
    "paged_decode_attention",
    "paged_attention",
    "norm_rope_cache",
    "grouped_mm",
    "upcast",
    "accumulate",
    "fp8_rows",
    "fp8_cols",
    "fp8_cast",
    "greedy_pick",
    "adamw_step_",
    "moe_expand",
    "moe_combine",
    "moe_routing",
    "HAS_TRITON",
    "use_triton",
    "KERNEL_OPS",
    "resolve_ops",
    "tune_for_model",
    "share_picks",
    "export_picks",
    "load_picks",
    "current_picks",
    "tuning",
    "tuned_configs",
    "untuned_keys",
]

KERNEL_OPS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "linear_cross_entropy", "bias_gelu", "moe_moves",
              "moe_routing", "norm_rope_cache")


def resolve_ops(spec) -> frozenset:
    """Which ops a model should take from titan_mm.kernels, from a config value:
    True / "all" -> every op; False / None / "" / "none" -> none; "rms_norm,swiglu" -> those;
    "all,-linear_cross_entropy" -> every op but the CE. Unknown names raise (no silently dropped keys)."""
    if spec is True:
        return frozenset(KERNEL_OPS)
    if spec is False or spec is None:
        return frozenset()
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    out: set = set()
    for it in items:
        neg = it.startswith("-")
        name = it[1:] if neg else it
        names = set(KERNEL_OPS) if name == "all" else (set() if name == "none" else {name})
        unknown = names - set(KERNEL_OPS)
        if unknown:
            raise ValueError(f"unknown kernel op(s) {sorted(unknown)}; choose from {KERNEL_OPS}, 'all', 'none'")
        out = out - names if neg else out | names
    return frozenset(out)

if HAS_TRITON:  # optional: triton is absent on some CPU machines, where every op takes its reference
    from .adamw import adamw_step_ as _adamw
    from .bias_gelu import BiasGeluFunction, bias_gelu_op
    from .cast import upcast as _upcast
    from .cast import widening_add as _widening_add
    from .cross_entropy import (LinearCrossEntropyFunction, VocabParallelLinearCrossEntropyFunction,
                                linear_cross_entropy_op)
    from .fp8_gemm import fits as _fp8_mm_fits
    from .fp8_gemm import fp8_mm as _fp8_mm
    from .fp8_rows import MAX_K as _FP8_MAX_K
    from .fp8_rows import fp8_cols as _fp8_cols
    from .fp8_rows import fp8_rows as _fp8_rows
    from .fp8_rows import swiglu_fp8_rows as _swiglu_fp8_rows
    from .greedy import greedy_pick as _greedy_pick
    from .grouped_gemm import GroupedMMFunction
    from .moe_moves import CombineFunction, ExpandFunction, moe_combine_op
    from .moe_router import MAX_E as _ROUTING_MAX_E
    from .moe_router import RoutingFunction, moe_routing_op
    from .norm_rope_cache import norm_rope_cache as _norm_rope_cache
    from .paged_attention import paged_mixed
    from .paged_decode import paged_decode
    from .rms_norm import AddRMSNormFunction, RMSNormFunction, add_rms_norm_op, rms_norm_op
    from .rms_norm import _fwd as _rms_fwd
    from .rope import RopeFunction, rope_op
    from .swiglu import SwiGLUFunction, swiglu_op


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3 RMSNorm over the last dim: w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
    if use_triton(x, w):
        if _dispatch.use_ops():
            return rms_norm_op(x, w, eps)[0]
        if not torch.is_grad_enabled():  # eval / generation: no backward, so no rstd written for it
            return _rms_fwd(x, None, w, eps, stats=False)[0]
        return RMSNormFunction.apply(x, w, eps)
    return _rms_norm_ref(x, w, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual, w, eps), new_residual)."""
    if use_triton(x, residual, w) and x.shape == residual.shape and x.dtype == residual.dtype:
        if not _dispatch.use_ops():
            if not torch.is_grad_enabled():
                return _rms_fwd(x, residual, w, eps, stats=False)[:2]
            return AddRMSNormFunction.apply(x, residual, w, eps)
        y, nr, _ = add_rms_norm_op(x, residual, w, eps)
        return y, nr
    return _add_rms_norm_ref(x, residual, w, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    if use_triton(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype:
        return swiglu_op(gate, up) if _dispatch.use_ops() else SwiGLUFunction.apply(gate, up)
    return silu_mul(gate, up)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-rotation RoPE on q [B, S, Hq, Dh] and k [B, S, Hk, Dh] (or [S, H, Dh]); cos/sin [S, X] or
    [B, S, X] with X = Dh (HF layout, halves duplicated) or Dh/2. A [B, H, S, Dh] tensor may be passed as
    .transpose(1, 2) without a copy; Triton outputs are contiguous [B, S, H, Dh]."""
    if use_triton(q, k, cos, sin) and q.dim() in (3, 4):
        if not _dispatch.use_ops():
            return RopeFunction.apply(q, k, cos, sin, False)
        return rope_op(q, k, cos, sin, False)
    return _apply_rope_ref(q, k, cos, sin)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 0,
    grad_accum_fp32: bool = False,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum (fp32 scalar) over labels != ignore_index of CE(h @ weight.T, labels) + z_loss * lse^2, without
    materializing the [N, V] logits. h [..., D], weight [V, D], labels [...] (already shifted).
    The trainer divides the result by the global label-token count. chunk_size 0 = automatic.
    grad_accum_fp32: accumulate the weight gradient over chunks in fp32 (one rounding at the end instead of
    one per chunk; costs V x D x 4 bytes more peak memory for a bf16 weight). Default off: Liger's memory.
    weights: per-token loss weights shaped like labels (None: 1), e.g. a diffusion objective's 1/t; each token's
    loss and gradient are multiplied by its weight."""
    if weights is not None:
        weights = weights.detach()
    if use_triton(h, weight) and h.dtype == weight.dtype:
        compute_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        args = (h, weight, labels, ignore_index, float(z_loss), compute_grad, chunk_size, bool(grad_accum_fp32),
                weights)
        if not _dispatch.use_ops():
            return LinearCrossEntropyFunction.apply(*args)
        return linear_cross_entropy_op(*args)[0]
    return chunked_cross_entropy(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1),
                                 chunk_size if chunk_size > 0 else 4096, z_loss, ignore_index=ignore_index,
                                 weights_N=None if weights is None else weights.reshape(-1))


def vocab_parallel_linear_cross_entropy(
    h: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear_cross_entropy with the head split over the vocabulary (loss parallel): ``weight_shard`` holds
    rows [vocab_start, vocab_start + V_local) of the [V, D] head, the other rows live on the other ranks of
    ``group``; ``h`` and ``labels`` are the same on every rank. Per chunk of tokens each rank computes its
    shard's log-sum-exp and target logit in Triton, one all-gather combines them into the global values, and
    a second Triton pass writes the shard's logit gradients in place (no fp32 [C, V] copies). Returns the
    same fp32 loss sum on every rank; h's gradient is complete (all-reduced), the weight's is this shard's.
    Triton only (``use_triton(h, weight_shard)`` with equal dtypes): elsewhere the PyTorch version is
    ``chunked_cross_entropy(h, weight_shard, labels, group=group, vocab_start=vocab_start)``
    (titan_mm.nn.loss). Eager autograd (it runs collectives; no torch.library op)."""
    if not (use_triton(h, weight_shard) and h.dtype == weight_shard.dtype):
        raise RuntimeError("vocab_parallel_linear_cross_entropy runs only on the Triton path (CUDA SM >= 80, or "
                           "TRITON_INTERPRET=1 on CPU) with h and the weight in one dtype; use "
                           "titan_mm.nn.loss.chunked_cross_entropy(..., group=group) elsewhere.")
    return VocabParallelLinearCrossEntropyFunction.apply(h, weight_shard, labels, int(vocab_start), group,
                                                         int(ignore_index), float(z_loss), int(chunk_size),
                                                         None if weights is None else weights.detach())


def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu(x + b, approximate='tanh')."""
    if use_triton(x, b):
        return bias_gelu_op(x, b) if _dispatch.use_ops() else BiasGeluFunction.apply(x, b)
    return _bias_gelu_ref(x, b)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(K)) v of each sequence's one query token q [B, H, K] over its first ``seq_lens[b]``
    keys (the last ``window`` of them with a sliding window), read from the pools [NB, BS, G, K] through
    ``block_tables`` [B, MB] (device int32 / int64; see titan_mm/kernels/paged_decode.py). -> [B, H, K]."""
    B, H, K = q.shape
    if k_pool.shape[-1] != K or H % k_pool.shape[2] or v_pool.shape != k_pool.shape:
        raise ValueError(f"paged decode: q [B, H, K] = {list(q.shape)} against pools {list(k_pool.shape)} / "
                         f"{list(v_pool.shape)}: K must agree, H must be a multiple of G, k and v pools alike")
    if use_triton_kv((k_pool, v_pool), q):  # any block size: tiles of 64 tokens look up each token's block
        return paged_decode(q, k_pool, v_pool, block_tables, seq_lens, window)
    return paged_decode_reference(q, k_pool, v_pool, block_tables, seq_lens, window)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal attention of the T new queries q [T, H, K] of B sequences, packed by ``cu_seqlens_q`` [B + 1] (device
    int32), over each sequence's first ``seq_lens[b]`` keys (its new tokens last, already written), read from the
    pools [NB, BS, G, K] through ``block_tables`` [B, MB] (the last ``window`` keys up to each query with a sliding
    window; see titan_mm/kernels/paged_attention.py). -> [T, H, K]."""
    T, H, K = q.shape
    if (k_pool.shape[-1] != K or H % k_pool.shape[2] or v_pool.shape != k_pool.shape
            or cu_seqlens_q.shape != (block_tables.shape[0] + 1,) or seq_lens.shape != (block_tables.shape[0],)):
        raise ValueError(f"paged attention: q [T, H, K] = {list(q.shape)} against pools {list(k_pool.shape)} / "
                         f"{list(v_pool.shape)}, block_tables {list(block_tables.shape)}, seq_lens "
                         f"{list(seq_lens.shape)}, cu_seqlens_q {list(cu_seqlens_q.shape)}: K must agree, H must be a "
                         "multiple of G, k and v pools alike, one table row and length per sequence and B + 1 offsets")
    if use_triton_kv((k_pool, v_pool), q):
        return paged_mixed(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, window)
    return paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, window)


@torch.no_grad()
def norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor | None,
                    k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A one-token decode step's attention prologue: q [B, H, K] and k [B, G, K] RMSNormed by ``q_w`` / ``k_w`` [K]
    (None: no q/k norm) and rotated by cos / sin [B, X] or [X] (X = K or K / 2; per token, so M-RoPE tables too);
    k and v [B, G, K] written into slot ``slots[b]`` of the pools [NB, BS, G, K]. -> q normed and rotated [B, H, K].
    One Triton launch (titan_mm/kernels/norm_rope_cache.py); elsewhere the references composed: nn's rms_norm,
    apply_rope, and KVCache.write's copy_rows."""
    B, H, D = q.shape
    G = k.shape[1]
    if cos.shape[-1] not in (D, D // 2) or k_pool.shape[2:] != (G, D) or slots.shape != (B,):
        raise ValueError(f"norm_rope_cache: q {list(q.shape)}, k {list(k.shape)}, cos {list(cos.shape)}, pool "
                         f"{list(k_pool.shape)}, slots {list(slots.shape)}: cos / sin need K or K / 2 entries "
                         f"(partial rotary: apply its RoPE unfused), the pool [NB, BS, G, K], one slot per row")
    cos, sin = cos.expand(B, cos.shape[-1]), sin.expand(B, sin.shape[-1])
    norm = () if q_w is None else (q_w, k_w)
    if (use_triton_kv((k_pool, v_pool), q, k, v, cos, sin, *norm) and all(w.dtype == q.dtype for w in norm)
            and k.dtype == q.dtype and all(t.stride(-1) == 1 for t in (q, k, v, cos, sin, k_pool, v_pool))):
        return _norm_rope_cache(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots)
    if q_w is not None:
        q, k = _rms_norm_ref(q, q_w, eps), _rms_norm_ref(k, k_w, eps)
    q, k = _apply_rope_ref(q, k, cos, sin)
    for pool, new in ((k_pool, k), (v_pool, v)):
        copy_rows(pool.view(-1, G, D), slots, new)
    return q


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T for x [A, K] (rows sorted by expert), w [E, N, K] and the group sizes
    ``counts_E`` [E] (on x's device: never read on the host by the Triton path). -> [A, N] in x's dtype."""
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or counts_E.numel() != w.shape[0]:
        raise ValueError(f"grouped_mm: x [A, K] = {list(x.shape)}, w [E, N, K] = {list(w.shape)} and counts [E] = "
                         f"{list(counts_E.shape)} must agree on K and E")
    if use_triton(x, w):
        return GroupedMMFunction.apply(x, w, counts_E)
    return _grouped_linear_ref(x, w.to(x.dtype), counts_E)


def upcast(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` in ``dtype``, wider than x's (bf16 / fp16 -> fp32): exact, as ``x.to(dtype)``, which it is off CUDA
    and for a non-contiguous ``x``."""
    if (use_triton(x) and x.is_contiguous() and x.is_floating_point() and x.dtype != dtype
            and torch.finfo(dtype).bits > torch.finfo(x.dtype).bits):
        return _upcast(x, dtype)
    return x.to(dtype)


def accumulate(acc: torch.Tensor, g: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``acc + g`` in ``dtype`` (fp32), written into ``acc`` when it is ``dtype`` already, else a new tensor: exact,
    as ``acc.to(dtype).add_(g)`` (fp32 sums of the widened values), which it is off CUDA and for non-contiguous or
    differently shaped tensors."""
    if (use_triton(acc, g) and acc.is_contiguous() and g.is_contiguous() and acc.shape == g.shape
            and dtype == torch.float32):
        return _widening_add(acc, g, acc if acc.dtype == dtype else torch.empty_like(acc, dtype=dtype))
    return acc.to(dtype).add_(g)


@torch.no_grad()
def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]) with x ~= e4m3 * scale, each row's amax at e4m3's 448."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] <= _FP8_MAX_K:
        return _fp8_rows(x)
    return _fp8_rows_ref(x)


@torch.no_grad()
def fp8_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, C] -> fp8_rows(x.T): (e4m3 [C, M], fp32 scales [C, 1]), the e4m3 rows contiguous."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        return _fp8_cols(x)
    q, scale = _fp8_rows_ref(x.t())
    return q.contiguous(), scale


@torch.library.custom_op("titan_mm::fp8_cast", mutates_args=())
def _fp8_cast_op(x: torch.Tensor, cols: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_cols(x) if cols else fp8_rows(x)


@_fp8_cast_op.register_fake
def _(x, cols):
    rows, width = (x.shape[1], x.shape[0]) if cols else x.shape
    return x.new_empty(rows, width, dtype=torch.float8_e4m3fn), x.new_empty(rows, 1, dtype=torch.float32)


def fp8_cast(x: torch.Tensor, cols: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_rows(x), or with ``cols`` fp8_cols(x); under torch.compile one opaque node (its kernels launch as in
    eager), since neither has a backward."""
    if _dispatch.use_ops():
        return _fp8_cast_op(x, cols)
    return fp8_cols(x) if cols else fp8_rows(x)


@torch.no_grad()
def swiglu_fp8_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2F] (gate | up, a fused GEMM's output) -> fp8_rows(swiglu(gate, up)): bit-equal to the two ops
    (the product rounded to gate_up's dtype first, as swiglu returns it), in one launch on CUDA."""
    if use_triton(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] <= 2 * _FP8_MAX_K:
        return _swiglu_fp8_rows(gate_up)
    return fp8_rows(swiglu(*gate_up.chunk(2, dim=-1)))


@torch.no_grad()
def fp8_mm(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """(x8 @ w8.T) x sx x sw (+ bias) in ``out_dtype``; x8 [M, K], w8 [N, K] e4m3, sx [M, 1], sw [1, N] fp32. On CUDA
    at up to 256 rows (a decode step's) the Triton kernel of kernels/fp8_gemm.py, else torch._scaled_mm; both sum
    in fp32 with Hopper's fast fp8 accumulation."""
    if x8.is_cuda and _dispatch.device_ok(x8.device) and _fp8_mm_fits(x8, w8):
        return _fp8_mm(x8, sx, w8, sw, bias, out_dtype)
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=out_dtype, use_fast_accum=True)


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (tokens int64 [R]: each row's argmax, its first index on ties; logprobs fp32 [R]: that
    token's logit - logsumexp of the row, in fp32)."""
    if use_triton(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        return _greedy_pick(logits)
    x = logits.float()
    tokens = x.argmax(1)
    return tokens, x.gather(1, tokens[:, None])[:, 0] - x.logsumexp(1)


@torch.no_grad()
def adamw_step_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, copy: torch.Tensor,
                step: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
    """One AdamW update in place of fp32 ``p``, ``m``, ``v`` from ``g`` (narrow or fp32), writing ``copy`` =
    ``p`` in the copy's dtype; ``step``: the 0-dim count, already advanced; ``grad_scale`` divides ``g``;
    ``found_inf != 0`` skips the update. One Triton pass on CUDA (titan_mm/kernels/adamw.py), the same arithmetic
    in torch ops elsewhere."""
    if use_triton(p, g, m, v, copy) and all(t.is_contiguous() for t in (p, g, m, v, copy)):
        return _adamw(p, g, m, v, copy, step, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf)
    keep = None if found_inf is None else (found_inf != 0)
    old = None if keep is None else (p.clone(), m.clone(), v.clone())
    g = g.float() if grad_scale is None else g.float() / grad_scale
    step_f = step.float()
    bias1 = 1 - beta1 ** step_f
    bias2_sqrt = (1 - beta2 ** step_f).sqrt()
    p.sub_(lr * weight_decay * p)
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    p.sub_((lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps))
    if old is not None:  # a skipped step leaves everything as it was (no host read of the flag)
        for t, o in zip((p, m, v), old):
            t.copy_(torch.where(keep, o, t))
    copy.copy_(p)


def moe_expand(x: torch.Tensor, src_A: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """x[src_A]: each token's row once per expert it goes to (titan_mm.nn.moe.expand_rows); the
    backward sums each token's K row gradients in one pass."""
    if use_triton(x):
        return ExpandFunction.apply(x, src_A, inv_NK, _dispatch.use_ops())
    return _expand_rows_ref(x, src_A, inv_NK)


def moe_combine(y_AD: torch.Tensor, top_w_NK: torch.Tensor, r, dtype: torch.dtype) -> torch.Tensor:
    """Each token's expert outputs ``y_AD`` (rows in expert order) weighted by its router weights and summed in
    increasing expert id (titan_mm.nn.moe.combine; ``r`` its Routing), in one pass; -> [N, D] in dtype."""
    if use_triton(y_AD, top_w_NK):
        w_NK = top_w_NK.gather(1, r.order_A[r.inv_NK] % top_w_NK.shape[1])  # the weight of each sorted slot
        y = y_AD.to(dtype)
        return moe_combine_op(y, r.inv_NK, w_NK) if _dispatch.use_ops() else CombineFunction.apply(y, r.inv_NK, w_NK)
    return _combine_ref(y_AD, top_w_NK, r, dtype)


def moe_routing(logits_NE: torch.Tensor, top_k: int, norm_topk_prob: bool,
                valid_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE routing from the router logits [N, E] (titan_mm.nn.moe.route_stats): -> (top_w_NK in the
    logits' dtype, top_i_NK int64, aux stats [2, E] fp32: assignment counts and prob sums over the rows ``valid_N``
    keeps). One Triton pass per block of rows; equal values rank by the lower expert index."""
    if (use_triton(logits_NE) and logits_NE.dim() == 2 and 0 < top_k <= logits_NE.shape[1] <= _ROUTING_MAX_E
            and (valid_N is None or (valid_N.device == logits_NE.device and valid_N.numel() == logits_NE.shape[0]))):
        valid = None if valid_N is None else valid_N.reshape(-1)
        if _dispatch.use_ops():
            return moe_routing_op(logits_NE, valid, top_k, bool(norm_topk_prob))
        return RoutingFunction.apply(logits_NE, valid, top_k, bool(norm_topk_prob))
    return _route_stats_ref(logits_NE, top_k, norm_topk_prob, valid_N)
