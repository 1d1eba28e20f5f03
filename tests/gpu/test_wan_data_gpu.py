"""Wan's data path on CUDA: the cache tool with --device cuda writes the latents and text states that the frozen
UMT5 and AutoencoderKLWan give on the CPU (fp32 both sides, TF32 off)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")  # the optional extra [diffusers]

from titan_mm.config import load_config  # noqa: E402
from titan_mm.data.clips import CacheSource, RawSource  # noqa: E402
from titan_mm.models.wan.data import load_encoders  # noqa: E402
from titan_mm.models.wan.toy import save_random_encoders, write_clip_rows  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.tools.cache import main as cache  # noqa: E402

pytestmark = pytest.mark.gpu
DATA = ["--config", "debug_wan_data", "--data.video_fps", "0", "--data.video_min_frames", "1",
        "--data.video_max_frames", "9", "--data.video_max_pixels", "20000"]


def test_cache_on_cuda_equals_cpu_encoding(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # its default is on for convolutions
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    pipe = str(tmp_path / "pipe")
    save_random_encoders(pipe, text_dim=16, z_dim=4)
    rows = write_clip_rows(str(tmp_path), 4, 9, ((16, 24), (24, 16)))
    flags = [*DATA, "--data.dataset", rows, "--data.encoders", pipe]
    cache([*flags, "--out", str(tmp_path / "cache"), "--device", "cuda"])
    cuda = CacheSource(str(tmp_path / "cache"))
    cpu = RawSource(load_config(flags).data, load_encoders(get_model_spec("wan").flavor("debug"), pipe))
    assert [r.sid for r in cuda.rows] == [r.sid for r in cpu.rows]
    for a, b in zip(cuda.rows, cpu.rows):
        (lat, text), (want_lat, want_text) = cuda.load(a), cpu.load(b)
        # fp32 on both; cuDNN's convolutions and cuBLAS sum in other orders than the CPU's: ~1e-6 relative per
        # layer, over the VAE's ~20 layers and UMT5's 2
        torch.testing.assert_close(lat, want_lat, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(text, want_text, atol=1e-5, rtol=1e-5)
