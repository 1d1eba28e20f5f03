"""Numerical checks of the Triton ops (titan_mm.kernels) against their float64 PyTorch references (the ops
of titan_mm.nn), shared by the CPU interpreter tests (tests/unit/test_kernels_*.py, small
shapes) and the H200 tests (tests/gpu/test_kernels_gpu.py, full shapes).

Each check draws fresh random inputs (the seed is returned so a failure can be replayed), runs the op
forward and backward through the public API (which must pick the Triton path), and compares every output
and gradient with the reference run in float64 by relative L2 error. Tolerances: fp32 1e-5, bf16/fp16 1e-2.
A NaN anywhere fails (NaN never compares below a tolerance, and outputs are also checked for finiteness).
Run with titan_mm.kernels._utils.POISON = True so every output buffer starts NaN-filled.

    python -m titan_mm.tools.kernel_checks [op ...]   # prints JSON records; set TRITON_INTERPRET=1 on CPU
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
import traceback
from types import SimpleNamespace

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops import triton_kernel_wrap as tkw
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._inductor.utils import run_and_get_code
from torch.library import opcheck

import titan_mm.kernels as K
from titan_mm.kernels import _dispatch, _utils, use_triton
from titan_mm.kernels.bias_gelu import bias_gelu_op
from titan_mm.kernels.cross_entropy import linear_cross_entropy_op
from titan_mm.kernels.rms_norm import _BWD as _RMS_BWD
from titan_mm.kernels.rms_norm import _FWD as _RMS_FWD
from titan_mm.kernels.rms_norm import add_rms_norm_op, rms_norm_op
from titan_mm.kernels.rope import rope_op
from titan_mm.kernels.swiglu import swiglu_op
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3.model import Qwen3Model
from titan_mm.nn.loss import chunked_cross_entropy
from titan_mm.nn.mlp import bias_gelu, silu_mul
from titan_mm.nn.norm import add_rms_norm, rms_norm
from titan_mm.nn.rope import apply_rope

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# The fused cross-entropy's input gradients pass three roundings to the low dtype (the logits, the softmax
# gradient fed to the second GEMM, the result), each up to u = eps / 2: allow 4u (measured worst of 150 seeds on 13
# rows: 2.5u in bf16, 1.5u in fp16).
CE_GRAD_TOL = {torch.float32: TOL[torch.float32], torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}
OPS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "linear_cross_entropy", "bias_gelu", "compile", "opcheck",
       "graph", "configs")


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if out.shape != ref.shape:
        return float("inf")
    if not torch.isfinite(out).all():
        return float("nan")
    num, den = (out - ref).norm().item(), ref.norm().item()
    return num / den if den > 0 else num


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _ref_leaves(ts):
    return [t.detach().double().requires_grad_(True) for t in ts]


def _strided(shape, dtype, device, mode: str, gen=None) -> torch.Tensor:
    """Random tensor of `shape`: 'contig', 'sliced' (a narrowed view of a wider last dim), or
    'transposed' (first two dims swapped in memory)."""
    if mode == "sliced":
        big = torch.randn(*shape[:-1], shape[-1] + 5, dtype=dtype, device=device)
        return big[..., : shape[-1]]
    if mode == "transposed" and len(shape) >= 3:
        return torch.randn(shape[1], shape[0], *shape[2:], dtype=dtype, device=device).transpose(0, 1)
    return torch.randn(*shape, dtype=dtype, device=device)


def _record(recs, op, dtype, case, name, out, ref, tol=None):
    err = rel_l2(out, ref)
    tol = TOL[dtype] if tol is None else tol
    recs.append(
        {"op": op, "dtype": str(dtype).replace("torch.", ""), "case": case, "what": name, "err": err, "tol": tol,
         "ok": bool(math.isfinite(err) and err < tol)}
    )


def _compare(recs, op, dtype, case, outs, refs, ins, ref_ins, grads, grad_tol=None):
    """Backprop `grads` through outs and refs; record forward outputs and input gradients (within `grad_tol` when
    given, else the dtype's tolerance)."""
    for i, (o, r) in enumerate(zip(outs, refs)):
        _record(recs, op, dtype, case, f"out{i}", o, r)
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, [g.double() for g in grads])
    for i, (x, xr) in enumerate(zip(ins, ref_ins)):
        if xr.grad is not None:
            _record(recs, op, dtype, case, f"grad{i}", x.grad, xr.grad, grad_tol)


