"""Generate an image with a BAGEL model through its forward's KV-cache path (titan_mm.models.bagel.sample): BAGEL's
Euler flow steps over its shifted schedule, text classifier-free guidance with the global renorm, the FLUX VAE's decode.

    python -m titan_mm.tools.bagel_generate --model outputs/bagel_run --vae /path/to/FLUX.1-dev/vae \\
        --prompt "a red fox in the snow" --height 512 --width 512 --out fox.png
    python -m titan_mm.tools.bagel_generate --model outputs/debug_bagel --prompt-ids 6,13 --height 16 --width 16 \\
        --out latents.pt

``--model``: a titan_mm run / checkpoint folder or a BAGEL folder (titan_mm.loader). The prompt is ``--prompt`` text
(the model's tokenizer) or ``--prompt-ids`` (comma-separated token ids); <|im_start|> / <|im_end|> go around
it, <|vision_start|> / <|vision_end|> around the image (the tokenizer's ids; a debug model's vocabulary: 1-4).
``--height`` / ``--width`` are pixels (multiples of the VAE's downsampling x the latent patch). With ``--vae`` (BFL's
``ae.safetensors`` or a BAGEL folder holding it, or a diffusers AutoencoderKL folder: FLUX's vae/, or the pipeline
folder) ``--out`` is a PNG; without, ``--out x.pt`` gets the latent image [z, h, w]. Editing: ``--image`` is the
source image (encoded by the VAE and seen by the ViT before the prompt), the output its size unless given, with image
guidance ``--cfg-img-scale``. Defaults are BAGEL inferencer's (50 points, shift 3, text scale 4 in (0.4, 1], image
scale 1.5). Every mistake is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from titan_mm.checkpoint_io import CheckpointError
from titan_mm.config import ConfigError
from titan_mm.loader import load_model
from titan_mm.models.bagel import BagelModel
from titan_mm.models.bagel.data import source_image, specials_for
from titan_mm.models.bagel.sample import check_sampling, sample, write_png
from titan_mm.models.bagel.vae import PIXELS, load_codec, vae_source


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: give comma-separated integer token ids, e.g. 6,13") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--prompt-ids {text!r}: give at least one token id, each >= 0")
    return ids


def check_args(a: argparse.Namespace) -> list[int] | None:
    """The checks that need no model: the prompt ids of --prompt-ids (None with --prompt)."""
    if (a.prompt is None) == (a.prompt_ids is None):
        raise ValueError("give the prompt as --prompt TEXT or as --prompt-ids 1,2,3, one of them")
    suffix = Path(a.out).suffix.lower()
    if suffix not in (".png", ".pt"):
        raise ValueError(f"--out {a.out}: name a PNG (*.png, decoded with --vae) or a torch file (*.pt, the latent)")
    if (suffix == ".png") != bool(a.vae):
        raise ValueError(f"--out {a.out}: a PNG needs --vae (ae.safetensors or a diffusers AutoencoderKL folder) and "
                         "--vae writes a PNG; pass both, or name *.pt without --vae for the latent")
    if a.vae and a.vae != PIXELS:
        vae_source(a.vae)
    if a.image and not a.vae:
        raise ValueError(f"--image {a.image}: editing encodes the source image with the VAE; pass --vae")
    if a.image and not Path(a.image).is_file():
        raise ValueError(f"--image {a.image}: no such file; give the source image (PNG / JPEG) to edit")
    if (a.height is None) != (a.width is None):
        raise ValueError("give --height and --width together, or neither (1024 x 1024, or the --image's size)")
    if a.height is None and not a.image:
        a.height, a.width = 1024, 1024
    if a.height is not None and min(a.height, a.width) < 1:
        raise ValueError(f"--height {a.height} / --width {a.width}: give the image's size in pixels, >= 1")
    return None if a.prompt_ids is None else _ids(a.prompt_ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.tools.bagel_generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="run / checkpoint folder, or a BAGEL folder")
    ap.add_argument("--prompt", default=None, help="the prompt's text (the model's tokenizer)")
    ap.add_argument("--prompt-ids", default=None, help="the prompt as comma-separated token ids")
    ap.add_argument("--height", type=int, default=None, help="pixels (default 1024, or the --image's)")
    ap.add_argument("--width", type=int, default=None, help="pixels (default 1024, or the --image's)")
    ap.add_argument("--image", default=None, help="editing: the source image (PNG / JPEG; needs --vae)")
    ap.add_argument("--cfg-img-scale", type=float, default=1.5, help="editing: image guidance; <= 1: off")
    ap.add_argument("--steps", type=int, default=50, help="points of BAGEL's linspace(1, 0, steps): steps - 1 calls")
    ap.add_argument("--shift", type=float, default=3.0, help="timestep shift")
    ap.add_argument("--cfg-text-scale", type=float, default=4.0, help="text guidance; <= 1: off")
    ap.add_argument("--cfg-interval", type=float, nargs=2, default=(0.4, 1.0), help="t range (low, high] of guidance")
    ap.add_argument("--cfg-renorm-min", type=float, default=0.0, help="least scale of the global renorm")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial noise (a CPU generator)")
    ap.add_argument("--vae", default=None, help="BFL's ae.safetensors (or a BAGEL folder holding it), or a diffusers "
                    "AutoencoderKL folder (FLUX's vae/, or its pipeline); \"pixels\": the pixel codec (the digits run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, help="image.png (decoded with --vae) or latent.pt")
    a = ap.parse_args(argv)
    try:
        ids = check_args(a)
        got = load_model(a.model, a.device)
        if not isinstance(got.model, BagelModel):
            raise ValueError(f"--model {a.model} holds a {got.spec.name!r} model; this tool samples BAGEL models")
        cfg = got.model_cfg
        vae = load_codec(a.vae, cfg, a.device) if a.vae else None
        source = source_image(a.image, vae, cfg) if a.image else None
        if a.height is None:
            a.height, a.width = (n * cfg.vae_config.downsample for n in source[0].shape[1:])
        down = cfg.vae_config.downsample
        if a.height % down or a.width % down:
            raise ValueError(f"--height {a.height} / --width {a.width} must be multiples of the VAE's downsampling "
                             f"{down} x the latent patch {cfg.latent_patch_size}")
        hw = (a.height // down, a.width // down)
        check_sampling(cfg, a.steps, a.shift, a.cfg_text_scale, tuple(a.cfg_interval), hw)
        if ids is None:
            ids = got.tokenizer.encode(a.prompt)
        if max(ids) >= cfg.llm_config.vocab_size:
            raise ValueError(f"token id {max(ids)} is outside the model's vocabulary of {cfg.llm_config.vocab_size}")
    except (ValueError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p = cfg.latent_patch_size
    g = torch.Generator().manual_seed(a.seed)
    noise = torch.randn((hw[0] // p) * (hw[1] // p), cfg.patch_latent_dim, generator=g)
    latent = sample(got.model, ids, noise, hw, steps=a.steps, shift=a.shift, cfg_text_scale=a.cfg_text_scale,
                    cfg_interval=tuple(a.cfg_interval), cfg_renorm_min=a.cfg_renorm_min,
                    specials=specials_for(got.tokenizer, cfg), source=source,
                    cfg_img_scale=a.cfg_img_scale if source is not None else 1.0)
    if vae is None:
        torch.save(latent.cpu(), a.out)
    else:
        write_png(vae.decode(latent[None])[0], a.out)
    print(f"[titan_mm] sampled a {a.height}x{a.width} image in {a.steps - 1} steps -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
