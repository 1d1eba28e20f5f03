"""Bucketed patch counts in the Qwen3-VL ViT (``build_vision_meta(..., bucket=B)``: the tower runs on the patch
count rounded up to a multiple of B, zero patches in attention segments of their own, their merged tokens dropped)
give the unpadded tower's outputs, DeepStack features and every gradient (fp32, CPU).

Tolerance, from the arithmetic: each real value is the same math as unpadded; only reductions reorder (GEMMs over
the patch axis add exact-zero products of the pad rows, a masked softmax row is longer). A reordered fp32 sum of at
most K terms moves by at most K u of its terms' magnitudes (u = 2^-24), and a value passes through at most
2 * depth + 4 reductions (patch embed, each block's attention and MLP, the merger; forward and backward): relative
to the tensor's largest magnitude, rtol = (2 depth + 4) K u with K the largest reduction (the padded patch count)."""

from __future__ import annotations

import pytest
import torch

from titan_mm.models.qwen2_5_vl.vision import build_window_meta
from titan_mm.models.qwen3_vl.config import VisionConfig
from titan_mm.models.qwen3_vl.vision import VisionTower, build_vision_meta
from titan_mm.registry import get_model_spec, resolve_model

CFG = VisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=36,
                   deepstack_visual_indexes=(0, 2), in_channels=3)
GRID = torch.tensor([[1, 4, 6], [2, 8, 4], [1, 6, 6]])  # 124 patches: an image, a 2-frame video, an image
U = 2.0**-24


def _tower() -> VisionTower:
    torch.manual_seed(0)
    t = VisionTower(CFG).float()
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(0.15 * torch.randn(p.shape))
    return t


def windowed_tower():
    """(Qwen2.5-VL debug flavor's windowed ViT with random fp32 weights, the family config)."""
    _, cfg = resolve_model("qwen2_5_vl", "debug", attn_backend="sdpa")
    torch.manual_seed(0)
    tower = get_model_spec("qwen2_5_vl").build(cfg).visual.float()
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(0.15 * torch.randn(p.shape))
    return tower, cfg


def _pixels(cfg, seed: int) -> torch.Tensor:
    return torch.randn(int(GRID.prod(-1).sum()), cfg.patch_dim, generator=torch.Generator().manual_seed(seed))


def _run(tower, x, meta, grad: bool):
    """(merged, *DeepStack, and with ``grad``: the pixels' gradient and every parameter's) of one forward."""
    tower.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(grad)
    out, ds = tower(xi, meta)
    outs = [out, *ds]
    if not grad:
        return [o.detach() for o in outs]
    # a loss that weighs every output differently
    w = [torch.linspace(-1, 1, o.numel(), device=o.device, dtype=o.dtype).view_as(o) for o in outs]
    sum((o * wi).sum() for o, wi in zip(outs, w)).backward()
    return [o.detach() for o in outs] + [xi.grad] + [p.grad for p in tower.parameters()]


def _close(got, want, k: int, depth: int = CFG.depth):
    rtol = (2 * depth + 4) * k * U
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        assert err <= rtol, f"relative error {err:.2e} over {rtol:.2e}"


@pytest.mark.parametrize("bucket", [64, 256])
def test_bucketed_tower_equals_unpadded_sdpa(bucket):
    tower, x = _tower(), _pixels(CFG, 1)
    meta = build_vision_meta(GRID, CFG, "sdpa", bucket=bucket)
    n = x.shape[0]
    assert meta.n_pad == -n % bucket and (n + meta.n_pad) % bucket == 0 and meta.pos_idx.shape[0] == n + meta.n_pad
    assert int(meta.cu_seqlens[-1]) == n + meta.n_pad and meta.max_seqlen == 36  # pads no longer than the longest
    assert not meta.pos_w[n:].any() and not meta.rope_hw[n:].any()
    _close(_run(tower, x, meta, True), _run(tower, x, build_vision_meta(GRID, CFG, "sdpa"), True), n + meta.n_pad)


def test_bucketed_tower_equals_unpadded_flex_forward():
    """flex has no CPU backward: the forward of its BlockMask path (pads as their own documents)."""
    tower, x = _tower(), _pixels(CFG, 2)
    meta = build_vision_meta(GRID, CFG, "flex", bucket=256)
    with torch.no_grad():
        _close(_run(tower, x, meta, False), _run(tower, x, build_vision_meta(GRID, CFG, "flex"), False), 256)


def test_bucket_shapes_repeat_and_mistakes_are_one_error():
    """Different image sets under one bucket run the blocks at one patch count; a bucket that does not hold whole
    merged tokens is refused with what to do."""
    sizes = {int(build_vision_meta(g, CFG, "sdpa", bucket=128).pos_idx.shape[0])
             for g in (GRID, torch.tensor([[1, 4, 4]]), torch.tensor([[1, 8, 8], [1, 2, 2]]))}
    assert sizes == {128}
    assert build_vision_meta(torch.tensor([[1, 8, 16]]), CFG, "sdpa", bucket=128).n_pad == 0  # already a multiple
    with pytest.raises(ValueError, match=r"vision bucket=6 is not a multiple of spatial_merge_size\*\*2=4"):
        build_vision_meta(GRID, CFG, "sdpa", bucket=6)
    empty = build_vision_meta(torch.zeros(0, 3, dtype=torch.int64), CFG, "sdpa", bucket=64)
    assert empty.n_pad == 0 and empty.pos_idx.shape[0] == 0  # no images: nothing to pad


@pytest.mark.parametrize("bucket", [64, 256])
def test_bucketed_windowed_tower_equals_unpadded(bucket):
    """Qwen2.5-VL's windowed ViT (the debug flavor's tower, random weights): window and full-attention blocks."""
    tower, cfg = windowed_tower()
    x, n = _pixels(cfg.vision, 3), int(GRID.prod(-1).sum())
    meta = build_window_meta(GRID, cfg.vision, "sdpa", bucket=bucket)
    assert meta.full.n_pad == meta.window.n_pad == -n % bucket and meta.order.shape[0] == n + meta.full.n_pad
    assert torch.equal(meta.order[n:], torch.arange(n, n + meta.full.n_pad)) and meta.inverse.shape[0] == n // 4
    ref = build_window_meta(GRID, cfg.vision, "sdpa")
    _close(_run(tower, x, meta, True), _run(tower, x, ref, True), n + meta.full.n_pad, cfg.vision.depth)
