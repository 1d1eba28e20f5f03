"""RoPE (Qwen3 half rotation) and Qwen3-VL interleaved M-RoPE on q and k, forward and backward.

Each program rotates all q heads and all k heads of BS consecutive tokens ([BS, heads, Dh/2] tiles),
loading cos/sin once per token. Inputs are read through their strides (a [B, H, S, Dh] tensor passed as
.transpose(1, 2) needs no copy); outputs are contiguous [B, S, H, Dh]. The backward is the same kernel with
the rotation inverted (sin times a runtime sign of -1), so forward and backward share one compiled kernel
and one tuned config (tokens per program, warps; picked per head layout and dtype by `_utils.Tuner`).

cos/sin tables: only the first Dh/2 entries of the last dim are read, so both the HF layout (Dh, halves
duplicated) and a half table (Dh/2) work.
- RoPE:   [S, X] or [B, S, X]
- M-RoPE: [3, B, S, X] per-axis (T, H, W) tables; frequency j takes axis H when j % 3 == 1 and
  j < 3 * mrope_section[1], axis W when j % 3 == 2 and j < 3 * mrope_section[2], else T
  (transformers' Qwen3-VL interleaving). The kernel loads the three axis rows of a token contiguously and
  selects per frequency (no gather).
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
    COS, SIN, sca, scb, scs,
    NT, S, HQ, HK, HALF, END_H, END_W, sign,
    MROPE: tl.constexpr, BS: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr,
):
    t = tl.program_id(0) * BS + tl.arange(0, BS)  # token ids (b * S + s)
    mt = t < NT
    b = t // S
    s = t - b * S
    j = tl.arange(0, BD)
    mc = mt[:, None] & (j < HALF)[None, :]
    coff = (b.to(tl.int64) * scb + s.to(tl.int64) * scs)[:, None] + j[None, :]
    if MROPE:
        is_h = (((j % 3) == 1) & (j < END_H))[None, :]
        is_w = (((j % 3) == 2) & (j < END_W))[None, :]
        c = tl.where(is_h, tl.load(COS + sca + coff, mask=mc, other=0.0),
                     tl.where(is_w, tl.load(COS + 2 * sca + coff, mask=mc, other=0.0),
                              tl.load(COS + coff, mask=mc, other=0.0)))
        sn = tl.where(is_h, tl.load(SIN + sca + coff, mask=mc, other=0.0),
                      tl.where(is_w, tl.load(SIN + 2 * sca + coff, mask=mc, other=0.0),
                               tl.load(SIN + coff, mask=mc, other=0.0)))
    else:
        c = tl.load(COS + coff, mask=mc, other=0.0)
        sn = tl.load(SIN + coff, mask=mc, other=0.0)
    c = c.to(tl.float32)
    sn = sn.to(tl.float32) * sign
    _rot_heads(Q, sqb, sqs, sqh, QO, b, s, t, mt, HQ, HALF, c, sn, BHQ, BD)
    _rot_heads(K, skb, sks, skh, KO, b, s, t, mt, HK, HALF, c, sn, BHK, BD)


writes(_rope_kernel, 'QO', 'KO')


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


def rope_impl(q, k, cos, sin, mrope_section, inverse, op=False):
    """op=True: from the triton_op body (traceable launches through `wrap_triton`); False: eager Function."""
    kern = wrap_triton(_rope_kernel) if op else _rope_kernel
    mrope = len(mrope_section) > 0
    q4, k4 = _as_bshd(q), _as_bshd(k)
    B, S, HQ, DH = q4.shape
    HK = k4.shape[2]
    assert DH % 2 == 0 and k4.shape[3] == DH, "head_dim must be even and equal for q and k"
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
    nt = B * S
    if nt > 0:
        def launch(c):
            kern[(triton.cdiv(nt, c["BS"]),)](
                q4, q4.stride(0), q4.stride(1), q4.stride(2), k4, k4.stride(0), k4.stride(1), k4.stride(2), qo, ko,
                c4, s4, c4.stride(0), c4.stride(1), c4.stride(2),
                nt, S, HQ, HK, half, end_h, end_w, -1.0 if inverse else 1.0,
                MROPE=mrope, BHQ=next_pow2(HQ), BHK=next_pow2(HK), BD=next_pow2(half), **c,
            )

        traced = kern is not _rope_kernel  # no timing while traced: the pick goes into the graph
        launch(_ROPE.pick((int(HQ), int(HK), int(DH), mrope, q.dtype), None if traced else launch))
    return qo.view(q.shape), ko.view(k.shape)


# triton_op: the body is the fake implementation too, and under torch.compile it is traced into the graph.
@torch.library.triton_op("titan_mm::rope", mutates_args=())
def rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int], inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_impl(q, k, cos, sin, mrope_section, inverse, op=True)


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
