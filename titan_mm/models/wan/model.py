"""The Wan 2.1 / 2.2 video diffusion transformer (diffusers' WanTransformer3DModel) as pure-function blocks over a
sequence of patches.

Legend: B batch, S patches (video tokens), D model dim, H heads, K head_dim, L text tokens, P values per patch.

The batch is the video already cut into patches (:func:`patchify`): ``noisy_latents`` [B, S, P] with each patch's
values in (pt, ph, pw, C) order (the order of the output head, so the flow-matching target needs no reordering),
``grid_fhw`` [B, S, 3] each patch's (frame, row, column) for the 3-D RoPE, the noise level t in [0, 1] and
``text_states`` [B, L, text_dim] (UMT5's, one prompt per row). t comes as ``clip_timesteps`` [B] (one per clip,
Wan2.1: the time MLP runs once per row and its modulation broadcasts over the patches) or ``timesteps`` [B, S] (one
per patch, Wan2.2 TI2V keeps its first frame clean: the time MLP runs per patch, 6 D^2 more per token). Which one is
the host's choice (:func:`clip_timesteps`, the family's prepare_batch), never a sync in the forward. The parameter
names are diffusers' own, so its folders load without renaming, but for the output norm's table (hf.py maps it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_mm import kernels as K
from titan_mm.models.wan.config import NUM_TRAIN_TIMESTEPS, WanConfig
from titan_mm.nn import init
from titan_mm.nn.attention import AttnMeta, attention
from titan_mm.nn.flow import timestep_embedding
from titan_mm.nn.output import ModelOutput, Stream

ROPE_THETA = 10000.0


def _ln(x: torch.Tensor, eps: float, weight=None, bias=None) -> torch.Tensor:
    """diffusers' FP32LayerNorm: the norm in fp32 whatever the stream's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(),
                        None if bias is None else bias.float(), eps)


def rope_cos_sin(grid_BS3: torch.Tensor, cfg: WanConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, 1, K/2] of the 3-D RoPE: the head dim's pairs split over (frame, row, column), each axis's
    angles pos x theta^(-2j/dim) in fp64 and cast to fp32, as diffusers' WanRotaryPosEmbed tables."""
    angles = []
    for axis, d in enumerate(cfg.rope_dims):
        inv = ROPE_THETA ** -(torch.arange(0, d, 2, dtype=torch.float64, device=grid_BS3.device)[: d // 2] / d)
        angles.append(grid_BS3[..., axis, None].double() * inv)
    a = torch.cat(angles, -1)[:, :, None]
    return a.cos().float(), a.sin().float()


def apply_rope(x_BSHK: torch.Tensor, cos, sin) -> torch.Tensor:
    """Rotate interleaved pairs (x[2j], x[2j+1]) by the angles (diffusers' Wan layout)."""
    x1, x2 = x_BSHK.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).type_as(x_BSHK)


class QKNorm(nn.RMSNorm):
    """diffusers' ``norm_q`` / ``norm_k``: an nn.RMSNorm over all heads' features, run by titan_mm.kernels.rms_norm
    when the config's kernels include it (one pass each way with the weight's gradient, where the compiled
    reference's backward was the step's slowest norm: docs/wan.md). Tensor parallel replaces it with
    titan_mm.parallel.tp's ShardedRMSNorm (style "colwise_norm")."""

    def __init__(self, dim: int, eps: float, fused: bool):
        super().__init__(dim, eps=eps)
        self.fused = fused

    def forward(self, x):
        return K.rms_norm(x, self.weight, self.eps) if self.fused else super().forward(x)


class WanAttention(nn.Module):
    """Self- or cross-attention with RMSNorm over all heads' q and k (diffusers' WanAttention names)."""

    def __init__(self, cfg: WanConfig, ops: frozenset = frozenset()):
        super().__init__()
        D, self.head_dim, self.eps = cfg.dim, cfg.attention_head_dim, cfg.eps
        self.to_q, self.to_k, self.to_v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.to_out = nn.ModuleList([nn.Linear(D, D)])
        self.qk_norm = cfg.qk_norm is not None
        if self.qk_norm:
            fused = "rms_norm" in ops
            self.norm_q, self.norm_k = QKNorm(D, cfg.eps, fused), QKNorm(D, cfg.eps, fused)

    def forward(self, x_BSD, ctx_BLD, rope, meta: AttnMeta | None):
        q, k, v = self.to_q(x_BSD), self.to_k(ctx_BLD), self.to_v(ctx_BLD)
        if self.qk_norm:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))  # tensor parallel: H/tp local heads
        if rope is not None:  # self-attention: the video tokens, full within each clip (meta's "bidirectional")
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            o = attention(q, k, v, meta, None)
        else:  # cross-attention: every video token sees every text token of its row; no mask, no CP split of L
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return self.to_out[0](o.flatten(-2))


