"""Wan's two data paths (titan_mm/data/clips.py; docs/wan.md "Data"): a latent cache written once by
python -m titan_mm.tools.cache and streamed, against encoding each clip in the data pipeline (data.encoders).

    OMP_NUM_THREADS=2 python bench/wan_data.py [--clips 6] [--frames 9] [--out bench/results/wan_data_cpu.json]

Random frozen encoders at Wan's compression (AutoencoderKLWan with dim_mult (1, 2, 4, 4): 4x in time, 8x in
space, 16 latent channels, base_dim 16 where Wan's is 96; UMT5 128 wide, 2 layers, where UMT5-XXL is 4096 x 24) and
generated mp4 clips of --frames frames at 64x64 and 64x96 (two buckets). Per path: seconds to list the rows,
then seconds per micro-batch (2 clips) over one epoch; and the cache tool's seconds per clip. Real encoders cost
far more per clip than these, so the ratio here is a floor on what the cache saves per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from titan_mm.config import load_config  # noqa: E402
from titan_mm.data.clips import CacheSource, ClipLoader, RawSource  # noqa: E402
from titan_mm.models.wan.toy import save_random_encoders, write_clip_rows  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.tools.cache import main as cache  # noqa: E402

FLAVOR = "1.3B"  # text_dim 4096 is the transformer's; the loader only pads states, so UMT5's width here is free


def _epoch(loader: ClipLoader) -> float:
    """Seconds per micro-batch over one epoch."""
    it, t0 = iter(loader), time.perf_counter()
    for _ in range(loader.per_epoch):
        next(it)
    return (time.perf_counter() - t0) / loader.per_epoch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=6)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/wan_data_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    tmp = tempfile.mkdtemp(prefix="wan_data_bench_")
    pipe = os.path.join(tmp, "pipe")
    save_random_encoders(pipe, text_dim=128, z_dim=16, text_layers=2, text_heads=4, vae_dim=16, vae_mult=(1, 2, 4, 4),
                         temporal=(False, True, True))
    rows = write_clip_rows(tmp, args.clips, args.frames, ((64, 96), (64, 64)))
    flags = ["--model.name", "wan", "--model.flavor", FLAVOR, "--data.dataset", rows,
             "--data.encoders", pipe, "--data.video_fps", "0", "--data.video_min_frames", "1",
             "--data.video_max_frames", str(args.frames), "--data.video_max_pixels", str(10**9),
             "--data.micro_batch_size", "2"]
    t0 = time.perf_counter()
    cache([*flags, "--out", os.path.join(tmp, "cache")])
    t_cache = time.perf_counter() - t0
    spec = get_model_spec("wan")
    layout = spec.data_needs(spec.flavor(FLAVOR)).clips
    data = load_config(flags).data
    list_s = {}
    t0 = time.perf_counter()
    sources = {"cache": CacheSource(os.path.join(tmp, "cache"))}
    list_s["cache"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sources["in_pipeline"] = RawSource(data, layout.encoders(pipe))
    list_s["in_pipeline"] = time.perf_counter() - t0
    out = {"question": "seconds per micro-batch of 2 Wan clips: latent cache vs encoding in the data pipeline",
           "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
           "command": "OMP_NUM_THREADS=2 python bench/wan_data.py",
           "load_average_1m": round(os.getloadavg()[0], 1),  # a shared CPU: other jobs' load slows every figure
           "clips": args.clips, "frames": args.frames, "sizes": ["64x96", "64x64"],
           "encoders": "random: AutoencoderKLWan base_dim 16, dim_mult (1, 2, 4, 4), z 16; UMT5 128 wide x 2 layers",
           "cache_tool_s_per_clip": round(t_cache / args.clips, 4), "rows": {}}
    for name, src in sources.items():
        loader = ClipLoader(src, layout, micro_batch_size=2, seed=0)
        out["rows"][name] = {"list_s": round(list_s[name], 4), "s_per_micro_batch": round(_epoch(loader), 4)}
    c, r = (out["rows"][k]["s_per_micro_batch"] for k in ("cache", "in_pipeline"))
    out["in_pipeline_over_cache"] = round(r / c, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
