"""The MP4 writer of Wan's sampler (titan_mm.models.wan.sample.write_mp4), read back through PyAV."""

import av
import numpy as np
import pytest
import torch

from titan_mm.models.wan import sample as wan_sample
from titan_mm.models.wan.sample import write_mp4


def _clip(frames: int, height: int, width: int) -> torch.Tensor:
    """Smooth frames in [0, 1] (gradients over rows and columns, a blue level that changes per frame): what a
    decoded clip looks like to a codec, and frame order is visible in every pixel."""
    y = torch.linspace(0, 1, height).view(1, height, 1, 1).expand(frames, height, width, 1)
    x = torch.linspace(0, 1, width).view(1, 1, width, 1).expand(frames, height, width, 1)
    t = torch.linspace(0.2, 0.8, frames).view(frames, 1, 1, 1).expand(frames, height, width, 1)
    return torch.cat([y, x, t], dim=-1)


def _read(path) -> tuple[list[np.ndarray], str, float]:
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)], s.codec_context.name, float(s.average_rate)


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_mp4_holds_the_frames_as_sampled(codec, tmp_path, monkeypatch):
    """Every sampled frame is one video frame, in order, at the asked rate, each within the codec's loss of the
    8-bit frame: YUV 4:2:0 at near-transparent quality moves smooth frames by a few levels of 255 on average."""
    if codec not in av.codecs_available:
        pytest.skip(f"PyAV's FFmpeg has no {codec} encoder")
    monkeypatch.setattr(wan_sample, "MP4_CODECS", (codec,))
    frames = _clip(7, 32, 48)
    assert write_mp4(frames, tmp_path / "clip.mp4", fps=12) == codec
    got, name, rate = _read(tmp_path / "clip.mp4")
    assert (len(got), got[0].shape, rate) == (7, (32, 48, 3), 12.0)
    assert name == ("h264" if codec == "libx264" else "mpeg4")
    want = (frames * 255).round().to(torch.uint8).numpy().astype(int)
    err = np.abs(np.stack(got).astype(int) - want)
    assert err.mean() < 4, err.mean()
    # the blue level steps 25 levels a frame: each read frame is nearest its own source frame
    blue = np.stack(got)[..., 2].mean(axis=(1, 2))
    assert np.argmin(np.abs(blue[:, None] - want[..., 2].mean(axis=(1, 2))[None, :]), axis=1).tolist() == list(range(7))


def test_odd_sides_repeat_the_last_row_and_column(tmp_path):
    """4:2:0 needs even sides: a 31 x 47 clip is written 32 x 48, the extra row / column a copy of the last (the
    gradients as smooth as the even clip's, so the same loss bound holds)."""
    frames = _clip(3, 31, 47)
    write_mp4(frames, tmp_path / "odd.mp4", fps=8)
    got, _, _ = _read(tmp_path / "odd.mp4")
    assert (len(got), got[0].shape) == (3, (32, 48, 3))
    assert np.abs(np.stack(got)[:, :31, :47].astype(int) - (frames * 255).round().numpy()).mean() < 4


def test_no_encoder_is_one_line(monkeypatch):
    monkeypatch.setattr(wan_sample, "MP4_CODECS", ("no_such_codec",))
    with pytest.raises(RuntimeError, match=r"encodes none of \('no_such_codec',\); write a GIF instead"):
        wan_sample.mp4_codec()
