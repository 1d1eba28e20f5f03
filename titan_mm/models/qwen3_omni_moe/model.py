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
  use_audio_in_video (bool, optional, host): HF's flag, accepted and not read (each video's tokens say it)
  doc_ids [B, S] (optional): packed documents; positions restart per document
Media of each kind are numbered row-major over the batch, in the order of their placeholders.

:func:`prepare_batch` (host) adds ``position_ids`` [3, B, S] (= HF's get_rope_index per document; int64, or
float32 when a video's second_per_grid * position_id_per_seconds is fractional, as HF's are), ``omni_meta`` (the
ViT metadata, the audio chunk / window metadata) and ``mm_index`` [B, S] (the row of cat(visual tokens, audio
tokens) each position takes, -1 on text). A batch without images / videos (or without audio) gets a stand-in: the
tower runs on a tiny zero input and its output enters the graph times 0, so every rank runs the same encoder
collectives (FSDP) whatever its batch holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn as nn

from titan_mm.nn.media import merge_by_time
from titan_mm.nn.attention import AttnMeta
from titan_mm.nn.output import ModelOutput, Stream
from titan_mm.models.qwen2_5_omni.model import _documents, apply_freeze, param_groups
from titan_mm.models.qwen3.model import Qwen3Model, select_ops
from titan_mm.models.qwen3_omni_moe.audio import DUMMY_FRAMES, AudioEncoder, AudioMeta, build_audio_meta, output_lengths
from titan_mm.models.qwen3_omni_moe.config import Qwen3OmniMoeConfig
from titan_mm.models.qwen3_vl.model import EmbedOutput, Qwen3VLModel, _vision_backend, visual_index
from titan_mm.models.qwen3_vl.vision import VisionMeta, VisionTower, build_vision_meta


class OmniMeta(NamedTuple):
    """Host-built encoder metadata of one micro-batch (:func:`prepare_batch`)."""

    vision: VisionMeta
    """Over the images then the videos, or over the stand-in image."""
    audio: AudioMeta
    """Over the clips, or over the stand-in clip."""
    n_visual: int
    """Merged visual tokens (rows of mm_index below this are visual and take the DeepStack additions)."""
    vision_dummy: bool
    audio_dummy: bool


