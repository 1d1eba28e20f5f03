"""BAGEL's data as a trainer source (issue 47, items 3 and 5): the pixel codec, fp32 on CPU."""

import dataclasses

import pytest
import torch

from titan_mm.models.bagel.config import FLAVORS, BagelVAEConfig
from titan_mm.models.bagel.vae import PixelCodec, load_codec

DEBUG = FLAVORS["debug"]


def pixel_cfg(z: int = 1, down: int = 2):
    return dataclasses.replace(DEBUG, vae_config=BagelVAEConfig(z_channels=z, downsample=down))


def test_pixel_codec_is_average_pooling_and_repetition():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 8, 12, generator=g) * 2 - 1
    rgb = load_codec("pixels", pixel_cfg(3, 2))
    z = rgb.encode(x)
    blocks = x.reshape(2, 3, 4, 2, 6, 2).permute(0, 1, 2, 4, 3, 5).reshape(2, 3, 4, 6, 4)
    torch.testing.assert_close(z, blocks.mean(-1), rtol=0, atol=2 * torch.finfo(torch.float32).eps)
    assert rgb.stride == 2 * DEBUG.latent_patch_size
    up = rgb.decode(z)  # each latent pixel over its 2 x 2 block, to [0, 1]
    assert up.shape == (2, 3, 8, 12) and torch.equal(up[..., ::2, ::2], (z * 0.5 + 0.5).clamp(0, 1))
    assert torch.equal(up[..., 1::2, 1::2], up[..., ::2, ::2])
    gray = PixelCodec(pixel_cfg(1, 1))  # no pooling: the pixels themselves, decoded to [0, 1] on R, G and B
    one = x[:, :1]
    assert torch.equal(gray.encode(one), one)
    assert torch.equal(gray.decode(gray.encode(one)), (one * 0.5 + 0.5).expand(2, 3, 8, 12))
    torch.testing.assert_close(gray.encode(x), x.mean(1, keepdim=True), rtol=0, atol=0)


def test_pixel_codec_mistakes_are_one_line():
    with pytest.raises(ValueError, match="z_channels 1 .grayscale. or 3") as e:
        PixelCodec(pixel_cfg(4, 2))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="multiples of 2"):
        PixelCodec(pixel_cfg(1, 2)).encode(torch.zeros(1, 1, 5, 4))
