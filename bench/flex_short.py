"""Flex attention on short rows with grouped heads (GQA): which form should titan_mm.nn.attention._flex take below
the 128-token block, where inductor's default blocks find no kernel config (torch 2.11)?

Times the compiled forward and forward + backward (mean of 20 after 3 warm-ups, wall clock around synchronize) of
16 rows of 96 tokens, 16 query / 8 kv heads, head dim 128, bf16, causal over the row: k / v repeated to the query
heads (inside and outside the compiled graph), grouped heads with 64-token blocks, grouped heads with the default
blocks (refused at 96), and 128-token rows with the default blocks.

    PYTHONPATH=$PWD python3 bench/flex_short.py [--out bench/results/flex_short.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, G, D, LIVE = 16, 16, 8, 128, 96
BLOCKS_64 = {"BLOCK_M": 64, "BLOCK_N": 64}


def timed(fn, q, k, v, mask, opts, n: int = 20) -> dict:
    """Mean ms of the forward and of forward + backward."""
    for _ in range(3):
        fn(q, k, v, mask, opts).sum().backward()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(q, k, v, mask, opts)
    torch.cuda.synchronize()
    fwd = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn(q, k, v, mask, opts).sum().backward()
    torch.cuda.synchronize()
    return {"fwd_ms": round(fwd * 1e3, 3), "fwd_bwd_ms": round((time.perf_counter() - t0) / n * 1e3, 3)}


@torch.compile(dynamic=False)
def repeated(q, k, v, mask, opts):
    k, v = (t.repeat_interleave(H // G, dim=1) for t in (k, v))
    return flex_attention(q, k, v, block_mask=mask, kernel_options=opts)


@torch.compile(dynamic=False)
def grouped(q, k, v, mask, opts):
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)


_FLEX = torch.compile(flex_attention, dynamic=False)


def repeated_outside(q, k, v, mask, opts):
    k, v = (t.repeat_interleave(H // G, dim=1) for t in (k, v))
    return _FLEX(q, k, v, block_mask=mask, kernel_options=opts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "flex_short.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/flex_short.py: needs a CUDA GPU (inductor's flex kernels)", file=sys.stderr)
        return 2
    torch._dynamo.config.recompile_limit = 256
    cases = (("repeated k / v, in the graph", repeated, LIVE, None),
             ("repeated k / v, before the graph", repeated_outside, LIVE, None),
             ("grouped, 64-token blocks", grouped, LIVE, BLOCKS_64),
             ("grouped, default blocks", grouped, LIVE, None),
             ("grouped, default blocks, rows of 128", grouped, 128, None))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": {"rows": B, "live_tokens": LIVE, "heads": H, "kv_heads": G, "head_dim": D}, "cases": {}}
    for name, fn, S, opts in cases:
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, G, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (ki < LIVE), B, None, S, S, device="cuda")
        try:
            res["cases"][name] = timed(fn, q, k, v, mask, opts)
        except Exception as e:  # inductor refuses a config: the finding itself
            res["cases"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        print(name, res["cases"][name], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
