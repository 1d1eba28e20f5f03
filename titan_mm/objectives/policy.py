"""The policy objective of RL post-training (GRPO / DAPO-style, docs/rl.md): a clipped policy gradient over sampled
completions, with the importance ratio against the log-probabilities the rollout engine reported, and an optional
KL term to a frozen reference (k3 estimator).

Batch fields (one completion per row, built by titan_mm.rl from the rollouts): ``labels`` [B, S] int64, shifted as
the causal LM's (the completion's tokens; -100 on the prompt, padding and the last token), ``old_logprobs`` [B, S]
(the engine's logprob of each target), ``advantages`` [B, S] (the completion's group-normalized advantage on each
of its tokens), ``rl_weights`` [B, S] (1, or 1 / completion length for sequence normalization) and, with a KL term,
``ref_logprobs`` [B, S]. Per token, with r = exp(logp - old_logprobs) and A the advantage:

    pg = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)          kl = kl_coef (exp(ref - logp) - (ref - logp) - 1)

Terms (sums of w x per-token value): ``pg`` and ``kl``, normalized by the global count of completion tokens
(loss_norm "token") or of completions ("sequence", w = 1 / length). Logged only (``stats``): ``entropy`` (the
policy's next-token entropy), ``clip_frac`` (tokens whose ratio was clipped) and ``logprob_gap`` (|logp -
old_logprobs|: at staleness 0 the engine's logprobs against the trainer's on the same weights, the bias a precision
or kernel mismatch puts in the ratio; at k >= 1 the policy's drift too), each a mean over the tokens.
``label_index`` [N] int64 (optional): the flat positions (over B x S) of the labels != -100, built on the host
(titan_mm.rl's collate), so the head runs on those rows alone. Family hook:

    model.token_logprobs(hidden [B, S, D], targets [B, S], index [N] | None) -> (logp [B, S] fp32, entropy [B, S] fp32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan_mm.objectives.base import Objective

IGNORE = -100


@dataclass(frozen=True)
class Policy(Objective):
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0
    loss_norm: str = "token"

    stats = ("entropy", "clip_frac", "logprob_gap")
    host_keys = ("num_label_tokens",)
    mask_kind = "causal"

    @property
    def terms(self) -> tuple[str, ...]:
        return ("pg",) + (("kl",) if self.kl_coef else ()) + self.stats

    @property
    def fields(self) -> tuple[str, ...]:
        return ("labels", "old_logprobs", "advantages", "rl_weights") + (("ref_logprobs",) if self.kl_coef else ())

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return ("labels", "num_label_tokens", "old_logprobs", "advantages", "rl_weights", "ref_logprobs",
                "label_index")

    def counts(self, batch: dict[str, Any]) -> dict[str, int]:
        valid = batch["labels"] != IGNORE
        tokens = int(valid.sum())
        n = tokens if self.loss_norm == "token" else int(valid.any(1).sum())
        return {t: (n if t in ("pg", "kl") else tokens) for t in self.terms}

    def loss_sums(self, model, out, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        logp, ent = model.token_logprobs(out.hidden, labels, batch.get("label_index"))
        return policy_sums(logp, ent, labels, batch, self)


def policy_sums(logp: torch.Tensor, ent: torch.Tensor, labels: torch.Tensor, batch: dict[str, Any],
                obj: Policy) -> dict[str, torch.Tensor]:
    """The terms of :class:`Policy` from the policy's per-token ``logp`` / ``ent`` [B, S] (fp32)."""
    dt = logp.dtype  # fp32 from the hook; the batch's fp32 values follow it
    valid = (labels != IGNORE).to(dt)
    w = batch["rl_weights"].to(dt) * valid
    adv = batch["advantages"].to(dt)
    # masked positions: ratio exp(0) = 1, so nothing overflows there; their weight is 0
    delta = (logp - batch["old_logprobs"].to(dt)) * valid
    ratio = delta.exp()
    clipped = ratio.clamp(1.0 - obj.eps_low, 1.0 + obj.eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    sums = {"pg": (w * pg).sum()}
    if obj.kl_coef:
        d = (batch["ref_logprobs"].to(dt) - logp) * valid
        sums["kl"] = obj.kl_coef * (w * (d.exp() - d - 1.0)).sum()
    # a token counts as clipped when the clipped side of the min was the smaller one (its gradient is 0)
    was_clipped = ((clipped * adv) < (ratio * adv)).to(dt) * valid
    sums["entropy"] = (ent.detach() * valid).sum()
    sums["clip_frac"] = was_clipped.detach().sum()
    sums["logprob_gap"] = delta.detach().abs().sum()
    return sums
