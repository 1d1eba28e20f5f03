"""The train step: global-token loss normalization, gradient accumulation, clipping, NaN policy."""

import math

import pytest
import torch

from titan_mm.config import JobConfig
from titan_mm.observe.health import NanGuard, NonFiniteError, StepTimes
from titan_mm.registry import get_model_spec
from titan_mm.train.optim import build_lr_scheduler, build_optimizer
from titan_mm.train.state import TrainState
from titan_mm.train.step import StepContext, forward_backward, train_step
from titan_mm.train.synthetic import SyntheticLoader, collate

VOCAB = 256


def tiny_model(seed=0, moe=False):
    spec = get_model_spec("qwen3")
    cfg = spec.flavors["debug_moe" if moe else "debug"].replace(
        vocab_size=VOCAB, num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16)
    torch.manual_seed(seed)
    m = spec.build(cfg)
    m.init_weights()
    return m


def batches(n_micro, mb=2, seq=32, seed=0):
    L = SyntheticLoader(vocab_size=VOCAB, seq_len=seq, micro_batch_size=mb, n_micro=n_micro, seed=seed)
    it = iter(L)
    return [next(it) for _ in range(n_micro)]


def merge(mbs):
    rows = []
    for b in mbs:
        for i in range(b["input_ids"].shape[0]):
            rows.append((b["input_ids"][i], b["labels"][i], b["position_ids"][i], b["doc_ids"][i]))
    return collate(rows)


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_loss_is_global_token_mean_not_mean_of_means():
    """Accumulating 2 micro-batches == one batch of all rows (sum CE / all label tokens)."""
    ctx = StepContext(device=torch.device("cpu"))
    mbs = batches(2)
    # make the micro-batches very unequal in label count, so a mean of means would differ
    mbs[1]["labels"][:, 4:] = -100
    mbs[1]["num_label_tokens"] = (mbs[1]["labels"] != -100).sum()
    n = {"ce": sum(int(b["num_label_tokens"]) for b in mbs)}
    m1 = tiny_model()
    loss1, _ = forward_backward(m1, mbs, ctx, n)
    g1 = grads(m1)
    m2 = tiny_model()
    big = merge(mbs)
    assert int(big["num_label_tokens"]) == n["ce"]
    loss2, _ = forward_backward(m2, [big], ctx, n)
    g2 = grads(m2)
    torch.testing.assert_close(loss1, loss2, rtol=1e-5, atol=1e-5)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6)


def _state(m):
    cfg = JobConfig()
    cfg.training.steps = 10
    opt = build_optimizer(m, cfg)
    return TrainState(model=m, optimizer=opt, scheduler=build_lr_scheduler(opt, cfg))


def test_train_step_updates_and_clips():
    m = tiny_model()
    st = _state(m)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ctx = StepContext(device=torch.device("cpu"), max_norm=1e-3, nan_guard=NanGuard("stop"))
    res = train_step(st, batches(2), ctx)
    assert st.step == 1 and not res.skipped
    assert math.isfinite(res.loss) and res.grad_norm > 1e-3  # pre-clip norm is reported
    assert res.counts["ce"] > 0 and res.tokens == 2 * 2 * 32 and res.terms == {"ce": res.loss}
    assert any(not torch.equal(before[n], p) for n, p in m.named_parameters())
    # after clipping the gradients were at most max_norm: the step is bounded by lr (Adam) anyway; check
    # the clip itself on a fresh backward
    from titan_mm.parallel.clip import clip_grad_norm_

    forward_backward(m, batches(1), ctx, {"ce": 10})
    clip_grad_norm_(m.parameters(), 1e-3)
    total = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in m.parameters() if p.grad is not None))
    assert float(total) <= 1e-3 * 1.001


def test_moe_aux_loss_is_added():
    m = tiny_model(moe=True)
    st = _state(m)
    res = train_step(st, batches(1), StepContext(device=torch.device("cpu")))
    assert res.aux_loss > 0


