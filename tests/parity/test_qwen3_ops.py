"""Common ops used by Qwen3: chunked CE (+ z-loss), MoE experts and aux loss vs HF, kernels toggle, meta build."""

from __future__ import annotations

import pytest
import torch

from _qwen3_helpers import VOCAB, hf_model, packed_batch, titan_twin
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.loss import IGNORE_INDEX, chunked_cross_entropy
from titan_mm.nn.moe import GroupedExperts, aux_stats, load_balancing_loss, route


def reference_cross_entropy(h_ND, w_VD, labels_N, z_loss_weight: float = 0.0) -> torch.Tensor:
    """The full-logits definition the chunked CE must equal."""
    logits = (h_ND @ w_VD.t()).float()
    loss = torch.nn.functional.cross_entropy(logits, labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
    if z_loss_weight:
        valid = (labels_N != IGNORE_INDEX).float()
        loss = loss + z_loss_weight * (torch.logsumexp(logits, -1).square() * valid).sum()
    return loss


@pytest.mark.parametrize("z", [0.0, 1e-3])
@pytest.mark.parametrize("chunk", [5, 64])
def test_chunked_ce_matches_full_logits(z, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    y[::4] = -100
    loss = chunked_cross_entropy(h, w, y, chunk_size=chunk, z_loss_weight=z)
    gh, gw = torch.autograd.grad(3.0 * loss, (h, w))
    ref = reference_cross_entropy(h, w, y, z_loss_weight=z)
    rh, rw = torch.autograd.grad(3.0 * ref, (h, w))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-5)
    # all ignored -> exactly 0, zero grads
    z_loss = chunked_cross_entropy(h, w, torch.full_like(y, -100), chunk_size=chunk)
    assert z_loss.item() == 0.0


def test_grouped_experts_match_naive_loop():
    torch.manual_seed(0)
    E, D, F, N, K = 6, 8, 12, 20, 2
    ex = GroupedExperts(D, F, E)
    ex.reset_parameters(0.2)
    x = torch.randn(N, D)
    router = torch.randn(E, D)
    _, w, i = route(x, router, K, True)
    y = ex(x, w, i)
    ref = torch.zeros_like(x)
    for n in range(N):
        for k in range(K):
            e = i[n, k]
            a = torch.nn.functional.silu(x[n] @ ex.w1[e].T) * (x[n] @ ex.w3[e].T)
            ref[n] += w[n, k] * (a @ ex.w2[e].T)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_aux_loss_with_padding_matches_hf_attention_mask():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    E, K, N = 8, 2, 12
    logits = [torch.randn(N, E) for _ in range(3)]
    mask = torch.ones(1, N, dtype=torch.long)
    mask[0, -4:] = 0
    ref = load_balancing_loss_func(tuple(logits), E, K, mask)
    stats = sum(aux_stats(torch.softmax(lg, -1), torch.topk(torch.softmax(lg, -1), K)[1], mask[0].bool())
                for lg in logits)
    ours = load_balancing_loss(stats, mask.sum().float() * 3, E)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_model_aux_loss_excludes_padding_like_hf():
    # one document + padding: titan (padding excluded through doc_ids) == HF with attention_mask
    hf = hf_model(moe=True, seed=2)
    tt = titan_twin(hf)
    one = packed_batch([11], S=16)
    out = tt(one["input_ids"], position_ids=one["position_ids"], attn=build_attn_meta(one, "sdpa", "cpu"))
    am = (one["doc_ids"] >= 0).long()
    ref = hf(input_ids=one["input_ids"], attention_mask=am, output_router_logits=True)
    torch.testing.assert_close(out.aux_loss, hf.config.router_aux_loss_coef * ref.aux_loss, rtol=1e-5, atol=1e-8)


def test_kernels_toggle_matches_reference_on_cpu():
    hf = hf_model(moe=False, seed=3)
    ref = titan_twin(hf)
    tk = titan_twin(hf, kernels=True)
    ids = torch.randint(0, VOCAB, (2, 12))
    labels = ids.roll(-1, 1)
    a, b = ref(ids, labels=labels), tk(ids, labels=labels)
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-5, atol=1e-4)


