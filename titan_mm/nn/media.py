"""Media layouts: how a family's HF processor turns images, video and audio into tokens (the values a family's
:class:`~titan_mm.registry.DataNeeds` holds; titan_mm.data.vision / titan_mm.data.audio follow them and name no
family), and the M-RoPE / time-order position rules that the data pipeline and the families' models share.

A layout is plain parameters chosen by the family; each choice is named by what it does:

- frames: ``"linspace"`` (n = seconds x data.video_fps clamped to [min_frames, max_frames], picked by linspace) or
  ``"strided"`` (a multiple of the temporal patch, frame int(k * total / n), as Qwen2VLVideoProcessor samples).
- pixel_bounds: ``"clip"`` (the clip's frames x pixels within the video pixel bounds) or ``"frame"`` (each frame's).
- video_time: ``"frame_groups"`` (each temporal patch is its own ``<t seconds><vision_start>pads<vision_end>`` group
  and its own M-RoPE run at t 0, t the mean time of its frames) or one run of pads per video, temporal patch k at
  t = int(k * second_per_grid * video_tokens_per_second), with second_per_grid = temporal patch / the ``"sampled_fps"``
  or the ``"requested_fps"`` (data.video_fps).
- audio_in_video: ``""`` (a video part's use_audio_in_video is skipped), ``"chunks"`` (per seconds_per_chunk the
  video's pads then the audio's) or ``"by_time"`` (the two merged by time, video first on ties: :func:`merge_by_time`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

FRAMES = ("linspace", "strided")
PIXEL_BOUNDS = ("clip", "frame")
VIDEO_TIME = ("frame_groups", "sampled_fps", "requested_fps")
AUDIO_IN_VIDEO = ("", "chunks", "by_time")


@dataclass(frozen=True)
class VisionLayout:
    """A family's image / video processing (see the module docstring for each choice)."""

    mean: tuple[float, float, float]
    """Per-channel mean of (x / 255 - mean) / std."""
    std: tuple[float, float, float]
    frames: str = "linspace"
    pixel_bounds: str = "clip"
    video_time: str = "frame_groups"
    audio_in_video: str = ""

    def __post_init__(self):
        for name, allowed in (("frames", FRAMES), ("pixel_bounds", PIXEL_BOUNDS), ("video_time", VIDEO_TIME),
                              ("audio_in_video", AUDIO_IN_VIDEO)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"VisionLayout.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @property
    def one_run(self) -> bool:
        """A video is one run of pads timed by second_per_grid (else one group per temporal patch)."""
        return self.video_time != "frame_groups"


@dataclass(frozen=True)
class AudioFrontEnd:
    """A family's audio processing: Whisper log-mel features (titan_mm.data.audio), padded and counted its way."""

    tokens: Callable[[int], int]
    """Placeholder tokens of a clip of ``frames`` mel frames: the length of the family's audio-tower output."""
    max_seconds: int = 0
    """>0: every clip is padded with zeros to and truncated at this many seconds (Whisper's window), with
    ceil(samples / hop) frames kept; 0: no padding or truncation, samples // hop frames."""


class ClipEncoders(Protocol):
    """A family's frozen encoders of captioned video clips (Wan: UMT5 and the VAE), as titan_mm.data.clips and the
    cache tool call them; built by :attr:`ClipLayout.encoders`."""

    frame_step: int
    """A clip has 1 + k x frame_step frames (the VAE's temporal compression)."""
    pixel_multiple: int
    """Frame height and width are multiples of this (the VAE's spatial compression x the patch size)."""

    def text(self, prompt: str) -> Any:
        """The prompt's text states [L, D] float32, L its own length (the loader zero-pads to ClipLayout.text_len)."""

    def video(self, frames_THWC: np.ndarray) -> Any:
        """Normalized latents [C, F, H, W] float32 of uint8 RGB frames already sized by the rules above."""


@dataclass(frozen=True)
class ClipLayout:
    """A family that trains on captioned clips encoded by frozen encoders (titan_mm.data.clips: a cache of their
    latents and text states, or encoding in the data pipeline)."""

    text_len: int
    """Text states per row: a prompt's states, zero-padded to this length (diffusers' max_sequence_length)."""
    batch: Callable[[Any, Any], dict]
    """batch(latents [B, C, F, H, W], text_states [B, text_len, D]) -> the family's micro-batch (its BatchSchema)."""
    encoders: Callable[..., ClipEncoders]
    """encoders(folder, device="cpu") -> the frozen encoders read from ``folder`` (data.encoders), on ``device``."""


@dataclass(frozen=True)
class Bound:
    """``fn`` with a family's config bound as its first argument, equal by value (a functools.partial is equal only
    to itself, and a family's DataNeeds compare equal for equal configs): the callables of the layouts here."""

    fn: Callable
    cfg: Any

    def __call__(self, *args, **kw):
        return self.fn(self.cfg, *args, **kw)


@dataclass(frozen=True)
class DocLayout:
    """A family that builds its documents from the raw records itself (splits of its own kinds: text, encoder
    images, noised latents) in place of the chat / text processors; titan_mm.data.loader reads, mixes, shards,
    packs and resumes them as any other documents."""

    builder: Callable[..., Callable[[Any, Any, str, int], Any]]
    """builder(data, tokenizer, seed, defer=False) -> build(record, unit, sample id, epoch) -> a
    titan_mm.data.packing.Doc (raising titan_mm.data.sources.SkipSample for a record it cannot use); made once per
    loader process, it must give the same doc for the same record every time (the loader rebuilds the packer's open
    rows from records on resume). A mistake in ``data`` is one ValueError line. ``defer=True`` (with ``encoder``):
    the doc leaves its frozen encoder's outputs as placeholders and carries the encoder's inputs instead."""
    collate: Callable[[list, int], dict]
    """collate(rows of Docs, row length) -> the family's micro-batch (its BatchSchema)."""
    encoder: Callable[..., Callable[[dict], dict]] | None = None
    """encoder(data, device) -> encode(batch) -> batch: the family's frozen encoder, built once in the trainer's
    process on ``device``, which fills a deferred batch's placeholders from the inputs the docs carried (the same
    batch the builder's own encoding gives); None: the builder always encodes."""
    cache: Callable[..., dict] | None = None
    """cache(data, tokenizer, seed, out, device, rows_per_shard) -> index: the encoder's outputs for every record of
    ``data``'s sources written once to the folder ``out`` (``python -m titan_mm.tools.cache``), which ``data``'s
    settings then name in its place; None: nothing to cache."""


# ------------------------------------------------------------------------------------------ positions
def mrope_index(kinds_L, image_grids, video_grids, merge: int, second_per_grid=None,
                tokens_per_second: float = 0.0) -> np.ndarray:
    """[3, L] int64 (t, h, w) positions of one document (starting at 0), as get_rope_index.

    ``kinds_L``: per token 0 text, 1 image pad, 2 video pad (HF's mm_token_type_ids); ``image_grids`` /
    ``video_grids``: the (t, h, w) patch grids in document order (arrays, tensors or lists). A run of pad
    tokens is one image, and one video frame group (a video is t runs of (1, h, w), given
    ``second_per_grid=None``) or one video (``second_per_grid`` holds each video's seconds per temporal patch, and
    temporal patch k has t = int(k * tokens_per_second * second_per_grid), in float32 as HF computes it). Text
    advances all three axes by one; a run starting at p gets (p + t, p + row, p + col) over its merged grid, and
    the next token starts at p + max(rows, cols). Raises ValueError when the runs do not match the grids."""
    kinds = np.asarray(kinds_L).reshape(-1)
    L = kinds.shape[0]
    vgrids = np.asarray(video_grids, dtype=np.int64).reshape(-1, 3).tolist()
    if second_per_grid is None:
        videos = [((1, h, w), 0.0) for t, h, w in vgrids for _ in range(t)]
    else:
        secs = np.asarray(second_per_grid, dtype=np.float32).reshape(-1)
        if len(secs) != len(vgrids):
            raise ValueError(f"{len(vgrids)} video grids but {len(secs)} second_per_grid values")
        videos = [(g, np.float32(tokens_per_second) * sec) for g, sec in zip(vgrids, secs)]
    images = [(g, 0.0) for g in np.asarray(image_grids, dtype=np.int64).reshape(-1, 3).tolist()]
    runs = {1: iter(images), 2: iter(videos)}
    pos = np.zeros((3, L), dtype=np.int64)
    cur, i = 0, 0
    while i < L:
        k = int(kinds[i])
        j = i
        while j < L and (kinds[j] == k if k else kinds[j] not in (1, 2)):
            j += 1
        if k in (1, 2):
            try:
                (gt, gh, gw), step = next(runs[k])
            except StopIteration:
                raise ValueError(f"more {('image', 'video')[k - 1]} pad runs than grids") from None
            lt, lh, lw = gt, gh // merge, gw // merge
            if lt * lh * lw != j - i:
                raise ValueError(f"a vision run of {j - i} tokens does not match its grid {(gt, gh, gw)} "
                                 f"(merge {merge})")
            t_pos = (np.arange(lt, dtype=np.float32) * np.float32(step)).astype(np.int64)
            tt, hh, ww = np.meshgrid(t_pos, np.arange(lh), np.arange(lw), indexing="ij")
            pos[0, i:j] = tt.reshape(-1) + cur
            pos[1, i:j] = hh.reshape(-1) + cur
            pos[2, i:j] = ww.reshape(-1) + cur
            cur += max(lh, lw)
        else:
            pos[:, i:j] = np.arange(j - i) + cur
            cur += j - i
        i = j
    return pos


def vision_grid_pos(start, t_index: np.ndarray, lh: int, lw: int) -> np.ndarray:
    """[3, t * lh * lw]: (t, h, w) of one image / video's merged tokens, frames then rows then columns, + start."""
    n = len(t_index)
    return np.stack([t_index.repeat(lh * lw), np.tile(np.arange(lh).repeat(lw), n), np.tile(np.arange(lw), n * lh)]) \
        + start


def chunk_bounds(values, per_chunk: int) -> list[tuple[int, int]]:
    """HF Qwen2.5-Omni's get_chunked_index (processor and model alike): (start, end) runs of increasing ``values``,
    cut wherever a value reaches the next multiple of ``per_chunk`` (one cut per value at most, as HF does)."""
    out, a, k = [], 0, 1
    for i, v in enumerate(np.asarray(values).tolist()):
        if v >= k * per_chunk:
            out.append((a, i))
            a, k = i, k + 1
    return out + [(a, len(values))]


def merge_by_time(video_t, audio_t) -> np.ndarray:
    """HF Qwen3-Omni's audio-in-video order (processor and get_rope_index alike): the indices into
    cat(video, audio) of the two increasing time lists merged, video first on ties."""
    t = np.concatenate([np.asarray(video_t, dtype=np.float64), np.asarray(audio_t, dtype=np.float64)])
    return np.argsort(t, kind="stable")  # stable: each list keeps its order, and the video's come first on ties
