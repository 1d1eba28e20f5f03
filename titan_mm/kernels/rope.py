"""RoPE (Qwen3 half rotation) and Qwen3-VL interleaved M-RoPE on q and k, forward and backward.

One program per token rotates all q heads and all k heads, loading cos/sin once. Inputs are read
through their strides (a [B, H, S, Dh] tensor passed as .transpose(1, 2) needs no copy); outputs are
contiguous [B, S, H, Dh]. The backward is the same kernel with the rotation inverted (sin -> -sin).

cos/sin tables: only the first Dh/2 entries of the last dim are read, so both the HF layout (Dh, halves
duplicated) and a half table (Dh/2) work.
- RoPE:   [S, X] or [B, S, X]
- M-RoPE: [3, B, S, X] per-axis (T, H, W) tables; frequency j takes axis H when j % 3 == 1 and
  j < 3 * mrope_section[1], axis W when j % 3 == 2 and j < 3 * mrope_section[2], else T
  (transformers' Qwen3-VL interleaving), selected inside the kernel.
Legend: B batch, S sequence, Hq/Hk heads, Dh head dim, X table width.
"""


import torch
import triton
import triton.language as tl

from ._utils import new_empty, next_pow2


@triton.jit
def _rot_heads(X, sxb, sxs, sxh, O, sob, sos, soh, b, s, H, HALF, c, sn, BH: tl.constexpr, BD: tl.constexpr):
    h = tl.arange(0, BH)
    j = tl.arange(0, BD)
    m = (h[:, None] < H) & (j[None, :] < HALF)
    xb = X + b * sxb + s * sxs + h[:, None] * sxh + j[None, :]
    x1 = tl.load(xb, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF, mask=m, other=0.0).to(tl.float32)
    ob = O + b * sob + s * sos + h[:, None] * soh + j[None, :]
    tl.store(ob, (x1 * c - x2 * sn).to(O.dtype.element_ty), mask=m)
    tl.store(ob + HALF, (x2 * c + x1 * sn).to(O.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(
    Q, sqb, sqs, sqh, K, skb, sks, skh,
    QO, soqb, soqs, soqh, KO, sokb, soks, sokh,
    COS, SIN, sca, scb, scs,
    S, HQ, HK, HALF, END_H, END_W,
    SIGN: tl.constexpr, MROPE: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    j = tl.arange(0, BD)
    mj = j < HALF
    off = b * scb + s * scs + j
    if MROPE:
        axis = tl.where(((j % 3) == 1) & (j < END_H), 1, tl.where(((j % 3) == 2) & (j < END_W), 2, 0))
        off += axis.to(tl.int64) * sca
    c = tl.load(COS + off, mask=mj, other=0.0).to(tl.float32)[None, :]
    sn = (SIGN * tl.load(SIN + off, mask=mj, other=0.0).to(tl.float32))[None, :]
    _rot_heads(Q, sqb, sqs, sqh, QO, soqb, soqs, soqh, b, s, HQ, HALF, c, sn, BHQ, BD)
    _rot_heads(K, skb, sks, skh, KO, sokb, soks, sokh, b, s, HK, HALF, c, sn, BHK, BD)


def _table(t: torch.Tensor, mrope: bool, B: int, S: int) -> torch.Tensor:
    """-> [A, B, S, X] view (A = 3 for M-RoPE, else 1), broadcast dims with stride 0."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if mrope:
        assert t.dim() == 4 and t.shape[0] == 3, "M-RoPE cos/sin must be [3, B, S, X]"
    else:
        while t.dim() < 4:
            t = t.unsqueeze(0)
    return t.expand(t.shape[0], B, S, t.shape[-1])


def _as_bshd(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.unsqueeze(0) if x.dim() == 3 else x


def rope_impl(q, k, cos, sin, mrope_section, inverse):
    mrope = len(mrope_section) > 0
    q4, k4 = _as_bshd(q), _as_bshd(k)
    B, S, HQ, DH = q4.shape
    HK = k4.shape[2]
    half = DH // 2
    c4 = _table(cos, mrope, B, S)
    s4 = _table(sin, mrope, B, S)
    if s4.stride() != c4.stride():  # the kernel reads both through one set of strides
        c4, s4 = c4.contiguous(), s4.contiguous()
    assert c4.shape[-1] >= half, f"cos/sin last dim {c4.shape[-1]} < head_dim / 2 = {half}"
    qo = new_empty(q4.shape, q.dtype, q.device)
    ko = new_empty(k4.shape, k.dtype, k.device)
    end_h = 3 * mrope_section[1] if mrope else 0
    end_w = 3 * mrope_section[2] if mrope else 0
    if B * S > 0:
        _rope_kernel[(B * S,)](
            q4, q4.stride(0), q4.stride(1), q4.stride(2), k4, k4.stride(0), k4.stride(1), k4.stride(2),
            qo, qo.stride(0), qo.stride(1), qo.stride(2), ko, ko.stride(0), ko.stride(1), ko.stride(2),
            c4, s4, c4.stride(0), c4.stride(1), c4.stride(2),
            S, HQ, HK, half, end_h, end_w,
            SIGN=-1.0 if inverse else 1.0, MROPE=mrope,
            BHQ=next_pow2(HQ), BHK=next_pow2(HK), BD=next_pow2(half), num_warps=4,
        )
    return qo.view(q.shape), ko.view(k.shape)


@torch.library.custom_op("titan_mm::rope", mutates_args=())
def rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int], inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_impl(q, k, cos, sin, mrope_section, inverse)


@rope_op.register_fake
def _(q, k, cos, sin, mrope_section, inverse):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )


def _setup(ctx, inputs, output):
    q, k, cos, sin, mrope_section, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.mrope_section = mrope_section
    ctx.inverse = inverse


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = rope_op(dq, dk, cos, sin, ctx.mrope_section, not ctx.inverse)
    return dq_in, dk_in, None, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup)


class RopeFunction(torch.autograd.Function):
    """The eager fast path (same kernel, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, mrope_section, inverse):
        ctx.save_for_backward(cos, sin)
        ctx.mrope_section, ctx.inverse = mrope_section, inverse
        return rope_impl(q, k, cos, sin, mrope_section, inverse)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rope_impl(dq, dk, cos, sin, ctx.mrope_section, not ctx.inverse)
        return dq_in, dk_in, None, None, None, None
