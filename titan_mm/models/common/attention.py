"""Grouped-query attention with qk-norm over packed sequences, three backends.

Legend: B batch, S sequence, H query heads, G kv heads, K head_dim, D model dim, T = B*S flat tokens.

Backends (chosen by the config's ``attn_backend``; metadata built by :func:`build_attn_meta` OUTSIDE the
forward, so the forward never syncs with the host):
  * "sdpa"   torch SDPA. Unpacked batches (no ``doc_ids``) run causal with ``is_causal=True``; packed
             batches use a dense bool mask [B, 1, S, S] (same document AND causal [AND window]).
  * "flex"   flex_attention with a BlockMask from ``doc_ids`` (causal, optional sliding window). On CUDA the
             kernel is compiled (torch.compile of flex_attention). On CPU it runs eager for forward-only
             calls; torch has no flex backward on CPU, so when gradients are needed on CPU the same mask
             (materialized from the mask_mod at build time) runs through SDPA.
  * "varlen" torch.nn.attention.varlen.varlen_attn over the flattened tokens with ``cu_seqlens``
             (CUDA only, torch builds that ship it); otherwise a clear error.

Rows that are each one whole document (``cu_seqlens`` says so on the host) need no mask: every backend
then runs fused causal SDPA (cuDNN / flash; the train step sets the backend priority).

Sliding window (HF semantics): query q sees key k iff q - window < k <= q.
Padding tokens (doc_id -1) attend causally among themselves, so no row is fully masked (no NaN).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_mm.models.common import init
from titan_mm.models.common.norm import RMSNorm, rms_norm
from titan_mm.models.common.rope import apply_rope

BACKENDS = ("sdpa", "flex", "varlen")


@dataclass
class AttnMeta:
    """What a backend needs, built from the batch before the forward. Fields not used by a backend are None."""

    backend: str
    packed: bool
    """True when built from ``doc_ids`` (document masking); False: plain causal rows."""
    sliding_window: int | None = None
    sdpa_mask: torch.Tensor | None = None
    """[B, 1, S, S] bool, True = attend (sdpa, packed or windowed)."""
    sdpa_mask_swa: torch.Tensor | None = None
    block_mask: Any = None
    """flex BlockMask (full causal + documents)."""
    block_mask_swa: Any = None
    """flex BlockMask with the sliding window."""
    cu_seqlens: torch.Tensor | None = None
    """[n_docs + 1] int32 on device (varlen)."""
    max_seqlen: int = 0
    valid_BS: torch.Tensor | None = None
    """[B, S] bool, False on padding (doc_id -1); MoE aux loss ignores padding like HF's attention_mask."""
    cp: Any = None
    """Context-parallel attention set by titan_mm.parallel.cp.prepare_cp_batch (q/k/v are then local sequence
    shards); when set, attention() delegates to ``cp(q, k, v, window)``."""


def _mask_dense(doc_BS: torch.Tensor | None, B: int, S: int, window: int | None, device) -> torch.Tensor:
    q = torch.arange(S, device=device)
    m = q[:, None] >= q[None, :]
    if window is not None:
        m = m & (q[:, None] - q[None, :] < window)
    m = m[None].expand(B, S, S)
    if doc_BS is not None:
        m = m & (doc_BS[:, :, None] == doc_BS[:, None, :])
    return m[:, None]


