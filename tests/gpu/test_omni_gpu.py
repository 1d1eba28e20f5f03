"""The Omni thinkers (Qwen2.5-Omni, Qwen3-Omni-MoE) on a GPU (run on the H200): for each debug flavor, a bf16
forward + backward with no host syncs (torch.cuda.set_sync_debug_mode("error")) on a sample holding an image, a
video and audio clips, for the trainer's backends (flex LLM, "auto" = varlen encoders) and for flex / sdpa
everywhere; the same on a text-only batch, where both encoders run their stand-ins (times 0): every encoder
parameter gets a gradient and the audio tower's (and the ViT's) is exactly zero; and the bf16 loss agrees with
fp32 (and, with media, each part's gradient direction: audio tower, ViT, LLM).

The samples come from the parity tests' builders (tests/parity/test_qwen2_5_omni_parity.py make_sample /
titan_batch, tests/parity/test_qwen3_omni_moe_parity.py make_batch); the debug flavors take those builders' token
ids, mel bins (and, for Qwen3-Omni, ViT patch size) so the builders apply as they are.

Run: pytest -q -m gpu tests/gpu/test_omni_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")  # the parity modules whose builders are reused import it

from tests.parity import test_qwen2_5_omni_parity as p25  # noqa: E402
from tests.parity import test_qwen3_omni_moe_parity as p3  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.registry import resolve_model  # noqa: E402

pytestmark = pytest.mark.gpu

FAMILIES = ("qwen2_5_omni", "qwen3_omni_moe")
BACKENDS = [("flex", "auto"), ("flex", "flex"), ("sdpa", "sdpa")]  # (LLM attn, encoders'): the trainer's first
FORWARD_KEYS = ("pixel_values", "pixel_values_videos", "input_features", "omni_meta", "mm_index")
DEV = torch.device("cuda")


def _cfg(family: str, attn: str = "sdpa", vattn: str = "sdpa"):
    """The family's debug flavor with the parity builders' special tokens and audio / patch shapes."""
    if family == "qwen2_5_omni":
        t = p25.TOK
        ov = {"audio": {"num_mel_bins": p25.MELS}, "audio_token_id": t["audio_token_index"],
              "image_token_id": t["image_token_index"], "video_token_id": t["video_token_index"],
              **{k: t[k] for k in ("audio_start_token_id", "audio_end_token_id", "vision_start_token_id",
                                   "vision_end_token_id")}}
    else:
        ov = {"vision": {"patch_size": 4}, "audio": {"num_mel_bins": p3.MELS}, "audio_token_id": p3.AUD,
              "audio_start_token_id": p3.AS, "audio_end_token_id": p3.AE, "image_token_id": p3.IMG,
              "video_token_id": p3.VID, "vision_start_token_id": p3.VS, "vision_end_token_id": p3.VE}
    spec, cfg = resolve_model(family, "debug", overrides=ov, attn_backend=attn, kernels=False)
    cfg = dataclasses.replace(cfg, vision_attn_backend=vattn)
    if family == "qwen3_omni_moe":
        assert cfg.vision.patch_dim == p3.PATCH
    return spec, cfg


def _special(cfg) -> torch.Tensor:
    return torch.tensor([cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id, cfg.vision_start_token_id,
                         cfg.vision_end_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id])


def _batch(family: str, cfg, media: bool) -> dict:
    """A host batch in the model's keys, with next-token labels (-100 on the special tokens and the last one)."""
    if family == "qwen2_5_omni":
        segs = ([("text", 5), ("image", (8, 12)), ("text", 7), ("audio", 250), ("text", 4),
                 ("video", (2, 8, 8), 1.0), ("text", 3), ("audio", 130), ("text", 6)] if media else [("text", 96)])
        b = p25.titan_batch(p25.make_sample(cfg, segs, torch.Generator().manual_seed(0)))
    else:
        rows = [[3, "image", 5, "audio250", 4, "video", 3, "audio130", 6]] if media else [[48], [48]]
        b, _ = p3.make_batch(rows)
    ids = b["input_ids"]
    tgt = ids[:, 1:].masked_fill(torch.isin(ids[:, 1:], _special(cfg)), -100)
    b["labels"] = torch.cat([tgt, torch.full_like(ids[:, :1], -100)], 1)
    if media:
        assert {"pixel_values", "pixel_values_videos", "input_features"} <= set(b)
    else:
        assert not {"pixel_values", "pixel_values_videos", "input_features"} & set(b)
    return b


