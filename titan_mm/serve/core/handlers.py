"""How a step's output (its logits, or the tokens it drew itself) becomes tokens: one handler per decoding kind,
behind one interface (``advance``).

  * :class:`Sampling`: greedy and sampled rows (the n / best_of fork at the first token), and the asynchronous
    steps (serve.async_scheduling: ``launch`` draws on the device, ``pend`` marks the tokens in flight,
    ``resolve`` reads them back a step later); ``plan`` hands a decode step its draw (serve.graph_sampling).
  * :class:`BeamSearch`: a beam waits for its siblings' logprobs, then titan_mm.serve.core.beam advances them all.
  * :class:`Speculative`: guesses before the forward (``lookahead``, ``propose``), rejection sampling after.

Each hands its tokens to the scheduler's ``update_from_output`` with the output processor's ``take``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan_mm.serve.core.beam import beam_step
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.core.output_processor import OutputProcessor
from titan_mm.serve.runner.model_runner import Executed, Fed
from titan_mm.serve.runner.sampler import Draw, DrawPlan, RowSampling, draw, sample
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.serve.core.scheduler import Row, Schedule, Scheduler
from titan_mm.serve.core.sequence import PENDING, Request, Sequence
from titan_mm.serve.core.spec_decode import DraftProposer, ngram_propose, verify

Touched = dict[str, Request]


class Handler(ABC):
    """Turns the step's output for rows that reached their last token (``out``: their logits, in their order, and
    the tokens the step drew for them itself, if it did) into tokens, beams or kept guesses; the requests that
    changed join ``touched``."""

    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor, generator: torch.Generator,
                 seq_generator: Callable[[SamplingParams, int], torch.Generator | None]):
        self.scheduler, self.outputs, self.generator, self.seq_generator = scheduler, outputs, generator, seq_generator

    @abstractmethod
    def advance(self, rows: list[Row], out: Executed, touched: Touched) -> None:
        """Consume ``out`` of ``rows``; the requests that changed join ``touched``."""

    def _fork(self, req: Request, seq: Sequence, index: int) -> Sequence:
        return self.scheduler.fork(req, seq, self.seq_generator(req.params, index))


@dataclass
class Inflight:
    """A step whose sampled tokens are still on the device (serve.async_scheduling): (sequence, request, row of
    the draw) for each sequence that holds a PENDING token, and where the next step's forward finds them."""

    seqs: list[tuple[Sequence, Request, int]]
    draw: Draw

    @property
    def fed(self) -> Fed:
        return Fed(self.draw.tokens, {s.seq_id: j for s, _, j in self.seqs})


class Sampling(Handler):
    def plan(self, rows: list[Row]) -> DrawPlan | None:
        """The draw of a step whose rows all sample one token each with graph-safe processors (no first-token fork,
        no beams), handed to the runner before the forward (serve.graph_sampling); else None. Its rows are exactly
        those ``advance`` or ``launch`` then draws, so each row's noise is drawn once, by the step."""
        if not all(r.samples and not r.lookahead and self.overlaps(r.req) and not r.seq.finished for r in rows):
            return None
        return DrawPlan.of([RowSampling(r.req.params, r.req.prompt, r.seq.output, r.seq.generator) for r in rows],
                           self.generator)

    def advance(self, rows: list[Row], out: Executed, touched: Touched) -> None:
        logits = out.logits
        rows_s: list[RowSampling] = []
        row_index: list[int] = []
        targets: list[tuple[Request, Sequence]] = []
        for i, r in enumerate(rows):
            req, group = r.req, (r.seq,)
            if not req.forked:  # the first token: n / best_of sequences share the prompt from here
                req.forked = True
                group += tuple(self._fork(req, r.seq, k) for k in range(1, req.params.width))
            for s in group:
                rows_s.append(RowSampling(req.params, req.prompt, s.output, s.generator))
                row_index.append(i)
                targets.append((req, s))
        # one gather (rows in order: the logits themselves, and the step's own tokens when it drew them)
        if len(row_index) == len(logits):
            got = sample(logits, rows_s, self.generator, out.tokens)
        else:
            got = sample(logits[torch.tensor(row_index, device=logits.device)], rows_s, self.generator)
        touched.update(self.scheduler.update_from_output(
            ((req, s, g) for (req, s), g in zip(targets, got)), self.outputs.take))

    # ---- asynchronous steps ----
    @staticmethod
    def overlaps(req: Request) -> bool:
        """Its next token can be sampled without the host: no beams and no first-token fork (n > 1 / best_of).
        Penalties count a pending token on the device."""
        return req.beam is None and (req.forked or req.params.width == 1)

    def launch(self, rows: list[Row], out: Executed, fed: Fed | None) -> tuple[Draw | None, list[Row]]:
        """Sample the rows that reached their last token, leaving the tokens on the device (their copy to the host
        started); -> (the draw, those rows in its order). ``fed``: the previous step's tokens, which the
        penalties of a sequence still holding one PENDING count."""
        at = [i for i, r in enumerate(rows) if r.samples]
        if not at:
            return None, []
        todo = [rows[i] for i in at]
        logits, tokens = out
        if len(at) < len(rows):  # mid-prompt chunks give no token
            logits, tokens = logits[torch.tensor(at).to(logits.device, non_blocking=True)], None
        samplings = [RowSampling(r.req.params, r.req.prompt, r.seq.output, r.seq.generator,
                                 _pending_token(r.seq, fed) if r.req.params.penalized else None) for r in todo]
        return draw(logits, samplings, self.generator, tokens).copy_out(), todo

    def pend(self, rows: list[Row], drawn: Draw | None, todo: list[Row]) -> Inflight | None:
        """After the launch and the previous step's tokens: the rows' k/v count as computed, and each sampling
        sequence still live holds a PENDING token (the next step feeds it from the device)."""
        self.scheduler.computed(rows)
        seqs = []
        for j, r in enumerate(todo):
            seq = r.seq
            if not seq.finished:
                r.req.forked = True
                if not self.outputs.ends(r.req, len(seq.tokens) + 1, len(seq.tokens) + 1 - seq.num_prompt):
                    seq.tokens.append(PENDING)  # a sequence this token ends gets no row next step
                seqs.append((seq, r.req, j))
        return Inflight(seqs, drawn) if seqs else None

    def resolve(self, prev: Inflight, touched: Touched) -> None:
        """The previous step's tokens, read back: stop checks, text and outputs, as a step in turn would do."""
        got = prev.draw.results()
        touched.update(self.scheduler.update_from_output(
            ((req, seq, got[j]) for seq, req, j in prev.seqs), self.outputs.take))