def check_rms_norm(device, dtype, big):
    recs = []
    shapes = [(16384, 4096), (3, 1000, 4099), (16384 * 8, 128)] if big else [(3, 7, 37), (5, 64), (3, 1000, 9), (2, 5, 1030)]
    for shape in shapes:
        for mode in ("contig", "sliced", "transposed"):
            if big and mode != "contig" and shape[-1] == 4096:
                continue
            x = _leaf(_strided(shape, dtype, device, mode))
            w = _leaf(1 + 0.1 * torch.randn(shape[-1], dtype=dtype, device=device))
            eps = 1e-6
            y = K.rms_norm(x, w, eps)
            xr, wr = _ref_leaves([x, w])
            yr = rms_norm(xr, wr, eps)
            _compare(recs, "rms_norm", dtype, f"{shape}/{mode}", [y], [yr], [x, w], [xr, wr], [torch.randn_like(y)])
            with torch.no_grad():  # the eval forward (no rstd written) and a detached input under grad mode
                _record(recs, "rms_norm", dtype, f"{shape}/{mode}", "out_nograd", K.rms_norm(x, w, eps), yr)
            _record(recs, "rms_norm", dtype, f"{shape}/{mode}", "out_detached", K.rms_norm(x.detach(), w.detach(), eps), yr)
    return recs


def check_add_rms_norm(device, dtype, big):
    recs = []
    shapes = [(16384, 4096), (3, 1000, 4099), (16384 * 8, 128)] if big else [(3, 7, 37), (5, 64), (3, 1000, 9), (2, 5, 1030)]
    for shape in shapes:
        for mode in ("contig", "sliced"):
            x = _leaf(_strided(shape, dtype, device, mode))
            r = _leaf(_strided(shape, dtype, device, "transposed" if mode == "sliced" else mode))
            w = _leaf(1 + 0.1 * torch.randn(shape[-1], dtype=dtype, device=device))
            y, nr = K.add_rms_norm(x, r, w, 1e-6)
            ins = [x, r, w]
            refs_in = _ref_leaves(ins)
            yr, nrr = add_rms_norm(*refs_in, 1e-6)
            with torch.no_grad():  # the eval forward (no rstd written)
                for i, (o, ref) in enumerate(zip(K.add_rms_norm(x, r, w, 1e-6), (yr, nrr))):
                    _record(recs, "add_rms_norm", dtype, f"{shape}/{mode}", f"out{i}_nograd", o, ref)
            _compare(recs, "add_rms_norm", dtype, f"{shape}/{mode}", [y, nr], [yr, nrr], ins, refs_in,
                     [torch.randn_like(y), torch.randn_like(nr)])
    return recs


def check_swiglu(device, dtype, big):
    recs = []
    shapes = [(16384, 12288), (2, 999, 4097)] if big else [(3, 5, 45), (7, 130), (3, 2100)]
    for shape in shapes:
        for mode in ("contig", "fused_halves"):
            if mode == "fused_halves":  # gate/up as the two halves of one [.., 2F] projection
                gu = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device)
                g, u = (_leaf(t) for t in gu.chunk(2, dim=-1))
            else:
                g, u = _leaf(torch.randn(shape, dtype=dtype, device=device)), _leaf(torch.randn(shape, dtype=dtype, device=device))
            y = K.swiglu(g, u)
            gr, ur = _ref_leaves([g, u])
            yr = silu_mul(gr, ur)
            _compare(recs, "swiglu", dtype, f"{shape}/{mode}", [y], [yr], [g, u], [gr, ur], [torch.randn_like(y)])
    return recs


def _rope_tables(lead, half, dtype, device, full: bool):
    ang = torch.rand(*lead, half, device=device, dtype=torch.float64) * 40.0
    cos, sin = ang.cos(), ang.sin()
    if full:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos.to(dtype), sin.to(dtype)


