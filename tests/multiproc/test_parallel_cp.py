"""Context parallelism (Ulysses, ring and all-gather KV, load-balanced, packed-document masks) over gloo, alone and
with fsdp, tp (SP + loss parallel) and ep: three SGD-momentum steps on tiny Qwen3 / Qwen3-MoE equal the world-1 run
(fp32, 1e-5)."""

import functools

import pytest
from _harness import run_multiproc
from _parallel_common import (build_tiny_qwen3, check_cells, make_packed_batches, qwen3_step, run_cells,
                              tiny_qwen3_config, train_steps)

BATCHES = make_packed_batches(3, batch=2, seq=32, vocab=128, seed=1)


@functools.lru_cache(maxsize=None)
def _reference(moe):
    return train_steps(build_tiny_qwen3(tiny_qwen3_config(moe)), BATCHES, qwen3_step)


def _cp_step(pd, mode):
    def step(model, b):
        from titan_mm.parallel.cp import prepare_cp_batch

        local, meta = prepare_cp_batch(b, pd, "sdpa", "cpu", mode=mode)
        return model(local["input_ids"], position_ids=local["position_ids"], attn=meta, labels=local["labels"]).loss_sum

    return step


def _run_cell(world, moe, dims, mode):
    from titan_mm.config import JobConfig
    from titan_mm.models.qwen3.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    cfg = tiny_qwen3_config(moe)
    model = build_tiny_qwen3(cfg)
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(cfg), pd, JobConfig())
    bm = pd.mesh("batch")
    return train_steps(model, BATCHES, _cp_step(pd, mode), dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                       loss_group=pd.mesh("loss").get_group())


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


# (launch id, world, cells); a cell is (name, moe, dims, cp_mode), the cells of a launch run one after another in the
# same processes. TP runs with SP and loss parallel (parallelize's defaults). Ulysses needs cp * tp to divide the kv
# heads (2 here), so cp x tp uses ring / all-gather.
LAUNCHES = [
    ("world2", 2, (
        ("cp2-ulysses", False, dict(dp_shard=1, cp=2), "ulysses"),
        ("cp2-ring", False, dict(dp_shard=1, cp=2), "ring"),
        ("cp2-ulysses-moe", True, dict(dp_shard=1, cp=2), "ulysses"),
        ("cp2-ring-moe", True, dict(dp_shard=1, cp=2), "ring"),
        ("cp2-allgather-moe", True, dict(dp_shard=1, cp=2), "allgather"),
    )),
    ("world4", 4, (
        ("fsdp2xcp2-ulysses", False, dict(dp_shard=2, cp=2), "ulysses"),
        ("fsdp2xcp2-ring", False, dict(dp_shard=2, cp=2), "ring"),
        ("fsdp2xcp2-ulysses-moe-ep2", True, dict(dp_shard=2, cp=2, ep=2), "ulysses"),
        ("fsdp2xcp2-ring-moe", True, dict(dp_shard=2, cp=2), "ring"),
        ("cp2xtp2-ring", False, dict(dp_shard=1, cp=2, tp=2), "ring"),
        ("cp2xtp2-allgather-moe-ep2", True, dict(dp_shard=1, cp=2, tp=2, ep=2), "allgather"),
    )),
]


@pytest.mark.parametrize("world,cells", [c[1:] for c in LAUNCHES], ids=[c[0] for c in LAUNCHES])
def test_cp_matches_world1(world, cells):
    got = run_multiproc(_worker, world, args=(cells,))
    check_cells(cells, got, lambda cell: _reference(cell[1]))
