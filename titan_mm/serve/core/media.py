"""A prompt's images and videos, processed the way training processes them (titan_mm.data.vision, the family's
vision layout): each image pad of the prompt becomes one pad per merged visual token, each video pad the video's
placeholder (one run of pads, or the layout's ``<t seconds><|vision_start|>pads<|vision_end|>`` frame groups), and
the family's position builder (DataNeeds.doc_positions) builds the expanded prompt's positions as the data
pipeline does. A family of image splits (DataNeeds.splits: its encoder's tokens between two markers) turns each image
pad into its split instead (:func:`expand_splits`). Audio clips (titan_mm.data.audio, the family's front end) are
expanded first, one pad per audio-tower token (:func:`expand_audio`)."""

from __future__ import annotations

import dataclasses
import hashlib
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from titan_mm.config import Data
from titan_mm.data import audio, vision
from titan_mm.data.processors import ProcessorConfig, check_special_tokens
from titan_mm.data.sources import SkipSample, media_bytes
from titan_mm.registry import DataNeeds
from titan_mm.serve.errors import BadRequest
from titan_mm.serve.core.sequence import Audio, Image

KINDS = ("image", "video")
"""Media kinds of a prompt, in the order the vision tower takes them (and visual_index counts them)."""
MEDIA_KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
"""A span's kind -> the family's batch keys of its patches and grids (the processor's tensors)."""


def expand_media(prompt: list[int], images: list, videos: list, needs: DataNeeds, data: Data, tokenizer):
    """(prompt with each image / video pad replaced by its tokens, [Image] spans in prompt order, its positions
    [axes, L] (M-RoPE's; None for 1-D positions), rope delta). ``images``: PIL images, encoded bytes, ``data:``
    URIs, arrays or MediaItems; ``videos``: encoded video bytes (PyAV decodes them), ``data:video/...`` URIs or
    MediaItems of titan_mm.data.vision.process_video; one per pad of the prompt, in order. ``tokenizer``: the
    model's (a frame group's timestamp is text)."""
    if needs.splits is not None:
        return expand_splits(prompt, images, videos, needs, data, tokenizer)
    pads = {k: needs.special_tokens.get(f"{k}_pad") for k in KINDS}
    given = {"image": images, "video": videos}
    for kind in KINDS:
        _check_pads(prompt, pads[kind], given[kind], kind, needs)
    pcfg = ProcessorConfig(data, needs)
    expand = {"image": _image_tokens, "video": _video_tokens}
    kind_of = {pads[k]: k for k in KINDS if pads[k] is not None and given[k]}
    left = {k: iter(enumerate(given[k])) for k in KINDS}
    out, spans, items = [], [], []
    for t in prompt:
        kind = kind_of.get(t)
        if kind is None:
            out.append(t)
            continue
        i, payload = next(left[kind])
        item, ids = expand[kind](payload, i, pcfg, tokenizer)
        pk, gk = MEDIA_KEYS[kind]
        pv = torch.as_tensor(np.asarray(item.tensors[pk]), dtype=torch.float32)
        grid = torch.as_tensor(np.asarray(item.tensors[gk]), dtype=torch.long).view(1, 3)
        key = int.from_bytes(hashlib.blake2b(kind.encode() + pv.numpy().tobytes() + grid.numpy().tobytes(),
                                             digest_size=8).digest(), "little")
        spans.append(Image(len(out), len(out) + len(ids), pv, grid, key, kind))
        items.append(item)
        out += ids
    build = needs.doc_positions  # None: 1-D positions, which the KV cache plans
    if build is None:
        return out, spans, None, 0
    # the pads are placed by the family's ids (needs.special_tokens), whatever tokenizer came
    pad_ids = types.SimpleNamespace(**{f"{role}_id": t for role, t in needs.special_tokens.items()})
    try:
        pos = torch.from_numpy(build(np.asarray(out, dtype=np.int64), items, pad_ids, pcfg))
    except SkipSample as e:
        raise BadRequest("prompt", str(e)) from None
    return out, spans, pos, int(pos.max()) + 1 - len(out)


