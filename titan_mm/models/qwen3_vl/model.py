"""Qwen3-VL / Qwen3-VL-MoE: vision tower + DeepStack + the Qwen3 text backbone with interleaved M-RoPE.

The text blocks are titan_mm's Qwen3 blocks (dense or MoE, from titan_mm/models/qwen3); this file adds
only what is VL-specific: the vision tower, the scatter of visual tokens into the embeddings, the
DeepStack additions after the first LLM blocks, and M-RoPE cos/sin from [3, B, S] positions.

Legend: B batch, S sequence, D LLM hidden, N = B*S tokens, K head_dim, F = K/2 rotary frequencies,
Mi / Mv merged image / video tokens, O = D.

Parameter names (titan):
  visual.*                       the vision tower (see vision.py; HF names in hf.py)
  language_model.tok_embeddings / layers.{i}.* / norm / output   the Qwen3 text model (qwen3/model.py)

Forward (no host syncs; metadata from :meth:`Qwen3VLModel.prepare_inputs`, called on the host first):
    extra = model.prepare_inputs(batch, device)      # {"vision_meta": VisionMeta} when the batch has pixels
    out = model(input_ids, position_ids=pos_3BS, attn=attn_meta, labels=labels,
                pixel_values=..., pixel_values_videos=..., **extra)

Visual tokens: ``input_ids`` hold one <|image_pad|> / <|video_pad|> per merged token, in the same order as
the patches of ``pixel_values`` / ``pixel_values_videos`` (row-major over the batch). The k-th pad of a
kind takes the k-th merged embedding of that kind: the index is a running count (cumsum) of the pad mask,
computed on device, and the embedding is gathered with it (no nonzero, no masked_scatter size check).
The number of pads must equal the number of merged tokens (the data pipeline guarantees it; it is not
checked in forward because checking needs a sync).

Context parallelism (titan_mm.parallel.cp.prepare_cp_batch): ``input_ids`` / ``labels`` / ``position_ids``
([3, B, S] sliced on the last axis) are this cp rank's load-balanced shard, and the batch also carries
``cp_full_input_ids`` (the full rows) and ``cp_seq_index`` (the shard's positions, built on the host). Every
cp rank runs the vision tower on *all* images of the micro-batch (redundant ViT work, cp times; the ViT is
small next to the LLM), computes the pad running counts over the full rows, and gathers the embeddings and
DeepStack additions of its own positions only, so the LLM blocks see exactly the rows they would see in
the unsplit forward. ViT gradients are partial per cp rank (only its tokens' contributions) and summed by
FSDP over ``dp_shard x cp`` like every other gradient.

Sequence parallel (titan_mm/models/qwen3_vl/plan.py): ``embed`` runs on the full (or cp-local) rows on every tp
rank, so the visual tokens and DeepStack features are placed exactly as without tp; ``embed_out`` (an identity
module, the plan's hook point) then cuts the embeddings and every DeepStack addition to this tp rank's sequence
shard, and the final norm (called as the module ``language_model.norm``) gathers the sequence for the loss. The
loss and the logits go through the text model's ``ops`` (``cross_entropy``, ``logits``), which loss parallel
swaps for vocab-parallel ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from titan_mm.models.common.attention import AttnMeta
from titan_mm.models.common.moe import load_balancing_loss
from titan_mm.models.common.output import ModelOutput
from titan_mm.models.qwen3.model import Qwen3Model, select_ops
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig
from titan_mm.models.qwen3_vl.vision import VisionMeta, VisionTower, build_vision_meta


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


def _pad_index(mask_BS: torch.Tensor, seq_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask_N, idx_N): position t (row-major over [B, S]) is the idx_N[t]-th True of ``mask_BS`` (garbage,
    clamped to 0, where mask_N is False). With ``seq_index`` [S'] the count runs over the full rows and only
    the positions ``seq_index`` of each row are returned (N = B * S'). Sync-free: a cumsum on device."""
    B, S = mask_BS.shape
    idx_BS = (torch.cumsum(mask_BS.reshape(-1).to(torch.int64), 0) - 1).clamp_(min=0).view(B, S)
    if seq_index is not None:
        mask_BS, idx_BS = mask_BS.index_select(1, seq_index), idx_BS.index_select(1, seq_index)
    return mask_BS.reshape(-1), idx_BS.reshape(-1)


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
        self.visual = VisionTower(cfg.vision, select_ops(cfg.kernels).bias_gelu)  # kernels: the ViT MLP's bias+GELU
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

    # ---- host-side metadata ----
    def prepare_inputs(self, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
        """Host-side metadata for :meth:`forward` (call before moving the batch to the device):
        ``{"vision_meta": VisionMeta}`` built from the CPU ``image_grid_thw`` / ``video_grid_thw``."""
        return prepare_inputs(self.cfg, batch, device)

    def split_param_groups(self, groups: list[dict[str, Any]], base_lr: float) -> list[dict[str, Any]]:
        """Called by titan_mm.train.optim.build_param_groups: per-part learning rates (see :func:`param_groups`)."""
        return param_groups(self, self.cfg, groups, base_lr)

    # ---- forward ----
    def embed(self, input_ids: torch.Tensor, pixel_values=None, pixel_values_videos=None,
              vision_meta: VisionMeta | None = None, seq_index: torch.Tensor | None = None):
        """Token embeddings with visual tokens scattered in -> (h_BSD, deepstack adds list of [B, S, D] or []).
        ``seq_index`` [S'] (context parallelism): ``input_ids`` are the full rows; the visual features are
        placed by counts over the full rows, and only the positions ``seq_index`` are returned ([B, S', D])."""
        lm = self.language_model
        full_ids = input_ids
        if seq_index is not None:
            input_ids = input_ids.index_select(1, seq_index)
        B, S = input_ids.shape
        h_BSD = lm.tok_embeddings(input_ids)
        pix = [p for p in (pixel_values, pixel_values_videos) if p is not None and p.numel()]
        if not pix:
            return h_BSD, []
        if vision_meta is None:
            raise ValueError(
                "pixel inputs were given without vision_meta; call model.prepare_inputs(batch, device) on the host "
                "and pass its result to the forward (the train step does this)."
            )
        pixels = pix[0] if len(pix) == 1 else torch.cat(pix, 0)
        merged, deepstack = self.visual(pixels, vision_meta)
        merged = merged.to(h_BSD.dtype)
        h_ND = h_BSD.reshape(B * S, -1)
        n_img = vision_meta.n_image_tokens
        kinds = []
        if pixel_values is not None and pixel_values.numel():
            kinds.append((self.cfg.image_token_id, slice(0, n_img)))
        if pixel_values_videos is not None and pixel_values_videos.numel():
            kinds.append((self.cfg.video_token_id, slice(n_img, None)))
        adds = [torch.zeros_like(h_ND) for _ in deepstack]
        for tok, sl in kinds:
            mask_N, idx_N = _pad_index(full_ids == tok, seq_index)
            m = mask_N[:, None]
            h_ND = torch.where(m, merged[sl].index_select(0, idx_N), h_ND)
            for i, ds in enumerate(deepstack):
                adds[i] = torch.where(m, ds[sl].to(h_ND.dtype).index_select(0, idx_N), adds[i])
        return h_ND.view(B, S, -1), [a.view(B, S, -1) for a in adds]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn: AttnMeta | None = None,
        labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        vision_meta: VisionMeta | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        cp_full_input_ids: torch.Tensor | None = None,
        cp_seq_index: torch.Tensor | None = None,
        **unused: Any,
    ) -> ModelOutput:
        """input_ids [B, S]; position_ids [3, B, S] M-RoPE positions (or [B, S] for text only; default
        arange); attn from build_attn_meta; labels [B, S] already shifted. ``image_grid_thw`` /
        ``video_grid_thw`` are accepted for interface compatibility but only ``vision_meta`` is read
        (it was built from them on the host). ``logits_at`` [B] (decoding): without labels, return logits
        only at these positions, [B, V]. ``cp_full_input_ids`` [B, S_full] / ``cp_seq_index`` [S] (set by
        titan_mm.parallel.cp.prepare_cp_batch for batches with pixels): the full rows and the positions of
        this cp rank's shard ``input_ids`` (see the module docstring). Unknown keyword inputs raise."""
        if unused:
            raise TypeError(f"Qwen3VLModel.forward got unexpected inputs {sorted(unused)}; expected pixel_values, "
                            "pixel_values_videos, image_grid_thw, video_grid_thw, vision_meta, cp_full_input_ids, "
                            "cp_seq_index")
        lm = self.language_model
        tcfg = lm.cfg
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
        if cp_seq_index is not None:  # CP shard: visual features follow the full rows, keep our positions
            h_BSD, ds_adds = self.embed(cp_full_input_ids, pixel_values, pixel_values_videos, vision_meta, cp_seq_index)
        else:
            h_BSD, ds_adds = self.embed(input_ids, pixel_values, pixel_values_videos, vision_meta)
        h_BSD, ds_adds = self.embed_out(h_BSD, ds_adds)  # (sequence parallel: from here on [B, S/tp, D])
        cos, sin = mrope_cos_sin(position_ids, lm.rope_inv_freq, self.cfg.mrope_section, h_BSD.dtype)
        stats_2E = None
        for i, block in enumerate(lm.layers.values()):
            h_BSD, st = block(h_BSD, cos, sin, attn)
            if st is not None:
                stats_2E = st if stats_2E is None else stats_2E + st
            if i < len(ds_adds):
                h_BSD = h_BSD + ds_adds[i]
        h_BSD = lm.norm(h_BSD)

        aux = torch.zeros((), dtype=torch.float32, device=h_BSD.device)
        if stats_2E is not None and tcfg.moe_aux_loss:
            valid = None if attn is None else attn.valid_BS
            rows = float(B * S * lm.n_moe_layers) if valid is None else valid.sum().float() * lm.n_moe_layers
            aux = tcfg.router_aux_loss_coef * load_balancing_loss(stats_2E, rows, tcfg.num_experts)
        if labels is None:
            if logits_at is not None:
                h_BSD = h_BSD[torch.arange(B, device=h_BSD.device), logits_at]
            return ModelOutput(logits=lm.ops.logits(h_BSD, lm.lm_head_weight), loss_sum=None, aux_loss=aux)
        h_ND, labels_N = h_BSD.reshape(B * S, -1), labels.reshape(-1)
        if h_ND.device.type == "cpu":
            # CPU only: drop unlabeled positions before the vocab projection (VL SFT labels few tokens; the
            # boolean index needs the count on the host, free on CPU but a sync on accelerators).
            keep_N = labels_N != -100
            h_ND, labels_N = h_ND[keep_N], labels_N[keep_N]
        # the text model's loss op: chunked CE, or the fused Triton linear-CE when kernels are on
        loss_sum = lm.ops.cross_entropy(h_ND, lm.lm_head_weight, labels_N, tcfg.loss_chunk_size, tcfg.z_loss_weight)
        return ModelOutput(logits=None, loss_sum=loss_sum, aux_loss=aux)


