"""Launch-config tuning outside the model's forward: `tune_for_model` runs every Triton kernel a model
uses once per key (width / head layout, dtype), forward and backward, on dummy tensors of the model's shapes
inside `_utils.tuning()`, where the tuner may time candidates (which synchronizes the GPU). The forward
then finds every key cached; a key it meets untuned runs config 0 without timing (`_utils.Tuner.pick`).

The widths come from the family's ``ModelSpec.kernel_shapes`` (titan_mm.registry.KernelShapes); the tuner
knows no family. Which keys the Qwen families hit (per rank; tp = tensor-parallel degree):
- rms_norm:     hidden (attn_norm, the final norm, the unfused add + norm) and head_dim (q/k-norm, rows of
                heads / tp), forward and backward;
- add_rms_norm: hidden (Qwen3Block: residual add + ffn_norm), forward and backward with the residual grad;
- swiglu:       intermediate_size / tp, contiguous gate / up (separate w1 / w3 outputs), dense layers only;
- rope:         heads / tp, kv heads / tp, head_dim (Qwen3-VL's interleaved M-RoPE too: one HF-layout table);
                the ViTs' 2-D rotary: vision heads (/ tp with encoder_tp), vision head_dim;
- bias_gelu:    the ViT MLP width (/ tp with encoder_tp), Qwen3-VL with a tanh GELU only;
- linear_cross_entropy: the row kernel of the fused linear cross-entropy: vocabulary, forward with
                gradients (training; tp's vocabulary-parallel loss has its own kernels, not tuned).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import _utils
from ._dispatch import use_triton


def _grads(outs, inputs):
    """Backward with random (contiguous) output grads: a sum().backward() would hand the kernels an
    expanded (stride 0) gradient, which changes SwiGLU's key (contiguous vs strided rows)."""
    outs = [o for o in outs if o is not None and o.requires_grad]
    torch.autograd.grad(outs, inputs, [torch.randn_like(o) for o in outs], allow_unused=True)


