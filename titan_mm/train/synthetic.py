"""Synthetic packed batches in the contract format (docs/architecture.md "Batch"), for tests and benchmarks.

``data.dataset = "synthetic"`` selects it. Rows are random tokens cut into documents of random lengths.
Row r of optimizer step t is generated from (seed, t, r) alone, where r counts rows over the whole global
batch, so the global batch is the same for every data-parallel world size and gradient-accumulation split
(what the multi-process equality tests need): micro-batch slot k of a step is rows k*B .. k*B+B-1, and rank r
of W serves slots r*n .. (r+1)*n-1 (titan_mm.data.loader.StreamLayout, the data loader's rule). State: the
micro-batches each slot has served, in the loader-state layout of StreamLayout, so it resumes on any dp world.
Batches come from the data pipeline's collator (titan_mm.data.packing.collate_rows).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from titan_mm.data.loader import CountedLoader, StreamLayout
from titan_mm.data.packing import IGNORE_INDEX as IGNORE
from titan_mm.data.packing import Doc, collate_rows


def make_row(gen: torch.Generator, seq_len: int, vocab_size: int, min_doc: int = 8):
    """(input_ids, labels, position_ids, doc_ids) of one packed row; labels shifted within each doc."""
    ids = torch.randint(0, vocab_size, (seq_len,), generator=gen)
    labels = torch.full((seq_len,), IGNORE, dtype=torch.long)
    pos = torch.zeros(seq_len, dtype=torch.long)
    doc = torch.full((seq_len,), -1, dtype=torch.int32)
    used, d = 0, 0
    pad = int(torch.randint(0, max(seq_len // 8, 1), (1,), generator=gen))
    budget = seq_len - pad
    while used < budget:
        n = int(torch.randint(min_doc, max(min_doc + 1, budget // 2), (1,), generator=gen))
        n = min(n, budget - used)
        sl = slice(used, used + n)
        labels[used: used + n - 1] = ids[used + 1: used + n]
        pos[sl] = torch.arange(n)
        doc[sl] = d
        used += n
        d += 1
    return ids, labels, pos, doc


def collate(rows) -> dict:
    """Rows of (input_ids, labels, position_ids, doc_ids) [S] tensors -> the contract batch, through
    collate_rows: each row's documents become Docs; the padding keeps the row's own token ids (the random
    draws of :func:`make_row`), so batches are what they were before the shared collator."""
    docs, ids = [], torch.stack([r[0] for r in rows])
    for r_ids, r_lab, r_pos, r_doc in rows:
        d = r_doc.numpy()
        starts = np.flatnonzero(np.diff(d, prepend=-2))  # first token of each doc and of the padding
        row = []
        for a, e in zip(starts, [*starts[1:], len(d)]):
            if d[a] >= 0:
                pos = r_pos[a:e].numpy()
                row.append(Doc(r_ids[a:e].numpy(), r_lab[a:e].numpy(), positions=np.broadcast_to(pos, (3, e - a))))
        docs.append(row)
    batch = collate_rows(docs, ids.shape[1], pad_id=0, position_axes=1, multiple=1)
    pad = batch["doc_ids"] < 0
    batch["input_ids"][pad] = ids[pad]
    return batch


class SyntheticLoader(CountedLoader):
    """An endless iterable of micro-batches with state_dict()/load_state_dict() like StatefulDataLoader."""

    def __init__(self, *, vocab_size: int, seq_len: int, micro_batch_size: int, n_micro: int = 1,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0,
                 make_batch: Callable[[list[torch.Generator]], dict] | None = None):
        """``make_batch(gens)``: a family's own micro-batch from its rows' generators (ModelSpec.synthetic, for
        batches without tokens); None: random token rows."""
        self.make_batch = make_batch
        self.vocab_size, self.seq_len, self.mb = vocab_size, seq_len, micro_batch_size
        self.n_micro, self.dp_rank, self.dp_world, self.seed = n_micro, dp_rank, dp_world, seed
        self.layout = StreamLayout(slots=n_micro * dp_world, dp_rank=dp_rank, dp_world=dp_world)
        self.served = 0

    def batch(self, j: int) -> dict:
        step, i = divmod(j, self.n_micro)
        first = (self.dp_rank * self.n_micro + i) * self.mb
        gens = [torch.Generator().manual_seed(hash((self.seed, step, r)) & 0x7FFFFFFF)
                for r in range(first, first + self.mb)]
        if self.make_batch is not None:
            return self.make_batch(gens)
        return collate([make_row(g, self.seq_len, self.vocab_size) for g in gens])

    def __iter__(self):
        while True:
            b = self.batch(self.served)
            self.served += 1
            yield b

    def metrics(self) -> dict:
        return {}
