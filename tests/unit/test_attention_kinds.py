"""Attention mask kinds x backends: every pair equals a dense reference (a boolean mask written out here, token by
token, and softmax attention written out here), forward and gradients, on packed rows with 2-3 documents and
padding and on unpacked rows; or it is refused with a ValueError naming the kind and the backend. Context
parallelism (ulysses / all-gather / ring, world 2 over gloo) runs every kind to the same reference."""

import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiproc"))
from _harness import run_multiproc  # noqa: E402

from titan_mm.nn import attention as A  # noqa: E402
from titan_mm.nn.attention import KINDS, AttnMeta, attention, build_attn_meta  # noqa: E402

B, S, H, G, K = 2, 16, 4, 2, 16  # K >= 16: flex kernels on CUDA need it
DOCS = ([5, 7], [3, 4, 6])  # per row; the rest of the row is padding (doc_id -1)
BLOCK = 3


# BAGEL's split lengths and types per document (kind "segments"); the padding of a row is one causal segment
SPLITS = {"packed": ([[(2, "causal"), (3, "noise")], [(2, "full"), (1, "causal"), (2, "noise"), (2, "causal")]],
                     [[(3, "noise")], [(1, "causal"), (3, "full")], [(2, "causal"), (2, "noise"), (2, "noise")]]),
          "unpacked": ([[(4, "causal"), (5, "noise"), (3, "full"), (4, "causal")]], [[(6, "full"), (10, "noise")]])}


def segment_keys(rows: str) -> dict[str, torch.Tensor]:
    """``seg_ids`` / ``seg_kinds`` of SPLITS[rows]: segments numbered along the row, kinds as SEGMENT_KINDS codes."""
    seg = torch.zeros(B, S, dtype=torch.int32)
    kinds = torch.zeros(B, S, dtype=torch.int8)
    for b, docs in enumerate(SPLITS[rows]):
        o = i = 0
        for n, t in [x for d in docs for x in d] + [(S - sum(n for d in docs for n, _ in d), "causal")]:
            seg[b, o:o + n], kinds[b, o:o + n] = i, A.SEGMENT_KINDS.index(t)
            o, i = o + n, i + 1
    return {"seg_ids": seg, "seg_kinds": kinds}


