"""Per-kernel benchmark on one GPU: eager PyTorch, torch.compile of the reference, Liger 0.8.5, titan_mm.

Named kernel_ops, not kernels: run as a script, bench/ leads sys.path, and a bench/kernels.py shadowed the
`kernels` package that transformers (>= 5.25) imports.

Shapes: Qwen3-8B / Qwen3-VL, 16,384 tokens x hidden 4096, bf16 (SwiGLU at the 8B MLP width 12,288;
RoPE with 32 q / 8 kv heads of 128; bias-GELU at the Qwen3-VL ViT MLP width 4,304; fused linear CE with
vocabulary 151,936). For each kernel, implementation and mode (fwd, fwd+bwd): median time over many
iterations (CUDA events), peak memory above the inputs, and achieved bandwidth (minimum bytes moved / time)
against the H200 copy ceiling of 4.23 TB/s; for the CE, TFLOP/s of its three GEMMs.

Time (`ms`) is device time: the GPU queue is kept ahead of the host (a GPU sleep before each batch of calls),
so Python and launch overhead do not count; `ms_loop` is the old back-to-back loop, where a call whose host
side is slower than its kernels measures the host. Before timing a titan_mm row, one fwd+bwd and one fwd call
run inside titan_mm.kernels.tuning(), which picks the launch configs for these shapes (seconds; the model's
forward never tunes); the picks are in each titan_mm row's `config` and, with the candidates' times, in
meta.tuning. Every kernel with a Liger row times Liger and titan_mm twice, in the order A B B A, and reports
the mean (`ms_runs` holds both): the clock drifts over the ~100 ms GPU-bound CE calls, where a single pass
favoured whichever ran first, and the memory-bound kernels differ by about 1 us. The JSON is rewritten after every kernel, so a run cut short keeps what it
measured.

    PYTHONPATH=$PWD:/tmp/site python3 bench/kernel_ops.py [--out bench/results/kernels.json] [--only rms_norm,...]
    python3 bench/kernel_ops.py --render bench/results/kernels.json [--doc docs/kernels.md]   # markdown table

Runs in < 3 minutes on the H200 (torch.compile of the references is most of it: no new compile row starts
after --budget-s; --no-compile skips them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

COPY_CEILING_TBS = 4.23  # H200 device-to-device copy, bytes read + written (shared/GPU.md)
MATMUL_CEILING_TFLOPS = 796.0  # H200 bf16 matmul 8192^3, measured
PROFILE_DIR = ""  # --profile: where run_case writes its torch.profiler tables
N_TOKENS, HIDDEN, FFN, VOCAB, VIT_FFN = 16384, 4096, 12288, 151936, 4304
HQ, HK, DH, MROPE_SECTION = 32, 8, 128, [24, 20, 20]
DOC_BEGIN, DOC_END = "<!-- kernels-bench:begin -->", "<!-- kernels-bench:end -->"


# ---------------------------------------------------------------------------------------------- timing


_CYCLES_PER_MS: list = []


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles per ms of torch.cuda._sleep (measured once)."""
    import torch

    if not _CYCLES_PER_MS:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(20_000_000)
        e.record()
        e.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / max(s.elapsed_time(e), 1e-3))
    return _CYCLES_PER_MS[0]


def time_ms(fn, min_iters=10, max_iters=100, budget_s=0.25, batch=25):
    """-> (device ms, loop ms, iterations).

    device ms: median over CUDA event pairs around each call while the GPU queue is kept ahead of the host
    (a GPU-side sleep before each batch of `batch` calls covers the time the host needs to enqueue them), so
    it is the GPU time of the call: kernels plus the gaps between them, without Python/launch overhead.
    loop ms: the same calls back to back with no sleep (the previous method): when the host needs longer to
    issue a call than the GPU needs to run it, this is host time. Both are reported; `ms` is device ms."""
    import torch

    if not torch.cuda.is_available():  # smoke mode: wall clock, a few iterations
        ts = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts), statistics.median(ts), len(ts)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)  # >= host time and >= GPU time of one call
    iters = int(min(max_iters, max(min_iters, budget_s / one)))

    def timed(k, sleep_ms):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
        if sleep_ms > 0:
            torch.cuda._sleep(int(_sleep_cycles_per_ms() * sleep_ms))
        for i in range(k):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return [s_.elapsed_time(e_) for s_, e_ in zip(starts, ends)]

    loop = timed(min(iters, 30), 0.0)
    if one > 5e-3:  # a call this long is GPU-bound: no sleep needed, the loop is the device time
        return statistics.median(loop), statistics.median(loop), len(loop)
    dev = []
    while len(dev) < iters:
        k = min(batch, iters - len(dev))
        dev += timed(k, min(200.0, 1.5 * k * one * 1e3))
    return statistics.median(dev), statistics.median(loop), iters


