"""Chunked linear + cross-entropy that never holds fp32 logits for all tokens at once.

Legend: N tokens, D hidden, V vocab (V/tp rows on each rank when vocab-parallel), C chunk of tokens.

``chunked_cross_entropy(h_ND, w_VD, labels_N)`` returns the SUM of token losses over labels != -100
(fp32 scalar); the train step divides by the global label-token count. Logits are computed chunk by chunk
in the weight's dtype and upcast to fp32 for the softmax (as HF does; float64 stays float64, which makes
this the float64 reference of the Triton linear-CE in titan_mm.kernels); gradients for h and w are computed
in the same pass (forward), so the backward only scales them: peak extra memory is one [C, V] fp32 chunk.
Optional z-loss: ``z_loss_weight * sum(logsumexp^2)`` over the same tokens. Optional per-token weights
``weights_N`` (fp32 [N], e.g. the 1/t of a masked-diffusion objective): each token's loss (z-loss included) and
its gradient are multiplied by its weight, so the result is ``sum_i w_i * CE_i``; None means every weight is 1.

Vocab-parallel (loss parallel, ``group=`` a process group): ``w_VD`` is this rank's rows
[vocab_start, vocab_start + V/tp) of the head and ``h_ND`` / ``labels_N`` are the same on every rank. Per
chunk the max, the sum of exponentials and the target logit are all-reduced over the group, so every rank
returns the same loss; the weight's gradient is this shard's and h's gradient is all-reduced once at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def head_rows(h_ND: torch.Tensor, labels_N: torch.Tensor, weights_N: torch.Tensor | None,
              index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows an LM head's loss runs on: those of ``index`` (the labeled positions, built on the host by the data
    pipeline or a family's prepare_batch: no sync), else on the CPU the labeled ones (a boolean index, whose count is a
    host sync on an accelerator, where every row stays and the loss skips the ignored ones)."""
    if index is not None:
        keep = index
    elif h_ND.device.type == "cpu":
        keep = labels_N != IGNORE_INDEX
    else:
        return h_ND, labels_N, weights_N
    return h_ND[keep], labels_N[keep], None if weights_N is None else weights_N[keep]


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk_size: int, z_loss_weight: float, ignore_index: int, group,
                vocab_start: int, weights_N):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, V = h_ND.shape[0], w_VD.shape[0]
        acc = torch.promote_types(h_ND.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=h_ND.device)
        grad_h = torch.empty_like(h_ND) if need_h else None
        grad_w = torch.zeros(w_VD.shape, dtype=acc, device=w_VD.device) if need_w else None
        for s in range(0, N, chunk_size):
            h_c = h_ND[s : s + chunk_size]
            y_c = labels_N[s : s + chunk_size]
            logits = (h_c @ w_VD.t()).to(acc)
            valid = y_c != ignore_index
            if group is None:
                mine, loc = valid, torch.where(valid, y_c, 0)
                lse = torch.logsumexp(logits, dim=-1)
                tgt_logit = logits.gather(1, loc[:, None]).squeeze(1)
            else:  # the softmax runs over every rank's shard: reduce its pieces
                m = logits.amax(-1)
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                sumexp = torch.exp(logits - m[:, None]).sum(-1)
                dist.all_reduce(sumexp, group=group)
                lse = torch.log(sumexp) + m
                loc = y_c - vocab_start
                mine = valid & (loc >= 0) & (loc < V)  # the target row lives in this shard
                loc = loc.clamp(0, max(V - 1, 0))
                tgt_logit = torch.where(mine, logits.gather(1, loc[:, None]).squeeze(1), torch.zeros_like(lse))
                dist.all_reduce(tgt_logit, group=group)
            vf = valid.to(acc)  # the token's weight, 0 on ignored rows
            if weights_N is not None:
                vf = vf * weights_N[s : s + chunk_size].to(acc)
            total = total + ((lse - tgt_logit) * vf).sum()
            if z_loss_weight:
                total = total + z_loss_weight * (lse.square() * vf).sum()
            if need_h or need_w:
                # d/dlogits: softmax - onehot (+ 2 z lse softmax), zero on ignored rows
                p = torch.exp(logits - lse[:, None])
                coef = vf if not z_loss_weight else vf * (1 + 2 * z_loss_weight * lse)
                g = p * coef[:, None]
                g.scatter_add_(1, loc[:, None], -(mine.to(acc) * vf)[:, None])  # vf is 0 where not valid
                g = g.to(h_ND.dtype)
                if need_h:
                    grad_h[s : s + chunk_size] = g @ w_VD
                if need_w:
                    grad_w += (g.t() @ h_c).to(acc)
        if need_h and group is not None:
            dist.all_reduce(grad_h, group=group)  # every vocabulary shard contributes to each token's gradient
        ctx.save_for_backward(grad_h if need_h else None, grad_w.to(w_VD.dtype) if need_w else None)
        return total

    @staticmethod
    def backward(ctx, g_out):
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * g_out.to(grad_h.dtype) if grad_h is not None else None,
            grad_w * g_out.to(grad_w.dtype) if grad_w is not None else None,
            None, None, None, None, None, None, None,
        )


def chunked_cross_entropy(
    h_ND: torch.Tensor,
    w_VD: torch.Tensor,
    labels_N: torch.Tensor,
    chunk_size: int = 4096,
    z_loss_weight: float = 0.0,
    *,
    group=None,
    vocab_start: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    weights_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over tokens with label != ignore_index of CE(h @ w.T, label) [+ z-loss], each times its weight in
    ``weights_N`` [N] (None: 1); fp32 scalar.

    ``group``: vocab-parallel over that process group, ``w_VD`` being this rank's rows starting at
    ``vocab_start`` (default: rank-in-group x rows, equal shards); see the module docstring."""
    if h_ND.dim() != 2 or labels_N.dim() != 1:
        raise ValueError(f"expected h [N, D] and labels [N], got {tuple(h_ND.shape)} and {tuple(labels_N.shape)}")
    if isinstance(w_VD, DTensor):
        raise TypeError("chunked_cross_entropy takes plain tensors: pass a vocabulary-sharded head as "
                        "w.to_local() with group= and vocab_start=.")
    if weights_N is not None and tuple(weights_N.shape) != tuple(labels_N.shape):
        raise ValueError(f"weights_N has shape {tuple(weights_N.shape)}; it needs one weight per label, "
                         f"{tuple(labels_N.shape)}")
    if group is not None and vocab_start is None:
        vocab_start = dist.get_rank(group) * w_VD.shape[0]
    return _ChunkedLinearCE.apply(h_ND, w_VD, labels_N, int(chunk_size), float(z_loss_weight), int(ignore_index),
                                  group, int(vocab_start or 0), None if weights_N is None else weights_N.detach())

