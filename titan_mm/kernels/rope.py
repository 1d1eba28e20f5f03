"""RoPE (Qwen3 half rotation) on q and k, forward and backward.

Each program rotates all q heads and all k heads of BS consecutive tokens ([BS, heads, Dh/2] tiles),
loading cos/sin once per token. Inputs are read through their strides (a [B, H, S, Dh] tensor passed as
.transpose(1, 2) needs no copy); outputs are contiguous [B, S, H, Dh]. The backward is the same kernel with
the rotation inverted (sin times a runtime sign of -1), so forward and backward share one compiled kernel
and one tuned config (tokens per program, warps; picked per head layout and dtype by `_utils.Tuner`).

cos/sin tables [S, X] or [B, S, X]: only the first Dh/2 entries of the last dim are read, so both the HF
layout (Dh, halves duplicated) and a half table (Dh/2) work. Qwen3-VL's interleaved M-RoPE runs through
this kernel too: the model builds the interleaved [B, S, Dh] table once per step (qwen3_vl mrope_cos_sin).
Legend: B batch, S sequence, Hq/Hk heads, Dh head dim, X table width, BS tokens per program.
"""


import torch
import triton
import triton.language as tl

from ._utils import Tuner, new_empty, next_pow2, wrap_triton, writes


def _configs(key):
    hq, hk, dh = key[:3]
    per_token = next_pow2(hq) * next_pow2(max(1, dh // 2))  # elements of one q half-tile
    out = []
    for elems, warps in ((2048, 4), (4096, 8), (4096, 4), (8192, 8)):
        c = dict(BS=max(1, min(64, elems // per_token)), num_warps=warps)
        if c not in out:
            out.append(c)
    return out


_ROPE = Tuner("rope", _configs)


@triton.jit
def _rot_heads(X, sxb, sxs, sxh, O, b, s, t, mt, H, HALF, c, sn, BH: tl.constexpr, BD: tl.constexpr):
    h = tl.arange(0, BH)
    j = tl.arange(0, BD)
    m = mt[:, None, None] & ((h < H)[:, None] & (j < HALF)[None, :])[None, :, :]
    x_tok = b.to(tl.int64) * sxb + s.to(tl.int64) * sxs  # [BS] int64; in-token offsets are int32
    x_in = (h * sxh)[:, None] + j[None, :]
    xp = X + x_tok[:, None, None] + x_in[None, :, :]
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    c3 = c[:, None, :]
    s3 = sn[:, None, :]
    o_tok = t.to(tl.int64) * (H * 2 * HALF)  # outputs are contiguous [tokens, H, 2 * HALF]
    op = O + o_tok[:, None, None] + ((h * (2 * HALF))[:, None] + j[None, :])[None, :, :]
    tl.store(op, (x1 * c3 - x2 * s3).to(O.dtype.element_ty), mask=m)
    tl.store(op + HALF, (x2 * c3 + x1 * s3).to(O.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(
    Q, sqb, sqs, sqh, K, skb, sks, skh, QO, KO,
    COS, SIN, scb, scs,
    NT, S, HQ, HK, HALF: tl.constexpr, sign,  # HALF a constant: x2's offset known, so odd halves (40) vectorize
    BS: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr,
):
    t = tl.program_id(0) * BS + tl.arange(0, BS)  # token ids (b * S + s)
    mt = t < NT
    b = t // S
    s = t - b * S
    j = tl.arange(0, BD)
    mc = mt[:, None] & (j < HALF)[None, :]
    coff = (b.to(tl.int64) * scb + s.to(tl.int64) * scs)[:, None] + j[None, :]
    c = tl.load(COS + coff, mask=mc, other=0.0).to(tl.float32)
    sn = tl.load(SIN + coff, mask=mc, other=0.0).to(tl.float32) * sign
    _rot_heads(Q, sqb, sqs, sqh, QO, b, s, t, mt, HQ, HALF, c, sn, BHQ, BD)
    _rot_heads(K, skb, sks, skh, KO, b, s, t, mt, HK, HALF, c, sn, BHK, BD)


writes(_rope_kernel, 'QO', 'KO')


def _table(t: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """-> [B, S, X] view, a broadcast batch dim with stride 0."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        t = t.unsqueeze(0)
    return t.expand(B, S, t.shape[-1])


def _as_bshd(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.unsqueeze(0) if x.dim() == 3 else x


def rope_impl(q, k, cos, sin, inverse, op=False):
    """op=True: from the triton_op body (traceable launches through `wrap_triton`); False: eager Function."""
    kern = wrap_triton(_rope_kernel) if op else _rope_kernel
    q4, k4 = _as_bshd(q), _as_bshd(k)
    B, S, HQ, DH = q4.shape
    HK = k4.shape[2]
    assert DH % 2 == 0 and k4.shape[3] == DH, "head_dim must be even and equal for q and k"
    half = DH // 2
    c3 = _table(cos, B, S)
    s3 = _table(sin, B, S)
    if s3.stride() != c3.stride():  # the kernel reads both through one set of strides
        c3, s3 = c3.contiguous(), s3.contiguous()
    assert c3.shape[-1] >= half, f"cos/sin last dim {c3.shape[-1]} < head_dim / 2 = {half}"
    qo = new_empty(q4.shape, q.dtype, q.device)
    ko = new_empty(k4.shape, k.dtype, k.device)
    nt = B * S
    if nt > 0:
        def launch(c):
            kern[(triton.cdiv(nt, c["BS"]),)](
                q4, q4.stride(0), q4.stride(1), q4.stride(2), k4, k4.stride(0), k4.stride(1), k4.stride(2), qo, ko,
                c3, s3, c3.stride(0), c3.stride(1),
                nt, S, HQ, HK, half, -1.0 if inverse else 1.0,
                BHQ=next_pow2(HQ), BHK=next_pow2(HK), BD=next_pow2(half), **c,
            )

        traced = kern is not _rope_kernel  # no timing while traced: the pick goes into the graph
        launch(_ROPE.pick((int(HQ), int(HK), int(DH), q.dtype), None if traced else launch))
    return qo.view(q.shape), ko.view(k.shape)


# triton_op: the body is the fake implementation too, and under torch.compile it is traced into the graph.
@torch.library.triton_op("titan_mm::rope", mutates_args=())
def rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_impl(q, k, cos, sin, inverse, op=True)


def _setup(ctx, inputs, output):
    q, k, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = rope_op(dq, dk, cos, sin, not ctx.inverse)
    return dq_in, dk_in, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup)


class RopeFunction(torch.autograd.Function):
    """The eager fast path (same kernel, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, inverse):
        ctx.save_for_backward(cos, sin)
        ctx.inverse = inverse
        return rope_impl(q, k, cos, sin, inverse)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rope_impl(dq, dk, cos, sin, not ctx.inverse)
        return dq_in, dk_in, None, None, None