def packed_batch() -> dict[str, torch.Tensor]:
    """Two rows of documents + trailing padding, in the packer's format, with a prefix on every document and
    BAGEL segments."""
    doc = torch.full((B, S), -1, dtype=torch.int32)
    prefix = torch.zeros(B, S, dtype=torch.bool)
    segs = []
    for b, lens in enumerate(DOCS):
        o = 0
        for d, n in enumerate(lens):
            doc[b, o:o + n] = d
            prefix[b, o:o + (n + 1) // 2] = True
            o += n
        segs += list(lens) + [S - o]
    cu = torch.tensor([0] + torch.tensor(segs).cumsum(0).tolist(), dtype=torch.int32)
    prefix[1, -1] = True  # a prefix flag on padding must not leak out of the padding
    return {"input_ids": torch.zeros(B, S, dtype=torch.long), "doc_ids": doc, "prefix_mask": prefix,
            "cu_seqlens": cu, "max_seqlen": torch.tensor(max(segs)), **segment_keys("packed")}


def unpacked_batch() -> dict[str, torch.Tensor]:
    prefix = torch.zeros(B, S, dtype=torch.bool)
    prefix[0, :6] = True
    prefix[1, :1] = True
    return {"input_ids": torch.zeros(B, S, dtype=torch.long), "prefix_mask": prefix, **segment_keys("unpacked")}


def bagel_mask(splits) -> torch.Tensor:
    """[L, L] bool of one document as BAGEL's data/data_utils.py prepare_attention_mask_per_sample builds it from
    split lengths and types: a causal split sees itself causally, a full / noise split itself wholly, every split
    sees all earlier splits; then no token sees a noise split but the split itself."""
    L = sum(n for n, _ in splits)
    m = torch.zeros(L, L, dtype=torch.bool)
    c = 0
    for n, t in splits:
        m[c:c + n, c:c + n] = torch.ones(n, n, dtype=torch.bool).tril() if t == "causal" else True
        m[c:c + n, :c] = True
        c += n
    c = 0
    for n, t in splits:
        if t == "noise":
            m[:, c:c + n] = False
            m[c:c + n, c:c + n] = True
        c += n
    return m


def segments_reference(rows: str) -> torch.Tensor:
    """[B, S, S]: BAGEL's mask of each document on the diagonal, the padding causal, nothing across documents."""
    m = torch.zeros(B, S, S, dtype=torch.bool)
    for b, docs in enumerate(SPLITS[rows]):
        o = 0
        for d in docs:
            n = sum(x for x, _ in d)
            m[b, o:o + n, o:o + n] = bagel_mask(d)
            o += n
        m[b, o:, o:] = torch.ones(S - o, S - o, dtype=torch.bool).tril()
    return m


def reference_mask(batch, kind, window=None) -> torch.Tensor:
    """[B, S, S] bool from the definitions, one (query, key) pair at a time (kind "segments": BAGEL's own)."""
    if kind == "segments":  # never with a window (refused)
        return segments_reference("packed" if "doc_ids" in batch else "unpacked")
    doc = batch.get("doc_ids", torch.zeros(B, S, dtype=torch.int32)).tolist()
    pre = batch.get("prefix_mask", torch.zeros(B, S, dtype=torch.bool)).tolist()
    m = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        pos = [0] * S  # position within the document
        for t in range(1, S):
            pos[t] = pos[t - 1] + 1 if doc[b][t] == doc[b][t - 1] else 0
        for q in range(S):
            for k in range(S):
                if doc[b][q] != doc[b][k]:
                    continue
                ok = {"causal": k <= q, "bidirectional": True,
                      "block_causal": pos[k] // BLOCK <= pos[q] // BLOCK,
                      "prefix_lm": k <= q or (pre[b][q] and pre[b][k])}[kind]
                if window is not None:
                    ok = ok and q - k < window
                m[b, q, k] = ok
    return m


def reference_attention(q, k, v, mask_BSS):
    """softmax(q k^T / sqrt(K) where mask) v, query head h using kv head h // (H / G)."""
    kk, vv = (t.repeat_interleave(H // G, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask_BSS[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, n, K, generator=g, requires_grad=True) for n in (H, G, G)]


def weights():
    return torch.randn(B, S, H, K, generator=torch.Generator().manual_seed(9))


def run_and_grads(fn, q, k, v, w=None):
    """fn(q, k, v) and the gradients of sum(fn(q, k, v) * w)."""
    o = fn(q, k, v)
    w = weights() if w is None else w
    (o * w).sum().backward()
    out = (o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    for t in (q, k, v):
        t.grad = None
    return out


def assert_matches_reference(batch, meta, kind, window=None):
    q, k, v = qkv()
    ref = run_and_grads(lambda *t: reference_attention(*t, reference_mask(batch, kind, window)), q, k, v)
    got = run_and_grads(lambda *t: attention(*t, meta, window), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(a).all(), f"{name}: non-finite values (a fully masked row?)"
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{kind} {meta.backend} {name}: {m}")
    if meta.backend == "flex":  # no-grad forward: the eager flex kernel on the BlockMask itself (not the fallback)
        o = attention(q.detach(), k.detach(), v.detach(), meta, window)
        torch.testing.assert_close(o, ref[0], atol=1e-5, rtol=1e-5)


def kw(kind):
    return {"kind": kind, "block_size": BLOCK if kind == "block_causal" else None}


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", ["packed", "unpacked"])
def test_kind_matches_dense_reference(rows, kind, backend):
    batch = packed_batch() if rows == "packed" else unpacked_batch()
    meta = build_attn_meta(batch, backend, "cpu", **kw(kind))
    assert meta.kind == kind and meta.packed == (rows == "packed")
    assert_matches_reference(batch, meta, kind)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", ["packed", "unpacked"])
def test_dense_mask_equals_the_reference_element_by_element(rows, kind, backend):
    """Every kind is built as a segment description; its mask (the sdpa mask, and flex's mask_mod over the grid)
    is the written-out rule exactly, BAGEL's for "segments"."""
    batch = packed_batch() if rows == "packed" else unpacked_batch()
    meta = build_attn_meta(batch, backend, "cpu", dense_mask=True, **kw(kind))
    ref = reference_mask(batch, kind)
    if meta.sdpa_mask is None:  # causal whole rows: SDPA's own is_causal
        assert kind == "causal" and rows == "unpacked"
    else:
        assert torch.equal(meta.sdpa_mask[:, 0], ref)
    if meta.block_mask is not None:
        assert torch.equal(A._mask_dense(meta.block_mask.mask_mod, B, S, "cpu")[:, 0], ref)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_segments_packed_equal_each_document_alone(backend):
    """BAGEL segments on packed rows attend as each document does alone in its own row (float64)."""
    batch = packed_batch()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, S, n, K, generator=g, dtype=torch.float64) for n in (H, G, G))
    with torch.no_grad():
        packed = attention(q, k, v, build_attn_meta(batch, backend, "cpu", kind="segments"), None)
        for b, docs in enumerate(SPLITS["packed"]):
            o = 0
            for d in docs:
                n = sum(x for x, _ in d)
                kinds = torch.tensor([[A.SEGMENT_KINDS.index(t) for x, t in d for _ in range(x)]], dtype=torch.int8)
                seg = torch.tensor([[i for i, (x, _) in enumerate(d) for _ in range(x)]], dtype=torch.int32)
                meta = build_attn_meta({"seg_ids": seg, "seg_kinds": kinds}, backend, "cpu", kind="segments")
                alone = attention(*(t[b:b + 1, o:o + n] for t in (q, k, v)), meta, None)
                torch.testing.assert_close(packed[b:b + 1, o:o + n], alone, atol=1e-12, rtol=1e-12)
                o += n


def test_segments_need_their_batch_keys():
    batch = packed_batch()
    with pytest.raises(ValueError, match=r"kind 'segments' needs batch\['seg_ids'\] and batch\['seg_kinds'\]"):
        build_attn_meta({k: v for k, v in batch.items() if k != "seg_kinds"}, "sdpa", "cpu", kind="segments")
    with pytest.raises(ValueError, match=r"batch\['seg_ids'\] has shape \[2, 15\]"):
        build_attn_meta({**batch, "seg_ids": batch["seg_ids"][:, 1:]}, "sdpa", "cpu", kind="segments")
    with pytest.raises(ValueError, match=r"seg_kinds'\] holds codes outside 0 .. 2"):
        build_attn_meta({**batch, "seg_kinds": batch["seg_kinds"] + 3}, "flex", "cpu", kind="segments")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_causal_sliding_window_matches_reference(backend):
    batch = packed_batch()
    meta = build_attn_meta(batch, backend, "cpu", sliding_window=3)
    assert_matches_reference(batch, meta, "causal", window=3)
    assert_matches_reference(batch, meta, "causal")  # the full-attention layers of the same model


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_whole_document_rows_take_the_maskless_fused_path(kind, backend):
    batch = {"input_ids": torch.zeros(B, S, dtype=torch.long), "doc_ids": torch.zeros(B, S, dtype=torch.int32),
             "cu_seqlens": torch.tensor([0, S, 2 * S], dtype=torch.int32)}
    meta = build_attn_meta(batch, backend, "cpu", kind=kind)
    assert not meta.packed and meta.sdpa_mask is None and meta.block_mask is None
    assert_matches_reference(batch, meta, kind)


def _fake_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
    """CPU stand-in with torch 2.13's varlen_attn signature: per-segment attention, causal iff window_size[1] == 0."""
    out = torch.empty_like(query)
    cu = cu_q.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for t in (k, v))
        i = torch.arange(b - a)
        m = i[:, None] >= i[None, :] if window_size[1] == 0 else torch.ones(b - a, b - a, dtype=torch.bool)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m).transpose(0, 1)
    return out


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
def test_varlen_kinds_with_a_cpu_stand_in(monkeypatch, kind):
    """varlen's kernels are CUDA-only: the wiring (causal flag from the kind) against the reference, on CPU."""
    monkeypatch.setattr(A, "_VARLEN", (_fake_varlen, frozenset(inspect.signature(_fake_varlen).parameters)))
    batch = packed_batch()
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        build_attn_meta(batch, "varlen", "cpu", kind=kind)  # the kind is fine; the device is not
    meta = AttnMeta(backend="varlen", packed=True, kind=kind, cu_seqlens=batch["cu_seqlens"],
                    max_seqlen=int(batch["max_seqlen"]))
    assert_matches_reference(batch, meta, kind)


@pytest.mark.parametrize("kind", ["block_causal", "prefix_lm", "segments"])
@pytest.mark.parametrize("rows", ["packed", "unpacked"])
def test_varlen_refuses_kinds_it_cannot_do(rows, kind):
    batch = packed_batch() if rows == "packed" else unpacked_batch()
    with pytest.raises(ValueError, match=f"backend 'varlen' cannot do kind '{kind}'.*attn_backend='sdpa' or 'flex'"):
        build_attn_meta(batch, "varlen", "cpu", **kw(kind))


@pytest.mark.parametrize("kind", ["bidirectional", "block_causal", "prefix_lm", "segments"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_sliding_window_with_a_non_causal_kind_is_refused(backend, kind):
    with pytest.raises(ValueError, match=f"sliding window \\(4\\) combines only with kind 'causal', not '{kind}'"):
        build_attn_meta(packed_batch(), backend, "cpu", sliding_window=4, **kw(kind))


@pytest.mark.parametrize("args,match", [
    (dict(kind="diagonal"), "unknown attention kind 'diagonal'"),
    (dict(kind="block_causal"), "kind 'block_causal' needs block_size"),
    (dict(kind="block_causal", block_size=0), "kind 'block_causal' needs block_size"),
    (dict(kind="causal", block_size=4), "block_size=4 applies only to kind 'block_causal'"),
])
def test_bad_kind_arguments_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        build_attn_meta(packed_batch(), "sdpa", "cpu", **args)


def test_prefix_lm_needs_a_prefix_mask_of_the_batch_shape():
    batch = packed_batch()
    with pytest.raises(ValueError, match=r"needs batch\['prefix_mask'\]"):
        build_attn_meta({k: v for k, v in batch.items() if k != "prefix_mask"}, "sdpa", "cpu", kind="prefix_lm")
    with pytest.raises(ValueError, match=r"prefix_mask'\] has shape \[2, 15\]"):
        build_attn_meta({**batch, "prefix_mask": batch["prefix_mask"][:, 1:]}, "flex", "cpu", kind="prefix_lm")


def test_dense_mask_for_cp_covers_bidirectional_rows():
    """Ring / all-gather CP slice a dense mask; a whole-row bidirectional batch gets an all-true one, not causal."""
    meta = build_attn_meta(unpacked_batch(), "flex", "cpu", dense_mask=True, kind="bidirectional")
    assert meta.sdpa_mask is not None and bool(meta.sdpa_mask.all())


# ---- context parallelism: every kind in every mode equals the reference (world 2, gloo) ----

CP_CELLS = [(mode, backend, kind) for mode in ("ulysses", "allgather", "ring") for backend in ("sdpa", "flex")
            for kind in KINDS]


def _cp_worker(rank, world, cells):
    from titan_mm.parallel.cp import load_balanced_index, prepare_cp_batch
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.registry import SeqKey

    pd = ParallelDims(world_size=world, dp_shard=1, cp=world)
    idx = load_balanced_index(S, world, rank)
    out = []
    latents = torch.randn(B, S, 3)  # a declared sequence key with a trailing dim: cut on dim 1
    for mode, backend, kind in cells:
        q, k, v = qkv()
        local, meta = prepare_cp_batch({**packed_batch(), "latents": latents}, pd, backend, "cpu", mode=mode,
                                       seq_keys=(SeqKey("latents", ("C",)),), **kw(kind))
        for key in ("prefix_mask", "seg_ids", "seg_kinds"):
            assert torch.equal(local[key], packed_batch()[key][:, idx])
        assert torch.equal(local["latents"], latents[:, idx])
        out.append(run_and_grads(lambda q, k, v: attention(*(t[:, idx] for t in (q, k, v)), meta, None), q, k, v,
                                 weights()[:, idx]))
    return out


def test_cp_modes_run_every_kind():
    from titan_mm.parallel.cp import load_balanced_index

    world = 2
    got = run_multiproc(_cp_worker, world, args=(CP_CELLS,))
    batch = packed_batch()
    for i, (mode, backend, kind) in enumerate(CP_CELLS):
        o_ref, *ref_grads = run_and_grads(lambda *t: reference_attention(*t, reference_mask(batch, kind)), *qkv())
        for r in range(world):
            torch.testing.assert_close(got[r][i][0], o_ref[:, load_balanced_index(S, world, r)], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{mode} {backend} {kind} rank {r} out: {m}")
        # each rank's loss covers its own rows; the ranks' gradients sum to those of the whole loss
        for name, g_ref, parts in zip(("dq", "dk", "dv"), ref_grads, zip(*(got[r][i][1:] for r in range(world)))):
            torch.testing.assert_close(sum(parts), g_ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{mode} {backend} {kind} {name}: {m}")


# ---- GPU: the compiled flex kernels and torch's real varlen kernel, no host sync in the forward ----

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen"])
@pytest.mark.parametrize("kind", KINDS)
def test_kinds_on_cuda_without_host_sync(backend, kind):
    batch = packed_batch()
    if kind not in A.BACKEND_KINDS[backend]:
        with pytest.raises(ValueError, match=f"cannot do kind '{kind}'"):
            build_attn_meta(batch, backend, "cuda", **kw(kind))
        return
    meta = build_attn_meta(batch, backend, "cuda", **kw(kind))
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in qkv())
    for check in (False, True):  # the first call compiles (flex), which may sync; the second must not
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if check else 0)
        try:
            o = attention(q, k, v, meta, None)
            o.float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    ref = reference_attention(*(t.detach().float() for t in (q, k, v)), reference_mask(batch, kind).cuda())
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [8, 12])
def test_flex_below_16_head_dims_on_cuda(head_dim):
    """Inductor's flex kernel needs head_dim >= 16: smaller heads (tiny debug models) are zero-padded to 16 with
    the scale of the true head dim, and equal the reference in fp32, forward and gradients."""
    batch = packed_batch()
    meta = build_attn_meta(batch, "flex", "cuda", kind="causal")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, S, n, head_dim, generator=g).cuda().requires_grad_() for n in (H, G, G))
    w = torch.randn(B, S, H, head_dim, generator=g).cuda()
    ref = run_and_grads(lambda *t: reference_attention(*t, reference_mask(batch, "causal").cuda()), q, k, v, w)
    got = run_and_grads(lambda *t: attention(*t, meta, None), q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [16, 50, 96, 112, 128])
