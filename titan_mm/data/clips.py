"""Captioned video clips through a family's frozen encoders (DataNeeds.clips; docs/data.md "Captioned clips").

Rows are lmms-engine's video format (its Wan processor reads ``messages[0].content``: a video part and the text
that captions it); the first message with a video part gives the clip, its text parts the prompt:

    {"messages": [{"role": "user", "content": [{"type": "video", "video": "clips/a.mp4"},
                                               {"type": "text", "text": "a red ball rolls left"}]}]}

A video is a file PyAV decodes (mp4, webm, gif, ...) or a folder of frame images (png / jpg, in name order, at
``"fps"`` of the part or data.video_fps). A clip keeps frames at data.video_fps (<= 0: every frame), at most
data.video_max_frames, cut to 1 + k x frame_step frames, and is resized (never up) to at most data.video_max_pixels
frames x pixels with sides that are multiples of the encoders' pixel_multiple: its *bucket* (frames, height, width).

Two sources give the same clips: :class:`CacheSource` (the shards ``python -m titan_mm.tools.cache`` wrote:
latents and text states, safetensors) and :class:`RawSource` (the JSONL / JSON / Parquet rows, encoded in the
data pipeline by the frozen encoders). Either lists its rows up front (the cache from its index, the raw rows by
reading every record and the video's header), so :class:`ClipLoader` orders them from the seed alone:

- epoch e shuffles the rows (seed, e), groups them by bucket and cuts each bucket into micro-batches of
  data.micro_batch_size (a bucket's last one is filled with its first rows again), then shuffles the micro-batches;
- global micro-batch j = step x K + slot (K = micro-batches per global batch) and rank r of W reads slots
  r*K/W .. (r+1)*K/W-1 (titan_mm.data.loader.StreamLayout): the same global batch on any dp world;
- the state is the micro-batches read (StreamLayout's layout), so a resume reads what a straight run reads;
- prompt dropout zeroes a row's text states when hash(seed, j, row) falls below data.prompt_dropout.

Malformed rows (bad JSON or schema, no video, an unreadable or too-short video) are skipped and counted by reason
(the cache's index keeps the tool's counts).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from titan_mm.config import Data
from titan_mm.data.loader import CountedLoader, StreamLayout, resolve_sources
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import READERS, DataError, SkipSample, Unit, hash_ints, list_units, media_bytes, permutation
from titan_mm.data.vision import decode_video, resize_frames
from titan_mm.nn.media import ClipEncoders, ClipLayout

CACHE_FORMAT = "titan_mm.clip_cache/1"
INDEX = "index.json"
IMAGE_EXT = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_DROP_SALT = 0xCF6  # the prompt-dropout draws' own hash stream
OPEN_SHARDS = 16
"""Cache shards a CacheSource keeps open."""


@dataclass(frozen=True)
class ClipRow:
    """One usable row: its id, bucket (frames, height, width in pixels) and where its clip is."""

    sid: str
    bucket: tuple[int, int, int]
    ref: Any


# ----------------------------------------------------------------------------------------- rows and frames
def clip_part(rec: Any) -> tuple[Any, str, float]:
    """(video reference, prompt, the part's "fps" or 0) of a row; SkipSample when it has none."""
    sample = parse_record(rec)
    for m in sample.messages or []:
        videos = [p for p in m.parts if p.type == "video"]
        if videos:
            prompt = "\n".join(p.text for p in m.parts if p.type == "text").strip()
            if not prompt:
                raise SkipSample("empty", "the message with the video has no caption text")
            fps = videos[0].ref.get("fps", 0) if isinstance(videos[0].ref, dict) else 0
            return videos[0].ref, prompt, float(fps or 0)
    raise SkipSample("no_video", "no message has a video part (lmms-engine's format: a video and its caption)")


def _frame_dir(ref: Any, unit: Unit, media_root: str) -> str | None:
    """The local folder of frame images that ``ref`` names, or None (a video file)."""
    if isinstance(ref, dict):
        ref = ref.get("url") or ref.get("path")
    if not isinstance(ref, str) or "://" in ref:
        return None
    root = media_root or os.path.dirname(unit.url)
    path = ref if os.path.isabs(ref) else os.path.join(root, ref)
    return path if os.path.isdir(path) else None


def _frame_files(folder: str) -> list[str]:
    files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXT))
    if not files:
        raise SkipSample("bad_video", f"{folder}: no frame images ({', '.join(IMAGE_EXT)})")
    return [os.path.join(folder, f) for f in files]


