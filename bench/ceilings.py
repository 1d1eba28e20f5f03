"""What this machine can do, measured in the same run as the bench that quotes it (bench/serve.py's rooflines,
bench/mfu.py's rows): device-to-device copy bandwidth (bytes read + written / time: the HBM ceiling a
memory-bound step is held to) and bf16 matmul TFLOP/s, with the device's name and memory. The GPU may be an H100
(80 GB, about 3.0 TB/s copy) or an H200 (141 GB, about 4.3 TB/s); a constant from one of them misstates the other.

    python3 bench/ceilings.py [--cpu]      # one JSON line: device, memory_gib, copy_tb_s, bf16_tflops, ...

On CPU the same fields come from small sizes (a check of the code, not a ceiling worth quoting).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

# (copy bytes, matmul n, timed repeats): the GPU sizes are far past any cache (50 MB L2) and a GEMM that runs at
# the tensor cores' sustained rate
SIZES = {"cuda": (2 << 30, 8192, 20), "cpu": (64 << 20, 512, 5)}


def _median_s(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up: first-call allocation, cuBLAS heuristics
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def measure(device: torch.device) -> dict:
    """The machine's ceilings on ``device``: {device, memory_gib, copy_tb_s, bf16_tflops, copy_bytes, matmul_n}."""
    nbytes, n, iters = SIZES["cuda" if device.type == "cuda" else "cpu"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), device, iters)
    del src, dst
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_s = _median_s(lambda: a @ b, device, iters)
    del a, b
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {"device": device_name(device), "memory_gib": round(memory / 2**30, 1) if memory else None,
            "copy_tb_s": round(2 * nbytes / copy_s / 1e12, 3), "bf16_tflops": round(2 * n**3 / mm_s / 1e12, 1),
            "copy_bytes": nbytes, "matmul_n": n, "torch": torch.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="measure the CPU (a check of this script)")
    a = ap.parse_args(argv)
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device; --cpu measures the CPU")
    print(json.dumps(measure(torch.device("cpu" if a.cpu else "cuda"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
