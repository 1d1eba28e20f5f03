"""How much does balancing packed rows across data-parallel ranks shorten a step? A replay of the cost model
(titan_mm.data.balance) over synthetic multimodal mixes, CPU only, about a minute.

Each mix is a stream of documents (token lengths, visual tokens included, and the vision patches of each image /
video temporal slice, Qwen3-VL geometry: 16 px patches, 2x2 merge, 2 frames per temporal patch), packed into rows
of ``--seq-len`` tokens by titan_mm.data.packing.BestFitPacker (as the loader does; a document longer than a row
is dropped, as the loader's ``too_long``). A global batch is ``ranks x n_micro x B`` consecutive rows (B =
``--micro-batch-size``), i.e. the loader's order, which is what placement "none" keeps. Mixes:

  skewed       the issue's stress mix: 40% text-only documents (log-normal, median 700 tokens), 25% rows of many
               small images (4-16 images of 224-448 px), 15% few huge images (1-2 of 1024-2048 px, up to 16k
               patches each), 20% short videos (8-32 frames at 336x336 / 448x448 / 640x352).
  llava_ov_si  LLaVA-OneVision-like single-image SFT: 90% one image of 336-1536 px with a short dialogue
               (median 200 tokens), 10% text-only (median 400).
  video_heavy  LLaVA-Video-like: 60% videos of 16-64 frames at 448x252-640x360, 20% one image of 448-1024 px,
               20% text-only (median 500).
  text_heavy   a mostly-text SFT: 80% text-only (median 900, long tail to the row length), 20% one image of
               256-768 px.

For each mix, rank count and micro-batches per rank it reports, averaged over the global batches the pool of rows
holds (at most ``--max-batches``): the imbalance max / mean rank cost of each placement (none / lpt / kk), the
predicted step-time speedup (sum over batches of the largest rank cost with "none" / with the method), and the
same speedup where ranks wait for each other at every micro-batch (FSDP's per-layer collectives: the step is the
sum over micro-batches of the slowest rank's). Then the placement's own CPU time for one global batch at the
largest rank count, against the step time the cost model predicts (its mean rank cost).

    OMP_NUM_THREADS=1 python bench/balance_sim.py                         # -> bench/results/balance_sim.json
    python bench/balance_sim.py --ranks 8 --batches 2 --out /tmp/b.json   # smoke
    python bench/balance_sim.py --table bench/results/balance_sim.json    # the markdown table of docs/data.md

Not modelled: the vision tower's own balance when its patches move between ranks (all-to-all, a later slice),
communication, and the coefficients are FLOP-derived (provisional, titan_mm/data/cost_coefficients.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_mm.data.balance import METHODS, RowCost, load_coefficients, lower_bound, place  # noqa: E402
from titan_mm.data.packing import BestFitPacker, Doc  # noqa: E402

PATCH_PX, MERGE, FRAMES_PER_SLICE = 16, 2, 2
TARGET = {"mix": "skewed", "ranks": 256, "speedup": 1.3, "cpu_share": 0.01}


# ---------------------------------------------------------------- documents: (tokens, [patches per segment])
def _side(px: float) -> int:
    """Patches along one side: resized to a multiple of the merge window (32 px)."""
    return max(MERGE, int(round(px / (PATCH_PX * MERGE))) * MERGE)


def _text(rng, median: float, sigma: float = 1.0) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), 16, 8192))


def _images(rng, n: int, lo: int, hi: int) -> tuple[int, list[int]]:
    segs = [_side(rng.uniform(lo, hi)) * _side(rng.uniform(lo, hi)) for _ in range(n)]
    return sum(p // MERGE**2 + 2 for p in segs), segs  # + vision start / end tokens


def _video(rng, frames: int, w: int, h: int) -> tuple[int, list[int]]:
    slices = frames // FRAMES_PER_SLICE
    p = _side(w) * _side(h)
    return slices * (p // MERGE**2 + 3), [p] * slices  # + a timestamp per slice


def _vl(text: int, media: tuple[int, list[int]]) -> tuple[int, list[int]]:
    return text + media[0], media[1]


def _skewed(rng):
    u = rng.random()
    if u < 0.40:
        return _text(rng, 700), []
    if u < 0.65:
        return _vl(int(rng.integers(64, 512)), _images(rng, int(rng.integers(4, 17)), 224, 448))
    if u < 0.80:
        return _vl(int(rng.integers(32, 256)), _images(rng, int(rng.integers(1, 3)), 1024, 2048))
    w, h = [(336, 336), (448, 448), (640, 352)][int(rng.integers(3))]
    return _vl(int(rng.integers(32, 256)), _video(rng, int(rng.choice([8, 16, 24, 32])), w, h))


def _llava_ov_si(rng):
    if rng.random() < 0.10:
        return _text(rng, 400), []
    return _vl(_text(rng, 200, 0.8), _images(rng, 1, 336, 1536))


def _video_heavy(rng):
    u = rng.random()
    if u < 0.60:
        s = rng.uniform(448, 640)
        return _vl(int(rng.integers(32, 256)), _video(rng, int(rng.choice([16, 32, 48, 64])), s, s * 9 / 16))
    if u < 0.80:
        return _vl(_text(rng, 200, 0.8), _images(rng, 1, 448, 1024))
    return _text(rng, 500), []


def _text_heavy(rng):
    if rng.random() < 0.80:
        return _text(rng, 900, 1.2), []
    return _vl(_text(rng, 150, 0.8), _images(rng, 1, 256, 768))


MIXES = {"skewed": _skewed, "llava_ov_si": _llava_ov_si, "video_heavy": _video_heavy, "text_heavy": _text_heavy}


# ---------------------------------------------------------------- rows
def pack_rows(mix: str, n_rows: int, seq_len: int, seed: int) -> tuple[list[RowCost], dict]:
    """``n_rows`` packed rows of the mix as RowCosts, and packing statistics."""
    rng = np.random.default_rng([seed, list(MIXES).index(mix)])
    packer = BestFitPacker(seq_len)
    docs: list[tuple[int, list[int]]] = []
    rows: list[RowCost] = []
    too_long = 0
    while len(rows) < n_rows:
        n, segs = MIXES[mix](rng)
        if n > seq_len:
            too_long += 1
            continue
        ids = np.broadcast_to(np.int64(0), (n,))  # the packer reads lengths only
        packer.add(Doc(ids, ids, sample_id=str(len(docs)), n_patches=sum(segs)))
        docs.append((n, segs))
        while packer.ready and len(rows) < n_rows:
            row = [docs[int(d.sample_id)] for d in packer.ready.popleft()]
            rows.append(RowCost.of([n for n, _ in row], [p for _, s in row for p in s]))
    tokens = sum(r.tokens for r in rows)
    return rows, {"docs": len(docs), "rows": n_rows, "docs_per_row": round(len(docs) / n_rows, 2),
                  "packing_efficiency": round(tokens / (n_rows * seq_len), 4), "skipped_too_long": too_long}


# ---------------------------------------------------------------- replay
def evaluate(costs: np.ndarray, ranks: int, n_micro: int, B: int, max_batches: int) -> dict:
    per_batch = ranks * n_micro * B
    nb = min(max_batches, len(costs) // per_batch)
    step = {m: 0.0 for m in METHODS}
    step_sync = dict(step)
    imb, gap = ({m: [] for m in METHODS} for _ in range(2))
    for b in range(nb):
        c = costs[b * per_batch : (b + 1) * per_batch]
        lb = lower_bound(c, ranks)
        for m in METHODS:
            micro = c[place(c, ranks, n_micro, m)].sum(axis=2)  # [ranks, n_micro]
            loads = micro.sum(axis=1)
            step[m] += loads.max()
            step_sync[m] += micro.max(axis=0).sum()
            imb[m].append(loads.max() / loads.mean())
            gap[m].append(loads.max() / lb)
    r4 = lambda x: round(float(x), 4)  # noqa: E731
    return {"ranks": ranks, "n_micro": n_micro, "batches": nb,
            "imbalance": {m: r4(np.mean(imb[m])) for m in METHODS},
            "speedup": {m: r4(step["none"] / step[m]) for m in METHODS},
            "speedup_sync": {m: r4(step_sync["none"] / step_sync[m]) for m in METHODS},
            "max_over_lower_bound": {m: r4(np.mean(gap[m])) for m in METHODS},
            "step_s": {m: r4(step[m] / nb) for m in METHODS}}


def time_placement(costs: np.ndarray, rows: list[RowCost], coeffs, ranks: int, n_micro: int, B: int) -> dict:
    n = ranks * n_micro * B
    c = costs[:n]
    out = {"ranks": ranks, "n_micro": n_micro, "rows": n, "place_ms": {}}

    def best_ms(fn, reps: int = 5) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(min(ts) * 1e3, 3)

    for m in METHODS:
        out["place_ms"][m] = best_ms(lambda: place(c, ranks, n_micro, m))
    out["row_costs_ms"] = best_ms(lambda: coeffs.costs(rows[:n]))
    step_s = float(c.sum()) / ranks  # the cost model's mean rank cost
    out["assumed_step_s"] = round(step_s, 4)
    out["place_share_of_step"] = {m: round(out["place_ms"][m] / 1e3 / step_s, 5) for m in METHODS}
    return out


def markdown_table(res: dict) -> str:
    """The docs/data.md table: per mix and rank count, each figure for 1 / 2 / ... micro-batches per rank."""
    cols = [("imbalance", "none"), ("imbalance", "kk"), ("speedup", "lpt"), ("speedup", "kk"), ("speedup_sync", "kk")]
    head = ["imbalance, none", "imbalance, kk", "speedup, lpt", "speedup, kk",
            "speedup, kk, ranks meet per micro-batch"]
    lines = ["| mix | ranks | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for mix, m in res["mixes"].items():
        for ranks in dict.fromkeys(r["ranks"] for r in m["results"]):
            rs = [r for r in m["results"] if r["ranks"] == ranks]
            cells = [" / ".join(f"{r[k][meth]:.3f}" for r in rs) for k, meth in cols]
            lines.append(f"| {mix} | {ranks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,256,1024", help="data-parallel rank counts, comma-separated")
    ap.add_argument("--micro", default="1,2,3,4", help="micro-batches per rank and step, comma-separated")
    ap.add_argument("--micro-batch-size", type=int, default=2, help="rows per micro-batch (B)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batches", type=int, default=3, help="global batches of rows at the largest ranks x micro")
    ap.add_argument("--max-batches", type=int, default=32, help="global batches replayed per setting at most")
    ap.add_argument("--model", default="qwen3_vl:2b", help="key of titan_mm/data/cost_coefficients.json")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "balance_sim.json"))
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and stop")
    a = ap.parse_args(argv)
    if a.table:
        print(markdown_table(json.loads(Path(a.table).read_text())))
        return {}
    ranks, micro = [int(x) for x in a.ranks.split(",")], [int(x) for x in a.micro.split(",")]
    coeffs = load_coefficients(a.model)
    B = a.micro_batch_size
    n_rows = max(ranks) * max(micro) * B * a.batches
    t0 = time.perf_counter()
    res: dict = {"model": a.model, "coefficients": dataclasses.asdict(coeffs), "seq_len": a.seq_len,
                 "micro_batch_size": B, "seed": a.seed, "target": TARGET, "mixes": {}}
    for mix in a.mixes.split(","):
        rows, stats = pack_rows(mix, n_rows, a.seq_len, a.seed)
        costs = coeffs.costs(rows)
        vision = coeffs.costs([RowCost(patches=r.patches, patch_sq=r.patch_sq) for r in rows]).sum()
        stats.update(vision_share_of_cost=round(float(vision / costs.sum()), 4),
                     row_cost_s={k: round(float(f(costs)), 4) for k, f in
                                 (("mean", np.mean), ("p50", np.median), ("p99", lambda c: np.quantile(c, 0.99)),
                                  ("max", np.max))})
        stats["results"] = [evaluate(costs, r, n, B, a.max_batches) for r in ranks for n in micro]
        if mix == TARGET["mix"]:
            res["timing"] = time_placement(costs, rows, coeffs, max(ranks), max(micro), B)
        res["mixes"][mix] = stats
        print(f"{mix}: {stats['docs']} docs -> {n_rows} rows, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    target = [r for r in res["mixes"].get(TARGET["mix"], {}).get("results", []) if r["ranks"] == TARGET["ranks"]]
    if target and "timing" in res:
        share = min(res["timing"]["place_share_of_step"][m] for m in ("lpt", "kk"))
        best = {r["n_micro"]: max(r["speedup"]["lpt"], r["speedup"]["kk"]) for r in target}
        res["target_check"] = {"best_speedup_by_n_micro": best, "best_method_cpu_share": share,
                               "met_for_n_micro": [n for n, s in best.items()
                                                   if s >= TARGET["speedup"] and share < TARGET["cpu_share"]]}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(markdown_table(res))
    print(json.dumps({k: res[k] for k in ("timing", "target_check", "wall_s") if k in res}, indent=1))
    return res


if __name__ == "__main__":
    main()