def probe(ref: Any, rec: dict, unit: Unit, data: Data, part_fps: float) -> tuple[int, float, int, int]:
    """(frames, fps, height, width) of a clip from its header (a folder: its file count and first image)."""
    folder = _frame_dir(ref, unit, data.media_root)
    try:
        if folder is not None:
            files = _frame_files(folder)
            with Image.open(files[0]) as im:
                return len(files), part_fps or data.video_fps, im.height, im.width
        with av.open(io.BytesIO(media_bytes(ref, rec, unit, data.media_root))) as c:
            vs = c.streams.video[0]
            total = int(vs.frames or 0) or sum(1 for p in c.demux(vs) if p.size)
            fps = float(vs.average_rate) if vs.average_rate else 24.0
            return total, part_fps or fps, vs.codec_context.height, vs.codec_context.width
    except SkipSample:
        raise
    except Exception as e:
        raise SkipSample("bad_video", f"cannot read the video header ({type(e).__name__}: {e})") from None


def geometry(frames: int, fps: float, height: int, width: int, data: Data,
             enc: ClipEncoders) -> tuple[np.ndarray, int, int]:
    """(frame indices, height, width) of the clip cut from a video of ``frames`` at ``fps`` (module docstring)."""
    step = fps / data.video_fps if data.video_fps > 0 and fps > data.video_fps else 1.0
    n = min(int((frames - 1) / step) + 1, data.video_max_frames)
    n = 1 + (n - 1) // enc.frame_step * enc.frame_step
    if n < data.video_min_frames:
        raise SkipSample("too_short", f"{frames} frames at {fps:g} fps give {n} at data.video_fps = "
                         f"{data.video_fps:g} (1 + k x {enc.frame_step}), fewer than data.video_min_frames = "
                         f"{data.video_min_frames}")
    scale = min(1.0, (data.video_max_pixels / n / (height * width)) ** 0.5)
    m = enc.pixel_multiple
    h, w = (max(m, int(s * scale) // m * m) for s in (height, width))
    idx = np.minimum(np.round(np.arange(n) * step).astype(int), frames - 1)
    return idx, h, w


def read_clip(ref: Any, rec: dict, unit: Unit, data: Data, part_fps: float, enc: ClipEncoders) -> np.ndarray:
    """The clip's uint8 RGB frames [T, H, W, 3], sampled and resized by :func:`geometry` of its :func:`probe`."""
    idx, h, w = geometry(*probe(ref, rec, unit, data, part_fps), data, enc)
    folder = _frame_dir(ref, unit, data.media_root)
    if folder is not None:
        files = _frame_files(folder)
        try:
            clip = np.stack([np.asarray(Image.open(files[i]).convert("RGB")) for i in idx])
        except (OSError, ValueError) as e:  # an unreadable image, or frames of different sizes
            raise SkipSample("bad_video", f"{folder}: {type(e).__name__}: {e}") from None
    else:
        clip = np.stack(decode_video(media_bytes(ref, rec, unit, data.media_root), lambda *_: idx)[0])
    return resize_frames(clip, h, w).transpose(0, 2, 3, 1).astype(np.uint8)


# ----------------------------------------------------------------------------------------- sources
class RawSource:
    """The rows of data.dataset / data.mixture (weights are ignored: every row once an epoch), encoded on demand by
    the family's frozen encoders. ``skipped``: reason -> rows left out while listing."""

    def __init__(self, data: Data, enc: ClipEncoders):
        self.data, self.enc = data, enc
        self.rows: list[ClipRow] = []
        self.skipped: dict[str, int] = {}
        for spec, _ in resolve_sources(data.dataset, data.mixture):
            for unit in list_units(spec):
                try:
                    for _, rid, _, rec in READERS[unit.fmt](unit, 0, None):
                        self._add(f"{unit.source}/{unit.uid}:{rid}", unit, rec)
                except SkipSample as e:  # the whole unit is unreadable
                    self.skipped[e.reason] = self.skipped.get(e.reason, 0) + 1

    def _add(self, sid: str, unit: Unit, rec: Any) -> None:
        try:
            ref, prompt, fps = clip_part(rec)
            idx, h, w = geometry(*probe(ref, rec, unit, self.data, fps), self.data, self.enc)
        except SkipSample as e:
            self.skipped[e.reason] = self.skipped.get(e.reason, 0) + 1
            return
        self.rows.append(ClipRow(sid, (len(idx), h, w), (unit, rec, ref, prompt, fps)))

    def load(self, row: ClipRow) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents [C, F, H, W], text states [L, D]) of a listed row."""
        unit, rec, ref, prompt, fps = row.ref
        with torch.no_grad():
            return self.enc.video(read_clip(ref, rec, unit, self.data, fps, self.enc)), self.enc.text(prompt)


class CacheSource:
    """A latent cache folder: ``index.json`` (format, rows per shard with their ids and buckets, the tool's skip
    counts) and ``shard-NNNNN.safetensors`` holding ``<i>.latents`` / ``<i>.text_states`` per row."""

    def __init__(self, folder: str):
        self.folder = folder
        idx = read_index(folder)
        self.skipped: dict[str, int] = dict(idx.get("skipped", {}))
        self.rows = [ClipRow(r["id"], tuple(r["bucket"]), (s["file"], i))
                     for s in idx["shards"] for i, r in enumerate(s["rows"])]
        self._open: dict[str, Any] = {}

    def load(self, row: ClipRow) -> tuple[torch.Tensor, torch.Tensor]:
        name, i = row.ref
        if name not in self._open:
            if len(self._open) >= OPEN_SHARDS:  # the oldest handle goes: a micro-batch reads one bucket's shards
                self._open.pop(next(iter(self._open)))
            self._open[name] = safe_open(os.path.join(self.folder, name), framework="pt")
        f = self._open[name]
        return f.get_tensor(f"{i}.latents"), f.get_tensor(f"{i}.text_states")


def is_cache(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX))


def read_index(folder: str, name: str = INDEX, fmt: str = CACHE_FORMAT) -> dict:
    """A cache folder's index ``name`` (python -m titan_mm.tools.cache's) of format ``fmt`` (a family's own cache
    names its own; ValueError in one line otherwise)."""
    try:
        with open(os.path.join(folder, name)) as fh:
            idx = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: no readable latent-cache index ({e}); build it with python -m "
                         "titan_mm.tools.cache") from None
    if idx.get("format") != fmt:
        raise ValueError(f"{folder}/{name} is format {idx.get('format')!r}, this titan_mm reads {fmt!r}; "
                         "rebuild the cache with python -m titan_mm.tools.cache")
    return idx


class CacheWriter:
    """Writes a latent cache: rows go to shards of ``rows_per_shard``; ``close()`` writes the index last, so a
    folder with an index is complete."""

    def __init__(self, folder: str, rows_per_shard: int = 256):
        self.folder, self.per = folder, rows_per_shard
        os.makedirs(folder, exist_ok=True)
        self.shards: list[dict] = []
        self._buf: dict[str, torch.Tensor] = {}
        self._rows: list[dict] = []

    def add(self, row: ClipRow, latents: torch.Tensor, text: torch.Tensor) -> None:
        i = len(self._rows)
        self._buf[f"{i}.latents"] = latents.contiguous()
        self._buf[f"{i}.text_states"] = text.contiguous()
        self._rows.append({"id": row.sid, "bucket": list(row.bucket)})
        if len(self._rows) == self.per:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(self._buf, os.path.join(self.folder, name))
        self.shards.append({"file": name, "rows": self._rows})
        self._buf, self._rows = {}, []

    def close(self, skipped: dict[str, int], meta: dict | None = None) -> dict:
        self._flush()
        idx = {"format": CACHE_FORMAT, "shards": self.shards, "skipped": skipped, **(meta or {})}
        tmp = os.path.join(self.folder, INDEX + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(idx, fh)
        os.replace(tmp, os.path.join(self.folder, INDEX))
        return idx


# ----------------------------------------------------------------------------------------- the loader
def epoch_plan(rows: list[ClipRow], B: int, seed: int, epoch: int) -> list[list[int]]:
    """Epoch ``epoch``'s micro-batches as row indices: one bucket each (module docstring)."""
    buckets: dict[tuple, list[int]] = {}
    for i in permutation(len(rows), seed, epoch):
        buckets.setdefault(rows[i].bucket, []).append(i)
    mbs = []
    for members in buckets.values():
        for a in range(0, len(members), B):
            mbs.append([members[(a + k) % len(members)] for k in range(B)])
    return [mbs[i] for i in permutation(len(mbs), seed, epoch, 1)]


