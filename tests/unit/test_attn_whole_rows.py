"""Rows that are each one whole document take the plain causal path (no mask), with identical results."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
from _qwen3_helpers import hf_model, packed_batch, titan_twin  # noqa: E402

from titan_mm.nn.attention import build_attn_meta


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_whole_rows_skip_masks_and_match_masked_path(backend):
    S = 32
    rows = [packed_batch([S], S, seed=s) for s in (1, 2)]
    batch = {k: torch.cat([r[k] for r in rows]) if k not in ("cu_seqlens", "max_seqlen", "num_label_tokens") else None
             for k in rows[0]}
    batch["cu_seqlens"] = torch.tensor([0, S, 2 * S], dtype=torch.int32)
    meta = build_attn_meta(batch, backend, "cpu")
    assert not meta.packed and meta.sdpa_mask is None and meta.block_mask is None

    # the same rows with one extra (fake) boundary in cu_seqlens stay on the masked path
    masked = build_attn_meta({**batch, "cu_seqlens": torch.tensor([0, S, S + 1, 2 * S], dtype=torch.int32)},
                             backend, "cpu")
    assert masked.packed

    model = titan_twin(hf_model(), attn_backend=backend)
    with torch.no_grad():
        plain = model(batch["input_ids"], position_ids=batch["position_ids"], attn=meta).logits
        ref = model(batch["input_ids"], position_ids=batch["position_ids"], attn=masked).logits
    torch.testing.assert_close(plain, ref, atol=1e-5, rtol=0)
