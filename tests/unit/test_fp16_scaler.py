"""float16 dynamic loss scaling (training.param_dtype = "float16", titan_mm.train.step.LossScaler) on CPU.

On CPU the model computes in float32 (titan_mm.parallel.apply), and the scaler runs the same path as on the GPU:
loss x scale backward, unscale before the clip, skip + backoff on non-finite gradients, growth after
growth_interval good steps, the scale saved with the ``train`` checkpoint item. Overflows are forced by a
gradient hook that writes inf; real float16 overflows are in tests/multiproc/test_fp16_scaler_multiproc.py
(FSDP2 with float16 params on gloo) and tests/gpu/test_fp16_gpu.py.
"""

import math

import pytest
import torch

from titan_mm.config import ConfigError, JobConfig, load_config
from titan_mm.observe.health import NanGuard, NonFiniteError
from titan_mm.registry import get_model_spec
from titan_mm.train.optim import build_lr_scheduler, build_optimizer, build_param_groups
from titan_mm.train.state import TrainState
from titan_mm.train.step import LossScaler, StepContext, train_step
from titan_mm.train.synthetic import SyntheticLoader

VOCAB = 128
CPU = torch.device("cpu")


def tiny_model(seed=0):
    spec = get_model_spec("qwen3")
    cfg = spec.flavors["debug"].replace(vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32,
                                        intermediate_size=64, head_dim=8)
    torch.manual_seed(seed)
    m = spec.build(cfg)
    m.init_weights()
    return m


def make_state(seed=0, scaler=None, fused=False, loader_seed=0):
    m = tiny_model(seed)
    cfg = JobConfig()
    cfg.training.steps = 20
    cfg.lr_scheduler.warmup_steps = 2
    if fused:  # torch's fused AdamW also runs on CPU: the device-decided skip (found_inf) path
        o = cfg.optimizer
        opt = torch.optim.AdamW(build_param_groups(m, cfg), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay, fused=True)
    else:
        opt = build_optimizer(m, cfg)
    loader = SyntheticLoader(vocab_size=VOCAB, seq_len=16, micro_batch_size=2, n_micro=2, seed=loader_seed)
    return TrainState(model=m, optimizer=opt, scheduler=build_lr_scheduler(opt, cfg), dataloader=loader,
                      scaler=scaler)


def steps(state, n, ctx, inf_at=()):
    """n train steps of 2 micro-batches from the state's loader; at steps (1-based) in ``inf_at`` a gradient
    hook turns one parameter's gradient into inf (the loss stays finite: an overflow, not a NaN loss)."""
    it = iter(state.dataloader)
    p0 = next(state.model.parameters())
    out = []
    for _ in range(n):
        hook = p0.register_hook(lambda g: torch.full_like(g, math.inf)) if state.step + 1 in inf_at else None
        out.append(train_step(state, [next(it), next(it)], ctx))
        if hook is not None:
            hook.remove()
    return out


