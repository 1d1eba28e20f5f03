"""How far two fp32 AdamW implementations (torch's foreach / fused step, titan_mm.kernels.adamw_step_) may leave
a parameter apart after a few steps, derived from the arithmetic instead of measured on one machine.

Per step, either implementation is within u * (2|p| + lr * (4 + k1 + k2 / 2)) of exact arithmetic, u = 2^-24
(fp32's unit roundoff):
- 2 u |p|: the parameter is rounded twice (after the weight decay, after the update);
- 4 u lr: the update lr * m_hat / (sqrt(v_hat) + eps), |m_hat / sqrt(v_hat)| <= ~1, takes a few roundings (the
  moments' own last bits included: a moment that cancels to ~0 moves the update by that much of lr, no more);
- k u lr, k = (3t + 3) beta^t / (1 - beta^t): the bias correction 1 - beta^t in fp32. beta^t is off by t u
  (beta rounded to fp32) plus the power's own error: the Triton kernel's exp2(t log2(beta)) on the GPU takes
  ex2.approx (2.8 u) and lg2.approx (2^-22.6 absolute, 1.8 t u after exp2); the subtraction then amplifies
  beta^t's relative error by beta^t / (1 - beta^t). sqrt halves k2.
Two implementations are within the sum of their gaps, and the steps' gaps add up.
"""

from __future__ import annotations

import torch

U32 = 2.0**-24


def _kappa(beta: float, t: int) -> float:
    return (3 * t + 3) * beta**t / (1 - beta**t)


def adamw_gap(p: torch.Tensor, lr: float, betas: tuple[float, float], steps: int) -> torch.Tensor:
    """Elementwise bound on |a - b| for two AdamW implementations' parameters after ``steps`` steps; ``p``: either
    one's parameters (the bound's |p| term takes the larger of p now and one lr-sized move per step)."""
    b1, b2 = betas
    per_lr = sum(4 + _kappa(b1, t) + _kappa(b2, t) / 2 for t in range(1, steps + 1))
    size = p.detach().abs().float() + steps * lr
    return 2 * U32 * (2 * steps * size + lr * per_lr)


def assert_adamw_close(a: torch.Tensor, b: torch.Tensor, lr: float, betas: tuple[float, float], steps: int,
                       msg: str = "") -> None:
    gap = (a.detach().float() - b.detach().float()).abs()
    bound = adamw_gap(b, lr, betas, steps)
    worst = int((gap / bound).argmax())
    assert bool((gap <= bound).all()), (f"{msg} AdamW results {gap.flatten()[worst]:.3g} apart, bound "
                                        f"{bound.flatten()[worst]:.3g} (|p| {b.flatten()[worst].abs():.3g})")
