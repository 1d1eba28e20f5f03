"""Images and video as the family's HF processor makes them (DataNeeds.vision_layout: "qwen3_vl", "qwen2_5_vl",
"qwen2_5_omni" or "qwen3_omni"), plus 3-D M-RoPE positions, on CPU with numpy / PIL / PyAV.

Images (equal to transformers' Qwen2VLImageProcessor with the family's settings, see tests/parity):
  RGB (transparency composited onto white) -> smart resize (both sides multiples of patch*merge, 32 or 28, area
  within [min_pixels, max_pixels], aspect ratio kept) with PIL bicubic -> x/255 -> (x - mean)/std (0.5 / 0.5 for
  Qwen3-VL, OpenAI CLIP's for Qwen2.5-VL) -> patches repeated over a temporal patch of 2 -> rows ordered by 2x2
  merge blocks: ``pixel_values [t*h*w, 3*2*p*p]``, ``image_grid_thw [[1, h, w]]`` (h, w in patches), and
  h*w/4 ``<|image_pad|>`` tokens.
Video: frames decoded with PyAV, resized with torch bicubic antialias (as torchvision does), patched with
  temporal patch 2 (last frame repeated to an even count).
  - "qwen3_vl": frames sampled uniformly at ``video_fps`` (clamped to [min_frames, max_frames]), one size for
    the clip with its total volume within [video_min_pixels, video_max_pixels]. Each temporal group becomes
    ``<{t:.1f} seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` at the place of the template's
    ``<|video_pad|>``, with t the mean timestamp of the group's frames.
  - "qwen2_5_vl" (Qwen2VLVideoProcessor + Qwen2_5_VLProcessor): a multiple of 2 frames sampled at ``video_fps``,
    each frame's area within [video_min_pixels, video_max_pixels]; the template's ``<|video_pad|>`` becomes
    t*h*w/4 of them, and ``video_second_per_grid`` = 2 / (the sampled fps).
  - "qwen2_5_omni" (Qwen2VLVideoProcessor + Qwen2_5OmniProcessor): Qwen2.5-VL's, but ``video_second_per_grid`` =
    2 / ``video_fps`` (HF times a temporal patch by the requested fps, not the sampled one). With
    ``use_audio_in_video`` the pad becomes ``<|audio_bos|>``, then per chunk of ``seconds_per_chunk`` seconds the
    video's pads then its audio's, then ``<|audio_eos|>`` (:func:`audio_in_video_ids`).
  - "qwen3_omni" (Qwen2VLVideoProcessor + Qwen3OmniMoeProcessor): Qwen2.5-Omni's sampling, sizes and timing with
    Qwen3-VL's mean / std 0.5 (and its patch 16). With ``use_audio_in_video`` there are no chunks: the video's pads
    (temporal patch k at k * second_per_grid * position_id_per_seconds, not truncated) and its audio's (token i at
    i) are merged by that time, video first on ties (:func:`merge_by_time`).
M-RoPE (get_rope_index): text advances all three axes by one; a run of vision tokens starting at position p
  gets (p + t, p + row, p + col) over its merged grid, and the next token starts at p + max(rows, cols).
  Qwen3-VL: each video frame group is its own run with t = 0. Qwen2.5-VL: a video is one run and temporal
  patch k has t = int(k * tokens_per_second * second_per_grid).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import numpy as np
from einops import rearrange

from titan_mm.data.sources import SkipSample

# (mean, std) of each layout's HF processor: Qwen3-VL's, and Qwen2-VL's OPENAI_CLIP_MEAN / OPENAI_CLIP_STD
NORM = {"qwen3_vl": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        "qwen2_5_vl": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))}
NORM["qwen2_5_omni"] = NORM["qwen2_5_vl"]
NORM["qwen3_omni"] = NORM["qwen3_vl"]
LAYOUTS = tuple(NORM)
QWEN2_5 = ("qwen2_5_vl", "qwen2_5_omni", "qwen3_omni")  # Qwen2VLVideoProcessor's sampling and sizes, one pad run
OMNI = ("qwen2_5_omni", "qwen3_omni")  # timed by the requested fps; a video part may bring its audio track


def normalize(x_CHW: np.ndarray, layout: str) -> np.ndarray:
    """float32 pixels in [0, 1] (channels first) -> (x - mean) / std of the layout."""
    mean, std = (np.asarray(v, dtype=np.float32)[:, None, None] for v in NORM[layout])
    return (x_CHW.astype(np.float32) - mean) / std


@dataclass
class MediaItem:
    kind: str  # "image" | "video" | "audio"
    tensors: dict = field(default_factory=dict)  # batch key -> array (concatenated over a batch)
    grid: tuple = (1, 1, 1)  # (t, h, w) in patches
    n_patches: int = 0
    n_tokens: int = 0
    timestamps: list = field(default_factory=list)  # video: seconds per temporal group (its mean / start time)
    layout: str = "qwen3_vl"  # DataNeeds.vision_layout it was made for
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
    from PIL import Image

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
    from PIL import Image

    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def _image_patches(img, h: int, w: int, patch: int, temporal: int, merge: int,
                   layout: str = "qwen3_vl") -> np.ndarray:
    from PIL import Image

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
    layout: str

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
    import av

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
            want = [int(i) for i in pick(total, fps)]
            need = set(want)
            got: dict[int, np.ndarray] = {}
            with _open() as c:
                for i, f in enumerate(c.decode(c.streams.video[0])):
                    if i in need:
                        got[i] = f.to_ndarray(format="rgb24")
                    if i >= want[-1]:
                        break
            if not got:
                raise ValueError("no frames decoded")
            last = max(got)  # the container may overstate the count: reuse the last decoded frame
            frames = [got.get(i, got[last]) for i in want]
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


def sample_frame_indices_qwen2_5_vl(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int,
                                    temporal: int) -> np.ndarray:
    """Qwen2VLVideoProcessor.sample_frames at ``fps``: a multiple of ``temporal`` frames, at int(k * total / n)
    (float32, as torch.arange gives them). A clip shorter than one temporal patch is taken whole (HF's sampling
    would divide by zero; its unsampled path takes every frame)."""
    import torch

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
    import torch
    import torch.nn.functional as F

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
        if layout in QWEN2_5:
            idx = sample_frame_indices_qwen2_5_vl(total, fps, d.video_fps, d.video_min_frames, d.video_max_frames, tp)
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
    if layout in QWEN2_5:  # the pixel bounds are per frame
        h, w = smart_resize(clip.shape[1], clip.shape[2], factor, d.video_min_pixels, d.video_max_pixels, "bad_video")
    else:
        h, w = video_smart_resize(clip.shape[0], clip.shape[1], clip.shape[2], factor, tp, d.video_min_pixels,
                                  d.video_max_pixels)
    x = normalize(resize_frames(clip, h, w) * np.float32(1 / 255), layout)
    pv, grid = patchify(x, cfg.patch_size, tp, cfg.merge_size)
    n = grid[0] * grid[1] * grid[2]
    tensors = {"pixel_values_videos": pv, "video_grid_thw": np.asarray([grid], dtype=np.int64)}
    item = MediaItem("video", tensors, grid, n, n // cfg.merge_size**2, layout=layout)
    if layout in QWEN2_5:
        # Qwen2_5_VLProcessor: temporal patch / the sampled fps; the Omni processors: / the requested fps
        sec = tp / (d.video_fps if layout in OMNI else n_frames / box["total"] * video_fps)
        tensors["video_second_per_grid"] = np.asarray([sec], np.float32)
        item.timestamps = [k * sec for k in range(grid[0])]  # float64, as HF's processor chunks them
    else:
        item.timestamps = frame_timestamps(idx, video_fps, tp)
    return item


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


def audio_in_video_ids(item: MediaItem, tok, cfg) -> np.ndarray:
    """The Omni processors' replace_video_with_audio_token: <|audio_bos|>, the video's pads (frame k at
    k * second_per_grid * position_id_per_seconds) and the audio's (token i at i), then <|audio_eos|>.
    Qwen2_5OmniProcessor: per chunk of seconds_per_chunk seconds the video's pads then the audio's;
    Qwen3OmniMoeProcessor: the two merged by time (:func:`merge_by_time`)."""
    _, h, w = item.grid
    frame_t = np.repeat(np.asarray(item.timestamps) * cfg.needs.video_tokens_per_second, h * w // cfg.merge_size**2)
    if item.layout == "qwen3_omni":
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
    :func:`audio_in_video_ids`). Qwen2.5-VL / Omni: t*h*w/4 <|video_pad|>. Qwen3-VL: per temporal group a timestamp
    and a <|vision_start|> <|video_pad|>*n <|vision_end|> block."""
    if item.layout in QWEN2_5:
        return np.full(item.n_tokens, tok.video_pad_id, dtype=np.int64)
    t, h, w = item.grid
    per = h * w // 4
    out: list[int] = []
    for k in range(t):
        out += tok.encode(f"<{item.timestamps[k]:.1f} seconds>")
        out += [tok.vision_start_id] + [tok.video_pad_id] * per + [tok.vision_end_id]
    return np.asarray(out, dtype=np.int64)


