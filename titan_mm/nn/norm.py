"""RMSNorm as a pure function plus a parameter container.

Legend: x_*D = any leading dims, last dim D (normalized); w_D = scale weight.
Numerics follow HF Qwen3RMSNorm exactly: normalize in fp32, cast back to the input dtype, then scale.
These are also the references the Triton kernels (titan_mm.kernels) are tested against, in float64.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def rms_norm(x_ND: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * (x / sqrt(mean(x^2) + eps)); the normalization runs in fp32 (float64 stays float64: the kernel
    tests' ground truth) and is cast back before scaling."""
    in_dtype = x_ND.dtype
    xf = x_ND.to(torch.promote_types(in_dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w_D * xf.to(in_dtype)


def add_rms_norm(x_ND: torch.Tensor, residual_ND: torch.Tensor, w_D: torch.Tensor, eps: float,
                 norm=rms_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, unfused: ``h = residual + x`` (rounded to the activation dtype, as the
    eager add) and ``(norm(h, w, eps), h)``. The reference for titan_mm.kernels.add_rms_norm; ``norm`` is the
    RMSNorm the model uses otherwise (the Triton ``rms_norm`` when only that op is on)."""
    h_ND = residual_ND + x_ND
    return norm(h_ND, w_D, eps), h_ND


class RMSNorm(nn.Module):
    """Holds the scale weight; ``forward`` is ``impl(x, weight, eps)`` (default :func:`rms_norm`; the
    Triton op from titan_mm.kernels when a model's config turns kernels on)."""

    def __init__(self, dim: int, eps: float = 1e-6, impl=rms_norm):
        super().__init__()
        self.eps = eps
        self.impl = impl
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
