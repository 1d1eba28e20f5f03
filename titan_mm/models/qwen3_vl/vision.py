"""Qwen3-VL vision tower: patch embedding, interpolated learned position embedding, 2-D rotary,
ViT blocks over packed images (one attention document per image / video frame), patch merger and
DeepStack mergers.

Everything that depends on the *values* of ``grid_thw`` (position-embedding gather indices and
bilinear weights, rotary (h, w) coordinates, attention document boundaries) is computed on the host by
:func:`build_vision_meta` before the forward, so the forward has no host-device syncs.

Legend: N = patches over all images/videos in the micro-batch, M = merged tokens (N / merge**2),
D = vision hidden size, H = heads, Dh = head dim, P = flattened patch size (C * T * ps * ps),
O = out hidden size (the LLM width).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import repeat
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from titan_mm.models.qwen3.model import Ops
from titan_mm.models.qwen3_vl.config import VisionConfig
from titan_mm.nn import init
from titan_mm.nn.attention import _varlen_fn, varlen_attention
from titan_mm.nn.rope import apply_rope


# --------------------------------------------------------------------------------------------------
# Metadata (host side, before forward)
# --------------------------------------------------------------------------------------------------
class VisionMeta(NamedTuple):
    """Per-micro-batch vision metadata, built on the host from ``grid_thw`` (see :func:`build_vision_meta`)."""

    pos_idx: torch.Tensor
    """[N, 4] int64: rows of the learned position table the bilinear interpolation reads."""
    pos_w: torch.Tensor
    """[N, 4] fp32: bilinear weights for ``pos_idx``."""
    rope_hw: torch.Tensor
    """[N, 2] int64: (row, col) patch coordinates for the 2-D rotary embedding."""
    backend: str
    """"sdpa" (dense block-diagonal mask), "flex" (BlockMask) or "varlen" (cu_seqlens kernel)."""
    mask: object
    """sdpa: [1, 1, N, N] bool (True = attend), or None when all segments have the same length (then
    attention runs batched per segment, no mask); flex: BlockMask; varlen: None."""
    cu_seqlens: torch.Tensor
    """[n_segments + 1] int32: attention segment boundaries (one per image, one per video frame)."""
    max_seqlen: int
    """Longest segment (a host int; varlen kernels need it)."""
    n_image_tokens: int = 0
    """Merged tokens that belong to images (the rest are videos'); images' patches come first."""
    n_pad: int = 0
    """Zero patches the tower appends after the real ones (``bucket`` of :func:`build_vision_meta`) and drops
    from its outputs; the fields above count them (their own attention segments, zero position taps)."""


def _merge_order_rows_cols(t: int, h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch in the processor's order: frames, then merge blocks, then in-block."""
    rows = repeat(torch.arange(h), "(hb mh) -> (t hb wb mh mw)", t=t, mh=merge, wb=w // merge, mw=merge)
    cols = repeat(torch.arange(w), "(wb mw) -> (t hb wb mh mw)", t=t, hb=h // merge, mh=merge, mw=merge)
    return rows, cols


def _bilinear_taps(coord: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps and weights along one axis: align_corners=True resampling of a ``side``-long table to
    ``size`` points (endpoints map onto endpoints), edge taps clamped."""
    src = coord.double() * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    frac = src - lo
    lo = lo.long()
    hi = (lo + 1).clamp(max=side - 1)
    return torch.stack([lo, hi], -1), torch.stack([1 - frac, frac], -1)


def build_vision_meta(
    grid_thw: torch.Tensor,
    cfg: VisionConfig,
    backend: str = "sdpa",
    device: torch.device | str | None = None,
    bucket: int = 0,
) -> VisionMeta:
    """Host-side metadata for one vision forward over the images/videos described by ``grid_thw``
    ([n, 3] (t, h, w) in patches, in the order their patches appear in ``pixel_values``).

    ``bucket`` > 0 (a multiple of spatial_merge_size**2): the tower runs on the patch count rounded up to a
    multiple of it, so micro-batches of other image sizes repeat the blocks' shapes (compiled graphs, kernel
    configs). The extra zero patches attend only among themselves, in segments no longer than the longest
    image's (the attention's longest row stays), and their merged tokens are dropped: the real patches' outputs
    and every gradient are the unpadded ones (the same arithmetic; sums over the patch axis add exact zeros)."""
    if grid_thw.device.type != "cpu":
        raise ValueError(
            "build_vision_meta wants grid_thw on the CPU (it reads its values); the data pipeline "
            "produces it there, so call this before moving the batch to the accelerator."
        )
    merge = cfg.spatial_merge_size
    side = int(math.isqrt(cfg.num_position_embeddings))
    if side * side != cfg.num_position_embeddings:
        raise ValueError(
            f"vision num_position_embeddings={cfg.num_position_embeddings} is not a square; Qwen3-VL's "
            "learned position table is a square grid, fix the vision config."
        )
    idx, wts, hw, seg = [], [], [], []
    for t, h, w in grid_thw.tolist():
        if h % merge or w % merge:
            raise ValueError(
                f"grid (t={t}, h={h}, w={w}) is not divisible by spatial_merge_size={merge}; resize "
                "images to a multiple of patch_size * spatial_merge_size (the Qwen-VL processor does)."
            )
        rows, cols = _merge_order_rows_cols(t, h, w, merge)
        rt, rw = _bilinear_taps(rows, h, side)
        ct, cw = _bilinear_taps(cols, w, side)
        idx.append((rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4))
        wts.append((rw[:, :, None] * cw[:, None, :]).reshape(-1, 4).float())
        hw.append(torch.stack([rows, cols], -1))
        seg += [h * w] * t
    if bucket and bucket % merge**2:
        raise ValueError(f"vision bucket={bucket} is not a multiple of spatial_merge_size**2={merge**2}: the padded "
                         "patches must merge into whole tokens; pick a multiple of it (or 0 for no bucket).")
    n_pad = -sum(seg) % bucket if bucket and seg else 0
    if n_pad:  # pad segments, each at most the longest real one
        longest = max(seg)
        seg += [longest] * (n_pad // longest) + ([n_pad % longest] if n_pad % longest else [])
        idx.append(torch.zeros(n_pad, 4, dtype=torch.int64))
        wts.append(torch.zeros(n_pad, 4))
        hw.append(torch.zeros(n_pad, 2, dtype=torch.int64))
    if not seg:  # no images (a rank the encoder balance gives none): zero-size metadata, the tower runs on nothing
        z = torch.zeros(0, 4, dtype=torch.int64)
        meta = VisionMeta(z, z.float(), z[:, :2], backend, None, torch.zeros(1, dtype=torch.int32), 0)
        return meta if device is None else move_vision_meta(meta, device)
    seg_t = torch.tensor(seg, dtype=torch.int32)
    cu = F.pad(seg_t.cumsum(0, dtype=torch.int32), (1, 0))
    n = int(cu[-1])
    max_seqlen = int(seg_t.max())
    mask = None
    if backend == "sdpa":
        if len(set(seg)) == 1:
            mask = None  # every segment has the same length: batched attention over [n_seg, H, L, Dh], no mask
        else:
            doc = torch.repeat_interleave(torch.arange(len(seg)), seg_t.long())
            mask = (doc[:, None] == doc[None, :])[None, None]
    elif backend == "flex":
        doc = torch.repeat_interleave(torch.arange(len(seg)), seg_t.long()).to(device or "cpu")

        def same_doc(b, h_, q, k):
            return doc[q] == doc[k]

        dev = torch.device(device or "cpu")
        mask = create_block_mask(same_doc, None, None, n, n, device=str(dev), _compile=dev.type == "cuda")
    elif backend == "varlen":
        _varlen_fn()  # resolve torch's varlen_attn here (clear error if missing), not inside the forward
    else:
        raise ValueError(f"unknown vision attention backend {backend!r}; use 'sdpa', 'flex' or 'varlen'.")
    meta = VisionMeta(
        pos_idx=torch.cat(idx),
        pos_w=torch.cat(wts),
        rope_hw=torch.cat(hw),
        backend=backend,
        mask=mask,
        cu_seqlens=cu,
        max_seqlen=max_seqlen,
        n_pad=n_pad,
    )
    return meta if device is None else move_vision_meta(meta, device)


def _on(have: torch.device, want: torch.device) -> bool:
    """``want`` without an index ("cuda") accepts any index of its type: the mask then stays where it is."""
    return have.type == want.type and want.index in (None, have.index)


def move_vision_meta(meta: VisionMeta, device: torch.device | str) -> VisionMeta:
    """The same metadata with its tensors on ``device`` (non-blocking host-to-device copies)."""
    def mv(x):
        return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x

    mask = meta.mask
    if isinstance(mask, torch.Tensor):
        mask = mv(mask)
    elif mask is not None and not _on(mask.kv_num_blocks.device, torch.device(device)):
        # a BlockMask's mask_mod closes over the document ids on the device it was built for
        raise ValueError(f"a flex vision mask built on {mask.kv_num_blocks.device} cannot move to {device}; build "
                         f"the metadata on its device: build_vision_meta(..., device={str(device)!r}).")
    return meta._replace(pos_idx=mv(meta.pos_idx), pos_w=mv(meta.pos_w), rope_hw=mv(meta.rope_hw),
                         cu_seqlens=mv(meta.cu_seqlens), mask=mask)


# --------------------------------------------------------------------------------------------------
# Pure ops
# --------------------------------------------------------------------------------------------------
def vision_rope(rope_hw: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, Dh] for the 2-D rotary: the first half of each rotated pair-half rotates by the row,
    the second by the column (frequencies over Dh/2), laid out for rotate-half application."""
    half = head_dim // 2  # each axis gets half of the rotated pairs: Dh/4 frequencies over a Dh/2 span
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=rope_hw.device) / half))
    freqs = rope_hw.float()[:, :, None] * inv_freq  # [N, 2, Dh/4]
    freqs = freqs.flatten(1)  # [N, Dh/2]: rows' freqs then cols' freqs
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def vision_attention_core(q_NHD, k_NHD, v_NHD, meta: VisionMeta) -> torch.Tensor:
    """Bidirectional attention inside each image / frame. Returns [N, H, Dh]."""
    if q_NHD.shape[0] == 0:  # no patches on this rank (encoder balance); a host-known shape, no sync
        return v_NHD
    mask = meta.mask
    if meta.backend == "varlen":
        if q_NHD.dtype in (torch.float16, torch.bfloat16):
            return varlen_attention(q_NHD, k_NHD, v_NHD, meta.cu_seqlens, meta.max_seqlen, causal=False)
        # float32 (a debug recipe on CUDA): varlen's flash kernels take half types only, so a dense
        # block-diagonal mask from cu_seqlens, built on the device (no host sync)
        doc = torch.searchsorted(meta.cu_seqlens[1:], torch.arange(q_NHD.shape[0], device=q_NHD.device), right=True)
        mask = (doc[:, None] == doc[None, :])[None, None]
    if meta.backend == "sdpa" and meta.mask is None:  # equal-length segments (e.g. same-size images)
        n, H, Dh = q_NHD.shape
        L = meta.max_seqlen
        q, k, v = (t.view(n // L, L, H, Dh).transpose(1, 2) for t in (q_NHD, k_NHD, v_NHD))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, H, Dh)
    q, k, v = (t.transpose(0, 1)[None] for t in (q_NHD, k_NHD, v_NHD))  # [1, H, N, Dh]
    if meta.backend == "flex":
        o = _flex_attention()(q, k, v, block_mask=meta.mask)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o[0].transpose(0, 1)


_FLEX = None


def _flex_attention():
    """flex_attention, compiled once on accelerators (eager flex materializes scores; fine on CPU)."""
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _FLEX


# --------------------------------------------------------------------------------------------------
# Modules (parameter containers; forward is a pure function of params and inputs)
# --------------------------------------------------------------------------------------------------
class VisionAttention(nn.Module):
    """``wqkv``: the fused q/k/v projection with its output features ordered head by head, [H, 3, Dh]
    (q, k, v of head 0, then of head 1, ...). HF's ``qkv`` orders them [3, H, Dh]; hf.py permutes the rows
    on load and export. Head-major rows make the fused projection split over tensor-parallel ranks by heads
    (a contiguous row block holds whole heads with their q, k and v), like separate q / k / v projections;
    the reshape below therefore takes the head count from the tensor (-1: the local heads).
    ``rope``: ``Ops.apply_rope``; with the tower's fp32 cos/sin the rotation runs in fp32 as the reference's
    does. The Triton kernel also keeps inductor, when it compiles the tower as one graph, from recomputing cos/sin
    inside every block (17% of the Qwen3-VL ViT's step on the H100): a kernel's inputs are computed once."""

    def __init__(self, cfg: VisionConfig, rope: Callable = apply_rope):
        super().__init__()
        self.rope = rope
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x_ND, cos, sin, meta: VisionMeta):
        q, k, v = self.wqkv(x_ND).unflatten(1, (-1, 3, self.head_dim)).unbind(2)  # n = 0 too
        q, k = self.rope(q, k, cos, sin)
        o = vision_attention_core(q, k, v, meta)
        return self.proj(o.flatten(1))


class VisionMLP(nn.Module):
    """linear_fc1 -> GELU -> linear_fc2. ``bias_gelu(x, b)`` (titan_mm.kernels.bias_gelu when the config's
    kernels include it; tanh GELU only): fc1 runs without its bias and one kernel adds the bias and applies
    the GELU. None (the reference): ``linear_fc1`` with its bias, then ``F.gelu``. Parameter names are the same
    either way."""

    def __init__(self, cfg: VisionConfig, bias_gelu: Callable | None = None):
        super().__init__()
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act={cfg.hidden_act!r} is not supported; Qwen3-VL uses gelu_pytorch_tanh.")
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.bias_gelu = bias_gelu if self.approximate == "tanh" else None
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x):
        fc1 = self.linear_fc1
        # the unfused path keeps fc1's own forward where it matters: a module swapped in for it (torchao's
        # Float8Linear) or a tensor-parallel fc1 (parallel.encoder_tp: DTensor weight, input / output hooks)
        if self.bias_gelu is not None and type(fc1) is nn.Linear and not isinstance(fc1.weight, DTensor):
            return self.linear_fc2(self.bias_gelu(F.linear(x, fc1.weight), fc1.bias))
        return self.linear_fc2(F.gelu(fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, ops: Ops):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg, ops.apply_rope)
        self.mlp = VisionMLP(cfg, ops.bias_gelu)

    def forward(self, x_ND, cos, sin, meta: VisionMeta):
        x_ND = x_ND + self.attn(self.norm1(x_ND), cos, sin, meta)
        return x_ND + self.mlp(self.norm2(x_ND))


