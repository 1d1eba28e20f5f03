"""Qwen3.5 on a GPU (run on the H200, with fla-core installed): fla's chunked gated delta rule equals the PyTorch
reference of titan_mm/nn/linear_attention.py on packed rows (outputs and gradients, fp32 and bf16) and
takes the host-built chunk table; a small Qwen3.5 / Qwen3.5-MoE forward + backward in bf16 runs with no host syncs
(torch.cuda.set_sync_debug_mode("error")), vision tower included, on fla and the reference, with and without
kernels; and its bf16 loss agrees with fp32.

Run: PYTHONPATH=$PWD:/tmp/site pytest -q -m gpu tests/gpu/test_qwen3_5_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.linear_attention import build_linear_meta, chunk_gated_delta_rule, gated_delta_rule
from titan_mm.models.qwen3_5.config import FLAVORS, MOE_FLAVORS
from titan_mm.models.qwen3_5.model import Qwen3_5Model, prepare_batch
from titan_mm.models.qwen3_vl.synthetic import make_sample, pack

pytestmark = pytest.mark.gpu
fla = pytest.importorskip("fla.ops.gated_delta_rule")

CU = torch.tensor([0, 300, 700, 1024, 1100, 1101, 2048])  # two rows of 1024: documents, one token, row padding


# K = V = 128: the released head dims (fla #640: Triton miscompiles key tiles of 64 on Hopper)
def _rule_inputs(dtype, B=2, S=1024, H=4, HV=8, K=128, V=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = dict(q=mk(B, S, H, K).to(dtype), k=mk(B, S, H, K).to(dtype), v=mk(B, S, HV, V).to(dtype),
             g=-torch.rand(B, S, HV, generator=g, device="cuda") * 0.5,  # fp32 log decays, as the model passes them
             beta=torch.rand(B, S, HV, generator=g, device="cuda").to(dtype))
    return {k: t.requires_grad_() for k, t in x.items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_fla_matches_reference_on_packed_rows(dtype, tol):
    meta = build_linear_meta({"input_ids": torch.zeros(2, 1024, dtype=torch.long), "cu_seqlens": CU}, "cuda")
    from fla.ops.utils.index import prepare_chunk_indices

    assert torch.equal(prepare_chunk_indices(meta.cu_seqlens, 64), meta.chunk_indices)
    outs, grads = [], []
    for impl in ("fla", "torch"):
        x = _rule_inputs(dtype)
        o = gated_delta_rule(**x, meta=meta, impl=impl)
        o.float().pow(2).sum().backward()
        outs.append(o.float())
        grads.append([x[k].grad.float() for k in ("q", "k", "v", "g", "beta")])

    def rel(a, b):  # RMS error relative to the reference's RMS (fla's own tests' measure)
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

    assert rel(outs[0], outs[1]) <= tol
    for name, a, b in zip("q k v g beta".split(), *grads):
        assert rel(a, b) <= tol, name
    ref = chunk_gated_delta_rule(**{k: v.detach() for k, v in _rule_inputs(dtype).items()}, doc_pos=meta.doc_pos)[0]
    assert rel(ref.float(), outs[1]) <= 1e-6  # the dispatch's reference path is chunk_gated_delta_rule itself


def _cfg(moe: bool, impl: str, kernels):
    base = (MOE_FLAVORS if moe else FLAVORS)["debug"]
    text = dataclasses.replace(base.text, vocab_size=4096, linear_attn_backend=impl, attn_backend="flex")
    return dataclasses.replace(base, text=text, vision_start_token_id=4000, image_token_id=4001,
                               video_token_id=4002, vision_end_token_id=4003, attn_backend="flex", kernels=kernels)


def _batch(cfg):
    g = torch.Generator().manual_seed(0)
    samples = [make_sample(cfg, [("text", 30), ("image", (16, 24)), ("text", 50)], g),
               make_sample(cfg, [("text", 10), ("video", (2, 8, 8)), ("text", 20)], g),
               make_sample(cfg, [("image", (8, 8)), ("text", 140)], g), make_sample(cfg, [("text", 100)], g)]
    return pack(samples, cfg, seq_len=512, rows=2)


def _run(model, batch, dtype, sync_check: bool):
    dev = torch.device("cuda")
    b = prepare_batch(model.cfg, batch, dev)
    attn = build_attn_meta(b, model.cfg.attn_backend, dev)
    b = {k: (v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) and k not in ("cu_seqlens", "max_seqlen")
             else v) for k, v in b.items()}
    keys = ("vision_meta", "visual_index", "linear_meta")
    vis = {k: b[k].to(dtype) for k in ("pixel_values", "pixel_values_videos") if k in b}
    torch.cuda.synchronize()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(b["input_ids"], position_ids=b["position_ids"], attn=attn, labels=b["labels"], **vis,
                    **{k: b[k] for k in keys if k in b})
        (out.loss_sum / 100.0 + out.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return out.loss_sum.detach().float().cpu()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("impl,kernels", [("fla", "all"), ("fla", False), ("torch", False)])
def test_no_host_sync_bf16(moe, impl, kernels):
    cfg = _cfg(moe, impl, kernels)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5Model(cfg)
    model.init_weights(buffer_device="cuda")
    ref = _run(model, _batch(cfg), torch.float32, sync_check=False)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    _run(model, _batch(cfg), torch.bfloat16, sync_check=False)  # warm-up: Triton autotuning and compiles synchronize
    model.zero_grad(set_to_none=True)
    # only the GPU path (fla) is held to no syncs; the PyTorch reference is the CPU path
    loss = _run(model, _batch(cfg), torch.bfloat16, sync_check=impl == "fla")
    assert torch.isfinite(loss) and abs(loss - ref) <= 0.02 * abs(ref)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