def peak_mb(fn):
    import torch

    if not torch.cuda.is_available():
        fn()
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# ---------------------------------------------------------------------------------------------- cases


def _liger(name):
    """Import a Liger autograd Function; None (with the reason printed) when Liger does not load."""
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction as F
        elif name == "add_rms_norm":
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as F
        elif name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as F
        elif name == "rope":
            from liger_kernel.ops.rope import LigerRopeFunction as F
        elif name == "mrope_model":
            from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction as F
        elif name == "linear_cross_entropy":
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as F
        else:
            return None
        return F
    except Exception as e:  # reported in the results, never silently
        print(f"[liger] {name}: import failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def set_smoke_shapes():
    """Tiny shapes for a CPU run through TRITON_INTERPRET=1 (tests the script, not the speed)."""
    global N_TOKENS, HIDDEN, FFN, VOCAB, VIT_FFN, HQ, HK, DH, MROPE_SECTION
    N_TOKENS, HIDDEN, FFN, VOCAB, VIT_FFN, HQ, HK, DH, MROPE_SECTION = 64, 64, 96, 500, 80, 4, 2, 16, [4, 2, 2]


def build_cases(only):
    """Per kernel: inputs factory, byte counts, and {impl: (fwd_fn(inputs) -> outputs)}."""
    import torch
    import torch.nn.functional as F

    import titan_mm.kernels as K
    from titan_mm.nn import mlp, norm, rope  # the PyTorch references (eager / compile rows)

    dev, dt = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    N, D = N_TOKENS, HIDDEN
    e = 2  # bytes per bf16 element

    def rnd(*s, scale=1.0, dtype=dt):
        return (torch.randn(*s, device=dev, dtype=dtype) * scale).requires_grad_(True)

    cases = {}

    # RMSNorm: fwd reads x, writes y; bwd reads x, dy, writes dx (w, rstd negligible)
    L = _liger("rms_norm")
    cases["rms_norm"] = dict(
        shape=f"x [{N}, {D}] bf16",
        inputs=lambda: dict(x=rnd(N, D), w=rnd(D, scale=0.1)),
        fwd_bytes=2 * N * D * e, bwd_bytes=3 * N * D * e,
        impls={
            "eager": lambda x, w: norm.rms_norm(x, w, 1e-6),
            "compile": ("compile", lambda x, w: norm.rms_norm(x, w, 1e-6)),
            "liger": (lambda x, w, L=L: L.apply(x, w, 1e-6)) if L else None,
            "titan_mm": lambda x, w: K.rms_norm(x, w, 1e-6),
        },
    )
    # Qwen3 q-norm: RMSNorm over head_dim for every (token, q head): many short rows
    cases["rms_norm_qk"] = dict(
        shape=f"q [{N * HQ}, {DH}] bf16 (q-norm over head_dim)",
        inputs=lambda: dict(x=rnd(N * HQ, DH), w=rnd(DH, scale=0.1)),
        fwd_bytes=2 * N * HQ * DH * e, bwd_bytes=3 * N * HQ * DH * e,
        impls={
            "eager": lambda x, w: norm.rms_norm(x, w, 1e-6),
            "compile": ("compile", lambda x, w: norm.rms_norm(x, w, 1e-6)),
            "liger": (lambda x, w, L=L: L.apply(x, w, 1e-6)) if L else None,
            "titan_mm": lambda x, w: K.rms_norm(x, w, 1e-6),
        },
    )
    L = _liger("add_rms_norm")
    cases["add_rms_norm"] = dict(
        shape=f"x, residual [{N}, {D}] bf16",
        inputs=lambda: dict(x=rnd(N, D), r=rnd(N, D), w=rnd(D, scale=0.1)),
        fwd_bytes=4 * N * D * e, bwd_bytes=4 * N * D * e,
        impls={
            "eager": lambda x, r, w: norm.add_rms_norm(x, r, w, 1e-6),
            "compile": ("compile", lambda x, r, w: norm.add_rms_norm(x, r, w, 1e-6)),
            "liger": (lambda x, r, w, L=L: L.apply(x, r, w, 1e-6)) if L else None,
            "titan_mm": lambda x, r, w: K.add_rms_norm(x, r, w, 1e-6),
        },
    )
    L = _liger("swiglu")
    cases["swiglu"] = dict(
        shape=f"gate, up [{N}, {FFN}] bf16",
        inputs=lambda: dict(g=rnd(N, FFN), u=rnd(N, FFN)),
        fwd_bytes=3 * N * FFN * e, bwd_bytes=5 * N * FFN * e,
        impls={
            "eager": lambda g, u: mlp.silu_mul(g, u),
            "compile": ("compile", lambda g, u: mlp.silu_mul(g, u)),
            "liger": (lambda g, u, L=L: L.apply(g, u)) if L else None,
            "titan_mm": lambda g, u: K.swiglu(g, u),
        },
    )
    B, S = 4, N // 4
    qk_bytes = N * (HQ + HK) * DH * e
    half = DH // 2

    def rope_inputs():
        ang = torch.rand(B, S, half, device=dev) * 100
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dt), torch.cat((ang.sin(), ang.sin()), -1).to(dt)
        return dict(q=rnd(B, S, HQ, DH), k=rnd(B, S, HK, DH), cos=cos, sin=sin)

    L = _liger("rope")
    cases["rope"] = dict(
        shape=f"q [{B}, {S}, {HQ}, {DH}], k [{B}, {S}, {HK}, {DH}] bf16",
        inputs=rope_inputs,
        fwd_bytes=2 * qk_bytes + N * DH * e, bwd_bytes=2 * qk_bytes + N * DH * e,  # + cos/sin halves
        impls={
            "eager": lambda q, k, cos, sin: rope.apply_rope(q, k, cos, sin),
            "compile": ("compile", lambda q, k, cos, sin: rope.apply_rope(q, k, cos, sin)),
            # Liger wants [B, H, S, Dh]; HF models hold q/k that way before attention
            "liger": (lambda q, k, cos, sin, L=L: L.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)) if L else None,
            "titan_mm": lambda q, k, cos, sin: K.apply_rope(q, k, cos, sin),
        },
    )

    def mrope_model_inputs():
        from titan_mm.models.qwen3_vl.model import mrope_cos_sin

        pos = torch.randint(0, 4096, (3, B, S), device=dev)
        inv = 1.0 / (5e6 ** (torch.arange(0, DH, 2, device=dev).float() / DH))
        ang = pos[..., None].float() * inv
        ang = torch.cat((ang, ang), -1)  # Liger's per-axis [3, B, S, Dh] tables
        cos_i, sin_i = mrope_cos_sin(pos, inv, MROPE_SECTION, dt)  # the model's interleaved [B, S, Dh] table
        return dict(q=rnd(B, S, HQ, DH), k=rnd(B, S, HK, DH), cos=ang.cos().to(dt), sin=ang.sin().to(dt),
                    cos_i=cos_i, sin_i=sin_i)

    # M-RoPE as each stack's model runs it per layer: titan_mm's Qwen3-VL interleaves the table once per step
    # (mrope_cos_sin) and applies the RoPE kernel to it; Liger's Qwen2-VL path takes the per-axis tables
    # (Liger 0.8.5 has Qwen2-VL's *sectioned*, not interleaved, M-RoPE: a peer for speed, not numerics)
    L = _liger("mrope_model")
    cases["mrope_model"] = dict(
        shape=f"q [{B}, {S}, {HQ}, {DH}], k [.., {HK}, ..], section {MROPE_SECTION}; titan_mm: the interleaved "
              f"[{B}, {S}, {DH}] table built once per step (models' path), Liger: per-axis [3, {B}, {S}, {DH}]",
        inputs=mrope_model_inputs,
        fwd_bytes=2 * qk_bytes + N * DH * e, bwd_bytes=2 * qk_bytes + N * DH * e,
        impls={
            "eager": lambda q, k, cos, sin, cos_i, sin_i: rope.apply_rope(q, k, cos_i, sin_i),
            "compile": ("compile", lambda q, k, cos, sin, cos_i, sin_i: rope.apply_rope(q, k, cos_i, sin_i)),
            "liger": (
                lambda q, k, cos, sin, cos_i, sin_i, L=L: L.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                                                  MROPE_SECTION)
            ) if L else None,
            "titan_mm": lambda q, k, cos, sin, cos_i, sin_i: K.apply_rope(q, k, cos_i, sin_i),
        },
    )
    cases["bias_gelu"] = dict(
        shape=f"x [{N}, {VIT_FFN}] bf16 (Qwen3-VL ViT MLP)",
        inputs=lambda: dict(x=rnd(N, VIT_FFN), b=rnd(VIT_FFN)),
        fwd_bytes=2 * N * VIT_FFN * e, bwd_bytes=3 * N * VIT_FFN * e,
        impls={
            "eager": lambda x, b: mlp.bias_gelu(x, b),
            "compile": ("compile", lambda x, b: mlp.bias_gelu(x, b)),
            "liger": None,  # Liger has no bias-GELU
            "titan_mm": lambda x, b: K.bias_gelu(x, b),
        },
    )

    def ce_inputs():
        labels = torch.randint(0, VOCAB, (N,), device=dev)
        labels[torch.rand(N, device=dev) < 0.1] = -100
        return dict(h=rnd(N, D), w=rnd(VOCAB, D, scale=D**-0.5), labels=labels)

    def ce_eager(h, w, labels):
        return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100, reduction="sum")

    L = _liger("linear_cross_entropy")
    cases["linear_cross_entropy"] = dict(
        shape=f"h [{N}, {D}], W [{VOCAB}, {D}] bf16",
        inputs=ce_inputs,
        fwd_flops=2 * N * VOCAB * D, bwd_flops=4 * N * VOCAB * D,
        # fwd rows run under no_grad with detached inputs: no implementation computes gradients there
        impls={
            "eager": ce_eager,
            "compile": ("compile", ce_eager),
            "liger": (lambda h, w, labels, L=L: L.apply(h, w, labels, None, None, -100, 0.0, 0.0, "sum")[0]) if L else None,
            "titan_mm": lambda h, w, labels: K.linear_cross_entropy(h, w, labels),
        },
    )
    cases["linear_cross_entropy_acc32"] = dict(
        shape=f"as above, grad_accum_fp32=True (fp32 dW accumulator)",
        inputs=ce_inputs,
        fwd_flops=2 * N * VOCAB * D, bwd_flops=4 * N * VOCAB * D,
        impls={"titan_mm": lambda h, w, labels: K.linear_cross_entropy(h, w, labels, grad_accum_fp32=True)},
    )
    return {k: v for k, v in cases.items() if not only or k in only}