def test_meta_build_then_init_weights():
    from titan_mm.registry import get_model_spec

    spec = get_model_spec("qwen3")
    for flavor in ("debug", "debug_moe"):
        cfg = spec.flavor(flavor).replace(vocab_size=256)
        with torch.device("meta"):
            m = spec.build(cfg)
        assert all(p.is_meta for p in m.parameters())
        m.to_empty(device="cpu")
        m.init_weights(buffer_device="cpu")
        ids = torch.randint(0, 256, (1, 8))
        out = m(ids, labels=ids)
        assert torch.isfinite(out.loss_sum) and out.logits is None
        assert (m.rope_inv_freq[0] == 1.0).item()
    assert spec.flavor("debug").vocab_size == 151936 and spec.flavor("debug_moe").is_moe


def test_backend_errors_and_registry_lookups(tmp_path):
    from titan_mm.registry import SpecError, get_model_spec, list_models, spec_for_hf_dir

    batch = packed_batch([3, 4], S=8)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        build_attn_meta(batch, "nope", "cpu")
    with pytest.raises(RuntimeError, match="varlen.*(CUDA|lacks)"):
        build_attn_meta(batch, "varlen", "cpu")
    with pytest.raises(SpecError, match="unknown model 'llama9'"):
        get_model_spec("llama9")
    with pytest.raises(SpecError, match="is not a flavor of 'qwen3'"):
        get_model_spec("qwen3").flavor("3B")
    assert {"qwen3", "qwen3_moe"} <= set(list_models())
    assert get_model_spec("qwen3_moe").name == "qwen3_moe" and get_model_spec("qwen3_moe").build is get_model_spec("qwen3").build
    hf_model(moe=True).save_pretrained(tmp_path)
    assert "qwen3_moe" in spec_for_hf_dir(str(tmp_path)).hf_model_types


def _fake_varlen(query, key, value, cu_q, cu_k, max_q, max_k, causal, left, gqa):
    """Reference for flash varlen semantics on CPU: per-segment causal (optionally windowed) attention."""
    out = torch.empty_like(query)
    cu = cu_q.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        if gqa:
            k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for t in (k, v))
        assert k.shape[0] == q.shape[0], "GQA heads reached varlen without enable_gqa"
        i = torch.arange(b - a)
        m = i[:, None] >= i[None, :] if causal else torch.ones(b - a, b - a, dtype=torch.bool)
        if left >= 0:
            m = m & (i[:, None] - i[None, :] <= left)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m).transpose(0, 1)
    return out


def _fake_varlen_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, -1, False)


def _fake_varlen_new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False):
    return _fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size[1] == 0,
                        window_size[0], enable_gqa)


@pytest.mark.parametrize("fake", [_fake_varlen_old, _fake_varlen_new], ids=["torch2.11-style", "torch2.13-style"])
def test_varlen_wiring_with_a_cpu_stand_in(monkeypatch, fake):
    """The varlen path (flatten B*S, cu_seqlens, GQA, causal / window kwargs) against SDPA, using a CPU
    stand-in with each torch version's varlen_attn signature (the real kernel is CUDA-only)."""
    import inspect

    from titan_mm.nn import attention as A

    monkeypatch.setattr(A, "_VARLEN", (fake, frozenset(inspect.signature(fake).parameters)))
    window = 4 if fake is _fake_varlen_new else None
    kw = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1) if window else {}
    hf = hf_model(seed=6, **kw)
    ref_model, tt = titan_twin(hf, attn_backend="sdpa"), titan_twin(hf, attn_backend="varlen")
    batch = packed_batch([5, 7, 4], S=20)
    ref = ref_model(batch["input_ids"], batch["position_ids"],
                    build_attn_meta(batch, "sdpa", "cpu", sliding_window=window)).logits
    meta = A.AttnMeta(backend="varlen", packed=True, sliding_window=window, cu_seqlens=batch["cu_seqlens"],
                      max_seqlen=int(batch["max_seqlen"]), valid_BS=batch["doc_ids"] >= 0)
    out = tt(batch["input_ids"], batch["position_ids"], meta).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