def test_nan_skip_keeps_weights_and_stop_raises():
    m = tiny_model()
    st = _state(m)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    guard = NanGuard("skip", max_skipped=1)
    ctx = StepContext(device=torch.device("cpu"), nan_guard=guard, inject_nan=True)
    res = train_step(st, batches(1), ctx)
    assert res.skipped and st.step == 1 and st.nan_count == 1 and guard.nan_count == 1
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
    with pytest.raises(NonFiniteError, match="2 steps in a row"):
        train_step(st, batches(1), ctx)
    st2 = _state(tiny_model())
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite loss=nan.*nan_policy='stop'"):
        train_step(st2, batches(1), StepContext(device=torch.device("cpu"), nan_guard=NanGuard("stop"), inject_nan=True))


def test_step_times_percentiles():
    t = StepTimes(skip_first=1)
    t.add(100.0)  # warmup (compile) step is left out once real steps arrive
    assert t.p50 == 100.0
    for x in [1.0, 2.0, 3.0, 4.0, 5.0]:
        t.add(x)
    assert t.p50 == 3.0 and abs(t.p90 - 4.6) < 1e-9


def test_after_optimizer_hook_runs_after_applied_steps_only():
    """StepContext.after_optimizer (float8.precompute_scale's hook) runs once per applied update, after it, and not
    after a step the NaN guard skipped."""
    m = tiny_model()
    st = _state(m)
    seen = []
    first = next(m.parameters())

    def hook():
        seen.append(first.detach().clone())

    before = first.detach().clone()
    train_step(st, batches(1), StepContext(device=torch.device("cpu"), after_optimizer=hook))
    assert len(seen) == 1 and not torch.equal(seen[0], before)  # called after the update
    ctx = StepContext(device=torch.device("cpu"), nan_guard=NanGuard("skip", max_skipped=2), inject_nan=True,
                      after_optimizer=hook)
    assert train_step(st, batches(1), ctx).skipped and len(seen) == 1


def test_float8_precompute_hook_config():
    from titan_mm.config import Float8
    from titan_mm.quant.float8 import float8_after_optimizer

    assert float8_after_optimizer(tiny_model(), Float8(enable=False, precompute_scale=True)) is None
    assert float8_after_optimizer(tiny_model(), Float8(enable=True, precompute_scale=False)) is None
    # no per-tensor scale with rowwise
    assert float8_after_optimizer(tiny_model(), Float8(enable=True, recipe="rowwise")) is None
    # precompute_scale defaults to on; it feeds FSDP's float8 all-gather, which the one-rank cast path does not use
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    for fsdp in (True, False):
        m = convert_to_float8_training(tiny_model(), config=Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp),
                                       module_filter_fn=lambda mod, fqn: mod.in_features % 16 == 0)
        assert callable(float8_after_optimizer(m, Float8(enable=True))) == fsdp


# ---------------------------------------------------------------- device-decided NaN skip (fused AdamW)
# titan_mm builds fused AdamW only on CUDA; torch's fused AdamW also runs on CPU, so these tests construct it
# directly and compare the device-skip path (StepContext.device_skip=True, the default) with the host-decided
# path (device_skip=False) on the same optimizer type.


def _fused_state(m):
    from titan_mm.train.optim import build_param_groups

    cfg = JobConfig()
    cfg.training.steps = 10
    o = cfg.optimizer
    opt = torch.optim.AdamW(build_param_groups(m, cfg), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, fused=True)
    return TrainState(model=m, optimizer=opt, scheduler=build_lr_scheduler(opt, cfg))


def _opt_state(st):
    """{(param name, state key): tensor clone} of the optimizer (exp_avg, exp_avg_sq, step)."""
    names = {id(p): n for n, p in st.model.named_parameters()}
    return {(names[id(p)], k): v.detach().clone() for p, s in st.optimizer.state.items() for k, v in s.items()}


