"""Qwen3-Omni-MoE thinker: Qwen3-VL-MoE's model (titan_mm/models/qwen3_vl/model.py: the Qwen3-MoE decoder, the ViT
with DeepStack, interleaved M-RoPE, trunk and head) plus the audio encoder of audio.py, with positions built on the
host by HF's Qwen3-Omni ``get_rope_index`` rules.

Parameter names (titan): ``visual.*`` and ``language_model.*`` as Qwen3-VL, ``audio_tower.*`` (audio.py; HF names
in hf.py).

Batch keys (what :func:`prepare_batch` and the forward read):
  input_ids [B, S]                 one <|image_pad|> / <|video_pad|> per merged visual token, one <|audio_pad|>
                                   (``audio_token_id``) per audio-encoder output token
  pixel_values [Ni, P], image_grid_thw [n_images, 3]                        images (Qwen3-VL's)
  pixel_values_videos [Nv, P], video_grid_thw [n_videos, 3], video_second_per_grid [n_videos] (float, host)
  input_features [n_mels, T] float: every clip's log-mel frames concatenated along T (as HF flattens them)
  audio_feature_lengths [n_clips] long (host): frames per clip, in the order of ``input_features``
  audio_groups [n_clips] (optional, host): clips encoded as calls of their own per group (the serving engine's
    requests; the audio encoder's build_audio_meta); absent: one group
  use_audio_in_video (bool, optional, host): HF's flag, checked against the tokens (each video's tokens say it)
  doc_ids [B, S] (optional): packed documents; positions restart per document
Media of each kind are numbered row-major over the batch, in the order of their placeholders.

:func:`prepare_batch` (host) consumes the host keys (thinker.CONSUMED_KEYS: the grids, seconds per grid, clip
lengths and the flag; the forward takes none of them) and adds ``position_ids`` [3, B, S] (= HF's get_rope_index
per document; int64, or float32 when a video's second_per_grid * position_id_per_seconds is fractional, as HF's
are), ``omni_meta`` (the ViT metadata, the audio chunk / window metadata) and ``mm_index`` [B, S] (the row of
cat(visual tokens, audio tokens) each position takes, -1 on text). A batch without images / videos (or without
audio) gets a stand-in: the tower runs on a tiny zero input and its output enters the graph times 0, so every
rank runs the same encoder collectives (FSDP) whatever its batch holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from titan_mm.nn.media import merge_by_time, vision_grid_pos
from titan_mm.models.qwen2_5_omni import thinker
from titan_mm.models.qwen2_5_omni.thinker import OmniMeta, OmniThinker, apply_freeze, param_groups  # noqa: F401 (re-exported)
from titan_mm.models.qwen3.model import Qwen3Model, select_ops
from titan_mm.models.qwen3_omni_moe.audio import DUMMY_FRAMES, AudioEncoder, build_audio_meta, output_lengths
from titan_mm.models.qwen3_omni_moe.config import Qwen3OmniMoeConfig
from titan_mm.models.qwen3_vl.model import EmbedOutput, Qwen3VLModel
from titan_mm.models.qwen3_vl.vision import VisionTower, build_vision_meta


class Qwen3OmniMoeModel(OmniThinker, Qwen3VLModel):
    """Qwen3-VL's model (rope, trunk, head) with the audio tower and the thinkers' embed and forward
    (qwen2_5_omni/thinker.py): both encoders' tokens placed through one host-built ``mm_index``, DeepStack added on
    the visual ones."""

    def __init__(self, cfg: Qwen3OmniMoeConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.visual = VisionTower(cfg.vision, select_ops(cfg.kernels))
        self.language_model = Qwen3Model(cfg.text)
        self.audio_tower = AudioEncoder(cfg.audio)
        self.embed_out = EmbedOutput()
        apply_freeze(self, cfg)


# ---- positions (host): HF Qwen3-Omni's get_rope_index ----
def rope_index(ids_L, cfg: Qwen3OmniMoeConfig, images: Iterator, videos: Iterator, audios: Iterator) -> np.ndarray:
    """Host side: [3, L] float64 positions of one document, by HF Qwen3-Omni's get_rope_index rules: each part
    starts after the max of the previous one (of its *last* slice: an audio-in-video part's trailing run of one
    kind, HF's quirk); an audio-in-video part (<vision_start><audio_start> ... <audio_end><vision_end>) gives its
    two start and two end tokens consecutive positions and merges the video and audio tokens by temporal position
    (video first on ties). The media iterators yield, in placeholder order, image grids (t, h, w), video (grid,
    seconds per temporal patch) and audio clip frame counts; the batch shares them across documents. HF's
    use_audio_in_video is read per video, from the tokens: a video whose <vision_start> is followed by
    <audio_start> has its audio interleaved (the data pipeline's flag is per video part). Where HF's one flag fits
    the document, the positions are HF's."""
    toks = np.asarray(ids_L).reshape(-1).tolist()
    L, merge, pps = len(toks), cfg.vision.spatial_merge_size, np.float32(cfg.position_id_per_seconds)
    img, vid, aud, a_start, v_start = (cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id,
                                       cfg.audio_start_token_id, cfg.vision_start_token_id)
    after_vs = [toks[i + 1] for i, t in enumerate(toks[:-1]) if t == v_start]
    rem_i, rem_a = after_vs.count(img), toks.count(a_start)
    n_alone, rem_v = after_vs.count(vid), after_vs.count(vid) + after_vs.count(a_start)
    parts: list[np.ndarray] = []

    def nxt() -> float:
        return parts[-1].max() + 1 if parts else 0

    def run(n: int, start: float) -> np.ndarray:
        return np.arange(n)[None].repeat(3, 0) + start

    def video_pos(start: float, grid, sec) -> np.ndarray:  # t in float32, as HF multiplies
        (t, h, w) = grid
        return vision_grid_pos(start, np.arange(t, dtype=np.float32) * np.float32(float(sec)) * pps, h // merge, w // merge)

    st = 0
    for _ in range(rem_i + n_alone + rem_a):  # an audio-in-video group counts once, by its <audio_start>
        s = nxt()
        ev = toks.index(v_start, st) if (img in toks or vid in toks) and (rem_v > 0 or rem_i > 0) else L + 1
        ea = toks.index(a_start, st) if aud in toks and rem_a > 0 else L + 1
        e = min(ev, ea)
        if e - st:
            parts.append(run(e - st, s))
            s += e - st
        both = e == ev and ev + 1 == ea
        nb = 2 if both else 1  # start (and end) tokens
        parts.append(run(nb, s))
        s += nb
        if e == ea:
            n = int(output_lengths(next(audios)))
            parts.append(run(n, s))
            rem_a -= 1
        elif toks[ev + 1] == img:
            t, h, w = next(images)
            parts.append(vision_grid_pos(s, np.arange(t) * pps, h // merge, w // merge))
            n, rem_i = t * h * w // merge**2, rem_i - 1
        elif toks[ev + 1] == vid:
            grid, sec = next(videos)
            parts.append(video_pos(s, grid, sec))
            n, rem_v = int(np.prod(grid)) // merge**2, rem_v - 1
        elif both:
            na = int(output_lengths(next(audios)))
            grid, sec = next(videos)
            v_pos = video_pos(s, grid, sec)
            order = merge_by_time(v_pos[0], np.arange(na) + s)
            pos = np.concatenate([v_pos, run(na, s)], 1)[:, order]
            is_audio = order >= v_pos.shape[1]
            other = np.flatnonzero(is_audio != is_audio[-1])
            cut = int(other[-1]) + 1 if other.size else 0
            parts += [pos[:, :cut], pos[:, cut:]]  # HF's last slice: the run left when the other kind ran out
            n = pos.shape[1]
            rem_a, rem_v = rem_a - 1, rem_v - 1
        else:
            raise ValueError(f"<vision_start> at {ev} is followed by {toks[ev + 1]}, not an image, video or audio "
                             "start token")
        st += (e - st) + 2 * nb + n
        parts.append(run(nb, nxt()))
    if st < L:
        parts.append(run(L - st, nxt()))
    pos = np.concatenate(parts, 1) if parts else np.zeros((3, 0))
    if pos.shape[1] != L:
        raise ValueError(f"a document of {L} tokens has {pos.shape[1]} positions: its placeholders do not match its "
                         "media (pads per image / video / clip, start and end tokens, audio in video)")
    return pos


AUDIO = thinker.OmniAudio(build_audio_meta, output_lengths, DUMMY_FRAMES)


def prepare_batch(cfg: Qwen3OmniMoeConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The family's ModelSpec.prepare_batch (qwen2_5_omni/thinker.py's, with this family's :func:`rope_index`, ViT
    metadata and audio encoder): ``position_ids``, the encoders' metadata and ``mm_index``."""
    return thinker.prepare_batch(cfg, batch, device, rope_index, build_vision_meta, AUDIO)


build = Qwen3OmniMoeModel  # under the caller's device context (``with torch.device("meta"):`` in the trainer)

__all__ = ["OmniMeta", "Qwen3OmniMoeModel", "build", "param_groups", "prepare_batch", "rope_index"]
