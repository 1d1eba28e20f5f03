"""BAGEL's rows where they are built (titan_mm/models/bagel/data.py; docs/bagel.md "Data"): what the packed loader
gives per second with the pixel codec (train_configs/debug_bagel_digits.toml's builtin:digits), what one image costs
the FLUX VAE's encoder (a random diffusers AutoencoderKL of FLUX's architecture: 4 levels of 128/256/512/512
channels, 2 res blocks each, 16 latent channels, 8x down) on the device, per image side, and the two places the
trainer's loader can encode (issue 47 item 3), per image and per micro-batch:

- ``worker``: the builder encodes each image as it builds the row (BagelDocs; a loader worker's cost, measured here
  in the loader's own process, num_workers=0, on the CPU with ``cpu_threads`` threads; a DataLoader worker runs one
  thread, so W workers on as many cores give a rank about W / cpu_threads of this rate, more where threads scale
  badly);
- ``device``: the workers leave the images in the batch and BagelEncoder encodes them in the trainer's process on
  ``--device`` (what the trainer does), images of one size in one call;
- ``cache``: the latents written once by the cache tool's writer (on ``--device``; its seconds per image too), read
  in the trainer's process (data.encoders names the cache).

    OMP_NUM_THREADS=2 python bench/bagel_data.py --vae small                 # CPU: all sections, a small VAE
    python bench/bagel_data.py --vae flux --device cuda --only flux paths --sides 256 512 --path-batches 3 \\
        --out bench/results/bagel_data_gpu.json                              # GPU: FLUX's size, random weights

Sections (``--only``): ``digits``, ``flux`` (one image through FluxVAE.encode, FLUX's size whatever ``--vae``) and
``paths`` (t2i rows of random side x side PNGs through both loaders with ``--vae``'s architecture; the worker path on
the CPU always, where a loader worker runs). The output JSON keeps the sections a run does not measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np
import torch
from diffusers import AutoencoderKL
from PIL import Image

from titan_mm.config import Data, load_config
from titan_mm.data.loader import build_dataloader
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.models.bagel.config import FLAVORS
from titan_mm.models.bagel.data import data_needs, write_latent_cache
from titan_mm.models.bagel.vae import FLUX_AE, FluxVAE
from titan_mm.registry import resolve_model

VAES = {"flux": FLUX_AE, "small": {**FLUX_AE, "block_out_channels": [16, 32, 64, 64], "layers_per_block": 1,
                                   "norm_num_groups": 8}}
"""FLUX's AutoencoderKL config, and a small one of the same shape (16 channels, 8x down) for a shared CPU."""
CFG = FLAVORS["7B-MoT"]  # the rows' sizes only (latent 16 x 8x, patch 2, 64-patch table); no model is built


def digits_rows_per_s(batches: int) -> dict:
    """Samples and tokens per second of debug_bagel_digits' loader (no workers), after its first batch."""
    cfg = load_config(["--config", "debug_bagel_digits"])
    spec, model_cfg = resolve_model("bagel", cfg.model.flavor, overrides=cfg.model.overrides)
    loader = build_dataloader(cfg.data, needs=spec.data_needs(model_cfg), seed=0)
    it = iter(loader)
    next(it)
    samples = tokens = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
        m = loader.metrics()
        samples, tokens = samples + m["samples"], tokens + m["tokens"]
    dt = time.perf_counter() - t0
    return {"batches": batches, "samples_per_s": samples / dt, "tokens_per_s": tokens / dt}


def random_vae(config: dict) -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(**config).eval()


