"""cuBLAS against inductor's max-autotune GEMMs for Qwen3-1.7B's linears (16384 tokens, bf16), one H200.

Would ``torch.compile(mode="max-autotune-no-cudagraphs")`` find faster GEMMs than cuBLAS for the shapes the
1.7B step runs (forward, input-gradient and weight-gradient GEMMs of the fused q/k/v, o, fused gate/up and
down projections)? Each form is timed as ``torch.mm`` and as a compiled ``a @ b`` that inductor autotunes over
its Triton templates and cuBLAS (bench/attention.py's timer: median of 20 CUDA-event timed runs after 3
warm-up runs). Weight-gradient forms take a
transposed view as their first operand, as autograd passes it.

    python3 bench/gemm_autotune.py --out bench/results/gemm_autotune.json    # ~4 minutes, GPU only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

M, D, F = 16384, 2048, 6144
# name -> (a shape, b shape) of a @ b
FORMS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "qkv_fwd": ((M, D), (D, 4096)),
    "qkv_dgrad": ((M, 4096), (4096, D)),
    "qkv_wgrad": ((4096, M), (M, D)),
    "o_fwd": ((M, D), (D, D)),
    "gate_up_fwd": ((M, D), (D, 2 * F)),
    "gate_up_dgrad": ((M, 2 * F), (2 * F, D)),
    "gate_up_wgrad": ((2 * F, M), (M, D)),
    "down_fwd": ((M, F), (F, D)),
    "down_dgrad": ((M, D), (D, F)),
    "down_wgrad": ((D, M), (M, F)),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=240, help="stop starting new forms after this long")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gemm_autotune.json"))
    args = ap.parse_args(argv)
    import torch

    from bench.attention import bench as cuda_ms  # median CUDA-event ms of fn(), as bench/floor.py

    if not torch.cuda.is_available():
        print("bench/gemm_autotune.py needs a CUDA GPU (it times cuBLAS against inductor's Triton GEMMs).",
              file=sys.stderr)
        return 2
    rows, t_end = {}, time.time() + args.seconds
    for name, (sa, sb) in FORMS.items():
        if time.time() > t_end:
            break
        a = torch.randn(sa, device="cuda", dtype=torch.bfloat16)
        if "wgrad" in name:
            a = torch.randn(sa[::-1], device="cuda", dtype=torch.bfloat16).t()
        b = torch.randn(sb, device="cuda", dtype=torch.bfloat16)
        t_cublas = cuda_ms(lambda: torch.mm(a, b))
        torch._dynamo.reset()
        t0 = time.time()
        f = torch.compile(lambda x, y: x @ y, mode="max-autotune-no-cudagraphs", dynamic=False)
        f(a, b)
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        t_auto = cuda_ms(lambda: f(a, b))
        flops = 2 * sa[0] * sa[1] * sb[1]
        rows[name] = dict(cublas_ms=t_cublas, autotune_ms=t_auto, speedup=t_cublas / t_auto, compile_s=compile_s,
                          cublas_tflops=flops / t_cublas / 1e9, autotune_tflops=flops / t_auto / 1e9)
        print(name, json.dumps(rows[name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "note": "cuBLAS (torch.mm) vs torch.compile max-autotune-no-cudagraphs, Qwen3-1.7B GEMM forms, 16384 tokens, "
                "bf16; speedup = cublas_ms / autotune_ms",
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
