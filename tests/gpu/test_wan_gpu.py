"""The wan family on CUDA: fp32 predictions and gradients equal diffusers' WanTransformer3DModel on the same card,
a flow-matching train step (sdpa and flex, kind "bidirectional") gives the CPU step's loss, and the sampler gives
the CPU's latents with a per-clip forward that makes no host sync; bench/mfu.py's diffusers stack, compiled on the
card, trains on titan's loss."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.unit.test_wan import TI2V, TINY, ClipFlow, _clips, _inputs, _pair
from tests.unit.test_wan_peer import assert_same_loss, peer_and_titan_losses
from titan_mm.models.wan import patchify, unpatchify
from titan_mm.models.wan.hf import to_diffusers
from titan_mm.models.wan.sample import sample
from titan_mm.nn.attention import build_attn_meta
from titan_mm.registry import get_model_spec
from titan_mm.train.state import TrainState
from titan_mm.train.step import StepContext, train_step

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hf,per_patch", [(TINY, False), (TI2V, True)], ids=["wan2.1", "wan2.2_ti2v"])
def test_wan_matches_diffusers_on_cuda(hf, per_patch, tmp_path, monkeypatch):
    # cuDNN runs diffusers' Conv3d patch embedding in TF32 by default (1e-3 off fp32, measured on the H200)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ref, model, cfg = _pair(hf, tmp_path)
    ref, model = ref.cuda(), model.cuda()
    x, text, patches, grid, t = (v.cuda() for v in _inputs(cfg, per_patch))
    want = ref(x, t * 1000 if per_patch else t[:, 0] * 1000, text).sample
    meta = build_attn_meta({"doc_ids": torch.zeros(patches.shape[:2], dtype=torch.int32)}, "sdpa", "cuda",
                           kind="bidirectional")
    pred = model.predict_velocity(model(attn=meta, noisy_latents=patches, timesteps=t, text_states=text,
                                        grid_fhw=grid), {})
    got = unpatchify(pred, tuple(n // p for n, p in zip(x.shape[2:], cfg.patch_size)), cfg.patch_size)
    # fp32 on both sides; other kernels sum in other orders: ~1e-6 on O(1) values
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    grads = to_diffusers(dict(model.named_parameters()))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _step_loss(device: str, backend: str) -> float:
    spec = get_model_spec("wan")
    torch.manual_seed(0)
    cfg = spec.flavor("debug")
    model = spec.build(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    # the family's prepare_batch, as setup() passes it: one t per clip runs the time MLP per clip
    ctx = StepContext(device=torch.device(device), attn_backend=backend, objective=ClipFlow(sampler="uniform", seed=1),
                      seq_keys=spec.schema().seq, prepare_batch=functools.partial(spec.prepare_batch, cfg))
    return train_step(state, [next(_clips(0, spec.flavor("debug")))], ctx).loss


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_wan_train_step_on_cuda_equals_cpu(backend):
    # one fp32 step: the same batch, noise and weights; the loss differs by summation order only
    assert _step_loss("cuda", backend) == pytest.approx(_step_loss("cpu", "sdpa"), rel=1e-5)


def test_sampler_on_cuda_equals_cpu_and_the_per_clip_forward_does_not_sync(tmp_path):
    _, model, cfg = _pair(TINY, tmp_path)
    text = torch.randn(2, 5, cfg.text_dim, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(2, cfg.in_channels, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    kw = {"steps": 4, "shift": 3.0, "guidance_scale": 4.0}
    want = sample(model, text, noise, **kw)
    model = model.cuda()
    got = sample(model, text.cuda(), noise.cuda(), **kw)
    # per step the velocity is within the parity bound (1e-5) of the CPU's, times up to 1 + 2 x scale by guidance
    torch.testing.assert_close(got.cpu(), want, atol=9e-5, rtol=1e-5)
    patches, grid = patchify(noise.cuda(), cfg.patch_size)
    meta = build_attn_meta({"doc_ids": torch.zeros(patches.shape[:2], dtype=torch.int32)}, "sdpa", "cuda",
                           kind="bidirectional")
    t, text = torch.rand(2, device="cuda"), text.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            out = model(attn=meta, noisy_latents=patches, clip_timesteps=t, text_states=text, grid_fhw=grid)
            model.predict_velocity(out, {})
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_diffusers_peer_compiled_on_cuda_loss_is_titans(tmp_path, monkeypatch):
    """bench/mfu.py's diffusers stack as the bench runs it on the GPU (blocks compiled, FSDP2 on a one-GPU NCCL
    world), in fp32 with TF32 off: its step-1 loss is titan's on the same weights and clips."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert_same_loss(*peer_and_titan_losses(tmp_path, torch.device("cuda"), compile_blocks=True))


def test_fused_ops_equal_the_modules_on_cuda(monkeypatch):
    """Wan's q / k norms and FFN bias + GELU through titan_mm.kernels' Triton kernels on the GPU (fp32, TF32 off:
    the same sums in other orders) give the modules' forward and gradients (tests/unit/test_wan_kernels.py)."""
    from tests.unit.test_wan_kernels import assert_same

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert_same("rms_norm,bias_gelu", "cuda")

