"""The FLUX autoencoder as BAGEL uses it (ByteDance-Seed/Bagel modeling/autoencoder.py): a diffusers
``AutoencoderKL`` with FLUX's config (16 latent channels, 8x down, no quant convs), frozen, and BAGEL's latent
normalization: ``encode`` gives ``scaling_factor x (z - shift_factor)``, ``decode`` takes ``z / scaling_factor +
shift_factor`` (FLUX's 0.3611 / 0.1159, read from the VAE's config). Pixels are in [-1, 1] (BAGEL's transform:
ToTensor, then Normalize(0.5, 0.5)).

One difference: BAGEL's ``DiagonalGaussian`` samples the posterior while training; ``encode`` here takes its mode, so
that the data pipeline's latents are a function of the image alone (exact resume, cacheable). The sampler's decode is
the reference's.

``PixelCodec`` stands in the VAE's place where no trained autoencoder exists (the digits debug task: a random VAE
gives no usable latent space): the latents are the pixels themselves, average-pooled. ``load_codec`` picks either by
name: ``"pixels"`` or a diffusers VAE folder (``data.encoders`` in a training config).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

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


PIXELS = "pixels"
"""The name that selects :class:`PixelCodec` (``data.encoders = "pixels"``)."""


class PixelCodec:
    """The pixels as latents, FluxVAE's interface: ``vae_config.z_channels`` 1 (grayscale) or 3 (RGB), each latent
    pixel the average of ``vae_config.downsample`` x ``downsample`` pixels (none when 1), values in [-1, 1]."""

    def __init__(self, cfg: BagelConfig, device: str | torch.device = "cpu"):
        want = cfg.vae_config
        if want.z_channels not in (1, 3) or want.downsample < 1:
            raise ValueError(f"data.encoders = {PIXELS!r} makes the latents the pixels: the model's vae_config must "
                             f"have z_channels 1 (grayscale) or 3 (RGB) and downsample >= 1, not "
                             f"{want.z_channels} / {want.downsample}; set them in the flavor's vae_config")
        self.channels, self.down, self.device = want.z_channels, want.downsample, torch.device(device)
        self.stride = want.downsample * cfg.latent_patch_size
        """Pixels per latent patch along a side: an image's sides must be multiples of it."""

    @torch.no_grad()
    def encode(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """Latents [B, z, H / down, W / down] fp32 of images [B, 1 or 3, H, W] in [-1, 1]: RGB to grayscale by the
        channels' mean, grayscale to RGB by repetition, then the average over each down x down block."""
        x = images_BCHW.float()
        B, C, H, W = x.shape
        if C not in (1, 3) or H % self.down or W % self.down:
            raise ValueError(f"images {tuple(x.shape)}: the pixel codec takes [B, 1 or 3, H, W] with H and W "
                             f"multiples of {self.down} (vae_config.downsample)")
        if C != self.channels:
            x = x.mean(1, keepdim=True) if self.channels == 1 else x.expand(B, 3, H, W)
        return F.avg_pool2d(x, self.down) if self.down > 1 else x.clone()

    @torch.no_grad()
    def decode(self, latents_BCHW: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] (x / 2 + 0.5, clamped, as FluxVAE): each latent pixel repeated over its
        down x down block, a grayscale channel over R, G and B."""
        x = latents_BCHW.float().cpu()
        x = x.repeat_interleave(self.down, 2).repeat_interleave(self.down, 3)
        return (x * 0.5 + 0.5).clamp(0, 1).expand(-1, 3, -1, -1).contiguous()


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


def load_codec(name: str, cfg: BagelConfig, device: str | torch.device = "cpu") -> FluxVAE | PixelCodec:
    """The image codec ``name`` selects: ``"pixels"`` (PixelCodec), else a diffusers AutoencoderKL folder (FluxVAE)."""
    return PixelCodec(cfg, device) if name == PIXELS else load_vae(name, cfg, device)