def params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def opt_state(st):
    names = {id(p): n for n, p in st.model.named_parameters()}
    return {(names[id(p)], k): v.detach().clone() for p, s in st.optimizer.state.items() for k, v in s.items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_scaling_is_exact_without_overflow():
    """A power-of-two scale commutes with rounding: scaled backward + unscale gives bitwise the gradients, norms
    and updates of the unscaled run (2 micro-batches a step: the normalized loss is scaled once per backward),
    also across a growth of the scale."""
    ctx = StepContext(device=CPU, nan_guard=NanGuard("stop"))
    ref_state = make_state()
    ref = steps(ref_state, 4, ctx)
    st = make_state(scaler=LossScaler(CPU, init_scale=2.0**10, growth_interval=2))
    got = steps(st, 4, ctx)
    assert [r.loss_scale for r in ref] == [None] * 4
    assert [r.loss_scale for r in got] == [2.0**10, 2.0**10, 2.0**11, 2.0**11]
    assert [(r.loss, r.grad_norm, r.skipped) for r in got] == [(r.loss, r.grad_norm, r.skipped) for r in ref]
    assert_bitwise(params(st.model), params(ref_state.model))
    assert_bitwise(opt_state(st), opt_state(ref_state))


@pytest.mark.parametrize("fused", [False, True], ids=["host-skip", "device-skip"])
def test_overflow_skips_the_step_backs_off_and_grows_back(fused):
    """An inf gradient with a finite loss: the update is dropped (params and AdamW state bitwise unchanged, also
    on the fused found_inf path), the scale halves, the NaN guard is not involved (policy "stop" does not raise,
    nan_count stays 0), and growth_interval=2 good steps later the scale doubles."""
    guard = NanGuard("stop")
    ctx = StepContext(device=CPU, nan_guard=guard)
    st = make_state(scaler=LossScaler(CPU, init_scale=2.0**10, growth_interval=2), fused=fused)
    steps(st, 1, ctx)
    p_before, s_before = params(st.model), opt_state(st)
    over = steps(st, 1, ctx, inf_at=(2,))[0]
    assert over.skipped and math.isfinite(over.loss) and math.isinf(over.grad_norm)
    assert over.loss_scale == 2.0**10 and float(st.scaler.scale) == 2.0**9
    assert_bitwise(params(st.model), p_before)
    assert_bitwise(opt_state(st), s_before)
    assert st.step == 2 and st.nan_count == 0 and guard.nan_count == 0
    after = steps(st, 3, ctx)
    assert [r.loss_scale for r in after] == [2.0**9, 2.0**9, 2.0**10]
    assert not any(r.skipped for r in after) and all(math.isfinite(r.loss) for r in after)
    assert {float(s["step"]) for s in st.optimizer.state.values()} == {4.0}  # 5 steps, 1 skipped


def test_nan_loss_is_a_nan_policy_event_not_an_overflow(capsys):
    """A non-finite loss (before scaling) goes to training.nan_policy: "stop" raises, "skip" counts it in
    nan_count. Its gradients are not finite either, so the scale backs off as torch's GradScaler would."""
    st = make_state(scaler=LossScaler(CPU, init_scale=2.0**10))
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite loss=nan.*nan_policy='stop'"):
        train_step(st, [next(iter(st.dataloader))], StepContext(device=CPU, nan_guard=NanGuard("stop"),
                                                               inject_nan=True))
    st = make_state(scaler=LossScaler(CPU, init_scale=2.0**10))
    guard = NanGuard("skip")
    res = train_step(st, [next(iter(st.dataloader))], StepContext(device=CPU, nan_guard=guard, inject_nan=True))
    assert res.skipped and math.isnan(res.loss) and st.nan_count == 1 and guard.nan_count == 1
    assert res.loss_scale == 2.0**10 and float(st.scaler.scale) == 2.0**9
    assert "update skipped (training.nan_policy='skip')" in capsys.readouterr().err


def test_overflow_at_scale_one_stops_with_one_line():
    st = make_state(scaler=LossScaler(CPU, init_scale=1.0))
    with pytest.raises(NonFiniteError, match=r"step 1: float16 gradients overflow even at loss scale 1: .*"
                                             r"--training.param_dtype float32") as ei:
        steps(st, 1, StepContext(device=CPU, nan_guard=NanGuard("skip")), inf_at=(1,))
    assert "\n" not in str(ei.value)


def test_scale_and_growth_tracker_resume_bitwise(tmp_path):
    """Save at step 3 (scale 2**9 after an overflow at step 2, growth tracker 1), resume into a fresh state:
    the next 4 steps' losses, grad norms and scales equal the uninterrupted run's bitwise (the growth at step 4
    needs the restored tracker)."""
    from titan_mm.train.checkpoint import CheckpointManager

    ctx = StepContext(device=CPU, nan_guard=NanGuard("stop"))
    st = make_state(scaler=LossScaler(CPU, init_scale=2.0**10, growth_interval=2))
    head = steps(st, 3, ctx, inf_at=(2,))
    assert [r.skipped for r in head] == [False, True, False]
    assert st.scaler.state_dict() == {"scale": 2.0**9, "growth_tracker": 1}
    mgr = CheckpointManager(tmp_path, interval=1, async_mode="disabled")
    mgr.save(st)
    mgr.close()
    straight = [(r.loss, r.grad_norm, r.loss_scale) for r in steps(st, 4, ctx)]
    assert [s for _, _, s in straight] == [2.0**9, 2.0**10, 2.0**10, 2.0**11]

    fresh = make_state(seed=1, scaler=LossScaler(CPU, init_scale=2.0**16, growth_interval=2), loader_seed=0)
    assert CheckpointManager(tmp_path, interval=1).resume(fresh) == 3
    assert fresh.scaler.state_dict() == {"scale": 2.0**9, "growth_tracker": 1}
    assert [(r.loss, r.grad_norm, r.loss_scale) for r in steps(fresh, 4, ctx)] == straight


def test_precision_config_errors():
    cfg = load_config(["--training.param_dtype", "float16", "--training.reduce_dtype", "float16"])
    assert cfg.training.loss_scale_init == 2.0**16 and cfg.training.loss_scale_growth_interval == 2000
    bad = {
        ("--training.param_dtype", "float16", "--float8.enable", "True"):
            "training.param_dtype='float16' with float8.enable: float8 needs an SM>=89 GPU",
        ("--training.reduce_dtype", "float16"): "training.reduce_dtype='float16' needs training.param_dtype='float16'",
        ("--training.param_dtype", "float16", "--training.loss_scale_init", "0"):
            "training.loss_scale_init must be a positive finite number, got 0.0",
        ("--training.param_dtype", "float16", "--training.loss_scale_growth_interval", "0"):
            "training.loss_scale_growth_interval must be >= 1, got 0",
    }
    for argv, msg in bad.items():
        with pytest.raises(ConfigError) as ei:
            load_config(list(argv))
        assert msg in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


def test_trainer_logs_the_loss_scale(tmp_path):
    """The trainer with --training.param_dtype float16 on CPU: setup builds the scaler from [training], the loss
    falls, and metrics.jsonl has loss_scale every step."""
    from titan_mm.observe.metrics import read_metrics
    from titan_mm.launch.train import main

    args = ["--job.dump_folder", str(tmp_path), "--job.name", "fp16", "--training.steps", "4",
            "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
            "--data.seq_len", "32", "--metrics.enable_tensorboard", "False", "--checkpoint.enable", "False",
            "--training.param_dtype", "float16", "--training.loss_scale_init", "1024",
            "--training.loss_scale_growth_interval", "2", "--lr_scheduler.warmup_steps", "1"]
    assert main(args) == 0
    rows = read_metrics(tmp_path / "fp16" / "metrics.jsonl")
    assert [rows[s]["loss_scale"] for s in sorted(rows)] == [1024.0, 1024.0, 2048.0, 2048.0]
    assert [rows[s]["skipped"] for s in sorted(rows)] == [0, 0, 0, 0]
    assert rows[4]["loss"] < rows[1]["loss"]