class ClipLoader(CountedLoader):
    """This dp rank's micro-batches of clips (module docstring), with state_dict() / load_state_dict() as the
    trainer's other loaders; ``epochs`` > 0 stops after that many passes."""

    def __init__(self, source: RawSource | CacheSource, layout: ClipLayout, *, micro_batch_size: int,
                 n_micro: int = 1, dp_rank: int = 0, dp_world: int = 1, seed: int = 0, prompt_dropout: float = 0.0,
                 epochs: int = 0):
        if not source.rows:
            raise ValueError(f"no usable clips (skipped by reason: {source.skipped}); fix the rows or the videos")
        self.source, self.clips, self.B = source, layout, micro_batch_size
        self.seed, self.p_drop, self.epochs = seed, prompt_dropout, epochs
        self.layout = StreamLayout(slots=n_micro * dp_world, dp_rank=dp_rank, dp_world=dp_world)
        self.per_epoch = len(epoch_plan(source.rows, micro_batch_size, seed, 0))
        self._plans: dict[int, list[list[int]]] = {}
        self.served = 0
        self.failed: dict[str, int] = {}
        self.last_sample_ids: list[str] = []

    def global_index(self, q: int) -> int:
        """The global micro-batch that the rank's q-th read is."""
        L = self.layout
        step, i = divmod(q, L.n_micro)
        return step * L.slots + L.dp_rank * L.n_micro + i

    def rows_of(self, j: int) -> list[ClipRow]:
        epoch, k = divmod(j, self.per_epoch)
        if epoch not in self._plans:
            self._plans = {epoch: epoch_plan(self.source.rows, self.B, self.seed, epoch)}
        return [self.source.rows[i] for i in self._plans[epoch][k]]

    def batch(self, j: int) -> dict:
        """Global micro-batch ``j``: the family's batch of its rows (ClipLayout.batch)."""
        rows, got = self.rows_of(j), []
        for r in rows:
            try:
                got.append(self.source.load(r))
            except SkipSample as e:  # listed, then failed to decode: its place goes to a row of the same bucket
                self.failed[e.reason] = self.failed.get(e.reason, 0) + 1
        if not got:
            raise DataError(f"data: no clip of micro-batch {j} decodes ({', '.join(r.sid for r in rows)}); fix them")
        lat, texts = zip(*(got[k % len(got)] for k in range(len(rows))))
        L = self.clips.text_len
        text = torch.zeros(len(rows), L, texts[0].shape[-1], dtype=torch.float32)
        for r, t in enumerate(texts):
            if hash_ints(self.seed, j, r, _DROP_SALT) / 2.0**64 >= self.p_drop:
                text[r, : min(L, t.shape[0])] = t[:L]
        self.last_sample_ids = [r.sid for r in rows]
        return self.clips.batch(torch.stack(lat).float(), text)

    def __iter__(self) -> Iterator[dict]:
        while True:
            j = self.global_index(self.served)
            if self.epochs and j >= self.epochs * self.per_epoch:
                return
            b = self.batch(j)
            self.served += 1
            yield b

    def metrics(self) -> dict[str, float]:
        skipped = dict(self.source.skipped)
        for k, v in self.failed.items():
            skipped[k] = skipped.get(k, 0) + v
        return {"samples": self.B, "skipped": sum(skipped.values()), **{f"skipped/{k}": v for k, v in skipped.items()}}


