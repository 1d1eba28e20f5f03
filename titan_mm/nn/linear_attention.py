"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): the depthwise causal short convolution and the gated delta
rule over packed documents. A PyTorch reference in two forms (chunked, for training; step by step, for tests and
decoding) runs anywhere; on CUDA the chunked rule runs as flash-linear-attention's Triton kernel (fla-core).

Legend: B batch, S sequence, T = B*S flat tokens, H key heads, HV value heads (a multiple of H: key head h serves the
HV/H consecutive value heads h*HV/H ..), K key head dim, V value head dim, C conv channels, W conv width, L chunk
length, N segments (documents and each row's padding).

The rule, per value head, with q and k L2-normalized and q scaled by K^-1/2, state S [K, V] starting at 0:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T          o_t = S_t^T q_t

g_t <= 0 is the log decay, beta_t in (0, 1) the write strength.

Packing. Every document starts from S = 0 and its convolution reads no token of an earlier document. The host
builds :class:`LinearMeta` from the batch's ``cu_seqlens`` (or ``doc_ids``) before the forward
(:func:`build_linear_meta`); the forward only reads it (no host sync): the reference masks by each token's position
in its document (``doc_pos``), the fla kernel takes the flat ``cu_seqlens`` and the chunk table built with it.
Without metadata every row is one document.

The chunked form (:func:`chunk_gated_delta_rule`) splits each row into chunks of L tokens. Inside a chunk, with
gamma_i the decay summed from the chunk start (or the document start, when the document starts inside the chunk)
to token i, the chunk's pseudo-values U solve the unit lower-triangular system

    (I + A) U = beta V - (beta exp(gamma) carry K) S0,       A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j  (j < i)

where S0 is the state at the chunk start and carry_i says token i's document began before the chunk. Then
O = (exp(gamma) carry Q) S0 + (Q K^T * decay) U and the state at the chunk end is
exp(gamma_last) carry_last S0 + K_end^T U; pairs (i, j) of different documents have decay 0.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

IMPLS = ("auto", "fla", "torch")
CHUNK = 64
"""Chunk length of the chunked rule (fla's default; the chunk table of :class:`LinearMeta` is built for it)."""


class LinearMeta(NamedTuple):
    """The documents of a batch as the linear-attention layers read them (host-built, on the device)."""

    doc_pos: torch.Tensor
    """[B, S] int64: each token's position in its segment (documents and each row's padding)."""
    cu_seqlens: torch.Tensor
    """[N + 1] int64: the segments over the flat B*S tokens (fla's varlen input)."""
    chunk_indices: torch.Tensor
    """[n_chunks, 2] int64: (segment, chunk of the segment) of every chunk of CHUNK tokens (fla's chunk table)."""
    cu_seqlens_cpu: torch.Tensor
    """``cu_seqlens`` on the host: fla-core 0.4 builds its chunk table from it (no device read)."""


def segment_starts(batch: dict[str, Any]) -> torch.Tensor | None:
    """Host side: the flat segment boundaries [N + 1] (int64) of a batch, from ``cu_seqlens`` or else from the
    runs of ``doc_ids`` in each row; None when the batch has neither (every row one document)."""
    ids = batch["input_ids"]
    B, S = ids.shape
    cu = batch.get("cu_seqlens")
    if cu is None:
        doc = batch.get("doc_ids")
        if doc is None:
            return None
        doc = doc.cpu()
        start = torch.ones(B, S, dtype=torch.bool)
        start[:, 1:] = doc[:, 1:] != doc[:, :-1]
        cu = torch.cat([start.reshape(-1).nonzero()[:, 0], torch.tensor([B * S])])
    cu = cu.cpu().to(torch.int64)
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != B * S or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"batch['cu_seqlens'] must rise from 0 to B*S = {B * S} (the flat tokens of input_ids "
                         f"[{B}, {S}]); got {cu.tolist()[:8]}...; build batches with "
                         "titan_mm.data.packing.collate_rows")
    rows = torch.arange(0, B * S + 1, S)
    if not bool(torch.isin(rows, cu).all()):
        raise ValueError("batch['cu_seqlens'] has a segment that crosses a row of input_ids; each row's documents "
                         "and padding must be segments of their own (titan_mm.data.packing.collate_rows)")
    return cu


