"""FSDP2 (and HSDP) over gloo: three SGD-momentum steps equal the world-1 run (stand-in model), with the
blocks' params freed after forward (the default) and kept (parallel.fsdp_reshard_after_forward = never), and with
explicit all-gather prefetch (parallel.fsdp_prefetch)."""

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import StandIn, assert_close_runs, make_batches, train_steps

from titan_mm.config import JobConfig
from titan_mm.parallel.plan import ParallelizePlan

PLAN = ParallelizePlan(fsdp_units=("layers.*",), ac_units=("layers.*",), compile_units=("layers.*",))
BATCHES = make_batches(3, batch=4, seq=16, vocab=64)


def _step(model, b):
    return model(b["input_ids"], b["labels"])


def _reference(ac="none"):
    torch.manual_seed(0)
    model = StandIn()
    if ac != "none":
        from titan_mm.parallel.apply import apply_ac

        apply_ac(model, PLAN.ac_units, ac, "op")
    return train_steps(model, BATCHES, _step)


def _worker(rank, world, dims, ac, reshard="always", prefetch=0):
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    torch.manual_seed(0)
    model = StandIn()
    pd = ParallelDims(world_size=world, **dims)
    cfg = JobConfig()
    cfg.activation_checkpoint.mode = ac
    cfg.parallel.fsdp_reshard_after_forward = reshard
    cfg.parallel.fsdp_prefetch = prefetch
    parallelize(model, PLAN, pd, cfg)
    # parallel.fsdp_prefetch: block 0 gathers block 1 ahead in its forward, block 1 block 0 in its backward
    blocks = [model.layers[str(i)]._get_fsdp_state() for i in range(2)]
    ahead = [[s._states_to_forward_prefetch, s._states_to_backward_prefetch] for s in blocks]
    assert ahead == ([[[blocks[1]], []], [[], [blocks[0]]]] if prefetch else [[[], []], [[], []]]), ahead
    # parallel.fsdp_reshard_after_forward reached every FSDP2 module: never = nothing freed after forward
    # (FSDP2 marks a module that keeps its params with post_forward_mesh_info None)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state()._fsdp_param_groups]
    assert len(groups) == 3, len(groups)  # 2 blocks + the root
    assert all((g.post_forward_mesh_info is None) == (reshard == "never") for g in groups), reshard
    return train_steps(model, BATCHES, _step, dp_rank=rank, dp_size=world)


@pytest.mark.parametrize(
    "world,dims,ac,reshard,prefetch",
    [(2, {}, "none", "always", 0), (2, {}, "none", "never", 0), (2, {}, "none", "always", 2),
     (4, {"dp_replicate": 2}, "selective", "always", 0)],
    ids=["fsdp2", "fsdp2-reshard-never", "fsdp2-prefetch2", "hsdp2x2-sac"],
)
def test_fsdp_matches_world1(world, dims, ac, reshard, prefetch):
    ref = _reference(ac)
    got = run_multiproc(_worker, world, args=(dims, ac, reshard, prefetch))
    for r in got:
        assert_close_runs(ref, r)


def test_world1_without_process_group():
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    torch.manual_seed(0)
    model = parallelize(StandIn(), PLAN, ParallelDims(world_size=1), JobConfig())
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
    assert_close_runs(_reference(), train_steps(model, BATCHES, _step))