# ---------------------------------------------------------------------------------------------- running


def _outputs(o):
    import torch

    return [t for t in (o if isinstance(o, (tuple, list)) else (o,)) if isinstance(t, torch.Tensor) and t.requires_grad]


def _reset_tuner_marks():
    try:
        from titan_mm.kernels._utils import Tuner
    except Exception:
        return
    for t in Tuner.registry:
        t.last = None


def _tuner_marks() -> dict:
    """{kernel: "key -> config"} for the tuned titan_mm kernels the last timed function launched."""
    from titan_mm.kernels._utils import Tuner

    out = {}
    for t in Tuner.registry:
        if t.last is not None:
            key, cfg = t.last
            out[t.name] = dict(key=str(key), **cfg)
    return out


def run_case(name, case, impl, fn, do_compile):
    import torch

    rows = []
    if isinstance(fn, tuple):
        if not do_compile:
            return rows
        fn = torch.compile(fn[1], fullgraph=True, dynamic=False)
    inp = case["inputs"]()
    diff = [v for v in inp.values() if v.requires_grad]

    inp_nograd = {k: v.detach() for k, v in inp.items()}  # fwd rows: no input requires grad (Liger's CE
    # otherwise computes its gradients in the forward even under no_grad)

    def fwd():
        with torch.no_grad():
            return fn(**inp_nograd)

    fixed = {}

    def fwd_bwd():
        outs = _outputs(fn(**inp))
        if "g" not in fixed:
            fixed["g"] = [torch.randn_like(o) for o in outs]
        torch.autograd.grad(outs, diff, fixed["g"], allow_unused=True)

    if impl == "titan_mm":
        # launch configs are picked before the timing, as the trainer does before its first step (the forward
        # never tunes: timing synchronizes); meta.tuning holds the candidates' times
        from titan_mm.kernels import tuning

        with tuning():
            fwd_bwd()
            fwd()
    for mode, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        t_c = time.perf_counter()
        _reset_tuner_marks()
        ms, ms_loop, iters = time_ms(f)
        mem = peak_mb(f)
        row = dict(kernel=name, shape=case["shape"], impl=impl, mode=mode, ms=round(ms, 4),
                   ms_loop=round(ms_loop, 4), iters=iters, peak_mb=round(mem, 1),
                   wall_s=round(time.perf_counter() - t_c, 2))
        if impl == "titan_mm":
            cfg = _tuner_marks()
            if cfg:
                row["config"] = cfg
        bwd = mode == "fwd+bwd"
        if "fwd_bytes" in case:
            row["bytes"] = case["fwd_bytes"] + (case["bwd_bytes"] if bwd else 0)
        else:
            row["flops"] = case["fwd_flops"] + (case["bwd_flops"] if bwd else 0)
        set_rates(row)
        rows.append(row)
    if PROFILE_DIR and impl != "eager":  # where the fwd+bwd time goes, kernel by kernel
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fwd_bwd()
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        os.makedirs(PROFILE_DIR, exist_ok=True)
        with open(os.path.join(PROFILE_DIR, f"kprof_{name}_{impl}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=90))
    del inp, inp_nograd, diff
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/kernels.json")
    p.add_argument("--only", default="", help="comma-separated kernel names")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile(reference) rows")
    p.add_argument("--budget-s", type=float, default=110.0,
                   help="start no new torch.compile rows after this many seconds (keeps the run under 3 minutes)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed (TRITON_INTERPRET=1): tests the script")
    p.add_argument("--profile", default="", help="folder: a torch.profiler table of 3 fwd+bwd calls per (kernel, "
                   "implementation), kernels sorted by their own time")
    p.add_argument("--render", default="", help="render the markdown table from this JSON and exit")
    p.add_argument("--doc", default="", help="with --render: replace the table between the markers in this file")
    a = p.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            md = render_markdown(json.load(f))
        if a.doc:
            update_doc(a.doc, md)
        print(md)
        return

    import torch
    import triton

    global PROFILE_DIR
    PROFILE_DIR = a.profile
    if a.smoke:
        set_smoke_shapes()
    else:
        assert torch.cuda.is_available(), "bench/kernel_ops.py needs a CUDA GPU (or --smoke)"
    t0 = time.perf_counter()
    only = [s for s in a.only.split(",") if s]
    try:
        import importlib.metadata as md_

        liger_v = md_.version("liger-kernel")
    except Exception:
        liger_v = None
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)", torch=torch.__version__, triton=triton.__version__, liger=liger_v,
        copy_ceiling_tb_s=COPY_CEILING_TBS, matmul_ceiling_tflops=MATMUL_CEILING_TFLOPS,
    )
    rows, errors = [], []
    cases = build_cases(only)
    order = {k: i for i, k in enumerate(cases)}
    imp = {k: i for i, k in enumerate(["eager", "compile", "liger", "titan_mm"])}

    def write(final=False):
        """The JSON is rewritten after every case, so a run cut short still leaves its rows."""
        rows.sort(key=lambda r: (order[r["kernel"]], r["mode"], imp[r["impl"]]))
        meta["wall_s"] = round(time.perf_counter() - t0, 1)
        meta["complete"] = final
        meta["tuning"] = _tuning_summary()
        data = dict(meta=meta, results=rows, errors=errors)
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
        return data

    # pass 1: eager, Liger, titan_mm (titan_mm tunes its launch configs before timing each kernel);
    # pass 2: torch.compile rows while the time budget lasts (inductor compiles dominate the wall time)
    for pass_compile in (False, True):
        for name, case in cases.items():
            for impl, fn in case["impls"].items():
                if fn is None or (impl == "compile") != pass_compile:
                    continue
                if pass_compile and (a.no_compile or time.perf_counter() - t0 > a.budget_s):
                    if not a.no_compile:
                        errors.append(f"{name}/compile: skipped, time budget of {a.budget_s:.0f} s spent")
                    continue
                try:
                    new = run_case(name, case, impl, fn, True)
                except Exception as e:
                    msg = f"{name}/{impl}: {type(e).__name__}: {e}"
                    print("[error]", msg, file=sys.stderr)
                    traceback.print_exc()
                    errors.append(msg[:1000])
                    torch.cuda.empty_cache() if torch.cuda.is_available() else None
                    continue
                for r in new:
                    print(_fmt_row(r), flush=True)
                rows += new
            if not pass_compile and all(case["impls"].get(i) for i in ABBA) and not a.smoke:
                retime_reversed(name, case, rows, errors)
            write()
    data = write(final=True)
    print()
    print(render_markdown(data))
    print(f"\nwrote {a.out} in {meta['wall_s']} s")


