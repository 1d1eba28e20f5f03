"""Distributed Muon over gloo (titan_mm.train.muon): with FSDP2, TP, FSDP x TP, HSDP and EP, each matrix is
orthogonalized whole on its owner rank and scattered back, so the step equals single-device Muon.

* optimizer step: the same full gradients (distributed like the parameters) give the same parameters as the
  world-1 optimizer after two steps, within 1e-6 (fp32); momentum buffers are DTensors placed like their params
  (FSDP2, TP, replicate, on world 2; FSDP x TP, HSDP, FSDP x EP on world 4);
* training: three train steps on tiny Qwen3 / Qwen3-MoE with packed batches give the world-1 run's losses and
  gradients (1e-5) and parameters (1e-6);
* DCP: a checkpoint written by 2 FSDP ranks loads in 1 process (momentum resharded) and the next step equals the
  world-1 run's.
"""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import (assert_close_runs, build_tiny_qwen3, make_packed_batches, qwen3_step, run_cells,
                              tiny_qwen3_config, train_steps)

BATCHES = make_packed_batches(3, batch=4, seq=32, vocab=128)
LR = 2e-2


def _clean(name):
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _job():
    from titan_mm.config import JobConfig

    job = JobConfig()
    job.optimizer.name, job.optimizer.lr = "muon", LR
    return job


def _optimizer(model, cfg):
    from titan_mm.models.qwen3.plan import plan
    from titan_mm.train.optim import build_optimizer

    return build_optimizer(model, _job(), plan=plan(cfg))


def _grads(model, seed):
    """Full gradients by (clean) parameter name, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.01 for n, p in sorted(
        ((_clean(n), p) for n, p in model.named_parameters()), key=lambda x: x[0])}


def _set_grads(model, grads):
    from torch.distributed.tensor import DTensor, distribute_tensor

    for n, p in model.named_parameters():
        g = grads[_clean(n)]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()


def _opt_steps(model, opt, seeds):
    for s in seeds:
        _set_grads(model, _grads(model, s))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {_clean(n): _full(p) for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _reference(moe, train, n_steps=2):
    cfg = tiny_qwen3_config(moe)
    model = build_tiny_qwen3(cfg)
    opt = _optimizer(model, cfg)
    if train:
        run = train_steps(model, BATCHES, qwen3_step, opt=opt)
        return run, {n: p.detach().clone() for n, p in model.named_parameters()}
    return _opt_steps(model, opt, range(n_steps))


def _parallel_model(world, moe, dims):
    from titan_mm.models.qwen3.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    cfg = tiny_qwen3_config(moe)
    model = build_tiny_qwen3(cfg)
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(cfg), pd, _job())
    return model, _optimizer(model, cfg), pd


def _run_cell(world, moe, dims, train):
    from torch.distributed.tensor import DTensor

    model, opt, pd = _parallel_model(world, moe, dims)
    if not train:
        params = _opt_steps(model, opt, range(2))
        for g in opt.param_groups:  # momentum buffers are sharded like their parameters
            for p in g["params"]:
                if g["algo"] == "muon":
                    buf = opt.state[p]["momentum_buffer"]
                    assert type(buf) is type(p) and (not isinstance(p, DTensor) or buf.placements == p.placements)
        return params
    bm = pd.mesh("batch")
    run = train_steps(model, BATCHES, qwen3_step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                      loss_group=bm.get_group(), opt=opt)
    return run, {_clean(n): _full(p) for n, p in model.named_parameters()}


def _save_cell(world, root):
    """Two optimizer steps on tiny Qwen3-MoE under FSDP over all ranks, then a blocking DCP save into ``root``."""
    from titan_mm.train.checkpoint import CheckpointManager
    from titan_mm.train.optim import build_lr_scheduler
    from titan_mm.train.state import TrainState

    model, opt, _ = _parallel_model(world, True, dict(dp_shard=world))
    _opt_steps(model, opt, range(2))
    state = TrainState(model=model, optimizer=opt, scheduler=build_lr_scheduler(opt, _job()))
    state.step = 2
    CheckpointManager(root, interval=1, async_mode="disabled").save(state)


def _worker(rank, world, cells, root=None):
    out = run_cells(cells, functools.partial(_run_cell, world))
    if root is not None:  # in the same processes: a launch costs more than the cells
        _save_cell(world, root)
    return out


# (world, cells); a cell is (name, moe, dims, train)
LAUNCHES = {
    "world2": (2, (
        ("fsdp2-dense-step", False, dict(dp_shard=2), False),
        ("fsdp2-moe-step", True, dict(dp_shard=2), False),
        ("tp2-dense-step", False, dict(dp_shard=1, tp=2), False),
        # Shard(0) over a mesh dim of size 1 (like FSDP2 on one GPU) holds whole matrices: no gather
        ("replicate2-dense-step", False, dict(dp_replicate=2, dp_shard=1), False),
        ("fsdp2-moe-train", True, dict(dp_shard=2), True),
    )),
    "world4": (4, (
        ("fsdp2xtp2-dense-step", False, dict(dp_shard=2, tp=2), False),
        ("fsdp2xtp2-moe-step", True, dict(dp_shard=2, tp=2), False),
        ("hsdp2x2-dense-step", False, dict(dp_replicate=2, dp_shard=2), False),
        ("fsdp2xep2-moe-step", True, dict(dp_shard=4, ep=2), False),
        ("fsdp2xtp2-dense-train", False, dict(dp_shard=2, tp=2), True),
    )),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """The world-2 launch: its cells' results and the folder of the checkpoint it saved."""
    root = tmp_path_factory.mktemp("muon_ckpt")
    world, cells = LAUNCHES["world2"]
    return run_multiproc(_worker, world, args=(cells, str(root))), root


