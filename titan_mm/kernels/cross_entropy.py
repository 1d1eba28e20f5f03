"""Fused linear + cross-entropy that never materializes the full [N, V] logits.

Tokens are processed in chunks of C rows: logits_C = h_C @ W^T (cuBLAS, in h.dtype), then a Triton
program per row (or a persistent grid of them, a launch config picked by `_utils.Tuner`) makes two passes
over its row (online max / sum-exp, then softmax) and overwrites the logits in place with d(loss)/d(logits);
the gradients for h and W are finished right away in the forward (grad_h_C = dlogits_C @ W,
grad_W += dlogits_C^T @ h_C), so the backward only scales them by the incoming gradient (in place in eager).
Peak extra memory: one C x V logits chunk plus grad_W and grad_h.

Loss (fp32, sum reduction): sum over labels != ignore_index of w * ((lse - logit[label]) + z_loss * lse^2), w the
row's optional weight (1 without weights; a masked-diffusion objective's 1/t). Rows with an ignored label contribute
0 to the loss and get zero gradients; a weighted row's gradient is w times the unweighted one.
Legend: N tokens, D hidden, V vocabulary, C chunk rows.
"""


import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ._utils import Tuner, as_rows, new_empty, next_pow2, sm_count


@triton.jit
def _row_lse(base, V: tl.constexpr, BLOCK: tl.constexpr):
    """Log-sum-exp (fp32) of the V logits at ``base``: one pass with a running max and rescaled sum per lane."""
    offs = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], -1e30, tl.float32)
    d_vec = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        msk = cols < V
        x = tl.where(msk, tl.load(base + cols, mask=msk, other=0.0).to(tl.float32), -1e30)
        m_new = tl.maximum(m_vec, x)
        d_vec = d_vec * tl.exp(m_vec - m_new) + tl.where(msk, tl.exp(x - m_new), 0.0)
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    return m + tl.log(tl.sum(d_vec * tl.exp(m_vec - m), axis=0))


@triton.jit
def _write_row_grad(base, lse, scale, tgt, tscale, V: tl.constexpr, BLOCK: tl.constexpr):
    """Overwrite the V logits at ``base`` with d(loss)/d(logits) = softmax(lse) * scale - tscale * onehot(tgt)
    (tgt < 0: none; tscale is the row's weight)."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        msk = cols < V
        x = tl.load(base + cols, mask=msk, other=0.0).to(tl.float32)
        p = tl.exp(x - lse) * scale
        p = tl.where(cols == tgt, p - tscale, p)
        tl.store(base + cols, p.to(base.dtype.element_ty), mask=msk)


@triton.jit
def _ce_row_kernel(
    L, stride_l, LAB, LOSS, WT, ignore_index, z_loss, n_rows, row_step,
    V: tl.constexpr, WRITE_GRAD: tl.constexpr, HAS_Z: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
):
    """Rows pid, pid + row_step, ... of the chunk (row_step = the grid size: one row per program when the grid
    covers the chunk, several per program with a persistent grid)."""
    row = tl.program_id(0).to(tl.int64)
    while row < n_rows:  # a `while`: the CPU interpreter cannot run a runtime `range`
        base = L + row * stride_l
        lab = tl.load(LAB + row)
        valid = lab != ignore_index
        lab = tl.where(valid, lab, 0)
        lse = _row_lse(base, V, BLOCK)
        x_t = tl.load(base + lab).to(tl.float32)
        loss = lse - x_t
        if HAS_Z:
            loss += z_loss * lse * lse
        wt = tl.where(valid, 1.0, 0.0)
        if HAS_W:
            wt = wt * tl.load(WT + row).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, loss * wt, 0.0))
        if WRITE_GRAD:
            scale = wt
            if HAS_Z:
                scale = scale * (1.0 + 2.0 * z_loss * lse)
            _write_row_grad(base, lse, scale, tl.where(valid, lab, -1), wt, V, BLOCK)
        row += row_step


def _row_configs(key):
    """PPS: programs per SM of a persistent grid (0: one program per row, the whole chunk in flight at once);
    warps; BLOCK: logits per load. On the H200 (151,936 vocabulary, bf16) one program per SM with 16,384-wide
    loads and 32 warps was 15% faster than one program per row; a persistent grid with 8,192-wide loads gained
    < 1%."""
    v = key[0]
    block = min(8192, next_pow2(v))
    warps = 16 if block >= 8192 else 8
    cands = [dict(PPS=0, BLOCK=block, num_warps=warps), dict(PPS=1, BLOCK=block, num_warps=warps),
             dict(PPS=2, BLOCK=block, num_warps=warps), dict(PPS=1, BLOCK=2 * block, num_warps=2 * warps),
             dict(PPS=2, BLOCK=block, num_warps=warps // 2)]
    return [c for i, c in enumerate(cands) if c not in cands[:i]]


_ROWS = Tuner("linear_cross_entropy", _row_configs)


def _ce_rows(logits, lab, loss_rows, ignore_index, z_loss, write_grad, wt=None):
    """The row kernel over a chunk's logits (in place with write_grad); ``wt``: the rows' weights (None: 1).
    Tuned per (V, dtype, write_grad) inside `_utils.tuning()`: the candidates are timed on a copy of the chunk
    (the kernel overwrites its input)."""
    n, v = logits.shape
    sms = sm_count(logits.device)

    def run(c, buf, out):
        c = dict(c)
        pps = c.pop("PPS")
        grid = n if pps == 0 else min(n, pps * sms)
        _ce_row_kernel[(grid,)](buf, buf.stride(0), lab, out, lab if wt is None else wt, ignore_index,
                                float(z_loss), n, grid, V=v, WRITE_GRAD=write_grad, HAS_Z=z_loss != 0.0,
                                HAS_W=wt is not None, **c)

    scratch = []

    def timed(c):  # only called while tuning
        if not scratch:
            scratch.extend((logits.clone(), torch.empty_like(loss_rows)))
        run(c, *scratch)

    run(_ROWS.pick((v, logits.dtype, bool(write_grad)), timed), logits, loss_rows)


@triton.jit
def _scale_kernel(X, G, N, BLOCK: tl.constexpr):
    """X[:N] *= G[0] in place, in fp32 (the backward's scale of the gradients computed in the forward)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G).to(tl.float32)
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=m)


