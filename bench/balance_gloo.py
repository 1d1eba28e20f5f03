"""Does data.balance even out the ranks' measured compute, not only the predicted one? The trainer's dispatch
(titan_mm/parallel/balance_dispatch.py) over gloo processes on the CPU, on a mix of bench/balance_sim.py.

Each of W processes holds a tiny Qwen3-VL (the debug flavor, a 512-token vocabulary) and its share of every
global batch (W x n_micro x B rows in the loader's order, placement "none"): documents of the mix (``--mix``,
default ``skewed``: text, many small images, few huge images, short videos), shrunk by ``--shrink`` (tokens and
patches; video temporal slices replayed as images of their patches) and packed into rows of ``--seq-len`` tokens by
titan_mm.data.packing.BestFitPacker. The Rebalancer places them ("kk") and exchanges the rows; then every rank times
forward + backward of its micro-batches, once for the loader's rows and once for the placed ones. The ranks time
in turn (a barrier between), so W processes on 2 cores never share a core while timing; no gradient collective
runs, so a rank's time is its own compute. The cost model uses the FLOP-derived coefficients of this tiny model
(titan_mm.data.balance.coefficients_from_flops). Reported per W: predicted and measured max / mean rank cost
before and after, the measured step time (the slowest rank) before and after, and the dispatch's host time.

On the CPU the attention masks are dense (sdpa: the ViT attends over all patches of a micro-batch, the decoder over
the whole row), so the times grow with (sum P)^2 and S^2 where the cost model (varlen kernels on the GPU) counts
sum P^2 and sum L^2; expect the measured imbalance after placement to stay above the predicted one.

    OMP_NUM_THREADS=1 python bench/balance_gloo.py                # W = 4 and 8 -> bench/results/balance_gloo.json
    python bench/balance_gloo.py --worlds 4 --steps 1 --out /tmp/b.json   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.balance_sim import MERGE, MIXES  # noqa: E402
from titan_mm.data.balance import coefficients_from_flops  # noqa: E402
from titan_mm.data.packing import BestFitPacker, Doc  # noqa: E402
from titan_mm.parallel.balance_dispatch import Rebalancer, join_rows, split_rows  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

VOCAB = 512


def tiny_config():
    base = get_model_spec("qwen3_vl").flavor("debug")
    return dataclasses.replace(base, text=dataclasses.replace(base.text, vocab_size=VOCAB), image_token_id=VOCAB - 4,
                               video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2, vision_end_token_id=VOCAB - 1)


def mix_rows(mix: str, n_rows: int, seq_len: int, shrink: int, seed: int) -> list[list[list]]:
    """``n_rows`` packed rows, each a list of documents, each a list of make_sample segments."""
    rng = np.random.default_rng([seed, list(MIXES).index(mix)])
    packer, docs, rows = BestFitPacker(seq_len), [], []
    while len(rows) < n_rows:
        n, segs = MIXES[mix](rng)
        patches = [max(MERGE**2, p // shrink // MERGE**2 * MERGE**2) for p in segs]
        visual = sum(p // MERGE**2 + 2 for p in patches)  # + vision start / end
        text = max(1, n // shrink - visual)
        if text + visual > seq_len:
            continue
        docs.append([("text", text)] + [("image", (MERGE, p // MERGE)) for p in patches])
        ids = np.zeros(text + visual, dtype=np.int64)  # the packer reads lengths only
        packer.add(Doc(ids, ids, sample_id=str(len(docs) - 1), n_patches=sum(patches)))
        while packer.ready and len(rows) < n_rows:
            rows.append([docs[int(d.sample_id)] for d in packer.ready.popleft()])
    return rows


def micro_batches(cfg, rows: list[list[list]], seq_len: int, B: int, seed: int) -> list[dict]:
    """The rows as collated micro-batches of B rows (one row packed at a time, then joined)."""
    from titan_mm.models.qwen3_vl.synthetic import make_sample, pack

    g = torch.Generator().manual_seed(seed)
    one = [split_rows(pack([make_sample(cfg, d, g, text_vocab=VOCAB - 4) for d in row], cfg, seq_len=seq_len),
                      {"image_pad": cfg.image_token_id}, MERGE)[0] for row in rows]
    return [join_rows(one[i:i + B]) for i in range(0, len(one), B)]


def _time(model, micro: list[dict], ctx) -> float:
    from titan_mm.train.step import forward_backward, local_counts

    n = local_counts(micro, ctx.objective)
    t0 = time.perf_counter()
    forward_backward(model, micro, ctx, n)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _in_turn(fn, rank: int, world: int) -> float:
    """fn() on one rank at a time (the others wait in a barrier), so the timings do not share cores."""
    out = 0.0
    for r in range(world):
        if r == rank:
            out = fn()
        dist.barrier()
    return out


def _worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from titan_mm.models.qwen3_vl.model import Qwen3VLModel
    from titan_mm.train.step import StepContext

    spec, cfg = get_model_spec("qwen3_vl"), tiny_config()
    torch.manual_seed(0)
    model = Qwen3VLModel(cfg)
    model.init_weights()
    ctx = StepContext(device=torch.device("cpu"), attn_backend="sdpa",
                      prepare_batch=functools.partial(spec.prepare_batch, cfg), seq_keys=spec.seq_keys)
    reb = Rebalancer("kk", coefficients_from_flops(spec, cfg), {"image_pad": cfg.image_token_id}, MERGE, None,
                     rank, world, torch.device("cpu"))
    per_rank = args.n_micro * args.micro_batch_size
    rows = mix_rows(args.mix, (args.steps + 1) * world * per_rank, args.seq_len, args.shrink, args.seed)
    steps = []
    for s in range(args.steps + 1):  # step 0 warms up (first-call costs), not reported
        mine = rows[(s * world + rank) * per_rank:(s * world + rank + 1) * per_rank]
        micro = micro_batches(cfg, mine, args.seq_len, args.micro_batch_size, args.seed + s)
        placed = reb(micro)
        rec = dict(reb.last)
        for key, mbs in (("before", micro), ("after", placed)):
            t = torch.tensor([_in_turn(lambda mbs=mbs: _time(model, mbs, ctx), rank, world)], dtype=torch.float64)
            ts = [torch.zeros_like(t) for _ in range(world)]
            dist.all_gather(ts, t)
            rec[f"measured_{key}_s"] = [float(x) for x in ts]
        if s:
            steps.append(rec)
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


def summarize(steps: list[dict]) -> dict:
    def imb(ts):
        return max(ts) / (sum(ts) / len(ts))

    mean = lambda xs: round(float(np.mean(xs)), 4)  # noqa: E731
    before = [s["measured_before_s"] for s in steps]
    after = [s["measured_after_s"] for s in steps]
    return {
        "predicted_imbalance_before": mean([s["balance/pred_imbalance_before"] for s in steps]),
        "predicted_imbalance_after": mean([s["balance/pred_imbalance_after"] for s in steps]),
        "measured_imbalance_before": mean([imb(t) for t in before]),
        "measured_imbalance_after": mean([imb(t) for t in after]),
        "measured_step_s_before": mean([max(t) for t in before]),
        "measured_step_s_after": mean([max(t) for t in after]),
        "measured_speedup": round(sum(max(t) for t in before) / sum(max(t) for t in after), 4),
        "dispatch_s": mean([s["balance/dispatch_s"] for s in steps]),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", default="skewed", choices=list(MIXES))
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=2, help="global batches timed (after one warm-up)")
    ap.add_argument("--n-micro", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--shrink", type=int, default=8, help="divide the mix's document tokens and patches by this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "balance_gloo.json"))
    args = ap.parse_args(argv)
    res = {"args": vars(args), "worlds": {}}
    for w in args.worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out_dir = Path(args.out).with_suffix(f".w{w}.tmp")
        out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(w, port, args, str(out_dir)), nprocs=w)
        r = summarize(json.loads((out_dir / "result.json").read_text()))
        (out_dir / "result.json").unlink()
        out_dir.rmdir()
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        res["worlds"][str(w)] = r
        print(f"W={w}: predicted max/mean {r['predicted_imbalance_before']} -> {r['predicted_imbalance_after']}, "
              f"measured {r['measured_imbalance_before']} -> {r['measured_imbalance_after']}, step "
              f"{r['measured_step_s_before']}s -> {r['measured_step_s_after']}s ({r['measured_speedup']}x), "
              f"dispatch {r['dispatch_s'] * 1e3:.1f} ms; {r['wall_s']}s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