def build_linear_meta(batch: dict[str, Any], device: torch.device | str, chunk: int = CHUNK) -> LinearMeta | None:
    """Host side, before the forward: :class:`LinearMeta` of ``batch`` on ``device`` (non-blocking copies), or None
    when the batch marks no documents (every row is one)."""
    cu = segment_starts(batch)
    if cu is None:
        return None
    B, S = batch["input_ids"].shape
    lens = cu[1:] - cu[:-1]
    lens = lens[lens > 0]
    cu = torch.cat([cu[:1], cu[:1] + lens.cumsum(0)])
    pos = torch.arange(B * S) - torch.repeat_interleave(cu[:-1], lens)
    n_chunks = (lens + chunk - 1) // chunk
    seg = torch.repeat_interleave(torch.arange(len(lens)), n_chunks)
    first = torch.repeat_interleave(n_chunks.cumsum(0) - n_chunks, n_chunks)
    chunks = torch.stack([seg, torch.arange(int(n_chunks.sum())) - first], 1)
    dev = torch.device(device)
    return LinearMeta(*(t.to(dev, non_blocking=True) for t in (pos.view(B, S), cu, chunks)), cu_seqlens_cpu=cu)


# ------------------------------------------------------------------------------------------------ the convolution
def causal_conv1d(x_BSC: torch.Tensor, w_CW: torch.Tensor, doc_pos_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over the sequence, y_t = sum_j w[:, W-1-j] * x_{t-j} (fp32 sums, returned in
    x's dtype): HF's ``conv1d(padding=W-1)[..., :S]``. Taps that reach into an earlier document (``doc_pos`` < j)
    read 0, as at a row start."""
    W = w_CW.shape[-1]
    ct = torch.promote_types(x_BSC.dtype, torch.float32)
    xf, wf = x_BSC.to(ct), w_CW.to(ct)
    y = xf * wf[:, W - 1]
    for j in range(1, W):
        xs = F.pad(xf, (0, 0, j, 0))[:, : x_BSC.shape[1]]
        if doc_pos_BS is not None:
            xs = xs * (doc_pos_BS >= j)[..., None]
        y = y + xs * wf[:, W - 1 - j]
    return y.to(x_BSC.dtype)


def causal_conv1d_cached(x_BSC: torch.Tensor, w_CW: torch.Tensor, state_BWC: torch.Tensor,
                         n_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution continuing a sequence (serving): ``state`` [B, W-1, C] holds the inputs before the row's
    first token (zeros at a sequence start), ``n_new`` [B] (device) the row's real tokens (the rest is padding).
    Returns (y [B, S, C], the new state: the last W-1 inputs up to the row's last real token)."""
    W = w_CW.shape[-1]
    xs = torch.cat([state_BWC.to(x_BSC.dtype), x_BSC], 1)  # [B, W-1+S, C]
    y = causal_conv1d(xs, w_CW)[:, W - 1:]
    idx = n_new[:, None] + torch.arange(W - 1, device=x_BSC.device)  # xs rows n .. n+W-2: the inputs before n
    return y, xs.gather(1, idx[..., None].expand(-1, -1, xs.shape[-1]))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and HF's)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale):
    """fp32 [B, HV, S, .] copies with the key heads shared over their value heads, q / k normalized, q scaled."""
    H, HV = k.shape[2], v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    if HV != H:
        q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    ct = torch.promote_types(v.dtype, torch.float32)  # fp32 (float64 stays: the tests' ground truth)
    q, k, v, g, beta = (t.transpose(1, 2).to(ct) for t in (q, k, v, g, beta))
    q = l2norm(q) * (scale if scale is not None else q.shape[-1] ** -0.5)
    return q, l2norm(k), v, g, beta


# ------------------------------------------------------------------------------------------------ the reference
def recurrent_gated_delta_rule(q, k, v, g, beta, scale: float | None = None, doc_pos: torch.Tensor | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """The rule token by token (the ground truth; decoding). q, k [B, S, H, K], v [B, S, HV, V], g, beta
    [B, S, HV]; ``doc_pos`` [B, S] resets the state where it is 0 (the row's first document continues
    ``initial_state`` [B, HV, K, V]).
    Returns (o [B, S, HV, V] in q's dtype, final state [B, HV, K, V] fp32 or None)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    B, HV, S, K = k.shape
    state = (torch.zeros(B, HV, K, v.shape[-1], dtype=v.dtype, device=v.device) if initial_state is None
             else initial_state.to(v.dtype))
    out = []
    for t in range(S):
        if doc_pos is not None and t:  # a document starts from 0 (the row's first one continues initial_state)
            state = state * (doc_pos[:, t] > 0).view(B, 1, 1, 1)
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(out, 2).transpose(1, 2).to(dtype)
    return o, (state if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale: float | None = None, doc_pos: torch.Tensor | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           chunk: int = CHUNK):
    """The rule in chunks of ``chunk`` tokens (module docstring), the same inputs and outputs as
    :func:`recurrent_gated_delta_rule`; fp32 inside, differentiable (autograd through the triangular solves)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    B, HV, S, K = k.shape
    Vd = v.shape[-1]
    L = chunk
    n = math.ceil(S / L)
    pad = n * L - S
    if doc_pos is None:
        pos = torch.arange(n * L, device=q.device).expand(B, n * L)
    else:  # the tail pad continues the last segment (zero keys, values, betas and decays: no effect)
        tail = doc_pos[:, -1:] + 1 + torch.arange(pad, device=doc_pos.device)
        pos = torch.cat([doc_pos, tail], 1)
    q, k, v = (F.pad(t, (0, 0, 0, pad)).view(B, HV, n, L, -1) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)).view(B, HV, n, L) for t in (g, beta))
    p = pos.view(B, 1, n, L)
    c = torch.arange(L, device=q.device)
    carry = p > c  # the token's document began before its chunk: it reads the chunk's initial state
    carry[..., 0, :] = p[..., 0, :] >= c  # the row's first document continues ``initial_state``
    first = (c - p).clamp(min=0)  # the chunk index where the token's document (in this chunk) starts
    G = g.cumsum(-1)
    base = torch.where(first > 0, G.gather(-1, (first - 1).clamp(min=0).expand_as(G)), 0.0)
    gam = G - base  # decay summed from the token's chunk-or-document start
    same = (c[:, None] >= c[None, :]) & ((c[:, None] - c[None, :]) <= p[..., None])  # [B, 1, n, L, L]
    decay = torch.where(same, gam[..., :, None] - gam[..., None, :], -torch.inf).exp()
    eg = gam.exp() * carry
    A = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    eye = torch.eye(L, dtype=q.dtype, device=q.device)
    wv = torch.linalg.solve_triangular(A + eye, beta[..., None] * v, upper=False, unitriangular=True)
    wk = torch.linalg.solve_triangular(A + eye, (beta * eg)[..., None] * k, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_s = q * eg[..., None]
    last = same[..., L - 1, :]  # tokens of the chunk's last document
    k_end = k * (torch.where(last, gam[..., L - 1 : L] - gam, -torch.inf).exp())[..., None]
    keep = (gam[..., L - 1].exp() * carry[..., L - 1])[..., None, None]
    state = (torch.zeros(B, HV, K, Vd, dtype=q.dtype, device=q.device) if initial_state is None
             else initial_state.to(q.dtype))
    outs = []
    for i in range(n):
        u = wv[:, :, i] - wk[:, :, i] @ state
        outs.append(q_s[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * keep[:, :, i] + k_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(B, HV, n * L, Vd)[:, :, :S].transpose(1, 2).to(dtype)
    return o, (state if output_final_state else None)


# ------------------------------------------------------------------------------------------------ dispatch
_FLA: Any = None


def _fla():
    """(fla's chunked gated delta rule, whether it is fla-core >= 0.5) imported once, or None without fla-core.
    fla-core >= 0.5 takes fewer q / k heads than v heads and our chunk table; 0.4 takes equal heads and builds the
    table from the host's cu_seqlens. 0.4 is the one that runs the backward on Hopper with Triton < 3.7.1: 0.5+
    refuses it there (fla #640, a Triton miscompile at key tiles of 64; 0.4 tiles head_dim 128 whole)."""
    global _FLA
    if _FLA is None:
        try:
            import fla  # optional: fla-core (Triton) is a GPU extra; CPUs run the PyTorch reference
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

            _FLA = (fn, tuple(int(x) for x in fla.__version__.split(".")[:2]) >= (0, 5))
        except ImportError:
            _FLA = False
    return _FLA or None


def prefetch(impl: str) -> None:
    """Import fla now (at build time, on the host) when ``impl`` may pick it, so the forward never imports."""
    if impl not in IMPLS:
        raise ValueError(f"linear_attn_backend={impl!r}; choose one of {IMPLS}")
    if impl != "torch" and torch.cuda.is_available():
        _fla()


def resolve_impl(impl: str, device: torch.device) -> str:
    """``"auto"``: fla's kernel on CUDA when fla-core imports (else the PyTorch reference, with one warning),
    the reference elsewhere; ``"fla"`` / ``"torch"``: that one (``"fla"`` without fla-core raises)."""
    if impl not in IMPLS:
        raise ValueError(f"linear_attn_backend={impl!r}; choose one of {IMPLS}")
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return "torch"
    if _fla() is None:
        if impl == "fla":
            raise ImportError("linear_attn_backend='fla' needs flash-linear-attention: pip install fla-core")
        warnings.warn("fla-core is not installed: the Gated DeltaNet layers run the PyTorch reference on CUDA "
                      "(slow); pip install fla-core", stacklevel=3)
        return "torch"
    return "fla"


def gated_delta_rule(q, k, v, g, beta, meta: LinearMeta | None, impl: str = "auto") -> torch.Tensor:
    """Training form of the rule over the batch's documents (``meta``; None: every row one document): fla's
    chunked kernel or :func:`chunk_gated_delta_rule`. q, k [B, S, H, K], v [B, S, HV, V], g, beta [B, S, HV]
    (g in fp32); q and k are L2-normalized here. Returns o [B, S, HV, V] in q's dtype."""
    if resolve_impl(impl, q.device) == "torch":
        return chunk_gated_delta_rule(q, k, v, g, beta, doc_pos=None if meta is None else meta.doc_pos)[0]
    fn, grouped = _fla()
    if not grouped and v.shape[2] != q.shape[2]:  # fla-core 0.4: one q / k head per v head, as HF repeats them
        q, k = (t.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for t in (q, k))
    if meta is None:
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    B, S = q.shape[:2]
    flat = [t.reshape(1, B * S, *t.shape[2:]) for t in (q, k, v, g, beta)]
    table = dict(chunk_indices=meta.chunk_indices) if grouped else dict(cu_seqlens_cpu=meta.cu_seqlens_cpu)
    o = fn(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=meta.cu_seqlens, **table)[0]
    return o.view(B, S, *o.shape[2:])


def gated_delta_rule_cached(q, k, v, g, beta, valid: torch.Tensor, state: torch.Tensor,
                            impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The rule continuing each row's sequence from ``state`` [B, HV, K, V] (serving: a prefill chunk or a decode
    token per row); ``valid`` [B, S] marks the real tokens (rows are right-padded). Padding gets beta = 0 and
    g = 0, so it leaves the state as the row's last real token left it. One token per row runs the recurrence;
    longer rows the chunked rule (fla's kernel on CUDA). Returns (o [B, S, HV, V], final state fp32)."""
    g = torch.where(valid[..., None], g, 0.0)
    beta = torch.where(valid[..., None], beta, 0.0)
    impl = resolve_impl(impl, q.device)
    if q.shape[1] == 1 or impl == "torch":
        fn = recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_gated_delta_rule
        return fn(q, k, v, g, beta, initial_state=state, output_final_state=True)
    fn, grouped = _fla()
    if not grouped and v.shape[2] != q.shape[2]:
        q, k = (t.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for t in (q, k))
    o, final = fn(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o, final.float()
