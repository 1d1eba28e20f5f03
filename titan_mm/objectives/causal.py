"""The causal LM: next-token cross-entropy over the data's labels.

Batch fields: ``labels`` [B, S] int64, already shifted (``labels[b, t]`` is the target of position t; -100 =
ignore: padding, prompts, each document's last token) and ``num_label_tokens`` (the count of labels != -100, the
term's normalizer share); optional ``loss_weights`` [B, S] fp32 per-token weights (a diffusion objective's 1/t) and
``label_index`` [N] int64, the flat positions (over B x S) of the labels != -100, which a family's prepare_batch builds
on the host where few tokens carry labels (BAGEL: the text of packed rows of images), so the head runs on those rows
alone without a host sync. Term ``"ce"``: sum over labeled tokens of w x CE, through the family hook

    model.lm_loss(hidden [B, S, D], targets [B, S], weights [B, S] | None, index [N] | None) -> fp32 sum

which runs the LM head and the fused linear cross-entropy (titan_mm.kernels.linear_cross_entropy, or
titan_mm.nn.loss.chunked_cross_entropy; their vocab-parallel forms under TP loss parallel): no [N, V] logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan_mm.objectives.base import Objective


@dataclass(frozen=True)
class CausalLM(Objective):
    """Next-token prediction with causal attention (the default of every text family)."""

    terms = ("ce",)
    fields = ("labels", "num_label_tokens")
    loss_keys = ("labels", "num_label_tokens", "loss_weights", "label_index")
    host_keys = ("num_label_tokens",)
    mask_kind = "causal"

    def counts(self, batch: dict[str, Any]) -> dict[str, int]:
        return {"ce": int(batch["num_label_tokens"])}

    def loss_sums(self, model, out, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"ce": model.lm_loss(out.hidden, batch["labels"], batch.get("loss_weights"), batch.get("label_index"))}