def uses_cache(data: Data) -> bool:
    """True when data.dataset is a latent cache (its index is checked), False for raw rows with data.encoders a
    folder; ValueError in one line otherwise."""
    if data.dataset and not data.mixture and is_cache(data.dataset):
        read_index(data.dataset)
        return True
    if not data.encoders:
        raise ValueError(f"data.dataset {data.dataset!r} is no latent cache (no {INDEX}); set data.encoders to the "
                         "frozen encoders' folder (a diffusers pipeline: tokenizer/, text_encoder/, vae/) to encode "
                         "the raw clips in the pipeline, or cache them first: python -m titan_mm.tools.cache")
    if not os.path.isdir(data.encoders):
        raise ValueError(f"data.encoders {data.encoders!r} is not a folder; give a diffusers pipeline folder "
                         "(tokenizer/, text_encoder/, vae/)")
    return False


def clip_source(data: Data, layout: ClipLayout, device: str = "cpu") -> RawSource | CacheSource:
    """data.dataset as a latent cache folder, or raw rows encoded by data.encoders on ``device``
    (:func:`uses_cache`)."""
    if uses_cache(data):
        return CacheSource(data.dataset)
    return RawSource(data, layout.encoders(data.encoders, device=device))


def build_clip_loader(data: Data, layout: ClipLayout, *, dp_rank: int = 0, dp_world: int = 1, n_micro: int = 1,
                      seed: int = 0, epochs: int = 0, device: str = "cpu") -> ClipLoader:
    """The trainer's loader for a family with DataNeeds.clips (titan_mm.train.setup.build_data); raw clips are
    encoded on ``device`` (the trainer's), in the trainer's process."""
    return ClipLoader(clip_source(data, layout, device), layout, micro_batch_size=data.micro_batch_size,
                      n_micro=n_micro, dp_rank=dp_rank, dp_world=dp_world, seed=seed,
                      prompt_dropout=data.prompt_dropout, epochs=epochs)
