"""Attention backends on one GPU at a training shape: which one should titan_mm pick?

Times forward+backward (CUDA events, median) of causal GQA attention for SDPA's flash, cuDNN and
memory-efficient backends (with ``enable_gqa`` and with k/v heads repeated), flex_attention (compiled,
causal BlockMask), torch's varlen attention (flash varlen with cu_seqlens) and cuDNN's ragged attention over the
same flattened tokens (``aten._cudnn_attention_forward`` with cumulative lengths: what SDPA runs for a nested
tensor). ``--bidirectional``: each of the B rows attends to itself without the causal mask, a ViT's images.

    PYTHONPATH=$PWD python3 bench/attention.py [--b 4 --s 4096 --h 16 --g 8 --k 128] [--out bench/results/attention.json]
    PYTHONPATH=$PWD python3 bench/attention.py --b 8 --s 1024 --h 16 --g 16 --k 72 --bidirectional \
        --out bench/results/attention_vit72.json    # a ViT's: 8 images of 1,024 patches, head dim 72
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

from titan_mm.nn.attention import varlen_attention  # noqa: E402


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
    ap.add_argument("--bidirectional", action="store_true", help="no causal mask (each row one image of a ViT)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/attention.json"))
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, S, H, G, K = a.b, a.s, a.h, a.g, a.k
    causal = not a.bidirectional
    dev = "cuda"
    q = torch.randn(B, H, S, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, G, S, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, G, S, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, S, K, device=dev, dtype=torch.bfloat16)
    flops_fwd = 4 * B * H * K * S * S / (2 if causal else 1)
    rows = []

    def run(name, f, leaves=(q, k, v), grad=do):
        def fb():
            f().backward(grad)
            for t in leaves:
                t.grad = None

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
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        def rep(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                                      is_causal=causal)

        run(name + "_gqa", gqa)
        run(name + "_repeat_kv", rep)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki if causal else qi >= 0, None, None, S, S, device=dev)
    fa = torch.compile(flex_attention)
    run("flex_compiled", lambda: fa(q, k, v, block_mask=bm, enable_gqa=True))

    # the same tokens flattened: [B * S, heads, K] with each row a document of cu
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=dev)
    qf, kf, vf = (t.detach().transpose(1, 2).reshape(B * S, -1, K).contiguous().requires_grad_() for t in (q, k, v))
    flat = dict(leaves=(qf, kf, vf), grad=do.transpose(1, 2).reshape(B * S, H, K).contiguous())
    run("varlen", lambda: varlen_attention(qf, kf, vf, cu, S, causal=causal), **flat)
    if G == H:  # cuDNN's ragged path takes as many k/v heads as q heads
        run("cudnn_ragged", lambda: torch.ops.aten._cudnn_attention_forward(
            qf, kf, vf, None, cu, cu, S, S, True, 0.0, causal, False)[0], **flat)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(shape=dict(B=B, S=S, H=H, G=G, K=K, causal=causal), gpu=torch.cuda.get_device_name(),
                                   torch=torch.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
