"""float16 loss scaling over gloo on CPU (2 ranks), tiny Qwen3 (titan_mm.train.step.LossScaler):

* an inf in ONE rank's local gradient shard skips the step on every rank and halves the scale everywhere, under
  FSDP2 (dp_shard 2) and under tensor parallelism (tp 2: DTensor and plain gradients side by side, the mix that
  torch.amp.GradScaler.unscale_ cannot take);
* real float16 compute: FSDP2 with float16 params (apply_fsdp asked for float16 directly; parallelize computes in
  float32 on CPU) overflows at a scale of 2**24, backs off step by step, then trains with finite losses.
"""

import math

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import build_tiny_qwen3, make_packed_batches, run_cells, tiny_qwen3_config

BATCHES = make_packed_batches(8, batch=4, seq=32, vocab=128, seed=5)
CELLS = [("fsdp2", dict(dp_shard=2), "inject"), ("tp2", dict(dp_shard=1, tp=2), "inject"),
         ("fsdp2-float16", dict(dp_shard=2), "float16")]


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run(dims, mode):
    from torch.distributed.tensor import DTensor, Shard

    from titan_mm.config import JobConfig
    from titan_mm.models.qwen3.plan import plan
    from titan_mm.observe.health import NanGuard
    from titan_mm.parallel.apply import apply_fsdp, parallelize
    from titan_mm.parallel.clip import clip_grad_norm_
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.train.optim import build_lr_scheduler, build_optimizer
    from titan_mm.train.setup import data_parallel_groups
    from titan_mm.train.state import TrainState
    from titan_mm.train.step import LossScaler, StepContext, train_step

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    pd = ParallelDims(world_size=world, **dims)
    mcfg = tiny_qwen3_config(False)
    model = build_tiny_qwen3(mcfg)
    dp_rank, dp_world, loss_group, count_group, loss_world = data_parallel_groups(pd)
    if mode == "float16":
        apply_fsdp(model, plan(mcfg), pd, param_dtype=torch.float16)
    else:
        parallelize(model, plan(mcfg), pd, JobConfig())
    dtypes = []
    model.tok_embeddings.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    cfg = JobConfig()
    cfg.training.steps = 20
    opt = build_optimizer(model, cfg)
    init = 2.0**24 if mode == "float16" else 2.0**10
    st = TrainState(model=model, optimizer=opt, scheduler=build_lr_scheduler(opt, cfg),
                    scaler=LossScaler(torch.device("cpu"), init_scale=init, growth_interval=1000))
    inject = []

    def clip(params, max_norm):  # the rank-local fault: one element of rank 0's shard of a sharded gradient
        params = list(params)  # (replicated gradients are the same reduced values on every rank)
        if inject and rank == 0:
            p = next(p for p in params if isinstance(p.grad, DTensor) and
                     any(isinstance(pl, Shard) for pl in p.grad.placements))
            p.grad._local_tensor.view(-1)[0] = math.inf
        return clip_grad_norm_(params, max_norm)

    ctx = StepContext(device=torch.device("cpu"), loss_group=loss_group, count_group=count_group, dp_world=dp_world,
                      loss_world=loss_world, nan_guard=NanGuard("stop"), parallel_dims=pd, clip_fn=clip)
    results, unchanged = [], None
    for i, gb in enumerate(BATCHES[: 3 if mode == "inject" else 8]):
        mb = {k: (v[dp_rank::dp_world] if v.dim() >= 2 else v) for k, v in gb.items()}
        mb["num_label_tokens"] = (mb["labels"] != -100).sum()
        inject[:] = [True] if (mode == "inject" and i == 1) else []
        before = {n: _full(p) for n, p in model.named_parameters()}
        res = train_step(st, [mb], ctx)
        if inject:
            unchanged = all(torch.equal(before[n], _full(p)) for n, p in model.named_parameters())
        results.append((res.loss, res.grad_norm, res.loss_scale, res.skipped))
    return results, unchanged, st.nan_count, float(st.scaler.scale), {str(d) for d in dtypes}


def _same(a, b) -> bool:
    """Nested equality where NaN equals NaN (an overflow's grad norm can be NaN: inf - inf in the backward)."""
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _worker(rank, world):
    return run_cells(CELLS, _run)


@pytest.mark.slow  # one launch of 2 gloo processes, three cells: 25-50 s on the shared 2-core machine
def test_fp16_scaler_over_gloo():
    got = run_multiproc(_worker, 2)
    for i, (name, _, mode) in enumerate(CELLS):
        (results, unchanged, nan_count, scale, dtypes) = got[0][i]
        assert _same(got[1][i][0], results), (name, got[1][i][0], results)  # every rank decided the same
        assert nan_count == 0 and got[1][i][2] == 0, name  # overflows are not NaN-policy events
        if mode == "inject":
            assert [r[3] for r in results] == [False, True, False], (name, results)
            assert not math.isfinite(results[1][1]) and math.isfinite(results[1][0]), (name, results)
            assert [r[2] for r in results] == [2.0**10, 2.0**10, 2.0**9] and scale == 2.0**9, name
            assert unchanged and got[1][i][1], name  # the skipped step changed no parameter on either rank
            assert dtypes == {"torch.float32"}, name
        else:
            assert dtypes == {"torch.float16"}, dtypes  # real float16 compute
            skipped = [r[3] for r in results]
            assert skipped[0] and not skipped[-1] and not all(skipped[-3:]), results
            for a, b in zip(results, results[1:]):  # each overflow halves the scale; good steps keep it
                assert b[2] == (a[2] / 2 if a[3] else a[2]), results
            assert all(math.isfinite(r[0]) for r in results)
            assert all(math.isfinite(r[1]) == (not r[3]) for r in results), results
