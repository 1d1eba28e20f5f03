"""CPU, in-process: the capability guards pick the PyTorch ops of titan_mm.nn (the references
the Triton kernels are checked against elsewhere), and those agree with transformers / torch."""

import os

import pytest
import torch
import torch.nn.functional as F

import titan_mm.kernels as K
from titan_mm.nn import rope
from titan_mm.nn.loss import chunked_cross_entropy
from titan_mm.nn.mlp import silu_mul
from titan_mm.nn.norm import rms_norm

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the non-interpreter path")


def test_cpu_uses_reference():
    x = torch.randn(4, 8)
    assert not K.use_triton(x)
    assert not K.use_triton(x.double())
    w = torch.randn(8)
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    torch.testing.assert_close(K.swiglu(x, x), silu_mul(x, x))
    torch.testing.assert_close(K.bias_gelu(x, w), F.gelu(x + w, approximate="tanh"))


def test_float64_never_takes_triton():
    x = torch.randn(4, 8, dtype=torch.float64)
    assert all(t not in K._dispatch.TRITON_DTYPES for t in (x.dtype,))


def test_linear_cross_entropy_reference_matches_torch():
    N, D, V = 37, 16, 101
    h, w = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    labels = torch.randint(0, V, (N,))
    labels[::4] = -100
    ref = F.cross_entropy(h @ w.t(), labels, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(chunked_cross_entropy(h, w, labels, chunk_size=8), ref)
    torch.testing.assert_close(K.linear_cross_entropy(h.float(), w.float(), labels), ref.float(), rtol=1e-5, atol=1e-4)
    # z-loss adds z * lse^2 over the same tokens
    lse = torch.logsumexp(h @ w.t(), -1)[labels != -100]
    torch.testing.assert_close(chunked_cross_entropy(h, w, labels, z_loss_weight=1e-2), ref + 1e-2 * (lse**2).sum())
    # the kernels' CPU path is the same function, for h [..., D] and any ignore_index
    lab2 = torch.where(labels == -100, 7, labels)
    lab2[::4] = -1
    got = K.linear_cross_entropy(h.float().view(1, N, D), w.float(), lab2.view(1, N), ignore_index=-1)
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-4)


def test_rope_layouts():
    """apply_rope takes [B, S, X] or [S, X] tables of width Dh (HF layout) or Dh/2, and q/k [B, S, H, Dh]."""
    B, S, H, Dh = 2, 6, 3, 8
    q, k = torch.randn(B, S, H, Dh, dtype=torch.float64), torch.randn(B, S, 1, Dh, dtype=torch.float64)
    inv, scale = rope.rope_inv_freq(Dh, 10000.0)
    pos = torch.arange(S).expand(B, S)
    cos, sin = rope.rope_cos_sin(pos, inv, scale, torch.float64)
    want = [q * cos[:, :, None] + rope.rotate_half(q) * sin[:, :, None],
            k * cos[:, :, None] + rope.rotate_half(k) * sin[:, :, None]]
    for c, s_ in ((cos, sin), (cos[..., : Dh // 2], sin[..., : Dh // 2]), (cos[0], sin[0])):
        for a, b in zip(rope.apply_rope(q, k, c, s_), want):
            torch.testing.assert_close(a, b)
    for a, b in zip(K.apply_rope(q.float(), k.float(), cos[0, :, : Dh // 2].float(), sin[0, :, : Dh // 2].float()), want):
        torch.testing.assert_close(a, b.float())


def test_interleaved_mrope_table_through_rope_matches_transformers():
    """Qwen3-VL's M-RoPE is the RoPE op applied to HF's interleaved [B, S, Dh] table (what the models build)."""
    mod = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig

    cfg = Qwen3VLTextConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                         "mrope_interleaved": True},
    )
    emb = mod.Qwen3VLTextRotaryEmbedding(cfg)
    B, S = 2, 9
    cos_hf, sin_hf = emb(torch.zeros(1), torch.randint(0, 50, (3, B, S)))
    q, k = torch.randn(B, S, 2, 128), torch.randn(B, S, 1, 128)
    qh, kh = mod.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos_hf, sin_hf)
    qo, ko = K.apply_rope(q, k, cos_hf, sin_hf)
    torch.testing.assert_close(qo, qh.transpose(1, 2))
    torch.testing.assert_close(ko, kh.transpose(1, 2))


def test_resolve_ops():
    assert K.resolve_ops(True) == frozenset(K.KERNEL_OPS)
    assert K.resolve_ops(False) == K.resolve_ops("none") == K.resolve_ops("") == frozenset()
    assert K.resolve_ops("all,-linear_cross_entropy") == frozenset(K.KERNEL_OPS) - {"linear_cross_entropy"}
    assert K.resolve_ops("rms_norm, swiglu") == {"rms_norm", "swiglu"}
    with pytest.raises(ValueError):
        K.resolve_ops("rmsnorm")


def test_dtensor_inputs_take_reference():
    from torch.distributed.tensor import DTensor

    assert K._dispatch.DTensor is DTensor


def test_qwen3_per_op_kernel_switch():
    mod = pytest.importorskip("titan_mm.models.qwen3.model")
    ops = mod.select_ops("all,-linear_cross_entropy")
    assert ops.rms_norm is K.rms_norm and ops.act_mul is K.swiglu and ops.apply_rope is K.apply_rope
    assert ops.cross_entropy is not mod.select_ops(True).cross_entropy
    ops = mod.select_ops("rope")
    assert ops.apply_rope is K.apply_rope and ops.rms_norm is not K.rms_norm
    assert mod.select_ops(False).rms_norm is not K.rms_norm


def test_moe_routing_reaches_every_moe_family_and_is_the_reference_off_cuda():
    """Kernel op moe_routing: every MoE layer of the softmax top-k families takes K.moe_routing when it is on and
    route_stats when off; off CUDA K.moe_routing is route_stats itself, which is route() then aux_stats."""
    from titan_mm.nn import moe
    from titan_mm.registry import get_model_spec

    for name in ("qwen3_moe", "qwen3_vl_moe", "qwen3_omni_moe", "qwen3_5_moe"):
        spec = get_model_spec(name)
        flavor = spec.flavor("debug_moe" if name == "qwen3_moe" else "debug")
        for kernels, want in ((True, K.moe_routing), ("all,-moe_routing", moe.route_stats), (False, moe.route_stats)):
            with torch.device("meta"):
                m = spec.build(spec.with_runtime(flavor, attn_backend="sdpa", kernels=kernels))
            layers = [mod for mod in m.modules() if isinstance(mod, moe.MoE)]
            assert layers and all(layer.routing is want for layer in layers), (name, kernels)
    x, w = torch.randn(9, 8), torch.randn(16, 8)
    valid = torch.rand(9) > 0.3
    probs, top_w, top_i = moe.route(x, w, 4, True)
    want = (top_w, top_i, moe.aux_stats(probs, top_i, valid))
    for got in (moe.route_stats(F.linear(x, w), 4, True, valid), K.moe_routing(F.linear(x, w), 4, True, valid)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
