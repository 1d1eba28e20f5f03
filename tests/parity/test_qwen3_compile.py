"""Qwen3 blocks trace with torch.compile(fullgraph=True) (no graph breaks) on CPU, dense and MoE, sdpa and
flex, and the compiled model equals the eager one. The MoE grouped-GEMM path (the CUDA path) is forced on
CPU here, so its sync-free routing is traced and checked against transformers too."""

from __future__ import annotations

import pytest
import torch

from _qwen3_helpers import assert_grads_close, grads_by_titan_name, hf_model, packed_batch, titan_twin
from titan_mm.nn import moe as moe_mod
from titan_mm.nn.attention import build_attn_meta

needs_cpu_grouped_mm = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm"
)


@needs_cpu_grouped_mm
def test_grouped_mm_path_matches_hf(monkeypatch):
    try:
        torch._grouped_mm(torch.randn(2, 16), torch.randn(1, 16, 16), offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        pytest.skip("torch._grouped_mm has no CPU kernel in this torch")
    monkeypatch.setattr(moe_mod, "GROUPED_MM", True)
    hf = hf_model(moe=True, seed=11)
    tt = titan_twin(hf)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out, ref = tt(ids), hf(input_ids=ids, output_router_logits=True)
    assert (out.logits - ref.logits).abs().max().item() <= 1e-5
    R = torch.randn(out.logits.shape)
    (out.logits * R).sum().backward()
    (ref.logits * R).sum().backward()
    assert_grads_close(*grads_by_titan_name(tt, hf))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("moe", [False, True])
def test_blocks_compile_fullgraph(monkeypatch, backend, moe):
    if moe:
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip("no torch._grouped_mm")
        monkeypatch.setattr(moe_mod, "GROUPED_MM", True)  # the CPU loop path reads group sizes on the host
    torch._dynamo.reset()
    hf = hf_model(moe=moe, seed=12)
    eager = titan_twin(hf, attn_backend=backend)
    comp = titan_twin(hf, attn_backend=backend)
    tol = dict(rtol=1e-5, atol=1e-5)
    if moe:  # torch._grouped_mm traces in bf16 only (its meta function checks the dtype), as on the GPU
        tol = dict(rtol=2e-2, atol=2e-2)
        for m in (eager, comp):
            m.to(torch.bfloat16)
            m.init_buffers()
    for block in comp.layers.values():
        block.compile(fullgraph=True, backend="aot_eager")
    batch = packed_batch([5, 7, 4], S=20)
    meta = build_attn_meta(batch, backend, "cpu")
    args = (batch["input_ids"], batch["position_ids"], meta)
    labels = batch["input_ids"].roll(-1, 1)
    with torch.no_grad():
        torch.testing.assert_close(comp(*args).logits, eager(*args).logits, **tol)
    a = comp(*args, labels=labels)
    b = eager(*args, labels=labels)
    (a.loss_sum + a.aux_loss).backward()
    (b.loss_sum + b.aux_loss).backward()
    torch.testing.assert_close(a.loss_sum, b.loss_sum, **tol)
    if not moe:
        for (n, p), (_, q) in zip(comp.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
    else:
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in comp.parameters())
    # a new batch (other document lengths -> new mask) reuses the compiled graphs: no recompiles per step
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    batch2 = packed_batch([2, 9, 8], S=20, seed=4)
    comp(batch2["input_ids"], batch2["position_ids"], build_attn_meta(batch2, backend, "cpu"), labels=labels)
    assert counters["stats"]["unique_graphs"] == graphs
