"""Pure PyTorch references for every kernel in titan_mm.kernels.

These are the numerical ground truth (tests run them in float64) and the fallback on CPU and on GPUs the
Triton path does not support. They follow HF transformers' Qwen3 / Qwen3-VL math exactly.

Legend: N = tokens (any leading dims flattened), D = hidden, F = MLP width, H = heads, Dh = head dim,
V = vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm: normalize in fp32, cast back to x.dtype, then scale by w."""
    dtype = x.dtype
    xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, w, eps), new_residual


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the Qwen3 MLP activation)."""
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _full_table(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """cos/sin tables may carry Dh/2 entries or Dh entries (halves duplicated, HF layout)."""
    if t.shape[-1] == head_dim // 2:
        t = torch.cat((t, t), dim=-1)
    return t


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3 half-rotation RoPE.

    q: [B, S, Hq, Dh], k: [B, S, Hk, Dh]; cos/sin: [B, S, Dh] or [S, Dh] (Dh/2 also accepted; the second
    half of a Dh table must duplicate the first, as HF builds it).
    """
    dh = q.shape[-1]
    cos = _full_table(cos, dh).unsqueeze(-2)  # [..., S, 1, Dh]
    sin = _full_table(sin, dh).unsqueeze(-2)
    q_out = q * cos + rotate_half(q) * sin
    k_out = k * cos + rotate_half(k) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def mrope_interleave(table_3: torch.Tensor, mrope_section: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Qwen3-VL interleaved M-RoPE layout (transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies).

    table_3: [3, ..., Dh/2] per-axis (T, H, W) cos or sin. Frequency j takes axis H when j % 3 == 1 and
    j < 3 * mrope_section[1], axis W when j % 3 == 2 and j < 3 * mrope_section[2], else axis T.
    Returns [..., Dh] (the Dh/2 result duplicated, as HF does).
    """
    out = table_3[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        idx = slice(offset, mrope_section[axis] * 3, 3)
        out[..., idx] = table_3[axis][..., idx]
    return torch.cat((out, out), dim=-1)


def apply_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: list[int] | tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved M-RoPE. cos/sin: [3, B, S, Dh/2] (or [3, B, S, Dh] with duplicated halves) per-axis tables,
    i.e. cos(position_ids[a, b, s] * inv_freq) for axis a in (T, H, W)."""
    dh = q.shape[-1]
    cos = mrope_interleave(cos[..., : dh // 2], mrope_section)
    sin = mrope_interleave(sin[..., : dh // 2], mrope_section)
    return apply_rope(q, k, cos, sin)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """sum over labels != ignore_index of CE(h @ weight.T, label) + z_loss * logsumexp^2, in fp32.

    h: [N, D] (any leading dims), weight: [V, D], labels: [N]. Chunked over tokens so that only
    chunk_size x V fp32 logits live at once (chunk_size=None: all at once).
    """
    h = h.reshape(-1, h.shape[-1])
    labels = labels.reshape(-1)
    n = h.shape[0]
    acc_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    total = h.new_zeros((), dtype=acc_dtype)
    step = n if chunk_size is None else max(1, chunk_size)
    for s in range(0, max(n, 1), step):
        logits = (h[s : s + step] @ weight.t()).to(acc_dtype)
        lab = labels[s : s + step]
        valid = lab != ignore_index
        lse = torch.logsumexp(logits, dim=-1)
        tgt = logits.gather(-1, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        per = lse - tgt
        if z_loss:
            per = per + z_loss * lse * lse
        total = total + torch.where(valid, per, torch.zeros_like(per)).sum()
    return total


_GELU_K0 = math.sqrt(2.0 / math.pi)


def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu(x + b, approximate='tanh') (the Qwen3-VL ViT MLP activation)."""
    return F.gelu(x + b, approximate="tanh")