def set_rates(row) -> None:
    """Achieved rate of a row from its ``ms``: TB/s and fraction of the copy ceiling for a row with ``bytes``,
    TFLOP/s and fraction of the matmul ceiling for one with ``flops``."""
    if "bytes" in row:
        tbs = row["bytes"] / (row["ms"] * 1e-3) / 1e12
        row.update(tb_s=round(tbs, 3), frac_copy=round(tbs / COPY_CEILING_TBS, 3))
    if "flops" in row:
        tf = row["flops"] / (row["ms"] * 1e-3) / 1e12
        row.update(tflops=round(tf, 1), frac_matmul=round(tf / MATMUL_CEILING_TFLOPS, 3))


ABBA = ("liger", "titan_mm")  # the pair whose ratio is a target: timed A B B A (retime_reversed)


def retime_reversed(name, case, rows, errors) -> None:
    """Time the ABBA implementations again in reverse order and make each row's ``ms`` the mean of its two
    timings (``ms_runs`` keeps both). The A B B A order cancels a linear drift over the run (the clock under
    ~100 ms of full-power GEMMs per CE call) that favoured whichever ran first, and the mean of two medians
    halves the spread of the 1-us differences between the memory-bound kernels."""
    for impl in reversed(ABBA):
        fn = case["impls"].get(impl)
        old = {r["mode"]: r for r in rows if r["kernel"] == name and r["impl"] == impl}
        if fn is None or not old:
            continue
        try:
            again = run_case(name, case, impl, fn, True)
        except Exception as e:
            errors.append(f"{name}/{impl} (reverse-order timing): {type(e).__name__}: {e}"[:1000])
            continue
        for r2 in again:
            r = old.get(r2["mode"])
            if r is None:
                continue
            r["ms_runs"] = [r["ms"], r2["ms"]]
            r["ms"] = round((r["ms"] + r2["ms"]) / 2, 4)
            set_rates(r)  # the rates follow the mean time
            print(_fmt_row(r) + f"  (runs {r['ms_runs']})", flush=True)


