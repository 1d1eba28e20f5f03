"""Data pipeline benchmark: streaming loader vs a naive map-style loader (materialize, then pack globally).

    OMP_NUM_THREADS=1 python bench/data.py [--sizes 10000,100000,1000000] [--out bench/results/data.json]

For each size a text-only JSONL dataset (8 shards, ~60 tokens per sample) is generated, then each
loader runs in its own process (so peak RSS is its own): time to first batch, peak RSS, samples/s
(one worker: num_workers=0, the main process does the work) over ``--batches`` batches, and packing
efficiency (non-pad fraction) at budget 8192, batch 1 row.
The naive loader reads every line, tokenizes everything, sorts by length and best-fit packs the whole
dataset before the first batch (what map-style pipelines that index into memory do).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BUDGET = 8192
VL_MODEL = ("qwen3_vl", "debug")  # (registry model, flavor) whose data needs the --vl case's loader meets


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_streaming(path: str, batches: int, vl: bool = False) -> dict:
    from titan_mm.config import Data
    from titan_mm.data.loader import build_dataloader
    from titan_mm.registry import DataNeeds, resolve_model

    # 64x64 generated images -> 256x256 -> 64 tokens (Qwen3-VL default minimum)
    data = Data(dataset=path, seq_len=BUDGET, micro_batch_size=1, num_workers=0, image_min_pixels=65536)
    if vl:  # the VL model's patch / merge sizes, M-RoPE positions and vision token ids
        spec, mc = resolve_model(*VL_MODEL)
        needs = spec.data_needs(mc)
    else:
        needs = DataNeeds()

    t0 = time.perf_counter()
    dl = build_dataloader(data, needs=needs, seed=0)
    it = iter(dl)
    next(it)
    ttfb = time.perf_counter() - t0
    toks = slots = samples = 0
    t1 = time.perf_counter()
    for _ in range(batches):
        next(it)
        m = dl.metrics()
        toks += m["tokens"]
        samples += m["samples"]
        slots += BUDGET
    dt = time.perf_counter() - t1
    return {"time_to_first_batch_s": ttfb, "samples_per_s_per_worker": samples / dt,
            "packing_efficiency": toks / slots, "peak_rss_mb": peak_rss_mb()}


def run_naive(path: str, batches: int) -> dict:
    import glob

    import numpy as np

    from titan_mm.data.packing import BestFitPacker, Doc, collate_rows
    from titan_mm.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    t0 = time.perf_counter()
    texts = []
    for f in sorted(glob.glob(os.path.join(path, "*.jsonl"))):
        with open(f) as fh:
            texts += [json.loads(line)["text"] for line in fh]
    docs = []
    for i in range(0, len(texts), 10000):
        for ids in tok.encode_batch(texts[i : i + 10000]):
            a = np.asarray(ids + [tok.endoftext_id], dtype=np.int64)
            docs.append(a)
    del texts
    docs.sort(key=len, reverse=True)  # global first-fit-decreasing flavour: longest first
    packer = BestFitPacker(BUDGET, open_rows=32)
    for a in docs:
        if len(a) <= BUDGET:
            packer.add(Doc(a, np.concatenate([a[1:], [-100]])))
    packer.flush()
    rows = list(packer.ready)
    collate_rows(rows[:1], BUDGET, tok.pad_id, 1)
    ttfb = time.perf_counter() - t0
    t1 = time.perf_counter()
    samples = toks = 0
    for r in rows[1 : 1 + batches]:
        collate_rows([r], BUDGET, tok.pad_id, 1)
        samples += len(r)
        toks += sum(len(d) for d in r)
    dt = max(time.perf_counter() - t1, 1e-9)
    # throughput of the naive loader over the whole run includes its preprocessing
    total_samples = sum(len(r) for r in rows)
    eff = sum(len(d) for r in rows for d in r) / (len(rows) * BUDGET)
    return {"time_to_first_batch_s": ttfb, "samples_per_s_per_worker": total_samples / (ttfb + dt * len(rows) / max(1, batches)),
            "packing_efficiency": eff, "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "data.json"))
    ap.add_argument("--timeout", type=float, default=240, help="seconds before a case is recorded as not finished")
    ap.add_argument("--vl", type=int, default=0, metavar="N",
                    help="only add a streaming VL case (N samples, 30%% image chats) to the existing --out file")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "PATH", "BATCHES"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        mode, path, n = a.child
        if mode == "streaming_vl":
            r = run_streaming(path, int(n), vl=True)
        else:
            r = (run_streaming if mode == "streaming" else run_naive)(path, int(n))
        print("RESULT " + json.dumps(r))
        return
    from titan_mm.data.builtin.generate import generate

    if a.vl:
        with tempfile.TemporaryDirectory() as tmp:
            generate(tmp, a.vl, "jsonl", shards=8, images=0.3, seed=0)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
            p = subprocess.run([sys.executable, __file__, "--child", "streaming_vl", tmp, str(a.batches)],
                               capture_output=True, text=True, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise RuntimeError(f"bench child streaming_vl failed:\n{p.stderr[-3000:]}")
            r = json.loads(line[-1][7:])
        r.update(mode="streaming_vl", samples=a.vl, images=0.3)
        print(json.dumps(r))
        results = json.load(open(a.out)) if os.path.exists(a.out) else {"cases": []}
        results["vl_cases"] = [r]
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        return

    results = {"budget": BUDGET, "batch_rows": 1, "num_workers": 0, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in a.sizes.split(",")]:
            d = os.path.join(tmp, f"n{n}")
            t = time.perf_counter()
            generate(d, n, "jsonl", shards=8, seed=0)
            gen_s = time.perf_counter() - t
            for mode in ("streaming", "naive"):
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
                try:
                    p = subprocess.run([sys.executable, __file__, "--child", mode, d, str(a.batches)],
                                       capture_output=True, text=True, env=env, timeout=a.timeout)
                except subprocess.TimeoutExpired:
                    r = {"mode": mode, "samples": n, "generate_s": gen_s, "time_to_first_batch_s": None,
                         "note": f"no first batch within {a.timeout:.0f} s (killed)"}
                    print(json.dumps(r), flush=True)
                    results["cases"].append(r)
                    continue
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    raise RuntimeError(f"bench child {mode} n={n} failed:\n{p.stderr[-3000:]}")
                r = json.loads(line[-1][7:])
                r.update(mode=mode, samples=n, generate_s=gen_s)
                print(json.dumps(r), flush=True)
                results["cases"].append(r)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
