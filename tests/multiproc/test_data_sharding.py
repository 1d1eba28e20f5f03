"""Within an epoch no sample is seen twice or lost across 2 dp ranks x 2 workers (2 micro-batches per rank and
step: 4 streams; by global ids), over JSONL (fewer files than streams: strided), Parquet row groups (more units
than streams) and tar shards. The streams end at different batches: each rank reads on until all of its own
have ended."""

import collections

from titan_mm.config import Data
from titan_mm.data.builtin.generate import generate
from titan_mm.data.loader import build_dataloader
from titan_mm.registry import DataNeeds


def _data(d) -> Data:
    return Data(seq_len=1024, micro_batch_size=2, open_rows=4, num_workers=2,
                mixture={f"{d}/j": 1.0, f"{d}/p": 2.0, f"{d}/t": 1.0})


def test_no_dup_no_loss_2_ranks_2_workers(tmp_path):
    d = str(tmp_path)
    generate(f"{d}/j", 150, "jsonl", shards=3, seed=1)
    generate(f"{d}/p", 200, "parquet", shards=2, seed=2, row_group=40)  # 5 + 5 row groups
    generate(f"{d}/t", 90, "tar", shards=2, seed=3)
    ids, seen_per_rank = [], []
    for rank in range(2):
        dl = build_dataloader(_data(d), needs=DataNeeds(), dp_rank=rank, dp_world=2, n_micro=2, seed=5, epochs=1,
                              return_sample_ids=True)
        assert dl.num_workers == 2
        rank_ids = []
        for _ in dl:
            rank_ids += dl.last_sample_ids
        m = dl.metrics()
        assert m["skipped"] == 0, m
        seen_per_rank.append(len(rank_ids))
        ids += rank_ids
    counts = collections.Counter(ids)
    dups = [k for k, c in counts.items() if c > 1]
    assert not dups, dups[:5]
    per_source = collections.Counter(i.split("/", 1)[0] for i in ids)
    assert sorted(per_source.values()) == [90, 150, 200], per_source
    assert len(ids) == 440
    assert min(seen_per_rank) > 100  # both ranks got a share
