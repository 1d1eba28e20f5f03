"""A parallelize plan: how one model family is sharded, checkpointed and compiled, as data.

Each model family ships a ``plan.py`` that returns a :class:`ParallelizePlan`. Nothing in a model
knows about parallelism; :func:`titan_mm.parallel.apply.parallelize` reads the plan and applies it
generically, in a fixed order: TP/EP -> CP -> AC -> compile -> FSDP.

Patterns are ``fnmatch`` patterns over module FQNs as given by ``model.named_modules()``
(for example ``"layers.*"`` or ``"layers.*.attn.wq"``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch.nn as nn


@dataclass(frozen=True)
class ParallelizePlan:
    fsdp_units: tuple[str, ...] = ()
    """Modules wrapped with ``fully_shard`` one by one (the root is always wrapped last)."""
    ac_units: tuple[str, ...] = ()
    """Modules wrapped with activation checkpointing when AC is on."""
    compile_units: tuple[str, ...] = ()
    """Modules compiled with ``torch.compile`` one by one when compile is on."""
    tp: dict[str, str] = field(default_factory=dict)
    """Module pattern -> tensor-parallel style over the ``tp`` mesh axis
    ("colwise", "rowwise", "embedding_rowwise", "grad_sum", "replicate", ...; see titan_mm/parallel/tp.py)."""
    sequence_parallel: dict[str, str] = field(default_factory=dict)
    """TP entries that replace / extend ``tp`` when ``parallel.sequence_parallel`` is on: the residual stream
    between blocks is then split over tp along the sequence ("rowwise_seq", "embedding_rowwise_seq",
    "seq_gather", "seq_gather_local", "seq_gather_output", "grad_sum"; see titan_mm/parallel/tp.py)."""
    encoder_tp: dict[str, str] = field(default_factory=dict)
    """TP entries for the modality encoders (Qwen3-VL: ViT blocks, patch and DeepStack mergers) that extend
    ``tp`` when ``parallel.encoder_tp`` is on; off, the encoders are replicated over tp (every tp rank computes
    the same features, gradients identical)."""
    loss_parallel: str | None = None
    """FQN of the module holding the output-head weight, for vocabulary-parallel loss under tp
    (``parallel.loss_parallel``): the untied head (nn.Linear) or, for tied heads, the token embedding
    (nn.Embedding, then vocab-sharded as well). Its weight is split over the vocabulary and the ``ops`` of the
    nearest module above it (signature of ``cross_entropy``: ``(h_ND, w_VD, labels_N, chunk_size,
    z_loss_weight, weights_N=None) -> loss_sum``; of ``logits``: ``(h, w_VD) -> logits``) are swapped for the vocab-parallel
    ones of titan_mm/parallel/tp.py. None: the head and the loss stay replicated."""
    ep: dict[str, str] = field(default_factory=dict)
    """Module pattern -> expert-parallel style over the ``ep`` mesh axis ("experts", ...)."""
    cp: dict[str, str] = field(default_factory=dict)
    """Module pattern -> context-parallel role ("attention", ...)."""
    pp_blocks: str | None = None
    """FQN of the container (an nn.ModuleDict keyed "0", "1", ...) that holds the trunk's blocks in order, the ones
    ``trunk(stream, rope, attn, start, stop)`` runs: pipeline stages cut it (titan_mm/parallel/pipeline.py).
    None: the model has no pipeline split."""
    pp_first: tuple[str, ...] = ()
    """FQNs of the modules only the first pipeline stage runs (``embed``: the token embedding, a vision tower)."""
    pp_last: tuple[str, ...] = ()
    """FQNs of the modules only the last pipeline stage runs (``head``: the final norm, the output head)."""


def match_modules(model: nn.Module, patterns: tuple[str, ...] | list[str]) -> list[tuple[str, nn.Module]]:
    """(fqn, module) for every submodule whose FQN matches one of ``patterns``, in model order."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if name and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]
