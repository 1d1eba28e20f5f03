"""Qwen2.5-VL vision tower: bias-free patch embedding, 2-D rotary, RMSNorm + SwiGLU ViT blocks with window
attention (full attention per image / frame in ``fullatt_block_indexes``), and an RMSNorm + MLP 2x2 merger.

What Qwen3-VL's tower (titan_mm/models/qwen3_vl/vision.py) already has is imported: the fused head-major
q/k/v attention (``VisionAttention``), the 2-D rotary, the sdpa / flex / varlen core and its host-built
metadata (``build_vision_meta``). Window attention reorders the patches, in merge units, so that every window
is contiguous: the host builds that order and its inverse (:func:`build_window_meta`); the forward gathers
with them, and the merged tokens come out in the processor's order. No host syncs in the forward.

Legend: N patches, M = N / merge**2 merged tokens, D vision width, P flattened patch (C * T * ps * ps),
O out width (the LLM's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_mm.nn import init
from titan_mm.nn.mlp import silu_mul
from titan_mm.nn.norm import RMSNorm
from titan_mm.models.qwen2_5_vl.config import VisionConfig
from titan_mm.models.qwen3_vl.config import VisionConfig as Qwen3VisionConfig
from titan_mm.models.qwen3_vl.vision import (VisionAttention, VisionMeta, build_vision_meta, move_vision_meta,
                                             vision_rope)


class WindowMeta(NamedTuple):
    """Host-built metadata of one vision forward (see :func:`build_window_meta`)."""

    order: torch.Tensor
    """[N] int64: the patch (processor order) at each position of the window order."""
    inverse: torch.Tensor
    """[M] int64: for each merged token in processor order, its row in the window order."""
    rope_hw: torch.Tensor
    """[N, 2] int64 (row, col) of each patch, in the window order."""
    full: VisionMeta
    """Attention within each image / video frame (the window order keeps frames contiguous)."""
    window: VisionMeta
    """Attention within each window."""
    n_image_tokens: int = 0
    """Merged tokens that belong to images (images' patches come first)."""


def segments_config(merge: int) -> Qwen3VisionConfig:
    # build_vision_meta also fills Qwen3-VL's learned-position taps; a 1-entry table keeps that part trivial
    return Qwen3VisionConfig(spatial_merge_size=merge, num_position_embeddings=1, deepstack_visual_indexes=())


def window_order(grid_thw: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """Host side: the merge-unit order that makes every window contiguous, and the windows' lengths in
    patches. Per frame, the grid of merged tokens is cut into window_merged x window_merged windows (the last
    row / column of windows may be smaller), taken row-major; inside a window, tokens stay row-major."""
    m, ws = cfg.spatial_merge_size, cfg.window_merged
    order, lens, base = [], [], 0
    for t, h, w in grid_thw.tolist():
        lh, lw = h // m, w // m
        idx = torch.arange(t * lh * lw).view(t, lh, lw)
        for f in range(t):
            for r in range(0, lh, ws):
                for c in range(0, lw, ws):
                    win = idx[f, r:r + ws, c:c + ws].reshape(-1)
                    order.append(win + base)
                    lens.append(win.numel() * m * m)
        base += t * lh * lw
    return torch.cat(order), lens


def build_window_meta(grid_thw: torch.Tensor, cfg: VisionConfig, backend: str = "sdpa",
                      device: torch.device | str | None = None, bucket: int = 0) -> WindowMeta:
    """Host-side metadata for one vision forward over the images / videos of ``grid_thw`` ([n, 3] (t, h, w) in
    patches, in the order of their patches in the pixel values). Raises when a grid is not a multiple of the
    merge size (as build_vision_meta does). ``bucket``: the patch count rounded up to a multiple of it, as
    build_vision_meta's (the zero patches go last in the window order too, and ``inverse`` never reads their
    merged tokens)."""
    m2 = cfg.spatial_merge_size**2
    # the inner metas are built on ``device``: a flex mask cannot move after it is built (see move_vision_meta)
    full = build_vision_meta(grid_thw, segments_config(cfg.spatial_merge_size), backend, device, bucket)  # checks grids
    units, lens = window_order(grid_thw, cfg)
    order = (units[:, None] * m2 + torch.arange(m2)).reshape(-1)
    order = torch.cat([order, torch.arange(len(order), len(order) + full.n_pad)])  # the bucket's pads stay last
    seg = torch.tensor([[1, 1, n] for n in lens])
    window = build_vision_meta(seg, segments_config(1), backend, device, bucket)
    empty = torch.zeros(0, 4, dtype=torch.int64)
    strip = dict(pos_idx=empty, pos_w=empty.float(), rope_hw=empty[:, :2])  # Qwen2.5-VL has no position table
    meta = WindowMeta(order=order, inverse=torch.argsort(units), rope_hw=full.rope_hw[order.to(full.rope_hw.device)],
                      full=full._replace(**strip), window=window._replace(**strip))
    return meta if device is None else move_window_meta(meta, device)


def move_window_meta(meta: WindowMeta, device: torch.device | str) -> WindowMeta:
    return meta._replace(order=meta.order.to(device, non_blocking=True),
                         inverse=meta.inverse.to(device, non_blocking=True),
                         rope_hw=meta.rope_hw.to(device, non_blocking=True),
                         full=move_vision_meta(meta.full, device), window=move_vision_meta(meta.window, device))


ALIGN = 64
"""The MLP's width is padded to a multiple of this inside the forward: Qwen2.5-VL's 3,420 is not 16-byte aligned in
bf16, and cuBLAS runs such GEMMs at well under half speed (bench/towers.py --floor on the H100: the 7B ViT's GEMMs
alone 149 ms at its widths, 58 ms with every width rounded up to 64; its other widths are aligned already). The
compiled tower with the pad: 148.0 -> 115.2 ms a step (H100, docs/efficiency.md)."""


class VisionSwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), every projection with a bias (HF names kept, as Qwen3-VL's ViT does). The
    weights keep HF's shapes; the forward pads the width with zero rows / columns (their outputs are silu(0) * 0 = 0,
    their gradients 0), unless the weights are tensor-parallel shards. The padded copies live until the backward
    (26 MB a block at the 7B's widths)."""

    def __init__(self, cfg: VisionConfig, act_mul=silu_mul):
        super().__init__()
        self.act_mul = act_mul
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.pad = -cfg.intermediate_size % ALIGN

    def forward(self, x):
        if not self.pad or isinstance(self.gate_proj.weight, DTensor):
            return self.down_proj(self.act_mul(self.gate_proj(x), self.up_proj(x)))
        p = self.pad
        gate, up = (F.linear(x, F.pad(lin.weight, (0, 0, 0, p)), F.pad(lin.bias, (0, p)))
                    for lin in (self.gate_proj, self.up_proj))
        return F.linear(self.act_mul(gate, up), F.pad(self.down_proj.weight, (0, p)), self.down_proj.bias)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, full_attention: bool, ops):
        super().__init__()
        self.full_attention = full_attention
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.attn = VisionAttention(cfg, ops.apply_rope)  # reads hidden_size / num_heads only
        self.mlp = VisionSwiGLU(cfg, ops.act_mul)

    def forward(self, x_ND, cos, sin, meta: WindowMeta):
        x_ND = x_ND + self.attn(self.norm1(x_ND), cos, sin, meta.full if self.full_attention else meta.window)
        return x_ND + self.mlp(self.norm2(x_ND))


class PatchMerger(nn.Module):
    """RMSNorm per patch, then each merge x merge block (consecutive rows) -> MLP (Linear, exact GELU, Linear).
    HF names: ``ln_q``, ``mlp.0``, ``mlp.2``."""

    def __init__(self, cfg: VisionConfig, ops):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, cfg.out_hidden_size))

    def forward(self, x_ND):
        return self.mlp(self.ln_q(x_ND).reshape(-1, self.merged))


