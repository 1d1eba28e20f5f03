"""KV caches (contiguous and paged): prefilling prompts and then decoding token by token gives the logits of one
full forward of the whole sequences, for a batch of sequences of different lengths, with and without sliding-window
layers; paged with blocks smaller than the sequences and block tables out of order. Mistakes in planning a step
raise one clear line."""

import dataclasses

import pytest
import torch

from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.kv_cache import (ContiguousKVCache, PagedKVCache, alloc_contiguous_cache,
                                             alloc_paged_cache, plan_step)
from titan_mm.models.qwen3.config import FLAVORS
from titan_mm.models.qwen3.model import Qwen3Model

LENS = (11, 8)  # full length of each sequence
BLOCK = 2  # paged: tokens per block, fewer than any sequence
TABLES = [[9, 3, 14, 0, 7, 11], [5, 12, 1, 8, -1, -1]]  # out of order; -1: not needed by sequence 1
# new tokens per sequence and step: prompts of 6 and 3 tokens, then one token per sequence at a time
DECODE = [[6, 3]] + [[1, 1]] * 5
# chunked prefill next to decoding, and an idle (finished) sequence in the last step
MIXED = [[6, 3], [2, 1], [1, 1], [1, 1], [1, 1], [0, 1]]


def tiny_model(window: bool) -> Qwen3Model:
    win = dict(use_sliding_window=True, sliding_window=3, max_window_layers=2) if window else {}
    cfg = dataclasses.replace(FLAVORS["debug"], vocab_size=256, **win)
    torch.manual_seed(0)
    m = Qwen3Model(cfg)
    m.init_weights()
    return m.eval()


def make_cache(model, layout):
    c = model.cfg
    if layout == "contiguous":
        return alloc_contiguous_cache(c.num_hidden_layers, len(LENS), max(LENS), c.num_key_value_heads, c.head_dim)
    return alloc_paged_cache(c.num_hidden_layers, 16, BLOCK, c.num_key_value_heads, c.head_dim)