class Qwen3OmniMoeModel(Qwen3VLModel):
    """Qwen3-VL's model (rope, trunk, head) with the audio tower and an embed that places both encoders' tokens
    through one host-built ``mm_index``."""

    def __init__(self, cfg: Qwen3OmniMoeConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.visual = VisionTower(cfg.vision, select_ops(cfg.kernels).bias_gelu)
        self.language_model = Qwen3Model(cfg.text)
        self.audio_tower = AudioEncoder(cfg.audio)
        self.embed_out = EmbedOutput()
        apply_freeze(self, cfg)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        super().init_weights(buffer_device)
        self.audio_tower.init_weights(self.cfg.audio.initializer_range)
        self.audio_tower.init_buffers(buffer_device)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        super().init_buffers(buffer_device)
        self.audio_tower.init_buffers(buffer_device)

    def embed(self, input_ids: torch.Tensor, pixel_values=None, pixel_values_videos=None, input_features=None,
              omni_meta: OmniMeta | None = None, mm_index: torch.Tensor | None = None) -> Stream:
        """Token embeddings with the visual and audio tokens placed by ``mm_index`` and the DeepStack additions on
        the visual positions; without ``omni_meta`` (a text-only batch that skipped prepare_batch, e.g. serving)
        the encoders do not run."""
        h_BSD = self.language_model.tok_embeddings(input_ids)
        media = [x for x in (pixel_values, pixel_values_videos, input_features) if x is not None and x.numel()]
        if omni_meta is None or mm_index is None:
            if media:
                raise ValueError("media inputs were given without omni_meta / mm_index; build them on the host with "
                                 "titan_mm.models.qwen3_omni_moe.model.prepare_batch(cfg, batch, device).")
            h_BSD, _ = self.embed_out(h_BSD, [])
            return Stream(h_BSD)
        v, a = self.cfg.vision, self.cfg.audio
        if omni_meta.vision_dummy:
            pix = self.visual.patch_embed.weight.new_zeros(v.spatial_merge_size**2, v.patch_dim)
        else:
            pix = torch.cat([x for x in (pixel_values, pixel_values_videos) if x is not None and x.numel()])
        merged, deepstack = self.visual(pix, omni_meta.vision)
        feats = self.audio_tower.conv2d1.weight.new_zeros(a.num_mel_bins, DUMMY_FRAMES) if omni_meta.audio_dummy \
            else input_features
        audio = self.audio_tower(feats, omni_meta.audio)
        B, S = input_ids.shape
        dt = h_BSD.dtype
        idx_N = mm_index.reshape(-1)
        sel = idx_N.clamp(min=0)
        tokens = torch.cat([merged.to(dt), audio.to(dt)])
        h_ND = torch.where((idx_N >= 0)[:, None], tokens.index_select(0, sel), h_BSD.reshape(B * S, -1))
        adds = []
        if omni_meta.vision_dummy:  # stand-ins place nothing; times 0 keeps their tower in the graph
            h_ND = h_ND + sum(x.sum() for x in (merged, *deepstack)).to(dt) * 0.0
        else:
            vis = ((idx_N >= 0) & (idx_N < omni_meta.n_visual))[:, None]
            sel_v = sel.clamp(max=omni_meta.n_visual - 1)
            adds = [torch.where(vis, ds.to(dt).index_select(0, sel_v), 0.0).view(B, S, -1) for ds in deepstack]
        if omni_meta.audio_dummy:
            h_ND = h_ND + audio.sum().to(dt) * 0.0
        h_BSD, adds = self.embed_out(h_ND.view(B, S, -1), adds)
        return Stream(h_BSD, None, tuple(adds))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn: AttnMeta | None = None,
        labels: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        omni_meta: OmniMeta | None = None,
        mm_index: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        audio_feature_lengths: torch.Tensor | None = None,
        use_audio_in_video: bool | None = None,
        loss_weights: torch.Tensor | None = None,
    ) -> ModelOutput:
        """position_ids [3, B, S] (or [B, S] for text only; default arange); ``omni_meta`` / ``mm_index`` from
        :func:`prepare_batch`. The grids, second_per_grid, audio lengths and use_audio_in_video are accepted for
        interface compatibility and not read (prepare_batch turned them into metadata on the host)."""
        lm = self.language_model
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        stream = self.embed(input_ids, pixel_values, pixel_values_videos, input_features, omni_meta, mm_index)
        stream = lm.trunk(stream, self.rope(position_ids, stream.h.dtype), attn)
        out = lm.head(stream, attn, labels, logits_at, loss_weights)
        return out if attn is None else out._replace(kv_cache=attn.kv_cache)