class _GeluProj(nn.Module):
    """Linear -> GELU(tanh); ``fused``: the bias and the GELU in titan_mm.kernels.bias_gelu after a bias-free GEMM
    (its backward sums the bias gradient in the same pass), while ``proj`` is a plain Linear on plain weights
    (float8's and tensor parallel's linears keep their own path)."""

    def __init__(self, i: int, o: int, fused: bool = False):
        super().__init__()
        self.proj, self.fused = nn.Linear(i, o), fused

    def forward(self, x):
        p = self.proj
        if self.fused and type(p) is nn.Linear and not isinstance(p.weight, DTensor):
            return K.bias_gelu(F.linear(x, p.weight), p.bias)
        return F.gelu(p(x), approximate="tanh")


class FeedForward(nn.Module):
    """Linear -> GELU(tanh) -> Linear, named as diffusers' FeedForward (net.0.proj, net.2)."""

    def __init__(self, dim: int, inner: int, fused_gelu: bool = False):
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(dim, inner, fused_gelu), nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x):
        return self.net[2](self.net[0](x))


class WanBlock(nn.Module):
    """Modulated self-attention, cross-attention to the text, modulated FFN; ``mod`` [B, S or 1, 6, D] is the
    timestep projection (per token, or per clip broadcast over the tokens)."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        D, self.eps = cfg.dim, cfg.eps
        ops = K.resolve_ops(cfg.kernels)  # the titan_mm.kernels ops the config turns on (the references otherwise)
        self.attn1, self.attn2 = WanAttention(cfg, ops), WanAttention(cfg, ops)
        self.norm2 = nn.LayerNorm(D, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = FeedForward(D, cfg.ffn_dim, "bias_gelu" in ops)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, D) / D**0.5)

    def forward(self, h, text, mod, rope, meta):
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + mod.float()).unbind(2)
        x = (_ln(h, self.eps) * (1 + scale) + shift).type_as(h)
        h = (h.float() + self.attn1(x, x, rope, meta) * gate).type_as(h)
        x = h if self.norm2 is None else _ln(h, self.eps, self.norm2.weight, self.norm2.bias).type_as(h)
        h = h + self.attn2(x, text, None, None)
        x = (_ln(h, self.eps) * (1 + c_scale) + c_shift).type_as(h)
        return (h.float() + self.ffn(x).float() * c_gate).type_as(h)


class _TimeEmbedder(nn.Module):
    def __init__(self, i: int, o: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(i, o), nn.Linear(o, o)

    def forward(self, x, act):
        return self.linear_2(act(self.linear_1(x)))


class _ConditionEmbedder(nn.Module):
    """diffusers' WanTimeTextImageEmbedding (T2V / TI2V: no image embedder)."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.time_embedder = _TimeEmbedder(cfg.freq_dim, cfg.dim)
        self.time_proj = nn.Linear(cfg.dim, 6 * cfg.dim)
        self.text_embedder = _TimeEmbedder(cfg.text_dim, cfg.dim)


