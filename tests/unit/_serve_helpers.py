"""A tiny Qwen3 (random weights, 256-token vocabulary, fp32) and serving engines over it, for the engine tests."""

from __future__ import annotations

import dataclasses

import torch

from titan_mm.models.qwen3.config import FLAVORS
from titan_mm.models.qwen3.model import Qwen3Model
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine

VOCAB = 256
_MODEL: list = []


def tiny_model() -> Qwen3Model:
    if not _MODEL:
        cfg = dataclasses.replace(FLAVORS["debug"], vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256,
                                  tie_word_embeddings=False)
        m = Qwen3Model(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # HF-parity style weights (tests/parity/_qwen3_helpers.randomize_): varied outputs
            for n, p in m.named_parameters():
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in n else
                        0.08 * torch.randn(p.shape, generator=g))
        _MODEL.append(m.eval())
    return _MODEL[0]


def engine(eos=(), clock=None, draft=None, **cfg) -> Engine:
    """An engine over the tiny model; ``cfg``: ServeConfig fields (default: 128 blocks of 4 tokens)."""
    m = tiny_model()
    kw = {} if clock is None else {"clock": clock}
    if draft is not None:
        kw["draft"] = draft
    return Engine(m, get_model_spec("qwen3"), m.cfg, ServeConfig(**{"block_size": 4, "num_blocks": 128, **cfg}),
                  eos_token_ids=list(eos), **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
