"""The device-decided NaN skip (fused AdamW + found_inf) with DTensor parameters, over gloo on CPU: tiny Qwen3
under FSDP2 (dp_shard 2) and tensor parallelism (tp 2: DTensor and plain parameter groups), three train_step
calls with a NaN step in the middle. The device path (StepContext.device_skip=True) gives bitwise the same
StepResults, parameters and optimizer state as the host-decided path on every rank, and the NaN step leaves
parameters and state unchanged."""

import math

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import build_tiny_qwen3, make_packed_batches, tiny_qwen3_config

BATCHES = make_packed_batches(3, batch=4, seq=32, vocab=128, seed=5)


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run(world, dims, device_skip):
    from titan_mm.config import JobConfig
    from titan_mm.models.qwen3.plan import plan
    from titan_mm.observe.health import NanGuard
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.train.optim import build_lr_scheduler, build_param_groups, split_dtensor_groups, supports_found_inf
    from titan_mm.train.state import TrainState
    from titan_mm.train.step import StepContext, train_step
    from titan_mm.train.setup import data_parallel_groups

    pd = ParallelDims(world_size=world, **dims)
    mcfg = tiny_qwen3_config(False)
    model = build_tiny_qwen3(mcfg)
    parallelize(model, plan(mcfg), pd, JobConfig())
    dp_rank, dp_world, loss_group, count_group, loss_world = data_parallel_groups(pd)
    cfg = JobConfig()
    cfg.training.steps = 10
    o = cfg.optimizer
    opt = torch.optim.AdamW(split_dtensor_groups(build_param_groups(model, cfg)), lr=o.lr, betas=(o.beta1, o.beta2),
                            eps=o.eps, weight_decay=o.weight_decay, fused=True)
    assert supports_found_inf(opt)
    st = TrainState(model=model, optimizer=opt, scheduler=build_lr_scheduler(opt, cfg))
    ctx = StepContext(device=torch.device("cpu"), loss_group=loss_group, count_group=count_group, dp_world=dp_world,
                      loss_world=loss_world, nan_guard=NanGuard("skip", max_skipped=2), parallel_dims=pd,
                      device_skip=device_skip)
    names = {id(p): n for n, p in model.named_parameters()}
    results, unchanged = [], None
    for i, gb in enumerate(BATCHES):
        mb = {k: (v[dp_rank::dp_world] if v.dim() >= 2 else v) for k, v in gb.items()}
        mb["num_label_tokens"] = (mb["labels"] != -100).sum()
        ctx.inject_nan = i == 1
        before = ({n: _full(p) for n, p in model.named_parameters()},
                  {(names[id(p)], k): _full(v) for p, s in opt.state.items() for k, v in s.items()})
        res = train_step(st, [mb], ctx)
        assert not hasattr(opt, "found_inf")
        if i == 1:
            after = ({n: _full(p) for n, p in model.named_parameters()},
                     {(names[id(p)], k): _full(v) for p, s in opt.state.items() for k, v in s.items()})
            unchanged = all(torch.equal(before[j][k], after[j][k]) for j in (0, 1) for k in before[j])
        results.append((res.loss, res.aux_loss, res.grad_norm, res.lr, res.counts, res.tokens, res.skipped))
    params = {n: _full(p) for n, p in model.named_parameters()}
    state = {(names[id(p)], k): _full(v) for p, s in opt.state.items() for k, v in s.items()}
    return results, params, state, unchanged, st.nan_count


def _worker(rank, world, dims):
    return [_run(world, dims, ds) for ds in (True, False)]


@pytest.mark.parametrize("dims", [dict(dp_shard=2), dict(dp_shard=1, tp=2)], ids=["fsdp2", "tp2"])
def test_device_skip_bitwise_equal_to_host_path_with_dtensors(dims):
    for rank, (dev, host) in enumerate(run_multiproc(_worker, 2, args=(dims,))):
        for got in (dev, host):
            results, _, state, unchanged, nan_count = got
            assert unchanged and nan_count == 1, rank
            assert [r[-1] for r in results] == [False, True, False]
            assert {float(v) for (_, k), v in state.items() if k == "step"} == {2.0}
        (r1, p1, s1, _, _), (r0, p0, s0, _, _) = dev, host
        for a, b in zip(r1, r0):
            assert all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)), (a, b)
        assert p1.keys() == p0.keys() and s1.keys() == s0.keys()
        assert all(torch.equal(p1[k], p0[k]) for k in p1), rank
        assert all(torch.equal(s1[k], s0[k]) for k in s1), rank
