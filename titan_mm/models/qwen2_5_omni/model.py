"""Qwen2.5-Omni thinker: Qwen2.5-VL's model (titan_mm/models/qwen2_5_vl/model.py: the Qwen2 decoder, the
window-attention ViT, chunked M-RoPE, trunk and head) plus the audio encoder of audio.py, and TMRoPE positions.

Parameter names (titan): ``visual.*`` and ``language_model.*`` as Qwen2.5-VL, ``audio_tower.*`` (audio.py; HF
names in hf.py).

Batch keys (what :func:`prepare_batch` and the forward read):
  input_ids [B, S]                 one <|image_pad|> / <|video_pad|> per merged visual token, one <|AUDIO|>
                                   (``audio_token_id``) per audio-encoder output token
  pixel_values [Ni, P], image_grid_thw [n_images, 3]                        images (Qwen2.5-VL's)
  pixel_values_videos [Nv, P], video_grid_thw [n_videos, 3], video_second_per_grid [n_videos] (float, host)
  input_features [n_mels, T] float: every clip's log-mel frames concatenated along T (as HF flattens them)
  audio_feature_lengths [n_clips] long (host): frames per clip, in the order of ``input_features``
  audio_groups [n_clips] (optional, host): clips encoded as calls of their own per group (the serving engine's
    requests; the audio encoder's build_audio_meta); absent: one group
  use_audio_in_video (bool, optional, host): HF's flag, checked against the tokens (each video's tokens say it)
  doc_ids [B, S] (optional): packed documents; positions restart per document
Media of each kind are numbered row-major over the batch, in the order of their placeholders.

:func:`prepare_batch` (host) consumes the host keys (thinker.CONSUMED_KEYS: the grids, seconds per grid, clip
lengths and the flag; the forward takes none of them) and adds ``position_ids`` [3, B, S] (TMRoPE, = HF's
get_rope_index per document), ``omni_meta`` (the ViT window metadata, the audio chunk metadata) and ``mm_index``
[B, S] (the row of cat(visual tokens, audio tokens) each position takes, -1 on text). A batch without images /
videos (or without audio) gets a stand-in: the tower runs on a tiny zero input and its output enters the graph
times 0, so every rank runs the same encoder collectives (FSDP) whatever its batch holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from titan_mm.nn.media import chunk_bounds, vision_grid_pos
from titan_mm.models.qwen2_5_omni import thinker
from titan_mm.models.qwen2_5_omni.audio import DUMMY_FRAMES, AudioEncoder, build_audio_meta, conv_lengths
from titan_mm.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from titan_mm.models.qwen2_5_omni.thinker import OmniThinker, apply_freeze, param_groups  # noqa: F401 (re-exported)
from titan_mm.models.qwen2_5_vl.model import Qwen2_5_VLModel
from titan_mm.models.qwen2_5_vl.vision import VisionTower, build_window_meta
from titan_mm.models.qwen3.model import Qwen3Model
from titan_mm.models.qwen3_vl.model import EmbedOutput


class Qwen2_5OmniModel(OmniThinker, Qwen2_5_VLModel):
    """Qwen2.5-VL's model (rope, trunk, head) with the audio tower and the thinkers' embed and forward (thinker.py):
    both encoders' tokens placed through one host-built ``mm_index``, TMRoPE positions from :func:`prepare_batch`."""

    def __init__(self, cfg: Qwen2_5OmniConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.language_model = Qwen3Model(cfg.decoder)
        self.visual = VisionTower(cfg.vision, self.language_model.ops)
        self.audio_tower = AudioEncoder(cfg.audio)
        self.embed_out = EmbedOutput()
        apply_freeze(self, cfg)


# ---- TMRoPE (host) ----
def rope_index(ids_L, cfg: Qwen2_5OmniConfig, images: Iterator, videos: Iterator, audios: Iterator) -> np.ndarray:
    """Host side: [3, L] int64 TMRoPE positions of one document, as HF Qwen2.5-Omni's get_rope_index (its
    rules, quirks included: the next part starts after the max of the *last* part, audio-in-video's two start
    and two end tokens share a position). The media iterators yield, in placeholder order, image grids (t, h, w),
    video (grid, seconds per temporal patch) and audio clip frame counts; the batch shares them across documents.
    HF's use_audio_in_video is read per video, from the tokens: a video whose <vision_start> is followed by
    <audio_start> has its audio interleaved (the data pipeline's flag is per video part). Where HF's one flag fits
    the document, the positions are HF's."""
    toks = np.asarray(ids_L).reshape(-1).tolist()
    L, merge, pps = len(toks), cfg.vision.spatial_merge_size, cfg.position_id_per_seconds
    img, vid, aud, a_start = cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id, cfg.audio_start_token_id
    after_vs = [toks[i + 1] for i, t in enumerate(toks[:-1]) if t == cfg.vision_start_token_id]
    n_img, n_aud = after_vs.count(img), toks.count(a_start)
    n_alone, n_vid = after_vs.count(vid), after_vs.count(vid) + after_vs.count(a_start)
    parts: list[np.ndarray] = []

    def nxt() -> int:
        return int(parts[-1].max()) + 1 if parts else 0

    def text(n: int) -> None:
        if n:
            parts.append(np.arange(n)[None].repeat(3, 0) + nxt())

    def first(tok: int, left: int, st: int) -> int:
        return toks.index(tok, st) if left > 0 and tok in toks else L + 1

    st = 0
    for _ in range(n_img + n_alone + n_aud):  # an audio-in-video group counts once, by its <audio_start>
        ei, ev, ea = first(img, n_img, st), first(vid, n_vid, st), first(aud, n_aud, st)
        e = min(ei, ev, ea)
        if e == ea:
            text(e - st - 1)
            text(1)
            n = int(conv_lengths(next(audios))[1])
            text(n)
            text(1)
            st, n_aud = st + (e - st - 1) + n + 2, n_aud - 1
        elif e == ei or toks[e - 1] != a_start:  # an image (t index 0) or a video alone
            text(e - st - 1)
            text(1)
            (t, h, w), sec = (next(images), 1) if e == ei else next(videos)
            parts.append(vision_grid_pos(nxt(), (torch.arange(t) * sec * pps).long().numpy(), h // merge, w // merge))
            text(1)
            st += (e - st - 1) + t * h * w // merge**2 + 2
            n_img, n_vid = (n_img - 1, n_vid) if e == ei else (n_img, n_vid - 1)
        else:  # <vision_start><audio_start> video and audio interleaved per seconds_per_chunk <audio_end><vision_end>
            text(e - st - 2)
            s0 = nxt()
            parts += [np.full((3, 1), s0), np.full((3, 1), s0)]
            s1 = s0 + 1
            n = int(conv_lengths(next(audios))[1])
            a_pos = np.arange(n)[None].repeat(3, 0) + s1
            grid, sec = next(videos)
            v_pos = vision_grid_pos(s1, (torch.arange(grid[0]) * sec * pps).long().numpy(), grid[1] // merge,
                                    grid[2] // merge)
            per = int(pps * cfg.seconds_per_chunk)
            vc, ac = chunk_bounds(v_pos[0] - s1, per), chunk_bounds(a_pos[0] - s1, per)
            for j in range(max(len(vc), len(ac))):
                parts += [v_pos[:, a:b] for a, b in vc[j:j + 1]] + [a_pos[:, a:b] for a, b in ac[j:j + 1]]
            s2 = nxt()
            parts += [np.full((3, 1), s2), np.full((3, 1), s2)]
            n_v = grid[0] * grid[1] * grid[2] // merge**2
            st, n_aud, n_vid = st + (e - st - 2) + n + n_v + 4, n_aud - 1, n_vid - 1
    text(L - st)
    pos = np.concatenate(parts, 1) if parts else np.zeros((3, 0), np.int64)
    if pos.shape[1] != L:
        raise ValueError(f"a document of {L} tokens has {pos.shape[1]} TMRoPE positions: its placeholders do not match "
                         "its media (pads per image / video / clip, start and end tokens, use_audio_in_video)")
    return pos.astype(np.int64)


AUDIO = thinker.OmniAudio(build_audio_meta, lambda frames: conv_lengths(frames)[1], DUMMY_FRAMES)


def prepare_batch(cfg: Qwen2_5OmniConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The family's ModelSpec.prepare_batch (thinker.prepare_batch): TMRoPE ``position_ids`` by :func:`rope_index`
    per document, the window ViT's and the audio encoder's metadata and ``mm_index``."""
    return thinker.prepare_batch(cfg, batch, device, rope_index, build_window_meta, AUDIO)


build = Qwen2_5OmniModel  # under the caller's device context (``with torch.device("meta"):`` in the trainer)
