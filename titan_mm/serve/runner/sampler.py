"""The batched sampler the engine runs on the step's logits, on the device, for each row's
:class:`~titan_mm.serve.sampling_params.SamplingParams`.

Order of the logits processing (HF's: penalties are logits processors, then the warpers):
    repetition penalty (prompt and output tokens), presence / frequency penalties (output tokens)
    -> greedy (temperature 0): argmax
    -> temperature -> top-k -> top-p -> min-p -> one draw from the kept tokens
A draw is ``argmax(p / E)`` with ``E ~ Exp(1)`` per token (the exponential race, exactly a draw from p). A request
with a ``seed`` draws its noise from its own generator, so its output depends on its seed and its logits only,
never on the batch around it. Logprobs are the model's (log-softmax of the raw logits), as vLLM reports them.

With serve.graph_sampling a decode step can make the draw itself (:class:`DrawPlan`, :class:`StaticDraw`,
:func:`pick`): rows with temperature, top-k and top-p only, through the same functions as :func:`draw`.
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
    """Tokens a decode step drew for its rows itself (serve.graph_sampling; :class:`DrawPlan`): the tokens and their
    logprobs, in the step's static output buffers."""

    tokens: torch.Tensor
    logprobs: torch.Tensor


def graph_safe(p: SamplingParams) -> bool:
    """Whether a decode step can draw the row inside its graph: only temperature, top-k and top-p, whose values sit
    in static per-row buffers, and at most the drawn token's own logprob, which the draw computes (penalties need
    the row's token counts, min-p and top logprobs a pass the graph lacks)."""
    return not p.logprobs and not p.penalized and p.min_p == 0.0


def truncates(params: list[SamplingParams]) -> bool:
    """Whether a batch of ``params`` runs the sorted pass (a row keeps a top-k or top-p) or plain softmax."""
    return not all(q.top_k in (0, -1) and q.top_p >= 1.0 for q in params)


def knob_values(p: SamplingParams, V: int) -> tuple[float, int, float, bool]:
    """One row's temperature, top-k and top-p as :class:`Knobs` hold them (off: 1, V, 2), and whether it is
    greedy."""
    return float(p.temperature or 1.0), p.top_k if p.top_k > 0 else V, p.top_p if p.top_p < 1.0 else 2.0, p.greedy