def test_flex_grouped_heads_below_its_block_on_cuda(seq):
    """Inductor's flex kernel found no config for grouped heads below 128 tokens (torch 2.11, H100: bench/rl.py's
    96-token rows of Qwen3-1.7B, 16 query / 8 kv heads, head dim 128, bf16): the attention runs there too, and its
    output and gradients are the fp32 reference's within bf16's rounding (4 units of 2^-8 of each tensor's size)."""
    Hq, Gk, D = 16, 8, 128
    ids = torch.zeros(2, seq, dtype=torch.long)
    meta = build_attn_meta({"input_ids": ids}, "flex", "cuda", kind="causal")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, seq, n, D, generator=g).cuda().bfloat16().requires_grad_() for n in (Hq, Gk, Gk))
    w = torch.randn(2, seq, Hq, D, generator=g).cuda()
    got = run_and_grads(lambda *t: attention(*t, meta, None).float(), q, k, v, w)
    causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))

    def ref(a, b, c):
        bb, cc = (t.repeat_interleave(Hq // Gk, dim=2) for t in (b, c))
        s = torch.einsum("bqhd,bkhd->bhqk", a, bb) / math.sqrt(D)
        return torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~causal, float("-inf")).softmax(-1), cc)

    want = run_and_grads(ref, q32, k32, v32, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        tol = 4 * 2.0 ** -8 * b.abs().max().item()
        torch.testing.assert_close(a.float(), b, atol=tol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _diffusion_rows(lens_per_row, S_, block):
    """Packed rows (the rest of each row is padding, one more document) and their mask written out per document:
    bidirectional (block None) or block-causal with blocks of ``block`` from each document's first token."""
    doc = torch.full((len(lens_per_row), S_), -1, dtype=torch.int32)
    mask = torch.zeros(len(lens_per_row), S_, S_, dtype=torch.bool)
    segs = []
    for b, lens in enumerate(lens_per_row):
        o = 0
        for d, n in enumerate(list(lens) + [S_ - sum(lens)]):
            if d < len(lens):
                doc[b, o:o + n] = d
            pos = torch.arange(n)
            mask[b, o:o + n, o:o + n] = True if block is None else (pos[None, :] // block <= pos[:, None] // block)
            segs.append(n)
            o += n
    cu = torch.tensor([0] + torch.tensor(segs).cumsum(0).tolist(), dtype=torch.int32)
    batch = {"input_ids": torch.zeros(len(lens_per_row), S_, dtype=torch.long), "doc_ids": doc, "cu_seqlens": cu,
             "max_seqlen": torch.tensor(max(segs))}
    return batch, mask


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "varlen"])
@pytest.mark.parametrize("kind,block", [("bidirectional", None), ("block_causal", 4), ("block_causal", 32),
                                        ("block_causal", 128)])
def test_diffusion_kinds_on_cuda_over_many_tiles(backend, kind, block):
    """The diffusion LM's kinds at its block sizes on rows of 640 tokens (five 128-token flex tiles) with documents
    across tile edges: the compiled flex kernel (and varlen, bidirectional) equals the mask written out per
    document, forward and gradients."""
    if kind not in A.BACKEND_KINDS[backend]:
        pytest.skip(f"{backend} refuses {kind} (test_varlen_refuses_kinds_it_cannot_do)")
    batch, mask = _diffusion_rows(([300, 211], [129, 1, 400]), 640, block)
    meta = build_attn_meta(batch, backend, "cuda", kind=kind, block_size=block)
    assert_bf16_cuda_matches(meta, mask, f"{kind} b={block} {backend}")


def assert_bf16_cuda_matches(meta, mask, what: str) -> None:
    """Attention in bf16 on rows [2, 640] equals the fp32 reference under ``mask``, forward and gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 640, n, K, generator=g).cuda().requires_grad_() for n in (H, G, G))
    w = torch.randn(2, 640, H, K, generator=g).cuda()
    got = run_and_grads(lambda *t: attention(*(x.bfloat16() for x in t), meta, None).float(), q, k, v, w)
    ref = run_and_grads(lambda *t: reference_attention(*t, mask.cuda()), q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2, msg=lambda m: f"{what} {name}: {m}")


def _bagel_rows(splits_per_row, S_):
    """Packed rows of BAGEL documents (split lengths and types; the rest of each row is causal padding) and their
    mask written out with bagel_mask per document."""
    rows = len(splits_per_row)
    doc = torch.full((rows, S_), -1, dtype=torch.int32)
    seg = torch.zeros(rows, S_, dtype=torch.int32)
    kinds = torch.zeros(rows, S_, dtype=torch.int8)
    mask = torch.zeros(rows, S_, S_, dtype=torch.bool)
    for b, docs in enumerate(splits_per_row):
        o = i = 0
        for d, splits in enumerate(docs):
            n = sum(x for x, _ in splits)
            doc[b, o:o + n] = d
            mask[b, o:o + n, o:o + n] = bagel_mask(splits)
            for x, t in splits:
                seg[b, o:o + x], kinds[b, o:o + x] = i, A.SEGMENT_KINDS.index(t)
                o, i = o + x, i + 1
        seg[b, o:] = i
        mask[b, o:, o:] = torch.ones(S_ - o, S_ - o, dtype=torch.bool).tril()
    return {"doc_ids": doc, "seg_ids": seg, "seg_kinds": kinds}, mask


TILED_DOCS = ([[(37, "causal"), (150, "full"), (150, "noise"), (20, "causal")], [(90, "causal"), (180, "noise")]],
              [[(1, "causal"), (256, "noise")], [(129, "full"), (3, "causal"), (128, "noise"), (60, "causal")]])


def test_segments_over_many_tiles_dense_mask():
    """The rows of the GPU test below: their dense mask (and flex's mask_mod) equals the one written per document."""
    batch, mask = _bagel_rows(TILED_DOCS, 640)
    meta = build_attn_meta(batch, "flex", "cpu", kind="segments")
    assert torch.equal(meta.sdpa_mask[:, 0], mask)
    assert torch.equal(A._mask_dense(meta.block_mask.mask_mod, 2, 640, "cpu")[:, 0], mask)


@pytest.mark.gpu
def test_segments_on_cuda_over_many_tiles():
    """BAGEL documents whose segments cross 128-token flex tiles (text, clean image, noised image, text) on rows of
    640: the compiled flex kernel equals the mask written out per document, forward and gradients."""
    batch, mask = _bagel_rows(TILED_DOCS, 640)
    assert_bf16_cuda_matches(build_attn_meta(batch, "flex", "cuda", kind="segments"), mask, "segments flex")
