"""The paged KV block manager: reference counts, copy-on-write of forked sequences, prefix caching by chained
hashes (tokens and images), LRU eviction of unreferenced cached blocks, and that ``cost`` is exactly what
``allocate`` takes."""

import random

from titan_mm.serve.core.block_manager import BlockManager, BlockTable, block_keys

BS = 4


def filled(bm: BlockManager, tokens: list[int]) -> BlockTable:
    """A sequence that computed ``tokens`` and registered its full blocks."""
    t = BlockTable()
    bm.allocate(t, 0, len(tokens))
    bm.register(t, block_keys(tokens, BS))
    return t


def test_allocate_and_free_count_every_block():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = BlockTable(), BlockTable()
    assert bm.cost(a, 0, 9) == 3
    bm.allocate(a, 0, 9)
    bm.allocate(b, 0, 4)
    assert (len(a.blocks), len(b.blocks), bm.num_free, bm.num_used) == (3, 1, 4, 4)
    bm.allocate(a, 9, 3)  # 12 tokens still fit 3 blocks
    assert len(a.blocks) == 3
    bm.allocate(a, 12, 1)
    assert len(a.blocks) == 4 and len(set(a.blocks + b.blocks)) == 5
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8 and a.blocks == [] and max(bm.ref) == 0


def test_prefix_hits_follow_the_chain():
    bm = BlockManager(16, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = filled(bm, prompt)
    assert len(a.keys) == 2
    same = block_keys(prompt + [99], BS)
    assert bm.match(same, limit_tokens=10) == a.blocks[:2]
    assert bm.match(same, limit_tokens=7) == a.blocks[:1]  # at most limit_tokens' worth
    other_second = block_keys(prompt[:4] + [50, 51, 52, 53], BS)
    assert bm.match(other_second, 8) == a.blocks[:1]
    # the same 4 tokens after another first block are another prefix: no hit
    assert bm.match(block_keys([7, 7, 7, 7] + prompt[4:8], BS), 8) == []
    # images: the same tokens with another picture in block 0 are another prefix
    assert bm.match(block_keys(prompt[:8], BS, extra=[(123,)]), 8) == []


def test_hits_are_shared_and_survive_their_owner():
    bm = BlockManager(6, BS)
    prompt = list(range(8))
    a = filled(bm, prompt)
    b = BlockTable()
    hit = bm.match(block_keys(prompt + [1], BS), 8)
    assert bm.cost(b, 0, 1, hit) == 1  # the hits are held already: only the new block
    bm.allocate(b, 0, 1, hit)
    assert b.blocks[:2] == a.blocks[:2] and [bm.ref[x] for x in hit] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and len(bm.cached) == 2  # free, but still cached
    c = BlockTable()
    hit = bm.match(block_keys(prompt + [1], BS), 8)
    assert bm.cost(c, 0, 1, hit) == 3  # evictable hits leave the free pool
    bm.allocate(c, 0, 1, hit)
    assert c.blocks[:2] == hit and bm.num_free == 3


def test_lru_evicts_the_oldest_tail_first():
    bm = BlockManager(4, BS)
    a = filled(bm, list(range(8)))
    b = filled(bm, list(range(100, 108)))
    (a0, a1), (b0, b1) = a.blocks, b.blocks
    bm.free(a)
    bm.free(b)
    assert list(bm.cached) == [a1, a0, b1, b0]  # freed tails first, oldest first
    t = BlockTable()
    bm.allocate(t, 0, 4)
    assert bm.num_evictions == 1 and t.blocks == [a1]
    # a's tail went first: a's head still hits, a's second block does not
    assert len(bm.match(block_keys(list(range(8)), BS), 8)) == 1
    assert len(bm.match(block_keys(list(range(100, 108)), BS), 8)) == 2


def test_fork_copies_the_shared_partial_block_on_write():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    parent = BlockTable()
    bm.allocate(parent, 0, 6)  # one full block + a partial one
    child = bm.fork(parent)
    assert child.blocks == parent.blocks and bm.ref[parent.blocks[1]] == 2
    assert bm.cost(child, 6, 1) == 1
    copies = bm.allocate(child, 6, 1)
    assert copies == [(parent.blocks[1], child.blocks[1])] and child.blocks[0] == parent.blocks[0]
    assert bm.allocate(parent, 6, 1) == []  # the last holder writes in place
    full = BlockTable()
    bm.allocate(full, 0, 8)
    kid = bm.fork(full)
    assert bm.allocate(kid, 8, 1) == [] and kid.blocks[:2] == full.blocks  # full blocks are never copied


def test_cost_is_what_allocate_takes():
    rng = random.Random(0)
    bm = BlockManager(64, BS)
    live: list[tuple[BlockTable, list[int]]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4 or not live:
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            keys = block_keys(toks, BS)
            hit = bm.match(keys, len(toks) - 1)
            t = BlockTable()
            n = len(toks) - len(hit) * BS
            need = bm.cost(t, 0, n, hit)
            if need <= bm.num_free:
                before = bm.num_free
                bm.allocate(t, 0, n, hit)
                assert before - bm.num_free == need
                t.keys[:] = keys[:len(hit)]
                bm.register(t, keys[len(hit):])
                live.append((t, toks))
        elif op < 0.7:
            t, toks = live[rng.randrange(len(live))]
            if rng.random() < 0.3:
                kid = bm.fork(t)
                live.append((kid, list(toks)))
                t = kid
            need = bm.cost(t, len(toks), 1)
            if need <= bm.num_free:
                before = bm.num_free
                bm.allocate(t, len(toks), 1)
                assert before - bm.num_free == need
                toks.append(rng.randrange(3))
        else:
            t, _ = live.pop(rng.randrange(len(live)))
            bm.free(t)
        assert bm.num_used == sum(1 for r in bm.ref if r > 0)
    for t, _ in live:
        bm.free(t)
    assert bm.num_free == 64 and max(bm.ref) == 0
