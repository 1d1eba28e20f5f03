"""A DCP checkpoint (model + SGD momentum state) written under one topology resumes under another: saved after 2
steps on 4 ranks, loaded on 2 ranks, step 3 equals the uninterrupted world-1 run (loss, grad norm, gradients within
1e-5). Qwen3-MoE: tp2 x ep2 (SP on) -> ep2. Qwen3-VL-MoE (the tiny image / video config of test_parallel_vl.py):
fsdp2 x cp2 (Ulysses) x ep2 -> tp2 (experts sharded over ep_fsdp x ep, then replicated over tp)."""

import functools
import os
import tempfile

from _harness import run_multiproc
from _parallel_common import (build_tiny_qwen3, check_cells, make_optimizer, make_packed_batches, qwen3_step,
                              run_cells, tiny_qwen3_config, train_steps)

import test_parallel_vl as vl

BATCHES = make_packed_batches(3, batch=4, seq=32, vocab=128, seed=3)
SAVE_WORLD, LOAD_WORLD = 4, 2

# (name, model, (dims, cp_mode) saved under at SAVE_WORLD ranks, (dims, cp_mode) resumed under at LOAD_WORLD ranks)
CASES = (
    ("qwen3_moe-tp2xep2-to-ep2", "qwen3_moe", (dict(dp_shard=2, tp=2, ep=2), None), (dict(dp_shard=2, ep=2), None)),
    ("qwen3_vl_moe-fsdp2xcp2xep2-to-tp2", "qwen3_vl_moe", (dict(dp_shard=2, cp=2, ep=2), "ulysses"),
     (dict(dp_shard=1, tp=2), None)),
)


def _setup(world, model_name, dims, mode, load):
    """-> (model, optimizer, steps(batches slice) -> train_steps result). ``load``: other random weights than the
    reference, so that the checkpoint must overwrite them."""
    from titan_mm.config import JobConfig
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    pd = ParallelDims(world_size=world, **dims)
    if model_name == "qwen3_moe":
        from titan_mm.models.qwen3.plan import plan

        cfg = tiny_qwen3_config(True)
        model = build_tiny_qwen3(cfg, seed=1 if load else 0)
        batches, step, select, p = BATCHES, qwen3_step, None, plan(cfg)
    else:
        from titan_mm.models.qwen3_vl.plan import plan

        model = vl._build(True, seed=1 if load else 0)
        batches, step, select, p = vl._batches(True), functools.partial(vl._step, pd=pd, mode=mode), vl._select, \
            plan(vl._cfg(True))
    parallelize(model, p, pd, JobConfig())
    opt = make_optimizer(model)
    bm = pd.mesh("batch")

    def steps(sl):
        return train_steps(model, batches[sl], step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                           loss_group=pd.mesh("loss").get_group(), select=select, opt=opt)

    return model, opt, steps


def _save(world, root, name, model_name, saved, resumed):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, steps = _setup(world, model_name, *saved, load=False)
    out = steps(slice(0, 2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, name))
    return out


def _load(world, root, name, model_name, saved, resumed):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, steps = _setup(world, model_name, *resumed, load=True)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(root, name))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return steps(slice(2, 3))


def _worker(rank, world, fn, root, cells):
    return run_cells(tuple((c[0], root, *c) for c in cells), functools.partial(fn, world))


@functools.lru_cache(maxsize=None)
def _reference(model_name):
    if model_name == "qwen3_moe":
        return train_steps(build_tiny_qwen3(tiny_qwen3_config(True)), BATCHES, qwen3_step)
    return vl._reference(True)


def test_resume_under_another_topology():
    with tempfile.TemporaryDirectory() as d:
        saved = run_multiproc(_worker, SAVE_WORLD, args=(_save, d, CASES), timeout_s=600)
        check_cells(CASES, saved, lambda c: tuple(x[:2] for x in _reference(c[1])))
        resumed = run_multiproc(_worker, LOAD_WORLD, args=(_load, d, CASES), timeout_s=600)
    check_cells(CASES, resumed, lambda c: tuple(x[2:] for x in _reference(c[1])))
