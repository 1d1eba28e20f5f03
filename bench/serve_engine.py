"""Offline engine throughput on one GPU: which KV block size should titan_mm default to (16 or 256)?

A randomly initialised Qwen3 flavor in bf16 serves N prompts (half of them open with one shared prefix) to
``--new`` greedy tokens each (EOS ignored), through ``Engine.generate``, once per block size. It reports wall time,
generated tokens / s, steps, preemptions and the prefix-cache hit rate.

    PYTHONPATH=$PWD python3 bench/serve_engine.py [--flavor 0.6B --n 64 --prompt 512 --prefix 256 --new 128]
        [--blocks 16,256] [--out bench/results/serve_engine.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="0.6B")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--blocks", default="16,256")
    ap.add_argument("--max_num_seqs", type=int, default=64)
    ap.add_argument("--max_num_batched_tokens", type=int, default=4096)
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself")
    ap.add_argument("--out", default=str(ROOT / "bench/results/serve_engine.json"))
    a = ap.parse_args()
    from bench.serve import random_model, run_titan, text_vocab
    from titan_mm.registry import get_model_spec
    from titan_mm.serve.config import ServeConfig
    from titan_mm.serve.engine import Engine

    spec = get_model_spec("qwen3")
    cfg = spec.flavor(a.flavor)
    g = torch.Generator().manual_seed(0)
    V = cfg.vocab_size
    prefix = torch.randint(0, V, (a.prefix,), generator=g).tolist()
    prompts = [(prefix if i % 2 == 0 else []) + torch.randint(0, V, (a.prompt - (a.prefix if i % 2 == 0 else 0),),
                                                             generator=g).tolist() for i in range(a.n)]
    rows = []
    for bs in [int(x) for x in a.blocks.split(",")]:
        model = random_model(spec, a.flavor, a.device, 0)  # built once, shared by the block sizes
        engine = Engine(model, spec, cfg, ServeConfig(block_size=bs, max_num_seqs=a.max_num_seqs,
                                                      max_num_batched_tokens=a.max_num_batched_tokens,
                                                      max_model_len=a.prompt + a.new + 16,
                                                      num_blocks=0 if a.device == "cuda" else 512), device=a.device)
        r = run_titan(engine, prompts, [a.new] * a.n, float("inf"), text_vocab())  # warm-up, then all at t0
        rows.append({"block_size": bs, "num_blocks": r["kv_blocks"], "seconds": r["seconds"],
                     "generated_tokens": r["output_tokens"], "tokens_per_s": r["tokens_per_s"], "steps": r["steps"],
                     "preemptions": r["preemptions"], "prefix_hit_rate": r["prefix_hit_rate"]})
        print(json.dumps(rows[-1]), flush=True)
        del engine
        if a.device == "cuda":
            torch.cuda.empty_cache()
    out = {"flavor": a.flavor, "n": a.n, "prompt": a.prompt, "prefix": a.prefix, "new": a.new,
           "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
