"""parallel.one_rank_mixed_precision = optimizer: the cast path keeps its copies and the large gradients in bf16
(titan_mm.parallel.apply.CastCopies), and titan_mm.train.cast_adamw.CastAdamW updates those parameters with
titan_mm.kernels.adamw_step_. On CPU, bf16 compute, two micro-batches a step, clipping: it trains as the cast path
with torch's AdamW; the kernel matches torch's fused AdamW (and the Triton one its reference in the interpreter);
a changed parameter is cast afresh; the wrong config is one clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.adamw_bound import assert_adamw_close
from titan_mm.config import ConfigError, JobConfig, Optimizer, Parallel, Training, validate
from titan_mm.parallel import apply
from titan_mm.parallel.apply import apply_param_cast, cast_copies
from titan_mm.parallel.clip import clip_grad_norm_
from titan_mm.kernels import adamw_step_
from titan_mm.registry import get_model_spec
from titan_mm.train.cast_adamw import CastAdamW


@pytest.fixture
def small_narrow(monkeypatch):
    """The debug models' parameters are far below the 2^20 elements from which gradients stay narrow."""
    monkeypatch.setattr(apply, "_UPCAST_ELEMS", 2048)


def _model(flavor: str = "debug"):
    spec = get_model_spec("qwen3")
    cfg = dataclasses.replace(spec.flavor(flavor), vocab_size=512)
    torch.manual_seed(0)
    model = spec.build(cfg)
    model.init_weights()
    return model


def _train(model, opt, steps: int = 3, grads_of=None) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        for _ in range(2):  # two micro-batches: the kept gradients are summed in fp32
            ids = torch.randint(0, 512, (2, 24), generator=g)
            out = model(ids, labels=ids)
            loss = out.loss_sum.float() / ids.numel() + (0 if out.aux_loss is None else out.aux_loss.float())
            loss.backward()
            losses.append(loss.item())
        clip_grad_norm_(model.parameters(), 0.05, grads_of=grads_of)  # small enough to clip
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


class _SameRoundingAdamW(torch.optim.AdamW):
    """The cast path's reference optimizer with CastAdamW's arithmetic: torch's AdamW for the small parameters,
    titan_mm.kernels.adamw_step_ for the large (narrow) ones. The same rounding as the kept-copies path, so that
    path must train bit for bit as this one, for any number of steps, on any CPU."""

    def __init__(self, params, narrow, **kw):
        super().__init__(params, **kw)
        self.narrow = narrow

    @torch.no_grad()
    def step(self):
        held = {p: p.grad for g in self.param_groups for p in g["params"] if self.narrow(p) and p.grad is not None}
        for p in held:
            p.grad = None
        super().step()
        for group in self.param_groups:
            for p in (p for p in group["params"] if p in held):
                st = self.state[p]
                if not st:
                    st.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                adamw_step_(p, held[p], st["exp_avg"], st["exp_avg_sq"], torch.empty_like(p, dtype=torch.bfloat16),
                            st["step"], group["lr"], *group["betas"], group["eps"], group["weight_decay"])
                p.grad = held[p]


