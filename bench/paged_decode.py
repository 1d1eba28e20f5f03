"""The paged decode kernel alone over bf16 and fp8 KV pools: where the fp8 cache's halved bytes go (issue 49).

Workload A at 8B ran 1.08x faster with the fp8 KV cache alone (docs/serving.md), where its bytes allow about 1.37x:
the kernel (titan_mm/kernels/paged_decode.py) reads half the bytes but, in bf16, converts each e4m3 value in two
steps and holds more registers, so it stops being held by HBM. This times one layer's decode attention at A's
shapes (256 sequences, Qwen3-8B's 32 query / 8 KV heads of 128, blocks of 16, contexts drawn from A's live
lengths) for each pool dtype and launch variant:

  stages   the key loop's software-pipelining stages (triton's num_stages; the kernel's ``STAGES`` default)
  warps    num_warps (the kernel's: 4)
  tile     keys a tile (auto: the kernel's ``keys_a_tile``: 64, and 128 over fp8 pools at one split, the bytes
           of a bf16 64)
  splits   spans a sequence is cut into (flash-decoding; the kernel's ``num_splits``: 1 at 256 sequences, so the
           longest contexts' programs finish last)
  f16      fp8 pools only: q and the loaded keys / values meet in fp16 (one exact e4m3 -> fp16 conversion) rather
           than bf16 (the kernel's default since this bench: ``dot_in_fp16``)

each inside a CUDA graph of ``--reps`` calls (GPU time a call). A row gives microseconds, the K/V bytes read over
that time (GB/s) and its fraction of this run's copy bandwidth (bench/ceilings.py: read + write of a 2 GiB copy; a
read-only stream beats it), the largest difference from the library's reference (fp32 attention over the same pool
values; bf16 output rounding is 2^-9 relative), and, per batch, each row's speedup over the best bf16 row. On the
CPU (``--cpu --tiny``: the smoke) the reference path runs once per pool dtype (the knobs are the Triton launch's).

The first run (H100, 2026-12-07, bench/results/paged_decode_h100.json) also timed ``swap``: the key tile as the
dots' left operand (scores [keys, heads], no 8-bit operand transposed in shared memory). It lost at every shape
(fp8 0.61-0.85x the untransposed tile at the same stages, bf16 0.97-1.0x) and was removed. The second (H100,
2026-12-07 08:00, bench/results/paged_decode_h100_sweep.json) timed the e4m3 -> fp16 cast as impure inline PTX,
which keeps it where the tile was loaded (the sm_90 SASS of a 64-key tile then reads fp16 operands by ldmatrix
where triton's cast, moved behind the shared-memory transpose, reads bytes: 64 LDS.U8): it lost at every tile
(349 against 281 us at 64 keys, 307 against 256 at 128) and was removed; 128-key fp8 tiles won (256 against 278
us: the kernel's default since).

    python3 bench/paged_decode.py --out bench/results/paged_decode_<device>.json      # ~1 minute on an H100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devices import device_slug  # noqa: E402
from bench.ceilings import measure as ceilings  # noqa: E402
from bench.timing import graph_us  # noqa: E402
from titan_mm.kernels import paged_decode_attention  # noqa: E402
from titan_mm.kernels.paged_decode import STAGES, keys_a_tile, num_splits, paged_decode  # noqa: E402
from titan_mm.nn.kv_cache import paged_decode_reference  # noqa: E402

POOLS = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
# (query heads, kv heads, head dim, block size, context lengths lo / hi): Qwen3-8B at workload A's live contexts
# (prompts and outputs each 100-1024 tokens)
SHAPE = dict(H=32, G=8, K=128, BS=16, lo=200, hi=2048)
TINY = dict(H=4, G=2, K=16, BS=4, lo=1, hi=24)


def batch(B: int, H: int, G: int, K: int, BS: int, lo: int, hi: int, device: torch.device, seed: int = 0):
    """q [B, H, K] bf16, the bf16 pools holding every sequence's blocks (shuffled), tables and lengths."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (B,), generator=g)
    MB = -(-hi // BS)
    NB = B * MB
    tables = torch.randperm(NB, generator=g).view(B, MB).to(torch.int32)
    torch.manual_seed(seed)  # the pools (a GB each at A's shape) are drawn on the device
    kp, vp = (torch.randn(NB, BS, G, K, device=device, dtype=torch.bfloat16) for _ in "kv")
    q = torch.randn(B, H, K, device=device, dtype=torch.bfloat16)
    return q, kp, vp, tables.to(device), lens.to(torch.int32).to(device)


def variants(pool: str, stages: tuple[int, ...], warps: tuple[int, ...], tiles: tuple[int | None, ...],
             splits: tuple[int | None, ...], cuda: bool) -> list[dict]:
    """The launches timed for ``pool``: each (stages, warps, tile, splits), the kernel's default dot dtype; for fp8
    also the kernel's earlier launches: bf16 dots at 3 stages (before this bench) and fp16 dots at 5 stages, both
    over 64-key tiles (before 128), 4 warps, its own splits."""
    if not cuda:
        return [{}]
    out = [dict(stages=s, warps=w, tile=t, splits=p) for s in stages for w in warps for t in tiles for p in splits]
    before = [dict(stages=3, warps=4, tile=64, splits=None, f16=False), dict(stages=5, warps=4, tile=64, splits=None)]
    return out + [b for b in before if b not in out] if pool == "fp8_e4m3" else out


@torch.no_grad()
def run(batches: tuple[int, ...], shape: dict, stages: tuple[int, ...], warps: tuple[int, ...],
        tiles: tuple[int | None, ...], splits: tuple[int | None, ...], device: torch.device, reps: int) -> dict:
    cuda = device.type == "cuda"
    copy = ceilings(device)["copy_tb_s"] * 1e3 if cuda else None  # GB/s, bench/ceilings.py's (not in a graph)
    rows = []
    for B in batches:
        q, kp, vp, tables, lens = batch(B, **shape, device=device)
        for pool, dt in POOLS.items():
            k, v = kp.to(dt), vp.to(dt)
            want = paged_decode_reference(q.float(), k.float(), v.float(), tables, lens)
            kv_bytes = int(lens.sum()) * shape["G"] * shape["K"] * 2 * k.element_size()
            for knobs in variants(pool, stages, warps, tiles, splits, cuda):
                if cuda:
                    call = (lambda kn=knobs: paged_decode(q, k, v, tables, lens, **kn))
                else:
                    call = (lambda: paged_decode_attention(q, k, v, tables, lens))
                row = dict(batch=B, pool=pool, **knobs)
                if cuda:
                    row.setdefault("f16", pool == "fp8_e4m3")
                    row["tile"] = row["tile"] or keys_a_tile(k, row["splits"] or num_splits(B, k.shape[2], device))
                try:
                    err = float((call().float() - want).abs().max())
                    us = graph_us(call, reps, cuda)
                except Exception as e:  # a launch this GPU refuses (shared memory) is its row's error
                    rows.append(dict(row, error=f"{type(e).__name__}: {e}"[:200]))
                    continue
                gbs = kv_bytes / us / 1e3
                rows.append(dict(row, us=round(us, 2), kv_bytes=kv_bytes, kv_gbs=round(gbs, 1), max_err=round(err, 5),
                                 frac_of_copy=round(gbs / copy, 3) if copy else None))
    for B in batches:
        base = min((r["us"] for r in rows if r["batch"] == B and r["pool"] == "bf16" and "us" in r), default=None)
        for r in rows:
            if r["batch"] == B and "us" in r and base:
                r["vs_best_bf16"] = round(base / r["us"], 3)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return dict(device=name, torch=torch.__version__, reps=reps, shape=shape, default_stages=STAGES,
                copy_gbs=round(copy, 1) if copy else None, rows=rows)


def ints(csv: str) -> tuple[int, ...]:
    return tuple(int(x) for x in csv.split(","))


def autos(csv: str) -> tuple[int | None, ...]:
    """Comma-separated ints, "auto" (the kernel's own choice) as None."""
    return tuple(None if x == "auto" else int(x) for x in csv.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (the reference path; with --tiny: the smoke)")
    ap.add_argument("--tiny", action="store_true", help="a small shape")
    ap.add_argument("--batches", default="256,32", help="sequences per decode step (32: split launches)")
    ap.add_argument("--stages", default="3,5", help="num_stages values to time")
    ap.add_argument("--warps", default="4", help="num_warps values to time")
    ap.add_argument("--tiles", default="auto", help="keys a tile (multiples of 16; auto: the kernel's choice) to time")
    ap.add_argument("--splits", default="auto", help="splits a sequence (auto: the kernel's num_splits) to time")
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/paged_decode_<device>.json)")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device here: run on the GPU machine, or give --cpu (with --tiny for the smoke)")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    res = run(ints(args.batches), TINY if args.tiny else SHAPE, ints(args.stages), ints(args.warps), autos(args.tiles),
              autos(args.splits), device, args.reps)
    out = Path(args.out) if args.out else ROOT / "bench/results" / f"paged_decode_{device_slug(res['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        what = " ".join(f"{k}={r[k]}" for k in ("stages", "warps", "tile", "splits", "f16") if k in r)
        print(f"B {r['batch']:>4} {r['pool']:<9} {what:<20} " + (r.get("error") or
              f"{r['us']:>9.1f} us {r['kv_gbs']:>8.1f} GB/s {r.get('frac_of_copy')} of copy "
              f"{r.get('vs_best_bf16')}x best bf16 err {r['max_err']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
