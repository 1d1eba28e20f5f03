"""Synthetic packed batches in the contract format (docs/architecture.md "Batch"), for tests and benchmarks.

``data.dataset = "synthetic"`` selects it. Rows are random tokens cut into documents of random lengths.
Row r of optimizer step t is generated from (seed, t, r) alone, where r counts rows over the whole global
batch, so the global batch is the same for every data-parallel world size and gradient-accumulation split
(what the multi-process equality tests need). State: the number of micro-batches served.
"""

from __future__ import annotations

import torch

IGNORE = -100


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
    ids = torch.stack([r[0] for r in rows])
    labels = torch.stack([r[1] for r in rows])
    pos = torch.stack([r[2] for r in rows])
    doc = torch.stack([r[3] for r in rows])
    B, S = ids.shape
    lens = []
    for b in range(B):
        d = doc[b]
        n_docs = int(d.max()) + 1 if (d >= 0).any() else 0
        for i in range(n_docs):
            lens.append(int((d == i).sum()))
        pad = int((d < 0).sum())
        if pad:
            lens.append(pad)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "doc_ids": doc,
        "cu_seqlens": cu,
        "max_seqlen": torch.tensor(max(lens) if lens else 0, dtype=torch.int64),
        "num_label_tokens": (labels != IGNORE).sum(),
    }


class SyntheticLoader:
    """An endless iterable of micro-batches with state_dict()/load_state_dict() like StatefulDataLoader."""

    def __init__(self, *, vocab_size: int, seq_len: int, micro_batch_size: int, n_micro: int = 1,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0):
        self.vocab_size, self.seq_len, self.mb = vocab_size, seq_len, micro_batch_size
        self.n_micro, self.dp_rank, self.dp_world, self.seed = n_micro, dp_rank, dp_world, seed
        self.served = 0

    def batch(self, j: int) -> dict:
        step, i = divmod(j, self.n_micro)
        first = (self.dp_rank * self.n_micro + i) * self.mb
        rows = []
        for r in range(first, first + self.mb):
            g = torch.Generator().manual_seed(hash((self.seed, step, r)) & 0x7FFFFFFF)
            rows.append(make_row(g, self.seq_len, self.vocab_size))
        return collate(rows)

    def __iter__(self):
        while True:
            b = self.batch(self.served)
            self.served += 1
            yield b

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, sd: dict) -> None:
        self.served = int(sd["served"])

    def seek_step(self, step: int) -> None:
        """Position at optimizer step ``step`` (used when a checkpoint's data state was written for another
        data-parallel world: this loader's order does not depend on the world, so the resume is still exact)."""
        self.served = step * self.n_micro

    def metrics(self) -> dict:
        return {}
