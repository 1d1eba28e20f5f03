"""Generate a clip with a Wan model through its training forward (titan_mm.models.wan.sample): Euler flow steps
with classifier-free guidance, the sigmas of diffusers' FlowMatchEulerDiscreteScheduler with ``--shift``.

    python -m titan_mm.tools.wan_sample --model outputs/wan_run --encoders /path/to/Wan2.1-T2V-1.3B-Diffusers \\
        --prompt "a red ball rolls left" --latent-frames 21 --latent-height 60 --latent-width 104 --out clip.gif
    python -m titan_mm.tools.wan_sample --model outputs/debug_wan --text-states prompt.pt --out latents.pt

``--model``: a titan_mm run / checkpoint folder or a diffusers transformer (or pipeline) folder. The prompt is
``--prompt`` text, encoded by the frozen UMT5 of ``--encoders`` (a diffusers Wan pipeline folder: tokenizer/,
text_encoder/, vae/; titan_mm.models.wan.data, as the data pipeline encodes captions) and zero-padded to 512
states as WanPipeline does, with ``--negative-prompt`` (default "", WanPipeline's); or ``--text-states``, a torch
file of UMT5 states [L, text_dim] or [B, L, text_dim], with ``--negative-states`` (default zeros: the empty prompt of
data.prompt_dropout). The latent sizes are the VAE's (a 480x832 clip of 81 frames is 21 x 60 x 104 latents with
Wan2.1's VAE). With a VAE (``--vae``: an AutoencoderKLWan folder or a pipeline holding vae/; else the one of
``--encoders``) ``--out`` is an animated GIF (``x.gif``) or an MP4 (``x.mp4``: H.264, or MPEG-4 where PyAV's FFmpeg
has no H.264 encoder) of the decoded frames, one per clip; ``--out x.pt`` gets the latents
[B, C, F, H, W]. Every mistake is one line and exit status 2, before the model loads.

Wan2.2 A14B's pair: ``--model`` at an A14B pipeline folder (model_index.json's boundary_ratio, transformer/ and
transformer_2/) samples with both experts as WanPipeline switches them (``--guidance-scale-2`` for the low-noise
one; default ``--guidance-scale``); or name the low-noise expert with ``--low-noise-model`` (a run, checkpoint or
transformer folder) and the switch with ``--boundary-ratio``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from titan_mm.checkpoint_io import CheckpointError
from titan_mm.config import ConfigError
from titan_mm.loader import load_model
from titan_mm.models.hf_io import component_dir
from titan_mm.models.wan import WanModel
from titan_mm.models.wan.config import pipeline_dir
from titan_mm.models.wan.data import TEXT_LEN, load_encoders
from titan_mm.models.wan.sample import check_sampling, decode, sample, write_gif, write_mp4


# --out's suffix -> the writer of the decoded frames
WRITERS = {".gif": write_gif, ".mp4": write_mp4}


def _states(path: str, flag: str) -> torch.Tensor:
    """[B, L, D] fp32 text states from a torch file; one ValueError line otherwise."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file; save the prompt's UMT5 states with torch.save")
    try:
        x = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  torch's weights-only unpickler raises any type on a file of other bytes
        raise ValueError(f"{flag} {path} is not a torch tensor file ({type(e).__name__}); write it with "
                         "torch.save(tensor, path)") from None
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or not x.is_floating_point():
        what = f"a {x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{flag} {path} holds {what}; it must be float text states [L, text_dim] or [B, L, text_dim]")
    return (x[None] if x.dim() == 2 else x).float()


def _vae_dir(path: str) -> str:
    """The AutoencoderKLWan folder: ``path`` or its pipeline's vae/."""
    folder = component_dir(path, "vae")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"--vae {path}: no config.json there nor in its vae/; give a diffusers AutoencoderKLWan "
                         "folder or a Wan pipeline folder")
    return folder


def _padded(states: torch.Tensor) -> torch.Tensor:
    """[1, TEXT_LEN, D]: a prompt's states zero-padded as WanPipeline pads them (and the data pipeline)."""
    return torch.cat([states, states.new_zeros(TEXT_LEN - len(states), states.shape[-1])])[None]