def _tuning_summary() -> dict:
    """Every titan_mm launch config picked so far, with the candidates' tuning times (ms)."""
    try:
        from titan_mm.kernels._utils import tuned_configs
    except Exception:
        return {}
    return tuned_configs()


def _fmt_row(r):
    perf = f"{r['tb_s']:.2f} TB/s ({100 * r['frac_copy']:.0f}%)" if "tb_s" in r else f"{r['tflops']:.0f} TFLOP/s"
    return (f"{r['kernel']:<22}{r['impl']:<10}{r['mode']:<9}{r['ms']:>9.3f} ms (loop {r.get('ms_loop', float('nan')):.3f})"
            f" {r['peak_mb']:>10.1f} MB  {perf}" + (f"  {r['config']}" if r.get("config") else ""))


# ---------------------------------------------------------------------------------------------- rendering


def render_markdown(data: dict) -> str:
    """One row per kernel and mode: time, bandwidth (or TFLOP/s) and peak memory of each implementation,
    plus titan_mm's speedup over Liger (and over eager where Liger has no kernel)."""
    impls = ["eager", "compile", "liger", "titan_mm"]
    res = data["results"]
    by = {(r["kernel"], r["mode"], r["impl"]): r for r in res}
    kernels = list(dict.fromkeys(r["kernel"] for r in res))
    m = data.get("meta", {})
    out = [
        f"Measured {m.get('date', '?')} on {m.get('device', '?')} (torch {m.get('torch', '?')}, triton "
        f"{m.get('triton', '?')}, liger {m.get('liger', '?')}). Time: median ms (CUDA events, GPU queue kept "
        f"ahead of the host: device time); memory-bound "
        f"kernels show achieved TB/s and % of the {m.get('copy_ceiling_tb_s', COPY_CEILING_TBS)} TB/s copy "
        "ceiling; the CE shows TFLOP/s of its GEMMs. Peak: MB allocated above the inputs.",
        "",
        "| kernel | mode | " + " | ".join(impls) + " | titan_mm vs liger | peak MB (" + " / ".join(impls) + ") |",
        "|---|---|" + "---|" * len(impls) + "---|---|",
    ]
    for k in kernels:
        for mode in ("fwd", "fwd+bwd"):
            cells, peaks = [], []
            for i in impls:
                r = by.get((k, mode, i))
                if r is None:
                    cells.append("–")
                    peaks.append("–")
                    continue
                perf = f"{r['tb_s']:.2f} TB/s, {100 * r['frac_copy']:.0f}%" if "tb_s" in r else f"{r['tflops']:.0f} TFLOP/s"
                cells.append(f"{r['ms']:.3f} ({perf})")
                peaks.append(f"{r['peak_mb']:.0f}")
            ours, lig, eag = by.get((k, mode, "titan_mm")), by.get((k, mode, "liger")), by.get((k, mode, "eager"))
            if ours and lig:
                vs = f"{lig['ms'] / ours['ms']:.2f}x"
            elif ours and eag:
                vs = f"n/a ({eag['ms'] / ours['ms']:.2f}x vs eager)"
            else:
                vs = "–"
            shape = next((r["shape"] for r in res if r["kernel"] == k), "")
            out.append(f"| {k} <br>{shape} | {mode} | " + " | ".join(cells) + f" | {vs} | " + " / ".join(peaks) + " |")
    if any("ms_loop" in r for r in res):
        out += ["", "Back-to-back call loop (`ms_loop`: no GPU sleep, so host overhead shows where a call's host "
                "side is slower than its kernels), ms:", "",
                "| kernel | mode | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
        for k in kernels:
            for mode in ("fwd", "fwd+bwd"):
                cells = [f"{by[(k, mode, i)]['ms_loop']:.3f}" if "ms_loop" in by.get((k, mode, i), {}) else "–"
                         for i in impls]
                out.append(f"| {k} | {mode} | " + " | ".join(cells) + " |")
    cfgs = [(r["kernel"], r["mode"], r["config"]) for r in res if r.get("config")]
    if cfgs:
        out += ["", "titan_mm launch configs (picked by timing the candidates before the timed runs): " + "; ".join(
            f"{k} {mode}: " + ", ".join(f"{n} [{', '.join(f'{a}={b}' for a, b in c.items() if a != 'key')}]"
                                        for n, c in cfg.items()) for k, mode, cfg in cfgs)]
    if data.get("errors"):
        out += ["", "Errors: " + "; ".join(data["errors"])]
    return "\n".join(out)


def update_doc(path: str, md: str) -> None:
    with open(path) as f:
        text = f.read()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise SystemExit(f"{path} has no {DOC_BEGIN} ... {DOC_END} markers")
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    with open(path, "w") as f:
        f.write(head + DOC_BEGIN + "\n" + md + "\n" + DOC_END + tail)


if __name__ == "__main__":
    main()
