"""BAGEL's rows where they are built (titan_mm/models/bagel/data.py; docs/bagel.md "Data"): what the packed loader
gives per second with the pixel codec (train_configs/debug_bagel_digits.toml's builtin:digits), and what one image
costs the FLUX VAE's encoder (a random diffusers AutoencoderKL of FLUX's architecture: 4 levels of 128/256/512/512
channels, 2 res blocks each, 16 latent channels, 8x down) on the device, per image side.

    OMP_NUM_THREADS=2 python bench/bagel_data.py [--device cpu] [--sides 256 512] [--out bench/results/bagel_data_cpu.json]

The VAE's figure is the data pipeline's cost per image where it encodes (a loader process or worker on the CPU, as
built), to set against a train step's time: it decides whether encoding can stay there or must move into the step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
from diffusers import AutoencoderKL

from titan_mm.config import load_config
from titan_mm.data.loader import build_dataloader
from titan_mm.models.bagel.config import FLAVORS
from titan_mm.models.bagel.vae import FluxVAE
from titan_mm.registry import resolve_model


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


def flux_encode_s(side: int, device: str, reps: int) -> float:
    """Seconds per side x side image through FluxVAE.encode (fp32), after one warm-up."""
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=16, norm_num_groups=32, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    codec = FluxVAE(vae, FLAVORS["7B-MoT"], device)
    x = torch.rand(1, 3, side, side) * 2 - 1
    codec.encode(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        codec.encode(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sides", type=int, nargs="*", default=[256, 512])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/bagel_data_cpu.json"))
    a = ap.parse_args()
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"{platform.processor() or 'cpu'} " \
        f"({torch.get_num_threads()} threads)"
    row = {"device": dev, "torch": torch.__version__, "command": " ".join(sys.argv),
           "digits_loader_pixel_codec": digits_rows_per_s(a.batches),
           "flux_vae_encode_s_per_image": {str(s): flux_encode_s(s, a.device, a.reps) for s in a.sides}}
    print(json.dumps(row, indent=1))
    with open(a.out, "w") as f:
        json.dump(row, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
