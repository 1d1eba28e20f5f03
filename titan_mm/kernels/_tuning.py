"""Launch-config tuning outside the model's forward: `tune_for_model` runs every Triton kernel a model
uses once per key (width / head layout, dtype), forward and backward, on dummy tensors of the model's shapes
inside `_utils.tuning()`, where the tuner may time candidates (which synchronizes the GPU). The forward
then finds every key cached; a key it meets untuned runs config 0 without timing (`_utils.Tuner.pick`).

Which keys the models hit (per rank; tp = tensor-parallel degree):
- rms_norm:     hidden (attn_norm, the final norm, the unfused add + norm) and head_dim (q/k-norm, rows of
                heads / tp), forward and backward;
- add_rms_norm: hidden (Qwen3Block: residual add + ffn_norm), forward and backward with the residual grad;
- swiglu:       intermediate_size / tp, contiguous gate / up (separate w1 / w3 outputs), dense layers only;
- rope:         heads / tp, kv heads / tp, head_dim (Qwen3-VL's interleaved M-RoPE too: one HF-layout table);
- bias_gelu:    the ViT MLP width (/ tp with encoder_tp), Qwen3-VL with a tanh GELU only;
- linear_cross_entropy: the row kernel of the fused linear cross-entropy: vocabulary, forward with
                gradients (training; tp's vocabulary-parallel loss has its own kernels, not tuned).
"""

from __future__ import annotations

import time

import torch

from . import _utils


def _grads(outs, inputs):
    """Backward with random (contiguous) output grads: a sum().backward() would hand the kernels an
    expanded (stride 0) gradient, which changes SwiGLU's key (contiguous vs strided rows)."""
    outs = [o for o in outs if o is not None and o.requires_grad]
    torch.autograd.grad(outs, inputs, [torch.randn_like(o) for o in outs], allow_unused=True)


def _calls(model_cfg, tokens: int, dtype, device, tp: int, encoder_tp: bool, vision_tokens: int | None):
    """[(name, fn)]: one forward + backward of each kernel the model's config turns on, at its shapes."""
    from . import add_rms_norm, apply_rope, bias_gelu, linear_cross_entropy, resolve_ops, rms_norm, swiglu

    on = resolve_ops(getattr(model_cfg, "kernels", False))
    text = getattr(model_cfg, "text", model_cfg)  # Qwen3-VL: the LLM's shapes
    n, d, dh = tokens, text.hidden_size, text.head_dim
    hq, hk = text.num_attention_heads // tp, text.num_key_value_heads // tp

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_(True)

    def norm(rows, width):
        def fn():
            x, w = rnd(*rows, width), rnd(width, scale=0.1)
            _grads([rms_norm(x, w, 1e-6)], [x, w])
        return fn

    def add_norm():
        x, r, w = rnd(n, d), rnd(n, d), rnd(d, scale=0.1)
        _grads(add_rms_norm(x, r, w, 1e-6), [x, r, w])

    def act_mul(f):
        def fn():
            g, u = rnd(n, f), rnd(n, f)
            _grads([swiglu(g, u)], [g, u])
        return fn

    def rope():
        q, k = rnd(1, n, hq, dh), rnd(1, n, hk, dh)
        ang = torch.rand(1, n, dh // 2, device=device) * 100
        ang = torch.cat((ang, ang), -1)  # the models' HF-layout [B, S, Dh] table
        _grads(apply_rope(q, k, ang.cos().to(dtype), ang.sin().to(dtype)), [q, k])

    def gelu(nv, f):
        def fn():
            x, b = rnd(nv, f), rnd(f, scale=0.1)
            _grads([bias_gelu(x, b)], [x, b])
        return fn

    def lce():
        h, w = rnd(n, d), rnd(text.vocab_size, d, scale=d ** -0.5)
        linear_cross_entropy(h, w, torch.randint(0, text.vocab_size, (n,), device=device))

    calls = []
    if "rms_norm" in on:  # attn_norm, the final norm (and the unfused add + norm's): hidden; q/k-norm: head_dim
        calls.append((f"rms_norm [{n}, {d}]", norm((n,), d)))
        calls.append((f"rms_norm (q/k-norm) [{n}, {hq}, {dh}]", norm((n, hq), dh)))
    if "add_rms_norm" in on:
        calls.append((f"add_rms_norm [{n}, {d}]", add_norm))
    dense = any(not text.is_moe_layer(i) for i in range(text.num_hidden_layers))
    if "swiglu" in on and dense:
        calls.append((f"swiglu [{n}, {text.intermediate_size // tp}]", act_mul(text.intermediate_size // tp)))
    if "rope" in on:
        calls.append((f"rope q [{n}, {hq}, {dh}] k [{n}, {hk}, {dh}]", rope))
    vision = getattr(model_cfg, "vision", None)
    if "bias_gelu" in on and vision is not None and vision.hidden_act == "gelu_pytorch_tanh":
        f = vision.intermediate_size // (tp if encoder_tp else 1)
        nv = vision_tokens or tokens
        calls.append((f"bias_gelu [{nv}, {f}]", gelu(nv, f)))
    if "linear_cross_entropy" in on:
        calls.append((f"linear_cross_entropy [{n}, {d}] x [{text.vocab_size}, {d}]", lce))
    return calls


def tune_for_model(model_cfg, tokens: int, dtype: torch.dtype, device, tp: int = 1, encoder_tp: bool = False,
                   vision_tokens: int | None = None, max_tokens: int = 16384) -> dict:
    """Pick the launch config of every Triton kernel that ``model_cfg`` (a Qwen3 / Qwen3-MoE / Qwen3-VL
    config; its ``kernels`` field says which ops are on) uses, for its widths and ``dtype``, by running each
    once forward + backward on random tensors inside `_utils.tuning()`. Call it once after building the model
    and before the first step (it synchronizes the GPU, so never from inside a forward).

    tokens: tokens per micro-batch on this rank (the timing shape; keys never depend on it), capped at
    ``max_tokens``; tp: tensor-parallel degree (heads and the MLP width per rank); encoder_tp: the ViT MLP is
    sharded over tp too; vision_tokens: ViT patches per micro-batch (default: ``tokens``).
    Returns {"tuned": {tuner: [key, ...]}, "seconds", "skipped": [reason, ...]}; nothing runs (a reason in
    "skipped") when no op is on, when the Triton path is not taken on ``device`` or with TITAN_KERNELS_TUNE=0.
    On the CPU interpreter every key caches config 0 (bookkeeping only)."""
    from . import use_triton

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
    calls = _calls(model_cfg, n, dtype, device, tp, encoder_tp, nv)
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
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    picks = [_utils.export_picks()]
    dist.broadcast_object_list(picks, src=src, group=group)
    _utils.load_picks(picks[0])