class VisionTower(nn.Module):
    """pixel patches [N, P] + WindowMeta -> (merged tokens [M, O] in the processor's order, [] : no DeepStack)."""

    def __init__(self, cfg: VisionConfig, ops):
        super().__init__()
        self.cfg = cfg
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"vision hidden_size={cfg.hidden_size} is not divisible by num_heads={cfg.num_heads}.")
        self.head_dim = cfg.hidden_size // cfg.num_heads
        # Conv3d with kernel == stride and no bias == a bias-free Linear over the flattened patch
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        full = set(cfg.fullatt_block_indexes)
        self.blocks = nn.ModuleList([VisionBlock(cfg, i in full, ops) for i in range(cfg.depth)])
        self.merger = PatchMerger(cfg, ops)

    def forward(self, pixels_NP: torch.Tensor, meta: WindowMeta) -> tuple[torch.Tensor, list[torch.Tensor]]:
        w = self.patch_embed.weight
        if meta.full.n_pad:  # the bucket's zero patches (build_window_meta); ``inverse`` drops their tokens
            pixels_NP = F.pad(pixels_NP, (0, 0, 0, meta.full.n_pad))
        x = F.linear(pixels_NP.index_select(0, meta.order).to(w.dtype), w)  # window order
        cos, sin = vision_rope(meta.rope_hw, self.head_dim, self.cfg.rope_theta)
        for blk in self.blocks:
            x = blk(x, cos, sin, meta)
        return self.merger(x).index_select(0, meta.inverse), []

    @torch.no_grad()
    def init_weights(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                init.trunc_normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
