"""Rotary position embeddings (1-D), pure functions.

Legend: B batch, S sequence, H heads, K = Dh head_dim, F = K // 2 frequencies.
q_BSHK / k_BSHK are in [batch, seq, heads, head_dim] layout; cos_BSK / sin_BSK broadcast over heads.

Supported ``rope_type`` (the HF ``rope_parameters`` / legacy ``rope_scaling`` dict): "default", "linear",
"dynamic", "yarn", "llama3". Frequencies are computed here (our code); tests compare them to
transformers' ROPE_INIT_FUNCTIONS.

"dynamic" (NTK) note: HF grows the base only when a sequence is longer than max_position_embeddings at
run time, which needs the max position on the host. Training keeps frequencies fixed: for positions below
max_position_embeddings this equals HF exactly; pass ``seq_len`` to :func:`rope_inv_freq` to build
frequencies for a longer fixed context.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def _base_inv_freq(theta: float, dim: int, device=None) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponent)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 32768,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (fp32) and the attention scaling applied to cos/sin.

    ``scaling`` is an HF rope dict (keys ``rope_type``/``type``, ``factor``, ...); None means default RoPE.
    """
    rtype = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {rtype!r} is not supported by titan_mm (supported: {ROPE_TYPES}); "
            "add it to titan_mm/nn/rope.py with a parity test against transformers"
        )
    dim = head_dim
    if rtype == "default":
        return _base_inv_freq(theta, dim, device), 1.0
    factor = float(scaling["factor"])
    if rtype == "linear":
        return _base_inv_freq(theta, dim, device) / factor, 1.0
    if rtype == "dynamic":
        L = max(seq_len or 0, max_position_embeddings)
        base = theta * ((factor * L / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim, device), 1.0
    if rtype == "llama3":
        inv = _base_inv_freq(theta, dim, device)
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    orig_ctx = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if scaling.get("factor") is None:
        factor = max_position_embeddings / orig_ctx

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn_factor = mscale_of(factor, m) / mscale_of(factor, m_all) if (m and m_all) else mscale_of(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def corr_dim(n_rot: float) -> float:  # dimension whose wavelength makes n_rot turns over orig_ctx
        return dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrap_weight = 1 - ramp
    base_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv = (1.0 / (factor * base_freqs)) * (1 - extrap_weight) + (1.0 / base_freqs) * extrap_weight
    return inv, float(attn_factor)


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq_F: torch.Tensor, attn_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*position_ids.shape, 2F] in ``dtype`` (HF layout: frequencies repeated twice)."""
    freqs = position_ids[..., None].float() * inv_freq_F.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attn_scaling).to(dtype), (emb.sin() * attn_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim's halves (HF's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q_BSHK: torch.Tensor, k_BSHK: torch.Tensor, cos_BSK: torch.Tensor, sin_BSK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (rotate-half convention, as HF Qwen3). q / k [B, S, H, K] (or [S, H, K]); cos / sin
    [B, S, X] or [S, X] with X = K (HF layout, halves duplicated) or K/2. Outputs in the dtypes of q and k.
    The reference of titan_mm.kernels.apply_rope, which accepts the same layouts."""
    K = q_BSHK.shape[-1]
    if cos_BSK.shape[-1] == K // 2:  # a half table: duplicate it to the HF layout
        cos_BSK, sin_BSK = torch.cat((cos_BSK, cos_BSK), -1), torch.cat((sin_BSK, sin_BSK), -1)
    cos, sin = cos_BSK.unsqueeze(-2), sin_BSK.unsqueeze(-2)  # broadcast over heads
    q = q_BSHK * cos + rotate_half(q_BSHK) * sin
    k = k_BSHK * cos + rotate_half(k_BSHK) * sin
    return q.to(q_BSHK.dtype), k.to(k_BSHK.dtype)