class PatchMerger(nn.Module):
    """Groups each merge x merge block of patches (consecutive in the processor's order) into one LLM
    token: LayerNorm (before the shuffle for the main merger, after it for DeepStack), MLP with exact GELU."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size, bias=True)

    def forward(self, x_ND):
        if self.postshuffle_norm:
            x = self.norm(x_ND.reshape(-1, self.merged))
        else:
            x = self.norm(x_ND).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """pixel patches [N, P] + VisionMeta -> (merged tokens [M, O], DeepStack features list of [M, O]).
    ``ops``: the blocks' RoPE and fused bias + GELU (``qwen3.model.select_ops(cfg.kernels)``; the default: the
    PyTorch references)."""

    def __init__(self, cfg: VisionConfig, ops: Ops = Ops()):
        super().__init__()
        self.cfg = cfg
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"vision hidden_size={cfg.hidden_size} is not divisible by num_heads={cfg.num_heads}.")
        self.head_dim = cfg.hidden_size // cfg.num_heads
        for i in cfg.deepstack_visual_indexes:
            if not 0 <= i < cfg.depth:
                raise ValueError(f"deepstack_visual_indexes has {i}, outside the vision depth {cfg.depth}.")
        # The Conv3d with kernel == stride == (T, ps, ps) is a Linear over the flattened patch (C, T, ps, ps).
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg, ops) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes]
        )

    def forward(self, pixels_NP: torch.Tensor, meta: VisionMeta) -> tuple[torch.Tensor, list[torch.Tensor]]:
        w = self.patch_embed.weight
        if meta.n_pad:  # the bucket's zero patches (build_vision_meta), dropped from the outputs below
            pixels_NP = F.pad(pixels_NP, (0, 0, 0, meta.n_pad))
        x = self.patch_embed(pixels_NP.to(w.dtype))
        pos = (self.pos_embed(meta.pos_idx) * meta.pos_w[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = vision_rope(meta.rope_hw, self.head_dim, self.cfg.rope_theta)
        deepstack = []
        ds_index = {layer: j for j, layer in enumerate(self.cfg.deepstack_visual_indexes)}
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, meta)
            if i in ds_index:
                deepstack.append(self.deepstack_merger_list[ds_index[i]](x))
        if not meta.n_pad:
            return self.merger(x), deepstack
        m = (x.shape[0] - meta.n_pad) // self.cfg.spatial_merge_size**2  # the real merged tokens
        return self.merger(x)[:m], [d[:m] for d in deepstack]

    @torch.no_grad()
    def init_weights(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                init.trunc_normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                init.normal_(m.weight, std=std)
