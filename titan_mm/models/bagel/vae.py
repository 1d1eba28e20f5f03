"""The FLUX autoencoder as BAGEL uses it (ByteDance-Seed/Bagel modeling/autoencoder.py): a diffusers
``AutoencoderKL`` with FLUX's config (16 latent channels, 8x down, no quant convs), frozen, and BAGEL's latent
normalization: ``encode`` gives ``scaling_factor x (z - shift_factor)``, ``decode`` takes ``z / scaling_factor +
shift_factor`` (FLUX's 0.3611 / 0.1159, read from the VAE's config). Pixels are in [-1, 1] (BAGEL's transform:
ToTensor, then Normalize(0.5, 0.5)).

One difference: BAGEL's ``DiagonalGaussian`` samples the posterior while training; ``encode`` here takes its mode, so
that the data pipeline's latents are a function of the image alone (exact resume, cacheable). The sampler's decode is
the reference's. The weights come from a diffusers folder or from BFL's original ``ae.safetensors`` (:func:`load_ae`).

``PixelCodec`` stands in the VAE's place where no trained autoencoder exists (the digits debug task: a random VAE
gives no usable latent space): the latents are the pixels themselves, average-pooled. ``CachedCodec`` reads the
latents a codec wrote once (a latent cache: ``python -m titan_mm.tools.cache``), found by the image's own bytes.
``load_codec`` picks one by name: ``"pixels"``, a latent cache folder, or a VAE (:func:`load_vae`; ``data.encoders``
in a training config).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from titan_mm.data.clips import read_index
from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.hf_io import component_dir


def latent_stride(cfg: BagelConfig) -> int:
    """Pixels per latent patch along a side (the codec's downsampling x the latent patch): an image's sides must be
    multiples of it."""
    return cfg.vae_config.downsample * cfg.latent_patch_size


def check_vae_shape(latent_channels: int, levels: int, cfg: BagelConfig) -> None:
    """A VAE of ``latent_channels`` and ``levels`` resolution levels (2 ** (levels - 1) x down) against the model's
    ``vae_config`` (one ValueError line)."""
    want, down = cfg.vae_config, 2 ** (levels - 1)
    if latent_channels != want.z_channels or down != want.downsample:
        raise ValueError(f"the VAE has {latent_channels} latent channels and {down}x downsampling; the model's "
                         f"vae_config wants {want.z_channels} and {want.downsample}x: give the VAE the model was "
                         "trained with (FLUX's: 16 channels, 8x)")


class FluxVAE:
    """A frozen diffusers ``AutoencoderKL`` checked against the model's ``vae_config`` (channels, downsampling)."""

    def __init__(self, vae, cfg: BagelConfig, device: str | torch.device = "cpu"):
        c = vae.config
        check_vae_shape(c.latent_channels, len(c.block_out_channels), cfg)
        self.vae = vae.eval().requires_grad_(False).to(device)
        self.device = torch.device(device)
        self.scale = float(c.scaling_factor)
        self.shift = float(c.shift_factor or 0.0)  # FLUX's config sets it; Stable Diffusion's VAEs have none
        self.stride = latent_stride(cfg)

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
        self.stride = latent_stride(cfg)
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


CACHE_FORMAT = "titan_mm.bagel_latents/1"
CACHE_INDEX = "latents.json"
"""A latent cache's index: the format, the latent shape (z_channels, downsample), the codec that wrote it, and per
shard file the image keys it holds (:func:`image_key`)."""


def image_key(image_CHW: torch.Tensor) -> str:
    """A latent cache's key of an image in [-1, 1]: its shape and the SHA-1 of its fp32 bytes."""
    x = image_CHW.detach().float().cpu().contiguous()
    return "x".join(map(str, x.shape)) + "-" + hashlib.sha1(x.numpy().tobytes()).hexdigest()


def is_latent_cache(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CACHE_INDEX))


