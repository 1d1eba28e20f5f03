"""Qwen3-VL on a GPU (run on the H200): forward + backward of a small VL model in bf16 with no host syncs
(torch.cuda.set_sync_debug_mode("error")), vision tower included, for dense and MoE and every attention
backend; and bf16 vs fp32 agreement of the loss.

Run: pytest -q -m gpu tests/gpu/test_qwen3_vl_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_mm.nn.attention import build_attn_meta
from titan_mm.models.qwen3_vl.config import FLAVORS, MOE_FLAVORS, with_overrides
from titan_mm.models.qwen3_vl.model import Qwen3VLModel
from titan_mm.models.qwen3_vl.synthetic import make_sample, pack
from titan_mm.models.qwen3_vl.model import vision_inputs  # noqa: E402

pytestmark = pytest.mark.gpu


def _cfg(moe: bool, attn: str, vattn: str):
    base = MOE_FLAVORS["debug"] if moe else FLAVORS["debug"]
    cfg = with_overrides(base, {"text": {"vocab_size": 4096}, "vision_start_token_id": 4000, "image_token_id": 4001,
                                "video_token_id": 4002, "vision_end_token_id": 4003})
    return dataclasses.replace(cfg, attn_backend=attn, vision_attn_backend=vattn)


def _batch(cfg):
    g = torch.Generator().manual_seed(0)
    samples = [
        make_sample(cfg, [("text", 30), ("image", (16, 24)), ("text", 50)], g),
        make_sample(cfg, [("text", 10), ("video", (2, 8, 8)), ("text", 20)], g),
        make_sample(cfg, [("image", (8, 8)), ("image", (12, 6)), ("text", 40)], g),
        make_sample(cfg, [("text", 100)], g),
    ]
    return pack(samples, cfg, seq_len=512, rows=2)


def _to_bf16(model):
    """Parameters to bf16; buffers (the RoPE inverse frequencies) stay fp32, as under FSDP mixed precision."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def _run(model, batch, dev, sync_check: bool):
    attn = build_attn_meta(batch, model.cfg.attn_backend, dev)
    extra = vision_inputs(model.cfg, batch, dev)
    b = {k: (v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) and k not in ("cu_seqlens", "max_seqlen")
             else v) for k, v in batch.items()}
    vis = {k: b[k].to(torch.bfloat16 if next(model.parameters()).dtype == torch.bfloat16 else torch.float32)
           for k in ("pixel_values", "pixel_values_videos") if k in b}
    torch.cuda.synchronize()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(b["input_ids"], position_ids=b["position_ids"], attn=attn, labels=b["labels"], **vis, **extra)
        loss = out.loss_sum / 100.0 + out.aux_loss
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return out.loss_sum.detach().float().cpu()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("attn,vattn", [("flex", "varlen"), ("flex", "flex"), ("sdpa", "sdpa"), ("varlen", "varlen")])
def test_no_host_sync_bf16(moe, attn, vattn):
    if vattn == "varlen" or attn == "varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    dev = torch.device("cuda")
    cfg = _cfg(moe, attn, vattn)
    torch.manual_seed(0)
    with dev:
        model = Qwen3VLModel(cfg)
    model.init_weights(buffer_device=dev)
    model = _to_bf16(model)
    batch = _batch(cfg)
    _run(model, batch, dev, sync_check=False)  # warm-up: compiles flex kernels, autotunes
    model.zero_grad(set_to_none=True)
    loss = _run(model, batch, dev, sync_check=True)
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and all(torch.isfinite(g).all() for g in grads)
    assert model.visual.patch_embed.weight.grad.abs().sum() > 0  # the vision tower is in the graph


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bf16_matches_fp32(moe):
    dev = torch.device("cuda")
    cfg = _cfg(moe, "sdpa", "sdpa")
    torch.manual_seed(0)
    with dev:
        m32 = Qwen3VLModel(cfg)
    m32.init_weights(buffer_device=dev)
    batch = _batch(cfg)
    l32 = _run(m32, batch, dev, sync_check=False)
    m16 = Qwen3VLModel(cfg).to(dev)
    m16.load_state_dict(m32.state_dict())
    m16.init_buffers(dev)
    m16 = _to_bf16(m16)
    l16 = _run(m16, batch, dev, sync_check=False)
    assert abs(l16 - l32) / l32 < 2e-2, (l16, l32)
