"""Diffusion LMs: masked (LLaDA), shifted (Dream) and block (SDAR / BD3-style) diffusion. One switch,
``[objective] kind``, on any registered family whose ModelSpec names the causal LM (docs/dllm.md says why this is not
a family): the diffusion kind takes the causal LM's place.

    obj = build_diffusion(cfg, spec, model_cfg)               # None for kind "causal"
    micro_batches = obj.prepare(micro_batches, step, dp_rank)  # host, in train_step, before the counts

An objective corrupts each micro-batch on the host, before the CP split and the forward (the forward stays
sync-free and the same noise reaches every backend and device):
  * which tokens may be masked (``maskable``): every token of a document (pre-training) or, with ``sft``, the tokens
    the data marks as targets (the assistant turns; prompts stay clean). shifted_diffusion drops each document's
    first token (no hidden state before it predicts it).
  * t per noise unit, t = eps + (1 - eps) * u, u ~ U[0, 1): the unit is a document (masked / shifted) or a block of
    ``block_size`` tokens of a document (block). Each maskable token becomes ``mask_id`` with probability t.
  * ``input_ids``: the noisy tokens; ``labels``: the clean token at each masked position (shifted: at the position
    before it), -100 elsewhere; ``loss_weights`` [B, S] fp32: 1/t there, 0 elsewhere; ``num_label_tokens``: the
    number of maskable tokens (the normalizer).
The loss is the causal LM's term "ce" (the family's ``lm_loss`` hook): sum_i w_i CE_i (titan_mm.nn.loss,
titan_mm.kernels), and the step divides it by the global count of maskable tokens N of the whole global batch:

    loss = sum over masked tokens i of CE(x0_i | x_t) / t_i  /  N

This is LLaDA's pre-training loss (sum / (batch x length) over rows without padding) and, with ``sft``, its SFT loss
with the answer length normalization taken over the global batch (token mean) instead of per sample. Its expectation
over the noise is the per-token ELBO bound on the negative log-likelihood.

Noise: a CPU generator seeded by (training.seed, step, global micro-batch slot = dp_rank x n_micro + i), the slot of
the data stream's layout (titan_mm.data.loader.StreamLayout), so the draws are the same for any dp world and are
bitwise on resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_mm.config import ConfigError, JobConfig
from titan_mm.data.tokenizer import load_tokenizer, tokenizer_for
from titan_mm.models.hf_io import local_hf_dir, read_hf_config
from titan_mm.nn.attention import check_kind, doc_positions
from titan_mm.objectives.base import noise_generator
from titan_mm.objectives.causal import CausalLM

IGNORE_INDEX = -100
MASK_KINDS = {"masked_diffusion": "bidirectional", "shifted_diffusion": "bidirectional",
              "block_diffusion": "block_causal"}
"""The attention mask kind (titan_mm.nn.attention KINDS) each diffusion kind trains with."""
MASK_TOKENS = ("<|mask|>", "<|MASK|>", "<mask>")
"""Tokens ``mask_token = "auto"`` takes when the tokenizer has one (in this order)."""
HF_NOTE_KEY = "titan_mm_objective"
"""The config.json key of an exported diffusion model that records its objective."""


@dataclass(frozen=True)
class DiffusionLM(CausalLM):
    """A diffusion objective, resolved (mask id known). Pure host-side functions of a batch and its noise; the loss
    is the causal LM's weighted cross-entropy on the targets ``prepare`` writes."""

    kind: str
    mask_id: int
    eps: float = 1e-3
    block_size: int | None = None
    """Tokens per block (block_diffusion only)."""
    sft: bool = False
    seed: int = 0

    seq_keys = ("loss_weights",)

    @property
    def mask_kind(self) -> str:
        return MASK_KINDS[self.kind]

    @property
    def shifted(self) -> bool:
        """Hidden state i predicts token i + 1 (Dream)."""
        return self.kind == "shifted_diffusion"

    # ---- host-side pieces ----
    def maskable(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, S] bool: the tokens this objective may mask (and scores when masked)."""
        ids = batch["input_ids"]
        B, S = ids.shape
        doc = batch.get("doc_ids")
        valid = torch.ones(B, S, dtype=torch.bool) if doc is None else doc >= 0
        if self.sft:  # target tokens: the data's labels are shifted, labels[t - 1] names token t
            same = torch.ones(B, S - 1, dtype=torch.bool) if doc is None else doc[:, 1:] == doc[:, :-1]
            out = torch.zeros(B, S, dtype=torch.bool)
            out[:, 1:] = (batch["labels"][:, :-1] != IGNORE_INDEX) & same & valid[:, 1:]
            return out
        if self.shifted:  # a document's first token has no hidden state before it
            return valid & (doc_positions(doc, B, S) > 0)
        return valid

    def noise(self, shape: tuple[int, int], step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(u_t, u_mask), each [B, S] U[0, 1) fp32, from a CPU generator seeded by (seed, step, slot)."""
        u = torch.rand((2, *shape), generator=noise_generator(self.seed, step, slot), dtype=torch.float32)
        return u[0], u[1]

    def corrupt(self, batch: dict[str, torch.Tensor], u_t: torch.Tensor, u_mask: torch.Tensor) -> dict[str, Any]:
        """The micro-batch the model trains on, for noise draws ``u_t`` / ``u_mask`` ([B, S] U[0, 1)): the value of
        t of a noise unit is ``u_t`` at the unit's first token."""
        ids = batch["input_ids"]
        B, S = ids.shape
        doc = batch.get("doc_ids")
        pos = doc_positions(doc, B, S)
        first = torch.arange(S).expand(B, S) - (pos % self.block_size if self.block_size else pos)
        p = self.eps + (1.0 - self.eps) * u_t.gather(1, first)
        keep = self.maskable(batch)
        masked = keep & (u_mask < p)
        weight = torch.where(masked, 1.0 / p, torch.zeros_like(p))
        out = dict(batch)
        out["input_ids"] = torch.where(masked, torch.full_like(ids, self.mask_id), ids)
        target = torch.where(masked, ids, torch.full_like(ids, IGNORE_INDEX))
        if self.shifted:  # scored at the position before: labels are shifted like the causal objective's
            target = torch.cat([target[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], 1)
            weight = torch.cat([weight[:, 1:], torch.zeros_like(weight[:, :1])], 1)
        out["labels"], out["loss_weights"] = target, weight
        out["num_label_tokens"] = keep.sum().to(torch.int64)
        if ids.is_pinned():  # the loader pins batches for non-blocking copies; keep that for the new tensors
            for k in ("input_ids", "labels", "loss_weights"):
                out[k] = out[k].pin_memory()
        return out

    def prepare(self, micro_batches: list[dict], step: int, dp_rank: int = 0) -> list[dict]:
        """The corrupted micro-batches of optimizer step ``step`` (0-based) on data-parallel rank ``dp_rank``."""
        n = len(micro_batches)
        return [self.corrupt(mb, *self.noise(tuple(mb["input_ids"].shape), step, dp_rank * n + i))
                for i, mb in enumerate(micro_batches)]

    # ---- what other parts ask ----
    def hf_note(self) -> dict[str, Any]:
        """What an exported HF folder records in config.json under ``titan_mm_objective``."""
        note = {"kind": self.kind, "mask_token_id": self.mask_id, "eps": self.eps, "sft": self.sft,
                "attention": self.mask_kind}
        if self.block_size:
            note["block_size"] = self.block_size
        return note


def resolve_mask_id(mask_token: str, tokenizer, vocab_size: int) -> int:
    """The mask token's id (``objective.mask_token``, docs/dllm.md): "auto", a token of ``tokenizer`` or a decimal
    id; ``tokenizer`` None (synthetic data): "auto" is vocab_size - 1. Raises ConfigError naming what to add."""
    if mask_token.isdigit():
        i = int(mask_token)
    elif mask_token != "auto":
        if tokenizer is None:
            raise ConfigError(f"objective.mask_token {mask_token!r} names a token, but this run has no tokenizer "
                              "(synthetic data); give a decimal id or 'auto'")
        i = tokenizer.token_to_id(mask_token)
        if i is None:
            raise ConfigError(f"objective.mask_token {mask_token!r} is not a token of {tokenizer.path}; add it to "
                              "the tokenizer's added tokens, or use objective.mask_token = 'auto'")
    elif tokenizer is None:
        i = vocab_size - 1
    else:
        i = next((t for t in map(tokenizer.token_to_id, MASK_TOKENS) if t is not None), None)
        if i is None:
            i = tokenizer.max_id + 1  # an embedding row no token uses (Qwen3: 151669, SDAR's <|MASK|>)
            if i >= vocab_size:
                raise ConfigError(f"the tokenizer {tokenizer.path} has no mask token and the model's {vocab_size} "
                                  "embedding rows are all tokens: add '<|mask|>' to the tokenizer (and raise "
                                  "vocab_size through model.overrides), or set objective.mask_token")
    if not 0 <= i < vocab_size:
        raise ConfigError(f"objective.mask_token {mask_token!r} is id {i}, outside the model's vocabulary "
                          f"[0, {vocab_size}); pick an id below {vocab_size}")
    if tokenizer is not None and i in (tokenizer.endoftext_id, tokenizer.im_start_id, tokenizer.im_end_id):
        raise ConfigError(f"objective.mask_token {mask_token!r} is id {i}, a token the chat template writes "
                          f"({tokenizer.id_to_token(i)}); use 'auto' or an unused token")
    return i


def run_tokenizer(cfg: JobConfig):
    """The run's tokenizer (as the trainer's data loader takes it), or None with synthetic data."""
    if cfg.data.dataset == "synthetic" and not cfg.data.mixture:
        return None
    path = tokenizer_for(cfg.data.tokenizer_path, local_hf_dir(cfg.model.hf_path) if cfg.model.hf_path else None)
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"objective.kind={cfg.objective.kind!r} needs the run's tokenizer for its mask token: {e}") \
            from None