class Knobs(NamedTuple):
    """The rows' processors on the device: temperature, top-k, top-p [R, 1], greedy [R], min-p [R, 1] (None: off
    in every row), and ``truncate`` (the batch's branch: the sorted pass)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    truncate: bool
    min_p: torch.Tensor | None = None


@dataclass(frozen=True)
class DrawPlan:
    """A step's draw handed to the runner before the forward, so that a decode step makes it itself (inside its
    CUDA graph; serve.graph_sampling): one row per logits row, in order, all graph-safe, and the engine's generator
    for the unseeded rows' noise. The draw after the step then takes the step's tokens (:func:`draw`'s ``picked``)
    and draws no noise of its own."""

    rows: list[RowSampling]
    generator: torch.Generator | None

    @staticmethod
    def of(rows: list[RowSampling], generator: torch.Generator | None) -> DrawPlan | None:
        """The plan of ``rows``; None when one is not :func:`graph_safe` (the draw then runs after the step)."""
        return DrawPlan(rows, generator) if rows and all(graph_safe(r.params) for r in rows) else None

    @property
    def greedy(self) -> bool:
        return all(r.params.greedy for r in self.rows)

    @property
    def truncate(self) -> bool:
        return truncates([r.params for r in self.rows])


class StaticDraw:
    """A decode step's draw inputs in static device buffers of R rows (serve.graph_sampling): the knobs and the
    Exp(1) noise [R, V], written before each sampled step (outside its graph: the seeded rows' generators cannot
    live in one), read by :func:`pick` over the first B rows. Pad rows are greedy (their noise is never read)."""

    def __init__(self, R: int, V: int, dev: torch.device):
        self.V = V
        self.temperature = torch.ones(R, 1, device=dev)
        self.top_k = torch.full((R, 1), V, dtype=torch.long, device=dev)
        self.top_p = torch.full((R, 1), 2.0, device=dev)
        self.greedy = torch.ones(R, dtype=torch.bool, device=dev)
        self.noise = torch.ones(R, V, device=dev)

    def knobs(self, B: int, truncate: bool) -> Knobs:
        return Knobs(self.temperature[:B], self.top_k[:B], self.top_p[:B], self.greedy[:B], truncate)

    def fill(self, plan: DrawPlan, B: int) -> None:
        """The plan's rows (then pad rows up to B) into the buffers: host values by one asynchronous copy each,
        and the noise drawn as :func:`draw` draws it."""
        pad = (1.0, self.V, 2.0, True)
        vals = [knob_values(r.params, self.V) for r in plan.rows] + [pad] * (B - len(plan.rows))
        for buf, col in zip((self.temperature, self.top_k, self.top_p, self.greedy), zip(*vals)):
            buf[:B].copy_(torch.tensor(col).view(buf[:B].shape), non_blocking=True)
        fill_noise(self.noise[: len(plan.rows)], plan.rows, plan.generator)


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


def knobs(rows: list[RowSampling], dev: torch.device, V: int) -> Knobs:
    """The rows' :class:`Knobs` on ``dev``."""
    p = [r.params for r in rows]
    temp, top_k, top_p, greedy = (list(c) for c in zip(*(knob_values(q, V) for q in p)))
    min_p = _on(dev, [q.min_p for q in p])[:, None] if any(q.min_p > 0.0 for q in p) else None
    return Knobs(_on(dev, temp)[:, None], _on(dev, top_k)[:, None], _on(dev, top_p)[:, None], _on(dev, greedy),
                 truncates(p), min_p)


def _warp(x: torch.Tensor, kn: Knobs) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (each row its own settings; greedy rows: 1)."""
    x = x / kn.temperature
    if not kn.truncate:
        probs = x.softmax(dim=1)
    else:
        x_sorted, order = x.sort(dim=1, descending=True)
        rank = torch.arange(x.shape[1], device=x.device)[None]
        x_sorted = x_sorted.masked_fill(rank >= kn.top_k, float("-inf"))
        probs = x_sorted.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass of the more likely tokens
        x_sorted = x_sorted.masked_fill((before >= kn.top_p) & (rank > 0), float("-inf"))
        probs = torch.empty_like(x).scatter_(1, order, x_sorted.softmax(dim=1))
    if kn.min_p is not None:
        probs = probs.masked_fill(probs < kn.min_p * probs.amax(dim=1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return probs


def _target(x: torch.Tensor, kn: Knobs) -> torch.Tensor:
    probs = _warp(x, kn)
    one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(1, keepdim=True), 1.0)
    return torch.where(kn.greedy[:, None], one_hot, probs)


def target_probs(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """[R, V] the distribution each row draws from (greedy rows: one-hot at the argmax) after every processor;
    the sampler draws exactly from it (the statistical test compares against it)."""
    x = _penalize(logits.float(), rows)
    return _target(x, knobs(rows, x.device, x.shape[1]))


def fill_noise(noise: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise [R, V] into the sampled rows of ``noise``: a seeded row's from its own generator, the others'
    from ``generator`` in one draw (greedy rows are left as they are)."""
    dev, V = noise.device, noise.shape[1]
    shared = [i for i, r in enumerate(rows) if r.generator is None and not r.params.greedy]
    if shared:
        noise[_on(dev, shared)] = torch.empty(len(shared), V, device=dev).exponential_(generator=generator)
    for i, r in enumerate(rows):
        if r.generator is not None and not r.params.greedy:
            noise[i].exponential_(generator=r.generator)  # in place: one launch a seeded row, the same numbers
    return noise


def _race(logits: torch.Tensor, x: torch.Tensor, kn: Knobs, noise: torch.Tensor):
    """The exponential race over the rows' distributions (``x``: the processed fp32 logits) -> tokens, their logprobs
    and the model's logprobs [R, V] (of the fp32 ``logits``); greedy rows ignore their noise."""
    probs = _target(x, kn)
    noise = noise.where(~kn.greedy[:, None], 1.0).clamp_(min=1e-30)  # a 0 draw would make 0 / 0 = NaN win argmax
    tokens = (probs / noise).argmax(1)
    logp = logits.log_softmax(dim=1)
    return tokens, logp.gather(1, tokens[:, None])[:, 0], logp


def pick(logits: torch.Tensor, kn: Knobs, noise: torch.Tensor) -> Picked:
    """A decode step's own draw of its rows (serve.graph_sampling: inside its graph, over static buffers): the
    arithmetic of :func:`draw` for rows without penalties, min-p or logprobs, so the tokens are the same."""
    x = logits.float()
    return Picked(*_race(x, x, kn, noise)[:2])


def sample(logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None = None,
           picked: Picked | None = None) -> list[Sampled]:
    """One next token per row of ``logits`` [R, V]; one host transfer at the end (``picked``: :func:`draw`'s)."""
    return draw(logits, rows, generator, picked).results()


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
        tv, ti = top or ([[]] * len(tok), [[]] * len(tok))  # no top-k pass: every asking row asked for 0
        out = []
        for i, n in enumerate(self.logprobs):
            best = None
            if n is not None:
                best = dict(zip(ti[i][:n], tv[i][:n]))
                best[tok[i]] = lp[i]
            out.append(Sampled(tok[i], lp[i], best))
        return out


def draw(logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None = None,
         picked: Picked | None = None) -> Draw:
    """One next token per row of ``logits`` [R, V], left on the device (no host sync). ``picked``: the tokens the
    decode step drew for exactly these rows (a :class:`DrawPlan`'s), taken as they are."""
    asks = [r.params.logprobs for r in rows]
    if picked is not None:
        return Draw(*picked, None, asks)
    if all(r.params.greedy and n is None and not r.params.penalized for r, n in zip(rows, asks)):
        # plain greedy (the common serving case): the argmax and its logprob in one pass, without the [R, V] draw
        return Draw(*greedy_pick(logits), None, asks)
    logits = logits.float()
    dev, R, V = logits.device, logits.shape[0], logits.shape[1]
    noise = fill_noise(torch.empty(R, V, device=dev), rows, generator)
    tokens, chosen, logp = _race(logits, _penalize(logits, rows), knobs(rows, dev, V), noise)
    k = max((n or 0) for n in asks)
    return Draw(tokens, chosen, logp.topk(k, dim=1) if k else None, asks)