def _calls(shapes, on, tokens: int, dtype, device, vision_tokens: int | None):
    """[(name, fn)]: one forward + backward of each kernel that ``on`` (the resolved op set) turns on, at the
    model's widths (``shapes``: titan_mm.registry.KernelShapes of one rank)."""
    # cycle: the package defines the ops after it imports this module
    from . import add_rms_norm, apply_rope, bias_gelu, linear_cross_entropy, rms_norm, swiglu

    n = tokens

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_(True)

    def norm(rows, width):
        def fn():
            x, w = rnd(*rows, width), rnd(width, scale=0.1)
            _grads([rms_norm(x, w, 1e-6)], [x, w])
        return fn

    def add_norm(d):
        def fn():
            x, r, w = rnd(n, d), rnd(n, d), rnd(d, scale=0.1)
            _grads(add_rms_norm(x, r, w, 1e-6), [x, r, w])
        return fn

    def act_mul(f):
        def fn():
            g, u = rnd(n, f), rnd(n, f)
            _grads([swiglu(g, u)], [g, u])
        return fn

    def rope(hq, hk, dh):
        def fn():
            q, k = rnd(1, n, hq, dh), rnd(1, n, hk, dh)
            ang = torch.rand(1, n, dh // 2, device=device) * 100
            ang = torch.cat((ang, ang), -1)  # the models' HF-layout [B, S, Dh] table
            _grads(apply_rope(q, k, ang.cos().to(dtype), ang.sin().to(dtype)), [q, k])
        return fn

    def gelu(nv, f):
        def fn():
            x, b = rnd(nv, f), rnd(f, scale=0.1)
            _grads([bias_gelu(x, b)], [x, b])
        return fn

    def lce(d, v):
        def fn():
            h, w = rnd(n, d), rnd(v, d, scale=d ** -0.5)
            linear_cross_entropy(h, w, torch.randint(0, v, (n,), device=device))
        return fn

    calls = []
    if "rms_norm" in on:
        calls += [(f"rms_norm [{n}, {d}]", norm((n,), d)) for d in shapes.rms_norm]
        calls += [(f"rms_norm (head norm) [{n}, {h}, {dh}]", norm((n, h), dh)) for h, dh in shapes.head_norm]
    if "add_rms_norm" in on:
        calls += [(f"add_rms_norm [{n}, {d}]", add_norm(d)) for d in shapes.add_rms_norm]
    if "swiglu" in on:
        calls += [(f"swiglu [{n}, {f}]", act_mul(f)) for f in shapes.swiglu]
    if "rope" in on:
        calls += [(f"rope q [{n}, {hq}, {dh}] k [{n}, {hk}, {dh}]", rope(hq, hk, dh)) for hq, hk, dh in shapes.rope]
    if "bias_gelu" in on:
        nv = vision_tokens or tokens
        calls += [(f"bias_gelu [{nv}, {f}]", gelu(nv, f)) for f in shapes.bias_gelu]
    if "linear_cross_entropy" in on and shapes.vocab:
        d = shapes.rms_norm[0]  # the final norm's width is the LM head's input width
        calls.append((f"linear_cross_entropy [{n}, {d}] x [{shapes.vocab}, {d}]", lce(d, shapes.vocab)))
    return calls


def tune_for_model(shapes, kernels: bool | str, tokens: int, dtype: torch.dtype, device,
                   vision_tokens: int | None = None, max_tokens: int = 16384) -> dict:
    """Pick the launch config of every Triton kernel a model uses, at its widths (``shapes``: the family's
    titan_mm.registry.KernelShapes for this rank, ``ModelSpec.kernel_shapes(cfg, tp, encoder_tp)``) and
    ``dtype``, by running each op that ``kernels`` (the model's kernels spec) turns on once forward + backward on
    random tensors inside `_utils.tuning()`. Call it once after building the model and before the first step
    (it synchronizes the GPU, so never from inside a forward).

    tokens: tokens per micro-batch on this rank (the timing shape; keys never depend on it), capped at
    ``max_tokens``; vision_tokens: ViT patches per micro-batch (default: ``tokens``).
    Returns {"tuned": {tuner: [key, ...]}, "seconds", "skipped": [reason, ...]}; nothing runs (a reason in
    "skipped") when no op is on, when the Triton path is not taken on ``device`` or with TITAN_KERNELS_TUNE=0.
    On the CPU interpreter every key caches config 0 (bookkeeping only)."""
    from . import resolve_ops  # cycle: the package defines it after it imports this module

    report: dict = {"tuned": {}, "seconds": 0.0, "skipped": []}
    device = torch.device(device)
    if not _utils.TUNE:
        report["skipped"].append("TITAN_KERNELS_TUNE=0: every kernel runs its first config")
        return report
    if not use_triton(torch.empty(0, device=device, dtype=dtype)):
        report["skipped"].append(f"no Triton path on {device} for {dtype}")
        return report
    n = max(1, min(int(tokens), max_tokens))
    nv = max(1, min(int(vision_tokens), max_tokens)) if vision_tokens else None
    calls = _calls(shapes, resolve_ops(kernels), n, dtype, device, nv)
    if not calls:
        report["skipped"].append("no tuned kernel is on in the model's kernels spec")
        return report
    before = {t.name: set(t.best) for t in _utils.Tuner.registry}
    t0 = time.perf_counter()
    with _utils.tuning():
        for name, fn in calls:
            try:
                fn()
            except torch.OutOfMemoryError:  # tuning is an optimization: leave those keys on their defaults
                report["skipped"].append(f"{name}: out of memory while tuning (default config)")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    for t in _utils.Tuner.registry:
        new = [k for k in t.best if k not in before.get(t.name, set())]
        if new:
            report["tuned"][t.name] = [str(k) for k in new]
    return report


def share_picks(src: int = 0, group=None) -> None:
    """Every rank of ``group`` takes rank ``src``'s picks (a collective: call it on every rank, after
    tune_for_model, outside the forward), so replicated computations launch the same configs and round alike
    on every rank. A no-op without an initialized process group of more than one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    picks = [_utils.export_picks()]
    dist.broadcast_object_list(picks, src=src, group=group)
    _utils.load_picks(picks[0])