def build_diffusion(cfg: JobConfig, spec, model_cfg) -> DiffusionLM | None:
    """The diffusion ``[objective]`` of ``cfg`` for this model (None: kind "causal"), checked against the model's
    attention backend and sliding window before anything heavy is built."""
    o = cfg.objective
    if o.kind == "causal":
        return None
    rt = spec.runtime(model_cfg)
    block = o.block_size if o.kind == "block_diffusion" else None
    try:
        check_kind(rt.attn_backend, MASK_KINDS[o.kind], rt.sliding_window, block)
    except ValueError as e:
        raise ConfigError(f"objective.kind={o.kind!r}: {e}") from None
    mask_id = resolve_mask_id(o.mask_token, run_tokenizer(cfg), spec.dims(model_cfg).vocab_size)
    return DiffusionLM(kind=o.kind, mask_id=mask_id, eps=o.eps, block_size=block, sft=o.sft,
                       seed=cfg.training.seed)


def objective_from_hf(hf_dir: str | Path) -> DiffusionLM | None:
    """The objective an exported folder's config.json records (None: a causal LM)."""
    note = read_hf_config(str(hf_dir)).get(HF_NOTE_KEY)
    if note is None:
        return None
    return DiffusionLM(kind=note["kind"], mask_id=int(note["mask_token_id"]), eps=float(note["eps"]),
                       block_size=note.get("block_size"), sft=bool(note["sft"]))


def write_hf_note(out_dir: str | Path, cfg: JobConfig, spec, model_cfg) -> dict | None:
    """Record the run's diffusion objective in ``out_dir/config.json`` (key ``titan_mm_objective``; a causal run
    writes nothing). transformers keeps the key as a config attribute; titan_mm's readers ignore it."""
    obj = build_diffusion(cfg, spec, model_cfg)
    if obj is None:
        return None
    f = Path(out_dir) / "config.json"
    d = json.loads(f.read_text())
    d[HF_NOTE_KEY] = obj.hf_note()
    f.write_text(json.dumps(d, indent=2))
    return d[HF_NOTE_KEY]