def expand_splits(prompt: list[int], images: list, videos: list, needs: DataNeeds, data: Data, tokenizer):
    """expand_media for a family of image splits (DataNeeds.splits): each image pad (``splits.pad``) becomes the
    image's split (``splits.image``: the tokens, tensors and span its training builds), and the prompt's 1-D
    positions [1, L] count text tokens one each and give a split its own offsets, the next token ``advance`` on."""
    splits = needs.splits
    pad = splits.pad(tokenizer)
    _check_pads(prompt, pad, images, "image", needs)
    _check_pads(prompt, None, videos, "video", needs)
    pcfg = ProcessorConfig(data, needs)
    out, spans, pos, cur = [], [], [], 0
    left = iter(enumerate(images))
    for t in prompt:
        if t != pad:
            out.append(t)
            pos.append(cur)
            cur += 1
            continue
        i, payload = next(left)
        if isinstance(payload, vision.MediaItem):
            raise BadRequest(f"images[{i}]", "a MediaItem is the vision processor's; this model builds its own image "
                             "splits: give the image (bytes, a PIL image, a uint8 array or a data: URI)")
        sp = _media_item(payload, f"images[{i}]", "image", lambda p: not isinstance(p, (str, dict)),
                         "image bytes, a PIL image, a uint8 array or a data: URI",
                         lambda p, _: splits.image(p, data, tokenizer), pcfg)
        h = hashlib.blake2b(b"split" + np.asarray(sp.ids, dtype=np.int64).tobytes(), digest_size=8)
        for k in sorted(sp.flat):
            h.update(k.encode() + np.ascontiguousarray(sp.flat[k]).tobytes())
        empty = torch.zeros(0)
        spans.append(Image(len(out), len(out) + len(sp.ids), empty, empty, int.from_bytes(h.digest(), "little"),
                           split=sp))
        out += sp.ids
        pos += [cur + o for o in sp.positions]
        cur += sp.advance
    if not spans:  # text only: the positions count the tokens, as the KV cache plans them
        return out, [], None, 0
    return out, spans, torch.tensor([pos], dtype=torch.long), cur - len(out)


def split_inputs(splits: list[tuple[Image, int, int]], shape: tuple[int, int]) -> dict:
    """The family's batch keys of image splits placed in a step's [B, S] ids (``splits``: (span, row, column of
    its first token)): each per-token key [B, S] (0 elsewhere), each flat key concatenated in order (host)."""
    seq: dict[str, np.ndarray] = {}
    flat: dict[str, list] = {}
    for im, row, col in splits:
        for k, v in im.split.seq.items():
            a = seq.setdefault(k, np.zeros(shape, dtype=np.asarray(v).dtype))
            a[row, col: col + len(v)] = v
        for k, v in im.split.flat.items():
            flat.setdefault(k, []).append(np.asarray(v))
    return ({k: torch.from_numpy(v) for k, v in seq.items()}
            | {k: torch.from_numpy(np.concatenate(v)) for k, v in flat.items()})


def _check_pads(prompt: list[int], pad: int | None, given: list, kind: str, needs: DataNeeds) -> None:
    """One item per pad of its kind, for a model that takes the kind."""
    field = f"{kind}s"
    if given and not needs.takes(kind):
        raise BadRequest(field, f"this model takes no {field}")
    n = sum(1 for t in prompt if t == pad) if pad is not None else 0
    if n != len(given):
        raise BadRequest(field, f"the prompt holds {n} {kind} pad token(s) (id {pad}) but {len(given)} {kind}(s) "
                         f"came; put one pad per {kind} where it goes (the chat template does)")


def _image_tokens(payload, i: int, pcfg: ProcessorConfig, tokenizer) -> tuple[vision.MediaItem, list[int]]:
    """(the processed image, its pads)."""
    item = _media_item(payload, f"images[{i}]", "image", lambda p: not isinstance(p, (str, dict)),
                       "image bytes, a PIL image, an array, a data: URI or a MediaItem of "
                       "titan_mm.data.vision.process_image", vision.process_image, pcfg)
    return item, [pcfg.needs.special_tokens["image_pad"]] * item.n_tokens


def _video_tokens(payload, i: int, pcfg: ProcessorConfig, tokenizer) -> tuple[vision.MediaItem, list[int]]:
    """(the processed video, its placeholder: one run of pads, or the layout's timestamped frame groups)."""
    needs = pcfg.needs
    item = _media_item(payload, f"videos[{i}]", "video", lambda p: isinstance(p, (bytes, bytearray)),
                       "encoded video bytes, a data:video/...;base64 URI or a MediaItem of "
                       "titan_mm.data.vision.process_video", vision.process_video, pcfg)
    if needs.vision_layout.one_run:
        if "video_second_per_grid" not in item.tensors:
            raise BadRequest(f"videos[{i}]", "the MediaItem has no video_second_per_grid; build it with this "
                             "model's processing (titan_mm.data.vision.process_video)")
        return item, [needs.special_tokens["video_pad"]] * item.n_tokens
    try:  # the frame groups' timestamps are text: the tokenizer must be the model's
        check_special_tokens(tokenizer, needs)
    except ValueError as e:
        raise BadRequest("videos", f"this model's videos carry timestamps as text, which needs its own tokenizer: "
                         f"{e}") from None
    return item, vision.video_placeholder_ids(item, tokenizer).tolist()


