"""The one-rank cast path (titan_mm.parallel.apply.apply_param_cast) against FSDP2's mixed precision on a one-rank
mesh (gloo, one process, CPU bf16): a tiny Qwen3 with a tied head and a Qwen3-MoE, two micro-batches a step, give
the same losses and fp32 gradients bit for bit, also under activation checkpointing (full, selective; eager and
compiled); the model holds its fp32 parameters outside the forward (state dict, optimizer), also when the forward
raises; parallelize picks the path from the config; the gradient widening kernel is exact."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from titan_mm.config import JobConfig, Parallel, Training
from titan_mm.parallel.apply import apply_param_cast, one_rank_cast
from titan_mm.registry import get_model_spec


def _model(flavor: str, seed: int = 0):
    spec = get_model_spec("qwen3")
    cfg = dataclasses.replace(spec.flavor(flavor), vocab_size=512)
    torch.manual_seed(seed)
    model = spec.build(cfg)
    model.init_weights()
    return model


def _batches(n: int = 2):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (2, 24), generator=g) for _ in range(n)]


def _step(model) -> list[float]:
    losses = []
    for ids in _batches():
        out = model(ids, labels=ids)
        loss = out.loss_sum.float() / ids.numel() + (0 if out.aux_loss is None else out.aux_loss.float())
        loss.backward()
        losses.append(loss.item())
    return losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, flavor: str, ac: str, compiled: bool, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from titan_mm.parallel.apply import apply_ac, apply_compile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        fsdp, cast = _model(flavor), _model(flavor)
        for m in (fsdp, cast):  # parallelize's order: AC, compile, then the mixed precision
            if ac != "none":
                apply_ac(m, ("layers.?",), ac, "op")
            if compiled:
                apply_compile(m, ("layers.?",))
        mesh = init_device_mesh("cpu", (1,))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for mod in [*fsdp.layers.values(), fsdp]:
            fully_shard(mod, mesh=mesh, mp_policy=mp_policy)
        apply_param_cast(cast, torch.bfloat16)
        out["losses"] = (_step(fsdp), _step(cast))
        ref = {n: p.grad.full_tensor() for n, p in fsdp.named_parameters()}
        got = {n: p.grad for n, p in cast.named_parameters()}
        out["names"] = sorted(ref) == sorted(got)
        out["equal"] = [n for n in ref if not torch.equal(ref[n], got[n])]
        out["fp32"] = all(type(p) is torch.nn.Parameter and p.dtype == p.grad.dtype == torch.float32
                          for p in cast.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flavor,ac,compiled", [("debug", "none", False), ("debug_moe", "none", False),
                                                ("debug", "full", False), ("debug", "selective", False),
                                                ("debug", "full", True)])
def test_cast_equals_fsdp_mixed_precision(flavor, ac, compiled):
    """Eager activation checkpointing recomputes its units in the backward, where the cast path has the fp32
    masters back in place: they are cast again for it (compiled units recompute inside their backward graph)."""
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_worker, args=(_free_port(), flavor, ac, compiled, out), nprocs=1, join=True)
        fsdp_losses, cast_losses = out["losses"]
        assert fsdp_losses == cast_losses
        assert out["names"] and out["equal"] == [] and out["fp32"], dict(out)


def test_computes_in_bf16_and_restores_on_error():
    model = _model("debug")
    apply_param_cast(model, torch.bfloat16)
    seen = []
    model.layers["0"].attn.register_forward_pre_hook(lambda m, a: seen.append(m.wq.weight.dtype))
    ids = _batches(1)[0]
    assert model(ids, labels=ids).loss_sum.dtype == torch.float32 and seen == [torch.bfloat16]
    with pytest.raises(IndexError):
        model(ids + 10_000)  # ids beyond the vocabulary: the forward raises, the fp32 masters come back
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point())


def test_casts_a_block_in_one_node_and_leaves_frozen_and_unused_parameters_alone():
    """A block's parameters are cast by one autograd node (the host records a node per block, not per parameter)
    up to a size, past which a group ends. A frozen parameter gets no gradient and an unused one none either; every
    trained one gets its fp32 gradient."""
    from titan_mm.parallel import apply

    model = _model("debug")
    model.layers["0"].attn_norm.weight.requires_grad_(False)
    model.unused = torch.nn.Linear(4, 4)  # in no forward
    old, apply._GROUP_ELEMS = apply._GROUP_ELEMS, max(p.numel() for p in model.parameters())  # the largest: alone
    try:
        apply_param_cast(model, torch.bfloat16)
        ids = _batches(1)[0]
        out = model(ids, labels=ids)
        nodes, todo = set(), [out.loss_sum.grad_fn]
        while todo:  # the cast nodes the loss reaches: one per group with a trained parameter
            fn = todo.pop()
            if fn is None or fn in nodes:
                continue
            nodes.add(fn)
            todo += [f for f, _ in fn.next_functions]
        casts = [fn for fn in nodes if type(fn).__name__ == "_CastBackward"]
        frozen = {id(model.layers["0"].attn_norm.weight)}
        groups = [{id(m._parameters[n]) for m, n in g} for g in apply._cast_groups(model)]
        assert all(sum(p.numel() for p in model.parameters() if id(p) in g) <= apply._GROUP_ELEMS for g in groups)
        used = {id(p) for p in model.parameters()} - {id(p) for p in model.unused.parameters()} - frozen
        # a tied parameter is cast in the first group that holds it
        first = {}
        for k, g in enumerate(groups):
            for i in g:
                first.setdefault(i, k)
        want = len({first[i] for i in used})
        assert len(casts) == want, (len(casts), want)
        assert len(casts) < sum(1 for p in model.parameters() if id(p) in used) / 2
        out.loss_sum.backward()
    finally:
        apply._GROUP_ELEMS = old
    for name, p in model.named_parameters():
        if name == "layers.0.attn_norm.weight" or name.startswith("unused."):
            assert p.grad is None, name
        else:
            assert p.grad is not None and p.grad.dtype == torch.float32, name


def test_parallelize_picks_the_path():
    one, two = 1, 2
    job = JobConfig(training=Training(param_dtype="bfloat16"))
    assert one_rank_cast(one, job, torch.bfloat16)
    assert not one_rank_cast(one, job, torch.float32)  # nothing to cast
    assert not one_rank_cast(two, job, torch.bfloat16)  # FSDP2 shards over the ranks
    assert not one_rank_cast(one, job, torch.bfloat16, pipelined=True)  # one FSDP root per stage
    fsdp = JobConfig(training=job.training, parallel=Parallel(one_rank_mixed_precision="fsdp"))
    assert not one_rank_cast(one, fsdp, torch.bfloat16)


_INTERP = r"""
import torch
from titan_mm.kernels import accumulate, upcast

