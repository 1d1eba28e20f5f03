"""Qwen3 / Qwen3-MoE vs transformers on tiny random configs (CPU, fp32): logits, loss, grads, aux loss,
packed documents on every CPU attention backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _qwen3_helpers import (
    VOCAB, assert_grads_close, grads_by_titan_name, hf_model, packed_batch, titan_twin,
)
from titan_mm.nn.attention import build_attn_meta

pytest.importorskip("transformers")


@pytest.mark.parametrize("moe,tie", [(False, False), (False, True), (True, False)])
def test_plain_batch_logits_and_grads(moe, tie):
    hf = hf_model(moe=moe, tie=tie)
    tt = titan_twin(hf, loss_chunk_size=7)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))

    out_hf = hf(input_ids=ids, output_router_logits=moe)
    out = tt(ids)
    assert (out.logits - out_hf.logits).abs().max().item() <= 1e-5
    if moe:
        hf_aux = out_hf.aux_loss
        assert torch.allclose(out.aux_loss, hf.config.router_aux_loss_coef * hf_aux, rtol=1e-6, atol=1e-8)
    else:
        assert out.aux_loss.item() == 0.0

    # loss path: shifted labels with some ignored, chunked CE vs full-logit CE on HF logits
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    hf.zero_grad()
    tt.zero_grad()
    ref = F.cross_entropy(out_hf.logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=-100,
                          reduction="sum")
    if moe:
        ref = ref + hf.config.router_aux_loss_coef * out_hf.aux_loss
    ref.backward()
    o2 = tt(ids, labels=labels)
    assert o2.logits is None
    assert abs(o2.loss_sum.item() - (ref - (hf.config.router_aux_loss_coef * out_hf.aux_loss if moe else 0)).item()) < 1e-4
    (o2.loss_sum + o2.aux_loss).backward()
    assert_grads_close(*grads_by_titan_name(tt, hf))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("moe", [False, True])
def test_packed_documents_equal_documents_alone(backend, moe):
    hf = hf_model(moe=moe, seed=1)
    tt = titan_twin(hf, attn_backend=backend)
    lens = [5, 7, 4]
    batch = packed_batch(lens, S=20)
    meta = build_attn_meta(batch, backend, "cpu")
    with torch.no_grad():  # forward-only: the real flex kernel runs on CPU
        out_ng = tt(batch["input_ids"], position_ids=batch["position_ids"], attn=meta)
    # with grad (flex on CPU falls back to SDPA with the same mask: torch has no CPU flex backward)
    out = tt(batch["input_ids"], position_ids=batch["position_ids"], attn=meta)
    assert (out.logits - out_ng.logits).abs().max().item() <= 1e-5
    R = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(5))
    loss_t = 0.0
    loss_h = 0.0
    o = 0
    for L in lens:
        ids_d = batch["input_ids"][:, o : o + L]
        ref = hf(input_ids=ids_d).logits
        assert (out_ng.logits[:, o : o + L] - ref).abs().max().item() <= 1e-5
        assert (out.logits[:, o : o + L] - ref).abs().max().item() <= 1e-5
        loss_t = loss_t + (out.logits[:, o : o + L] * R[:, o : o + L]).sum()
        loss_h = loss_h + (ref * R[:, o : o + L]).sum()
        o += L
    loss_t.backward()
    loss_h.backward()
    assert_grads_close(*grads_by_titan_name(tt, hf))


def test_sliding_window_dense_matches_hf():
    # layers >= max_window_layers use a window of 4 tokens (HF semantics); sdpa and flex
    hf = hf_model(moe=False, seed=2, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    ref = hf(input_ids=ids).logits
    for backend in ("sdpa", "flex"):
        tt = titan_twin(hf, attn_backend=backend)
        assert tt.cfg.layer_window(0) is None and tt.cfg.layer_window(1) == 4
        meta = build_attn_meta({"input_ids": ids}, backend, "cpu", sliding_window=tt.cfg.attn_sliding_window)
        with torch.no_grad():
            out = tt(ids, attn=meta)
        assert (out.logits - ref).abs().max().item() <= 1e-5, backend


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ],
)
def test_rope_scaling_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from titan_mm.nn.rope import rope_inv_freq

    from _qwen3_helpers import hf_config

    cfg = hf_config(rope_parameters=rope)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    ours, scale = rope_inv_freq(16, 10000.0, rope, cfg.max_position_embeddings)
    torch.testing.assert_close(ours, ref_inv, rtol=1e-6, atol=0)
    assert abs(scale - ref_scale) < 1e-7
    # and the whole model agrees (positions beyond the original context for yarn)
    hf = hf_model(seed=4, rope_parameters=rope)
    tt = titan_twin(hf)
    ids = torch.randint(0, VOCAB, (1, 12))
    pos = torch.arange(100, 112)[None]
    assert (tt(ids, position_ids=pos).logits - hf(input_ids=ids, position_ids=pos).logits).abs().max() <= 1e-5