# ---- audio (the Omni thinkers) ----
def expand_audio(prompt: list[int], audios: list, needs: DataNeeds, data: Data) -> tuple[list[int], list[Audio]]:
    """(prompt with each audio pad repeated per output token of the family's audio tower, [Audio] in prompt
    order), the clips processed as training processes them (titan_mm.data.audio: the family's front end).
    ``audios``: encoded audio bytes (wav, flac: PyAV decodes them), ``data:audio/...`` URIs, 16 kHz mono
    waveforms (1-D float arrays) or MediaItems of titan_mm.data.audio.process_audio; one per audio pad, in order.
    Runs before :func:`expand_media`, whose positions then count the audio pads as text, as the data pipeline's
    do (the Omni thinkers' TMRoPE places a clip alone the same way); :func:`after_media` moves the spans."""
    pad = needs.special_tokens.get("audio_pad")
    if audios and not needs.takes("audio"):
        raise BadRequest("audios", "this model takes no audio")
    n = sum(1 for t in prompt if t == pad) if pad is not None else 0
    if n != len(audios):
        raise BadRequest("audios", f"the prompt holds {n} audio pad token(s) (id {pad}) but {len(audios)} audio "
                         "clip(s) came; put one pad per clip where it goes (the chat template does)")
    if not audios:
        return prompt, []
    pcfg = ProcessorConfig(data, needs)
    out, clips = [], []
    it = iter(audios)
    for t in prompt:
        if t != pad:
            out.append(t)
            continue
        item = _audio_item(next(it), len(clips), pcfg)
        feats = torch.as_tensor(np.asarray(item.tensors["input_features"]), dtype=torch.float32)  # [frames, mels]
        key = int.from_bytes(hashlib.blake2b(b"audio" + feats.numpy().tobytes(), digest_size=8).digest(), "little")
        clips.append(Audio(len(out), len(out) + item.n_tokens, feats, key))
        out += [pad] * item.n_tokens
    return out, clips


def _audio_item(payload, i: int, pcfg: ProcessorConfig) -> vision.MediaItem:
    return _media_item(payload, f"audios[{i}]", "audio", lambda p: isinstance(p, (bytes, bytearray, np.ndarray)),
                       "encoded audio bytes (wav, flac), a data:audio/...;base64 URI, a 16 kHz mono waveform (1-D "
                       "float array) or a MediaItem of titan_mm.data.audio.process_audio", audio.process_audio, pcfg)


def _media_item(payload, field: str, kind: str, raw: Callable[[Any], bool], give: str,
                process: Callable[[Any, ProcessorConfig], vision.MediaItem], pcfg: ProcessorConfig) -> vision.MediaItem:
    """``payload`` as a MediaItem of ``kind``: a MediaItem of that kind as it is, a ``data:`` URI decoded and
    processed, a payload that ``raw`` accepts processed as training processes it; anything else (a path, a URL) is
    refused naming what to ``give``. Every failure is a BadRequest on ``field``."""
    try:
        if isinstance(payload, vision.MediaItem):
            if payload.kind != kind:
                raise SkipSample(f"bad_{kind}", f"a MediaItem of kind {payload.kind!r}; give {give}")
            return payload
        if isinstance(payload, str) and payload.startswith("data:"):
            payload = media_bytes(payload, {}, None)
        elif not raw(payload):
            raise SkipSample(f"bad_{kind}", f"the engine opens no paths or URLs: give {give}")
        return process(payload, pcfg)
    except SkipSample as e:
        raise BadRequest(field, str(e)) from None


def after_media(clips: list[Audio], spans: list[Image]) -> list[Audio]:
    """``clips`` (spans of :func:`expand_audio`'s prompt) moved to the prompt :func:`expand_media` made of it, where
    each of ``spans`` took the place of one pad token."""
    grown, replaced = 0, []  # (the pad's index in the audio-expanded prompt, tokens it grew by)
    for s in spans:
        replaced.append((s.start - grown, s.end - s.start - 1))
        grown += s.end - s.start - 1
    out = []
    for c in clips:
        d = sum(g for at, g in replaced if at < c.start)
        out.append(dataclasses.replace(c, start=c.start + d, end=c.end + d))
    return out


def audio_inputs(clips: list[Audio], groups: list[int], device: torch.device, dtype: torch.dtype) -> dict:
    """The family's batch keys of ``clips`` as the collator makes them: ``input_features`` [n_mels, sum frames]
    (clips side by side, on ``device``) and ``audio_feature_lengths`` [n_clips] (host), with ``audio_groups``
    [n_clips] (host): each clip's request, whose clips the audio tower encodes as one call of their own would, not
    with the other requests' of the step."""
    return {"input_features": torch.cat([c.features for c in clips]).T.to(device, dtype, non_blocking=True),
            "audio_feature_lengths": torch.tensor([c.features.shape[0] for c in clips]),
            "audio_groups": torch.tensor(groups)}
