"""AdamW over the one-rank cast path's kept copies (``parallel.one_rank_mixed_precision = optimizer``).

The cast path (titan_mm.parallel.apply.CastCopies) leaves each large parameter's gradient in bf16 and keeps its
bf16 compute copy between steps. This optimizer updates those parameters with titan_mm.kernels.adamw_step_, one
pass that reads the bf16 gradient and writes the fp32 parameter, both moments and the next forward's copy; every
other parameter (its gradient in ``.grad``) goes through torch's AdamW as before. The state is torch's (``step``,
``exp_avg``, ``exp_avg_sq`` per parameter), so a checkpoint moves between this and torch.optim.AdamW.

    opt = CastAdamW(groups, copies=cast_copies(model), lr=..., fused=True)   # built by titan_mm.train.optim
"""

from __future__ import annotations

import torch

from titan_mm.kernels import adamw_step_
from titan_mm.parallel.apply import CastCopies

__all__ = ["CastAdamW"]


class CastAdamW(torch.optim.AdamW):
    def __init__(self, params, copies: CastCopies, **kwargs):
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("CastAdamW (parallel.one_rank_mixed_precision = optimizer) has no amsgrad / maximize; "
                             "use parallel.one_rank_mixed_precision = cast")
        super().__init__(params, **kwargs)
        self.copies = copies

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CastAdamW.step takes no closure")
        super().step()  # the parameters with a .grad
        for group in self.param_groups:  # torch's fused kernel leaves p._version alone: their copies are stale
            for p in group["params"]:
                if p.grad is not None:
                    self.copies.drop(p)
        # GradScaler's attributes, read as torch's fused step reads them (titan_mm.train.step._update sets them)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                raise ValueError("CastAdamW takes a float lr (a tensor would be read on the host every step)")
            todo = [(p, g) for p in group["params"] if (g := self.copies.grad(p)) is not None]
            for p, _ in todo:
                state = self.state[p]
                if not state:  # torch's fused AdamW's initial state
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            steps = [self.state[p]["step"] for p, _ in todo]
            if steps:
                torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            for p, g in todo:
                state, copy = self.state[p], self.copies.copy_of(p)
                if copy is None:
                    raise RuntimeError("CastAdamW: a parameter with a kept gradient has no current copy: it was "
                                       "changed between its backward and this step; change parameters after "
                                       "opt.step(), or use parallel.one_rank_mixed_precision = cast")
                adamw_step_(p, g, state["exp_avg"], state["exp_avg_sq"], copy, state["step"], group["lr"], beta1,
                            beta2, group["eps"], group["weight_decay"], grad_scale, found_inf)
                self.copies.keep(p, copy)  # p changed with the copy (the torch reference bumps p's version)
            if steps and found_inf is not None:  # a skipped step does not count, as in torch's fused step
                torch._foreach_sub_(steps, [found_inf] * len(steps))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.copies.clear_grads()
