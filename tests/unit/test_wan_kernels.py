"""Wan's fused ops (WanConfig.kernels): the q / k norms through titan_mm.kernels.rms_norm and the FFN's bias + GELU
through titan_mm.kernels.bias_gelu give the model's forward and gradients of the PyTorch modules (nn.RMSNorm, the
Linear's bias then GELU), on the CPU references and in the Triton kernels under the interpreter. fp32: the same
sums in other orders, so differences of a few ulps of O(1) values (bounds 1e-5 forward, 1e-4 gradients, as the
diffusers parity of tests/unit/test_wan.py)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import run_interpreted
from titan_mm.models.wan.model import QKNorm, _GeluProj
from titan_mm.nn.attention import build_attn_meta
from titan_mm.registry import resolve_model


def _run(kernels, device: str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The debug Wan model's velocity on random clips (seeded weights and inputs) and its parameters' gradients."""
    spec, cfg = resolve_model("wan", "debug", kernels=kernels)
    torch.manual_seed(0)
    model = spec.build(cfg)
    model.init_weights()
    model.to(device)
    with torch.no_grad():  # every weight away from its init's zeros and ones, so that each matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    B, S = 2, 3 * 4 * 4
    grid = torch.stack(torch.meshgrid(*(torch.arange(n) for n in (3, 4, 4)), indexing="ij"), -1).reshape(1, S, 3)
    P = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    meta = build_attn_meta({"doc_ids": torch.zeros(B, S, dtype=torch.int32)}, "sdpa", device, kind="bidirectional")
    x, text, t = torch.randn(B, S, P, generator=g), torch.randn(B, 5, cfg.text_dim, generator=g), torch.rand(B, generator=g)
    out = model(attn=meta, noisy_latents=x.to(device), grid_fhw=grid.expand(B, -1, -1).to(device),
                text_states=text.to(device), clip_timesteps=t.to(device))
    pred = model.predict_velocity(out, {})
    (pred * torch.randn(pred.shape, generator=g).to(device)).sum().backward()
    return pred.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def assert_same(kernels, device: str = "cpu") -> None:
    want, want_g = _run(False, device)
    got, got_g = _run(kernels, device)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want_g.keys() == got_g.keys()
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("kernels", ["all", "rms_norm", "bias_gelu"])
def test_fused_ops_equal_the_modules_on_their_references(kernels):
    assert_same(kernels)


def test_the_config_picks_the_fused_ops():
    spec, cfg = resolve_model("wan", "debug", kernels="all,-bias_gelu")
    block = spec.build(cfg).blocks["0"]
    assert isinstance(block.attn1.norm_q, QKNorm) and block.attn1.norm_q.fused and block.attn2.norm_k.fused
    assert isinstance(block.ffn.net[0], _GeluProj) and not block.ffn.net[0].fused
    plain = resolve_model("wan", "debug")[0].build(resolve_model("wan", "debug")[1]).blocks["0"]
    assert not plain.attn1.norm_q.fused and not plain.ffn.net[0].fused
    # the parameter names stay diffusers' (folders load and export unchanged)
    assert {"attn1.norm_q.weight", "ffn.net.0.proj.weight", "ffn.net.0.proj.bias"} <= dict(block.named_parameters()).keys()


def test_fused_ops_equal_the_modules_in_the_triton_kernels():
    """The same comparison with the Triton kernels themselves (CPU tensors take them under TRITON_INTERPRET=1)."""
    run_interpreted("from tests.unit.test_wan_kernels import assert_same\nassert_same('rms_norm,bias_gelu')\n"
                    "print('OK')\n", timeout=600)
