"""Objectives on CUDA: a combined objective (cross-entropy on tokens + flow matching's velocity MSE on latents in one
packed row, titan_mm/objectives) runs its forward and backward without a host sync (prepare and the counts are the
host's), and its loss terms and gradients match the CPU run's."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_objectives import TextAndLatents, mixed_batch
from titan_mm.objectives import CausalLM, Combined, FlowMatching
from titan_mm.train.step import model_inputs, to_device

pytestmark = pytest.mark.gpu


def _terms_and_grads(model, b: dict, obj):
    model.zero_grad(set_to_none=True)
    out = model(b["input_ids"], loss=obj.bind(b), **model_inputs(b, obj))
    loss = out.terms["ce"] / 7.0 + out.terms["mse"] / 5.0
    loss.backward()
    return torch.stack([out.terms[t].detach() for t in obj.terms]), [p.grad.clone() for p in model.parameters()]


def test_combined_objective_is_sync_free_and_matches_cpu():
    torch.manual_seed(0)
    obj = Combined((CausalLM(), FlowMatching(sampler="shifted", shift=3.0, seed=1)))
    mb = obj.prepare([mixed_batch(1)], 0)[0]
    ref = _terms_and_grads(TextAndLatents().double(), mb, obj)
    torch.manual_seed(0)
    model = TextAndLatents().double().cuda()
    b = to_device(mb, torch.device("cuda"), obj.host_keys)  # as the step moves it
    torch.cuda.synchronize()
    for check in (False, True):  # the first call warms up cuBLAS; the second must not sync
        torch.cuda.set_sync_debug_mode("error" if check else 0)
        try:
            terms, grads = _terms_and_grads(model, b, obj)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # float64 on both devices: only the order of the sums differs
    torch.testing.assert_close(terms.cpu(), ref[0], rtol=1e-12, atol=0)
    for g, r in zip(grads, ref[1]):
        torch.testing.assert_close(g.cpu(), r, rtol=1e-10, atol=1e-14)