# ---- positions (host): HF Qwen3-Omni's get_rope_index ----
def _vision_pos(start: float, t_index: np.ndarray, lh: int, lw: int) -> np.ndarray:
    """[3, t * lh * lw]: (t, h, w) of one image / video's merged tokens, frames then rows then columns."""
    n = len(t_index)
    return np.stack([t_index.repeat(lh * lw), np.tile(np.arange(lh).repeat(lw), n), np.tile(np.arange(lw), n * lh)]) \
        + start


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
        return _vision_pos(start, np.arange(t, dtype=np.float32) * np.float32(sec) * pps, h // merge, w // merge)

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
            parts.append(_vision_pos(s, np.arange(t) * pps, h // merge, w // merge))
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


def omni_positions(cfg: Qwen3OmniMoeConfig, batch: dict[str, Any]) -> torch.Tensor:
    """[3, B, S] on the host: :func:`rope_index` per document (padding keeps 0); int64 when every position is
    whole, else float32 (HF's dtype)."""
    ids = batch["input_ids"].cpu()
    grids = {k: batch[k].cpu().tolist() if batch.get(k) is not None else []
             for k in ("image_grid_thw", "video_grid_thw")}
    secs = batch.get("video_second_per_grid")
    if grids["video_grid_thw"] and secs is None:
        raise ValueError("a batch with videos needs video_second_per_grid (seconds per temporal patch, per video).")
    secs = torch.as_tensor(secs if secs is not None else [], dtype=torch.float32).cpu().reshape(-1).tolist()
    lens = batch.get("audio_feature_lengths")
    images, audios = iter(grids["image_grid_thw"]), iter([] if lens is None else lens.cpu().tolist())
    videos = iter(zip(grids["video_grid_thw"], secs))
    pos = np.zeros((3, *ids.shape))
    for b, a, e in _documents(batch):
        pos[:, b, a:e] = rope_index(ids[b, a:e], cfg, images, videos, audios)
    whole = np.array_equal(pos, np.round(pos))
    return torch.from_numpy(pos.astype(np.int64) if whole else pos.astype(np.float32))


def encoder_inputs(cfg: Qwen3OmniMoeConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Host side: ``{"omni_meta", "mm_index"}`` (on ``device``) for any batch, stand-ins included."""
    device = torch.device(device)
    ids = batch["input_ids"].cpu()
    m = cfg.vision.spatial_merge_size
    m2 = m * m
    has = {k: batch.get(k) is not None and batch[k].numel() > 0
           for k in ("pixel_values", "pixel_values_videos", "input_features")}
    grids = [batch[g].cpu() for p, g in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
             if has[p]]
    n_img = int((grids[0].prod(-1) // m2).sum()) if has["pixel_values"] else 0
    grid = torch.cat(grids) if grids else torch.tensor([[1, m, m]])  # stand-in: one merged token
    n_visual = int((grid.prod(-1) // m2).sum())
    vision = build_vision_meta(grid, cfg.vision, _vision_backend(cfg, device), device)._replace(n_image_tokens=n_img)
    idx = visual_index(ids, cfg.image_token_id, cfg.video_token_id, n_img) if grids else torch.full_like(ids, -1)
    if grids and int((idx >= 0).sum()) != n_visual:
        raise ValueError(f"{int((idx >= 0).sum())} image / video placeholders for {n_visual} merged visual tokens; "
                         "the data pipeline must place one per merged token.")
    has_audio = has["input_features"]
    if has_audio and batch.get("audio_feature_lengths") is None:
        raise ValueError("batch has input_features but no audio_feature_lengths (mel frames per clip).")
    lens = batch["audio_feature_lengths"].cpu() if has_audio else torch.tensor([DUMMY_FRAMES])
    audio = build_audio_meta(lens, cfg.audio, _vision_backend(cfg, device), device)
    pads = ids == cfg.audio_token_id
    n_out = int(output_lengths(lens.numpy()).sum()) if has_audio else 0
    if int(pads.sum()) != n_out:
        raise ValueError(f"{int(pads.sum())} <|audio_pad|> placeholders for {n_out} audio tokens "
                         f"(audio_feature_lengths {lens.tolist() if has_audio else []}); the data pipeline must place "
                         "one per output token.")
    idx[pads] = n_visual + torch.arange(n_out)  # audio rows follow the visual ones
    meta = OmniMeta(vision, audio, n_visual, vision_dummy=not grids, audio_dummy=not has_audio)
    return {"omni_meta": meta, "mm_index": idx.to(device, non_blocking=True)}


def prepare_batch(cfg: Qwen3OmniMoeConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The family's ModelSpec.prepare_batch, on the host before the batch moves to the device and before any
    context-parallel split: the batch with ``position_ids`` and :func:`encoder_inputs`."""
    return {**batch, "position_ids": omni_positions(cfg, batch), **encoder_inputs(cfg, batch, device)}


def build(cfg: Qwen3OmniMoeConfig) -> Qwen3OmniMoeModel:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen3OmniMoeModel(cfg)


__all__ = ["OmniMeta", "Qwen3OmniMoeModel", "build", "encoder_inputs", "omni_positions", "param_groups",
           "prepare_batch", "rope_index"]