def _build(spec, cfg, dev):
    torch.manual_seed(0)
    with dev:
        model = spec.build(cfg)
    model.init_weights(buffer_device=dev)
    return model


def _to_bf16(model):
    """Parameters to bf16; buffers stay fp32, as under FSDP mixed precision."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def _run(spec, model, batch, sync_check: bool) -> torch.Tensor:
    """Host prepare_batch + attention metadata, the copies, then forward + backward (under the sync check)."""
    dev = DEV
    dtype = next(model.parameters()).dtype
    b = spec.prepare_batch(model.cfg, batch, dev)
    attn = build_attn_meta(b, model.cfg.attn_backend, dev)
    kw = {}
    for k in FORWARD_KEYS:
        v = b.get(k)
        if isinstance(v, torch.Tensor):
            v = v.to(dev, non_blocking=True)
            v = v.to(dtype) if v.is_floating_point() else v
        if v is not None:
            kw[k] = v
    ids, pos, labels = (b[k].to(dev, non_blocking=True) for k in ("input_ids", "position_ids", "labels"))
    n = max(int((batch["labels"] != -100).sum()), 1)
    torch.cuda.synchronize()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(ids, position_ids=pos, attn=attn, labels=labels, **kw)
        loss = out.loss_sum / n
        (loss + out.aux_loss if out.aux_loss is not None else loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return loss.detach().float().cpu()


UNUSED = ("audio_tower.audio_bos_eos_token.weight",)  # Qwen2.5-Omni's: loaded, never read (nor by HF)


def _check_grads(model, media: bool):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in UNUSED]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for _, p in named), \
        [n for n, p in named if p.grad is None or not torch.isfinite(p.grad).all()]
    audio = [p.grad for n, p in named if n.startswith("audio_tower.")]
    vision = [p.grad for n, p in named if n.startswith("visual.")]
    assert audio and vision
    if media:  # both encoders' outputs reach the loss
        assert sum(g.float().abs().sum() for g in audio) > 0 and sum(g.float().abs().sum() for g in vision) > 0
    else:  # the stand-ins enter times 0: in the graph, and exactly zero
        assert all(torch.count_nonzero(g) == 0 for g in audio)
        assert all(torch.count_nonzero(g) == 0 for g in vision)


@pytest.mark.parametrize("media", [True, False], ids=["image_video_audio", "text_only"])
@pytest.mark.parametrize("attn,vattn", BACKENDS, ids=[f"{a}-{v}" for a, v in BACKENDS])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_host_sync_bf16(family, attn, vattn, media):
    if "varlen" in (attn, vattn):  # "auto" takes flex where varlen is missing
        pytest.importorskip("torch.nn.attention.varlen")
    dev = DEV
    spec, cfg = _cfg(family, attn, vattn)
    model = _to_bf16(_build(spec, cfg, dev))
    batch = _batch(family, cfg, media)
    _run(spec, model, batch, sync_check=False)  # warm-up: flex / Triton compiles and autotuning synchronize
    model.zero_grad(set_to_none=True)
    loss = _run(spec, model, batch, sync_check=True)
    assert torch.isfinite(loss)
    _check_grads(model, media)


@pytest.mark.parametrize("media", [True, False], ids=["image_video_audio", "text_only"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_fp32(family, media):
    dev = DEV
    spec, cfg = _cfg(family)
    m32 = _build(spec, cfg, dev)
    batch = _batch(family, cfg, media)
    l32 = _run(spec, m32, batch, sync_check=False)
    with torch.device("meta"):
        m16 = spec.build(cfg)
    m16.to_empty(device=dev)
    m16.init_buffers(dev)
    m16.load_state_dict(m32.state_dict())
    l16 = _run(spec, _to_bf16(m16), batch, sync_check=False)
    assert torch.isfinite(l16) and abs(l16 - l32) / l32 < 2e-2, (l16, l32)
    if not media:
        return
    # near-uniform logits at init make the loss a weak check: each part's gradient must point the same way too
    # (cosine >= 0.9998 on the CPU; bf16 on the GPU rounds alike)
    g16 = dict(m16.named_parameters())
    for part in ("audio_tower.", "visual.", "language_model."):
        names = [n for n, p in m32.named_parameters() if n.startswith(part) and p.grad is not None]
        a = torch.cat([m32.get_parameter(n).grad.float().flatten() for n in names])
        b = torch.cat([g16[n].grad.float().flatten() for n in names])
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        assert cos >= 0.99, (part, cos)