bad = []
for dt in (torch.bfloat16, torch.float16):
    for shape in ((5000,), (3, 1500), (0, 4)):
        x = (torch.randn(shape) * 1e3).to(dt)
        y = upcast(x)
        if y.dtype != torch.float32 or not torch.equal(y, x.float()):
            bad.append(f"{dt} {shape}")
        g = (torch.randn(shape) * 1e-3).to(dt)
        wide = accumulate(x, g)  # the second micro-batch: two narrow gradients, a new fp32 sum
        if wide.dtype != torch.float32 or not torch.equal(wide, x.float().add_(g)):
            bad.append(f"{dt} {shape} widening sum")
        want = wide.clone().add_(g)
        if accumulate(wide, g) is not wide or not torch.equal(wide, want):  # the third on: in place
            bad.append(f"{dt} {shape} sum in place")
    t = torch.randn(40, 30).to(dt).t()  # not contiguous: torch's copy and add
    if not torch.equal(upcast(t), t.float()) or not torch.equal(accumulate(t.float(), t), t.float().add_(t)):
        bad.append(f"{dt} transposed")
print("BAD" if bad else "OK", bad)
"""


def test_upcast_kernel_is_exact_in_the_interpreter():
    """The gradient widening of the cast path (titan_mm.kernels.upcast) and its sum over micro-batches
    (titan_mm.kernels.accumulate): bit-equal to torch's copy and fp32 add."""
    from tests.triton_interp import run_interpreted

    run_interpreted(_INTERP)