def _pending_token(seq: Sequence, fed: Fed | None) -> torch.Tensor | None:
    """[1] on the device: the token ``seq``'s PENDING place stands for (None when it holds none)."""
    if seq.tokens[-1] != PENDING:
        return None
    j = fed.row_of[seq.seq_id]
    return fed.tokens[j:j + 1]


class BeamSearch(Handler):
    def advance(self, rows: list[Row], out: Executed, touched: Touched) -> None:
        for r, lg in zip(rows, out.logits):
            req = r.req
            r.seq.pending = lg.float().log_softmax(-1)
            if all(s.pending is not None for s in req.live):
                if req.metrics.first_token is None:
                    req.metrics.first_token = self.scheduler.clock()
                beam_step(req, lambda s, req=req: self._fork(req, s, len(req.seqs)),
                          lambda s, req=req: self.scheduler.drop(req, s))
                touched[req.request_id] = req
                if req.beam.done:
                    self.scheduler.finish(req)


class Speculative(Handler):
    """Guesses (n-gram lookup or a draft model) scored by one forward, kept by rejection sampling."""

    def __init__(self, *args, cfg: ServeConfig, max_model_len: int, proposer: DraftProposer | None):
        super().__init__(*args)
        self.cfg, self.max_model_len, self.proposer = cfg, max_model_len, proposer
        self._guesses: dict[int, list[int]] = {}
        self.scheduler.lookahead = self.lookahead

    def lookahead(self, req: Request, seq: Sequence) -> int:
        """Guess slots for a decoding sequence: the next token and every guess must fit max_tokens and the context.
        ngram: as many as the lookup finds (kept for the step)."""
        p = req.params
        if req.beam is not None:
            return 0
        left = min((p.max_tokens or self.max_model_len) - len(seq.output), self.max_model_len - len(seq.tokens))
        k = max(0, min(self.cfg.num_speculative_tokens, left - 1))
        if k and self.cfg.speculative_method == "ngram":
            self._guesses[seq.seq_id] = ngram_propose(seq.tokens, k, self.cfg.ngram_max, self.cfg.ngram_min)
            k = len(self._guesses[seq.seq_id])
        return k

    def propose(self, sched: Schedule) -> int:
        """Fill the decoding rows' guesses (they then feed 1 + guesses tokens); -> logits per row for the forward."""
        rows = [r for r in sched.rows if r.lookahead]
        if not rows:
            self._guesses.clear()
            return 1
        if self.proposer is None:
            for r in rows:
                r.draft = self._guesses.pop(r.seq.seq_id, [])[: r.lookahead]
                r.q = None
        else:
            samplings = [RowSampling(r.req.params, r.req.prompt, r.seq.output, r.seq.generator) for r in rows]
            for r, (g, q) in zip(rows, self.proposer.propose(rows, samplings, sched.copies)):
                r.draft, r.q = g, q
        self._guesses.clear()
        for r in rows:
            r.n = 1 + len(r.draft)
        return 1 + max(len(r.draft) for r in rows)

    def advance(self, rows: list[Row], out: Executed, touched: Touched) -> None:
        """Keep the guesses rejection sampling accepts, then the target's own token (stop conditions per token)."""
        samplings = [RowSampling(r.req.params, r.req.prompt, r.seq.output, r.seq.generator) for r in rows]
        checked = verify(out.logits, samplings, [r.draft for r in rows], [r.q for r in rows], self.generator)
        for r, v in zip(rows, checked):
            seq, req = r.seq, r.req
            T = r.start + 1  # the sequence's length before the step
            seq.num_computed = T + v.accepted  # k/v of the guesses after the first rejection are stale
            if self.proposer is not None:  # the draft pool holds the kept guesses but the last one
                seq.draft_computed = T + min(v.accepted, max(len(r.draft) - 1, 0))
            req.metrics.spec_proposed += len(r.draft)
            req.metrics.spec_accepted += v.accepted
            for got in v.emitted:
                touched.update(self.scheduler.update_from_output([(req, seq, got)], self.outputs.take))
                if seq.finished:
                    break
            if not seq.finished:
                self.scheduler.register(req, seq)
            touched[req.request_id] = req
