"""Images and video as the family's HF processor makes them (the family's DataNeeds.vision_layout, a
:class:`~titan_mm.nn.media.VisionLayout`), plus 3-D M-RoPE positions, on CPU with numpy / PIL / PyAV.

Images (equal to transformers' Qwen2VLImageProcessor with the family's settings, see tests/parity):
  RGB (transparency composited onto white) -> smart resize (both sides multiples of patch*merge, area within
  [min_pixels, max_pixels], aspect ratio kept) with PIL bicubic -> x/255 -> (x - mean)/std of the layout -> patches
  repeated over a temporal patch of 2 -> rows ordered by 2x2 merge blocks: ``pixel_values [t*h*w, 3*2*p*p]``,
  ``image_grid_thw [[1, h, w]]`` (h, w in patches), and h*w/4 ``<|image_pad|>`` tokens.
Video: frames decoded with PyAV, resized with torch bicubic antialias (as torchvision does), patched with
  temporal patch 2 (last frame repeated to an even count). The layout picks (titan_mm/nn/media.py):
  - frames "linspace" (clamped to [min_frames, max_frames]) or "strided" (a multiple of 2 frames, as
    Qwen2VLVideoProcessor samples them); pixel_bounds "clip" (the total volume within [video_min_pixels,
    video_max_pixels], :func:`video_smart_resize`) or "frame" (each frame's area).
  - video_time "frame_groups": each temporal group becomes
    ``<{t:.1f} seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` at the place of the template's
    ``<|video_pad|>``, with t the mean timestamp of the group's frames. Otherwise the template's ``<|video_pad|>``
    becomes t*h*w/4 of them and ``video_second_per_grid`` = 2 / (the "sampled_fps", or the "requested_fps"
    data.video_fps: HF's Omni processors time a temporal patch by the requested fps).
  - audio_in_video (a video part's ``use_audio_in_video``; :func:`audio_in_video_ids`): the pad becomes
    ``<|audio_bos|>``, the video's pads (temporal patch k at k * second_per_grid * video_tokens_per_second) and its
    audio's (token i at i), then ``<|audio_eos|>``; "chunks": per chunk of ``seconds_per_chunk`` seconds the video's
    pads then the audio's; "by_time": the two merged by time, video first on ties (:func:`merge_by_time`).
M-RoPE (get_rope_index, :func:`titan_mm.nn.media.mrope_index`): text advances all three axes by one; a run of
  vision tokens starting at position p gets (p + t, p + row, p + col) over its merged grid, and the next token
  starts at p + max(rows, cols). "frame_groups": each video frame group is its own run with t = 0; otherwise a
  video is one run and temporal patch k has t = int(k * tokens_per_second * second_per_grid).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image

from titan_mm.data.sources import SkipSample
from titan_mm.nn.media import VisionLayout, chunk_bounds, merge_by_time, mrope_index

STANDARD_NORM = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # HF's IMAGENET_STANDARD_MEAN / _STD, where no layout is given


def normalize(x_CHW: np.ndarray, layout: VisionLayout | None) -> np.ndarray:
    """float32 pixels in [0, 1] (channels first) -> (x - mean) / std of the layout."""
    norm = (layout.mean, layout.std) if layout is not None else STANDARD_NORM
    mean, std = (np.asarray(v, dtype=np.float32)[:, None, None] for v in norm)
    return (x_CHW.astype(np.float32) - mean) / std


@dataclass
class MediaItem:
    kind: str  # "image" | "video" | "audio"
    tensors: dict = field(default_factory=dict)  # batch key -> array (concatenated over a batch)
    grid: tuple = (1, 1, 1)  # (t, h, w) in patches
    n_patches: int = 0
    n_tokens: int = 0
    timestamps: list = field(default_factory=list)  # video: seconds per temporal group (its mean / start time)
    layout: VisionLayout | None = None  # DataNeeds.vision_layout it was made for
    audio_tokens: int = 0  # a video with its audio track interleaved (use_audio_in_video): the audio's tokens


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 reason: str = "bad_image") -> tuple[int, int]:
    """(h, w) multiples of ``factor``, area in [min_pixels, max_pixels], aspect ratio kept (Qwen-VL rule)."""
    if max(height, width) / min(height, width) > 200:
        raise SkipSample(reason, f"aspect ratio {max(height, width) / min(height, width):.0f} > 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def video_smart_resize(n_frames: int, height: int, width: int, factor: int, temporal: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The video variant: the budget is over frames x pixels; tiny frames are first scaled up to ``factor``."""
    if height < factor or width < factor:
        s = max(factor / height, factor / width)
        height, width = int(height * s), int(width * s)
    if max(height, width) / min(height, width) > 200:
        raise SkipSample("bad_video", f"aspect ratio {max(height, width) / min(height, width):.0f} > 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(n_frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(n_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (n_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patchify(frames_TCHW: np.ndarray, patch: int, temporal: int, merge: int) -> tuple[np.ndarray, tuple]:
    """[T, C, H, W] float32 -> [T/tp * H/p * W/p, C*tp*p*p] rows in merge-block order, and (t, h, w)."""
    T, _, H, W = frames_TCHW.shape
    if T % temporal:
        frames_TCHW = np.concatenate([frames_TCHW, np.repeat(frames_TCHW[-1:], temporal - T % temporal, 0)], 0)
        T = frames_TCHW.shape[0]
    x = rearrange(frames_TCHW, "(gt t) c (gh mh p) (gw mw q) -> (gt gh gw mh mw) (c t p q)",
                  t=temporal, mh=merge, p=patch, mw=merge, q=patch)  # a merge block's patches are adjacent rows
    return np.ascontiguousarray(x), (T // temporal, H // patch, W // patch)


def _load_pil(payload):
    if isinstance(payload, Image.Image):
        return payload
    if isinstance(payload, np.ndarray):
        return Image.fromarray(payload)
    try:
        img = Image.open(io.BytesIO(payload))
        img.load()
        return img
    except Exception as e:
        raise SkipSample("corrupt_image", f"cannot decode image ({type(e).__name__}: {e})") from None


def to_rgb(img):
    """RGB, with any transparency (RGBA, LA, PA, P or RGB with a transparent colour) composited onto white, as
    transformers' image processors do (``convert_to_rgb``); a plain convert would keep the hidden colours."""
    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def _image_patches(img, h: int, w: int, patch: int, temporal: int, merge: int,
                   layout: VisionLayout | None = None) -> np.ndarray:
    img = to_rgb(img).resize((w, h), resample=Image.Resampling.BICUBIC)
    x = np.asarray(img).astype(np.float64) * (1 / 255)
    x = normalize(x.transpose(2, 0, 1), layout)[None]  # [1, C, H, W]
    x = np.repeat(x, temporal, axis=0)
    return patchify(x, patch, temporal, merge)[0]


@dataclass
class LazyImage:
    """An image whose pixel patches are computed only when its batch is collated: the packer's open rows
    then hold the (compressed) bytes, not float32 patches. The grid is known up front from the size."""
    payload: object  # encoded bytes, or a PIL image / array
    h: int
    w: int
    patch: int
    temporal: int
    merge: int
    layout: VisionLayout | None

    def materialize(self) -> dict[str, np.ndarray]:
        pv = _image_patches(_load_pil(self.payload), self.h, self.w, self.patch, self.temporal, self.merge,
                            self.layout)
        g = (1, self.h // self.patch, self.w // self.patch)
        return {"pixel_values": pv, "image_grid_thw": np.asarray([g], dtype=np.int64)}


def process_image(payload, cfg, lazy: bool = False) -> MediaItem:
    """Decode (validating the image), smart-resize rule -> grid; patches now, or at collate time (lazy)."""
    img = _load_pil(payload)
    factor = cfg.patch_size * cfg.merge_size
    h, w = smart_resize(img.height, img.width, factor, cfg.data.image_min_pixels, cfg.data.image_max_pixels)
    grid = (1, h // cfg.patch_size, w // cfg.patch_size)
    n = grid[1] * grid[2]
    layout = cfg.needs.vision_layout
    if lazy:
        keep = payload if isinstance(payload, (bytes, bytearray)) else img
        item = MediaItem("image", {"_lazy_image": LazyImage(keep, h, w, cfg.patch_size, cfg.temporal_patch_size,
                                                              cfg.merge_size, layout)}, grid, n, n // cfg.merge_size**2)
        return item
    pv = _image_patches(img, h, w, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size, layout)
    return MediaItem("image", {"pixel_values": pv, "image_grid_thw": np.asarray([grid], dtype=np.int64)},
                     grid, n, n // cfg.merge_size**2)


# ------------------------------------------------------------------------------------------ video
def decode_video(payload, pick=None) -> tuple[list[np.ndarray], float]:
    """RGB uint8 [H, W, 3] frames and the stream's fps (PyAV).

    With ``pick(total_frames, fps) -> indices`` only the picked frames are kept while decoding, so a long
    video never sits in memory whole (the frame count comes from the container; when the container does
    not say, a first pass counts frames without converting them)."""
    import av  # PyAV (FFmpeg) only for video payloads: a text or image run never loads it

    def _open():
        return av.open(io.BytesIO(payload) if isinstance(payload, (bytes, bytearray)) else payload)

    try:
        with _open() as c:
            vs = c.streams.video[0]
            fps = float(vs.average_rate) if vs.average_rate else 24.0
            total = int(vs.frames or 0)
            if pick is None:
                frames = [f.to_ndarray(format="rgb24") for f in c.decode(vs)]
        if pick is not None:
            if total <= 0:
                with _open() as c:
                    total = sum(1 for _ in c.decode(c.streams.video[0]))
            picked = [int(i) for i in pick(total, fps)]
            need = set(picked)
            got: dict[int, np.ndarray] = {}
            with _open() as c:
                for i, f in enumerate(c.decode(c.streams.video[0])):
                    if i in need:
                        got[i] = f.to_ndarray(format="rgb24")
                    if i >= picked[-1]:
                        break
            if not got:
                raise ValueError("no frames decoded")
            last = max(got)  # the container may overstate the count: reuse the last decoded frame
            frames = [got.get(i, got[last]) for i in picked]
    except SkipSample:
        raise
    except Exception as e:
        raise SkipSample("bad_video", f"cannot decode video ({type(e).__name__}: {e})") from None
    if not frames:
        raise SkipSample("bad_video", "video has no frames")
    return frames, fps


def sample_frame_indices(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    n = int(total / video_fps * fps)
    n = min(max(n, min_frames), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def sample_frame_indices_strided(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int,
                                    temporal: int) -> np.ndarray:
    """Qwen2VLVideoProcessor.sample_frames at ``fps``: a multiple of ``temporal`` frames, at int(k * total / n)
    (float32, as torch.arange gives them). A clip shorter than one temporal patch is taken whole (HF's sampling
    would divide by zero; its unsampled path takes every frame)."""
    top = math.floor(min(max_frames, total) / temporal) * temporal
    n = math.floor(min(max(total / video_fps * fps, min_frames), top, total) / temporal) * temporal
    if n == 0:
        return np.arange(total)
    return torch.arange(0, total, total / n).int().numpy()


def frame_timestamps(indices, video_fps: float, temporal: int) -> list[float]:
    idx = list(indices)
    if len(idx) % temporal:
        idx += [idx[-1]] * (temporal - len(idx) % temporal)
    ts = [i / video_fps for i in idx]
    return [(ts[i] + ts[i + temporal - 1]) / 2 for i in range(0, len(ts), temporal)]


def resize_frames(frames_THWC: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bicubic antialiased resize of uint8 frames as torchvision does on tensors: float, round, clamp."""
    x = torch.from_numpy(np.ascontiguousarray(frames_THWC)).permute(0, 3, 1, 2).float()
    if x.shape[-2:] != (h, w):
        x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
        x = x.round_().clamp_(0, 255)
    return x.numpy()  # [T, C, H, W] float32 in [0, 255]


def process_video(payload, cfg, frames: list[np.ndarray] | None = None, video_fps: float | None = None) -> MediaItem:
    """``payload`` (bytes / file) is decoded keeping only the sampled frames; or pass all ``frames`` + fps."""
    layout, d, tp = cfg.needs.vision_layout, cfg.data, cfg.temporal_patch_size
    box = {}

    def pick(total, fps):
        if layout.frames == "strided":
            idx = sample_frame_indices_strided(total, fps, d.video_fps, d.video_min_frames, d.video_max_frames, tp)
        else:
            idx = sample_frame_indices(total, fps, d.video_fps, d.video_min_frames, d.video_max_frames)
        box.update(total=total, idx=idx)
        return idx

    if frames is None:
        clip_frames, video_fps = decode_video(payload, pick)
        frames = dict(zip(box["idx"].tolist(), clip_frames))
    else:
        pick(len(frames), video_fps)
    idx = box["idx"]
    if len(idx) < 1:
        raise SkipSample("bad_video", "no frames sampled")
    clip = np.stack([frames[i] for i in idx])  # [T, H, W, 3]
    factor = cfg.patch_size * cfg.merge_size
    n_frames = len(idx)
    if n_frames < tp:
        clip = np.concatenate([clip, np.repeat(clip[-1:], tp - n_frames, 0)])
    if layout.pixel_bounds == "frame":
        h, w = smart_resize(clip.shape[1], clip.shape[2], factor, d.video_min_pixels, d.video_max_pixels, "bad_video")
    else:
        h, w = video_smart_resize(clip.shape[0], clip.shape[1], clip.shape[2], factor, tp, d.video_min_pixels,
                                  d.video_max_pixels)
    x = normalize(resize_frames(clip, h, w) * np.float32(1 / 255), layout)
    pv, grid = patchify(x, cfg.patch_size, tp, cfg.merge_size)
    n = grid[0] * grid[1] * grid[2]
    tensors = {"pixel_values_videos": pv, "video_grid_thw": np.asarray([grid], dtype=np.int64)}
    item = MediaItem("video", tensors, grid, n, n // cfg.merge_size**2, layout=layout)
    if layout.one_run:
        sec = tp / (d.video_fps if layout.video_time == "requested_fps" else n_frames / box["total"] * video_fps)
        tensors["video_second_per_grid"] = np.asarray([sec], np.float32)
        item.timestamps = [k * sec for k in range(grid[0])]  # float64, as HF's processor chunks them
    else:
        item.timestamps = frame_timestamps(idx, video_fps, tp)
    return item


def audio_in_video_ids(item: MediaItem, tok, cfg) -> np.ndarray:
    """HF's replace_video_with_audio_token: <|audio_bos|>, the video's pads (frame k at
    k * second_per_grid * video_tokens_per_second) and the audio's (token i at i), then <|audio_eos|>; the layout's
    audio_in_video "chunks": per chunk of seconds_per_chunk seconds the video's pads then the audio's; "by_time":
    the two merged by time (:func:`merge_by_time`)."""
    _, h, w = item.grid
    frame_t = np.repeat(np.asarray(item.timestamps) * cfg.needs.video_tokens_per_second, h * w // cfg.merge_size**2)
    if item.layout.audio_in_video == "by_time":
        pads = np.r_[np.full(len(frame_t), tok.video_pad_id), np.full(item.audio_tokens, tok.audio_pad_id)]
        body = pads[merge_by_time(frame_t, np.arange(item.audio_tokens))].tolist()
        return np.asarray([tok.audio_start_id, *body, tok.audio_end_id], dtype=np.int64)
    per = int(cfg.needs.video_tokens_per_second * cfg.needs.seconds_per_chunk)
    vc, ac = chunk_bounds(frame_t, per), chunk_bounds(np.arange(item.audio_tokens), per)
    out = [tok.audio_start_id]
    for j in range(max(len(vc), len(ac))):  # one list may run out of chunks before the other
        for chunks, pad in ((vc, tok.video_pad_id), (ac, tok.audio_pad_id)):
            if j < len(chunks):
                out += [pad] * (chunks[j][1] - chunks[j][0])
    return np.asarray(out + [tok.audio_end_id], dtype=np.int64)


def video_placeholder_ids(item: MediaItem, tok) -> np.ndarray:
    """Token ids replacing the template's single <|video_pad|> (a video alone; with its audio track see
    :func:`audio_in_video_ids`). One run (the layout's video_time): t*h*w/4 <|video_pad|>; "frame_groups": per
    temporal group a timestamp and a <|vision_start|> <|video_pad|>*n <|vision_end|> block."""
    if item.layout.one_run:
        return np.full(item.n_tokens, tok.video_pad_id, dtype=np.int64)
    t, h, w = item.grid
    per = h * w // 4
    out: list[int] = []
    for k in range(t):
        out += tok.encode(f"<{item.timestamps[k]:.1f} seconds>")
        out += [tok.vision_start_id] + [tok.video_pad_id] * per + [tok.vision_end_id]
    return np.asarray(out, dtype=np.int64)


# ------------------------------------------------------------------------------------------ M-RoPE
def mrope_positions(ids: np.ndarray, items: list[MediaItem], tok, cfg) -> np.ndarray:
    """[3, L] positions of one processed document (its media ``items`` in order), via :func:`mrope_index`."""
    kinds = np.zeros(ids.shape[0], dtype=np.int64)
    for k, pad in ((1, tok.image_pad_id), (2, tok.video_pad_id)):
        if pad is not None:
            kinds[ids == pad] = k
    videos = [it for it in items if it.kind == "video" and not it.audio_tokens]
    if len(videos) < sum(it.kind == "video" for it in items):
        # audio in video has no M-RoPE layout: its pads count as text here (the family's TMRoPE replaces these)
        inside = np.cumsum(ids == tok.audio_start_id) - np.cumsum(ids == tok.audio_end_id) > 0
        kinds[inside] = 0
    secs = None
    if cfg.needs.vision_layout is not None and cfg.needs.vision_layout.one_run:
        secs = [s for it in videos for s in it.tensors["video_second_per_grid"]]
    try:
        return mrope_index(kinds, [it.grid for it in items if it.kind == "image"], [it.grid for it in videos],
                           cfg.merge_size, secs, cfg.needs.video_tokens_per_second)
    except ValueError as e:
        raise SkipSample("bad_schema", str(e)) from None

