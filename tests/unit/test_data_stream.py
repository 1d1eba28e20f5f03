"""One global sample stream: every global batch holds the same micro-batches (rows, sample ids) for any number of
data-parallel ranks and loader workers, and a loader state moves between dp worlds
(titan_mm.data.loader.StreamLayout)."""

import hashlib
import logging

import pytest

from titan_mm.config import Data
from titan_mm.data.loader import StreamLayout, build_dataloader
from titan_mm.registry import DataNeeds

K, STEPS = 4, 3  # micro-batch slots per global batch (global batch 8 rows of micro-batches of 2), steps read


def _data(nw=0, **kw) -> Data:  # debug_qwen3.toml's data: the built-in corpus, long texts split
    return Data(dataset="builtin", seq_len=128, micro_batch_size=2, split_long_text=True, num_workers=nw,
                shuffle_buffer=16, **kw)


def _loader(W, r, nw=0, **kw):
    return build_dataloader(_data(nw, **kw), needs=DataNeeds(), dp_rank=r, dp_world=W, n_micro=K // W, seed=3,
                            return_sample_ids=True)


def digest(b) -> str:
    h = hashlib.sha1()
    for k in sorted(b):
        h.update(k.encode())
        h.update(b[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def read(W, nw=0, steps=STEPS, first=0, states=None, **kw) -> dict:
    """{(step, slot): (digest, sample ids)} of ``steps`` steps read by every rank of W, from ``states`` (per rank)."""
    out, n = {}, K // W
    for r in range(W):
        dl = _loader(W, r, nw, **kw)
        if states is not None:
            dl.load_state_dict(states[r] if isinstance(states, list) else states)
        it = iter(dl)
        for j in range(n * steps):
            b = next(it)
            out[(first + j // n, r * n + j % n)] = (digest(b), tuple(dl.last_sample_ids))
    return out


def merged(states: list[dict]) -> dict:
    """The loader states of every rank as one (what the checkpoint's per-slot items hold)."""
    return {"num_slots": states[0]["num_slots"], "slots": {k: v for s in states for k, v in s["slots"].items()}}


@pytest.fixture(scope="module")
def reference():
    return read(1)


@pytest.mark.parametrize("W,nw", [(1, 2), (2, 0), (2, 2), (4, 0), (4, 2)])
def test_global_batches_same_for_any_world_and_workers(reference, W, nw):
    got = read(W, nw)
    assert got == reference
    for t in range(STEPS):  # and so the sample ids of each global batch (docs split by split_long_text: id@offset)
        ids = sorted(i for k in range(K) for i in got[(t, k)][1])
        assert ids and ids == sorted(i for k in range(K) for i in reference[(t, k)][1])
    assert len({i for v in reference.values() for i in v[1]}) > 2 * K * STEPS  # real, distinct samples


def test_streams_per_slot_lets_workers_share_a_rank(reference, caplog):
    # 1 micro-batch per rank and step: one stream per rank, so a second worker has nothing to read (logged)
    with caplog.at_level(logging.WARNING, logger="titan_mm.data"):
        dl = build_dataloader(_data(2), needs=DataNeeds(), dp_rank=0, dp_world=2, n_micro=1)
    assert dl.num_workers == 1
    assert "using 1 of data.num_workers = 2 loader workers" in caplog.text and "data.streams_per_slot" in caplog.text
    # two streams per slot: 2 workers per rank, and still the same global batches as one process without workers
    dl = build_dataloader(_data(2, streams_per_slot=2), needs=DataNeeds(), dp_rank=0, dp_world=2, n_micro=1)
    assert dl.num_workers == 2
    one = read(1, 0, streams_per_slot=2)
    assert read(K, 2, streams_per_slot=2) == one
    assert one != reference  # the streams are part of the order


def test_workers_that_do_not_divide_the_streams():
    # 3 micro-batches per step, 2 workers: each period padded to 4 positions (one placeholder); resumed mid-step
    def mk(nw):
        return build_dataloader(_data(nw), needs=DataNeeds(), n_micro=3, seed=3)

    it = iter(mk(0))
    ref = [digest(next(it)) for _ in range(10)]
    dl = mk(2)
    assert dl.num_workers == 2
    it = iter(dl)
    got = [digest(next(it)) for _ in range(4)]
    again = mk(2)
    again.load_state_dict(dl.state_dict())
    it = iter(again)
    assert got + [digest(next(it)) for _ in range(6)] == ref


def test_state_moves_between_worlds(reference):
    # 2 ranks (2 workers each) read 1 step, 1 process (no workers) continues: the same next 2 steps
    dls = [_loader(2, r, 2) for r in range(2)]
    for dl in dls:
        it = iter(dl)
        for _ in range(K // 2):
            next(it)
    saved2 = merged([dl.state_dict() for dl in dls])
    want = {key: v for key, v in reference.items() if key[0] >= 1}
    assert read(1, 0, steps=2, first=1, states=saved2) == want
    # and 1 -> 4 ranks (workers 2, capped to 1 per rank)
    dl = _loader(1, 0)
    it = iter(dl)
    for _ in range(K):
        next(it)
    assert read(4, 2, steps=2, first=1, states=dl.state_dict()) == want


def test_state_in_the_middle_of_a_step():
    # 1 process stopped after 1 of its 4 micro-batches: it resumes itself, and 2 ranks can take it too
    dl = _loader(1, 0)
    it = iter(dl)
    ref = [digest(next(it)) for _ in range(K + 1)]
    dl = _loader(1, 0)
    next(iter(dl))
    mid = dl.state_dict()
    again = _loader(1, 0)
    again.load_state_dict(mid)
    it = iter(again)
    assert [digest(next(it)) for _ in range(K)] == ref[1:]
    r0 = _loader(2, 0)
    r0.load_state_dict(mid)
    assert digest(next(iter(r0))) == ref[1]  # rank 0 goes on with slot 1 of step 0
    # rank 1 of 2 ahead of rank 0: no position of one process's reading
    r1 = _loader(2, 1)
    next(iter(r1))
    bad = merged([_loader(2, 0).state_dict(), r1.state_dict()])
    with pytest.raises(ValueError, match="no position of this rank's reading"):
        _loader(1, 0).load_state_dict(bad)


def test_state_of_another_global_batch_is_refused():
    dl = build_dataloader(_data(), needs=DataNeeds(), n_micro=2)
    with pytest.raises(ValueError, match="for 2 micro-batch slots per global batch, this loader has 4"):
        _loader(1, 0).load_state_dict(dl.state_dict())
    with pytest.raises(ValueError, match="streams_per_slot = 1"):
        _loader(1, 0, streams_per_slot=2).load_state_dict(_loader(1, 0).state_dict())
    with pytest.raises(ValueError, match="older version"):
        _loader(1, 0).load_state_dict({"_snapshot": {}})


def test_layout_maps_ranks_onto_slots():
    L = StreamLayout(slots=4, per_slot=2, dp_rank=1, dp_world=2)
    assert list(L.owned_slots) == [2, 3] and L.period == 4
    # step t reads slot k from stream 2k + t % 2: slots 2, 3 of step 0, then of step 1
    assert L.streams == [4, 6, 5, 7]
    assert [L.turns(3, r) for r in range(4)] == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="cannot be split"):
        StreamLayout(slots=3, dp_world=2)