def sequences():
    ids = torch.randint(0, 256, (len(LENS), max(LENS)), generator=torch.Generator().manual_seed(1))
    for b, n in enumerate(LENS):
        ids[b, n:] = 0  # padding after the shorter sequence (causal: it changes nothing before it)
    return ids


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("schedule", [DECODE, MIXED], ids=["prefill+decode", "mixed"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@torch.no_grad()
def test_cached_steps_equal_one_full_forward(layout, schedule, window):
    model = tiny_model(window)
    win = model.cfg.attn_sliding_window
    ids = sequences()
    full = model(ids, attn=build_attn_meta({"input_ids": ids}, "sdpa", "cpu", sliding_window=win)).logits

    cache = make_cache(model, layout)
    tables = {"block_tables": TABLES} if layout == "paged" else {}
    done = [0] * len(LENS)
    for new in schedule:
        cache = plan_step(cache, new, sliding_window=win, **tables)
        st = cache.step
        step_ids = torch.zeros(st.positions.shape, dtype=torch.long)
        for b, n in enumerate(new):
            step_ids[b, :n] = ids[b, done[b]:done[b] + n]
        meta = build_attn_meta({"input_ids": step_ids}, "sdpa", "cpu", sliding_window=win, kv_cache=cache)
        out = model(step_ids, position_ids=st.positions, attn=meta)
        assert out.kv_cache is cache and torch.isfinite(out.logits).all()  # padding rows too (no NaN)
        for b, n in enumerate(new):
            torch.testing.assert_close(out.logits[b, :n], full[b, done[b]:done[b] + n], atol=1e-5, rtol=0,
                                       msg=lambda m: f"sequence {b}, positions {done[b]}..{done[b] + n - 1}: {m}")
            done[b] += n
        cache = out.kv_cache
    assert done == list(LENS) and cache.seq_lens.tolist() == list(LENS)


def packed_steps(model, ids, schedule, layout, varlen=False, no_sync=False):
    """Run ``schedule`` as packed steps (every sequence's new tokens back to back in one row); -> per step and
    sequence the logits of its new tokens, and the last cache."""
    c, win, dev = model.cfg, model.cfg.attn_sliding_window, ids.device
    dtype = next(model.parameters()).dtype
    cache = (alloc_contiguous_cache(c.num_hidden_layers, len(LENS), max(LENS), c.num_key_value_heads, c.head_dim,
                                    dtype, dev) if layout == "contiguous" else
             alloc_paged_cache(c.num_hidden_layers, 16, BLOCK, c.num_key_value_heads, c.head_dim, dtype, dev))
    tables = {"block_tables": TABLES} if layout == "paged" else {}
    done, got = [0] * len(LENS), []
    for new in schedule:
        cache = plan_step(cache, new, sliding_window=win, packed=True, varlen=varlen, **tables)
        row = torch.cat([ids[b, done[b]:done[b] + n] for b, n in enumerate(new)])[None]
        assert cache.step.positions.shape == row.shape
        meta = build_attn_meta({"input_ids": row}, "sdpa", dev, sliding_window=win, kv_cache=cache)
        if no_sync:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(row, position_ids=cache.step.positions, attn=meta)
        finally:
            if no_sync:
                torch.cuda.set_sync_debug_mode(0)
        o, step = 0, []
        for b, n in enumerate(new):
            step.append((b, done[b], out.logits[0, o:o + n]))
            done[b] += n
            o += n
        got.append(step)
        cache = out.kv_cache
    assert done == list(LENS) and cache.seq_lens.tolist() == list(LENS)
    return got


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("schedule", [DECODE, MIXED], ids=["prefill+decode", "mixed"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@torch.no_grad()
def test_packed_steps_equal_one_full_forward(layout, schedule, window):
    """The same steps with every sequence's new tokens back to back in one row (plan_step(packed=True)): the
    block-diagonal causal mask over each sequence's cached and new keys gives the full forward's logits."""
    model = tiny_model(window)
    ids = sequences()
    full = model(ids, attn=build_attn_meta({"input_ids": ids}, "sdpa", "cpu",
                                           sliding_window=model.cfg.attn_sliding_window)).logits
    for step in packed_steps(model, ids, schedule, layout):
        for b, at, logits in step:
            torch.testing.assert_close(logits, full[b, at:at + len(logits)], atol=1e-5, rtol=0,
                                       msg=lambda m: f"sequence {b}, positions from {at}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@torch.no_grad()
def test_packed_varlen_steps_on_cuda_match_the_masked_steps(window):
    """bf16 on CUDA: the varlen kernel over cu_seqlens (queries aligned to the end of their sequence's keys, a
    cached prefix before them) gives the masked path's logits, with no host sync in the forward."""
    model = tiny_model(window).cuda().to(torch.bfloat16)
    ids = sequences().cuda()
    fast = packed_steps(model, ids, MIXED, "paged", varlen=True, no_sync=True)
    ref = packed_steps(model, ids, MIXED, "paged")
    for a, b in zip(fast, ref):
        for (s, at, x), (_, _, y) in zip(a, b):
            torch.testing.assert_close(x.float(), y.float(), atol=3e-2, rtol=3e-2,
                                       msg=lambda m: f"sequence {s}, positions from {at}: {m}")


def test_paged_writes_land_in_the_tables_blocks():
    """Each token's k/v lives at block_tables[b, p // block_size], offset p % block_size; other blocks stay empty."""
    model = tiny_model(False)
    cache = plan_step(make_cache(model, "paged"), [3, 2], block_tables=TABLES)
    ids = sequences()[:, :3]
    with torch.no_grad():
        model(ids, position_ids=cache.step.positions, attn=build_attn_meta({"input_ids": ids}, "sdpa", "cpu",
                                                                          kv_cache=cache))
    used = {(9, 0), (9, 1), (3, 0), (5, 0), (5, 1)}  # (block, offset) of seq 0 positions 0-2 and seq 1 positions 0-1
    for layer in range(model.cfg.num_hidden_layers):
        for pool in (cache.k[layer], cache.v[layer]):
            filled = {(blk, off) for blk in range(pool.shape[0]) for off in range(BLOCK) if pool[blk, off].any()}
            assert filled == used
    assert isinstance(cache, PagedKVCache) and cache.slot_mapping.tolist() == [18, 19, 6, 10, 11]


def test_contiguous_cache_layout():
    cache = plan_step(alloc_contiguous_cache(2, 2, 8, 1, 4), [3, 1])
    assert isinstance(cache, ContiguousKVCache) and cache.k[0].shape == (2, 8, 1, 4)
    assert cache.step.slot_mapping.tolist() == [0, 1, 2, 8] and cache.seq_lens.tolist() == [3, 1]
    nxt = plan_step(cache, [1, 1])
    assert nxt.step.positions.tolist() == [[3], [1]] and nxt.step.slot_mapping.tolist() == [3, 9]


def test_see_new_sets_which_new_tokens_each_new_token_sees():
    """plan_step(see_new=): the new tokens see each other as given (BAGEL's full image splits), every cached key
    stays visible, keys past a row's length stay hidden; a wrong shape, a packed step or spans beside it is one line."""
    see = torch.tensor([[True, True, False], [True, True, False], [True, True, True]])[None].expand(2, 3, 3)
    step = plan_step(alloc_contiguous_cache(1, 2, 8, 1, 4), [3, 2], cached_lens=[2, 0], see_new=see).step
    want0 = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(step.mask[0, 0], want0)  # row 0: 2 cached keys, then the 3 new ones as see_new says
    assert torch.equal(step.mask[1, 0, :2, :2], see[1, :2, :2]) and not step.mask[1, 0, :2, 2:].any()
    with pytest.raises(ValueError, match=r"see_new has shape \[2, 2, 2\]; give \[B, S, S\] = \[2, 3, 3\]"):
        plan_step(alloc_contiguous_cache(1, 2, 8, 1, 4), [3, 2], see_new=see[:, :2, :2])
    with pytest.raises(ValueError, match="see_new=...\\) plans a step of rows"):
        plan_step(alloc_contiguous_cache(1, 2, 8, 1, 4), [3, 2], see_new=see, packed=True)
    with pytest.raises(ValueError, match="spans \\(which make see_new\\) or see_new, not both"):
        plan_step(alloc_contiguous_cache(1, 2, 8, 1, 4), [3, 2], see_new=see, spans=torch.ones(2, 3, dtype=torch.long))


def test_step_planning_mistakes_are_refused():
    contiguous = alloc_contiguous_cache(2, 2, 4, 1, 4)
    paged = alloc_paged_cache(2, 4, 2, 1, 4)
    with pytest.raises(ValueError, match="row 0 would hold 5 tokens but the cache holds max_len=4"):
        plan_step(contiguous, [5, 1])
    with pytest.raises(ValueError, match="new_lens has 3 sequences but the cache holds 2; plan one new_lens entry"):
        plan_step(contiguous, [1, 1, 1])
    with pytest.raises(ValueError, match="contiguous cache has 2 rows but the step has 3 sequences"):
        plan_step(contiguous, [1, 1, 1], cached_lens=[0, 0, 0])
    with pytest.raises(ValueError, match="block_tables apply to a PagedKVCache only"):
        plan_step(contiguous, [1, 1], block_tables=[[0], [1]])
    with pytest.raises(ValueError, match="needs block_tables"):
        plan_step(paged, [1, 1])
    with pytest.raises(ValueError, match="sequence 0 needs 2 blocks of 2 tokens for 3 tokens"):
        plan_step(paged, [3, 1], block_tables=[[0], [1]])
    with pytest.raises(ValueError, match="names a block outside the pool of 4 blocks"):
        plan_step(paged, [1, 1], block_tables=[[0], [4]])
    with pytest.raises(ValueError, match="at least one new token"):
        plan_step(paged, [0, 0], block_tables=[[0], [1]])
    planned = plan_step(paged, [2, 1], block_tables=[[0], [1]])
    with pytest.raises(ValueError, match="new_lens has 3 sequences but the cache holds 2; pass cached_lens"):
        plan_step(planned, [1, 1, 1], block_tables=[[0], [1], [2]])
    batch = {"input_ids": torch.zeros(2, 2, dtype=torch.long)}
    with pytest.raises(ValueError, match="has no planned step"):
        build_attn_meta(batch, "sdpa", "cpu", kv_cache=paged)
    with pytest.raises(ValueError, match=r"batch has \[B, S\] = \[2, 3\] tokens but the cache step was planned"):
        build_attn_meta({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, "sdpa", "cpu", kv_cache=planned)
    with pytest.raises(ValueError, match="attends causally; kind 'bidirectional'"):
        build_attn_meta(batch, "sdpa", "cpu", kind="bidirectional", kv_cache=planned)
    with pytest.raises(ValueError, match="sliding_window=3 but the cache step was planned with None"):
        build_attn_meta(batch, "sdpa", "cpu", sliding_window=3, kv_cache=planned)


def test_a_cache_for_fewer_layers_than_the_model_is_refused():
    model = tiny_model(False)
    c = model.cfg
    cache = plan_step(alloc_contiguous_cache(2, 1, 4, c.num_key_value_heads, c.head_dim), [2])
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="layer 2 has no KV cache: the cache holds 2 layers"), torch.no_grad():
        model(ids, position_ids=cache.step.positions, attn=build_attn_meta({"input_ids": ids}, "sdpa", "cpu",
                                                                          kv_cache=cache))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_decode_step_on_cuda_without_host_sync(layout):
    model = tiny_model(True).cuda()
    win = model.cfg.attn_sliding_window
    c = model.cfg
    cache = (alloc_contiguous_cache(c.num_hidden_layers, 2, 16, c.num_key_value_heads, c.head_dim, device="cuda")
             if layout == "contiguous" else
             alloc_paged_cache(c.num_hidden_layers, 16, BLOCK, c.num_key_value_heads, c.head_dim, device="cuda"))
    tables = {"block_tables": TABLES} if layout == "paged" else {}
    ids = sequences().cuda()
    full = model(ids, attn=build_attn_meta({"input_ids": ids}, "sdpa", "cuda", sliding_window=win)).logits
    done = 0
    with torch.no_grad():
        for new in [[6, 6], [1, 1], [1, 1]]:
            cache = plan_step(cache, new, sliding_window=win, **tables)
            step_ids = ids[:, done:done + new[0]]
            meta = build_attn_meta({"input_ids": step_ids}, "sdpa", "cuda", sliding_window=win, kv_cache=cache)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = model(step_ids, position_ids=cache.step.positions, attn=meta)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.testing.assert_close(out.logits, full[:, done:done + new[0]], atol=1e-4, rtol=1e-4)
            done += new[0]
