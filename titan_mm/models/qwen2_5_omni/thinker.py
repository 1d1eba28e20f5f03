"""What the Omni thinkers share (Qwen2.5-Omni's here; Qwen3-Omni-MoE parameterizes it): the training parts
(vision, merger, llm, audio), the embed that places both encoders' tokens through one host-built ``mm_index``
(DeepStack additions where the ViT gives them), and the host side of prepare_batch: the documents of a packed
batch, the positions per document through the family's own ``rope_index``, and the encoders' metadata.

A family's model class mixes :class:`OmniThinker` in before its VL model class and builds ``visual`` (a ViT with
``patch_embed``), ``language_model``, ``audio_tower`` (with ``stand_in_features()``) and ``embed_out``; its
model.py passes its ViT metadata builder and :class:`OmniAudio` to :func:`prepare_batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn as nn

from titan_mm.models.qwen3.model import finish
from titan_mm.models.qwen3_vl.model import GRID_KEYS, consume, split_by_part, vision_backend, visual_index
from titan_mm.models.qwen3_vl.model import param_kind as vl_param_kind
from titan_mm.nn.attention import AttnMeta
from titan_mm.nn.output import ModelOutput, Stream


class OmniMeta(NamedTuple):
    """Host-built encoder metadata of one micro-batch (:func:`prepare_batch`)."""

    vision: Any
    """The family ViT's metadata over the images then the videos, or over the stand-in image."""
    audio: Any
    """The family audio encoder's metadata over the clips, or over the stand-in clip."""
    n_visual: int
    """Merged visual tokens (rows of mm_index below this are visual and take the DeepStack additions)."""
    vision_dummy: bool
    audio_dummy: bool


class OmniAudio(NamedTuple):
    """A thinker's audio encoder, as the host side sees it."""

    build_meta: Callable
    """(lengths [n_clips], audio config, backend, device, groups) -> the encoder's metadata; ``groups`` ([n_clips]
    or None, the batch's ``audio_groups``): clips encoded as calls of their own per group (the serving engine's
    requests), None: as one call."""
    tokens: Callable
    """Output tokens of clips of ``frames`` mel frames (an integer array), = <|audio_pad|> placeholders per clip."""
    dummy_frames: int
    """Frames of the stand-in clip of a batch without audio."""


# ---- training parts: Qwen3-VL's plus "audio" (the whole audio encoder) ----
def param_kind(name: str) -> str:
    return "audio" if "audio_tower." in name else vl_param_kind(name)


def apply_freeze(model: nn.Module, cfg) -> None:
    frozen = {"vision": cfg.freeze_vision, "merger": cfg.freeze_merger, "llm": cfg.freeze_llm,
              "audio": cfg.freeze_audio}
    if all(frozen.values()):
        raise ValueError("freeze_vision, freeze_merger, freeze_llm and freeze_audio are all true: nothing would train.")
    for name, p in model.named_parameters():
        if frozen[param_kind(name)]:
            p.requires_grad_(False)


def param_groups(model: nn.Module, cfg, groups: list[dict[str, Any]], base_lr: float) -> list[dict]:
    """Qwen3-VL's split (qwen3_vl.model.param_groups) with the audio encoder as its own part at ``audio_lr``."""
    pick = lambda *lrs: next((x for x in lrs if x is not None), base_lr)  # noqa: E731
    lrs = {"vision": pick(cfg.vision_lr), "merger": pick(cfg.merger_lr, cfg.vision_lr), "llm": pick(cfg.llm_lr),
           "audio": pick(cfg.audio_lr)}
    return split_by_part(model, groups, lrs, param_kind)


class OmniThinker:
    """The VL model's weights plus the audio tower's, the embed of both encoders and the forward (mixed in before
    the VL model class, whose rope, trunk and head the thinker keeps)."""

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        super().init_weights(buffer_device)
        self.audio_tower.init_weights(self.cfg.audio.initializer_range)
        self.audio_tower.init_buffers(buffer_device)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        super().init_buffers(buffer_device)
        self.audio_tower.init_buffers(buffer_device)

    def embed(self, input_ids: torch.Tensor, pixel_values=None, pixel_values_videos=None, input_features=None,
              omni_meta: OmniMeta | None = None, mm_index: torch.Tensor | None = None) -> Stream:
        """Token embeddings with the visual and audio tokens placed by ``mm_index`` and any DeepStack additions on
        the visual positions; without ``omni_meta`` (a text-only batch that skipped prepare_batch, e.g. serving)
        the encoders do not run."""
        h_BSD = self.language_model.tok_embeddings(input_ids)
        media = [x for x in (pixel_values, pixel_values_videos, input_features) if x is not None and x.numel()]
        if omni_meta is None or mm_index is None:
            if media:
                raise ValueError("media inputs were given without omni_meta / mm_index; build them on the host with "
                                 f"{type(self).__module__}.prepare_batch(cfg, batch, device).")
            h_BSD, _ = self.embed_out(h_BSD, [])
            return Stream(h_BSD)
        v = self.cfg.vision
        if omni_meta.vision_dummy:
            pix = self.visual.patch_embed.weight.new_zeros(v.spatial_merge_size**2, v.patch_dim)
        else:
            pix = torch.cat([x for x in (pixel_values, pixel_values_videos) if x is not None and x.numel()])
        merged, deepstack = self.visual(pix, omni_meta.vision)
        feats = self.audio_tower.stand_in_features() if omni_meta.audio_dummy else input_features
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
        loss_weights: torch.Tensor | None = None,
        loss: Callable | None = None,
    ) -> ModelOutput:
        """position_ids [3, B, S] (the family's, or [B, S] for text only; default arange); ``omni_meta`` /
        ``mm_index`` from :func:`prepare_batch`, which consumes :data:`CONSUMED_KEYS` into them. ``loss``: an
        objective's, as Qwen3Model.forward's."""
        lm = self.language_model
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        stream = self.embed(input_ids, pixel_values, pixel_values_videos, input_features, omni_meta, mm_index)
        stream = lm.trunk(stream, self.rope(position_ids, stream.h.dtype), attn)
        out = lm.head(stream, attn, labels, logits_at, loss_weights, hidden=loss is not None)
        return finish(self, out, attn, loss)

