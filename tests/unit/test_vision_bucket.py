"""Bucketed patch counts in the Qwen3-VL ViT (``build_vision_meta(..., bucket=B)``: the tower runs on the patch
count rounded up to a multiple of B, zero patches in attention segments of their own, their merged tokens dropped)
give the unpadded tower's outputs, DeepStack features and every gradient (fp32, CPU).

Tolerance, from the arithmetic: each real value is the same math as unpadded; only reductions reorder (GEMMs over
the patch axis add exact-zero products of the pad rows, a masked softmax row is longer). A reordered fp32 sum of at
most K terms moves by at most K u of its terms' magnitudes (u = 2^-24), and a value passes through at most
2 * depth + 4 reductions (patch embed, each block's attention and MLP, the merger; forward and backward): relative
to the tensor's largest magnitude, rtol = (2 depth + 4) K u with K the largest reduction (the padded patch count).

The trainer buckets through the model config's ``vision_bucket`` (read by the family's prepare_batch): its losses are
the unbucketed run's and its ViT blocks run at one patch count across micro-batches of other image sizes."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from titan_mm.launch.train import main
from titan_mm.models.qwen2_5_vl import vision as vl25_vision
from titan_mm.models.qwen2_5_vl.vision import build_window_meta
from titan_mm.models.qwen3_vl import vision as vl3_vision
from titan_mm.models.qwen3_vl.config import VisionConfig
from titan_mm.models.qwen3_vl.vision import VisionTower, build_vision_meta
from titan_mm.observe.metrics import read_metrics
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


def _image_records(path, n: int = 12) -> None:
    """``n`` chat records, each a random PNG (data: URI) of one of several sizes: micro-batches of other patch counts."""
    rng = np.random.default_rng(0)
    sizes = [(32, 32), (64, 32), (32, 96), (64, 64), (96, 32), (32, 64)]
    with open(path, "w") as f:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (*sizes[i % len(sizes)], 3), dtype=np.uint8)).save(buf, "PNG")
            uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            f.write(json.dumps({"messages": [
                {"role": "user", "content": [{"type": "image", "image": uri}, {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": f"number {i}"}]}) + "\n")


STEPS = 3


# the quick suite runs the two metadata builders (build_vision_meta, build_window_meta); -m slow the families that
# reach them through their own prepare_batch (~10 s each on 2 cores)
@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl", *(pytest.param(n, marks=pytest.mark.slow)
                                                             for n in ("qwen3_5", "qwen2_5_omni", "qwen3_omni_moe"))])
def test_trainer_buckets_patches_with_the_same_losses(tmp_path, monkeypatch, name):
    """debug_<name>.toml on images of six sizes, 3 steps, with and without model vision_bucket: the same losses
    (within the tower's bound above, K = the bucket; each step's loss is a mean over tokens whose visual inputs moved
    by at most that much) and, bucketed, every ViT block call at one patch count while the real counts vary."""
    bucket = 512  # above the patches of any micro-batch here: one shape for all
    _image_records(tmp_path / "data.jsonl")
    seen: list[int] = []
    for block in (vl3_vision.VisionBlock, vl25_vision.VisionBlock):
        run = block.forward
        monkeypatch.setattr(block, "forward", lambda self, x, *a, _run=run: seen.append(x.shape[0]) or _run(self, x, *a))
    runs = {}
    for b in (0, bucket):
        seen.clear()
        out = tmp_path / f"b{b}"
        assert main(["--config", f"debug_{name}", "--job.dump_folder", str(out), "--data.dataset",
                     str(tmp_path / "data.jsonl"), "--data.image_min_pixels", "1024", "--data.image_max_pixels",
                     "16384", "--data.micro_batch_size", "2", "--training.steps", str(STEPS),
                     "--training.global_batch_size", "0", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
                     "False", "--checkpoint.enable", "False", "--eval.interval", "0",
                     "--model.overrides", json.dumps({"vision_bucket": b})]) == 0
        rows = read_metrics(out / f"debug_{name}" / "metrics.jsonl")
        runs[b] = ([rows[s]["loss"] for s in sorted(rows)], sorted(set(seen)))
    (plain, plain_n), (bucketed, bucketed_n) = runs[0], runs[bucket]
    assert len(plain_n) > 1 and max(plain_n) < bucket  # the micro-batches' patch counts differ
    assert bucketed_n == [bucket]  # bucketed, the blocks see one shape
    _, cfg = resolve_model(name, "debug")
    rtol = (2 * cfg.vision.depth + 4) * bucket * U
    assert len(plain) == len(bucketed) == STEPS
    for a, b in zip(plain, bucketed):
        assert abs(a - b) <= rtol * abs(a), (plain, bucketed)


def test_vision_bucket_mistakes_are_one_line(tmp_path, capsys):
    """A bucket that does not hold whole merged tokens stops the launcher before any work (exit 2, one line)."""
    assert main(["--config", "debug_qwen3_vl", "--job.dump_folder", str(tmp_path),
                 "--model.overrides", '{"vision_bucket": 6}']) == 2
    err = capsys.readouterr().err
    assert "vision_bucket=6 must be 0 (off) or a positive multiple of spatial_merge_size**2=4" in err, err
