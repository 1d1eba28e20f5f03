"""The cross-entropy's chunk size is the model's ``loss_chunk_size`` on both paths (fused kernel and PyTorch)."""

import dataclasses

import pytest

from titan_mm.registry import get_model_spec


def test_fused_cross_entropy_takes_the_models_chunk_size(monkeypatch):
    """The fused CE chunks by the model's loss_chunk_size (not Liger's rule: 256 rows at Qwen3-8B's shape made the
    head's weight gradient 32 passes a step); a chunk size below 1 is refused."""
    import torch

    from titan_mm import kernels as K
    from titan_mm.models.qwen3.model import select_ops

    seen = []
    real = K.linear_cross_entropy
    monkeypatch.setattr(K, "linear_cross_entropy", lambda *a, **kw: seen.append(kw["chunk_size"]) or real(*a, **kw))
    h, w = torch.randn(10, 8), torch.randn(32, 8)
    labels = torch.randint(0, 32, (10,))
    got = select_ops("linear_cross_entropy").cross_entropy(h, w, labels, 3, 0.0)
    assert seen == [3]
    assert torch.allclose(got, select_ops(False).cross_entropy(h, w, labels, 3, 0.0))
    with pytest.raises(ValueError, match="loss_chunk_size=0"):
        dataclasses.replace(get_model_spec("qwen3").flavor("debug"), loss_chunk_size=0)

