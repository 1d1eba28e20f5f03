"""The FLUX autoencoder as BAGEL uses it (ByteDance-Seed/Bagel modeling/autoencoder.py): a diffusers
``AutoencoderKL`` with FLUX's config (16 latent channels, 8x down, no quant convs), frozen, and BAGEL's latent
normalization: ``encode`` gives ``scaling_factor x (z - shift_factor)``, ``decode`` takes ``z / scaling_factor +
shift_factor`` (FLUX's 0.3611 / 0.1159, read from the VAE's config). Pixels are in [-1, 1] (BAGEL's transform:
ToTensor, then Normalize(0.5, 0.5)).

One difference: BAGEL's ``DiagonalGaussian`` samples the posterior while training; ``encode`` here takes its mode, so
that the data pipeline's latents are a function of the image alone (exact resume, cacheable). The sampler's decode is
the reference's.
"""

from __future__ import annotations

import os

import torch

from titan_mm.models.bagel.config import BagelConfig


class FluxVAE:
    """A frozen diffusers ``AutoencoderKL`` checked against the model's ``vae_config`` (channels, downsampling)."""

    def __init__(self, vae, cfg: BagelConfig, device: str | torch.device = "cpu"):
        c, want = vae.config, cfg.vae_config
        down = 2 ** (len(c.block_out_channels) - 1)
        if c.latent_channels != want.z_channels or down != want.downsample:
            raise ValueError(f"the VAE has {c.latent_channels} latent channels and {down}x downsampling; the model's "
                             f"vae_config wants {want.z_channels} and {want.downsample}x: give the VAE the model was "
                             "trained with (FLUX's: 16 channels, 8x)")
        self.vae = vae.eval().requires_grad_(False).to(device)
        self.device = torch.device(device)
        self.scale = float(c.scaling_factor)
        self.shift = float(c.shift_factor or 0.0)  # FLUX's config sets it; Stable Diffusion's VAEs have none
        self.stride = down * cfg.latent_patch_size
        """Pixels per latent patch along a side: an image's sides must be multiples of it."""

    @torch.no_grad()
    def encode(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """Latents [B, z, H/8, W/8] fp32 of images in [-1, 1]: the posterior's mode, normalized as BAGEL's."""
        z = self.vae.encode(images_BCHW.to(self.device, self.vae.dtype)).latent_dist.mode()
        return (self.scale * (z - self.shift)).float().cpu()

    @torch.no_grad()
    def decode(self, latents_BCHW: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] (BAGEL's ``decode_image``: x / 2 + 0.5, clamped)."""
        z = latents_BCHW.to(self.device, self.vae.dtype) / self.scale + self.shift
        return (self.vae.decode(z).sample.float() * 0.5 + 0.5).clamp(0, 1).cpu()


def vae_dir(folder: str | os.PathLike) -> str:
    """The AutoencoderKL folder: ``folder`` or its pipeline's vae/; one ValueError line when neither holds one."""
    sub = os.path.join(folder, "vae")
    path = sub if os.path.isfile(os.path.join(sub, "config.json")) else str(folder)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"VAE folder {folder}: no config.json there nor in {sub}; give a diffusers AutoencoderKL "
                         "folder, e.g. black-forest-labs/FLUX.1-dev's vae/")
    return path


def load_vae(folder: str | os.PathLike, cfg: BagelConfig, device: str | torch.device = "cpu") -> FluxVAE:
    """The ``AutoencoderKL`` of a diffusers folder (a FLUX pipeline's vae/, or the pipeline folder holding it)."""
    # diffusers is an optional dependency (the diffusers extra): only encoding and decoding images need it
    from diffusers import AutoencoderKL

    return FluxVAE(AutoencoderKL.from_pretrained(vae_dir(folder), torch_dtype=torch.float32), cfg, device)
