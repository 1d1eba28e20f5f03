"""The bagel family on CUDA: fp32 hidden states, loss sums and gradients equal the transformers-built reference of
tests/unit/test_bagel.py on the same card (sdpa, and flex's BlockMask of the "segments" kind), also with the fused
linear cross-entropy; and a bf16 forward + backward of packed rows (the fused CE) runs with no host sync (the MoT
routing by host-built indices, the ViT, the latents)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.unit.test_bagel import (CFG, SCHEMA, SEQ, _objective, _ours, _pair, _rows, assert_matches, compile_units,
                                   ref_mask)
from titan_mm.data.packing import collate_rows
from titan_mm.models.bagel.spec import prepare_batch
from titan_mm.nn.attention import build_attn_meta
from titan_mm.train.step import model_inputs, to_device

pytestmark = pytest.mark.gpu


def _batch(n_rows: int = 2):
    rows = _rows(n_rows)
    return rows, _objective().prepare([collate_rows(rows, SEQ, 0, 1, multiple=1, schema=SCHEMA)], 0)[0]


@pytest.mark.parametrize("backend,compiled", [("sdpa", False), ("flex", False), ("flex", True)])
def test_bagel_matches_the_reference_on_cuda(backend, compiled):
    """fp32; ``compiled``: the plan's compile units (MoT layers, the ViT) through inductor, fullgraph."""
    model, ref, pp = _pair()
    model, ref = model.cuda(), ref.cuda()
    if compiled:
        compile_units(model, fullgraph=True)
    rows, batch = _batch()
    obj = _objective()
    want = ref({k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
               ref_mask(rows, SEQ).cuda())
    assert_matches(_ours(model, batch, obj, backend, "cuda"), want, model, pp)  # TF32 is off by default


def test_fused_cross_entropy_matches_the_reference_on_cuda():
    """``kernels`` with linear_cross_entropy (the trainer's GPU default): the LM loss runs the fused Triton kernel
    (fp32 here) and the hidden states, both loss sums and every gradient still equal the reference's."""
    model, ref, pp = _pair(cfg=dataclasses.replace(CFG, kernels="linear_cross_entropy"))
    assert model.fused_ce
    model, ref = model.cuda(), ref.cuda()
    rows, batch = _batch()
    want = ref({k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
               ref_mask(rows, SEQ).cuda())
    assert_matches(_ours(model, batch, _objective(), "sdpa", "cuda"), want, model, pp)


def test_bagel_bf16_step_has_no_host_sync():
    """Forward and backward under torch.cuda.set_sync_debug_mode("error"): the host work (prepare_batch's indices,
    the segments BlockMask, the copy) comes before, as in the train step; the tables stay fp32."""
    model = _pair(cfg=dataclasses.replace(CFG, kernels="linear_cross_entropy"))[0].cuda().to(torch.bfloat16)
    model.init_buffers("cuda")
    _, batch = _batch(4)
    obj = _objective()
    pb = prepare_batch(dataclasses.replace(CFG, attn_backend="flex"), batch, "cuda")
    attn = build_attn_meta(pb, "flex", "cuda", kind=obj.mask_kind)
    b = to_device(pb, torch.device("cuda"), obj.host_keys)
    for check in (False, True):  # the first compiles flex's kernels
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(b["input_ids"], position_ids=b["position_ids"], attn=attn, loss=obj.bind(b),
                        **model_inputs(b, obj))
            loss = out.terms["ce"] / 100 + out.terms["mse"] / 1000
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item() and model.llm2vae.weight.grad.abs().sum().item() > 0