def _block_mask(doc_BS: torch.Tensor | None, B: int, S: int, window: int | None, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        m = q_idx >= kv_idx
        if doc_BS is not None:
            m = m & (doc_BS[b, q_idx] == doc_BS[b, kv_idx])
        if window is not None:
            m = m & (q_idx - kv_idx < window)
        return m

    Bm = B if doc_BS is not None else None
    return create_block_mask(mask_mod, Bm, None, S, S, device=device, _compile=torch.device(device).type == "cuda")


def _whole_rows(cu: torch.Tensor | None, B: int, S: int) -> bool:
    """True when ``cu_seqlens`` (host tensor) says each of the B rows is a single document of S tokens."""
    if cu is None or cu.device.type != "cpu" or cu.numel() != B + 1:
        return False
    return bool(torch.equal(cu.to(torch.int64), torch.arange(0, (B + 1) * S, S, dtype=torch.int64)))


def build_attn_meta(
    batch: dict[str, torch.Tensor], backend: str, device: torch.device | str, sliding_window: int | None = None,
    dense_mask: bool = False,
) -> AttnMeta:
    """Turn a batch's ``doc_ids`` / ``cu_seqlens`` / ``max_seqlen`` into backend metadata (on ``device``).

    Call it before the forward (it may sync; the forward must not). ``sliding_window``: pass the model
    config's ``attn_sliding_window`` when any layer uses a window (Qwen3 configs with use_sliding_window).
    Batches without ``doc_ids`` are treated as unpacked causal rows. ``dense_mask``: also build the dense
    ``sdpa_mask`` (and ``sdpa_mask_swa``) for the flex backend on CUDA, where it is otherwise left out; ring
    and all-gather context parallelism slice their mask blocks from it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    device = torch.device(device)
    ids = batch["input_ids"]
    B, S = ids.shape[-2], ids.shape[-1]
    doc = batch.get("doc_ids")
    if doc is not None and sliding_window is None and _whole_rows(batch.get("cu_seqlens"), B, S):
        doc = None  # every row is one whole document: plain causal rows (fused SDPA kernels, no mask)
    doc = doc.to(device=device, non_blocking=True) if doc is not None else None
    meta = AttnMeta(backend=backend, packed=doc is not None, sliding_window=sliding_window)
    if doc is not None:
        meta.valid_BS = doc >= 0
    elif sliding_window is None:
        if backend == "varlen" and device.type == "cuda":
            _varlen_fn()  # resolve torch's varlen_attn here, not inside a (compiled) forward
        return meta  # plain causal rows: attention() runs fused causal SDPA for every backend
    if backend == "sdpa":
        if doc is not None or sliding_window is not None:
            meta.sdpa_mask = _mask_dense(doc, B, S, None, device)
        if sliding_window is not None:
            meta.sdpa_mask_swa = _mask_dense(doc, B, S, sliding_window, device)
    elif backend == "flex":
        meta.block_mask = _block_mask(doc, B, S, None, device)
        if sliding_window is not None:
            meta.block_mask_swa = _block_mask(doc, B, S, sliding_window, device)
        if device.type == "cpu" or dense_mask:  # CPU fallback (no flex backward on CPU), CP ring / allgather
            meta.sdpa_mask = _mask_dense(doc, B, S, None, device)
            if sliding_window is not None:
                meta.sdpa_mask_swa = _mask_dense(doc, B, S, sliding_window, device)
    else:  # varlen
        _varlen_fn()  # fail early with a clear message when unavailable
        if device.type != "cuda":
            raise RuntimeError(
                "attention backend 'varlen' needs a CUDA device (flash varlen kernels); "
                "use attn_backend='flex' or 'sdpa' on CPU"
            )
        cu = batch.get("cu_seqlens")
        if cu is None:
            if doc is None:
                cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
                max_len = S
            else:
                raise ValueError(
                    "attention backend 'varlen' needs batch['cu_seqlens'] (and 'max_seqlen') for packed batches; "
                    "the titan_mm packer provides them"
                )
        else:
            max_len = int(batch["max_seqlen"]) if "max_seqlen" in batch else S
        meta.cu_seqlens = cu.to(device=device, dtype=torch.int32, non_blocking=True)
        meta.max_seqlen = max_len
    return meta


from torch.nn.attention.flex_attention import flex_attention as _FLEX_EAGER  # noqa: E402

_FLEX_COMPILED = None  # torch.compile(flex_attention), made on the first eager CUDA call (importing dynamo
                       # at module import would cost every process ~3 s of start-up)


def _flex(q, k, v, block_mask):
    # Inside a compiled block dynamo fuses flex_attention itself; eager CUDA calls go through the compiled
    # wrapper (the eager flex materializes all scores); CPU runs eager.
    global _FLEX_COMPILED
    if torch.compiler.is_compiling() or not q.is_cuda:
        fn = _FLEX_EAGER
    else:
        if _FLEX_COMPILED is None:
            _FLEX_COMPILED = torch.compile(_FLEX_EAGER, dynamic=False)
        fn = _FLEX_COMPILED
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


_VARLEN: tuple | None = None  # (varlen_attn, its parameter names), resolved outside the forward


def _varlen_fn():
    """torch's varlen_attn and its parameter names (they differ across torch versions: ``is_causal`` in
    older builds, ``window_size=(-1, 0)`` for causal in newer ones; ``enable_gqa`` only in newer ones)."""
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as e:  # pragma: no cover - depends on the torch build
            raise RuntimeError(
                f"attention backend 'varlen' needs torch.nn.attention.varlen.varlen_attn, which this torch "
                f"({torch.__version__}) lacks; use attn_backend='flex' or 'sdpa'"
            ) from e
        _VARLEN = (varlen_attn, frozenset(inspect.signature(varlen_attn).parameters))
    return _VARLEN


def attention(
    q_BSHK: torch.Tensor, k_BSGK: torch.Tensor, v_BSGK: torch.Tensor, meta: AttnMeta | None, window: int | None
) -> torch.Tensor:
    """Scaled dot-product attention (scale 1/sqrt(K)) -> o_BSHK. ``meta=None``: plain causal via SDPA."""
    if meta is not None and meta.cp is not None:
        return meta.cp(q_BSHK, k_BSGK, v_BSGK, window)
    B, S, H, K = q_BSHK.shape
    G = k_BSGK.shape[2]
    if meta is not None and window is not None and meta.sliding_window != window:
        raise ValueError(
            f"this layer uses a sliding window of {window} but the attention metadata was built with "
            f"sliding_window={meta.sliding_window}; call build_attn_meta(..., sliding_window=cfg.attn_sliding_window)"
        )
    cpu_grad = q_BSHK.device.type == "cpu" and torch.is_grad_enabled() and (
        q_BSHK.requires_grad or k_BSGK.requires_grad or v_BSGK.requires_grad
    )
    plain = meta is None or (not meta.packed and window is None)  # causal rows: fused SDPA, no mask
    if plain or meta.backend == "sdpa" or (meta.backend == "flex" and cpu_grad):
        q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BSGK, v_BSGK))
        mask = None
        if meta is not None:
            mask = meta.sdpa_mask_swa if window is not None else meta.sdpa_mask
        elif window is not None:
            raise ValueError("a sliding-window layer needs attention metadata; call build_attn_meta(...) first")
        gqa = G != H
        if gqa and mask is not None:
            # fused SDPA kernels that take a mask (mem-efficient) lack GQA: share kv heads explicitly
            k, v = (t.repeat_interleave(H // G, dim=1) for t in (k, v))
            gqa = False
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return o.transpose(1, 2)
    if meta.backend == "flex":
        bm = meta.block_mask_swa if window is not None else meta.block_mask
        q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BSGK, v_BSGK))
        return _flex(q, k, v, bm).transpose(1, 2)
    # varlen over flattened tokens
    q, k, v = (t.reshape(B * S, t.shape[2], K) for t in (q_BSHK, k_BSGK, v_BSGK))
    o = varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=True, window=window)
    return o.reshape(B, S, H, K)


def varlen_attention(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool, window: int | None = None) -> torch.Tensor:
    """torch's varlen_attn over flattened tokens (documents given by ``cu_seqlens``), whatever the installed
    torch calls its arguments. GQA: kv heads are shared natively when torch can, else repeated."""
    fn, params = _varlen_fn()
    H, G = q_THK.shape[1], k_TGK.shape[1]
    kwargs: dict[str, Any] = {}
    if G != H:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k_TGK, v_TGK = (t.repeat_interleave(H // G, dim=1) for t in (k_TGK, v_TGK))
    if causal:
        if "is_causal" in params:
            kwargs["is_causal"] = True
            if window is not None:
                if "window_size" not in params:
                    raise RuntimeError("this torch's varlen_attn has no window_size; use attn_backend='flex'")
                kwargs["window_size"] = [window - 1, 0]
        else:
            kwargs["window_size"] = (window - 1 if window is not None else -1, 0)
    elif window is not None:
        raise ValueError("varlen_attention: a sliding window needs causal=True")
    # non-causal is the default of every signature (is_causal=False / window (-1, -1))
    return fn(q_THK, k_TGK, v_TGK, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


class Attention(nn.Module):
    """GQA with per-head RMSNorm on q and k (Qwen3), RoPE, and an output projection."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool, eps: float,
                 qk_norm: bool = True, norm_impl=rms_norm, rope_impl=apply_rope):
        super().__init__()
        self.rope_impl = rope_impl
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, norm_impl) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, norm_impl) if qk_norm else None

    def forward(self, x_BSD, cos_BSK, sin_BSK, meta: AttnMeta | None, window: int | None = None):
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rope_impl(q, k, cos_BSK, sin_BSK)
        o = attention(q, k, v, meta, window)
        return self.wo(o.reshape(B, S, -1))

    def reset_parameters(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            init.normal_(lin.weight, mean=0.0, std=std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.q_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()