def flux_encode_s(side: int, device: str, reps: int) -> float:
    """Seconds per side x side image through FluxVAE.encode (fp32), after one warm-up."""
    codec = FluxVAE(random_vae(FLUX_AE), CFG, device)
    x = torch.rand(1, 3, side, side) * 2 - 1
    codec.encode(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        codec.encode(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def t2i_rows(folder: str, side: int, n: int) -> str:
    """A JSONL of n text-to-image rows, each a random side x side PNG and a short caption."""
    rng = np.random.default_rng(0)
    with open(os.path.join(folder, f"t2i{side}.jsonl"), "w") as f:
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
                os.path.join(folder, f"{side}_{i}.png"))
            f.write(json.dumps({"image": f"{side}_{i}.png", "caption": f"random picture number {i}"}) + "\n")
    return f.name


def path_times(vae_dir: str, rows: str, side: int, per_batch: int, batches: int, device: str) -> dict:
    """Seconds per micro-batch of ``per_batch`` images, and per image, of the three loaders after their first batch,
    taken in turns (worker, device, cache, worker, ...) so that all see the same load on a shared machine: the
    median and the least of ``batches`` each; encode_s: the device encoder's (or cache reader's) share of its batch;
    and the cache tool's seconds per image (write_latent_cache on ``device``)."""
    tokens = (side // 16) ** 2 + 2 + 8  # latent patches + vs / ve + the caption's at most 8 tokens (bos, eos included)
    d = Data(dataset=rows, encoders=vae_dir, image_min_pixels=0, image_max_pixels=side * side, shuffle_buffer=0,
             seq_len=tokens * per_batch, micro_batch_size=1, num_workers=0, open_rows=1)  # a row closes when full
    cache = os.path.join(os.path.dirname(rows), f"cache{side}")
    t0 = time.perf_counter()
    idx = write_latent_cache(CFG, d, load_tokenizer(), 0, cache, device)
    write_s = (time.perf_counter() - t0) / idx["images"]
    cached = dataclasses.replace(d, encoders=cache)
    loaders = {"worker_cpu": build_dataloader(d, needs=data_needs(CFG), seed=0),
               f"device_{device}": build_dataloader(d, needs=data_needs(CFG), seed=0, encode_device=device),
               "cache": build_dataloader(cached, needs=data_needs(CFG), seed=0, encode_device=device)}
    its = {k: iter(ld) for k, ld in loaders.items()}
    for it in its.values():
        next(it)
    times: dict[str, list[float]] = {k: [] for k in its}
    enc: dict[str, list[float]] = {k: [] for k in its}
    images: dict[str, int] = dict.fromkeys(its, 0)
    for _ in range(batches):
        for k, it in its.items():
            t0 = time.perf_counter()
            b = next(it)
            times[k].append(time.perf_counter() - t0)
            enc[k].append(loaders[k].metrics()["encode_s"])
            images[k] += int(b["latent_mask"].sum()) // (side // 16) ** 2
    return {"cache_tool_s_per_image": write_s,
            **{k: {"batches": batches, "images_per_batch": images[k] / batches,
                   "s_per_batch_median": float(np.median(t)), "s_per_batch_min": min(t),
                   "s_per_image_median": float(np.median(t)) * batches / images[k],
                   "encode_s_per_batch_median": float(np.median(enc[k]))} for k, t in times.items()}}


def paths(vae: str, sides: list[int], device: str, per_batch: int, batches: int) -> dict:
    out = {"vae": vae, "vae_block_out_channels": VAES[vae]["block_out_channels"],
           "micro_batch": f"one row of {per_batch} text-to-image samples of one size (data.micro_batch_size 1)"}
    with tempfile.TemporaryDirectory() as tmp:
        random_vae(VAES[vae]).save_pretrained(os.path.join(tmp, "vae"))
        for side in sides:
            rows = t2i_rows(tmp, side, per_batch * (batches + 2))
            out[str(side)] = path_times(os.path.join(tmp, "vae"), rows, side, per_batch, batches, device)
            print(side, json.dumps(out[str(side)]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sides", type=int, nargs="*", default=[256])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--batches", type=int, default=50, help="digits batches")
    ap.add_argument("--vae", choices=sorted(VAES), default="small", help="the paths section's VAE architecture")
    ap.add_argument("--per-batch", type=int, default=4, help="images per micro-batch in the paths section")
    ap.add_argument("--path-batches", type=int, default=6, help="timed micro-batches of each path, in turns")
    ap.add_argument("--only", nargs="*", choices=["digits", "flux", "paths"], default=["digits", "flux", "paths"])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/bagel_data_cpu.json"))
    a = ap.parse_args()
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"{platform.processor() or 'cpu'} " \
        f"({torch.get_num_threads()} threads)"
    head = {"device": dev, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
            "command": " ".join(sys.argv), "load_average_1min_at_start": os.getloadavg()[0]}  # a shared CPU's noise
    row = {}
    if os.path.isfile(a.out):
        with open(a.out) as f:
            row = json.load(f)
    if "digits" in a.only:
        row.update(head, digits_loader_pixel_codec=digits_rows_per_s(a.batches))
    if "flux" in a.only:
        row.update(head, flux_vae_encode_s_per_image={str(s): flux_encode_s(s, a.device, a.reps) for s in a.sides})
    if "paths" in a.only:
        row["encode_paths"] = {**head, **paths(a.vae, a.sides, a.device, a.per_batch, a.path_batches)}
    print(json.dumps(row, indent=1))
    with open(a.out, "w") as f:
        json.dump(row, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
