"""What checkpoint checksums cost: hash speed, save time, load-time verify, and how much of the hashing an async
save hides from the training thread.

    OMP_NUM_THREADS=1 python bench/checkpoint_verify.py [--flavor 1.7B] [--dtype bfloat16] [--dir /tmp/ckbench]
                                                        [--out bench/results/checkpoint_verify.json]

The model is the registry's qwen3 ``--flavor`` built on CPU with random weights in ``--dtype`` (bfloat16 by
default: 3.4 GB for 1.7B, so that the async save's CPU staging copy fits a 24 GiB machine). The checkpoint holds
the weights and the train state, not AdamW moments (see build_state); a trained checkpoint holds fp32 master
weights and two moments, about 6x the bytes, and every cost here is per byte. It is saved with titan_mm's
CheckpointManager four times: blocking and async, each with and without checksums. For async the
training thread is modelled as a loop that calls ``poll()`` every 50 ms (what the trainer does once per step);
"blocked" is the time it spends inside ``save()`` (the CPU staging copy, the same work with or without
checksums: the hashing starts after the write) and ``poll()`` (where an unhidden hash would show). Hidden share of
the hash time = 1 - (poll time with checksums - poll time without) / hash time. Verify is timed right after the save (page cache warm)
and after dropping the files from the page cache (posix_fadvise DONTNEED; a resume in a new job).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def hash_speeds(mib: int = 256) -> dict[str, float]:
    """GB/s of each candidate over one in-memory buffer, 8 MiB chunks (the chunking file_record uses)."""
    buf = memoryview(os.urandom(mib << 20))
    chunk = 8 << 20

    def crc32():
        c = 0
        for i in range(0, len(buf), chunk):
            c = zlib.crc32(buf[i:i + chunk], c)

    def hashlib_algo(name):
        def run():
            h = hashlib.new(name)
            for i in range(0, len(buf), chunk):
                h.update(buf[i:i + chunk])
        return run

    algos = {"crc32": crc32, "sha256": hashlib_algo("sha256"), "blake2b": hashlib_algo("blake2b"),
             "md5": hashlib_algo("md5")}
    try:
        import xxhash

        def xxh3():
            h = xxhash.xxh3_128()
            for i in range(0, len(buf), chunk):
                h.update(buf[i:i + chunk])
        algos["xxh3_128 (xxhash, not a titan_mm dependency)"] = xxh3
    except ImportError:
        pass
    out = {}
    for name, fn in algos.items():
        best = min(_timed(fn) for _ in range(3))
        out[name] = round(len(buf) / best / 1e9, 3)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_state(flavor: str, dtype):
    import torch

    from titan_mm.registry import resolve_model
    from titan_mm.train.state import TrainState

    spec, mcfg = resolve_model("qwen3", flavor)
    torch.set_default_dtype(dtype)
    with torch.device("meta"):
        model = spec.build(mcfg)
    model.to_empty(device="cpu")
    torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
            # get_optimizer_state_dict fills an empty AdamW state with a zero-grad step (grads + 2 moments: 3x the
            # weights in memory); frozen parameters keep the optimizer state empty, so the checkpoint is the weights
            p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    n = sum(p.numel() for p in model.parameters())
    return TrainState(model=model, optimizer=opt, scheduler=sched), n


def drop_page_cache(folder) -> None:
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_save(state, root, mode: str, checksums: bool) -> dict:
    from titan_mm.checkpoint_io import verify_checkpoint
    from titan_mm.train.checkpoint import CheckpointManager

    folder = root / f"{mode}_{'crc' if checksums else 'none'}"
    shutil.rmtree(folder, ignore_errors=True)
    mgr = CheckpointManager(folder, interval=1, keep_last=0, async_mode=mode, checksums=checksums)
    state.step += 1
    t0 = time.perf_counter()
    path = mgr.save(state)
    in_save = time.perf_counter() - t0
    in_poll = 0.0
    while mgr.last_saved_step != state.step:  # the training loop: one poll per 50 ms "step"
        time.sleep(0.05)
        t = time.perf_counter()
        mgr.poll()
        in_poll += time.perf_counter() - t
    total = time.perf_counter() - t0
    mgr.close()
    row = {"mode": mode, "checksums": checksums, "save_to_commit_s": round(total, 3),
           "training_thread_in_save_s": round(in_save, 3), "training_thread_in_poll_s": round(in_poll, 4),
           "training_thread_blocked_s": round(in_save + in_poll, 3), "hash_s": round(mgr.hash_seconds, 3),
           "bytes": sum(p.stat().st_size for p in path.iterdir())}
    if checksums:
        row["verify_warm_s"] = round(_timed(lambda: verify_checkpoint(path)), 3)
        drop_page_cache(path)
        row["verify_cold_s"] = round(_timed(lambda: verify_checkpoint(path)), 3)
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="1.7B")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--dir", default="/tmp/titan_mm_ckbench")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the four saves; each figure is the min over them")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "checkpoint_verify.json"))
    a = ap.parse_args(argv)

    from pathlib import Path

    import torch

    speeds = hash_speeds()
    print(json.dumps({"hash_gb_per_s": speeds}), flush=True)
    state, n_params = build_state(a.flavor, getattr(torch, a.dtype))
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = [one_save(state, root, mode, cs) for _ in range(a.repeat) for mode in ("disabled", "async")
            for cs in (False, True)]
    shutil.rmtree(root, ignore_errors=True)

    by = {}
    for r in rows:  # the min over the rounds of every timed figure (the first round pays DCP's warm-up)
        key = (r["mode"], r["checksums"])
        by[key] = {k: (min(v, by[key][k]) if key in by and k.endswith("_s") else v) for k, v in r.items()}
    a_crc, a_none = by["async", True], by["async", False]
    b_crc, b_none = by["disabled", True], by["disabled", False]
    gb = b_crc["bytes"] / 1e9
    trained_gb = n_params * 4 * 3 / 1e9  # fp32 weights + AdamW exp_avg + exp_avg_sq
    result = {
        "what": f"qwen3 {a.flavor} ({n_params / 1e9:.3f}B params), random init, {a.dtype} weights, model + "
                "train state (no optimizer moments), CheckpointManager on CPU, one process",
        "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0], "torch": torch.__version__,
        "hash_gb_per_s": speeds, "checksum": "crc32", "runs": rows,
        "summary": {
            "checkpoint_gb": round(gb, 3),
            "hash_s": b_crc["hash_s"], "hash_gb_per_s_on_files": round(gb / b_crc["hash_s"], 3),
            "blocking_save_s_without_checksums": b_none["save_to_commit_s"],
            "blocking_save_s_with_checksums": b_crc["save_to_commit_s"],
            "async_blocked_s_without_checksums": a_none["training_thread_blocked_s"],
            "async_blocked_s_with_checksums": a_crc["training_thread_blocked_s"],
            "async_hash_s": a_crc["hash_s"],
            "async_poll_s_without_checksums": a_none["training_thread_in_poll_s"],
            "async_poll_s_with_checksums": a_crc["training_thread_in_poll_s"],
            "async_hash_hidden_share": round(1 - max(0.0, a_crc["training_thread_in_poll_s"]
                                                     - a_none["training_thread_in_poll_s"]) / a_crc["hash_s"], 3),
            "verify_warm_s": b_crc["verify_warm_s"], "verify_cold_s": b_crc["verify_cold_s"],
            "trained_checkpoint_gb_estimate": round(trained_gb, 2),
            "verify_s_for_trained_checkpoint_estimate_cold": round(b_crc["verify_cold_s"] * trained_gb / gb, 1),
        },
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