class _HeadTable(nn.Module):
    """The output norm's modulation table [1, 2, D] (shift, scale): diffusers' root ``scale_shift_table``, held in a
    module so that the last pipeline stage owns it (hf.py maps the name)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)


class WanModel(nn.Module):
    """embed (patches, timesteps, text) -> trunk (blocks) -> head (modulated final norm); ``predict_velocity`` is
    the output projection (flow matching's hook)."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.cfg = cfg
        # diffusers' Conv3d weight [D, C, pt, ph, pw]: kept in its shape so folders round-trip; a patch-wise linear
        self.patch_embedding = nn.Conv3d(cfg.in_channels, cfg.dim, cfg.patch_size, cfg.patch_size)
        self.condition_embedder = _ConditionEmbedder(cfg)
        # a ModuleDict keyed "0".. (the FQNs of diffusers' ModuleList): pipeline stages drop the blocks they do not run
        self.blocks = nn.ModuleDict({str(i): WanBlock(cfg) for i in range(cfg.num_layers)})
        self.norm_out = _HeadTable(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.patch_dim)

    def init_weights(self, buffer_device=None) -> None:
        """Random init (the trainer's, under titan_mm.nn.init.seeded_init): weights N(0, 0.02), biases 0, norms 1,
        the modulation tables N(0, 1/D) as diffusers draws them. No buffers: RoPE angles come from the batch's grid."""
        for name, p in self.named_parameters():
            if name.endswith("scale_shift_table"):
                init.normal_(p, std=self.cfg.dim**-0.5)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name.rsplit(".", 2)[-2]:  # norm_q / norm_k / norm2 weights
                nn.init.ones_(p)
            else:
                init.normal_(p, std=0.02)

    def init_buffers(self, buffer_device=None) -> None:
        """Nothing to fill: the RoPE angles come from the batch's grid."""

    def embed(self, input_ids=None, noisy_latents=None, text_states=None, timesteps=None,
              clip_timesteps=None) -> Stream:
        """Stream(h [B, S, D], cond=(text [B, L, D], mod [B, S or 1, 6, D], temb [B, S or 1, D])) for ``timesteps``
        [B, S] (a t per patch) or ``clip_timesteps`` [B] (a t per clip: the time MLP runs once per row)."""
        timesteps = timesteps if clip_timesteps is None else clip_timesteps[:, None]  # [B, S] or [B, 1]
        w = self.patch_embedding.weight
        w_DP = w.permute(0, 2, 3, 4, 1).flatten(1)  # (pt, ph, pw, C): the patch order of the batch
        h = F.linear(noisy_latents.to(w.dtype), w_DP, self.patch_embedding.bias)
        ce = self.condition_embedder
        t = timestep_embedding(timesteps.float() * NUM_TRAIN_TIMESTEPS, self.cfg.freq_dim)
        temb = ce.time_embedder(t.to(ce.time_embedder.linear_1.weight.dtype), F.silu)
        mod = ce.time_proj(F.silu(temb)).unflatten(-1, (6, -1))
        text = ce.text_embedder(text_states.to(w.dtype), lambda x: F.gelu(x, approximate="tanh"))
        return Stream(h, cond=(text, mod, temb))

    def rope(self, position_ids, dtype, *, grid_fhw):
        """The 3-D RoPE's cos / sin from each patch's (frame, row, column): Wan reads ``grid_fhw``, not positions."""
        return rope_cos_sin(grid_fhw, self.cfg)

    def trunk(self, stream: Stream, rope, attn, start: int = 0, stop: int | None = None) -> Stream:
        """Blocks start .. stop-1 (any contiguous slice); the text states and the modulation ride in ``stream.cond``."""
        text, mod, _ = stream.cond
        h = stream.h
        for i in range(start, len(self.blocks) if stop is None else stop):
            h = self.blocks[str(i)](h, text, mod, rope, attn)
        return stream._replace(h=h)

    def head(self, stream: Stream, attn=None, hidden: bool = True) -> ModelOutput:
        """The final norm modulated by the time embedding, as ``hidden`` (``proj_out`` is flow matching's hook,
        :meth:`predict_velocity`)."""
        h, temb = stream.h, stream.cond[2]
        shift, scale = (self.norm_out.scale_shift_table + temb[:, :, None].float()).unbind(2)
        out = (_ln(h, self.cfg.eps) * (1 + scale) + shift).type_as(h)
        return ModelOutput(None, None, torch.zeros((), device=h.device), hidden=out)

    def forward(self, input_ids=None, position_ids=None, attn=None, loss=None, noisy_latents=None, timesteps=None,
                text_states=None, grid_fhw=None, clip_timesteps=None, **_):
        stream = self.embed(None, noisy_latents, text_states, timesteps, clip_timesteps)
        out = self.head(self.trunk(stream, self.rope(position_ids, stream.h.dtype, grid_fhw=grid_fhw), attn), attn)
        return out._replace(terms=loss(self, out)) if loss is not None else out

    def predict_velocity(self, out, batch):  # flow matching's hook: [B, S, P] in (pt, ph, pw, C) order
        return self.proj_out(out.hidden)


def build(cfg: WanConfig) -> WanModel:
    return WanModel(cfg)


def clip_timesteps(batch: dict) -> dict:
    """The batch with ``timesteps`` [B, S] replaced by ``clip_timesteps`` [B] when, on the host, each row's latent
    patches share one t (Wan2.1: flow matching's one noise unit per clip), so the forward runs the time MLP once
    per clip; otherwise (a t per patch, several clips in a row, a device batch) the batch as it is. Positions
    outside the latents get the row's t: they are no target and no clip attends them."""
    t, mask = batch.get("timesteps"), batch.get("latent_mask")
    if t is None or mask is None or t.device.type != "cpu" or not mask.any(1).all():
        return batch
    mask = mask.bool()
    first = t.gather(1, mask.int().argmax(1, keepdim=True))  # each row's first latent t
    if not bool(torch.where(mask, t == first, True).all()):
        return batch
    out = {k: v for k, v in batch.items() if k != "timesteps"}
    out["clip_timesteps"] = first[:, 0]
    return out


def patchify(x_BCFHW: torch.Tensor, patch: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent video [B, C, F, H, W] -> (patches [B, S, P] in (pt, ph, pw, C) order, grid [B, S, 3] (f, h, w) of
    each patch), S = F/pt x H/ph x W/pw in frame-major order (diffusers' token order)."""
    B, C, Fr, H, W = x_BCFHW.shape
    pt, ph, pw = patch
    if Fr % pt or H % ph or W % pw:
        raise ValueError(f"a latent video of {Fr}x{H}x{W} (frames x height x width) does not divide into patches "
                         f"of {pt}x{ph}x{pw}; crop or pad it to multiples")
    f, hh, ww = Fr // pt, H // ph, W // pw
    x = x_BCFHW.reshape(B, C, f, pt, hh, ph, ww, pw).permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(B, f * hh * ww, -1)
    grid = torch.stack(torch.meshgrid(*(torch.arange(n) for n in (f, hh, ww)), indexing="ij"), -1).reshape(1, -1, 3)
    return x, grid.expand(B, -1, -1).to(x.device)


def unpatchify(x_BSP: torch.Tensor, fhw: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of :func:`patchify`: [B, S, P] -> [B, C, F, H, W] for a grid of ``fhw`` patches."""
    B = x_BSP.shape[0]
    (f, hh, ww), (pt, ph, pw) = fhw, patch
    x = x_BSP.reshape(B, f, hh, ww, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(B, -1, f * pt, hh * ph, ww * pw)