@pytest.mark.parametrize("flavor,impl", [("debug", "foreach"), ("debug", "fused"), ("debug_moe", "fused")])
def test_kept_copies_train_as_the_cast_path(small_narrow, flavor, impl):
    """torch's fused AdamW (the trainer's on CUDA) writes the small parameters without moving their version: their
    copies must be dropped by the step, not left to the version check."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **{impl: True})
    ref, same, mine = _model(flavor), _model(flavor), _model(flavor)
    apply_param_cast(ref, torch.bfloat16)
    apply_param_cast(same, torch.bfloat16)
    apply_param_cast(mine, torch.bfloat16, keep=True)
    copies = cast_copies(mine)
    assert cast_copies(ref) is None and copies is not None
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **kw), CastAdamW(mine.parameters(), copies=copies, **kw)
    same_opt = _SameRoundingAdamW(same.parameters(), copies.narrow, **kw)
    ref_losses, losses = _train(ref, ref_opt, steps=1), _train(mine, opt, steps=1, grads_of=copies.grads_of)
    assert losses == ref_losses  # the same forward, the same gradients
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):  # one update of another AdamW arithmetic
        assert_adamw_close(p, q, kw["lr"], kw["betas"], steps=1, msg=name)
    # later steps drift from torch's AdamW as two AdamW implementations do (a bf16 copy one rounding apart flips a
    # tiny gradient's sign, and Adam's first steps move such an element by about lr): against the reference with
    # CastAdamW's own rounding, three steps are bitwise the same
    same_losses = _train(same, same_opt, steps=1) + _train(same, same_opt, steps=2)  # mine's batches
    losses += _train(mine, opt, steps=2, grads_of=copies.grads_of)
    assert losses == same_losses
    for (name, p), q in zip(mine.named_parameters(), same.parameters()):
        assert torch.equal(p, q), name
    narrow = [p for p in mine.parameters() if copies.narrow(p)]
    assert narrow and len(narrow) < len(list(mine.parameters()))
    for p in narrow:  # the step wrote the next forward's copy
        c = copies.copy_of(p)
        assert c is not None and c.dtype == torch.bfloat16 and torch.equal(c, p.detach().to(torch.bfloat16))
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} and float(opt.state[p]["step"]) == 3


def test_gradients_stay_narrow_for_one_micro_batch_and_widen_for_two(small_narrow):
    model = _model()
    apply_param_cast(model, torch.bfloat16, keep=True)
    copies = cast_copies(model)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    big = next(p for p in model.parameters() if copies.narrow(p))
    small = next(p for p in model.parameters() if not copies.narrow(p))
    model(ids, labels=ids).loss_sum.backward()
    assert big.grad is None and copies.grad(big).dtype == torch.bfloat16
    assert small.grad.dtype == torch.float32 and copies.grad(small) is None
    first = copies.grad(big).float()
    model(ids, labels=ids).loss_sum.backward()
    assert copies.grad(big).dtype == torch.float32 and torch.equal(copies.grad(big), first * 2)
    assert {id(g) for g in copies.grads_of(model.parameters())} >= {id(copies.grad(big)), id(small.grad)}


def test_a_changed_parameter_is_cast_again(small_narrow):
    """A checkpoint or weight load writes parameters in place (their version moves): the kept copy is dropped."""
    model = _model()
    apply_param_cast(model, torch.bfloat16, keep=True)
    copies = cast_copies(model)
    ids = torch.randint(0, 512, (2, 24))
    model(ids, labels=ids)
    p = model.layers["0"].mlp.w1.weight
    assert copies.copy_of(p) is not None
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    assert copies.copy_of(p) is None
    model(ids, labels=ids)
    torch.testing.assert_close(copies.copy_of(p), p.detach().to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("scaled", [False, True])
def test_update_matches_torch_fused_adamw(scaled):
    """The reference arithmetic (titan_mm.kernels.adamw_step_ off CUDA) against torch's fused AdamW on CPU, with
    GradScaler's grad_scale; found_inf = 1 leaves every tensor as it was."""
    torch.manual_seed(0)
    p = torch.randn(1000)
    q = torch.nn.Parameter(p.clone())
    ref = torch.optim.AdamW([q], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    m, v, step, copy = torch.zeros(1000), torch.zeros(1000), torch.zeros(()), torch.empty(1000, dtype=torch.bfloat16)
    scale = torch.tensor(4.0) if scaled else None
    for t in range(1, 4):
        g = torch.randn(1000).to(torch.bfloat16)
        q.grad = g.float()
        if scaled:
            ref.grad_scale = scale
        ref.step()
        step += 1
        adamw_step_(p, g, m, v, copy, step, 1e-2, 0.9, 0.99, 1e-8, 0.1, grad_scale=scale)
        assert_adamw_close(p, q, 1e-2, (0.9, 0.99), steps=t)
        assert torch.equal(copy, p.to(torch.bfloat16))
    before = [t.clone() for t in (p, m, v, copy)]
    adamw_step_(p, g, m, v, copy, step + 1, 1e-2, 0.9, 0.99, 1e-8, 0.1, found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v, copy)))


_INTERP = r"""
import torch
from titan_mm.kernels import adamw_step_
from titan_mm.kernels.adamw import adamw_step_ as triton_step

bad = []
for gdt in (torch.bfloat16, torch.float32):
    for scale, found in ((None, None), (torch.tensor(2.0), torch.tensor(0.0)), (None, torch.tensor(1.0))):
        torch.manual_seed(0)
        n = 5003
        ts = [torch.randn(n), torch.randn(n).to(gdt), torch.randn(n) * 0.1, torch.rand(n)]
        ts.append(ts[0].to(torch.bfloat16))
        ref = [t.clone() for t in ts]
        step = torch.tensor(3.0)
        triton_step(*ts, step, 1e-2, 0.9, 0.95, 1e-8, 0.1, scale, found)
        # the reference path: a kernel-less call (the interpreter would take the Triton path)
        import titan_mm.kernels as K
        K.use_triton, keep = (lambda *a: False), K.use_triton
        adamw_step_(*ref, step, 1e-2, 0.9, 0.95, 1e-8, 0.1, scale, found)
        K.use_triton = keep
        for name, a, b in zip("pgmv", ts, ref):
            if not torch.allclose(a, b.to(a.dtype), rtol=1e-5, atol=1e-6):
                bad.append(f"{gdt} {scale} {found} {name} {(a.float() - b.float()).abs().max()}")
        # the copy is the kernel's own parameter, rounded (toward zero in the interpreter: the GPU test checks the
        # round to nearest even)
        if not torch.allclose(ts[4].float(), ts[0], rtol=2**-7, atol=0):
            bad.append(f"{gdt} {scale} {found} copy")
print("BAD" if bad else "OK", bad)
"""


def test_update_kernel_matches_its_reference_in_the_interpreter():
    from tests.triton_interp import run_interpreted

    run_interpreted(_INTERP)


def test_config_errors():
    base = dict(parallel=Parallel(one_rank_mixed_precision="optimizer"))
    validate(JobConfig(training=Training(param_dtype="bfloat16"), **base))
    with pytest.raises(ConfigError, match="optimizer.name='adamw'"):
        validate(JobConfig(training=Training(param_dtype="bfloat16"), optimizer=Optimizer(name="muon"), **base))
    with pytest.raises(ConfigError, match="param_dtype='float16'"):
        validate(JobConfig(training=Training(param_dtype="float16"), **base))
