"""Synthetic Qwen3-VL samples and packed batches (tests, benchmarks).

A sample is a list of segments: ``("text", n)`` (n random text tokens), ``("image", (h, w))`` (an image of
h x w patches: <|vision_start|> + h*w/merge**2 <|image_pad|> + <|vision_end|>), ``("video", (t, h, w))``
(t temporal patches; each frame is preceded by a timestamp text token and wrapped in start/end tokens, as
the Qwen3-VL processor lays videos out).

:func:`pack` places samples into rows and collates them with the data pipeline's collator
(titan_mm.data.packing.collate_rows; the Batch contract in docs/architecture.md); each sample's [3, S]
M-RoPE positions come from titan_mm.nn.media.mrope_index (= HF's ``get_rope_index``, parity-tested).
:func:`synthetic_vl_batch` builds a packed image+text batch of N tokens for a config (bench/mfu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_mm.data.packing import Doc, collate_rows
from titan_mm.nn.media import mrope_index
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig


@dataclass
class Sample:
    input_ids: torch.Tensor  # [S] int64
    mm_type: torch.Tensor  # [S] int64: 0 text, 1 image, 2 video
    image_grid_thw: torch.Tensor  # [n_img, 3]
    video_grid_thw: torch.Tensor  # [n_vid, 3]
    pixel_values: torch.Tensor  # [n_img_patches, P]
    pixel_values_videos: torch.Tensor  # [n_vid_patches, P]


def make_sample(cfg: Qwen3VLConfig, segments, generator: torch.Generator | None = None,
                text_vocab: int | None = None) -> Sample:
    """Random tokens and pixels for the given segments (see the module docstring)."""
    v = cfg.vision
    m = v.spatial_merge_size
    vocab = text_vocab or min(cfg.vision_start_token_id, cfg.text.vocab_size)
    ids, types, igrid, vgrid, ipix, vpix = [], [], [], [], [], []

    def text(n):
        ids.append(torch.randint(0, vocab, (n,), generator=generator))
        types.append(torch.zeros(n, dtype=torch.long))

    def visual(tok, typ, n):
        ids.append(torch.tensor([cfg.vision_start_token_id]))
        types.append(torch.zeros(1, dtype=torch.long))
        ids.append(torch.full((n,), tok))
        types.append(torch.full((n,), typ))
        ids.append(torch.tensor([cfg.vision_end_token_id]))
        types.append(torch.zeros(1, dtype=torch.long))

    for kind, arg in segments:
        if kind == "text":
            text(arg)
        elif kind == "image":
            h, w = arg
            igrid.append((1, h, w))
            ipix.append(torch.randn(h * w, v.patch_dim, generator=generator))
            visual(cfg.image_token_id, 1, h * w // m**2)
        elif kind == "video":
            t, h, w = arg
            vgrid.append((t, h, w))
            vpix.append(torch.randn(t * h * w, v.patch_dim, generator=generator))
            for _ in range(t):
                text(1)  # timestamp token(s) before each frame
                visual(cfg.video_token_id, 2, h * w // m**2)
        else:
            raise ValueError(f"unknown segment kind {kind!r}; use 'text', 'image' or 'video'")
    P = v.patch_dim
    return Sample(
        input_ids=torch.cat(ids),
        mm_type=torch.cat(types),
        image_grid_thw=torch.tensor(igrid, dtype=torch.long).view(-1, 3),
        video_grid_thw=torch.tensor(vgrid, dtype=torch.long).view(-1, 3),
        pixel_values=torch.cat(ipix) if ipix else torch.zeros(0, P),
        pixel_values_videos=torch.cat(vpix) if vpix else torch.zeros(0, P),
    )


def place(samples, rows: int, seq_len: int | None, doc) -> tuple[list[list[Doc]], int]:
    """Samples placed greedily into ``rows`` rows of ``seq_len`` tokens (default: all in one row, padded to a
    multiple of 16), each as ``doc(sample)`` (a Doc); -> (rows of docs, seq_len)."""
    lens = [len(s.input_ids) for s in samples]
    if seq_len is None:
        seq_len = -(-sum(lens) // 16) * 16
    placed: list[list[Doc]] = [[] for _ in range(rows)]
    r, off = 0, 0
    for s in samples:
        n = len(s.input_ids)
        if off + n > seq_len:
            r, off = r + 1, 0
            if r >= rows or n > seq_len:
                raise ValueError(f"samples ({lens}) do not fit in {rows} rows of {seq_len} tokens")
        placed[r].append(doc(s))
        off += n
    return placed, seq_len


def next_token_labels(ids: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Next-token targets within one sample, -100 where the target is one of the ``masked`` ids and at the end."""
    lab = torch.full((len(ids),), -100, dtype=torch.long)
    if len(ids) > 1:
        tgt = ids[1:].clone()
        tgt[torch.isin(tgt, masked)] = -100
        lab[:-1] = tgt
    return lab


