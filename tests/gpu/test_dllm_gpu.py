"""Diffusion objectives on CUDA: on packed rows of odd-length documents over several flex tiles, the diffusion loss
and its gradients are the same for every backend that runs the objective's mask kind (sdpa's dense mask, flex's
BlockMask, varlen for the bidirectional kinds, in bf16 since its flash kernels take half types only) and for the
weighted Triton linear-CE against the PyTorch chunked CE;
the forward and backward make no host sync (titan_mm/objectives/diffusion.py corrupts on the host, before the
forward)."""

from __future__ import annotations

import pytest
import torch

from titan_mm.nn.attention import BACKEND_KINDS, build_attn_meta
from titan_mm.registry import resolve_model
from titan_mm.objectives import DiffusionLM as Objective
from titan_mm.train.synthetic import SyntheticLoader

pytestmark = pytest.mark.gpu
V = 1024


def _model(backend: str, kernels: bool, sd=None):
    spec, cfg = resolve_model("qwen3", "debug", overrides={"vocab_size": V, "num_hidden_layers": 2},
                              attn_backend=backend, kernels=kernels)
    torch.manual_seed(0)
    model = spec.build(cfg)
    model.init_weights()
    if sd is not None:
        model.load_state_dict(sd)
    return model.cuda()


def _on_device(mb, obj, backend):
    """The batch and its attention metadata on the GPU, as the trainer moves them before the forward (the copies
    from pageable host memory synchronize, so they stay outside the checked region)."""
    meta = build_attn_meta(mb, backend, "cuda", kind=obj.mask_kind, block_size=obj.block_size)
    b = {k: mb[k].cuda() for k in ("input_ids", "labels", "loss_weights", "position_ids")}
    torch.cuda.synchronize()
    return b, meta


def _loss_and_grad(model, b, meta, obj):
    model.zero_grad(set_to_none=True)
    out = model(b["input_ids"], position_ids=b["position_ids"], attn=meta, loss=obj.bind(b))
    out.terms["ce"].backward()
    return out.terms["ce"].detach(), model.tok_embeddings.weight.grad.detach().clone()


@pytest.mark.parametrize("kind", ["masked_diffusion", "shifted_diffusion", "block_diffusion"])
def test_diffusion_loss_is_the_same_on_every_backend_without_host_sync(kind):
    obj = Objective(kind=kind, mask_id=V - 1, block_size=32 if kind == "block_diffusion" else None, seed=3)
    mb = obj.prepare([SyntheticLoader(vocab_size=V - 1, seq_len=640, micro_batch_size=2, seed=0).batch(0)], 0)[0]
    assert (mb["labels"] != -100).sum() > 100
    sd = _model("sdpa", False).cpu().state_dict()
    ref_loss, ref_grad = _loss_and_grad(_model("sdpa", False, sd), *_on_device(mb, obj, "sdpa"), obj)
    for backend in ("sdpa", "flex", "varlen"):
        if obj.mask_kind not in BACKEND_KINDS[backend]:
            continue
        half = backend == "varlen"  # its flash kernels take half types only: bf16, against the fp32 reference
        for kernels in (False, True):
            model = _model(backend, kernels, sd).to(torch.bfloat16 if half else torch.float32)
            for check in (False, True):  # the first call compiles (flex) and tunes; the second must not sync
                b, meta = _on_device(mb, obj, backend)
                torch.cuda.set_sync_debug_mode("error" if check else 0)
                try:
                    loss, grad = _loss_and_grad(model, b, meta, obj)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            if half:
                assert abs(float(loss) - float(ref_loss)) <= 1e-2 * abs(float(ref_loss)), (backend, kernels)
                assert float((grad.float() - ref_grad).norm()) <= 5e-2 * float(ref_grad.norm()), (backend, kernels)
                continue
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-3, msg=f"{backend} kernels={kernels} loss")
            torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=1e-5, msg=f"{backend} kernels={kernels} grad")
