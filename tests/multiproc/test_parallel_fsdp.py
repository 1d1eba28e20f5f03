"""FSDP2 (and HSDP) over gloo: three SGD-momentum steps equal the world-1 run (stand-in model)."""

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import StandIn, assert_close_runs, make_batches, train_steps

from titan_mm.parallel.plan import ParallelizePlan

PLAN = ParallelizePlan(fsdp_units=("layers.*",), ac_units=("layers.*",), compile_units=("layers.*",))
BATCHES = make_batches(3, batch=4, seq=16, vocab=64)


class _Cfg:
    class activation_checkpoint:
        mode = "none"
        selective_option = "op"


def _step(model, b):
    return model(b["input_ids"], b["labels"])


def _reference(ac="none"):
    torch.manual_seed(0)
    model = StandIn()
    if ac != "none":
        from titan_mm.parallel.apply import apply_ac

        apply_ac(model, PLAN.ac_units, ac, "op")
    return train_steps(model, BATCHES, _step)


def _worker(rank, world, dims, ac):
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    torch.manual_seed(0)
    model = StandIn()
    pd = ParallelDims(world_size=world, **dims)
    cfg = _Cfg()
    cfg.activation_checkpoint.mode = ac
    parallelize(model, PLAN, pd, cfg)
    return train_steps(model, BATCHES, _step, dp_rank=rank, dp_size=world)


@pytest.mark.parametrize(
    "world,dims,ac",
    [(2, {}, "none"), (4, {"dp_replicate": 2}, "selective")],
    ids=["fsdp2", "hsdp2x2-sac"],
)
def test_fsdp_matches_world1(world, dims, ac):
    ref = _reference(ac)
    got = run_multiproc(_worker, world, args=(dims, ac))
    for r in got:
        assert_close_runs(ref, r)


def test_world1_without_process_group():
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    torch.manual_seed(0)
    model = parallelize(StandIn(), PLAN, ParallelDims(world_size=1), None)
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
    assert_close_runs(_reference(), train_steps(model, BATCHES, _step))