class CachedCodec:
    """The latents of a latent cache folder in a codec's place (its ``encode``; no ``decode``): each image's latent
    read by :func:`image_key`; the cache's latent shape is checked against the model's ``vae_config`` (one line)."""

    def __init__(self, folder: str, cfg: BagelConfig, device: str | torch.device = "cpu"):
        idx, want = read_index(folder, CACHE_INDEX, CACHE_FORMAT), cfg.vae_config
        if (idx.get("z_channels"), idx.get("downsample")) != (want.z_channels, want.downsample):
            raise ValueError(f"latent cache {folder} holds latents of {idx.get('z_channels')} channels at "
                             f"{idx.get('downsample')}x; the model's vae_config wants {want.z_channels} at "
                             f"{want.downsample}x: cache with the model's VAE")
        self.folder, self.device = folder, torch.device(device)
        self.where = {k: name for name, keys in idx["shards"].items() for k in keys}
        self.stride = latent_stride(cfg)
        self._open: dict[str, object] = {}

    def encode(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """Latents [B, z, H / down, W / down] fp32 of the images, as the cache's codec encoded them."""
        out = []
        for x in images_BCHW:
            k = image_key(x)
            if k not in self.where:
                raise ValueError(f"an image of {x.shape[1]}x{x.shape[2]} px is not in the latent cache {self.folder}; "
                                 "the data or its sizes changed since: rebuild it with python -m titan_mm.tools.cache")
            name = self.where[k]
            if name not in self._open:
                self._open[name] = safe_open(os.path.join(self.folder, name), framework="pt")
            out.append(self._open[name].get_tensor(k))
        return torch.stack(out)


AE_FILE = "ae.safetensors"
"""BFL's original autoencoder file (FLUX.1's; BAGEL-7B-MoT's release holds one), in BFL's key layout."""

FLUX_AE = {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
           "layers_per_block": 2, "act_fn": "silu", "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024,
           "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
           "force_upcast": True, "mid_block_add_attention": True}
"""FLUX.1's AutoencoderKL config (FLUX.1-dev's vae/config.json): BAGEL's ``load_ae`` params (ch 128, ch_mult
1, 2, 4, 4, 2 res blocks, z 16, scale 0.3611, shift 0.1159) in diffusers' terms."""


def vae_source(path: str | os.PathLike) -> str:
    """What ``path`` names: an ``ae.safetensors`` file (given, or in a BAGEL folder), else a diffusers AutoencoderKL
    folder (``path`` or its pipeline's vae/); one ValueError line when it is neither."""
    path = str(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return path
    if os.path.isfile(os.path.join(path, AE_FILE)):
        return os.path.join(path, AE_FILE)
    folder = component_dir(path, "vae")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"VAE {path}: no {AE_FILE}, no config.json there nor in its vae/; give BFL's {AE_FILE} (or a "
                         "BAGEL folder holding it) or a diffusers AutoencoderKL folder, e.g. FLUX.1-dev's vae/")
    return folder


def load_ae(path: str | os.PathLike, cfg: BagelConfig, device: str | torch.device = "cpu",
            config: dict | None = None) -> FluxVAE:
    """BFL's ``ae.safetensors`` in the AutoencoderKL of ``config`` (default :data:`FLUX_AE`), through diffusers'
    own single-file converter (``convert_ldm_vae_checkpoint``, what ``AutoencoderKL.from_single_file`` runs; no
    download); every tensor checked by name and shape first (one ValueError line)."""
    # diffusers is an optional dependency (the diffusers extra): only encoding and decoding images need it
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    config = FLUX_AE if config is None else config
    vae = AutoencoderKL(**config)
    want = vae.state_dict()
    got = convert_ldm_vae_checkpoint(load_file(str(path)), config)
    missing = sorted(set(want) - set(got))
    wrong = sorted(k for k in set(want) & set(got) if got[k].shape != want[k].shape)
    if missing or wrong:
        first = (f"{missing[0]} missing" if missing else
                 f"{wrong[0]} is {list(got[wrong[0]].shape)}, not {list(want[wrong[0]].shape)}")
        raise ValueError(f"{path} does not hold the autoencoder {config['block_out_channels']} x "
                         f"{config['latent_channels']} in BFL's layout: {len(missing)} tensors missing, {len(wrong)} "
                         f"of another shape ({first}); give FLUX.1's {AE_FILE}")
    vae.load_state_dict({k: got[k].float() for k in want})
    return FluxVAE(vae, cfg, device)


def load_vae(path: str | os.PathLike, cfg: BagelConfig, device: str | torch.device = "cpu") -> FluxVAE:
    """The FLUX VAE at ``path`` (:func:`vae_source`): BFL's ``ae.safetensors``, or a diffusers AutoencoderKL folder
    (a FLUX pipeline's vae/, or the pipeline folder holding it)."""
    src = vae_source(path)
    if os.path.isfile(src):
        return load_ae(src, cfg, device)
    # diffusers is an optional dependency (the diffusers extra): only encoding and decoding images need it
    from diffusers import AutoencoderKL

    return FluxVAE(AutoencoderKL.from_pretrained(src, torch_dtype=torch.float32), cfg, device)


def check_codec(name: str, cfg: BagelConfig) -> None:
    """:func:`load_codec`'s checks of ``name`` without loading a VAE's weights (one ValueError line): a diffusers
    folder's config.json, or an ``ae.safetensors`` header's latent convolution, against ``vae_config``."""
    if name == PIXELS:
        PixelCodec(cfg)
    elif is_latent_cache(name):
        CachedCodec(name, cfg)
    elif os.path.isfile(src := vae_source(name)):
        key = "encoder.conv_out.weight"  # BFL's layout: [2 x latent channels (mean, log-variance), C, 3, 3]
        try:
            with safe_open(src, framework="pt") as f:
                shape = f.get_slice(key).get_shape() if key in f.keys() else None
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{src} is no safetensors file ({e}); give FLUX.1's {AE_FILE}") from None
        if shape is None:
            raise ValueError(f"{src} has no {key}: not an autoencoder in BFL's layout; give FLUX.1's {AE_FILE}")
        check_vae_shape(shape[0] // 2, len(FLUX_AE["block_out_channels"]), cfg)
    else:
        try:
            with open(os.path.join(src, "config.json")) as f:
                c = json.load(f)
            check_vae_shape(int(c["latent_channels"]), len(c["block_out_channels"]), cfg)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{src}/config.json is no AutoencoderKL config ({type(e).__name__}: {e}); give a "
                             "diffusers AutoencoderKL folder") from None


def load_codec(name: str, cfg: BagelConfig, device: str | torch.device = "cpu") -> FluxVAE | PixelCodec | CachedCodec:
    """The image codec ``name`` selects: ``"pixels"`` (PixelCodec), a latent cache folder (CachedCodec), else the VAE
    :func:`load_vae` reads (FluxVAE)."""
    if name == PIXELS:
        return PixelCodec(cfg, device)
    return CachedCodec(name, cfg, device) if is_latent_cache(name) else load_vae(name, cfg, device)