# ------------------------------------------------------------------------------------------ M-RoPE
def mrope_index(kinds_L, image_grids, video_grids, merge: int, second_per_grid=None,
                tokens_per_second: float = 0.0) -> np.ndarray:
    """[3, L] int64 (t, h, w) positions of one document (starting at 0), as get_rope_index.

    ``kinds_L``: per token 0 text, 1 image pad, 2 video pad (HF's mm_token_type_ids); ``image_grids`` /
    ``video_grids``: the (t, h, w) patch grids in document order (arrays, tensors or lists). A run of pad
    tokens is one image, and one video frame group (Qwen3-VL: a video is t runs of (1, h, w), given
    ``second_per_grid=None``) or one video (Qwen2.5-VL: ``second_per_grid`` holds each video's seconds per
    temporal patch, and temporal patch k has t = int(k * tokens_per_second * second_per_grid), in float32 as HF
    computes it). Raises ValueError when the runs do not match the grids."""
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
    if cfg.needs.vision_layout in QWEN2_5:
        secs = [s for it in videos for s in it.tensors["video_second_per_grid"]]
    try:
        return mrope_index(kinds, [it.grid for it in items if it.kind == "image"], [it.grid for it in videos],
                           cfg.merge_size, secs, cfg.needs.video_tokens_per_second)
    except ValueError as e:
        raise SkipSample("bad_schema", str(e)) from None