def pack(samples: list[Sample], cfg: Qwen3VLConfig, seq_len: int | None = None, rows: int = 1,
         labels: bool = True) -> dict[str, torch.Tensor]:
    """Pack samples greedily into ``rows`` rows of ``seq_len`` tokens (default: all in one row, padded to
    a multiple of 16). Labels are next-token targets within each sample, -100 on visual pads and padding."""
    pads = torch.tensor([cfg.image_token_id, cfg.video_token_id])

    def doc(s: Sample) -> Doc:
        lab = torch.full((len(s.input_ids),), -100, dtype=torch.long)
        if labels:
            lab = next_token_labels(s.input_ids, pads)
            lab[:-1][s.mm_type[1:] != 0] = -100
        media = {}
        if len(s.image_grid_thw):
            media.update(pixel_values=[s.pixel_values.numpy()], image_grid_thw=[s.image_grid_thw.numpy()])
        if len(s.video_grid_thw):
            media.update(pixel_values_videos=[s.pixel_values_videos.numpy()], video_grid_thw=[s.video_grid_thw.numpy()])
        pos = mrope_index(s.mm_type.numpy(), s.image_grid_thw, s.video_grid_thw, cfg.vision.spatial_merge_size)
        return Doc(s.input_ids.numpy(), lab.numpy(), positions=pos, media=media)

    placed, seq_len = place(samples, rows, seq_len, doc)
    return collate_rows(placed, seq_len, pad_id=0, position_axes=3, multiple=1)


def synthetic_vl_batch(cfg: Qwen3VLConfig, num_tokens: int = 8192, rows: int = 1, image_hw: tuple[int, int] = (32, 32),
                       text_per_sample: int = 512, seed: int = 0) -> dict[str, torch.Tensor]:
    """A packed image+text batch of ``rows`` rows x ``num_tokens`` tokens: samples of one image of
    ``image_hw`` patches (default 32x32 patches = 512x512 px for patch 16 -> 256 LLM tokens) followed by
    ``text_per_sample`` text tokens, packed until the rows are full (the tail is text-only)."""
    g = torch.Generator().manual_seed(seed)
    m = cfg.vision.spatial_merge_size
    per = image_hw[0] * image_hw[1] // m**2 + 2 + text_per_sample
    samples, budget = [], num_tokens * rows
    while True:
        row_left = num_tokens - (sum(len(s.input_ids) for s in samples) % num_tokens if samples else 0)
        if budget < per:
            break
        if row_left < per:
            samples.append(make_sample(cfg, [("text", row_left)], g))
            budget -= row_left
            continue
        samples.append(make_sample(cfg, [("image", image_hw), ("text", text_per_sample)], g))
        budget -= per
    if budget > 0:
        samples.append(make_sample(cfg, [("text", budget)], g))
    return pack(samples, cfg, seq_len=num_tokens, rows=rows)
