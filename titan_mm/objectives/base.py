"""What an objective is: registered data that the train step, eval's held-out loss and the pipeline schedule call.

    obj = build_objective(cfg, spec, model_cfg)                  # titan_mm.objectives: the family's, or [objective]
    micro_batches = obj.prepare(micro_batches, step, dp_rank)    # host: noise, corrupted inputs, targets, counts
    counts = obj.counts(mb)                                       # host: {term: normalizer share} per micro-batch
    out = model(ids, position_ids=, attn=, loss=obj.bind(b), **model inputs)   # the forward calls the objective
    out.terms                                                     # {term: fp32 sum}: the step divides each term by
                                                                  # its global count (one all-reduce per step)

An objective names its loss terms (``"ce"``, ``"mse"``); each term is a SUM over the micro-batch and has its own
normalizer counted on the host (label tokens, latent elements), summed over the global batch before any backward,
so sum_i term_i / N_term is the true mean over the whole global batch whatever the accumulation, dp, cp or pp split.

The model side: a family's forward takes ``loss`` (a callable ``loss(model, out) -> {term: sum}``) and calls it on
its output (``out.hidden``, the final-norm hidden states) inside the forward, so that FSDP's gathered weights,
the one-rank parameter casts and tensor-parallel loss parallel are the same as for the rest of the forward. The
objective then asks the family through a named hook (``lm_loss`` for the causal LM, ``predict_velocity`` for flow
matching); docs/models.md lists the hooks.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch


def noise_generator(seed: int, step: int, slot: int, salt: str = "") -> torch.Generator:
    """A CPU generator seeded by (seed, step, global micro-batch slot[, salt]): the same draws for any dp world and
    bitwise on resume (the slot is the data stream's, titan_mm.data.loader.StreamLayout)."""
    key = hashlib.blake2b(f"{seed}/{step}/{slot}{salt}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


class Objective(ABC):
    """The base of every objective: what the step asks. A subclass is a frozen dataclass of its options; it sets
    these class attributes (or properties) and overrides the methods."""

    terms: tuple[str, ...] = ()
    """Loss-term names, in the order the step logs and reduces them (``loss/<term>``)."""
    fields: tuple[str, ...] = ()
    """Batch fields it reads (checked on the first micro-batch: a missing one is a one-line error)."""
    loss_keys: tuple[str, ...] = ()
    """Batch keys only the loss reads: the step does not hand them to the model's forward."""
    host_keys: tuple[str, ...] = ()
    """Batch keys that stay on the host (counts)."""
    seq_keys: tuple = ()
    """Keys ``prepare`` adds along the sequence (names of [B, S] keys, or titan_mm.registry.SeqKey with trailing
    dims): context parallelism cuts them on S."""
    mask_kind: str | None = None
    """Attention mask kind it trains with (titan_mm.nn.attention KINDS); None: no preference (the family's)."""
    block_size: int | None = None
    """Block size of the "block_causal" kind."""
    stats: tuple[str, ...] = ()
    """Terms that are logged only (a policy's entropy, its clipped fraction): among ``terms``, each with its own
    count, detached, and left out of the loss."""

    def prepare(self, micro_batches: list[dict], step: int, dp_rank: int = 0) -> list[dict]:
        """The micro-batches the model trains on at optimizer step ``step`` (0-based) on dp rank ``dp_rank``
        (host; noise seeded by the global micro-batch slot dp_rank x n_micro + i). Default: as they come."""
        return micro_batches

    @abstractmethod
    def counts(self, batch: dict[str, Any]) -> dict[str, int]:
        """Each term's normalizer share of this (prepared, not yet CP-split) micro-batch, on the host."""

    @abstractmethod
    def loss_sums(self, model, out, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """{term: fp32 scalar SUM over this micro-batch} from the model's output (called inside its forward)."""

    def bind(self, batch: dict[str, Any]) -> Callable:
        """The ``loss`` argument of a family's forward for ``batch`` (device tensors)."""
        return lambda model, out: self.loss_sums(model, out, batch)

    def flops(self, spec, model_cfg, doc_lens, **grids) -> float:
        """Training FLOPs of a micro-batch: the family's count (causal attention pairs), plus, for a bidirectional
        or block-causal mask, the attention pairs it adds (L^2 per document; every key of the query's block too) at
        12 x heads x head_dim per pair and layer (docs/flops.md). Other kinds (causal, a family's segments) are the
        family's count."""
        if self.mask_kind not in ("bidirectional", "block_causal"):
            return spec.flops(model_cfg, doc_lens, **grids)
        lens = [int(x) for x in (doc_lens.tolist() if hasattr(doc_lens, "tolist") else doc_lens)]
        d = spec.dims(model_cfg)
        extra = sum(attention_pairs(L, self.mask_kind, self.block_size) - attention_pairs(L, "causal") for L in lens)
        return float(spec.flops(model_cfg, lens, **grids)) + 12.0 * d.num_heads * d.head_dim * d.num_layers * extra

    def check_batch(self, batch: dict[str, Any]) -> None:
        """Raise ValueError naming the first field this objective needs and the batch lacks."""
        missing = [f for f in self.fields if f not in batch]
        if missing:
            raise ValueError(f"objective {type(self).__name__} needs batch field {missing[0]!r}, which the batch "
                             f"lacks (keys {sorted(batch)}); the data pipeline or the family's prepare_batch must "
                             "produce it")


def attention_pairs(L: int, kind: str, block_size: int | None = None) -> int:
    """(query, key) pairs a document of L tokens attends under mask ``kind`` (no sliding window)."""
    if kind == "causal":
        return L * (L + 1) // 2
    if kind == "bidirectional":
        return L * L
    if kind == "block_causal":  # a query of block j sees every key up to the end of block j
        return sum(min(block_size, L - s) * min(s + block_size, L) for s in range(0, L, block_size))
    raise ValueError(f"attention_pairs: unknown kind {kind!r}")
