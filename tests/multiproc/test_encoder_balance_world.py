"""parallel.encoder_balance on gloo: the debug Qwen3-VL (dense, cut as in test_parallel_vl.py) under FSDP over 2 ranks
and (slow suite) 4 ranks as fsdp4, hsdp 2x2 and fsdp2 x tp2 (with and without encoder_tp), with the vision tower's
images spread over the dp ranks by all-to-all (titan_mm/parallel/encoder_balance.py), gives the same losses, grad norms and every gradient (ViT, mergers, DeepStack included; fp32, 1e-5) over three
SGD-momentum steps as the world-1 run without it. The rows carry images of different sizes, a video and text-only
rows, so that images move (some out of order, so the restore permutation runs), ranks without images of their own
take part (and some receive images), one step has images on one rank only and one step has none anywhere (no
exchange, decided from the all-gathered grids on every rank). The micro-batches go through the train step's
host preparation (titan_mm.train.step.host_prepare with StepContext.encoder_balance)."""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import assert_close_runs, run_cells, train_steps
from test_parallel_vl import _build, _cfg, _select, _step

BIG = [("image", (8, 8)), ("text", 6)]  # 64 patches, 16 visual tokens
SMALL = [("image", (4, 4)), ("text", 6)]
VID = [("video", (2, 4, 4)), ("text", 4)]  # 2 temporal patches = 2 attention segments
TEXT = [("text", 14)]
STEPS = [  # 4 rows per step: rank r of a world-W run reads rows r::W
    [[BIG, SMALL], [TEXT, TEXT], [VID, SMALL], [SMALL, TEXT]],  # world 4: rank 0's big image goes first to rank 1
    [[BIG, VID], [TEXT, TEXT], [TEXT], [TEXT]],  # images on one rank only
    [[TEXT, TEXT], [TEXT], [TEXT, TEXT], [TEXT]],  # no images anywhere: no exchange
]


def _batches():
    from titan_mm.models.qwen3_vl.synthetic import make_sample, pack

    cfg = _cfg(False)
    out = []
    for s, rows in enumerate(STEPS):
        g = torch.Generator().manual_seed(s)
        out.append([pack([make_sample(cfg, segs, g) for segs in row], cfg, seq_len=48) for row in rows])
    return out


@functools.lru_cache(maxsize=None)
def _reference():
    return train_steps(_build(False), _batches(), _step, select=_select)


def _balanced_step(model, b, ctx, plans):
    """As titan_mm.train.step.forward_backward: _prepare (the family's prepare_batch with the exchange plan, then the
    attention metadata), every other batch key as a model input."""
    from titan_mm.train.step import NOT_MODEL_KWARGS, host_prepare

    b, meta = host_prepare(b, ctx)
    plans.append(b.get("vision_balance"))
    extra = {k: v for k, v in b.items() if k not in NOT_MODEL_KWARGS}
    return model(b["input_ids"], position_ids=b["position_ids"], attn=meta, labels=b["labels"], **extra).loss_sum


def _run_cell(world, dims, switches=None):
    from titan_mm.config import JobConfig, Parallel
    from titan_mm.models.qwen3_vl.model import prepare_batch
    from titan_mm.models.qwen3_vl.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.encoder_balance import balance_group, balance_planner
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.train.step import StepContext

    model = _build(False)
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(_cfg(False)), pd, JobConfig(parallel=Parallel(encoder_balance=True, **(switches or {}))))
    ctx = StepContext(device=torch.device("cpu"), prepare_batch=functools.partial(prepare_batch, model.cfg),
                      encoder_balance=balance_planner(balance_group(pd)))
    plans = []
    bm = pd.mesh("batch")
    run = train_steps(model, _batches(), functools.partial(_balanced_step, ctx=ctx, plans=plans),
                      dp_rank=bm.get_local_rank(), dp_size=bm.size(), loss_group=pd.mesh("loss").get_group(),
                      select=_select)
    summary = [None if p is None else (p.moves, p.send_index is not None, sum(p.send_splits), sum(p.recv_splits),
                                       max(p.cost_before) * len(p.cost_before) / sum(p.cost_before),
                                       max(p.cost_after) * len(p.cost_after) / sum(p.cost_after)) for p in plans]
    return run, summary, bm.get_local_rank()


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


# (world, cells): a cell is (name, ParallelDims degrees[, parallel switches]); the cells of a launch run one after
# another in the same processes. World 4 (HSDP too) is in the slow suite, world 2 is its quick sibling.
LAUNCHES = [
    pytest.param(2, (("fsdp2", dict(dp_shard=2)),), id="world2"),
    pytest.param(4, (("fsdp4", dict(dp_shard=4)), ("hsdp2x2", dict(dp_replicate=2, dp_shard=2)),
                     ("fsdp2xtp2", dict(dp_shard=2, tp=2)),  # sequence and loss parallel on, the ViT replicated
                     ("fsdp2xtp2-encodertp", dict(dp_shard=2, tp=2), dict(encoder_tp=True))),
                 id="world4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world,cells", LAUNCHES)
def test_encoder_balance_matches_world1(world, cells):
    per_rank = run_multiproc(_worker, world, args=(cells,), timeout_s=600)
    ref = _reference()
    for i, (name, *_) in enumerate(cells):
        _check(world, name, ref, [r[i] for r in per_rank])


def _check(world, name, ref, got):
    for rank, (run, summary, _) in enumerate(got):
        try:
            assert_close_runs(ref, run)
        except AssertionError as e:
            raise AssertionError(f"cell {name!r}, rank {rank}: {e}") from None
        assert summary[0][0], f"rank {rank}: step 0 moved no image"
        assert summary[0][5] < summary[0][4], f"rank {rank}: step 0 not better balanced: {summary[0]}"
        assert summary[2] is None, f"rank {rank}: an exchange was planned for a batch without images"
    # a rank without images of its own received some in step 1 (dp rank 1: the video), and dp rank 0 sent out of
    # order (dp 4, step 0: its 8x8 image before its 4x4 one)
    by_dp = {dp: summary for _, summary, dp in got}
    assert by_dp[1][1][3] > 0 and by_dp[1][1][2] == 0
    if len(by_dp) == 4:
        assert by_dp[0][0][1]
    s0, s1 = by_dp[0][0], by_dp[0][1]
    print(f"world {world} {name}: max/mean ViT cost before -> after, step 0: {s0[4]:.2f} -> {s0[5]:.2f}; "
          f"step 1: {s1[4]:.2f} -> {s1[5]:.2f}")
