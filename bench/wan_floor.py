"""The step-time floor of a Wan training step on this GPU (bench/floor.py's method for the video DiT): every
GEMM, the bidirectional self-attention and the cross-attention, and fused AdamW, each timed alone with the
libraries every stack calls (cuBLAS, SDPA's cuDNN / flash / memory-efficient backends, fused AdamW).

Any stack that trains the model with these libraries does at least this work per step; the memory-bound work
between the GEMMs (the fp32 modulated LayerNorms, RMSNorm of q / k, RoPE, GELU, gated residuals) is left out and
the GPU is never idle, so the real ceiling is lower. Against a step time of bench/mfu.py (``--mfu-json``, rows of
the same call) the report gives the floor's MFU and the most any stack could beat that row by (``max_speedup``):
issue 48's 1.3x over diffusers is out of reach when diffusers' step time over the floor is below 1.3.

  gemm        per block: self-attention q / k / v (separate and fused, the faster counts) and o, cross-attention
              q and o over the video tokens, k / v over the text tokens, the FFN's two linears; the patch
              embedding and the output head once; forward, input- and weight-gradient GEMMs, bf16
  attention   per block: self-attention over the clip (no mask) forward + backward per SDPA backend (the fastest
              counts) and the cross-attention to the text states
  adamw       one fused AdamW step over fp32 parameters of the model's shapes

  PYTHONPATH=$PWD python3 bench/wan_floor.py --cases wan2.1_1.3b --mfu-json $OUT/mfu_wan.json --out $OUT/wan_floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.attention import bench as cuda_ms  # noqa: E402  (median CUDA-event ms of fn())
from bench.floor import PEAK_TFLOPS, adamw_time, gemm_list, time_ops  # noqa: E402
from bench.mfu import CASES, model_config  # noqa: E402

from titan_mm.models.wan.flops import TEXT_LEN  # noqa: E402


def linears(cfg, n: int) -> dict[str, list[tuple[int, list[tuple[int, int]]]]]:
    """Form -> [(rows, [(in, out)])] of the linears: per block q / k / v (separate or fused) and the rest (o, the
    cross-attention's q / o over the ``n`` video tokens and k / v over the text tokens, the FFN); ``edge`` the
    patch embedding and the output head once. The text and time embedders (per clip) are left out."""
    D, F_, L = cfg.dim, cfg.ffn_dim, TEXT_LEN
    p_in = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    return {"qkv": [(n, [(D, D)] * 3)], "qkv_fused": [(n, [(D, 3 * D)])],
            "rest": [(n, [(D, D)] * 3 + [(D, F_), (F_, D)]), (L, [(D, D)] * 2)],
            "edge": [(n, [(p_in, D), (D, cfg.patch_dim)])]}


def gemm_floor(cfg, n: int) -> dict:
    """ms per step of every GEMM: per block the faster of separate / fused q, k, v, x blocks, + embed and head."""
    ms = {}
    for name, groups in linears(cfg, n).items():
        ms[name] = 0.0
        for rows, pairs in groups:
            ops, _ = gemm_list(rows, pairs, False)
            ms[name] += time_ops(ops)
            del ops
    torch.cuda.empty_cache()
    block = min(ms["qkv"], ms["qkv_fused"]) + ms["rest"]
    return dict(ms=block * cfg.num_layers + ms["edge"], block_ms=block, per_form_ms=ms, embed_head_ms=ms["edge"])


def attention_floor(cfg, batch: int, seq: int) -> dict:
    """Self-attention over the clip (fastest SDPA backend) and cross-attention to TEXT_LEN states, fwd + bwd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, K = cfg.num_attention_heads, cfg.attention_head_dim
    mk = lambda s: torch.randn(batch, H, s, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v, tk, tv = mk(seq), mk(seq), mk(seq), mk(TEXT_LEN), mk(TEXT_LEN)
    do = torch.randn_like(q)
    out = {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for what, (kk, vv) in (("self", (k, v)), ("cross", (tk, tv))):
            def run(be=be, kk=kk, vv=vv):
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(q, kk, vv).backward(do)
            try:
                out[f"{what}_{name}"] = cuda_ms(run, iters=10)
            except RuntimeError as e:  # a backend this build lacks for the shape
                out[f"{what}_{name}"] = None
                print(f"[wan_floor] {what} attention {name}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    best = {w: min(v for k_, v in out.items() if k_.startswith(w) and v is not None) for w in ("self", "cross")}
    flops = 3.5 * 4 * batch * H * K * seq * seq  # full S x S scores: fwd 2 GEMMs, bwd 5 (docs/flops.md's 3.5x)
    return dict(ms=(best["self"] + best["cross"]) * cfg.num_layers, self_ms=best["self"], cross_ms=best["cross"],
                per_backend_ms=out, self_tflops=flops / best["self"] / 1e9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="wan2.1_1.3b")
    ap.add_argument("--mfu-json", default=str(ROOT / "bench/results/mfu_wan.json"),
                    help="bench/mfu.py rows of the same call: the step times set against the floor")
    ap.add_argument("--out", default=str(ROOT / "bench/results/wan_floor.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/wan_floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    mfu_rows = json.loads(Path(args.mfu_json).read_text())["rows"] if Path(args.mfu_json).exists() else []
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        spec, mc = model_config(case)
        with torch.device("meta"):
            shapes = [tuple(p.shape) for p in spec.build(mc).parameters()]
        t0 = time.time()
        n = case["batch"] * case["seq"]
        gemm, attn = gemm_floor(mc, n), attention_floor(mc, case["batch"], case["seq"])
        torch.cuda.empty_cache()  # the attention's operands, freed on its return
        adam = adamw_time(shapes)
        floor_ms = gemm["ms"] + attn["ms"] + adam["ms"]
        row = dict(case=name, tokens=n, gemm=gemm, attention=attn, adamw=adam, floor_ms=floor_ms,
                   gpu=torch.cuda.get_device_name(), torch=torch.__version__, seconds=round(time.time() - t0, 1))
        for r in mfu_rows:  # each stack's step against the floor: the floor's MFU and the most it could gain
            if r.get("case") == name and r.get("step_time_s"):
                row.setdefault("stacks", {})[r["stack"]] = dict(
                    step_ms=r["step_time_s"] * 1e3, mfu=r.get("mfu"), max_speedup=r["step_time_s"] * 1e3 / floor_ms,
                    floor_mfu=r["mfu"] * r["step_time_s"] * 1e3 / floor_ms if r.get("mfu") else None)
        rows.append(row)
        print(f"{name} ({row['gpu']}): gemm {gemm['ms']:.1f} ms, attention {attn['ms']:.1f} ms (self "
              f"{attn['self_ms']:.2f} ms a block, {attn['self_tflops']:.0f} TFLOP/s; {attn['per_backend_ms']}), adamw "
              f"{adam['ms']:.1f} ms -> floor {floor_ms:.1f} ms", flush=True)
        for stack, s in row.get("stacks", {}).items():
            print(f"  {stack}: step {s['step_ms']:.1f} ms, MFU {s['mfu']:.3f}; the floor is {s['max_speedup']:.2f}x "
                  f"faster (floor MFU {s['floor_mfu']:.3f} of {PEAK_TFLOPS:.0f})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
