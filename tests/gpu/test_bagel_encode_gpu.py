"""BAGEL's VAE encoding on CUDA in the trainer's process (bagel.data.BagelEncoder, DocLayout.encoder): the loader
given encode_device "cuda" keeps the VAE on the card and gives the CPU worker path's batches, every key equal but
the latents, which the card's convolutions sum in other orders (fp32 both sides, TF32 off); images of one size go in
together. The latent cache written with the VAE on the card reads back to the same batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("diffusers")  # the optional extra [diffusers]

from tests.unit.test_bagel_data import TOK, loader  # noqa: E402
from tests.unit.test_bagel_encode import vae_rows  # noqa: E402
from titan_mm.models.bagel.data import write_latent_cache  # noqa: E402

pytestmark = pytest.mark.gpu
LATENT_KEYS = ("latents", "cond_latents")


def test_device_encoding_on_cuda_equals_the_cpu_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # its default is on for convolutions
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg, d = vae_rows(tmp_path, [(16, 16), (16, 16), (8, 16), (16, 16)], edit=(2, 0))  # three of one size
    want = [b for _, b in zip(range(4), loader(d, cfg))]
    cuda = loader(d, cfg, encode_device="cuda")
    assert next(cuda.encode.codec.vae.parameters()).device.type == "cuda"
    got = [b for _, b in zip(range(4), cuda)]
    for a, b in zip(got, want, strict=True):
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a if k not in LATENT_KEYS)
        # cuDNN's convolutions sum in other orders than the CPU's: ~1e-6 relative per layer over the tiny VAE's ~10
        for k in LATENT_KEYS:
            assert a[k].device.type == "cpu"  # back on the host, where the step reads the batch
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)


def test_latent_cache_written_on_cuda_equals_the_cpu_workers(tmp_path, monkeypatch):
    """The cache tool's writer with the VAE on the card: read back (data.encoders names the cache), the CPU worker
    path's batches, the latents within the same reordered sums."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg, d = vae_rows(tmp_path, [(16, 16), (16, 16), (8, 16), (16, 16)], edit=(2, 0))
    assert write_latent_cache(cfg, d, TOK, 0, str(tmp_path / "cache"), device="cuda")["images"] == 4
    want = [b for _, b in zip(range(4), loader(d, cfg))]
    got = [b for _, b in zip(range(4), loader(dataclasses.replace(d, encoders=str(tmp_path / "cache")), cfg,
                                              encode_device="cuda"))]
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a if k not in LATENT_KEYS)
        for k in LATENT_KEYS:
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)