def _check(cells, got):
    for i, (name, moe, _, train) in enumerate(cells):
        ref = _reference(moe, train)
        for rank, per_cell in enumerate(got):
            res = per_cell[i]
            if train:
                assert_close_runs(ref[0], res[0])
                ref_params, params = ref[1], res[1]
            else:
                ref_params, params = ref, res
            assert set(params) == set(ref_params), name
            for n, p in params.items():
                torch.testing.assert_close(p, ref_params[n], atol=1e-6, rtol=0,
                                           msg=lambda m: f"cell {name!r}, rank {rank}, {n}: {m}")


def test_fsdp_tp_world2_matches_single_device(world2):
    _check(LAUNCHES["world2"][1], world2[0])


def test_fsdp_x_tp_hsdp_ep_world4_matches_single_device():
    world, cells = LAUNCHES["world4"]
    _check(cells, run_multiproc(_worker, world, args=(cells,)))


def test_dcp_reshard_2_to_1(world2):
    """Muon state written by 2 FSDP ranks (Shard(0) momentum DTensors) loads in one process; step 3 then equals
    the world-1 run of three steps."""
    from titan_mm.train.checkpoint import CheckpointManager
    from titan_mm.train.optim import build_lr_scheduler
    from titan_mm.train.state import TrainState

    cfg = tiny_qwen3_config(True)
    model = build_tiny_qwen3(cfg, seed=1)  # other weights: the checkpoint must overwrite them
    opt = _optimizer(model, cfg)
    state = TrainState(model=model, optimizer=opt, scheduler=build_lr_scheduler(opt, _job()))
    CheckpointManager(world2[1], interval=1, async_mode="disabled").resume(state)
    assert state.step == 2
    ref_model = build_tiny_qwen3(cfg)
    ref_opt = _optimizer(ref_model, cfg)
    _opt_steps(ref_model, ref_opt, range(2))
    n_bufs = 0
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if "momentum_buffer" in ref_opt.state[q]:
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                                       atol=1e-6, rtol=0)
            n_bufs += 1
    assert n_bufs == sum(len(g["params"]) for g in opt.param_groups if g["algo"] == "muon")
    got = _opt_steps(model, opt, [2])
    ref = _opt_steps(ref_model, ref_opt, [2])
    for n, p in got.items():
        torch.testing.assert_close(p, ref[n], atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")
