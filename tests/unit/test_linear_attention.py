"""The Gated DeltaNet reference (titan_mm/nn/linear_attention.py), in float64: the chunked rule equals the
token-by-token recurrence (outputs, final state and gradients; grouped value heads; rows that are not a multiple of
the chunk), the state restarts at every document of a packed row (equal to running each document alone), the causal
conv reads no earlier document, and the host-built documents agree whatever the batch gives (cu_seqlens or
doc_ids)."""

import pytest
import torch
import torch.nn.functional as F

from titan_mm.nn.linear_attention import (build_linear_meta, causal_conv1d, chunk_gated_delta_rule,
                                                     gated_delta_rule, recurrent_gated_delta_rule, segment_starts)

D64 = torch.float64


def _inputs(B=2, S=150, H=2, HV=4, K=8, V=6, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = dict(q=torch.randn(B, S, H, K, generator=g, dtype=D64), k=torch.randn(B, S, H, K, generator=g, dtype=D64),
             v=torch.randn(B, S, HV, V, generator=g, dtype=D64),
             g=-2 * torch.rand(B, S, HV, generator=g, dtype=D64), beta=torch.rand(B, S, HV, generator=g, dtype=D64))
    return {k: v.requires_grad_(grad) for k, v in t.items()}


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrence(chunk):
    x = _inputs()
    s0 = torch.randn(2, 4, 8, 6, dtype=D64)
    o1, s1 = recurrent_gated_delta_rule(**x, initial_state=s0, output_final_state=True)
    o2, s2 = chunk_gated_delta_rule(**x, initial_state=s0, output_final_state=True, chunk=chunk)
    assert (o1 - o2).abs().max() < 1e-12 and (s1 - s2).abs().max() < 1e-12


def test_chunked_gradients_equal_recurrence():
    grads = []
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        x = _inputs(S=40, grad=True)
        o, _ = fn(**x) if fn is recurrent_gated_delta_rule else fn(**x, chunk=16)
        (o * torch.linspace(-1, 1, o.numel(), dtype=D64).view_as(o)).sum().backward()
        grads.append([x[k].grad for k in ("q", "k", "v", "g", "beta")])
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 1e-10


CU = torch.tensor([0, 10, 80, 150, 170, 171, 300])  # two rows of 150: documents, a 1-token one, row padding


def test_state_restarts_at_every_document():
    """Packed rows (documents crossing chunk boundaries and a chunk starting mid-document): the chunked rule, the
    recurrence and each document run alone agree."""
    x = _inputs()
    meta = build_linear_meta({"input_ids": torch.zeros(2, 150, dtype=torch.long), "cu_seqlens": CU}, "cpu")
    o1, _ = recurrent_gated_delta_rule(**x, doc_pos=meta.doc_pos)
    o2, _ = chunk_gated_delta_rule(**x, doc_pos=meta.doc_pos, chunk=16)
    o3 = gated_delta_rule(**x, meta=meta, impl="torch")
    assert (o1 - o2).abs().max() < 1e-12 and torch.equal(o3, chunk_gated_delta_rule(**x, doc_pos=meta.doc_pos)[0])
    flat = {k: v.reshape(300, *v.shape[2:]) for k, v in x.items()}
    for a, b in zip(CU[:-1].tolist(), CU[1:].tolist()):
        alone, _ = recurrent_gated_delta_rule(**{k: v[None, a:b] for k, v in flat.items()})
        assert (alone[0] - o2.reshape(300, 4, 6)[a:b]).abs().max() < 1e-12, (a, b)
    # without the documents the rows run as one sequence each: a different result
    assert (chunk_gated_delta_rule(**x, chunk=16)[0] - o2).abs().max() > 1e-3


def test_conv_is_causal_and_stays_in_documents():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 150, 6, generator=g, dtype=D64)
    w = torch.randn(6, 4, generator=g, dtype=D64)
    ref = F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=6)[..., :150].transpose(1, 2)
    assert (causal_conv1d(x, w) - ref).abs().max() < 1e-12
    meta = build_linear_meta({"input_ids": torch.zeros(2, 150, dtype=torch.long), "cu_seqlens": CU}, "cpu")
    y = causal_conv1d(x, w, meta.doc_pos).reshape(300, 6)
    xf = x.reshape(300, 6)
    for a, b in zip(CU[:-1].tolist(), CU[1:].tolist()):
        alone = F.conv1d(xf[a:b].T[None], w[:, None], padding=3, groups=6)[0, :, : b - a].T
        assert (y[a:b] - alone).abs().max() < 1e-12


def test_documents_from_cu_seqlens_or_doc_ids():
    ids = torch.zeros(2, 150, dtype=torch.long)
    doc = torch.full((2, 150), -1, dtype=torch.int32)
    for d, (a, b) in enumerate(zip(CU[:-1].tolist(), CU[1:].tolist())):
        if b - a and d != 2 and d != 5:  # docs 2 and 5 are each row's padding (doc_id -1)
            doc.view(-1)[a:b] = d
    m1 = build_linear_meta({"input_ids": ids, "cu_seqlens": CU.to(torch.int32)}, "cpu")
    m2 = build_linear_meta({"input_ids": ids, "doc_ids": doc}, "cpu")
    for a, b in zip(m1, m2):
        assert torch.equal(a, b)
    assert m1.doc_pos[0, :12].tolist() == list(range(10)) + [0, 1]
    # fla's chunk table: (segment, chunk within it) per 64-token chunk
    assert m1.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [4, 0], [5, 0], [5, 1], [5, 2]]
    assert build_linear_meta({"input_ids": ids}, "cpu") is None
    with pytest.raises(ValueError, match="crosses a row"):
        segment_starts({"input_ids": ids, "cu_seqlens": torch.tensor([0, 100, 300])})
    with pytest.raises(ValueError, match="rise from 0 to B\\*S = 300"):
        segment_starts({"input_ids": ids, "cu_seqlens": torch.tensor([0, 150, 290])})


def test_chunk_table_matches_fla():
    """Where fla-core imports (the GPU machine), its own chunk table equals ours."""
    index = pytest.importorskip("fla.ops.utils.index")
    m = build_linear_meta({"input_ids": torch.zeros(2, 150, dtype=torch.long), "cu_seqlens": CU}, "cpu")
    assert torch.equal(index.prepare_chunk_indices(m.cu_seqlens, 64), m.chunk_indices)
