"""Chunked linear + cross-entropy that never holds fp32 logits for all tokens at once.

Legend: N tokens, D hidden, V vocab, C chunk of tokens.

``chunked_cross_entropy(h_ND, w_VD, labels_N)`` returns the SUM of token losses over labels != -100
(fp32 scalar); the train step divides by the global label-token count. Logits are computed chunk by chunk
in the weight's dtype and upcast to fp32 for the softmax (as HF does); gradients for h and w are computed
in the same pass (forward), so the backward only scales them: peak extra memory is one [C, V] fp32 chunk.
Optional z-loss: ``z_loss_weight * sum(logsumexp^2)`` over the same tokens.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk_size: int, z_loss_weight: float):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N = h_ND.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h = torch.empty_like(h_ND) if need_h else None
        grad_w = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w else None
        for s in range(0, N, chunk_size):
            h_c = h_ND[s : s + chunk_size]
            y_c = labels_N[s : s + chunk_size]
            logits = (h_c @ w_VD.t()).float()
            valid = y_c != IGNORE_INDEX
            tgt = torch.where(valid, y_c, 0)
            lse = torch.logsumexp(logits, dim=-1)
            tgt_logit = logits.gather(1, tgt[:, None]).squeeze(1)
            vf = valid.float()
            total = total + ((lse - tgt_logit) * vf).sum()
            if z_loss_weight:
                total = total + z_loss_weight * (lse.square() * vf).sum()
            if need_h or need_w:
                # d/dlogits: softmax - onehot (+ 2 z lse softmax), zero on ignored rows
                p = torch.exp(logits - lse[:, None])
                coef = vf if not z_loss_weight else vf * (1 + 2 * z_loss_weight * lse)
                g = p * coef[:, None]
                g.scatter_add_(1, tgt[:, None], -vf[:, None])
                g = g.to(h_ND.dtype)
                if need_h:
                    grad_h[s : s + chunk_size] = g @ w_VD
                if need_w:
                    grad_w += (g.t() @ h_c).float()
        ctx.save_for_backward(grad_h if need_h else None, grad_w.to(w_VD.dtype) if need_w else None)
        return total

    @staticmethod
    def backward(ctx, g_out):
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * g_out.to(grad_h.dtype) if grad_h is not None else None,
            grad_w * g_out.to(grad_w.dtype) if grad_w is not None else None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    h_ND: torch.Tensor,
    w_VD: torch.Tensor,
    labels_N: torch.Tensor,
    chunk_size: int = 4096,
    z_loss_weight: float = 0.0,
) -> torch.Tensor:
    """Sum over tokens with label != -100 of CE(h @ w.T, label) [+ z-loss]; fp32 scalar."""
    if h_ND.dim() != 2 or labels_N.dim() != 1:
        raise ValueError(f"expected h [N, D] and labels [N], got {tuple(h_ND.shape)} and {tuple(labels_N.shape)}")
    return _ChunkedLinearCE.apply(h_ND, w_VD, labels_N, int(chunk_size), float(z_loss_weight))


def reference_cross_entropy(h_ND, w_VD, labels_N, z_loss_weight: float = 0.0) -> torch.Tensor:
    """Plain (full-logits) version for tests."""
    logits = (h_ND @ w_VD.t()).float()
    loss = torch.nn.functional.cross_entropy(logits, labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
    if z_loss_weight:
        valid = (labels_N != IGNORE_INDEX).float()
        loss = loss + z_loss_weight * (torch.logsumexp(logits, -1).square() * valid).sum()
    return loss