def scale_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x *= g (a 1-element tensor on x's device) in place for a contiguous x, math in fp32. One vectorized
    pass: a bf16 tensor times an fp32 0-d tensor through torch's `mul_` takes a slower mixed-dtype kernel
    (about 3x the time of a copy at 151,936 x 4096 on the H200)."""
    assert x.is_contiguous()
    n = x.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, 4096),)](x, g.reshape(1), n, BLOCK=4096, num_warps=8)
    return x


def default_chunk_size(n: int, d: int, v: int) -> int:
    """Rows per chunk: the logits chunk holds about as many elements as h (Liger's rule, same peak)."""
    return max(1, next_pow2(triton.cdiv(n, triton.cdiv(v, d))))


def lce_impl(h, w, labels, ignore_index, z_loss, compute_grad, chunk_size, accum_fp32=False, weights=None):
    h2 = as_rows(h).contiguous()
    w = w.contiguous()
    lab = labels.reshape(-1).contiguous()
    wt = None if weights is None else weights.reshape(-1).to(torch.float32).contiguous()
    n, d = h2.shape
    v = w.shape[0]
    c = chunk_size if chunk_size > 0 else default_chunk_size(n, d, v)
    loss_rows = new_empty((n,), torch.float32, h.device)
    acc32 = compute_grad and accum_fp32 and w.dtype != torch.float32
    if compute_grad:
        grad_h = new_empty((n, d), h.dtype, h.device)
        # the first chunk writes it (mm out=), later chunks addmm_ into it
        grad_w = new_empty(w.shape, torch.float32 if acc32 else w.dtype, w.device)
    else:
        grad_h, grad_w = h.new_empty(0), w.new_empty(0)
    if n == 0 and compute_grad:
        grad_w.zero_()
    logits_buf = new_empty((min(c, n), v), h.dtype, h.device) if n > 0 else None  # one buffer for all chunks
    for s in range(0, n, c):
        e = min(n, s + c)
        hc = h2[s:e]
        logits = logits_buf[: e - s]
        torch.mm(hc, w.t(), out=logits)
        _ce_rows(logits, lab[s:e], loss_rows[s:e], ignore_index, z_loss, compute_grad, None if wt is None else wt[s:e])
        if compute_grad:
            torch.mm(logits, w, out=grad_h[s:e])
            if acc32:
                _addmm_fp32(grad_w, logits.t(), hc, first=s == 0)
            elif s == 0:
                torch.mm(logits.t(), hc, out=grad_w)
            else:
                grad_w.addmm_(logits.t(), hc)
    loss = loss_rows.sum()
    if compute_grad:
        grad_h = grad_h.view(h.shape)
        if acc32:
            grad_w = grad_w.to(w.dtype)  # one rounding at the end instead of one per chunk
    return loss, grad_h, grad_w


# ---- vocabulary-parallel variant (loss parallel: each tp rank holds rows [v0, v0 + V) of the head) ----
@triton.jit
def _ce_shard_stats_kernel(L, stride_l, LOC, LSE, TGT, V: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: the log-sum-exp of this shard's logits, and the target logit when the label is in the shard
    (LOC = label - v0, or -1 for ignored rows / labels of other shards; TGT = 0 otherwise)."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    loc = tl.load(LOC + row)
    mine = (loc >= 0) & (loc < V)
    tl.store(LSE + row, _row_lse(base, V, BLOCK))
    x_t = tl.load(base + tl.where(mine, loc, 0)).to(tl.float32)
    tl.store(TGT + row, tl.where(mine, x_t, 0.0))


@triton.jit
def _ce_shard_grad_kernel(L, stride_l, LOC, LSE, SCALE, WT, V: tl.constexpr, BLOCK: tl.constexpr):
    """Overwrite this shard's logits with d(loss)/d(logits): softmax(global lse) * scale - weight * onehot."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    _write_row_grad(base, tl.load(LSE + row), tl.load(SCALE + row), tl.load(LOC + row), tl.load(WT + row), V, BLOCK)


def lce_vocab_parallel_impl(h, w, labels, vocab_start, group, ignore_index, z_loss, compute_grad, chunk_size,
                            weights=None):
    """As :func:`lce_impl` with ``w`` = rows [vocab_start, vocab_start + V) of the head, the other rows on the
    other ranks of ``group``. Per chunk: this shard's logits (cuBLAS), a Triton pass for the shard's per-row
    log-sum-exp and target logit, one all-gather of those [2, C] pieces (combined to the global lse and target
    logit on every rank), a Triton pass writing the shard's d(loss)/d(logits) in place, then the gradient
    matmuls. grad_W is this shard's; grad_h is all-reduced over ``group`` once at the end. Same loss on every
    rank. ``weights``: per-token weights [N] (None: 1)."""
    h2 = as_rows(h).contiguous()
    w = w.contiguous()
    lab = labels.reshape(-1).contiguous()
    n, d = h2.shape
    v = w.shape[0]
    world = dist.get_world_size(group)
    c = chunk_size if chunk_size > 0 else default_chunk_size(n, d, v)  # a logits chunk ~ the size of h
    block = min(8192, next_pow2(v))
    valid = lab != ignore_index
    loc = torch.where(valid & (lab >= vocab_start) & (lab < vocab_start + v), lab - vocab_start, -1)
    loss_rows = torch.zeros((n,), dtype=torch.float32, device=h.device)
    if compute_grad:
        grad_h = new_empty((n, d), h.dtype, h.device)
        grad_w = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    else:
        grad_h, grad_w = h.new_empty(0), w.new_empty(0)
    logits_buf = new_empty((min(c, n), v), h.dtype, h.device) if n > 0 else None
    for s in range(0, n, c):
        e = min(n, s + c)
        hc = h2[s:e]
        logits = logits_buf[: e - s]
        torch.mm(hc, w.t(), out=logits)
        pieces = new_empty((2, e - s), torch.float32, h.device)
        _ce_shard_stats_kernel[(e - s,)](logits, logits.stride(0), loc[s:e], pieces[0], pieces[1], V=v, BLOCK=block,
                                         num_warps=16 if block >= 8192 else 8)
        every = new_empty((world * 2, e - s), torch.float32, h.device)  # ranks' pieces concatenated on dim 0
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch renamed it
        all_gather(every, pieces, group=group)
        every = every.view(world, 2, e - s)
        lse = torch.logsumexp(every[:, 0], 0)
        tgt = every[:, 1].sum(0)
        vf = valid[s:e].float()  # the rows' weights, 0 on ignored rows
        if weights is not None:
            vf = vf * weights.reshape(-1)[s:e].float()
        row_loss = lse - tgt + (z_loss * lse * lse if z_loss else 0.0)
        loss_rows[s:e] = row_loss * vf
        if compute_grad:
            scale = vf * (1.0 + 2.0 * z_loss * lse) if z_loss else vf
            _ce_shard_grad_kernel[(e - s,)](logits, logits.stride(0), loc[s:e], lse, scale.contiguous(),
                                            vf.contiguous(), V=v, BLOCK=block, num_warps=16 if block >= 8192 else 8)
            torch.mm(logits, w, out=grad_h[s:e])
            grad_w.addmm_(logits.t(), hc)
    if compute_grad and n > 0:
        dist.all_reduce(grad_h, group=group)  # every vocabulary shard contributes to each token's gradient
    loss = loss_rows.sum()
    if compute_grad:
        grad_h = grad_h.view(h.shape)
    return loss, grad_h, grad_w


class VocabParallelLinearCrossEntropyFunction(torch.autograd.Function):
    """Eager autograd around :func:`lce_vocab_parallel_impl` (it runs collectives, so it has no custom op; the
    loss is outside the compiled blocks)."""

    @staticmethod
    def forward(ctx, h, w, labels, vocab_start, group, ignore_index, z_loss, chunk_size, weights=None):
        compute_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, grad_h, grad_w = lce_vocab_parallel_impl(h, w, labels, vocab_start, group, ignore_index, z_loss,
                                                       compute_grad, chunk_size, weights)
        ctx.compute_grad = compute_grad
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        gh, gw, *_ = _backward(ctx, dloss, None, None)
        return gh, gw, None, None, None, None, None, None, None


def _addmm_fp32(acc, a, b, first: bool):
    """acc (fp32) (+)= a @ b for bf16/fp16 a, b without materializing fp32 copies of them."""
    if acc.is_cuda:
        if first:
            acc.zero_()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # torch >= 2.8
    elif first:
        torch.mm(a.float(), b.float(), out=acc)
    else:
        acc.add_(a.float() @ b.float())


@torch.library.custom_op("titan_mm::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    compute_grad: bool,
    chunk_size: int,
    accum_fp32: bool = False,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lce_impl(h, w, labels, ignore_index, z_loss, compute_grad, chunk_size, accum_fp32, weights)


@linear_cross_entropy_op.register_fake
def _(h, w, labels, ignore_index, z_loss, compute_grad, chunk_size, accum_fp32=False, weights=None):
    loss = h.new_empty((), dtype=torch.float32)
    if compute_grad:
        return loss, torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(w)
    return loss, h.new_empty(0), w.new_empty(0)


def _setup(ctx, inputs, output):
    ctx.compute_grad = inputs[5]
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, dloss, _dgh, _dgw):
    if not ctx.compute_grad:
        raise RuntimeError("linear_cross_entropy ran with compute_grad=False; it has no backward")
    grad_h, grad_w = ctx.saved_tensors
    g = dloss.to(torch.float32)
    eager = type(grad_h) is torch.Tensor and type(grad_w) is torch.Tensor and not torch.compiler.is_compiling()
    if eager:  # scale the buffers computed in forward (Triton path) in place: no second grad_W-sized tensor
        gh, gw = scale_(grad_h, g), scale_(grad_w, g)
    else:  # traced (compile / export / AOT): functional, fp32 math as scale_; the compiler reuses the dead buffers
        gh, gw = (grad_h.float() * g).to(grad_h.dtype), (grad_w.float() * g).to(grad_w.dtype)
    return gh, gw, None, None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The eager fast path (same kernels, without the custom-op dispatcher's overhead)."""

    @staticmethod
    def forward(ctx, h, w, labels, ignore_index, z_loss, compute_grad, chunk_size, accum_fp32, weights=None):
        loss, grad_h, grad_w = lce_impl(h, w, labels, ignore_index, z_loss, compute_grad, chunk_size, accum_fp32,
                                        weights)
        ctx.compute_grad = compute_grad
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        return _backward(ctx, dloss, None, None)
