"""Context parallelism (Ulysses, ring and all-gather KV, load-balanced, packed-document masks) over gloo: three
SGD-momentum steps on tiny Qwen3 / Qwen3-MoE equal the world-1 run (fp32, 1e-5)."""

import functools

import pytest
from _harness import run_multiproc
from _parallel_common import (assert_close_runs, build_tiny_qwen3, make_packed_batches, qwen3_step, tiny_qwen3_config,
                              train_steps)

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


def _worker(rank, world, moe, dims, mode):
    from titan_mm.models.qwen3.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    cfg = tiny_qwen3_config(moe)
    model = build_tiny_qwen3(cfg)
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(cfg), pd, None)
    bm = pd.mesh("batch")
    return train_steps(model, BATCHES, _cp_step(pd, mode), dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                       loss_group=pd.mesh("loss").get_group())


CASES = [
    ("cp2-ulysses", 2, False, dict(dp_shard=1, cp=2), "ulysses"),
    ("cp2-ring", 2, False, dict(dp_shard=1, cp=2), "ring"),
    ("cp2-allgather-moe", 2, True, dict(dp_shard=1, cp=2), "allgather"),
    ("fsdp2xcp2-ulysses-moe-ep2", 4, True, dict(dp_shard=2, cp=2, ep=2), "ulysses"),
]


@pytest.mark.parametrize("name,world,moe,dims,mode", CASES, ids=[c[0] for c in CASES])
def test_cp_matches_world1(name, world, moe, dims, mode):
    got = run_multiproc(_worker, world, args=(moe, dims, mode))
    for r in got:
        assert_close_runs(_reference(moe), r)