def _vision_backend(cfg: Qwen3VLConfig, device: torch.device) -> str:
    b = cfg.vision_attn_backend
    if b != "auto":
        return b
    if device.type != "cuda":
        return "sdpa"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        return "varlen"
    except ImportError:
        return "flex"


def prepare_inputs(cfg: Qwen3VLConfig, batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Host-side: VisionMeta over the images then the videos of ``batch`` (CPU grids), on ``device``."""
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
    if not grids:
        return {}
    meta = build_vision_meta(torch.cat(grids), cfg.vision, _vision_backend(cfg, device), device)
    return {"vision_meta": meta._replace(n_image_tokens=n_img)}


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
    kind_of = {id(p): param_kind(n) for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for g in groups:
        by: dict[str, list] = {}
        for p in g["params"]:
            by.setdefault(kind_of.get(id(p), "llm"), []).append(p)
        for kind, ps in by.items():
            ng = {**g, "params": ps, "lr": lrs[kind], "name": f"{g.get('name', 'group')}/{kind}"}
            # LambdaLR schedules scale each group's initial_lr, so per-group peaks survive warmup/decay.
            ng["initial_lr"] = lrs[kind]
            out.append(ng)
    return out


def build(cfg: Qwen3VLConfig) -> Qwen3VLModel:
    """Build under the caller's device context (``with torch.device("meta"):`` in the trainer)."""
    return Qwen3VLModel(cfg)
