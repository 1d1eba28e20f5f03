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
  use_audio_in_video (bool, optional, host): HF's flag, accepted and not read (each video's tokens say it)
  doc_ids [B, S] (optional): packed documents; positions restart per document
Media of each kind are numbered row-major over the batch, in the order of their placeholders.

:func:`prepare_batch` (host) adds ``position_ids`` [3, B, S] (TMRoPE, = HF's get_rope_index per document),
``omni_meta`` (the ViT window metadata, the audio chunk metadata) and ``mm_index`` [B, S] (the row of
cat(visual tokens, audio tokens) each position takes, -1 on text). A batch without images / videos (or without
audio) gets a stand-in: the tower runs on a tiny zero input and its output enters the graph times 0, so every
rank runs the same encoder collectives (FSDP) whatever its batch holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn as nn

from titan_mm.nn.media import chunk_bounds
from titan_mm.nn.attention import AttnMeta
from titan_mm.nn.output import ModelOutput, Stream
from titan_mm.models.qwen2_5_omni.audio import DUMMY_FRAMES, AudioEncoder, AudioMeta, build_audio_meta, conv_lengths
from titan_mm.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from titan_mm.models.qwen2_5_vl.model import Qwen2_5_VLModel
from titan_mm.models.qwen2_5_vl.vision import VisionTower, WindowMeta, build_window_meta
from titan_mm.models.qwen3.model import Qwen3Model
from titan_mm.models.qwen3_vl.model import EmbedOutput, _vision_backend
from titan_mm.models.qwen3_vl.model import param_kind as vl_param_kind
from titan_mm.models.qwen3_vl.model import visual_index


class OmniMeta(NamedTuple):
    """Host-built encoder metadata of one micro-batch (:func:`prepare_batch`)."""

    vision: WindowMeta
    """Over the images then the videos, or over the stand-in image."""
    audio: AudioMeta
    """Over the clips, or over the stand-in clip."""
    vision_dummy: bool
    audio_dummy: bool


# ---- training modes: Qwen3-VL's parts plus "audio" (the whole audio encoder) ----
def param_kind(name: str) -> str:
    return "audio" if "audio_tower." in name else vl_param_kind(name)


def apply_freeze(model: nn.Module, cfg: Qwen2_5OmniConfig) -> None:
    frozen = {"vision": cfg.freeze_vision, "merger": cfg.freeze_merger, "llm": cfg.freeze_llm,
              "audio": cfg.freeze_audio}
    if all(frozen.values()):
        raise ValueError("freeze_vision, freeze_merger, freeze_llm and freeze_audio are all true: nothing would train.")
    for name, p in model.named_parameters():
        if frozen[param_kind(name)]:
            p.requires_grad_(False)


def param_groups(model: nn.Module, cfg: Qwen2_5OmniConfig, groups: list[dict[str, Any]], base_lr: float) -> list[dict]:
    """Qwen3-VL's split (qwen3_vl.model.param_groups) with the audio encoder as its own part at ``audio_lr``."""
    pick = lambda *lrs: next((x for x in lrs if x is not None), base_lr)  # noqa: E731
    lrs = {"vision": pick(cfg.vision_lr), "merger": pick(cfg.merger_lr, cfg.vision_lr), "llm": pick(cfg.llm_lr),
           "audio": pick(cfg.audio_lr)}
    kind_of = {id(p): param_kind(n) for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for g in groups:
        by: dict[str, list] = {}
        for p in g["params"]:
            by.setdefault(kind_of.get(id(p), "llm"), []).append(p)
        for kind, ps in by.items():  # initial_lr: LambdaLR schedules scale it, so per-part peaks survive
            out.append({**g, "params": ps, "lr": lrs[kind], "initial_lr": lrs[kind],
                        "name": f"{g.get('name', 'group')}/{kind}"})
    return out


class Qwen2_5OmniModel(Qwen2_5_VLModel):
    """Qwen2.5-VL's model (rope, trunk, head) with the audio tower and an embed that places both encoders'
    tokens through one host-built ``mm_index``."""

    def __init__(self, cfg: Qwen2_5OmniConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.language_model = Qwen3Model(cfg.decoder)
        self.visual = VisionTower(cfg.vision, self.language_model.ops)
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
        """Token embeddings with the visual and audio tokens placed by ``mm_index``; without ``omni_meta`` (a
        text-only batch that skipped prepare_batch, e.g. serving) the encoders do not run."""
        h_BSD = self.language_model.tok_embeddings(input_ids)
        media = [x for x in (pixel_values, pixel_values_videos, input_features) if x is not None and x.numel()]
        if omni_meta is None or mm_index is None:
            if media:
                raise ValueError("media inputs were given without omni_meta / mm_index; build them on the host with "
                                 "titan_mm.models.qwen2_5_omni.model.prepare_batch(cfg, batch, device).")
            h_BSD, _ = self.embed_out(h_BSD, [])
            return Stream(h_BSD)
        v, a = self.cfg.vision, self.cfg.audio
        pw, cw = self.visual.patch_embed.weight, self.audio_tower.conv1.weight
        if omni_meta.vision_dummy:
            pix = pw.new_zeros(v.spatial_merge_size**2, v.patch_dim)
        else:
            pix = torch.cat([x for x in (pixel_values, pixel_values_videos) if x is not None and x.numel()])
        merged, _ = self.visual(pix, omni_meta.vision)
        feats = cw.new_zeros(a.num_mel_bins, DUMMY_FRAMES) if omni_meta.audio_dummy else input_features
        audio = self.audio_tower(feats, omni_meta.audio)
        B, S = input_ids.shape
        tokens = torch.cat([merged.to(h_BSD.dtype), audio.to(h_BSD.dtype)])
        idx_N = mm_index.reshape(-1)
        h_ND = torch.where((idx_N >= 0)[:, None], tokens.index_select(0, idx_N.clamp(min=0)), h_BSD.reshape(B * S, -1))
        # stand-ins place nothing; times 0 keeps their tower in the graph (same collectives on every rank)
        for dummy, out in ((omni_meta.vision_dummy, merged), (omni_meta.audio_dummy, audio)):
            if dummy:
                h_ND = h_ND + out.sum().to(h_ND.dtype) * 0.0
        h_BSD, _ = self.embed_out(h_ND.view(B, S, -1), [])
        return Stream(h_BSD)

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
        """position_ids [3, B, S] TMRoPE (or [B, S] for text only; default arange); ``omni_meta`` / ``mm_index``
        from :func:`prepare_batch`. The grids, second_per_grid, audio lengths and use_audio_in_video are accepted
        for interface compatibility and not read (prepare_batch turned them into metadata on the host)."""
        lm = self.language_model
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        stream = self.embed(input_ids, pixel_values, pixel_values_videos, input_features, omni_meta, mm_index)
        stream = lm.trunk(stream, self.rope(position_ids, stream.h.dtype), attn)
        out = lm.head(stream, attn, labels, logits_at, loss_weights)
        return out if attn is None else out._replace(kv_cache=attn.kv_cache)


# ---- TMRoPE (host) ----
def _vision_pos(start: int, t_index: torch.Tensor, lh: int, lw: int) -> np.ndarray:
    """[3, t * lh * lw]: (t, h, w) of one image / video's merged tokens, frames then rows then columns."""
    n = len(t_index)
    t = t_index.numpy().repeat(lh * lw)
    h = np.tile(np.arange(lh).repeat(lw), n)
    w = np.tile(np.arange(lw), n * lh)
    return np.stack([t, h, w]) + start


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
            parts.append(_vision_pos(nxt(), (torch.arange(t) * sec * pps).long(), h // merge, w // merge))
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
            v_pos = _vision_pos(s1, (torch.arange(grid[0]) * sec * pps).long(), grid[1] // merge, grid[2] // merge)
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


def _documents(batch: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document, row-major (doc_ids >= 0 runs; a row without doc_ids is one)."""
    ids = batch["input_ids"]
    docs = batch.get("doc_ids")
    if docs is None:
        return [(b, 0, ids.shape[1]) for b in range(ids.shape[0])]
    out = []
    for b, row in enumerate(docs.cpu().numpy()):
        cuts = np.flatnonzero(np.diff(row)) + 1
        for a, e in zip(np.r_[0, cuts], np.r_[cuts, len(row)]):
            if row[a] >= 0:
                out.append((b, int(a), int(e)))
    return out


def tmrope_positions(cfg: Qwen2_5OmniConfig, batch: dict[str, Any]) -> torch.Tensor:
    """[3, B, S] int64 on the host: :func:`rope_index` per document (padding keeps 0)."""
    ids = batch["input_ids"].cpu()
    grids = {k: batch[k].cpu().tolist() if batch.get(k) is not None else []
             for k in ("image_grid_thw", "video_grid_thw")}
    secs = batch.get("video_second_per_grid")
    if grids["video_grid_thw"] and secs is None:
        raise ValueError("a batch with videos needs video_second_per_grid (seconds per temporal patch, per video).")
    secs = torch.as_tensor(secs if secs is not None else [], dtype=torch.float32).cpu().reshape(-1)
    lens = batch.get("audio_feature_lengths")
    images, audios = iter(grids["image_grid_thw"]), iter([] if lens is None else lens.cpu().tolist())
    videos = iter(zip(grids["video_grid_thw"], secs))
    pos = torch.zeros((3, *ids.shape), dtype=torch.int64)
    for b, a, e in _documents(batch):
        pos[:, b, a:e] = torch.from_numpy(rope_index(ids[b, a:e], cfg, images, videos, audios))
    return pos


def encoder_inputs(cfg: Qwen2_5OmniConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
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
    vision = build_window_meta(grid, cfg.vision, _vision_backend(cfg, device), device)._replace(n_image_tokens=n_img)
    idx = visual_index(ids, cfg.image_token_id, cfg.video_token_id, n_img) if grids else torch.full_like(ids, -1)
    has_audio = has["input_features"]
    if has_audio and batch.get("audio_feature_lengths") is None:
        raise ValueError("batch has input_features but no audio_feature_lengths (mel frames per clip).")
    lens = batch["audio_feature_lengths"].cpu() if has_audio else torch.tensor([DUMMY_FRAMES])
    audio = build_audio_meta(lens, cfg.audio, _vision_backend(cfg, device), device)
    pads = ids == cfg.audio_token_id
    n_out = int(conv_lengths(lens)[1].sum()) if has_audio else 0
    if int(pads.sum()) != n_out:
        raise ValueError(f"{int(pads.sum())} <|AUDIO|> placeholders for {n_out} audio tokens (audio_feature_lengths "
                         f"{lens.tolist() if has_audio else []}); the data pipeline must place one per output token.")
    idx[pads] = int((grid.prod(-1) // m2).sum()) + torch.arange(n_out)  # audio rows follow the visual ones
    meta = OmniMeta(vision, audio, vision_dummy=not grids, audio_dummy=not has_audio)
    return {"omni_meta": meta, "mm_index": idx.to(device, non_blocking=True)}


def prepare_batch(cfg: Qwen2_5OmniConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The family's ModelSpec.prepare_batch, on the host before the batch moves to the device and before any
    context-parallel split: the batch with TMRoPE ``position_ids`` and :func:`encoder_inputs`."""
    return {**batch, "position_ids": tmrope_positions(cfg, batch), **encoder_inputs(cfg, batch, device)}


def build(cfg: Qwen2_5OmniConfig) -> Qwen2_5OmniModel:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen2_5OmniModel(cfg)