# ---- host side ----
def documents(batch: dict[str, Any]) -> list[tuple[int, int, int]]:
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


def positions(cfg, batch: dict[str, Any], rope_index: Callable) -> torch.Tensor:
    """[3, B, S] on the host: the family's ``rope_index(ids_L, cfg, images, videos, audios)`` per document (padding
    keeps 0); int64 when every position is whole, else float32 (HF's dtype). The media iterators yield image grids,
    (video grid, seconds per temporal patch as a float32 scalar tensor) and clip frame counts, in batch order."""
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
    pos = np.zeros((3, *ids.shape))
    for b, a, e in documents(batch):
        pos[:, b, a:e] = rope_index(ids[b, a:e], cfg, images, videos, audios)
    whole = np.array_equal(pos, np.round(pos))
    return torch.from_numpy(pos.astype(np.int64) if whole else pos.astype(np.float32))


def encoder_inputs(cfg, batch: dict[str, Any], device: torch.device | str, vision_meta: Callable,
                   audio_enc: OmniAudio) -> dict[str, Any]:
    """Host side: ``{"omni_meta", "mm_index"}`` (on ``device``) for any batch, stand-ins included.
    ``vision_meta(grids, vision config, backend, device, bucket)``: the family ViT's metadata builder."""
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
    vision = vision_meta(grid, cfg.vision, vision_backend(cfg, device), device,
                         cfg.vision_bucket)._replace(n_image_tokens=n_img)
    idx = visual_index(ids, cfg.image_token_id, cfg.video_token_id, n_img) if grids else torch.full_like(ids, -1)
    if grids and int((idx >= 0).sum()) != n_visual:
        raise ValueError(f"{int((idx >= 0).sum())} image / video placeholders for {n_visual} merged visual tokens; "
                         "the data pipeline must place one per merged token.")
    has_audio = has["input_features"]
    if has_audio and batch.get("audio_feature_lengths") is None:
        raise ValueError("batch has input_features but no audio_feature_lengths (mel frames per clip).")
    lens = batch["audio_feature_lengths"].cpu() if has_audio else torch.tensor([audio_enc.dummy_frames])
    groups = batch.get("audio_groups") if has_audio else None
    audio = audio_enc.build_meta(lens, cfg.audio, vision_backend(cfg, device), device, groups)
    pads = ids == cfg.audio_token_id
    n_out = int(audio_enc.tokens(lens.numpy()).sum()) if has_audio else 0
    if int(pads.sum()) != n_out:
        raise ValueError(f"{int(pads.sum())} audio placeholders (audio_token_id {cfg.audio_token_id}) for {n_out} "
                         f"audio tokens (audio_feature_lengths {lens.tolist() if has_audio else []}); the data "
                         "pipeline must place one per output token.")
    idx[pads] = n_visual + torch.arange(n_out)  # audio rows follow the visual ones
    meta = OmniMeta(vision, audio, n_visual, vision_dummy=not grids, audio_dummy=not has_audio)
    return {"omni_meta": meta, "mm_index": idx.to(device, non_blocking=True)}


CONSUMED_KEYS = (*GRID_KEYS, "video_second_per_grid", "audio_feature_lengths", "audio_groups", "use_audio_in_video")
"""What a thinker's prepare_batch turns into ``position_ids``, ``omni_meta`` and ``mm_index`` (or, HF's
``use_audio_in_video``, checks against the tokens) and takes out of the batch: the forward takes none of them."""


def check_audio_in_video(cfg, batch: dict[str, Any]) -> None:
    """HF's batch-wide ``use_audio_in_video``, when given, must say what the tokens say (they decide: each video whose
    <vision_start> is followed by <audio_start> has its audio interleaved)."""
    flag = batch.get("use_audio_in_video")
    if flag is None:
        return
    ids = batch["input_ids"].cpu()
    after = ids[:, 1:][ids[:, :-1] == cfg.vision_start_token_id]
    n_aiv, n_alone = int((after == cfg.audio_start_token_id).sum()), int((after == cfg.video_token_id).sum())
    if (n_alone if bool(flag) else n_aiv):
        raise ValueError(f"use_audio_in_video={bool(flag)}, but {n_alone if bool(flag) else n_aiv} video(s) of the "
                         f"batch {'have no' if bool(flag) else 'have their'} audio interleaved in their tokens; the "
                         "tokens decide per video: drop the flag or place the tokens it says")


def prepare_batch(cfg, batch: dict[str, Any], device: torch.device | str, rope_index: Callable,
                  vision_meta: Callable, audio_enc: OmniAudio) -> dict[str, Any]:
    """A thinker's ModelSpec.prepare_batch, on the host before the batch moves to the device and before any
    context-parallel split: the batch with :func:`positions` and :func:`encoder_inputs` in place of
    :data:`CONSUMED_KEYS`."""
    check_audio_in_video(cfg, batch)
    return {**consume(batch, CONSUMED_KEYS), "position_ids": positions(cfg, batch, rope_index),
            **encoder_inputs(cfg, batch, device, vision_meta, audio_enc)}
