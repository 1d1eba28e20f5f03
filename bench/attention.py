"""Attention backends on one GPU at a training shape: which one should titan_mm pick?

Times forward+backward (CUDA events, median) of causal GQA attention for SDPA's flash, cuDNN and
memory-efficient backends (with ``enable_gqa`` and with k/v heads repeated), flex_attention (compiled,
causal BlockMask) and torch's varlen attention (flash varlen with cu_seqlens).

    PYTHONPATH=$PWD python3 bench/attention.py [--b 4 --s 4096 --h 16 --g 8 --k 128] [--out bench/results/attention.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bench(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event time of fn() in ms (also bench/floor.py's timer)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--g", type=int, default=8)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench/results/attention.json"))
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, S, H, G, K = a.b, a.s, a.h, a.g, a.k
    dev = "cuda"
    q = torch.randn(B, H, S, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, G, S, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, G, S, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, S, K, device=dev, dtype=torch.bfloat16)
    flops_fwd = 4 * B * H * K * S * S / 2  # causal
    rows = []

    def run(name, f):
        def fb():
            out = f()
            out.backward(do)
            q.grad = k.grad = v.grad = None

        try:
            ms_f = bench(lambda: f())
            ms_fb = bench(fb)
            rows.append(dict(backend=name, fwd_ms=ms_f, fwd_bwd_ms=ms_fb, fwd_tflops=flops_fwd / ms_f / 1e9,
                             fwd_bwd_tflops=3.5 * flops_fwd / ms_fb / 1e9))
        except Exception as e:  # a backend that refuses these inputs
            rows.append(dict(backend=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
        r = rows[-1]
        print(f"{name:28s} " + (f"fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TF/s)  fwd+bwd {r['fwd_bwd_ms']:.3f} ms "
                                f"({r['fwd_bwd_tflops']:.0f} TF/s)" if "error" not in r else r["error"]), flush=True)

    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def gqa(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def rep(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                                      is_causal=True)

        run(name + "_gqa", gqa)
        run(name + "_repeat_kv", rep)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=dev)
    fa = torch.compile(flex_attention)
    run("flex_compiled", lambda: fa(q, k, v, block_mask=bm, enable_gqa=True))

    try:
        from titan_mm.nn.attention import varlen_attention

        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=dev)
        qf = q.detach().transpose(1, 2).reshape(B * S, H, K).contiguous().requires_grad_()
        kf = k.detach().transpose(1, 2).reshape(B * S, G, K).contiguous().requires_grad_()
        vf_ = v.detach().transpose(1, 2).reshape(B * S, G, K).contiguous().requires_grad_()
        do_f = do.transpose(1, 2).reshape(B * S, H, K).contiguous()

        def var():
            return varlen_attention(qf, kf, vf_, cu, S, causal=True)

        def varfb():
            var().backward(do_f)
            qf.grad = kf.grad = vf_.grad = None

        ms_f, ms_fb = bench(var), bench(varfb)
        rows.append(dict(backend="varlen", fwd_ms=ms_f, fwd_bwd_ms=ms_fb, fwd_tflops=flops_fwd / ms_f / 1e9,
                         fwd_bwd_tflops=3.5 * flops_fwd / ms_fb / 1e9))
        print(f"{'varlen':28s} fwd {ms_f:.3f} ms  fwd+bwd {ms_fb:.3f} ms", flush=True)
    except Exception as e:
        rows.append(dict(backend="varlen", error=f"{type(e).__name__}: {str(e)[:200]}"))
        print("varlen", rows[-1]["error"])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(shape=dict(B=B, S=S, H=H, G=G, K=K), gpu=torch.cuda.get_device_name(),
                                   torch=torch.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
