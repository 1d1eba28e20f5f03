"""The batched sampler the engine runs on the step's logits, on the device, for each row's
:class:`~titan_mm.serve.sampling_params.SamplingParams`.

Order of the logits processing (HF's: penalties are logits processors, then the warpers):
    repetition penalty (prompt and output tokens), presence / frequency penalties (output tokens)
    -> greedy (temperature 0): argmax
    -> temperature -> top-k -> top-p -> min-p -> one draw from the kept tokens
A draw is ``argmax(p / E)`` with ``E ~ Exp(1)`` per token (the exponential race, exactly a draw from p). A request
with a ``seed`` draws its noise from its own generator, so its output depends on its seed and its logits only,
never on the batch around it. Logprobs are the model's (log-softmax of the raw logits), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from titan_mm.kernels import greedy_pick
from titan_mm.serve.sampling_params import SamplingParams


@dataclass(slots=True)  # one per row and step
class RowSampling:
    """One sequence to sample for: its params, its tokens so far and its generator (None: the engine's)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None
    pending: torch.Tensor | None = None
    """[1] on the device: the previous step's token, when ``output_ids`` ends with its PENDING place (an
    asynchronous step); the penalties count it from there."""


@dataclass(slots=True)  # one per row and step
class Sampled:
    token: int
    logprob: float
    """The model's logprob of ``token``."""
    top: dict[int, float] | None = None
    """The ``logprobs`` most likely tokens and the sampled one -> logprob (None when not asked)."""


class Picked(NamedTuple):
    """A decode step's greedy pick of its logits, made inside the step (serve.graph_sampling): greedy_pick's
    tokens and logprobs, in the step's static output buffers."""

    tokens: torch.Tensor
    logprobs: torch.Tensor


def with_pick(logits: torch.Tensor, picked: Picked) -> torch.Tensor:
    """``logits`` carrying the greedy pick the step made of exactly them: :func:`draw` takes it for a plain-greedy
    batch instead of launching greedy_pick. A slice or gather of the logits is a new tensor without it, so a draw
    over other rows (mid-prompt rows left out, a first-token fork) picks afresh."""
    logits.picked = picked
    return logits


def _pick_of(logits: torch.Tensor) -> Picked:
    """The step's greedy pick of ``logits`` (:func:`with_pick`), else greedy_pick now."""
    picked = logits.__dict__.get("picked")
    return picked if picked is not None else Picked(*greedy_pick(logits))


def _on(dev: torch.device, values: list) -> torch.Tensor:
    """A host list on ``dev`` without waiting for the stream (torch.tensor(..., device=cuda) synchronizes)."""
    return torch.tensor(values).to(dev, non_blocking=True)


def _penalize(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Repetition, presence and frequency penalties of the rows that ask for them: the token counts from flat
    host indices (one copy each, no wait) and a pending token's from the device."""
    todo = [i for i, r in enumerate(rows) if r.params.penalized]
    if not todo:
        return logits
    dev, V, n = logits.device, logits.shape[1], len(todo)
    outs, seen_ids, pend, pend_at = [], [], [], []
    for j, i in enumerate(todo):
        r = rows[i]
        out = r.output_ids[:-1] if r.pending is not None else r.output_ids
        outs.append(np.asarray(out, dtype=np.int64) + j * V)
        seen_ids.append(np.asarray(r.prompt_ids + out, dtype=np.int64) + j * V)
        if r.pending is not None:
            pend.append(r.pending)
            pend_at.append(j * V)
    out_at, seen_at = _on(dev, np.concatenate(outs)), _on(dev, np.concatenate(seen_ids))
    if pend:
        got = torch.cat(pend) + _on(dev, pend_at)
        out_at, seen_at = torch.cat([out_at, got]), torch.cat([seen_at, got])
    counts = torch.zeros(n * V, device=dev).index_add_(0, out_at, torch.ones(out_at.numel(), device=dev))
    seen = torch.zeros(n * V, dtype=torch.bool, device=dev).index_fill_(0, seen_at, True)
    counts, seen = counts.view(n, V), seen.view(n, V)
    p = [rows[i].params for i in todo]
    rep = _on(dev, [q.repetition_penalty for q in p])[:, None]
    pres = _on(dev, [q.presence_penalty for q in p])[:, None]
    freq = _on(dev, [q.frequency_penalty for q in p])[:, None]
    idx = _on(dev, todo)
    logits = logits.clone()
    x = logits[idx]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0)
    logits[idx] = x
    return logits


def _warp(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (each row its own settings; greedy rows: 1)."""
    dev, V = logits.device, logits.shape[1]
    p = [r.params for r in rows]
    x = logits / _on(dev, [q.temperature or 1.0 for q in p])[:, None]
    if all(q.top_k in (0, -1) and q.top_p >= 1.0 for q in p):
        probs = x.softmax(dim=1)
    else:
        x_sorted, order = x.sort(dim=1, descending=True)
        rank = torch.arange(V, device=dev)[None]
        k = _on(dev, [q.top_k if q.top_k > 0 else V for q in p])[:, None]
        x_sorted = x_sorted.masked_fill(rank >= k, float("-inf"))
        probs = x_sorted.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass of the more likely tokens
        top_p = _on(dev, [q.top_p if q.top_p < 1.0 else 2.0 for q in p])[:, None]  # 1: off
        x_sorted = x_sorted.masked_fill((before >= top_p) & (rank > 0), float("-inf"))
        probs = torch.empty_like(x).scatter_(1, order, x_sorted.softmax(dim=1))
    if any(q.min_p > 0.0 for q in p):
        min_p = _on(dev, [q.min_p for q in p])[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return probs


def target_probs(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """[R, V] the distribution each row draws from (greedy rows: one-hot at the argmax) after every processor;
    the sampler draws exactly from it (the statistical test compares against it)."""
    x = _penalize(logits.float(), rows)
    probs = _warp(x, rows)
    greedy = _on(x.device, [r.params.greedy for r in rows])
    one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample(logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None = None) -> list[Sampled]:
    """One next token per row of ``logits`` [R, V]; one host transfer at the end."""
    return draw(logits, rows, generator).results()


class Draw:
    """The tokens of one sampling pass, still on the device: :meth:`copy_out` starts their transfer to the host
    (pinned, asynchronous, behind the step's kernels) and :meth:`results` reads them, so the engine can launch
    the next forward before it waits for these tokens (serve.async_scheduling)."""

    def __init__(self, tokens: torch.Tensor, chosen: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None,
                 logprobs: list[int | None]):
        self.tokens, self.chosen, self.top, self.logprobs = tokens, chosen, top, logprobs
        self._host: list[torch.Tensor] | None = None
        self._event: torch.cuda.Event | None = None

    def copy_out(self) -> Draw:
        """Start the device -> host copies (CUDA: into pinned memory, an event marks their end)."""
        parts = [self.tokens, self.chosen] + (list(self.top) if self.top is not None else [])
        if self.tokens.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in parts]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = parts
        return self

    def results(self) -> list[Sampled]:
        """Wait for the tokens; -> one :class:`Sampled` per row."""
        if self._host is None:
            self.copy_out()
        if self._event is not None:
            self._event.synchronize()
        tok, lp, *top = (t.tolist() for t in self._host)
        if not any(n is not None for n in self.logprobs):
            return [Sampled(t, p) for t, p in zip(tok, lp)]
        tv, ti = top
        out = []
        for i, n in enumerate(self.logprobs):
            best = None
            if n is not None:
                best = dict(zip(ti[i][:n], tv[i][:n]))
                best[tok[i]] = lp[i]
            out.append(Sampled(tok[i], lp[i], best))
        return out


def draw(logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None = None) -> Draw:
    """One next token per row of ``logits`` [R, V], left on the device (no host sync)."""
    asks = [r.params.logprobs for r in rows]
    if all(r.params.greedy and n is None and not r.params.penalized for r, n in zip(rows, asks)):
        # plain greedy (the common serving case): the argmax and its logprob in one pass, without the [R, V] draw;
        # a decode step under serve.graph_sampling made this pass inside its graph already
        return Draw(*_pick_of(logits), None, asks)
    logits = logits.float()
    dev, R, V = logits.device, logits.shape[0], logits.shape[1]
    probs = target_probs(logits, rows)
    noise = torch.empty(R, V, device=dev)
    shared = [i for i, r in enumerate(rows) if r.generator is None and not r.params.greedy]
    if shared:
        noise[_on(dev, shared)] = torch.empty(len(shared), V, device=dev).exponential_(generator=generator)
    for i, r in enumerate(rows):
        if r.generator is not None and not r.params.greedy:
            noise[i] = torch.empty(V, device=dev).exponential_(generator=r.generator)
    greedy = _on(dev, [r.params.greedy for r in rows])
    noise = noise.where(~greedy[:, None], 1.0).clamp_(min=1e-30)  # a 0 draw would make 0 / 0 = NaN win argmax
    tokens = (probs / noise).argmax(1)
    logp = logits.log_softmax(dim=1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    k = max((n or 0) for n in asks)
    return Draw(tokens, chosen, logp.topk(k, dim=1) if k else None, asks)
