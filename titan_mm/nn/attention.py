"""Grouped-query attention with qk-norm over packed sequences: mask kinds x backends, and a KV-cache path.

Legend: B batch, S sequence, H query heads, G kv heads, K head_dim, D model dim, T = B*S flat tokens,
L cached keys per sequence.

Mask kinds (``AttnMeta.kind``, from ``build_attn_meta(..., kind=...)``). A query q sees a key k only within its
own document (``doc_ids``; rows without them are one document each), and then iff
  * "causal"         k <= q (the default; with a sliding window also q - window < k, HF semantics)
  * "bidirectional"  always (ViTs, diffusion LMs)
  * "block_causal"   block(k) <= block(q), block = (position within the document) // ``block_size``
                     (block diffusion; positions come from ``doc_ids`` in build_attn_meta, never in the forward)
  * "prefix_lm"      k <= q, or both are prefix tokens (``batch["prefix_mask"]`` [B, S] bool, True on the prefix)
  * "segments"       the batch's own per-token description (BAGEL): ``batch["seg_ids"]`` [B, S] int, a segment index
                     unique within its row, and ``batch["seg_kinds"]`` [B, S] int, a code of SEGMENT_KINDS:
                     "causal" (text), "full" (bidirectional within the segment), "noise" (noised latents that only
                     their own segment sees). k is visible iff (k is not a noise token of another segment) and
                     (k <= q, or k and q are in the same full / noise segment).
Every kind is built as such a description (:class:`Segments`, :func:`describe`) and one mask_mod reads it:
"causal" and "bidirectional" are one causal / full segment per document, "block_causal" a full segment per block,
"prefix_lm" a full segment on the prefix; the masks are those of the rules above, element by element.
Sliding windows combine only with "causal". Every kind lets a token see itself, so no row is fully masked; padding
(doc_id -1) forms one more document of its row (no NaN).

Backends (the config's ``attn_backend``; metadata built by :func:`build_attn_meta` OUTSIDE the forward, so the
forward never syncs with the host):

  kind            sdpa                 flex                    varlen (CUDA)
  causal          dense bool mask      BlockMask (mask_mod)    cu_seqlens, causal=True (+ window)
  bidirectional   dense bool mask      BlockMask (mask_mod)    cu_seqlens, causal=False
  block_causal    dense bool mask      BlockMask (mask_mod)    refused: use flex or sdpa
  prefix_lm       dense bool mask      BlockMask (mask_mod)    refused: use flex or sdpa
  segments        dense bool mask      BlockMask (mask_mod)    refused: use flex or sdpa

  * "sdpa"   torch SDPA with a dense bool mask [B, 1, S, S].
  * "flex"   flex_attention with a BlockMask from the same mask_mod that builds the dense mask. On CUDA the
             kernel is compiled (torch.compile of flex_attention). On CPU it runs eager for forward-only calls;
             torch has no flex backward on CPU, so when gradients are needed on CPU the dense mask (built from
             the mask_mod at build time) runs through SDPA.
  * "varlen" torch.nn.attention.varlen.varlen_attn over the flattened tokens with ``cu_seqlens`` (CUDA only,
             torch builds that ship it); its kernels take whole documents, so only causal or bidirectional
             (no block, prefix or BAGEL segment masks).

Rows that are each one whole document (``cu_seqlens`` says so on the host; or no ``doc_ids``) need no mask for
"causal" and "bidirectional": every backend then runs fused SDPA (is_causal=True / False; cuDNN / flash, the
train step sets the backend priority).

KV cache (``AttnMeta.kv_cache``, titan_mm.nn.kv_cache; None in training): every backend writes the
layer's new k/v (after qk-norm and RoPE) into the cache by the step's slot mapping and attends the new queries
to all cached keys of their sequence (causal by absolute position, optional window) with SDPA over the gathered
keys. Causal only. A packed step (one row of several sequences' new tokens) runs the varlen kernel over the
gathered keys on CUDA, the planned block-diagonal mask elsewhere; one-token steps read the pool in place (the
serving engine's paged decode kernel), and there an Attention given a ``decode_prologue`` (titan_mm.kernels'
norm_rope_cache) runs its q/k norms, RoPE and the cache write as that one op.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as _FLEX_EAGER

from titan_mm.nn import init
from titan_mm.nn.norm import RMSNorm, rms_norm
from titan_mm.nn.rope import apply_rope
from titan_mm.nn.kv_cache import KVCache

BACKENDS = ("sdpa", "flex", "varlen")
KINDS = ("causal", "bidirectional", "block_causal", "prefix_lm", "segments")
BACKEND_KINDS = {"sdpa": KINDS, "flex": KINDS, "varlen": ("causal", "bidirectional")}
"""The kinds each backend implements (varlen's kernels take whole documents: causal or not)."""
_ROW_KINDS = ("block_causal", "prefix_lm", "segments")  # need a mask even on rows that are one whole document
SEGMENT_KINDS = ("causal", "full", "noise")
"""Per-token segment kinds; a token's code in ``batch["seg_kinds"]`` is the index here."""
CAUSAL, FULL, NOISE = range(len(SEGMENT_KINDS))


@dataclass
class Segments:
    """A batch's attention as a per-token description ([B, S] tensors). Within one document (``doc``; None: one
    per row) key k is visible to query q iff (kind[k] is not NOISE or seg[k] == seg[q]) and (k <= q, or
    seg[k] == seg[q] and kind[q] is not CAUSAL)."""

    doc: torch.Tensor | None
    seg: torch.Tensor | None
    """Segment ids, equal exactly on the tokens of one segment of a row (None: each document is one segment)."""
    kind: torch.Tensor | int
    """SEGMENT_KINDS codes per token ([B, S]), or one code for every token (with ``seg``: FULL only)."""

    def to(self, device) -> "Segments":
        return Segments(*(t.to(device=device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                          for t in (self.doc, self.seg, self.kind)))


@dataclass
class AttnMeta:
    """What a backend needs, built from the batch before the forward. Fields not used by a backend are None."""

    backend: str
    packed: bool
    """True when built from ``doc_ids`` (document masking); False: one document per row."""
    kind: str = "causal"
    """Mask kind, one of KINDS (module docstring)."""
    block_size: int | None = None
    """Tokens per block of kind "block_causal"."""
    sliding_window: int | None = None
    sdpa_mask: torch.Tensor | None = None
    """[B, 1, S, S] bool, True = attend (sdpa; flex on CPU or with dense_mask)."""
    sdpa_mask_swa: torch.Tensor | None = None
    block_mask: Any = None
    """flex BlockMask (the kind + documents)."""
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
    kv_cache: KVCache | None = None
    """A planned KVCache (titan_mm.nn.kv_cache.plan_step) when decoding; None in training. Each
    Attention writes its layer's new k/v into it and attends to all cached keys of the sequence."""


def _mask_mod(d: Segments, window: int | None):
    """The description's mask as a flex mask_mod; on broadcast index grids it also builds the dense mask."""
    doc, seg, kind = d.doc, d.seg, d.kind

    def mask_mod(b, h, q, k):
        if seg is not None and isinstance(kind, int):  # full segments only (block_causal's blocks)
            m = (q >= k) | (seg[b, q] == seg[b, k])
        elif seg is not None:
            same = seg[b, q] == seg[b, k]
            m = ((q >= k) | (same & (kind[b, q] != CAUSAL))) & (same | (kind[b, k] != NOISE))
        elif kind == CAUSAL:
            m = q >= k
        else:  # one full segment: every key (of the document, below)
            m = (q >= 0) & (k >= 0)
        if window is not None:
            m = m & (q - k < window)
        if doc is not None:
            m = m & (doc[b, q] == doc[b, k])
        return m

    return mask_mod


def _mask_dense(mask_mod, B: int, S: int, device) -> torch.Tensor:
    i = torch.arange(S, device=device)
    m = mask_mod(torch.arange(B, device=device)[:, None, None], None, i[None, :, None], i[None, None, :])
    return m.expand(B, S, S)[:, None]


def _block_mask(mask_mod, B: int | None, S: int, device):
    return create_block_mask(mask_mod, B, None, S, S, device=device, _compile=torch.device(device).type == "cuda")


def doc_positions(doc_BS: torch.Tensor | None, B: int, S: int) -> torch.Tensor:
    """[B, S] position of every token within its document (a run of equal ``doc_ids``), where doc_ids live."""
    i = torch.arange(S, device=None if doc_BS is None else doc_BS.device).expand(B, S)
    if doc_BS is None:
        return i
    start = torch.ones_like(doc_BS, dtype=torch.bool)
    start[:, 1:] = doc_BS[:, 1:] != doc_BS[:, :-1]
    return i - torch.where(start, i, 0).cummax(1).values  # minus the start of the token's run


def _prefix_mask(batch: dict[str, torch.Tensor], B: int, S: int) -> torch.Tensor:
    p = batch.get("prefix_mask")
    if p is None:
        raise ValueError("attention kind 'prefix_lm' needs batch['prefix_mask'] ([B, S] bool, True on each "
                         "document's prefix tokens); add it in the data pipeline")
    if tuple(p.shape) != (B, S):
        raise ValueError(f"batch['prefix_mask'] has shape {list(p.shape)}; kind 'prefix_lm' needs [B, S] = "
                         f"[{B}, {S}], one bool per token of input_ids")
    return p.bool()


def describe(batch: dict[str, torch.Tensor], kind: str, block_size: int | None, doc: torch.Tensor | None,
             B: int, S: int) -> Segments:
    """Mask ``kind`` of ``batch`` (checked by :func:`check_kind`) as a segment description over documents ``doc``."""
    if kind in ("causal", "bidirectional"):
        return Segments(doc, None, CAUSAL if kind == "causal" else FULL)
    if kind == "block_causal":  # each block a full segment; blocks follow each other causally
        return Segments(doc, doc_positions(doc, B, S) // block_size, FULL)
    if kind == "prefix_lm":  # the prefix a full segment, the rest causal
        p = _prefix_mask(batch, B, S)
        return Segments(doc, p.to(torch.int8), torch.where(p, FULL, CAUSAL).to(torch.int8))
    return Segments(doc, *_segment_keys(batch, B, S))


def _segment_keys(batch: dict[str, torch.Tensor], B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    seg, kinds = batch.get("seg_ids"), batch.get("seg_kinds")
    if seg is None or kinds is None:
        raise ValueError("attention kind 'segments' needs batch['seg_ids'] and batch['seg_kinds'] ([B, S] ints: "
                         f"segment index within the row, a code of {SEGMENT_KINDS}); give each Doc its segments "
                         "(titan_mm.data.packing) or add them in the family's prepare_batch")
    for name, t in (("seg_ids", seg), ("seg_kinds", kinds)):
        if tuple(t.shape) != (B, S):
            raise ValueError(f"batch[{name!r}] has shape {list(t.shape)}; kind 'segments' needs [B, S] = [{B}, {S}]")
    if kinds.numel() and (int(kinds.min()) < 0 or int(kinds.max()) >= len(SEGMENT_KINDS)):
        raise ValueError(f"batch['seg_kinds'] holds codes outside 0 .. {len(SEGMENT_KINDS) - 1} "
                         f"({SEGMENT_KINDS}); write SEGMENT_KINDS.index(kind) per token")
    return seg, kinds


def batch_rows(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(B, S) of a batch, from the first of its [B, S] attention keys (a batch need not hold tokens)."""
    for key in ("input_ids", "doc_ids", "seg_ids"):
        if key in batch:
            return batch[key].shape[-2], batch[key].shape[-1]
    raise ValueError(f"the batch (keys {sorted(batch)}) has none of input_ids, doc_ids, seg_ids to size the "
                     "attention mask; the packer writes doc_ids for every batch")


def check_kind(backend: str, kind: str, sliding_window: int | None = None, block_size: int | None = None) -> None:
    """Raise a ValueError saying what to use instead when ``backend`` cannot run mask ``kind`` as asked."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {KINDS}")
    if kind not in BACKEND_KINDS[backend]:
        able = " or ".join(repr(b) for b in BACKENDS if kind in BACKEND_KINDS[b])
        raise ValueError(f"attention backend {backend!r} cannot do kind {kind!r} (it does {BACKEND_KINDS[backend]}); "
                         f"use attn_backend={able}")
    if sliding_window is not None and kind != "causal":
        raise ValueError(f"a sliding window ({sliding_window}) combines only with kind 'causal', not {kind!r}; "
                         "turn the window off (use_sliding_window=false) or use kind='causal'")
    if kind == "block_causal":
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"kind 'block_causal' needs block_size, a positive int of tokens per block; "
                             f"got {block_size!r}")
    elif block_size is not None:
        raise ValueError(f"block_size={block_size} applies only to kind 'block_causal', not {kind!r}; leave it None")


def _whole_rows(cu: torch.Tensor | None, B: int, S: int) -> bool:
    """True when ``cu_seqlens`` (host tensor) says each of the B rows is a single document of S tokens."""
    if cu is None or cu.device.type != "cpu" or cu.numel() != B + 1:
        return False
    return bool(torch.equal(cu.to(torch.int64), torch.arange(0, (B + 1) * S, S, dtype=torch.int64)))


def build_attn_meta(
    batch: dict[str, torch.Tensor], backend: str, device: torch.device | str, sliding_window: int | None = None,
    dense_mask: bool = False, kind: str = "causal", block_size: int | None = None, kv_cache: KVCache | None = None,
) -> AttnMeta:
    """Turn a batch's ``doc_ids`` / ``cu_seqlens`` / ``max_seqlen`` (and ``prefix_mask`` for kind "prefix_lm",
    ``seg_ids`` / ``seg_kinds`` for kind "segments") into backend metadata for mask ``kind`` (on ``device``).

    Call it before the forward (it may sync; the forward must not). ``sliding_window``: pass the model
    config's ``attn_sliding_window`` when any layer uses a window (Qwen3 configs with use_sliding_window).
    Batches without ``doc_ids`` are one document per row. ``dense_mask``: also build the dense ``sdpa_mask``
    (and ``sdpa_mask_swa``) where it is otherwise left out (flex on CUDA, bidirectional whole rows); ring and
    all-gather context parallelism slice their mask blocks from it. ``block_size``: tokens per block of kind
    "block_causal". ``kv_cache``: a KVCache planned for this step (kv_cache.plan_step); the metadata then
    only carries it (causal kind only).
    """
    check_kind(backend, kind, sliding_window, block_size)
    device = torch.device(device)
    B, S = batch_rows(batch)
    if kv_cache is not None:
        return _cache_meta(kv_cache, backend, kind, sliding_window, B, S)
    doc = batch.get("doc_ids")
    if doc is not None and sliding_window is None and _whole_rows(batch.get("cu_seqlens"), B, S):
        doc = None  # every row is one whole document: no document mask (fused SDPA kernels for causal)
    segs = describe(batch, kind, block_size, doc, B, S).to(device)
    doc = segs.doc
    meta = AttnMeta(backend=backend, packed=doc is not None, kind=kind, block_size=block_size,
                    sliding_window=sliding_window)
    if doc is not None:
        meta.valid_BS = doc >= 0
    mask_mod = _mask_mod(segs, None)
    if doc is None and sliding_window is None and kind not in _ROW_KINDS:
        if backend == "varlen" and device.type == "cuda":
            _varlen_fn()  # resolve torch's varlen_attn here, not inside a (compiled) forward
        if dense_mask and kind != "causal":  # CP slices it (its own fallback for causal rows is the causal mask)
            meta.sdpa_mask = _mask_dense(mask_mod, B, S, device)
        return meta  # one document per row: attention() runs fused SDPA for every backend
    swa_mod = _mask_mod(segs, sliding_window) if sliding_window is not None else None
    if backend == "sdpa" or (backend == "flex" and (device.type == "cpu" or dense_mask)):
        # flex on CPU: the fallback when gradients are needed (no flex backward on CPU); CP ring / allgather
        meta.sdpa_mask = _mask_dense(mask_mod, B, S, device)
        if swa_mod is not None:
            meta.sdpa_mask_swa = _mask_dense(swa_mod, B, S, device)
    if backend == "flex":
        Bm = B if doc is not None or segs.seg is not None else None  # None: the same mask on every row
        meta.block_mask = _block_mask(mask_mod, Bm, S, device)
        if swa_mod is not None:
            meta.block_mask_swa = _block_mask(swa_mod, Bm, S, device)
    elif backend == "varlen":
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


def _cache_meta(cache: KVCache, backend: str, kind: str, sliding_window: int | None, B: int, S: int) -> AttnMeta:
    """Metadata of a decoding step: the planned cache; its masks were built on the host by plan_step."""
    if kind != "causal":
        raise ValueError(f"the KV-cache path attends causally; kind {kind!r} with a kv_cache is not supported, "
                         "use kind='causal'")
    step = cache.step
    if step is None:
        raise ValueError("kv_cache has no planned step; call titan_mm.nn.kv_cache.plan_step(cache, "
                         "new_lens) before build_attn_meta")
    if tuple(step.positions.shape) != (B, S):
        raise ValueError(f"the batch has [B, S] = [{B}, {S}] tokens but the cache step was planned for "
                         f"{list(step.positions.shape)}; plan_step with this batch's new token counts")
    if step.sliding_window != sliding_window:
        raise ValueError(f"build_attn_meta got sliding_window={sliding_window} but the cache step was planned "
                         f"with {step.sliding_window}; pass the same cfg.attn_sliding_window to plan_step")
    return AttnMeta(backend=backend, packed=False, sliding_window=sliding_window, valid_BS=step.valid,
                    kv_cache=cache)


_FLEX_COMPILED = None  # torch.compile(flex_attention), made on the first eager CUDA call (importing dynamo
                       # at module import would cost every process ~3 s of start-up)


_FLEX_MIN_HEAD_DIM = 16  # inductor's flex kernel refuses smaller head dims ("NYI", torch 2.11)
# inductor's flex kernel finds no config for grouped heads (GQA) when a length is below its 128-token block (torch
# 2.11, H100: NoValidChoicesError at 96 and 112 tokens, head dims 64 and 128; 128 and 192 run): such short calls
# take 64-token blocks (H100, 16 x 96 tokens, 16 / 8 heads: forward 0.17 ms, where k / v repeated to the query
# heads took 0.70 ms)
_FLEX_GQA_MIN_LEN = 128
_FLEX_SHORT_GQA_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64}


def _flex(q, k, v, block_mask, scale: float | None = None):
    # Inside a compiled block dynamo fuses flex_attention itself; eager CUDA calls go through the compiled
    # wrapper (the eager flex materializes all scores); CPU runs eager.
    global _FLEX_COMPILED
    K = q.shape[-1]
    if q.is_cuda and K < _FLEX_MIN_HEAD_DIM:  # tiny debug models: zero channels add nothing to q.k, and v's are cut
        q, k, v = (F.pad(t, (0, _FLEX_MIN_HEAD_DIM - K)) for t in (q, k, v))
        return _flex(q, k, v, block_mask, scale=1.0 / math.sqrt(K))[..., :K]
    H, G = q.shape[1], k.shape[1]
    short_gqa = q.is_cuda and H != G and min(q.shape[2], k.shape[2]) < _FLEX_GQA_MIN_LEN
    options = _FLEX_SHORT_GQA_BLOCKS if short_gqa else None
    if torch.compiler.is_compiling() or not q.is_cuda:
        fn = _FLEX_EAGER
    else:
        if _FLEX_COMPILED is None:
            # one graph per shape (heads, lengths, dtype, mask): a multimodal model's towers and varying image
            # sizes pass dynamo's default 8 recompiles of flex_attention, past which it falls back to the eager
            # flex (all scores materialized, host syncs); the H100 vl tests hit it
            dynamo_config = torch._dynamo.config
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
            _FLEX_COMPILED = torch.compile(_FLEX_EAGER, dynamic=False)
        fn = _FLEX_COMPILED
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=H != G, kernel_options=options)


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
    q_BSHK: torch.Tensor, k_BSGK: torch.Tensor, v_BSGK: torch.Tensor, meta: AttnMeta | None, window: int | None,
    layer_id: int = 0, written: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention (scale 1/sqrt(K)) -> o_BSHK. ``meta=None``: plain causal via SDPA.
    ``layer_id``: the layer of ``meta.kv_cache`` that this call writes and reads. ``written``: on an in-place
    decode step (:func:`fused_decode_step`), k and v are in the cache already (the fused prologue wrote them)."""
    if meta is not None and meta.cp is not None:
        return meta.cp(q_BSHK, k_BSGK, v_BSGK, window)
    B, S, H, K = q_BSHK.shape
    if meta is not None and window is not None and meta.sliding_window != window:
        raise ValueError(
            f"this layer uses a sliding window of {window} but the attention metadata was built with "
            f"sliding_window={meta.sliding_window}; call build_attn_meta(..., sliding_window=cfg.attn_sliding_window)"
        )
    if meta is not None and meta.kv_cache is not None:
        cache = meta.kv_cache
        st = cache.step
        if st.decode_attention is not None:  # one token per sequence, paged: the keys are read in place
            if not written:
                cache.write(layer_id, k_BSGK, v_BSGK)
            o = st.decode_attention(q_BSHK[:, 0], cache.k[layer_id], cache.v[layer_id], st.block_tables, st.seq_lens,
                                    window)
            return o[:, None]
        if st.paged_attention is not None:  # one packed row [1, T] of rows of any length, read in place
            cache.write(layer_id, k_BSGK, v_BSGK)
            o = st.paged_attention(q_BSHK[0], cache.k[layer_id], cache.v[layer_id], st.block_tables, st.seq_lens,
                                   st.cu_seqlens_q, window)
            return o[None]
        k_all, v_all = cache.update(layer_id, k_BSGK, v_BSGK)  # [B, L, G, K]: every cached key of the sequence
        if st.varlen:  # one packed row [1, N]: each sequence's new queries end its keys (bottom-right causal)
            o = varlen_attention(q_BSHK[0], k_all[0], v_all[0], st.cu_seqlens_q, st.max_seqlen_q, True, window,
                                 cu_seqlens_k=st.cu_seqlens_k, max_seqlen_k=st.max_seqlen_k)
            return o[None]
        return _sdpa(q_BSHK, k_all, v_all, cache.step.mask_swa if window is not None else cache.step.mask, False)
    if meta is None and window is not None:
        raise ValueError("a sliding-window layer needs attention metadata; call build_attn_meta(...) first")
    cpu_grad = q_BSHK.device.type == "cpu" and torch.is_grad_enabled() and (
        q_BSHK.requires_grad or k_BSGK.requires_grad or v_BSGK.requires_grad
    )
    causal = meta is None or meta.kind == "causal"
    plain = meta is None or not (meta.packed or window is not None or meta.kind in _ROW_KINDS)  # one doc per row
    if plain or meta.backend == "sdpa" or (meta.backend == "flex" and cpu_grad):
        mask = None if meta is None else meta.sdpa_mask_swa if window is not None else meta.sdpa_mask
        return _sdpa(q_BSHK, k_BSGK, v_BSGK, mask, causal)
    if meta.backend == "flex":
        bm = meta.block_mask_swa if window is not None else meta.block_mask
        q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BSGK, v_BSGK))
        return _flex(q, k, v, bm).transpose(1, 2)
    # varlen over flattened tokens
    q, k, v = (t.reshape(B * S, t.shape[2], K) for t in (q_BSHK, k_BSGK, v_BSGK))
    o = varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=causal, window=window)
    return o.reshape(B, S, H, K)


def fused_decode_step(meta: AttnMeta | None, B: int, S: int) -> bool:
    """True on an in-place paged decode step (the serving engine's) whose B rows each write one new token: the step
    a fused prologue (q/k norm, RoPE, cache write in one op) may run. Shapes only: no host sync."""
    if meta is None or meta.cp is not None or meta.kv_cache is None:
        return False
    st = meta.kv_cache.step
    return st.decode_attention is not None and S == 1 and st.slot_mapping.shape[0] == B


def _sdpa(q_BSHK, k_BLGK, v_BLGK, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """torch SDPA with a bool mask [B, 1, S, L] (True = attend), or without one: causal or not."""
    q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BLGK, v_BLGK))
    H, G = q.shape[1], k.shape[1]
    gqa = G != H
    if gqa and mask is not None:
        # fused SDPA kernels that take a mask (mem-efficient) lack GQA: share kv heads explicitly
        k, v = (t.repeat_interleave(H // G, dim=1) for t in (k, v))
        gqa = False
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=gqa)
    return o.transpose(1, 2)


def varlen_attention(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool, window: int | None = None, cu_seqlens_k: torch.Tensor | None = None,
                     max_seqlen_k: int = 0) -> torch.Tensor:
    """torch's varlen_attn over flattened tokens (documents given by ``cu_seqlens``), whatever the installed
    torch calls its arguments. GQA: kv heads are shared natively when torch can, else repeated. ``cu_seqlens_k``:
    the keys' own document starts when they differ from the queries' (a cached prefix: causal is then aligned
    to each document's last key)."""
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
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    return fn(q_THK, k_TGK, v_TGK, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **kwargs)


class Attention(nn.Module):
    """GQA with per-head RMSNorm on q and k (Qwen3), RoPE, and an output projection."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool, eps: float,
                 qk_norm: bool = True, norm_impl=rms_norm, rope_impl=apply_rope, o_bias: bool | None = None,
                 layer_id: int = 0, decode_prologue=None):
        super().__init__()
        self.rope_impl = rope_impl
        # on an in-place decode step: (q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots) -> q, the norms, RoPE
        # and the cache write in one op (titan_mm.kernels.norm_rope_cache); None: those ops one by one
        self.decode_prologue = decode_prologue
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias if o_bias is None else o_bias)  # Qwen2: q/k/v only
        # serving's layout (titan_mm/serve/runner/weights.py): q, k, v in one [q+k+v, D] projection, split by sizes
        self.wqkv: nn.Linear | None = None
        self.qkv_sizes: tuple[int, int, int] = (0, 0, 0)
        self.layer_id = layer_id  # which layer of a KV cache this module reads and writes
        self.q_norm = RMSNorm(head_dim, eps, norm_impl) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, norm_impl) if qk_norm else None

    def forward(self, x_BSD, cos_BSK, sin_BSK, meta: AttnMeta | None, window: int | None = None):
        B, S, _ = x_BSD.shape
        if self.wqkv is not None:  # one GEMM; q, k, v are column views of its output
            q, k, v = self.wqkv(x_BSD).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        q, k, v = (t.view(B, S, -1, self.head_dim) for t in (q, k, v))
        if self.decode_prologue is not None and fused_decode_step(meta, B, S):
            cache, norm = meta.kv_cache, self.q_norm is not None
            q = self.decode_prologue(q[:, 0], k[:, 0], v[:, 0], self.q_norm.weight if norm else None,
                                     self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0,
                                     cos_BSK[..., 0, :], sin_BSK[..., 0, :], cache.k[self.layer_id],
                                     cache.v[self.layer_id], cache.step.slot_mapping)[:, None]
            o = attention(q, k, v, meta, window, self.layer_id, written=True)
        else:
            if self.q_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q, k = self.rope_impl(q, k, cos_BSK, sin_BSK)
            o = attention(q, k, v, meta, window, self.layer_id)
        return self.wo(o.reshape(B, S, -1))

    def reset_parameters(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            init.normal_(lin.weight, mean=0.0, std=std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.q_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()
