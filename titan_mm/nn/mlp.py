"""SwiGLU feed-forward and the MLP activations (the references of titan_mm.kernels.swiglu / bias_gelu).

Legend: N tokens (any leading dims), D model dim, F hidden dim. w1 = gate, w3 = up, w2 = down
(nn.Linear layout: weight [out, in]).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_mm.nn import init


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the Qwen3 MLP activation)."""
    return F.silu(gate) * up


def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu(x + b, approximate='tanh') (the Qwen3-VL ViT MLP activation after a bias-free fc1)."""
    return F.gelu(x + b, approximate="tanh")


class SwiGLU(nn.Module):
    """``act_mul(gate, up)`` defaults to silu(gate) * up (titan_mm.kernels.swiglu when kernels are on)."""

    def __init__(self, dim: int, hidden_dim: int, act_mul=silu_mul):
        super().__init__()
        self.act_mul = act_mul
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w13: nn.Linear | None = None  # serving's layout: gate and up in one [2F, D] (serve/runner/weights.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:  # one GEMM; gate and up are column views of its output
            return self.w2(self.act_mul(*self.w13(x).chunk(2, dim=-1)))
        return self.w2(self.act_mul(self.w1(x), self.w3(x)))

    def reset_parameters(self, std: float) -> None:
        for lin in (self.w1, self.w3, self.w2):
            init.normal_(lin.weight, mean=0.0, std=std)
