"""A DCP checkpoint (model + SGD momentum state) written under one topology resumes under another: Qwen3-MoE saved
after 2 steps under tp2 x ep2 (4 ranks, SP on) and loaded under ep2 (2 ranks) gives step 3 equal to the
uninterrupted world-1 run (loss, grad norm, gradients within 1e-5)."""

import tempfile

import torch
from _harness import run_multiproc
from _parallel_common import (assert_close_runs, build_tiny_qwen3, make_optimizer, make_packed_batches, qwen3_step,
                              tiny_qwen3_config, train_steps)

BATCHES = make_packed_batches(3, batch=4, seq=32, vocab=128, seed=3)


def _setup(world, dims):
    from titan_mm.models.qwen3.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    cfg = tiny_qwen3_config(True)
    model = build_tiny_qwen3(cfg, seed=1 if dims.get("tp", 1) == 1 else 0)  # the loader must overwrite weights
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(cfg), pd, None)
    return model, make_optimizer(model), pd.mesh("batch")


def _save_worker(rank, world, dims, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, bm = _setup(world, dims)
    out = train_steps(model, BATCHES[:2], qwen3_step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                      loss_group=bm.get_group(), opt=opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return out


def _load_worker(rank, world, dims, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, bm = _setup(world, dims)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return train_steps(model, BATCHES[2:], qwen3_step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                       loss_group=bm.get_group(), opt=opt)


def test_resume_under_another_topology():
    ref = train_steps(build_tiny_qwen3(tiny_qwen3_config(True)), BATCHES, qwen3_step)
    with tempfile.TemporaryDirectory() as d:
        saved = run_multiproc(_save_worker, 4, args=(dict(dp_shard=2, tp=2, ep=2), d))
        for r in saved:
            assert_close_runs(tuple(x[:2] for x in ref), r)
        resumed = run_multiproc(_load_worker, 2, args=(dict(dp_shard=2, ep=2), d))
    for r in resumed:
        assert_close_runs(tuple(x[2:] for x in ref), r)
