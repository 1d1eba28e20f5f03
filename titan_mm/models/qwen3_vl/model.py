"""Qwen3-VL / Qwen3-VL-MoE: vision tower + DeepStack + the Qwen3 text backbone with interleaved M-RoPE.

The text blocks are titan_mm's Qwen3 blocks (dense or MoE, from titan_mm/models/qwen3); this file adds
only what is VL-specific: the vision tower, the scatter of visual tokens into the embeddings, the
DeepStack additions after the first LLM blocks, and M-RoPE cos/sin from [3, B, S] positions.

Legend: B batch, S sequence, D LLM hidden, N = B*S tokens, K head_dim, F = K/2 rotary frequencies,
Mi / Mv merged image / video tokens, O = D.

Parameter names (titan):
  visual.*                       the vision tower (see vision.py; HF names in hf.py)
  language_model.tok_embeddings / layers.{i}.* / norm / output   the Qwen3 text model (qwen3/model.py)

Forward (no host syncs; metadata from :func:`prepare_batch`, the family's ``ModelSpec.prepare_batch``, on the
host first):
    batch = prepare_batch(cfg, batch, device)        # grids -> vision_meta, visual_index (when it has pixels)
    out = model(input_ids, position_ids=pos_3BS, attn=attn_meta, labels=labels, pixel_values=...,
                pixel_values_videos=..., vision_meta=..., visual_index=...)

Visual tokens: ``input_ids`` hold one <|image_pad|> / <|video_pad|> per merged token, in the same order as
the patches of ``pixel_values`` / ``pixel_values_videos`` (row-major over the batch). ``visual_index`` [B, S]
(host-built) names, per position, the merged embedding it takes (-1 on text); the forward gathers with it (no
nonzero, no masked_scatter size check). The number of pads must equal the number of merged tokens (the data
pipeline guarantees it; it is not checked in forward because checking needs a sync).

Context parallelism: ``visual_index`` is a sequence key (``ModelSpec.seq_keys``), so
titan_mm.parallel.cp.prepare_cp_batch cuts it with ``input_ids``: every cp rank runs the vision tower on *all*
images of the micro-batch (redundant ViT work; the ViT is small next to the LLM) and gathers the embeddings and
DeepStack additions of its own positions only. The forward knows nothing of CP. ViT gradients are partial per
cp rank and summed by FSDP over ``dp_shard x cp`` like every other gradient.

Sequence parallel (titan_mm/models/qwen3_vl/plan.py): ``embed`` runs on the full (or cp-local) rows on every tp
rank, so the visual tokens and DeepStack features are placed exactly as without tp; ``embed_out`` (an identity
module, the plan's hook point) then cuts the embeddings and every DeepStack addition to this tp rank's sequence
shard, and the final norm (called as the module ``language_model.norm``) gathers the sequence for the loss. The
loss and the logits go through the text model's ``ops`` (``cross_entropy``, ``logits``), which loss parallel
swaps for vocab-parallel ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from titan_mm.nn.attention import AttnMeta
from titan_mm.nn.output import ModelOutput, Stream
from titan_mm.models.qwen3.model import Qwen3Model, finish, select_ops
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig
from titan_mm.models.qwen3_vl.vision import VisionMeta, VisionTower, build_vision_meta

if TYPE_CHECKING:  # the plan's type only: the models import nothing from parallel/
    from titan_mm.parallel.encoder_balance import EncoderBalance


def mrope_cos_sin(position_ids_3BS: torch.Tensor, inv_freq_F: torch.Tensor, section: tuple[int, int, int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved M-RoPE cos/sin [B, S, K]: frequency j uses the h position if j % 3 == 1 and
    j < 3 * section[1], the w position if j % 3 == 2 and j < 3 * section[2], else the t position
    (HF Qwen3-VL). Computed in fp32, returned in ``dtype``."""
    if position_ids_3BS.dim() == 2:  # text-only batch with 1-D positions: t = h = w
        position_ids_3BS = position_ids_3BS[None].expand(3, -1, -1)
    F_ = inv_freq_F.shape[0]
    j = torch.arange(F_, device=inv_freq_F.device)
    use_h = (j % 3 == 1) & (j < 3 * section[1])
    use_w = (j % 3 == 2) & (j < 3 * section[2])
    f_3BSF = position_ids_3BS[..., None].float() * inv_freq_F.float()
    f_BSF = torch.where(use_h, f_3BSF[1], torch.where(use_w, f_3BSF[2], f_3BSF[0]))
    emb = torch.cat([f_BSF, f_BSF], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def visual_index(input_ids_BS: torch.Tensor, image_token_id: int, video_token_id: int,
                 n_image_tokens: int) -> torch.Tensor:
    """Host side: [B, S] int64, for each position the row of the merged visual embeddings (images first,
    then videos, as the vision tower returns them) that it takes, -1 on text. The k-th pad of a kind (row-major
    over the batch) takes the k-th merged token of that kind."""
    idx = torch.full_like(input_ids_BS, -1, dtype=torch.int64)
    for tok, first in ((image_token_id, 0), (video_token_id, n_image_tokens)):
        m = input_ids_BS == tok
        idx[m] = first + torch.arange(int(m.sum()), dtype=torch.int64)
    return idx


class EmbedOutput(nn.Module):
    """No parameters: ``forward(h_BSD, adds) -> (h_BSD, adds)``, the identity. It names the point where the
    embeddings (visual tokens merged in) and the DeepStack additions enter the decoder, so that a
    parallelize plan can act there: sequence parallel cuts every [B, S, D] tensor of its output to this
    rank's sequence shard (titan_mm/models/qwen3_vl/plan.py)."""

    def forward(self, h_BSD: torch.Tensor, adds: list[torch.Tensor]):
        return h_BSD, adds


class Qwen3VLModel(nn.Module):
    def __init__(self, cfg: Qwen3VLConfig):
        super().__init__()
        self.cfg = cfg
        self.visual = VisionTower(cfg.vision, select_ops(cfg.kernels))  # kernels: the ViT's RoPE, MLP bias+GELU
        self.language_model = Qwen3Model(cfg.text)
        self.embed_out = EmbedOutput()
        apply_freeze(self, cfg)

    # ---- weights ----
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        self.language_model.init_weights(buffer_device)
        self.visual.init_weights(self.cfg.vision.initializer_range)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        self.language_model.init_buffers(buffer_device)

    @property
    def rope_inv_freq(self) -> torch.Tensor:
        return self.language_model.rope_inv_freq

    # ---- forward: embed -> trunk -> head (the trunk and head are the text model's) ----
    def embed(self, input_ids: torch.Tensor, pixel_values=None, pixel_values_videos=None,
              vision_meta: VisionMeta | None = None, visual_index: torch.Tensor | None = None,
              vision_balance: EncoderBalance | None = None) -> Stream:
        """Token embeddings with the visual tokens placed by ``visual_index`` [B, S] (host-built by
        :func:`prepare_batch`, already cut to this rank's positions under context parallelism), and the
        DeepStack additions as the stream's ``adds``; both pass ``embed_out`` (sequence parallel: from there on
        [B, S/tp, D]), so the stream is what the trunk reads, as a first pipeline stage hands it on.
        ``vision_balance`` (parallel.encoder_balance): the tower runs on the images this plan assigns to the rank
        (``vision_meta`` describes those), and their features come back to their owners
        (titan_mm/parallel/encoder_balance.py); every rank takes part, with or without images of its own."""
        h_BSD = self.language_model.tok_embeddings(input_ids)
        pix = [p for p in (pixel_values, pixel_values_videos) if p is not None and p.numel()]
        if not pix and vision_balance is None:
            h_BSD, _ = self.embed_out(h_BSD, [])
            return Stream(h_BSD)
        if vision_meta is None or visual_index is None:
            raise ValueError(
                "pixel inputs were given without vision_meta / visual_index; build them on the host with "
                "titan_mm.models.qwen3_vl.model.prepare_batch(cfg, batch, device) (the train step does this)."
            )
        B, S = input_ids.shape
        if vision_balance is None:
            merged, deepstack = self.visual(torch.cat(pix, 0) if len(pix) > 1 else pix[0], vision_meta)
        else:  # one dtype on every rank for the all-to-all: the tower's (its first op casts to it anyway)
            w = self.visual.patch_embed.weight
            x = torch.cat(pix, 0).to(w.dtype) if pix else w.new_empty((0, w.shape[1]))
            merged, deepstack = vision_balance.encode(self.visual, x, vision_meta)
            if not pix:  # no images here: nothing to place, but the backward must reach the exchange
                h_BSD, _ = self.embed_out(vision_balance.keep_in_graph(h_BSD, [merged, *deepstack]), [])
                return Stream(h_BSD)
        idx_N = visual_index.reshape(-1)
        m = (idx_N >= 0)[:, None]
        sel = idx_N.clamp(min=0)
        h_ND = torch.where(m, merged.to(h_BSD.dtype).index_select(0, sel), h_BSD.reshape(B * S, -1))
        adds = [torch.where(m, ds.to(h_ND.dtype).index_select(0, sel), 0.0).view(B, S, -1) for ds in deepstack]
        h_BSD, adds = self.embed_out(h_ND.view(B, S, -1), adds)
        return Stream(h_BSD, None, tuple(adds))

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Interleaved M-RoPE cos / sin [B, S, K] from position_ids [3, B, S] (or [B, S] for text only)."""
        return mrope_cos_sin(position_ids, self.language_model.rope_inv_freq, self.cfg.mrope_section, dtype)

    def trunk(self, stream: Stream, rope: tuple[torch.Tensor, torch.Tensor], attn: AttnMeta | None,
              start: int = 0, stop: int | None = None) -> Stream:
        """The text model's blocks ``start .. stop-1`` (DeepStack additions after their blocks)."""
        return self.language_model.trunk(stream, rope, attn, start, stop)

    def head(self, stream: Stream, attn: AttnMeta | None, labels: torch.Tensor | None = None,
             logits_at: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None,
             hidden: bool = False) -> ModelOutput:
        """The text model's head: final norm, MoE aux loss, then hidden states, loss sum or logits."""
        return self.language_model.head(stream, attn, labels, logits_at, loss_weights, hidden)

    def lm_loss(self, h_BSD: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None,
                index: torch.Tensor | None = None) -> torch.Tensor:
        """The causal-LM objective's hook: the text model's (Qwen3Model.lm_loss)."""
        return self.language_model.lm_loss(h_BSD, targets, weights, index)

    def token_logprobs(self, h_BSD: torch.Tensor, targets: torch.Tensor,
                       index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy objective's hook: the text model's (Qwen3Model.token_logprobs)."""
        return self.language_model.token_logprobs(h_BSD, targets, index)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn: AttnMeta | None = None,
        labels: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        vision_meta: VisionMeta | None = None,
        visual_index: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        vision_balance: EncoderBalance | None = None,
        loss: Callable | None = None,
    ) -> ModelOutput:
        """input_ids [B, S]; position_ids [3, B, S] M-RoPE positions (or [B, S] for text only; default
        arange); attn from build_attn_meta; labels [B, S] already shifted. ``vision_meta`` / ``visual_index``
        come from :func:`prepare_batch` (host), which consumes the grids (:data:`GRID_KEYS`) into them.
        ``logits_at`` [B] (decoding): without labels, logits only at these positions, [B, V]. ``loss_weights``
        [B, S]: per-token loss weights (None: 1).
        ``vision_balance``: the encoder-balance plan from :func:`prepare_batch` (see :meth:`embed`). ``loss``: an
        objective's, as Qwen3Model.forward's."""
        lm = self.language_model
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        stream = self.embed(input_ids, pixel_values, pixel_values_videos, vision_meta, visual_index, vision_balance)
        stream = lm.trunk(stream, self.rope(position_ids, stream.h.dtype), attn)
        out = lm.head(stream, attn, labels, logits_at, loss_weights, hidden=loss is not None)
        return finish(self, out, attn, loss)


def vision_backend(cfg: Qwen3VLConfig, device: torch.device) -> str:
    """The encoders' attention backend: ``vision_attn_backend``, or for "auto" SDPA off CUDA and varlen (else
    flex) on it."""
    b = cfg.vision_attn_backend
    if b != "auto":
        return b
    if device.type != "cuda":
        return "sdpa"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (a probe: older torch has no varlen_attn)

        return "varlen"
    except ImportError:
        return "flex"


def vision_inputs(cfg: Qwen3VLConfig, batch: dict[str, Any], device: torch.device | str,
                  encoder_balance=None) -> dict[str, Any]:
    """Host side: ``{"vision_meta", "visual_index"}`` for a batch with pixels ({} without): VisionMeta over the
    images then the videos, from the CPU grids, and :func:`visual_index` [B, S], both on ``device``.
    ``encoder_balance``: parallel.encoder_balance's planner, ``(grid_thw, merge, device) -> (plan, grids)``
    (titan_mm.parallel.encoder_balance.balance_planner; collective: every rank calls it). Then also
    ``"vision_balance"``, the exchange plan, and ``vision_meta`` describes the images this rank encodes; {} only
    when no rank of the group has images."""
    device = torch.device(device)
    grids = []
    n_img = 0
    m2 = cfg.vision.spatial_merge_size**2
    for pk, gk in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if batch.get(pk) is not None and batch[pk].numel():
            g = batch.get(gk)
            if g is None:
                raise ValueError(f"batch has {pk} but no {gk}; the data pipeline must provide the (t, h, w) grids.")
            g = g.cpu() if g.device.type != "cpu" else g
            grids.append(g)
            if pk == "pixel_values":
                n_img = int((g.prod(-1) // m2).sum())
    extra = {}
    if encoder_balance is not None:
        planned = encoder_balance(torch.cat(grids) if grids else None, m2, device)
        if planned is None:
            return {}
        extra["vision_balance"], grids = planned[0], [planned[1]]
    elif not grids:
        return {}
    meta = build_vision_meta(torch.cat(grids), cfg.vision, vision_backend(cfg, device), device, cfg.vision_bucket)
    idx = visual_index(batch["input_ids"].cpu(), cfg.image_token_id, cfg.video_token_id, n_img)
    if not extra:  # with the exchange the tower's images are a mix of ranks' images and videos
        meta = meta._replace(n_image_tokens=n_img)
    return {"vision_meta": meta, "visual_index": idx.to(device, non_blocking=True), **extra}


GRID_KEYS = ("image_grid_thw", "video_grid_thw")
"""Host keys that prepare_batch turns into ``vision_meta`` / ``visual_index`` and consumes: no forward takes them."""


def consume(batch: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``batch`` without ``keys``: what a prepare_batch turned into metadata leaves the batch (a new dict)."""
    return {k: v for k, v in batch.items() if k not in keys}


def prepare_batch(cfg: Qwen3VLConfig, batch: dict[str, Any], device: torch.device | str,
                  encoder_balance=None) -> dict[str, Any]:
    """The family's ModelSpec.prepare_batch: the batch with :func:`vision_inputs` in place of the grids
    (:data:`GRID_KEYS`), on the host, before the batch moves to the device and before any context-parallel split
    (``visual_index`` is a sequence key CP cuts). ``encoder_balance``: parallel.encoder_balance's planner (the
    train step passes it when on)."""
    return {**consume(batch, GRID_KEYS), **vision_inputs(cfg, batch, device, encoder_balance)}


# ---- training modes ----
def param_kind(name: str) -> str:
    """'vision' (ViT), 'merger' (patch + DeepStack mergers) or 'llm' for a parameter FQN (wrappers' prefixes ok)."""
    if "visual." in name or name.startswith("visual"):
        return "merger" if (".merger." in name or "deepstack_merger_list" in name) else "vision"
    return "llm"


def apply_freeze(model: nn.Module, cfg: Qwen3VLConfig) -> None:
    """requires_grad=False on the parts the config freezes."""
    frozen = {"vision": cfg.freeze_vision, "merger": cfg.freeze_merger, "llm": cfg.freeze_llm}
    if all(frozen.values()):
        raise ValueError("freeze_vision, freeze_merger and freeze_llm are all true: nothing would train.")
    for name, p in model.named_parameters():
        if frozen[param_kind(name)]:
            p.requires_grad_(False)


def param_groups(model: nn.Module, cfg: Qwen3VLConfig, groups: list[dict[str, Any]], base_lr: float) -> list[dict]:
    """Split optimizer groups (as built by titan_mm.train.optim.build_param_groups) by part, each with its
    learning rate: ViT ``vision_lr``, mergers ``merger_lr`` (default vision_lr), LLM ``llm_lr`` (None:
    ``base_lr``). Frozen parameters are already absent (requires_grad=False). Groups keep their other keys."""
    lrs = {
        "vision": cfg.vision_lr if cfg.vision_lr is not None else base_lr,
        "merger": cfg.merger_lr if cfg.merger_lr is not None else (cfg.vision_lr if cfg.vision_lr is not None else base_lr),
        "llm": cfg.llm_lr if cfg.llm_lr is not None else base_lr,
    }
    return split_by_part(model, groups, lrs, param_kind)


def split_by_part(model: nn.Module, groups: list[dict[str, Any]], lrs: dict[str, float],
                  part: Callable[[str], str]) -> list[dict]:
    """Each optimizer group split by the part ``part(name)`` of its parameters (unnamed: "llm"), at the part's
    learning rate ``lrs[part]``; the other keys kept."""
    kind_of = {id(p): part(n) for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for g in groups:
        by: dict[str, list] = {}
        for p in g["params"]:
            by.setdefault(kind_of.get(id(p), "llm"), []).append(p)
        for kind, ps in by.items():  # initial_lr: LambdaLR schedules scale it, so per-part peaks survive warmup
            out.append({**g, "params": ps, "lr": lrs[kind], "initial_lr": lrs[kind],
                        "name": f"{g.get('name', 'group')}/{kind}"})
    return out


def build(cfg: Qwen3VLConfig) -> Qwen3VLModel:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen3VLModel(cfg)