def check_args(a: argparse.Namespace) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every cheap check, before the model loads: (text states, negative states or None) of --text-states, or
    (None, None) with --prompt (encoded once the model is known)."""
    check_sampling(a.steps, a.shift, a.guidance_scale)
    if min(a.latent_frames, a.latent_height, a.latent_width) < 1:
        raise ValueError("--latent-frames / --latent-height / --latent-width must be >= 1 (latent sizes)")
    if (a.prompt is None) == (a.text_states is None):
        raise ValueError("give the prompt as --prompt TEXT (with --encoders) or as --text-states FILE, one of them")
    if a.prompt is None and (a.negative_prompt is not None or a.encoders):
        raise ValueError("--negative-prompt / --encoders go with --prompt; with --text-states use --negative-states")
    if a.prompt is not None and a.negative_states:
        raise ValueError("--negative-states goes with --text-states; with --prompt use --negative-prompt")
    if a.prompt is not None and not a.encoders:
        raise ValueError("--prompt needs --encoders: a diffusers Wan pipeline folder (tokenizer/, text_encoder/, vae/)")
    suffix = Path(a.out).suffix.lower()
    if suffix not in (*WRITERS, ".pt"):
        raise ValueError(f"--out {a.out}: name a GIF or an MP4 (*.gif, *.mp4: the decoded frames) or a torch file "
                         "(*.pt, the latents)")
    if suffix in WRITERS and not (a.vae or a.encoders):
        raise ValueError(f"--out {a.out}: decoding a {suffix[1:].upper()} needs a VAE: pass --vae (or --encoders), "
                         "or name it *.pt for the latents")
    if suffix == ".pt" and a.vae:
        raise ValueError(f"--out {a.out}: --vae decodes frames into a GIF or an MP4; name it *.gif or *.mp4, or drop "
                         "--vae")
    if a.boundary_ratio is not None and not a.low_noise_model:
        raise ValueError("--boundary-ratio switches to --low-noise-model: give both (an A14B pipeline folder as "
                         "--model brings its own)")
    if a.low_noise_model and a.boundary_ratio is None and pipeline_dir(a.model) is None:
        raise ValueError("--low-noise-model needs the switch: pass --boundary-ratio (Wan2.2-T2V-A14B's is 0.875)")
    if a.fps < 1:
        raise ValueError(f"--fps {a.fps} must be >= 1")
    if a.vae:
        _vae_dir(a.vae)
    if a.prompt is not None:
        missing = [f"{s}/" for s in ("tokenizer", "text_encoder", "vae")
                   if not os.path.isdir(os.path.join(a.encoders, s))]
        if missing:
            raise ValueError(f"--encoders {a.encoders} has no {', '.join(missing)}; give a diffusers Wan pipeline "
                             "folder (tokenizer/, text_encoder/, vae/)")
        return None, None
    text = _states(a.text_states, "--text-states")
    neg = _states(a.negative_states, "--negative-states") if a.negative_states else None
    if neg is not None and (neg.shape[0] not in (1, text.shape[0]) or neg.shape[-1] != text.shape[-1]):
        raise ValueError(f"--negative-states of shape {list(neg.shape)} does not fit the text states "
                         f"{list(text.shape)}: same text_dim, and 1 or {text.shape[0]} rows")
    return text, neg


def _low_noise_expert(a: argparse.Namespace, cfg) -> tuple[WanModel | None, float | None]:
    """(A14B's low-noise expert, the boundary ratio): --low-noise-model, or the transformer_2/ of --model's A14B
    pipeline folder; (None, None) for one transformer."""
    ratio = cfg.boundary_ratio if a.boundary_ratio is None else a.boundary_ratio
    pipe = pipeline_dir(a.model)
    path = a.low_noise_model or (os.path.join(pipe, "transformer_2") if pipe and ratio is not None else None)
    if path is None:
        if a.guidance_scale_2 is not None:
            raise ValueError("--guidance-scale-2 guides A14B's low-noise expert; --model is one transformer (give "
                             "an A14B pipeline folder or --low-noise-model)")
        return None, None
    if ratio is None:
        raise ValueError(f"--model {a.model}'s pipeline names no boundary_ratio: pass --boundary-ratio")
    low = load_model(path, a.device)
    if not isinstance(low.model, WanModel) or low.model_cfg.patch_size != cfg.patch_size or \
            low.model_cfg.in_channels != cfg.in_channels:
        raise ValueError(f"the low-noise expert {path} is not a Wan model of --model's patch and channels")
    return low.model, ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.tools.wan_sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="run / checkpoint folder, or a diffusers transformer folder")
    ap.add_argument("--prompt", default=None, help="the prompt's text (with --encoders)")
    ap.add_argument("--negative-prompt", default=None, help="the negative prompt's text (default \"\", WanPipeline's)")
    ap.add_argument("--encoders", default=None, help="diffusers Wan pipeline folder: tokenizer/, text_encoder/, vae/")
    ap.add_argument("--text-states", default=None, help="torch file: the prompt's states [L, D] or [B, L, D]")
    ap.add_argument("--negative-states", default=None, help="torch file: the negative prompt's states (default zeros)")
    ap.add_argument("--latent-frames", type=int, default=3)
    ap.add_argument("--latent-height", type=int, default=8)
    ap.add_argument("--latent-width", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50, help="Euler steps")
    ap.add_argument("--shift", type=float, default=5.0, help="timestep shift of the sigmas (diffusers' scheduler)")
    ap.add_argument("--guidance-scale", type=float, default=5.0, help="classifier-free guidance; <= 1: off")
    ap.add_argument("--guidance-scale-2", type=float, default=None, help="A14B: the low-noise expert's guidance "
                    "(default --guidance-scale)")
    ap.add_argument("--low-noise-model", default=None, help="A14B: the low-noise expert (run, checkpoint or "
                    "transformer folder); an A14B pipeline folder as --model brings its transformer_2/")
    ap.add_argument("--boundary-ratio", type=float, default=None, help="A14B: the switch (default: --model's "
                    "pipeline's model_index.json)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial noise (a CPU generator)")
    ap.add_argument("--vae", default=None, help="diffusers AutoencoderKLWan folder (or a pipeline with vae/)")
    ap.add_argument("--fps", type=int, default=16, help="frames per second of the GIF / MP4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, help="clip.gif or clip.mp4 (decoded through a VAE) or latents.pt")
    a = ap.parse_args(argv)
    try:
        text, neg = check_args(a)
        got = load_model(a.model, a.device)
        if not isinstance(got.model, WanModel):
            raise ValueError(f"--model {a.model} holds a {got.spec.name!r} model; this tool samples Wan models")
        cfg = got.model_cfg
        low, ratio = _low_noise_expert(a, cfg)
        fhw = (a.latent_frames, a.latent_height, a.latent_width)
        if any(n % p for n, p in zip(fhw, cfg.patch_size)):
            raise ValueError(f"latent sizes {fhw} (frames, height, width) must be multiples of the model's patch "
                             f"{tuple(cfg.patch_size)}")
        enc = load_encoders(cfg, a.encoders, a.device) if a.prompt is not None else None
        if enc is not None:
            text, neg = _padded(enc.text(a.prompt)), _padded(enc.text(a.negative_prompt or ""))
        if text.shape[-1] != cfg.text_dim:
            raise ValueError(f"the prompt's states (--{'encoders' if enc else 'text-states'}) have text_dim "
                             f"{text.shape[-1]}; the model's text_dim is {cfg.text_dim}")
        vae = None
        if a.vae:
            # the optional extra [diffusers]: only the decode needs it
            from diffusers import AutoencoderKLWan

            vae = AutoencoderKLWan.from_pretrained(_vae_dir(a.vae)).to(a.device).eval()
        elif Path(a.out).suffix.lower() in WRITERS:
            vae = enc.vae
        if vae is not None and vae.config.z_dim != cfg.in_channels:
            raise ValueError(f"the VAE has {vae.config.z_dim} latent channels, the model {cfg.in_channels}; use the "
                             "VAE of the model's pipeline")
    except (ValueError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(a.seed)
    noise = torch.randn((text.shape[0], cfg.in_channels, *fhw), generator=g).to(a.device)
    dev = torch.device(a.device)
    latents = sample(got.model, text.to(dev), noise, steps=a.steps, shift=a.shift, guidance_scale=a.guidance_scale,
                     negative_states=None if neg is None else neg.to(dev),
                     attn_backend=cfg.attn_backend, low_noise_model=low, boundary_ratio=ratio,
                     guidance_scale_2=a.guidance_scale_2)
    if vae is None:
        torch.save(latents.cpu(), a.out)
    else:
        frames = decode(latents, vae)
        out = Path(a.out)
        outs = [a.out] if len(frames) == 1 else [f"{out.with_suffix('')}_{i}{out.suffix}" for i in range(len(frames))]
        for f, path in zip(frames, outs):
            WRITERS[out.suffix.lower()](f, path, a.fps)
        a.out = ", ".join(outs)
    print(f"[titan_mm] sampled {text.shape[0]} clip(s) of {fhw} latents in {a.steps} steps -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
