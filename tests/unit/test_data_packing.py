"""The batch contract (docs/architecture.md) and the packer."""

import numpy as np
import pytest
import torch

from tests.data_needs import QWEN3_VL_NEEDS
from titan_mm.config import Data
from titan_mm.data.loader import build_dataloader
from titan_mm.data.packing import BestFitPacker, Doc, collate_rows, padded_seq_len
from titan_mm.registry import BatchSchema, DataNeeds, SeqKey


def _doc(n, sid=""):
    ids = np.arange(1, n + 1, dtype=np.int64)
    lab = np.concatenate([ids[1:], [-100]])
    return Doc(ids, lab, sid)


def test_contract_on_builtin_text():
    data = Data(seq_len=200, micro_batch_size=3)
    dl = build_dataloader(data, needs=DataNeeds())
    b = next(iter(dl))
    B, S = b["input_ids"].shape
    assert (B, S) == (3, 208) and S == padded_seq_len(data)
    assert b["input_ids"].dtype == torch.int64 and b["labels"].dtype == torch.int64
    assert b["doc_ids"].dtype == torch.int32 and b["cu_seqlens"].dtype == torch.int32
    assert b["max_seqlen"].dim() == 0 and b["num_label_tokens"].dim() == 0
    assert int(b["num_label_tokens"]) == int((b["labels"] != -100).sum())
    cu = b["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == B * S
    assert int(b["max_seqlen"]) == max(np.diff(cu))
    flat_ids, flat_pos, flat_doc = (b[k].reshape(-1) for k in ("input_ids", "position_ids", "doc_ids"))
    flat_lab = b["labels"].reshape(-1)
    for a, e in zip(cu[:-1], cu[1:]):
        seg_doc = flat_doc[a:e]
        assert (seg_doc == seg_doc[0]).all()
        if seg_doc[0] >= 0:  # a document: positions restart, labels are the next ids, last label -100
            assert flat_pos[a:e].tolist() == list(range(e - a))
            assert flat_lab[e - 1] == -100
            assert torch.equal(flat_lab[a : e - 1], flat_ids[a + 1 : e])
        else:  # padding
            assert (flat_lab[a:e] == -100).all() and (flat_pos[a:e] == 0).all()
    m = dl.metrics()
    assert 0.9 < m["packing_efficiency"] <= 1.0 and m["samples"] > 0 and "data_wait_s" in m


def test_best_fit_is_dense_and_state_roundtrips():
    rng = np.random.default_rng(0)
    p = BestFitPacker(8192, open_rows=32)
    for i, n in enumerate(rng.integers(20, 600, 20000)):
        p.add(_doc(int(n), str(i)))
    rows = list(p.ready)
    fill = sum(len(d) for r in rows for d in r) / (len(rows) * 8192)
    assert fill >= 0.98, fill
    q = BestFitPacker(8192, open_rows=32)
    q.load_state_dict(p.state_dict())
    assert [len(r.docs) for r in q.open] == [len(r.docs) for r in p.open]
    assert [r.used for r in q.open] == [r.used for r in p.open]


def test_collate_mrope_and_padding_rows():
    d = _doc(5)
    d.positions = np.stack([np.arange(5)] * 3)
    b = collate_rows([[d], []], 16, pad_id=0, position_axes=3)
    assert b["position_ids"].shape == (3, 2, 16)
    assert b["cu_seqlens"].tolist() == [0, 5, 16, 32]
    assert (b["doc_ids"][1] == -1).all()


def test_patch_cap_and_oversized_docs():
    p = BestFitPacker(1000, open_rows=4, max_patches_per_row=100)
    big = _doc(50)
    big.n_patches = 150
    assert not p.fits(big) and not p.fits(_doc(1001)) and p.fits(_doc(1000))
    for _ in range(6):
        d = _doc(50)
        d.n_patches = 40
        p.add(d)
    p.flush()
    assert all(sum(d.n_patches for d in r) <= 100 for r in p.ready)


def test_near_ties_go_to_the_row_with_smaller_sum_of_squares():
    from titan_mm.data.packing import _Row

    p = BestFitPacker(1000, open_rows=2)

    a, b = _Row(), _Row()
    a.add(_doc(400))  # used 400, sumsq 160000
    for _ in range(4):
        b.add(_doc(100))  # used 400, sumsq 40000
    p.open = [a, b]
    p.add(_doc(50))
    assert len(b.docs) == 5 and len(a.docs) == 1


def test_lazy_image_equals_eager():
    import io

    from PIL import Image

    from titan_mm.data import vision
    from titan_mm.data.processors import ProcessorConfig

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (70, 130, 3), dtype=np.uint8)).save(buf, format="PNG")
    cfg = ProcessorConfig(Data(image_min_pixels=4096, image_max_pixels=20000), QWEN3_VL_NEEDS)
    eager = vision.process_image(buf.getvalue(), cfg)
    lazy = vision.process_image(buf.getvalue(), cfg, lazy=True)
    assert lazy.grid == eager.grid and lazy.n_tokens == eager.n_tokens
    out = lazy.tensors["_lazy_image"].materialize()
    np.testing.assert_array_equal(out["pixel_values"], eager.tensors["pixel_values"])
    np.testing.assert_array_equal(out["image_grid_thw"], eager.tensors["image_grid_thw"])


