"""The step-time floor of a dense Qwen3 training step on this GPU: the unavoidable GEMMs, attention and
optimizer, each timed alone with the libraries every stack calls (cuBLAS, cuDNN SDPA, fused AdamW).

Any stack that trains the model with these libraries does at least this work per step; the floor leaves out
everything memory-bound between the GEMMs (norms, RoPE, SwiGLU, residual adds, the CE's softmax, float8
casts, FSDP copies) and assumes the GPU is never idle, so the real ceiling is lower. The report sets the
floor's tokens/s next to the issue's targets (1.2x / 1.5x the faster peer of bench/results/mfu.json):
a target above the floor cannot be met with these libraries.

Timed per step, at the case's shape (tokens = batch x seq):
  gemm        every linear's forward, input-gradient and weight-gradient GEMM, all layers + the LM head, bf16
              (q/k/v and gate/up each timed separate and fused; the faster form counts)
  gemm_f8     the same GEMMs through torch._scaled_mm in float8 e4m3 with tensorwise scales (torchao's
              tensorwise recipe), except the LM head, which stays bf16 (titan_mm's float8.filter_fqns);
              without fast accumulation (torchao uses it in the forward), so its time errs on the slow side
  attention   causal GQA SDPA forward + backward (cuDNN backend, as titan_mm's and the peers' runs pick)
  adamw       one fused AdamW step over fp32 parameters of the model's shapes (tied embeddings counted once)

For an MoE case, the rows are those of one MoE layer instead (``moe_floor``), forward + backward in bf16, at the
case's tokens and at two routings: ``router`` (titan_mm's router, random weights, on random hidden states: near
uniform) and ``skewed`` (each token's experts drawn without replacement from a Zipf prior, s = 1, about what a
router with a weak balancing loss keeps):
  gemms       the nine grouped GEMMs alone (torch._grouped_mm: gate / up / down forward, their input and weight
              gradients) at that routing's tokens per expert, and one dense GEMM of the same FLOPs (what grouping
              costs)
  permute     titan_mm's gather of each token's rows into expert order (``moe.expand_rows``: its backward sums
              each token's rows by a gather) and its backward, against the bytes it moves at the H200's copy rate
              (4.23 TB/s, docs GPU.md); ``permute_autograd`` is plain ``x[tok_A]``, whose backward is index_put
              with accumulation (titan_mm's form before 2026-12-02)
  combine     the weighted sum back to tokens (``moe.combine``, a gather in both directions) and its backward,
              against its bytes; ``combine_index_add`` is the scatter with ``index_add_`` (the form before)
  route       router logits, softmax, top-k, renormalization and the aux statistics, forward + backward
  routing     the same after the router's GEMM, from bf16 logits with a padding mask (``moe.route_stats``: softmax,
              topk, renormalization, aux_stats, 6-8 kernels each way), forward + backward, against
              ``routing_fused`` (titan_mm.kernels.moe_routing, kernel op moe_routing: one pass each way); eager and
              (``*_compiled``) under torch.compile; at qwen3_30b_a3b_4l's shape N 16,384, E 128, K 8
  layer       titan_mm's whole MoE layer (titan_mm.nn.moe.MoE), forward + backward; the parts above
              do not add up to it exactly (the SwiGLU between the GEMMs is in ``layer`` only);
              ``layer_compiled`` the same under torch.compile, as the trainer runs its blocks
  *_fused     permute, combine and the compiled layer with titan_mm.kernels' token moves (kernel op moe_moves:
              each sum one pass, the router weights fused into the combine)
  gemms_gate_up_fused  the grouped GEMMs with gate and up as one [E, 2F, D] weight (six GEMMs: one input gradient
              for both, no add)
  gemms_f8    the nine GEMMs in float8 (float8.moe_experts: torchao's rowwise-scaled grouped GEMM, its casts and
              scales included) on the padded layout (each expert's rows a multiple of 16); ``layer_compiled_f8``
              the compiled layer with them and the fused moves (SM>=90 with torchao only, else None)
and the step's floor (``step``): the attention projections, SDPA and the experts' grouped GEMMs of every layer, the
LM head and fused AdamW over all parameters (moe_step_floor), with titan's MFU scaled to it (``floor_mfu``).

  PYTHONPATH=$PWD python3 bench/floor.py --cases qwen3_1.7b --out bench/results/floor.json
  PYTHONPATH=$PWD python3 bench/floor.py --cases qwen3_30b_a3b_4l --out bench/results/floor_moe.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.attention import bench as cuda_ms  # noqa: E402  (median CUDA-event ms of fn())
from bench.mfu import CASES, model_config  # noqa: E402

from titan_mm.registry import ModelDims, spec_for_config  # noqa: E402

PEAK_TFLOPS = 989.0


def dims_of(m) -> ModelDims:
    """The decoder's shapes: ``m`` itself (titan_mm.registry.ModelDims) or its family's spec.dims of a model config."""
    return m if isinstance(m, ModelDims) else spec_for_config(m).dims(m)


def linears(m) -> dict[str, list[tuple[int, int]]]:
    """Per decoder layer: group -> [(in, out)] of its linears, in two forms (separate and fused)."""
    t = dims_of(m)
    d, f, hd = t.hidden_size, t.intermediate_size, t.head_dim
    q, kv = t.num_heads * hd, t.num_kv_heads * hd
    return {
        "qkv": [(d, q), (d, kv), (d, kv)], "qkv_fused": [(d, q + 2 * kv)],
        "o": [(q, d)],
        "gate_up": [(d, f), (d, f)], "gate_up_fused": [(d, 2 * f)],
        "down": [(f, d)],
    }


def gemm_list(n: int, pairs, float8: bool, device="cuda", dtype=torch.bfloat16):
    """The three GEMMs of each linear (x [n, in], W [out, in]) as closures over preallocated operands (float8:
    e4m3 on CUDA; else ``dtype`` on ``device``)."""
    ops, flops = [], 0
    for i, o in pairs:
        flops += 6 * n * i * o
        if float8:
            e4 = torch.float8_e4m3fn
            x = torch.randn(n, i, device="cuda").to(e4)
            w = torch.randn(o, i, device="cuda").to(e4)
            dy = torch.randn(n, o, device="cuda").to(e4)
            dyt = dy.t().contiguous()  # for the weight gradient, the left operand is dy^T row-major
            xt = x.t().contiguous()    # ... and the right operand x, column-major
            one = torch.ones((), device="cuda")
            wt = w.t().contiguous()    # dgrad: dy @ W with W column-major
            ops += [
                lambda x=x, w=w, one=one: torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16),
                lambda dy=dy, wt=wt, one=one: torch._scaled_mm(dy, wt.t(), one, one, out_dtype=torch.bfloat16),
                lambda dyt=dyt, xt=xt, one=one: torch._scaled_mm(dyt, xt.t(), one, one, out_dtype=torch.bfloat16),
            ]
        else:
            x = torch.randn(n, i, device=device, dtype=dtype)
            w = torch.randn(o, i, device=device, dtype=dtype)
            dy = torch.randn(n, o, device=device, dtype=dtype)
            ops += [lambda x=x, w=w: x @ w.t(), lambda dy=dy, w=w: dy @ w, lambda dy=dy, x=x: dy.t() @ x]
    return ops, flops


def time_ops(ops) -> float:
    def run():
        for op in ops:
            op()
    return cuda_ms(run, iters=10)


def gemm_floor(t: ModelDims, n: int, float8: bool) -> dict:
    """ms per step of all GEMMs: per layer the faster of separate / fused qkv and gate_up, x layers, + head."""
    groups = linears(t)
    per_layer, detail = 0.0, {}
    layer_flops = 0
    for name in ("qkv", "o", "gate_up", "down"):
        forms = [name] + ([name + "_fused"] if name + "_fused" in groups else [])
        best = None
        for form in forms:
            ops, fl = gemm_list(n, groups[form], float8)
            ms = time_ops(ops)
            detail[form] = round(ms, 4)
            del ops
            if best is None or ms < best[0]:
                best = (ms, fl)
        per_layer += best[0]
        layer_flops += best[1]
    ops, head_flops = gemm_list(n, [(t.hidden_size, t.vocab_size)], False)  # the LM head stays bf16
    head_ms = time_ops(ops)
    del ops
    torch.cuda.empty_cache()
    L = t.num_layers
    ms = per_layer * L + head_ms
    flops = layer_flops * L + head_flops
    return dict(ms=ms, tflops=flops / ms / 1e9, layer_ms=per_layer, head_ms=head_ms, per_form_ms=detail,
                flops=flops)


def attention_floor(t: ModelDims, batch: int, seq: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, g, hd = t.num_heads, t.num_kv_heads, t.head_dim
    q = torch.randn(batch, h, seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, g, seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, g, seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(batch, h, seq, hd, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def run(be=be):
            with sdpa_kernel([be]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != h)
            o.backward(do)
        try:
            out[name] = cuda_ms(run, iters=10)
        except RuntimeError as e:  # a backend this build lacks for the shape
            out[name] = None
            print(f"[floor] attention {name}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    best = min(v for v in out.values() if v is not None)
    # causal: half the S x S score matrix; fwd 2 GEMMs, bwd 5 (FLOPs as docs/flops.md counts them: 3.5x fwd)
    flops = 3.5 * 2 * 2 * batch * h * seq * seq * hd / 2
    L = t.num_layers
    return dict(ms=best * L, layer_ms=best, per_backend_layer_ms=out, tflops=flops / best / 1e9)


def adamw_floor(t: ModelDims) -> dict:
    d, f, hd, L = t.hidden_size, t.intermediate_size, t.head_dim, t.num_layers
    q, kv = t.num_heads * hd, t.num_kv_heads * hd
    if t.is_moe:  # router and the stacked experts in place of the dense MLP
        E, fm = t.num_experts, t.moe_intermediate_size
        mlp = [(E, d), (E, fm, d), (E, fm, d), (E, d, fm)]
    else:
        mlp = [(f, d), (f, d), (d, f)]
    layer = [(q, d), (kv, d), (kv, d), (d, q), *mlp, (d,), (d,), (hd,), (hd,)]
    shapes = layer * L + [(t.vocab_size, d), (d,)] + ([] if t.tie_word_embeddings else [(t.vocab_size, d)])
    return adamw_time(shapes)


def adamw_time(shapes: list[tuple[int, ...]]) -> dict:
    """One fused AdamW step over fp32 parameters of ``shapes`` (ms, parameters, GB/s moved)."""
    params = [torch.zeros(s, device="cuda", requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    ms = cuda_ms(opt.step, iters=5, warmup=2)
    n = sum(p.numel() for p in params)
    del opt, params
    torch.cuda.empty_cache()
    return dict(ms=ms, params=n, gb_per_s=n * 4 * 7 / ms / 1e6)  # read p g m v, write p m v (fp32)


COPY_TBS = 4.23  # the H200's device-to-device copy rate (docs GPU.md)


def routing(n: int, t: ModelDims, kind: str, device, seed: int = 0) -> torch.Tensor:
    """top_i [n, K] of one MoE layer: ``router`` (titan_mm's router, random weights, on random hidden states) or
    ``skewed`` (experts drawn without replacement from a Zipf prior over a random order of the experts)."""
    from titan_mm.nn.moe import route

    g = torch.Generator(device=device).manual_seed(seed)
    E, K, D = t.num_experts, t.experts_per_tok, t.hidden_size
    if kind == "router":
        x = torch.randn(n, D, device=device, generator=g)
        w = torch.randn(E, D, device=device, generator=g) * D**-0.5
        return route(x, w, K, True)[2]
    if kind == "skewed":
        prior = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32)
        prior = prior[torch.randperm(E, device=device, generator=g)]
        return torch.multinomial(prior.expand(n, E), K, replacement=False, generator=g)
    raise ValueError(f"routing kind {kind!r}: router | skewed")


def moe_floor(t: ModelDims, n: int, kind: str, device=None, dtype=torch.bfloat16) -> dict:
    """One MoE layer's parts and their floors at ``n`` tokens and ``kind`` routing (the module docstring)."""
    from titan_mm import kernels
    from titan_mm.nn import moe

    device = device or torch.device("cuda")
    from bench.optim_step import timed

    gpu = device.type == "cuda"
    ms_of = lambda fn: timed(fn, device, iters=10 if gpu else 3, warmup=3 if gpu else 1)  # noqa: E731
    E, K, D, F_ = t.num_experts, t.experts_per_tok, t.hidden_size, t.moe_intermediate_size
    A = n * K
    top_i = routing(n, t, kind, device)
    counts = torch.bincount(top_i.reshape(-1), minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    mk = lambda *s: (torch.randn(*s, device=device) * 0.02).to(dtype)  # noqa: E731
    # the experts' GEMMs as titan_mm's grouped path calls them (weights [E, out, in]), on leaves: no SwiGLU
    x_AD, h_AF = mk(A, D).requires_grad_(), mk(A, F_).requires_grad_()
    w1, w3, w2 = (mk(E, F_, D).requires_grad_(), mk(E, F_, D).requires_grad_(), mk(E, D, F_).requires_grad_())
    dh_AF, dy_AD = mk(A, F_), mk(A, D)
    gm = torch._grouped_mm

    def gemms():  # forward gate, up, down; backward: their input and weight gradients (autograd's layouts)
        for leaf in (x_AD, h_AF, w1, w3, w2):
            leaf.grad = None
        outs = [gm(x_AD, w1.transpose(-2, -1), offs=offs), gm(x_AD, w3.transpose(-2, -1), offs=offs),
                gm(h_AF, w2.transpose(-2, -1), offs=offs)]
        torch.autograd.backward(outs, [dh_AF, dh_AF, dy_AD])
    gemm_flops = 2 * A * D * F_ * 9
    w13 = torch.cat([w1, w3], 1).detach().requires_grad_()  # gate and up as one [E, 2F, D] weight (HF 5's layout)
    dh2_AF = mk(A, 2 * F_)

    def gemms_fused():  # six grouped GEMMs: the input gradient of gate / up is one GEMM, without the add
        for leaf in (x_AD, h_AF, w13, w2):
            leaf.grad = None
        outs = [gm(x_AD, w13.transpose(-2, -1), offs=offs), gm(h_AF, w2.transpose(-2, -1), offs=offs)]
        torch.autograd.backward(outs, [dh2_AF, dy_AD])
    a_AD, b_DF = mk(A, D), mk(D, 3 * F_)  # one dense GEMM of the same FLOPs, three times (fwd, dgrad, wgrad)
    dense = lambda: [a_AD @ b_DF for _ in range(3)]  # noqa: E731

    x_ND = mk(n, D).requires_grad_()
    r = moe.sort_by_expert(top_i, E)

    # float8: the same GEMMs on the padded layout (groups of multiples of 16 rows, pad rows zero)
    f8 = gpu and torch.cuda.get_device_capability(device) >= (9, 0) and importlib.util.find_spec("torchao") is not None
    rp = moe.sort_by_expert(top_i, E, moe.FLOAT8_ALIGN)
    offs8 = torch.cumsum(rp.counts_E, 0, dtype=torch.int32)
    pad = (rp.src_A == n)[:, None]
    x_PD, h_PF = (mk(rp.src_A.numel(), c).masked_fill(pad, 0).requires_grad_() for c in (D, F_))
    dh_PF, dy_PD = mk(rp.src_A.numel(), F_).masked_fill(pad, 0), mk(rp.src_A.numel(), D).masked_fill(pad, 0)

    def gemms_f8():
        for leaf in (x_PD, h_PF, w1, w3, w2):
            leaf.grad = None
        outs = [moe.float8_grouped_mm(x_PD, w1, offs8), moe.float8_grouped_mm(x_PD, w3, offs8),
                moe.float8_grouped_mm(h_PF, w2, offs8)]
        torch.autograd.backward(outs, [dh_PF, dh_PF, dy_PD])

    def permute():
        x_ND.grad = None
        moe.expand_rows(x_ND, r.src_A, r.inv_NK).backward(dy_AD)

    fused = moe.TokenMoves(kernels.moe_expand, kernels.moe_combine)

    def permute_fused():
        x_ND.grad = None
        fused.expand(x_ND, r.src_A, r.inv_NK).backward(dy_AD)

    def permute_autograd():
        x_ND.grad = None
        x_ND[r.src_A].backward(dy_AD)
    y_AD = mk(A, D).requires_grad_()
    w_NK = torch.rand(n, K, device=device).to(dtype).requires_grad_()
    dy_ND = mk(n, D)

    def combine():
        y_AD.grad = w_NK.grad = None
        moe.combine(y_AD, w_NK, r, dtype).backward(dy_ND)

    def combine_fused():
        y_AD.grad = w_NK.grad = None
        fused.combine(y_AD, w_NK, r, dtype).backward(dy_ND)

    def combine_index_add():
        y_AD.grad = w_NK.grad = None
        w_A = w_NK.reshape(-1)[r.order_A, None]
        torch.zeros(n, D, device=device, dtype=dtype).index_add_(0, r.src_A, y_AD * w_A).backward(dy_ND)
    elt = torch.finfo(dtype).bits // 8
    # lower bounds, each tensor touched once a pass: permute's forward reads and writes A rows, its backward reads
    # A rows and writes N (accumulating K each); combine the same, plus the weighted rows written and read again
    permute_bytes = elt * D * (2 * A + A + n)
    combine_bytes = elt * D * (2 * A + A + n) + elt * D * 4 * A

    layer = moe.MoE(D, F_, E, K, norm_topk_prob=True).to(device=device, dtype=dtype)
    layer.reset_parameters(0.02)
    layer_fused = moe.MoE(D, F_, E, K, norm_topk_prob=True, moves=fused).to(device=device, dtype=dtype)
    layer_fused.load_state_dict(layer.state_dict())
    layer_f8 = moe.MoE(D, F_, E, K, norm_topk_prob=True, moves=fused, float8=True).to(device=device, dtype=dtype)
    layer_f8.load_state_dict(layer.state_dict())
    xl = mk(1, n, D).requires_grad_()

    def route_part():
        probs, w, i = moe.route(xl[0], layer.router.weight, K, True)
        (w.float().sum() + moe.aux_stats(probs, i, None).sum()).backward()

    # the routing after the router's GEMM: its logits as a leaf, the last 1/16 of the tokens padding
    lg_NE = torch.randn(n, E, device=device).to(dtype).requires_grad_()
    valid_N = torch.arange(n, device=device) < n - n // 16
    dw_NK, ds_2E = mk(n, K), torch.randn(2, E, device=device)

    def routing_step(fn):
        def run():
            lg_NE.grad = None
            w, _, s = fn(lg_NE, K, True, valid_N)
            torch.autograd.backward([w, s], [dw_NK, ds_2E])
        return run
    routing_ref, routing_fused = routing_step(moe.route_stats), routing_step(kernels.moe_routing)
    routing_ref_c = routing_step(torch.compile(moe.route_stats))
    routing_fused_c = routing_step(torch.compile(kernels.moe_routing))

    def layer_loss(x, m=layer):  # the layer's own route, then its experts at this routing's choices
        probs, w, i = moe.route(x, m.router.weight, K, True)
        y = m.experts(x, w, top_i)
        return y.float().pow(2).mean() + moe.aux_stats(probs, i, None).sum()
    compiled_loss = torch.compile(layer_loss)
    compiled_fused = torch.compile(lambda x: layer_loss(x, layer_fused))
    compiled_f8 = torch.compile(lambda x: layer_loss(x, layer_f8))
    whole = lambda: layer_loss(xl[0]).backward()  # noqa: E731
    whole_compiled = lambda: compiled_loss(xl[0]).backward()  # noqa: E731
    whole_fused_compiled = lambda: compiled_fused(xl[0]).backward()  # noqa: E731
    whole_f8_compiled = lambda: compiled_f8(xl[0]).backward()  # noqa: E731
    forced, moe.GROUPED_MM = moe.GROUPED_MM, True  # the grouped path on the CPU smoke test as well
    try:
        res = dict(kind=kind, tokens=n, assignments=A, max_over_mean=float(counts.max() * E / A),
                   gemms_ms=ms_of(gemms), gemms_gate_up_fused_ms=ms_of(gemms_fused),
                   dense_same_flops_ms=ms_of(dense), permute_ms=ms_of(permute),
                   permute_autograd_ms=ms_of(permute_autograd), permute_fused_ms=ms_of(permute_fused),
                   combine_ms=ms_of(combine), combine_index_add_ms=ms_of(combine_index_add),
                   combine_fused_ms=ms_of(combine_fused), route_ms=ms_of(route_part),
                   routing_ms=ms_of(routing_ref), routing_fused_ms=ms_of(routing_fused),
                   routing_compiled_ms=ms_of(routing_ref_c) if gpu else None,
                   routing_fused_compiled_ms=ms_of(routing_fused_c) if gpu else None, layer_ms=ms_of(whole),
                   layer_compiled_ms=ms_of(whole_compiled) if gpu else None,
                   layer_compiled_fused_ms=ms_of(whole_fused_compiled) if gpu else None,
                   gemms_f8_ms=ms_of(gemms_f8) if f8 else None,
                   layer_compiled_f8_ms=ms_of(whole_f8_compiled) if f8 else None)
    finally:
        moe.GROUPED_MM = forced
    res.update(gemm_flops=gemm_flops, gemms_tflops=gemm_flops / res["gemms_ms"] / 1e9,
               dense_tflops=gemm_flops / res["dense_same_flops_ms"] / 1e9,
               permute_floor_ms=permute_bytes / COPY_TBS / 1e9, combine_floor_ms=combine_bytes / COPY_TBS / 1e9)
    res["layer_tflops"] = gemm_flops / res["layer_ms"] / 1e9
    res["gemms_f8_tflops"] = gemm_flops / res["gemms_f8_ms"] / 1e9 if f8 else None  # the unpadded rows' FLOPs
    return res


def moe_step_floor(t: ModelDims, name: str, case: dict, layer: dict, mfu_json: Path) -> dict:
    """The floor of an MoE step: per layer the attention projections (the faster of separate and fused q/k/v),
    SDPA and the experts' grouped GEMMs at the router's routing (the faster of separate and fused gate / up),
    the LM head, and fused AdamW over every parameter; the router's own small GEMM and everything memory-bound
    between are left out. ``floor_mfu``: titan's MFU row of bench/results/mfu.json scaled to this step time."""
    n = case["batch"] * case["seq"]
    groups = linears(t)
    proj = 0.0
    for group in ("qkv", "o"):
        proj += min(time_ops(gemm_list(n, groups[form], False)[0]) for form in (group, group + "_fused") if form in groups)
    head = time_ops(gemm_list(n, [(t.hidden_size, t.vocab_size)], False)[0])
    torch.cuda.empty_cache()
    attn = attention_floor(t, case["batch"], case["seq"])["layer_ms"]
    experts = min(layer["gemms_ms"], layer["gemms_gate_up_fused_ms"])
    adam = adamw_floor(t)["ms"]
    L = t.num_layers
    parts = dict(projections=round(proj * L, 2), attention=round(attn * L, 2), experts=round(experts * L, 2),
                 head=round(head, 2), adamw=round(adam, 2))
    floor_ms = sum(parts.values())
    rows = [r for r in json.loads(mfu_json.read_text()).get("rows", []) if r.get("case") == name
            and r.get("stack") == "titan" and r.get("ac", "none") == "none"] if mfu_json.exists() else []
    mfu = rows[-1]["mfu"] * rows[-1]["step_time_s"] * 1e3 / floor_ms if rows else None
    return dict(parts_ms=parts, floor_ms=floor_ms, floor_tok_s=n / floor_ms * 1e3,
                floor_mfu=round(mfu, 3) if mfu else None)


def peers(case: str, mfu_json: Path) -> dict:
    """The latest rows of bench/results/mfu.json for the case: titan stacks and the peers."""
    if not mfu_json.exists():
        return {}
    rows = {}
    for r in json.loads(mfu_json.read_text()).get("rows", []):
        if r.get("case") == case and r.get("ac", "none") == "none":
            rows[r["stack"]] = r["tokens_per_s"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="qwen3_1.7b")
    ap.add_argument("--out", default=str(ROOT / "bench/results/floor.json"))
    ap.add_argument("--mfu-json", default=str(ROOT / "bench/results/mfu.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        spec, mc = model_config(case)
        t = spec.dims(mc)
        n = case["batch"] * case["seq"]
        t0 = time.time()
        if t.is_moe:  # one MoE layer's parts against their floors, at two routings, and the step's floor
            moe_rows = [moe_floor(t, n, kind) for kind in ("router", "skewed")]
            rows.append(dict(case=name, tokens=n, moe=moe_rows, step=moe_step_floor(t, name, case, moe_rows[0], Path(args.mfu_json)),
                             gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                             seconds=round(time.time() - t0, 1)))
            st = rows[-1]["step"]
            print(f"{name} step floor: {st['floor_ms']:.1f} ms ({st['parts_ms']}) = {st['floor_tok_s']:,.0f} tok/s, "
                  f"MFU {st['floor_mfu']}", flush=True)
            for m in rows[-1]["moe"]:
                print(f"{name} {m['kind']} (max/mean {m['max_over_mean']:.2f}): gemms {m['gemms_ms']:.2f} ms "
                      f"({m['gemms_tflops']:.0f} TFLOP/s; dense same FLOPs {m['dense_tflops']:.0f}), permute "
                      f"{m['permute_ms']:.2f} ms (x[tok] {m['permute_autograd_ms']:.2f}, floor {m['permute_floor_ms']:.2f}), "
                      f"combine {m['combine_ms']:.2f} (index_add {m['combine_index_add_ms']:.2f}, floor "
                      f"{m['combine_floor_ms']:.2f}), fused moves: permute {m['permute_fused_ms']:.2f} combine "
                      f"{m['combine_fused_ms']:.2f}, route {m['route_ms']:.2f}, layer {m['layer_ms']:.2f} ms "
                      f"(compiled {m['layer_compiled_ms']:.2f}; with the fused moves {m['layer_compiled_fused_ms']:.2f})",
                      flush=True)
                print(f"{name} {m['kind']} routing fwd+bwd (N {n}, E {t.num_experts}, K {t.experts_per_tok}, bf16): "
                      f"reference {m['routing_ms']:.3f} ms (compiled {m['routing_compiled_ms']:.3f}), fused "
                      f"{m['routing_fused_ms']:.3f} ms (compiled {m['routing_fused_compiled_ms']:.3f})", flush=True)
                if m["gemms_f8_ms"] is not None:
                    print(f"{name} {m['kind']} float8 experts: gemms {m['gemms_f8_ms']:.2f} ms "
                          f"({m['gemms_f8_tflops']:.0f} TFLOP/s), layer compiled {m['layer_compiled_f8_ms']:.2f} ms",
                          flush=True)
            continue
        gemm = gemm_floor(t, n, False)
        gemm8 = gemm_floor(t, n, True)
        attn = attention_floor(t, case["batch"], case["seq"])
        adam = adamw_floor(t)
        floor_ms = gemm["ms"] + attn["ms"] + adam["ms"]
        floor8_ms = gemm8["ms"] + attn["ms"] + adam["ms"]
        p = peers(name, Path(args.mfu_json))
        best_peer = max((v for k, v in p.items() if not k.startswith("titan")), default=None)
        row = dict(
            case=name, tokens=n, gemm=gemm, gemm_f8=gemm8, attention=attn, adamw=adam,
            floor_ms=floor_ms, floor_tok_s=n / floor_ms * 1e3,
            floor_f8_ms=floor8_ms, floor_f8_tok_s=n / floor8_ms * 1e3,
            mfu_rows=p, best_peer_tok_s=best_peer,
            target_bf16_tok_s=1.2 * best_peer if best_peer else None,
            target_f8_tok_s=1.5 * best_peer if best_peer else None,
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, seconds=round(time.time() - t0, 1),
        )
        rows.append(row)
        print(f"{name}: gemm {gemm['ms']:.1f} ms ({gemm['tflops']:.0f} TFLOP/s), f8 {gemm8['ms']:.1f} ms "
              f"({gemm8['tflops']:.0f}), attention {attn['ms']:.1f} ms ({attn['tflops']:.0f}), adamw "
              f"{adam['ms']:.1f} ms -> floor {floor_ms:.1f} ms = {row['floor_tok_s']:,.0f} tok/s "
              f"(float8 {row['floor_f8_tok_s']:,.0f}); best peer {best_peer}; targets "
              f"{row['target_bf16_tok_s']} / {row['target_f8_tok_s']}", flush=True)
    Path(args.out).write_text(json.dumps(dict(
        note="per-step floor: GEMMs + attention + fused AdamW, each timed alone; MoE cases: one MoE layer's parts "
             "(bench/floor.py docstring)",
        rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
