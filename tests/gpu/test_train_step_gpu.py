"""The device-decided NaN skip on CUDA (fused AdamW's found_inf, titan_mm.train.step): the same run as the
host-decided path, bit for bit, with a NaN step in the middle that leaves parameters and AdamW state alone.
The CPU tests (tests/unit/test_train_step.py) run torch's fused CPU AdamW; this is the optimizer the trainer
builds on the GPU (titan_mm.train.optim.build_optimizer: fused=True on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.adamw_bound import assert_adamw_close
from titan_mm.config import JobConfig
from titan_mm.observe.health import NanGuard
from titan_mm.registry import get_model_spec
from titan_mm.train.optim import build_lr_scheduler, build_optimizer, supports_found_inf
from titan_mm.train.state import TrainState
from titan_mm.train.step import StepContext, train_step
from titan_mm.train.synthetic import SyntheticLoader

pytestmark = pytest.mark.gpu
VOCAB = 256


def _run(device_skip: bool, nan_at: int):
    dev = torch.device("cuda")
    spec = get_model_spec("qwen3")
    cfg = spec.flavors["debug"].replace(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=64,
                                        intermediate_size=128, head_dim=16)
    torch.manual_seed(0)
    with dev:
        m = spec.build(cfg)
        m.init_weights()
    jc = JobConfig()
    jc.training.steps = 10
    opt = build_optimizer(m, jc)
    assert supports_found_inf(opt), "build_optimizer should give fused AdamW on CUDA"
    st = TrainState(model=m, optimizer=opt, scheduler=build_lr_scheduler(opt, jc))
    guard = NanGuard("skip", max_skipped=2)
    it = iter(SyntheticLoader(vocab_size=VOCAB, seq_len=32, micro_batch_size=2, n_micro=1, seed=0))
    out = []
    for i in range(4):
        ctx = StepContext(device=dev, nan_guard=guard, device_skip=device_skip, inject_nan=i == nan_at)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        res = train_step(st, [next(it)], ctx)
        if i == nan_at:
            assert res.skipped and math.isnan(res.loss)
            for n, p in m.named_parameters():
                assert torch.equal(p.detach(), before[n]), f"the NaN step changed {n}"
        out.append((res.loss, res.grad_norm, res.skipped))
    steps = {float(s["step"]) for s in opt.state.values()}
    return out, {n: p.detach().clone() for n, p in m.named_parameters()}, st.nan_count, steps


def test_device_skip_matches_host_path_on_cuda():
    r1, p1, n1, s1 = _run(True, nan_at=1)
    r0, p0, n0, s0 = _run(False, nan_at=1)
    assert n1 == n0 == 1
    assert s1 == s0 == {3.0}, (s1, s0)  # 4 steps, one skipped: AdamW's step counts restored on the device
    assert len(r1) == len(r0) and all(
        (math.isnan(a[0]) and math.isnan(b[0])) or a == b for a, b in zip(r1, r0)), (r1, r0)
    for n in p0:
        assert torch.equal(p1[n], p0[n]), n


def _train_losses(tmp_path, name: str, *extra: str, checkpoint: bool = False, tune: bool = False,
                  overrides: str = '{"vocab_size": 256}') -> list[tuple[float, float]]:
    """(loss, grad norm) of 4 logged steps of debug_qwen3 through run_train.sh (bf16 params, compile, synthetic).
    Without ``tune`` the kernels run their default launch configs (TITAN_KERNELS_TUNE=0): the tuner's timed picks
    can differ between processes and with them a reduction's order. Two tuned runs of one config differed by one
    ulp in a loss on the H200 (2026-12-03)."""
    import os
    import subprocess
    from pathlib import Path

    from titan_mm.observe.metrics import read_metrics

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               TITAN_KERNELS_TUNE="1" if tune else "0")
    args = ["--config", "debug_qwen3", "--job.dump_folder", str(tmp_path / name), "--training.steps", "4",
            "--model.overrides", overrides, "--data.dataset", "synthetic", "--data.seq_len", "64",
            "--training.param_dtype", "bfloat16", "--compile.enable", "True", "--checkpoint.enable", str(checkpoint),
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "False", *extra]
    r = subprocess.run([str(root / "run_train.sh"), *args], capture_output=True, text=True, env=env, cwd=root,
                       timeout=300)
    assert r.returncode == 0, (name, r.stderr[-3000:])
    rows = read_metrics(tmp_path / name / "debug_qwen3" / "metrics.jsonl")
    out = [(rows[s]["loss"], rows[s]["grad_norm"]) for s in sorted(rows)]
    assert len(out) == 4 and all(math.isfinite(x) for x, _ in out), out
    return out


def test_fsdp_reshard_policies_train_the_same_on_cuda(tmp_path):
    """parallel.fsdp_reshard_after_forward only changes when FSDP2 frees and re-gathers the bf16 params, never
    their values: the trainer (FSDP2 on a 1-GPU mesh, bf16 params, float8 linears with the scale precompute,
    compile) logs bit-identical losses and grad norms under always and never."""
    runs = {policy: _train_losses(tmp_path, policy, "--float8.enable", "True", "--parallel.one_rank_mixed_precision",
                                  "fsdp", "--parallel.fsdp_reshard_after_forward", policy)
            for policy in ("always", "never")}
    assert runs["never"] == runs["always"], runs


def test_one_rank_cast_trains_as_fsdp_on_cuda(tmp_path):
    """The one-rank cast path (the default on one GPU: titan_mm.parallel.apply.apply_param_cast) logs the losses
    and grad norms of FSDP2's mixed precision bit for bit (bf16, compile, kernels). With float8 its weights reach
    the float8 cast through bf16 (FSDP2 gathers them in float8 from fp32), so there it is close, not equal."""
    cast = _train_losses(tmp_path, "cast")
    fsdp = _train_losses(tmp_path, "fsdp", "--parallel.one_rank_mixed_precision", "fsdp")
    assert cast == fsdp, (cast, fsdp)
    f8_cast = _train_losses(tmp_path, "f8_cast", "--float8.enable", "True")
    f8_fsdp = _train_losses(tmp_path, "f8_fsdp", "--float8.enable", "True", "--parallel.one_rank_mixed_precision",
                            "fsdp")
    for (a, _), (b, _) in zip(f8_cast, f8_fsdp):
        assert abs(a - b) < 2e-2 * abs(b), (f8_cast, f8_fsdp)


def test_resume_launches_the_checkpointed_kernel_picks(tmp_path):
    """A tuned run's checkpoint carries its kernels' launch configs (TrainState.extra["kernel_picks"]), and the run
    resumed from it launches them: resumed from step 2 without any timing of its own (TITAN_KERNELS_TUNE=0), it
    logs steps 3 and 4 bit for bit as the tuned run did."""
    first = _train_losses(tmp_path, "run", "--checkpoint.interval", "2", checkpoint=True, tune=True)
    again = _train_losses(tmp_path, "run", "--checkpoint.interval", "2", "--checkpoint.load_step", "2",
                          checkpoint=True)
    assert again == first, (first, again)


def test_optimizer_owned_copies_train_as_cast_on_cuda(tmp_path):
    """parallel.one_rank_mixed_precision = optimizer through the trainer (CastAdamW, the clip over the kept bf16
    gradients): MLP weights of 2^20 elements take the kept path, the rest torch's fused AdamW; the first step's
    loss and grad norm are the cast path's, the later ones close (another AdamW kernel). Resumed from its step-2
    checkpoint (no copies kept yet: the first forward casts the loaded weights) it logs steps 3 and 4 bit for bit."""
    wide = '{"vocab_size": 256, "hidden_size": 1024, "intermediate_size": 1024}'
    mode = ("--parallel.one_rank_mixed_precision", "optimizer", "--checkpoint.interval", "2")
    cast = _train_losses(tmp_path, "cast", overrides=wide)
    mine = _train_losses(tmp_path, "optimizer", *mode, overrides=wide, checkpoint=True)
    print("cast", cast, "optimizer", mine)
    assert mine[0][0] == cast[0][0] and abs(mine[0][1] - cast[0][1]) < 1e-5 * cast[0][1], (cast, mine)
    for (a, ga), (b, gb) in zip(mine, cast):
        assert abs(a - b) < 1e-2 * abs(b) and abs(ga - gb) < 5e-2 * gb, (cast, mine)
    again = _train_losses(tmp_path, "optimizer", *mode, "--checkpoint.load_step", "2", overrides=wide,
                          checkpoint=True)
    assert again == mine, (mine, again)


def test_cast_adamw_kernel_matches_fused_adamw_on_cuda():
    """titan_mm.kernels.adamw_step_'s Triton pass against torch's fused AdamW on an 8B MLP weight's size: fp32
    parameters and moments within rounding, the bf16 copy the parameter rounded to nearest, no host sync; its time
    against torch's fused step plus the cast it replaces is printed (bench/mfu.py's titan_optcast rows time the step)."""
    from titan_mm.kernels import adamw_step_
    from bench.attention import bench as cuda_ms  # median CUDA-event ms of fn()

    torch.manual_seed(0)
    n = 12288 * 4096
    p = torch.randn(n, device="cuda") * 0.02
    q = torch.nn.Parameter(p.clone())
    ref = torch.optim.AdamW([q], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step, copy = torch.zeros((), device="cuda"), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(3.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            g = (torch.randn(n, device="cuda") * 1e-3).to(torch.bfloat16)
            q.grad = g.float()
            ref.grad_scale = scale
            ref.step()
            step += 1
            adamw_step_(p, g, m, v, copy, step, 1e-3, 0.9, 0.95, 1e-8, 0.1, grad_scale=scale)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        del ref.grad_scale
    assert_adamw_close(p, q, 1e-3, (0.9, 0.95), steps=3)  # the bound derived in tests/adamw_bound.py
    # the moments near zero cancel: their last bits are relative to the largest (1.5e-11 of ~3e-5 on the H200)
    for mine_t, theirs in ((m, ref.state[q]["exp_avg"]), (v, ref.state[q]["exp_avg_sq"])):
        torch.testing.assert_close(mine_t, theirs, rtol=1e-5, atol=1e-6 * float(theirs.abs().max()))
    assert torch.equal(copy, p.to(torch.bfloat16))
    found = torch.ones((), device="cuda")
    before = p.clone()
    adamw_step_(p, g, m, v, copy, step, 1e-3, 0.9, 0.95, 1e-8, 0.1, found_inf=found)
    assert torch.equal(p, before)
    mine = cuda_ms(lambda: adamw_step_(p, g, m, v, copy, step, 1e-3, 0.9, 0.95, 1e-8, 0.1))
    theirs = cuda_ms(lambda: (ref.step(), copy.copy_(q.detach())))
    print(f"adamw_step_ {mine:.2f} ms ({n * 28 / mine / 1e9:.2f} TB/s), fused AdamW + cast {theirs:.2f} ms")


def test_count_reduce_runs_beside_the_compute_stream(tmp_path):
    """reduce_counts (the step's loss-term counts summed over the dp ranks) on NCCL: the right sums, read on the host
    while the compute stream is still busy: it does not queue behind the previous step's work."""
    import torch.distributed as dist

    from titan_mm.train.step import reduce_counts

    dev = torch.device("cuda", torch.cuda.current_device())  # init_process_group wants the index
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1, device_id=dev)
    try:
        assert reduce_counts([1, 2], dist.group.WORLD, dev) == [1, 2]  # the communicator's first use, synchronized
        torch.cuda.synchronize()
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        for _ in range(40):  # about 40 TFLOP queued on the compute stream
            a = a @ a.T
        got = reduce_counts([3, 5], dist.group.WORLD, dev)
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert got == [3, 5] and busy
    finally:
        dist.destroy_process_group()