def test_token_docs_give_the_token_batch_only():
    """Docs without seq arrays or segments: the batch of before (no segment or latent keys)."""
    b = collate_rows([[_doc(5), _doc(4)], [_doc(9)]], 16, pad_id=0, position_axes=1)
    assert list(b) == ["input_ids", "labels", "position_ids", "doc_ids", "cu_seqlens", "max_seqlen",
                       "num_label_tokens"]


def _latent_doc(n_cond, n_lat, C=3, sid=""):
    """A doc without tokens: conditioning vectors (a causal segment), then latents (a noise segment)."""
    n = n_cond + n_lat
    x = np.arange(n * C, dtype=np.float32).reshape(n, C) + 1
    mask = np.arange(n) >= n_cond
    return Doc(None, None, sid, seq={"latents": x, "latent_mask": mask},
               segments=((n_cond, "causal"), (n_lat, "noise")))


LATENT_SCHEMA = BatchSchema((SeqKey("latents", ("C",), "float32"), SeqKey("latent_mask", dtype="bool")), tokens=False)


def test_docs_without_tokens_pack_their_seq_arrays_and_segments():
    rows = [[_latent_doc(2, 3), _latent_doc(1, 4)], [_latent_doc(3, 3)]]
    b = collate_rows(rows, 16, pad_id=0, position_axes=1, schema=LATENT_SCHEMA)
    assert "input_ids" not in b and "labels" not in b and "num_label_tokens" not in b
    assert b["latents"].shape == (2, 16, 3) and b["latents"].dtype == torch.float32
    assert torch.equal(b["latents"][0, :5], torch.from_numpy(rows[0][0].seq["latents"]))
    assert torch.equal(b["latents"][0, 5:10], torch.from_numpy(rows[0][1].seq["latents"]))
    assert (b["latents"][0, 10:] == 0).all() and not b["latent_mask"][:, 10:].any()  # padding: zeros
    assert b["seg_ids"][0].tolist() == [0, 0, 1, 1, 1, 2, 3, 3, 3, 3] + [4] * 6  # numbered along the row
    assert b["seg_kinds"][0].tolist() == [0, 0, 2, 2, 2, 0, 2, 2, 2, 2] + [0] * 6  # padding: causal
    assert b["doc_ids"][0].tolist() == [0] * 5 + [1] * 5 + [-1] * 6
    assert b["position_ids"][1, :6].tolist() == list(range(6))
    assert b["cu_seqlens"].tolist() == [0, 5, 10, 16, 22, 32]


def test_docs_that_do_not_fit_the_schema_are_refused():
    with pytest.raises(ValueError, match="'latents' of shape \\[5, 3\\] is not a sequence key"):
        collate_rows([[_latent_doc(2, 3)]], 16, 0, 1, schema=BatchSchema(tokens=False))
    with pytest.raises(ValueError, match="lacks input_ids but the family's BatchSchema says tokens=True"):
        collate_rows([[_latent_doc(2, 3)]], 16, 0, 1, schema=BatchSchema())
    with pytest.raises(ValueError, match="mixes docs with and without input_ids"):
        collate_rows([[_latent_doc(2, 3), _doc(3)]], 16, 0, 1)
    bad = _latent_doc(2, 3)
    bad.segments = ((2, "causal"), (2, "noisy"))
    with pytest.raises(ValueError, match="must cover its 5 tokens with kinds of"):
        collate_rows([[bad]], 16, 0, 1)
