"""Synthetic Omni-thinker samples and packed batches (tests, benchmarks) for both Omni families: Qwen2.5-Omni
(``Qwen2_5OmniConfig``) and Qwen3-Omni-MoE (``Qwen3OmniMoeConfig``); the module bench/mfu.py's Omni cases name.

A sample is a list of segments: ``("text", n)`` (n random text tokens), ``("image", (h, w))`` (an image of
h x w patches: <|vision_start|> + h*w/merge**2 <|image_pad|> + <|vision_end|>) and ``("audio", frames)`` (a clip
of ``frames`` random log-mel frames, 100 per second: <|audio_start|> + one <|audio_pad|> per audio-encoder output
token + <|audio_end|>, the count of the family's HF audio tower, titan_mm.data.audio.audio_tokens).

:func:`pack` places samples into rows and collates them with the data pipeline's collator
(titan_mm.data.packing.collate_rows: clips side by side as ``input_features [n_mels, sum frames]`` with
``audio_feature_lengths [n_clips]``, the Batch contract of the Omni model.py docstrings); its ``position_ids`` are
the family's TMRoPE positions (the ones its prepare_batch builds, = HF's get_rope_index per document).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from titan_mm.data.packing import Doc, collate_rows
from titan_mm.models.qwen3_vl.synthetic import next_token_labels, place
from titan_mm.registry import spec_for_config

FRAMES_PER_SECOND = 100  # log-mel hop 160 at 16 kHz


def audio_tokens(cfg, frames: int) -> int:
    """<|audio_pad|> tokens of a clip of ``frames`` mel frames for ``cfg``'s audio encoder (its DataNeeds')."""
    return int(spec_for_config(cfg).data_needs(cfg).audio.tokens(int(frames)))


@dataclass
class Sample:
    input_ids: torch.Tensor  # [S] int64
    image_grid_thw: torch.Tensor  # [n_img, 3]
    pixel_values: torch.Tensor  # [n_img_patches, P]
    audio: list[torch.Tensor] = field(default_factory=list)  # per clip [n_mels, frames]


def _special_ids(cfg) -> list[int]:
    return [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
            cfg.audio_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id]


def make_sample(cfg, segments, generator: torch.Generator | None = None, text_vocab: int | None = None) -> Sample:
    """Random tokens, pixels and mel frames for the given segments (see the module docstring). Text tokens stay
    below every special token id (Qwen2.5-Omni's audio tokens sit below its vision ones)."""
    v = cfg.vision
    m2 = v.spatial_merge_size**2
    vocab = text_vocab or min(*_special_ids(cfg), cfg.text.vocab_size)
    ids, grid, pix, audio = [], [], [], []
    for kind, arg in segments:
        if kind == "text":
            ids.append(torch.randint(0, vocab, (int(arg),), generator=generator))
        elif kind == "image":
            h, w = arg
            if h % v.spatial_merge_size or w % v.spatial_merge_size:
                raise ValueError(f"image grid {h}x{w} is not a multiple of the merge size {v.spatial_merge_size}")
            grid.append((1, h, w))
            pix.append(torch.randn(h * w, v.patch_dim, generator=generator))
            ids += [torch.tensor([cfg.vision_start_token_id]), torch.full((h * w // m2,), cfg.image_token_id),
                    torch.tensor([cfg.vision_end_token_id])]
        elif kind == "audio":
            audio.append(torch.randn(cfg.audio.num_mel_bins, int(arg), generator=generator))
            ids += [torch.tensor([cfg.audio_start_token_id]), torch.full((audio_tokens(cfg, arg),), cfg.audio_token_id),
                    torch.tensor([cfg.audio_end_token_id])]
        else:
            raise ValueError(f"unknown segment kind {kind!r}; use 'text', 'image' or 'audio'")
    return Sample(input_ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long),
                  image_grid_thw=torch.tensor(grid, dtype=torch.long).view(-1, 3),
                  pixel_values=torch.cat(pix) if pix else torch.zeros(0, v.patch_dim), audio=audio)


def positions(cfg, batch: dict) -> torch.Tensor:
    """[3, B, S] TMRoPE positions of a collated batch: those the family's prepare_batch builds (on the host)."""
    return spec_for_config(cfg).prepare_batch(cfg, dict(batch), "cpu")["position_ids"]


def pack(samples: list[Sample], cfg, seq_len: int | None = None, rows: int = 1,
         labels: bool = True) -> dict[str, torch.Tensor]:
    """Pack samples greedily into ``rows`` rows of ``seq_len`` tokens (default: all in one row, padded to a
    multiple of 16). Labels are next-token targets within each sample, -100 on media placeholders and padding."""
    pads = torch.tensor([cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id])

    def doc(s: Sample) -> Doc:
        lab = next_token_labels(s.input_ids, pads) if labels else torch.full((len(s.input_ids),), -100)
        media = {}
        if len(s.image_grid_thw):
            media.update(pixel_values=[s.pixel_values.numpy()], image_grid_thw=[s.image_grid_thw.numpy()])
        if s.audio:  # docs keep frames first; the collator gives the batch mels first (MELS_FIRST)
            media.update(input_features=[a.T.numpy() for a in s.audio],
                         audio_feature_lengths=[torch.tensor([a.shape[1]]).numpy() for a in s.audio])
        return Doc(s.input_ids.numpy(), lab.numpy(), media=media, n_patches=int(s.image_grid_thw.prod(-1).sum()))

    placed, seq_len = place(samples, rows, seq_len, doc)
    batch = collate_rows(placed, seq_len, pad_id=0, position_axes=3, multiple=1)
    batch["position_ids"] = positions(cfg, batch)
    return batch
