"""Ring and all-gather context parallelism read the packed batch's document mask densely. On CUDA the flex
backend builds only block masks, so the CP metadata asks for the dense one (dense_mask=True); metadata of a
packed batch without it is refused instead of silently attending across documents (the bug the 2-GPU cp2_ring
run found: step-1 loss 6e-4 off the 1-GPU run)."""

import dataclasses

import pytest
import torch

from titan_mm.nn.attention import build_attn_meta
from titan_mm.parallel.cp import _check_dense, _seq_axes
from titan_mm.registry import SeqKey


def _packed():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, -1]], dtype=torch.int32)
    return {"input_ids": torch.zeros(1, 8, dtype=torch.long), "doc_ids": doc,
            "cu_seqlens": torch.tensor([0, 3, 5, 7], dtype=torch.int32)}


def test_flex_dense_mask_equals_the_sdpa_mask():
    flex = build_attn_meta(_packed(), "flex", "cpu", dense_mask=True)
    sdpa = build_attn_meta(_packed(), "sdpa", "cpu")
    assert flex.sdpa_mask is not None and torch.equal(flex.sdpa_mask, sdpa.sdpa_mask)
    assert not bool(flex.sdpa_mask[0, 0, 3, 2])  # token 3 (doc 1) must not see token 2 (doc 0)


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_packed_meta_without_dense_mask_is_refused(mode):
    cuda_like = dataclasses.replace(build_attn_meta(_packed(), "flex", "cpu"), sdpa_mask=None)  # as flex on CUDA
    with pytest.raises(ValueError, match="dense_mask=True"):
        _check_dense(cuda_like, mode)
    _check_dense(build_attn_meta({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, "flex", "cpu"), mode)  # causal


def test_cp_cuts_declared_sequence_keys_on_their_axis_and_refuses_the_rest():
    b = {**_packed(), "latents": torch.zeros(1, 8, 4), "position_ids": torch.zeros(3, 1, 8),
         "pixels": torch.zeros(5, 4)}
    axes = _seq_axes(b, (SeqKey("latents", ("C",)),), 8)
    assert axes == {"input_ids": 1, "doc_ids": 1, "latents": 1, "position_ids": 2}  # undeclared pixels stay whole
    with pytest.raises(ValueError, match=r"cannot cut batch\['latents'\] of shape \[1, 8, 4\]: dim 2 .*BatchSchema"):
        _seq_axes(b, ("latents",), 8)  # declared without its trailing dim