def check_rope(device, dtype, big):
    recs = []
    # (B, S, Hq, Hk, Dh)
    cfgs = [(4, 4096, 32, 8, 128), (1, 999, 5, 3, 64)] if big else [(2, 5, 3, 1, 8), (1, 7, 4, 2, 6)]
    for B, S, HQ, HK, DH in cfgs:
        for mode in ("bshd", "bhsd_view", "table_SK_half"):
            if mode == "bhsd_view":  # q/k stored [B, H, S, Dh], passed as a transposed view
                q = _leaf(torch.randn(B, HQ, S, DH, dtype=dtype, device=device).transpose(1, 2))
                k = _leaf(torch.randn(B, HK, S, DH, dtype=dtype, device=device).transpose(1, 2))
            else:
                q = _leaf(torch.randn(B, S, HQ, DH, dtype=dtype, device=device))
                k = _leaf(torch.randn(B, S, HK, DH, dtype=dtype, device=device))
            if mode == "table_SK_half":
                cos, sin = _rope_tables((S,), DH // 2, dtype, device, full=False)
            else:
                cos, sin = _rope_tables((B, S), DH // 2, dtype, device, full=True)
            qo, ko = K.apply_rope(q, k, cos, sin)
            qr, kr = _ref_leaves([q, k])
            qor, kor = apply_rope(qr, kr, cos.double(), sin.double())
            _compare(recs, "rope", dtype, f"{(B, S, HQ, HK, DH)}/{mode}", [qo, ko], [qor, kor], [q, k], [qr, kr],
                     [torch.randn_like(qo), torch.randn_like(ko)])
    return recs


def check_linear_cross_entropy(device, dtype, big):
    recs = []
    # (N, D, V, chunk)
    cfgs = [(16384, 4096, 151936, 0), (1023, 257, 15001, 100)] if big else [(13, 16, 100, 4), (9, 24, 77, 0)]
    for N, D, V, chunk in cfgs:
        for z in (0.0, 1e-3):
            for mode in ("contig", "sliced"):
                if big and z and V > 100000:  # full vocabulary: contig (bf16 accumulation) + sliced (fp32)
                    continue
                h = _leaf(_strided((N, D), dtype, device, mode))
                w = _leaf(torch.randn(V, D, dtype=dtype, device=device) / math.sqrt(D))
                labels = torch.randint(0, V, (N,), device=device)
                labels[torch.rand(N, device=device) < 0.25] = -100  # ignore-index rows
                labels[0] = -100
                acc32 = mode == "sliced"  # also covers the fp32 weight-gradient accumulator
                # sliced: per-token weights as a diffusion objective's 1/t (>= 1, fp32)
                wts = 1.0 / (0.05 + torch.rand(N, device=device)) if mode == "sliced" else None
                loss = K.linear_cross_entropy(h, w, labels, ignore_index=-100, z_loss=z, chunk_size=chunk,
                                              grad_accum_fp32=acc32, weights=wts)
                hr, wr = _ref_leaves([h, w])
                lr = chunked_cross_entropy(hr, wr, labels, 1024, z, weights_N=None if wts is None else wts.double())
                scale = torch.tensor(0.37, device=device)  # like 1 / num_label_tokens
                _compare(recs, "linear_cross_entropy", dtype,
                         f"{(N, D, V, chunk)}/z={z}/{mode}/acc32={acc32}/weights={wts is not None}", [loss], [lr],
                         [h, w], [hr, wr], [scale.to(loss.dtype)], CE_GRAD_TOL[dtype])
    # all rows ignored: loss 0, zero grads, no NaN
    N, D, V = (64, 32, 300)
    h = _leaf(torch.randn(N, D, dtype=dtype, device=device))
    w = _leaf(torch.randn(V, D, dtype=dtype, device=device))
    loss = K.linear_cross_entropy(h, w, torch.full((N,), -100, device=device))
    loss.backward()
    ok = bool(loss.item() == 0.0 and h.grad.abs().sum().item() == 0.0 and w.grad.abs().sum().item() == 0.0)
    recs.append({"op": "linear_cross_entropy", "dtype": str(dtype).replace("torch.", ""), "case": "all_ignored",
                 "what": "zero loss and grads", "err": 0.0 if ok else float("nan"), "tol": TOL[dtype], "ok": ok})
    return recs


def check_bias_gelu(device, dtype, big):
    recs = []
    shapes = [(16384, 4304), (999, 1153)] if big else [(33, 19), (2, 9, 40), (21, 700)]
    for shape in shapes:
        for mode in ("contig", "sliced"):
            x = _leaf(3 * _strided(shape, dtype, device, mode))
            b = _leaf(torch.randn(shape[-1], dtype=dtype, device=device))
            y = K.bias_gelu(x, b)
            xr, br = _ref_leaves([x, b])
            yr = bias_gelu(xr, br)
            _compare(recs, "bias_gelu", dtype, f"{shape}/{mode}", [y], [yr], [x, b], [xr, br], [torch.randn_like(y)])
    return recs


def check_compile(device, dtype, big, backend: str | None = None):
    """torch.compile(fullgraph=True) over every public op, forward + backward, equals eager."""
    backend = backend or ("inductor" if device.type == "cuda" else "aot_eager")
    torch._dynamo.reset()
    recs = []

    def f(x, r, w, g, u, q, k, cos, sin, h, wv, labels, xb, b):
        y, nr = K.add_rms_norm(x, r, w, 1e-6)
        y = K.rms_norm(y, w, 1e-6)
        s = K.swiglu(g, u)
        qo, ko = K.apply_rope(q, k, cos, sin)
        loss = K.linear_cross_entropy(h, wv, labels, z_loss=1e-4)
        gb = K.bias_gelu(xb, b)
        return (y.float().sum() + nr.float().sum() + s.float().sum() + qo.float().sum() + ko.float().sum()
                + loss + gb.float().sum())

    def inputs():
        B, S, HQ, HK, DH = 2, 5, 3, 1, 8
        t = lambda *s: _leaf(torch.randn(*s, dtype=dtype, device=device))  # noqa: E731
        cos, sin = _rope_tables((B, S), DH // 2, dtype, device, full=True)
        labels = torch.randint(0, 50, (11,), device=device)
        labels[::3] = -100
        return [t(4, 6, 33), t(4, 6, 33), t(33), t(5, 20), t(5, 20), t(B, S, HQ, DH), t(B, S, HK, DH), cos, sin,
                t(11, 16), t(50, 16), labels, t(7, 24), t(24)]

    args = inputs()
    args2 = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = f(*args)
    out.backward()
    cf = torch.compile(f, fullgraph=True, backend=backend)
    out2 = cf(*args2)
    out2.backward()
    _record(recs, "compile", dtype, backend, "out", out2, out)
    for i, (a, a2) in enumerate(zip(args, args2)):
        if a.grad is not None:
            _record(recs, "compile", dtype, backend, f"grad{i}", a2.grad, a.grad)
    return recs


def check_opcheck(device, dtype, big):
    """torch.library.opcheck: schema, fake (meta) impl, autograd registration, AOT dispatch."""
    t = lambda *s: torch.randn(*s, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    cos, sin = _rope_tables((2, 5), 4, dtype, device, full=True)
    labels = torch.tensor([1, -100, 3, 4, -100, 0, 2], device=device)
    cases = [
        (rms_norm_op, (t(3, 17), t(17), 1e-6)),
        (add_rms_norm_op, (t(3, 17), t(3, 17), t(17), 1e-6)),
        (swiglu_op, (t(3, 17), t(3, 17))),
        (rope_op, (t(2, 5, 3, 8), t(2, 5, 1, 8), cos, sin, False)),
        (linear_cross_entropy_op, (t(7, 16), t(30, 16), labels, -100, 1e-3, True, 3)),
        (linear_cross_entropy_op, (t(7, 16), t(30, 16), labels, -100, 0.0, True, 2, True)),
        (linear_cross_entropy_op, (t(7, 16), t(30, 16), labels, -100, 1e-3, True, 3, False,
                                   torch.rand(7, device=device) + 1.0)),
        (bias_gelu_op, (t(5, 9), t(9))),
    ]
    recs = []
    for op, args in cases:
        try:
            opcheck(op, args)
            ok, msg = True, "opcheck"
        except Exception as e:  # recorded, the test reports it
            ok, msg = False, f"opcheck: {type(e).__name__}: {e}"[:500]
        recs.append({"op": "opcheck", "dtype": str(dtype).replace("torch.", ""), "case": str(op), "what": msg,
                     "err": 0.0 if ok else float("nan"), "tol": TOL[dtype], "ok": ok})
    return recs


def _twin_models(cfg_a, cfg_b, device, dtype, B: int, S: int):
    """Two Qwen3 models (configs a and b) with the same random weights in ``dtype``, and a random batch
    (input ids, position ids, labels) of B x S tokens."""
    with torch.device(device):
        a = Qwen3Model(cfg_a)
        a.init_weights()
        b = Qwen3Model(cfg_b)
    b.load_state_dict(a.state_dict())
    b.init_buffers()
    a.to(dtype)
    b.to(dtype)
    ids = torch.randint(0, cfg_a.vocab_size, (B, S), device=device)
    labels = torch.randint(0, cfg_a.vocab_size, (B, S), device=device)
    pos = torch.arange(S, device=device).repeat(B, 1)
    return a, b, (ids, pos, labels)


def check_model(device, dtype, big):
    """Integration: a Qwen3 model with kernels=True equals kernels=False (loss_sum and every gradient).
    The models pick titan_mm.kernels through their config (Ops in titan_mm/models/qwen3/model.py)."""
    if dtype != torch.float32:  # two low-precision models drift apart by more than one op's tolerance
        return []
    if big:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
        B, S = 2, 1024
    else:
        cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                          max_position_embeddings=256)
        B, S = 2, 16
    recs = []
    ref, ker, (ids, pos, labels) = _twin_models(dataclasses.replace(cfg, kernels=False),
                                                dataclasses.replace(cfg, kernels=True), device, dtype, B, S)
    labels[:, :3] = -100
    outs = []
    for m in (ref, ker):
        out = m(ids, position_ids=pos, labels=labels)
        (out.loss_sum / (labels != -100).sum()).backward()
        outs.append(out.loss_sum)
    # fp32 model vs fp32 model (not float64): rounding differences compound over layers; 1e-4 relative L2
    case = f"qwen3 {cfg.hidden_size}x{cfg.num_hidden_layers}"
    _record(recs, "model", dtype, case, "loss_sum", outs[1], outs[0], tol=1e-4)
    gr = dict(ref.named_parameters())
    for name, p in ker.named_parameters():
        _record(recs, "model", dtype, case, f"grad {name}", p.grad, gr[name].grad, tol=1e-4)
    return recs


CONFIGS_PER_OP = {"bias_gelu": 6, "linear_cross_entropy": 5}  # the longest candidate list of the op's tuners (others: 4)


def _kernel_name(k) -> str:
    """The Python function's name behind a kernel recorded by torch's triton tracing (an Autotuner that holds
    the launch's num_warps, around the JITFunction or, in the interpreter, its twin)."""
    while not inspect.isfunction(k):
        k = k.fn
    return k.__name__


def graph_launches(gm) -> tuple[list[tuple[str, dict]], list[str]]:
    """([(kernel name, launch kwargs)] of the triton_kernel_wrapper_* nodes, [titan_mm op nodes]) of an FX graph."""
    hops = (torch.ops.higher_order.triton_kernel_wrapper_functional, torch.ops.higher_order.triton_kernel_wrapper_mutation)
    launches, opaque = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in hops:
            k = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            consts = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
            launches.append((_kernel_name(k), {**node.kwargs["kwargs"], **consts,
                                               "tensors_to_clone": node.kwargs.get("tensors_to_clone", [])}))
        elif getattr(node.target, "namespace", None) == "titan_mm":
            opaque.append(str(node.target))
    return launches, opaque


def use_declared_writes() -> None:
    """CPU interpreter only: torch finds which arguments a traced Triton launch writes by compiling the kernel
    to TTIR, which needs a GPU target (on CPU it warns and assumes every tensor argument is written: inputs,
    weights and aliased arguments then look mutated, which the AOT graphs of a whole block do not survive).
    Use the kernels' declared written arguments (titan_mm.kernels._utils.WRITES) instead; on the GPU
    check_graph checks that torch's own analysis agrees with them."""
    if getattr(tkw.identify_accessed_tensors, "_titan_declared", False):
        return
    orig = tkw.identify_accessed_tensors

    def declared(kernel, kwargs, tma_descriptor_metadata):
        name = _kernel_name(kernel)
        if name not in _utils.WRITES:
            return orig(kernel, kwargs, tma_descriptor_metadata)
        w = [SimpleNamespace(name=n) for n in _utils.WRITES[name] if isinstance(kwargs.get(n), torch.Tensor)]
        return SimpleNamespace(read_writes=SimpleNamespace(writes=w))

    declared._titan_declared = True
    tkw.identify_accessed_tensors = declared


def check_graph(device, dtype, big):
    """The point of registering the ops with torch.library.triton_op: torch.compile's AOT graphs of a Qwen3
    decoder block (every block kernel on) hold the Triton launches as triton_kernel_wrapper_* nodes, visible
    to the compiler, and no opaque titan_mm.* op; the launch config in the graph is the Tuner's cached pick
    (picked while tracing without timing, even inside `tuning()` with timing possible); the compiled blocks
    equal the eager kernels (loss and every gradient). On CUDA also: inductor's generated code launches the
    kernels itself (their names in the code, no torch.ops.titan_mm call)."""
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=256, kernels="rms_norm,add_rms_norm,swiglu,rope")
    B, S = 2, 12
    torch._dynamo.reset()
    eager, comp, (ids, pos, labels) = _twin_models(cfg, dataclasses.replace(cfg), device, dtype, B, S)
    out_e = eager(ids, position_ids=pos, labels=labels)
    out_e.loss_sum.backward()

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    for block in comp.layers.values():
        block.compile(fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    # the tuner state the check sets up: the keys of the eager parts (embedding side, final norm) cached
    # (config 0, no timing in the interpreter); the blocks' q/k-norm, RoPE and SwiGLU keys left untuned, so
    # tracing meets untuned keys inside tuning() with timing possible and must not time them; a non-default
    # pick for the hidden-width RMSNorm forward (attn_norm, and the eager final norm), which the graph must launch
    saved = {t: dict(t.best) for t in _utils.Tuner.registry}, _utils.can_time, _utils.bench_ms
    with _utils.tuning():
        ref = Qwen3Model(cfg).to(device=device, dtype=dtype)
        ref(ids, position_ids=pos, labels=labels).loss_sum.backward()
    key = (_utils.next_pow2(cfg.hidden_size), dtype, False)
    for t in _utils.Tuner.registry:
        for k in list(t.best):
            if t is not _RMS_FWD and t is not _RMS_BWD or k[0] != key[0]:
                del t.best[k]
    cands = _RMS_FWD.configs(key)
    pick = next(c for c in cands if c["BR"] != cands[0]["BR"])
    timed = []
    _RMS_FWD.best[key] = pick
    _utils.can_time = lambda: True  # a pick that tried to time while tracing would reach bench_ms

    def _no_bench(fn):
        timed.append(1)
        raise RuntimeError("a launch config was timed while tracing")

    _utils.bench_ms = _no_bench
    try:
        with _utils.tuning():
            out_c = comp(ids, position_ids=pos, labels=labels)
            out_c.loss_sum.backward()
    finally:
        for t, best in saved[0].items():
            t.best.clear()
            t.best.update(best)
        _utils.can_time, _utils.bench_ms = saved[1], saved[2]

    recs = []
    case = "qwen3 block (compiled, aot)"
    _record(recs, "graph", dtype, case, "loss_sum", out_c.loss_sum, out_e.loss_sum)
    ge = dict(eager.named_parameters())
    for name, p in comp.named_parameters():
        _record(recs, "graph", dtype, case, f"grad {name}", p.grad, ge[name].grad)

    def flag(what, ok):
        recs.append({"op": "graph", "dtype": str(dtype).replace("torch.", ""), "case": case, "what": what,
                     "err": 0.0 if ok else float("nan"), "tol": TOL[dtype], "ok": bool(ok)})

    # one block's forward and backward graph (both blocks compile to the same graphs: 2 more, or a cache hit)
    fw_names, bw_names, opaque, attn_norm_br, extra_clones = set(), set(), [], set(), set()
    for i, gm in enumerate(graphs):
        launches, op_nodes = graph_launches(gm)
        opaque += op_nodes
        names = {n for n, _ in launches}
        (bw_names if any(n.endswith("_bwd_kernel") for n in names) else fw_names).update(names)
        for n, kw in launches:
            # functionalized launches clone what the kernel writes; on the GPU torch finds that from the TTIR,
            # and anything beyond the declared outputs (an input or weight) would be a copy per launch
            extra_clones.update(f"{n}.{a}" for a in kw["tensors_to_clone"] if a not in _utils.WRITES.get(n, ()))
            if n == "_rms_fwd_kernel" and kw.get("BD") == key[0] and not kw.get("HAS_RES"):
                attn_norm_br.add(kw.get("BR"))
    want_fw = {"_rms_fwd_kernel", "_rope_kernel", "_swiglu_fwd_kernel"}
    want_bw = {"_rms_bwd_kernel", "_col_sum_kernel", "_rope_kernel", "_swiglu_bwd_kernel"}  # col_sum: dW of the norms
    flag(f"forward graph launches {sorted(fw_names)} (want {sorted(want_fw)})", fw_names == want_fw)
    flag(f"backward graph launches {sorted(bw_names)} (want {sorted(want_bw)})", bw_names == want_bw)
    flag(f"no opaque titan_mm op nodes in the block graphs: {opaque}", not opaque)
    flag(f"attn_norm launch BR {sorted(attn_norm_br)} = the cached pick's {pick['BR']}", attn_norm_br == {pick["BR"]})
    flag(f"no timing while tracing inside tuning() ({len(timed)} timed)", not timed)
    flag(f"launches clone only the kernels' outputs (extra: {sorted(extra_clones)})", not extra_clones)
    if device.type == "cuda":  # inductor: the launches are in its generated wrapper code
        torch._dynamo.reset()
        with torch.device(device):
            ind = Qwen3Model(cfg)
        ind.load_state_dict(eager.state_dict())
        ind.init_buffers()
        ind.to(dtype)
        for block in ind.layers.values():
            block.compile(fullgraph=True)
        _, codes = run_and_get_code(lambda: ind(ids, position_ids=pos, labels=labels).loss_sum.backward())
        code = "\n".join(codes)
        names = sorted(n for n in want_fw | want_bw if n in code)
        flag(f"inductor code launches {names}, no torch.ops.titan_mm call",
             set(names) == want_fw | want_bw and "torch.ops.titan_mm" not in code)
    return recs


def check_configs(device, dtype, big):
    """Every launch config of every tuned kernel (not only the one the tuner would pick): the op checks
    rerun with titan_mm.kernels._utils.FORCE_CONFIG = 1, 2, ... (config 0 is what the plain checks run on
    CPU). Small shapes even on the GPU: this is about each config's code path, not the full-shape numbers."""
    recs = []
    before = _utils.FORCE_CONFIG
    try:
        for i in range(1, _utils.MAX_CONFIGS):
            _utils.FORCE_CONFIG = i
            for op in TUNED_OPS:
                if i >= CONFIGS_PER_OP.get(op, 4):  # FORCE_CONFIG wraps around: past the list it repeats configs
                    continue
                try:
                    new = CHECKS[op](device, dtype, False)
                except Exception as e:  # recorded under the op's name, so that op's test fails
                    new = [{"op": op, "dtype": str(dtype).replace("torch.", ""), "case": "exception",
                            "what": "".join(traceback.format_exception(e))[-3000:], "err": float("nan"),
                            "tol": TOL[dtype], "ok": False}]
                for r in new:
                    r["case"] = f"[config {i}] " + r["case"]
                recs += new
    finally:
        _utils.FORCE_CONFIG = before
    return recs


CHECKS = {
    "configs": check_configs,
    "model": check_model,
    "opcheck": check_opcheck,
    "rms_norm": check_rms_norm,
    "add_rms_norm": check_add_rms_norm,
    "swiglu": check_swiglu,
    "rope": check_rope,
    "linear_cross_entropy": check_linear_cross_entropy,
    "bias_gelu": check_bias_gelu,
    "compile": check_compile,
    "graph": check_graph,
}


def run(ops, device, dtypes, big: bool) -> dict:
    poison_before, _utils.POISON = _utils.POISON, True
    # fp32 tolerances assume true fp32 GEMMs: another test in the session may have enabled TF32
    prec_before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return _run(ops, device, dtypes, big)
    finally:
        _utils.POISON = poison_before
        torch.set_float32_matmul_precision(prec_before)


TUNED_OPS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "bias_gelu", "linear_cross_entropy")  # with a Tuner


def _tune_for_check(op, device, dtype, big) -> None:
    """GPU: run the check once inside `_utils.tuning()` (records dropped), so the recorded run launches the
    tuned configs on outputs no timing launch has written (the NaN poison still catches unwritten elements)."""
    try:
        with _utils.tuning():
            CHECKS[op](device, dtype, big)
    except Exception:  # the recorded run reports it
        pass


def _run(ops, device, dtypes, big: bool) -> dict:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    probe = torch.empty(1, device=device)
    assert use_triton(probe), f"the Triton path is not active on {device} (CPU needs TRITON_INTERPRET=1)"
    if device.type == "cpu":
        use_declared_writes()
    recs = []
    # eager runs twice: through the autograd.Function fast path (what eager users get) and through the
    # torch.library custom ops (what torch.compile graphs call); "[ops]" marks the second
    paths = [("", False), ("[ops] ", True)]
    prefer_before = _dispatch.PREFER_OPS
    try:
        for tag, prefer_ops in paths:
            _dispatch.PREFER_OPS = prefer_ops
            for op in ops:
                if prefer_ops and op in ("compile", "opcheck", "graph", "model", "configs"):
                    continue
                for dt in dtypes:
                    if op == "configs" and device.type == "cpu" and dt != torch.float32:
                        continue  # the config sweep is about code paths: one dtype in the slow interpreter
                    if prefer_ops and (dt == torch.float16 or (device.type == "cpu" and dt != torch.float32)):
                        continue  # same kernels as the fast path: one dtype is enough in the slow interpreter
                    if op in ("compile", "opcheck", "graph") and dt == torch.float16:
                        continue
                    if device.type == "cuda" and not prefer_ops and op in TUNED_OPS:
                        _tune_for_check(op, device, dt, big)
                    try:
                        new = CHECKS[op](device, dt, big)
                    except Exception as e:  # one broken check must not hide the others; it fails its own test
                        new = [{"op": op, "dtype": str(dt).replace("torch.", ""), "case": "exception",
                                "what": "".join(traceback.format_exception(e))[-3000:], "err": float("nan"),
                                "tol": TOL[dt], "ok": False}]
                    for r in new:
                        r["case"] = tag + r["case"]
                    recs += new
    finally:
        _dispatch.PREFER_OPS = prefer_before
    return {"seed": seed, "records": recs}


def main(argv: list[str]) -> None:
    ops = argv or list(OPS)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cpu" else [])
    print(json.dumps(run(ops, device, dtypes, big=False)))


if __name__ == "__main__":
    main(sys.argv[1:])


_INTERP_CACHE: dict = {}


def run_in_interpreter(ops: list[str], timeout: float = 600) -> dict:
    """Run the checks in a fresh CPU process with TRITON_INTERPRET=1 (set before triton is imported
    there) and NaN-poisoned outputs; returns {"seed", "records"}. The calling process and the rest of the
    test suite never see the interpreter setting. The first call runs every check at once (one process
    start instead of one per test file) and later calls in the same session reuse its records."""
    if "all" in _INTERP_CACHE:
        return _INTERP_CACHE["all"]
    ops = list(OPS) + ["model"]
    res = _run_interpreter_process(ops, timeout)
    _INTERP_CACHE["all"] = res
    return res


def _run_interpreter_process(ops: list[str], timeout: float) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", TITAN_KERNELS_POISON="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "titan_mm.tools.kernel_checks", *ops],
        env=env, cwd=root, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kernel checks {ops} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def failures(result: dict, op: str | None = None, dtype: str | None = None) -> list[str]:
    """Human-readable lines for the failed records (empty when all passed)."""
    recs = [r for r in result["records"] if (op is None or r["op"] == op) and (dtype is None or r["dtype"] == dtype)]
    if not recs:
        return [f"no records for op={op} dtype={dtype}"]
    return [
        f"seed {result['seed']}: {r['op']} {r['dtype']} {r['case']} {r['what']}: err {r['err']:.3e} (tol {r['tol']:.0e})"
        for r in recs
        if not r["ok"]
    ]
