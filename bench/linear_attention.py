"""The Gated DeltaNet rule on one GPU against its memory-bandwidth floor: fla-core's chunked kernel (what Qwen3.5's
linear-attention layers run on CUDA, titan_mm/nn/linear_attention.py), forward and forward + backward, at a
model's shapes over packed documents (bf16 q / k / v / beta, fp32 log decays, as the model passes them).

Floors (bytes / 4.23 TB/s, the H200's measured device-to-device copy rate, docs GPU.md):
  io       the tensors the op must read and write: forward q, k, v, g, beta in and o out; forward + backward adds
           reading them again with d(o) and writing d(q), d(k), d(v), d(g), d(beta)
  states   io + the chunk-start states the chunked algorithm materializes ([chunks, Hv, Dk, Dv] bf16: written in the
           forward, written again by the backward's recomputation and read back), which fla stores by design
The rule's FLOPs are titan_mm's count (titan_mm/models/qwen3_5/flops.py, x3 for forward + backward); the kernel's
ratio to the io floor is what the memory system leaves on the table.

  PYTHONPATH=$PWD:/tmp/site python3 bench/linear_attention.py --cases qwen3_5_9b_8l,qwen3_5_35b_a3b_4l \\
      --out bench/results/linear_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.attention import bench as cuda_ms  # noqa: E402  (median CUDA-event ms of fn())
from bench.mfu import CASES, model_config  # noqa: E402

from titan_mm.nn.linear_attention import CHUNK, build_linear_meta, gated_delta_rule  # noqa: E402
from titan_mm.models.qwen3_5.flops import gdn_flops_per_token  # noqa: E402

COPY_TBS = 4.23


def run_case(name: str, tokens: int, doc_len: int) -> dict:
    _, mc = model_config(CASES[name])
    t = mc.text
    Hk, Hv, dk, dv = t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
    dev = torch.device("cuda")
    n = tokens // doc_len
    cu = torch.tensor([i * doc_len for i in range(n)] + [tokens])
    meta = build_linear_meta({"input_ids": torch.zeros(1, tokens, dtype=torch.long), "cu_seqlens": cu}, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(1, tokens, Hk, dk, generator=g, device=dev, dtype=bf).requires_grad_()
    k = torch.randn(1, tokens, Hk, dk, generator=g, device=dev, dtype=bf).requires_grad_()
    v = torch.randn(1, tokens, Hv, dv, generator=g, device=dev, dtype=bf).requires_grad_()
    lg = (-torch.rand(1, tokens, Hv, generator=g, device=dev)).requires_grad_()
    beta = torch.rand(1, tokens, Hv, generator=g, device=dev, dtype=bf).requires_grad_()
    do = torch.randn(1, tokens, Hv, dv, generator=g, device=dev, dtype=bf)

    def fwd():
        with torch.no_grad():
            gated_delta_rule(q, k, v, lg, beta, meta, "fla")

    def fwd_bwd():
        o = gated_delta_rule(q, k, v, lg, beta, meta, "fla")
        torch.autograd.backward(o, do)

    io_fwd = tokens * (2 * (2 * Hk * dk + 2 * Hv * dv + Hv) + 4 * Hv)  # q k v beta (bf16), g (fp32); o (bf16)
    o_bytes = tokens * 2 * Hv * dv
    io_bwd = 2 * (io_fwd - o_bytes) + o_bytes  # the inputs read again, d(o) read, the inputs' gradients written
    chunks = int(meta.chunk_indices.shape[0])
    states = chunks * Hv * dk * dv * 2
    rows = {}
    for mode, fn, io, st in (("fwd", fwd, io_fwd, states), ("fwd+bwd", fwd_bwd, io_fwd + io_bwd, 3 * states)):
        ms = cuda_ms(fn, iters=20, warmup=5)
        fl = (1 if mode == "fwd" else 3) * tokens * (gdn_flops_per_token(t) - 2 * t.linear_conv_kernel_dim
                                                     * (2 * Hk * dk + Hv * dv))
        rows[mode] = dict(ms=ms, io_floor_ms=io / COPY_TBS / 1e9, states_floor_ms=(io + st) / COPY_TBS / 1e9,
                          vs_io_floor=ms / (io / COPY_TBS / 1e9), vs_states_floor=ms / ((io + st) / COPY_TBS / 1e9),
                          tflops=fl / ms / 1e9, gbps=io / ms / 1e6)
    return dict(case=name, tokens=tokens, doc_len=doc_len, heads=(Hk, Hv), dims=(dk, dv), chunk=CHUNK, **rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="qwen3_5_9b_8l,qwen3_5_35b_a3b_4l")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--doc-len", type=int, default=1000, help="packed documents of this length (the last shorter)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/linear_attention.json"))
    a = ap.parse_args()
    rows = [run_case(c, a.tokens, a.doc_len) for c in a.cases.split(",")]
    print("| case | mode | ms | io floor ms | x io floor | states floor ms | x states floor | TFLOP/s | GB/s (io) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for mode in ("fwd", "fwd+bwd"):
            m = r[mode]
            print(f"| {r['case']} | {mode} | {m['ms']:.3f} | {m['io_floor_ms']:.3f} | {m['vs_io_floor']:.1f}x | "
                  f"{m['states_floor_ms']:.3f} | {m['vs_states_floor']:.1f}x | {m['tflops']:.0f} | {m['gbps']:.0f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"copy_tbs": COPY_TBS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