def _params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _nan_eq(a, b) -> bool:
    """Equality of nested lists / tuples of values where NaN equals NaN."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_nan_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _result_values(res):
    return (res.loss, res.aux_loss, res.grad_norm, res.lr, res.counts, res.tokens, res.skipped)


def test_supports_found_inf():
    from titan_mm.train.optim import supports_found_inf

    m = tiny_model()
    assert not supports_found_inf(_state(m).optimizer)  # CPU: build_optimizer gives foreach AdamW
    opt = _fused_state(m).optimizer
    assert supports_found_inf(opt)
    opt.found_inf = torch.zeros(())  # driven by someone else (a GradScaler): leave it alone
    assert not supports_found_inf(opt)
    assert not supports_found_inf(torch.optim.SGD(m.parameters(), lr=0.1))


@pytest.mark.parametrize("moe", [False, True])
def test_device_skip_finite_steps_bitwise_equal_to_host_path(moe):
    runs = {}
    for device_skip in (True, False):
        m = tiny_model(moe=moe)
        st = _fused_state(m)
        ctx = StepContext(device=torch.device("cpu"), nan_guard=NanGuard("skip"), device_skip=device_skip)
        results = [_result_values(train_step(st, batches(2, seed=i), ctx)) for i in range(3)]
        assert not hasattr(st.optimizer, "found_inf") and st.nan_count == 0 and st.step == 3
        runs[device_skip] = (results, _params(m), _opt_state(st), st.scheduler.get_last_lr())
    (r1, p1, s1, lr1), (r0, p0, s0, lr0) = runs[True], runs[False]
    assert r1 == r0 and lr1 == lr0
    assert all(not r[-1] for r in r1)
    _assert_bitwise(p1, p0)
    _assert_bitwise(s1, s0)
    assert {float(v) for (_, k), v in s1.items() if k == "step"} == {3.0}


@pytest.mark.parametrize("nan_at", [0, 1])
def test_device_skip_nan_step_leaves_params_and_state_and_next_step_proceeds(nan_at):
    """A NaN step (inject_nan: NaN loss and gradients) on the device path: the fused kernel skips the update,
    params and exp_avg / exp_avg_sq / step are bitwise unchanged, the guard counts it, and the following
    finite steps give bitwise the same run as the host-decided path (which never calls opt.step there)."""
    runs = {}
    for device_skip in (True, False):
        m = tiny_model()
        st = _fused_state(m)
        guard = NanGuard("skip", max_skipped=2)
        results = []
        for i in range(3):
            ctx = StepContext(device=torch.device("cpu"), nan_guard=guard, device_skip=device_skip,
                              inject_nan=i == nan_at)
            if i == nan_at:
                p_before, s_before = _params(m), _opt_state(st)
            res = train_step(st, batches(1, seed=i), ctx)
            results.append(_result_values(res))
            if i == nan_at:
                assert res.skipped and math.isnan(res.loss)
                assert st.nan_count == 1 and guard.nan_count == 1 and st.step == i + 1
                assert not hasattr(st.optimizer, "found_inf")
                _assert_bitwise(_params(m), p_before)
                if device_skip and nan_at == 0:
                    # the skipped first opt.step() created zero state with step 0 (same as no state for Adam)
                    assert all(float(v.abs().max()) == 0.0 for v in _opt_state(st).values())
                else:
                    _assert_bitwise(_opt_state(st), s_before)
        assert st.step == 3 and st.nan_count == 1 and guard.skipped_in_a_row == 0
        runs[device_skip] = (results, _params(m), _opt_state(st))
    (r1, p1, s1), (r0, p0, s0) = runs[True], runs[False]
    assert _nan_eq(r1, r0)  # loss, aux, grad norm (NaN on the skipped step), lr, tokens, skipped
    _assert_bitwise(p1, p0)
    _assert_bitwise(s1, s0)
    assert {float(v) for (_, k), v in s1.items() if k == "step"} == {2.0}  # two applied updates


def test_device_skip_host_read_after_optimizer_step(monkeypatch):
    """On the device path nothing reads device values on the host between the clip and opt.step(); the
    statistics are read (tolist) after it. The host path reads, then steps."""
    from titan_mm.parallel.clip import clip_grad_norm_

    events = []
    orig_tolist, orig_cpu, orig_item = torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.item

    def rec(name, fn):
        def wrapper(self, *a, **k):
            events.append(name)
            return fn(self, *a, **k)
        return wrapper

    monkeypatch.setattr(torch.Tensor, "tolist", rec("tolist", orig_tolist))
    monkeypatch.setattr(torch.Tensor, "cpu", rec("cpu", orig_cpu))
    monkeypatch.setattr(torch.Tensor, "item", rec("item", orig_item))

    def clip(params, max_norm, scale=True):
        out = clip_grad_norm_(params, max_norm, scale=scale)
        events.append("clipped")
        return out

    for device_skip in (True, False):
        m = tiny_model()
        st = _fused_state(m)
        opt = st.optimizer
        seen_flag = []
        step = opt.step

        def recording_step(*a, **k):
            events.append("step")
            seen_flag.append(getattr(opt, "found_inf", None))
            return step(*a, **k)

        opt.step = recording_step
        events.clear()
        ctx = StepContext(device=torch.device("cpu"), nan_guard=NanGuard("skip"), clip_fn=clip,
                          device_skip=device_skip)
        res = train_step(st, batches(1), ctx)
        assert not res.skipped
        tail = events[events.index("clipped") + 1:]
        if device_skip:
            assert tail[0] == "step" and "tolist" in tail[1:], tail
            flag = seen_flag[0]
            assert flag is not None and flag.shape == () and flag.dtype == torch.float32 and float(flag) == 0.0
        else:
            assert tail.index("tolist") < tail.index("step"), tail
            assert seen_flag == [None]
        assert not hasattr(opt, "found_inf")


def test_device_skip_stop_policy_raises_same_message_without_update():
    msgs = {}
    for device_skip in (True, False):
        m = tiny_model()
        st = _fused_state(m)
        guard = NanGuard("stop")
        train_step(st, batches(1), StepContext(device=torch.device("cpu"), nan_guard=guard, device_skip=device_skip))
        p_before, s_before = _params(m), _opt_state(st)
        ctx = StepContext(device=torch.device("cpu"), nan_guard=guard, inject_nan=True, device_skip=device_skip)
        with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss=nan.*nan_policy='stop'") as ei:
            train_step(st, batches(1, seed=1), ctx)
        msgs[device_skip] = str(ei.value)
        _assert_bitwise(_params(m), p_before)
        _assert_bitwise(_opt_state(st), s_before)
        assert st.step == 1 and guard.nan_count == 1 and not hasattr(st.optimizer, "found_inf")
    assert msgs[True] == msgs[False]


def test_device_skip_without_guard_matches_host_path():
    """No NaN guard: nothing to decide, the device path only moves opt.step() before the host read (no
    found_inf is set), with bitwise the same result."""
    runs = {}
    for device_skip in (True, False):
        m = tiny_model()
        st = _fused_state(m)
        res = train_step(st, batches(2), StepContext(device=torch.device("cpu"), device_skip=device_skip))
        runs[device_skip] = (_result_values(res), _params(m), _opt_state(st))
    assert runs[True][0] == runs[False][0]
    _assert_bitwise(runs[True][1], runs[False][1])
    _assert_bitwise(runs[True][2], runs[False][2])


def test_fused_adamw_takes_the_clip_factor(monkeypatch):
    """With fused AdamW the clip factor reaches the kernel as opt.grad_scale (1 / factor) instead of a pass over
    the gradients: the same grad norms and, to rounding, the same parameters as scaling the gradients first; the
    attribute never outlives the step."""
    import titan_mm.train.step as step_mod

    runs = {}
    for fold in (True, False):
        if not fold:
            monkeypatch.setattr(step_mod, "supports_found_inf", lambda opt: False)
        m = tiny_model()
        st = _fused_state(m)
        ctx = StepContext(device=torch.device("cpu"), max_norm=0.05)  # small: every step clips
        norms = [train_step(st, mbs, ctx).grad_norm for mbs in (batches(1, seed=s) for s in range(3))]
        assert not hasattr(st.optimizer, "grad_scale")
        runs[fold] = norms, _params(m)
    (n1, p1), (n0, p0) = runs[True], runs[False]
    assert n1[0] == n0[0] and all(n > 0.05 for n in n1)
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], rtol=1e-5, atol=1e-6)
