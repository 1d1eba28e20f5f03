"""Continuous batching: which sequences run in the next forward, and how many tokens each.

One step mixes decode tokens and prefill chunks under ``max_num_batched_tokens``:
  1. Running requests, in order (priority class, deadline, arrival), get their next tokens: one per decoding
     sequence, a chunk of the prompt (or of a recompute) otherwise. When blocks run out, the last running request
     (lowest class, latest) is preempted: its blocks are freed and it waits to be recomputed from its tokens.
  2. If nothing was preempted, waiting requests are admitted in the same order while sequences
     (``max_num_seqs``), tokens and blocks last. A new sequence first takes the longest cached prefix of its
     tokens. A waiting request of a higher class may preempt running requests of a preemptible class
     (``preemptible_priority``) to get in.
A chunk never ends inside an image or audio clip (the encoders see whole items), so one may take a step past the
token budget when it runs alone. No request can need more blocks than the pool holds (the engine refuses it at
admission), so preempting the others always lets the first one run: there is no deadlock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from titan_mm.serve.core.block_manager import BlockManager, StateSlots, block_keys
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.runner.sampler import Sampled
from titan_mm.serve.core.sequence import Request, Sequence, Status, now


@dataclass(slots=True)  # one per row and step
class Row:
    """One sequence of the step: ``n`` tokens from position ``start`` (its k/v up to ``start`` are cached)."""

    req: Request
    seq: Sequence
    start: int
    n: int
    lookahead: int = 0
    """Speculative decoding: slots allocated for up to this many guesses after the row's token."""
    draft: list[int] = field(default_factory=list)
    """The guesses that follow ``seq.tokens`` (fed after them; ``n`` counts them)."""
    q: object = None
    """The draft model's distributions of the guesses [k, V] (None: n-gram guesses, point masses)."""

    @property
    def tokens(self) -> list[int]:
        if not self.draft:  # no copy of the whole sequence (a decode step asks this of every row)
            return self.seq.tokens[self.start:self.start + self.n]
        return (self.seq.tokens + self.draft)[self.start:self.start + self.n]

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token: its logits give the next token."""
        return self.start + self.n >= len(self.seq.tokens)


@dataclass
class Schedule:
    rows: list[Row] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) block copies (copy-on-write) to make before the forward."""
    budget: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(r.n for r in self.rows)


def media_extra(req: Request, n_blocks: int, block_size: int) -> list[tuple]:
    """Per block, the keys of the media (images, videos, audio clips) overlapping it (what its k/v depend on
    besides the tokens)."""
    extra = [()] * n_blocks
    for im in req.media:
        for b in range(im.start // block_size, min(n_blocks, -(-im.end // block_size))):
            extra[b] = extra[b] + (im.key,)
    return extra


def sequence_keys(req: Request, seq: Sequence, n_tokens: int, block_size: int, start: int = 0,
                  parent: int | None = None) -> list[int]:
    """Chained prefix keys of ``seq``'s full blocks within its first ``n_tokens`` tokens, from block ``start``."""
    n_blocks = n_tokens // block_size
    return block_keys(seq.tokens[:n_blocks * block_size], block_size, media_extra(req, n_blocks, block_size),
                      parent, start)


def _outside_images(req: Request, n_tokens: int, block_size: int) -> int:
    """The longest whole-block prefix of ``n_tokens`` tokens that does not end inside an image."""
    moved = True
    while moved:
        moved = False
        for im in req.media:
            if im.start < n_tokens < im.end:
                n_tokens = im.start // block_size * block_size
                moved = True
    return n_tokens


class Scheduler:
    def __init__(self, cfg: ServeConfig, blocks: BlockManager, slots: StateSlots | None = None,
                 copy_state: Callable[[int, int], None] | None = None, clock: Callable[[], float] = now):
        self.cfg = cfg
        self.blocks = blocks
        self.slots = slots
        """Linear-attention families: a state slot per running sequence (None: KV blocks only)."""
        self.copy_state = copy_state
        """Linear-attention families: copies a state slot to another (the runner's; a fork goes on from it)."""
        self.clock = clock
        self.seq_ids = itertools.count()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.lookahead: Callable[[Request, Sequence], int] | None = None
        """Speculative decoding: guess slots for a decoding sequence (set by the engine; None: no guesses)."""

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.live) for r in self.running)

    @property
    def seats_taken(self) -> int:
        return sum(r.seats for r in self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: str | None = None) -> None:
        """End ``req``: every live sequence gets ``reason``; it leaves the queues and every block (and state slot)
        it holds is freed."""
        for s in req.live:
            s.finish_reason = reason
        for seq in req.seqs:
            self.free_seq(seq)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.metrics.finished = self.clock()

    def free_seq(self, seq: Sequence) -> None:
        self.blocks.free(seq.table)
        if self.slots is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None

    # ---- after a forward ----
    def computed(self, rows: Iterable[Row]) -> None:
        """The rows' k/v are in the cache (a row of a sequence that ended meanwhile is void)."""
        for r in rows:
            if not r.seq.finished:
                r.seq.num_computed = r.start + r.n
                self.register(r.req, r.seq)

    def register(self, req: Request, seq: Sequence) -> None:
        """Record the prefix keys of ``seq``'s newly computed full blocks."""
        bs = self.blocks.block_size
        if self.blocks.prefix_caching and seq.num_computed // bs > len(seq.table.keys):
            parent = seq.table.keys[-1] if seq.table.keys else None
            self.blocks.register(seq.table, sequence_keys(req, seq, seq.num_computed, bs, len(seq.table.keys), parent))

    def update_from_output(self, sampled: Iterable[tuple[Request, Sequence, Sampled]],
                           take: Callable[[Request, Sequence, Sampled], bool]) -> dict[str, Request]:
        """The sampled tokens, in order, into their sequences through ``take`` (the output processor's: text and
        stops; True: it ended the sequence). An ended sequence is freed, a request left without a live one
        finishes. A sequence that ended before its pending token was read loses that token. -> the requests
        that got tokens."""
        got: dict[str, Request] = {}
        for req, seq, token in sampled:
            if seq.finished:  # aborted or past its deadline while its token was in flight
                seq.drop_pending()
                continue
            got[req.request_id] = req
            if take(req, seq, token):
                self.free_seq(seq)
                if req.status is not Status.FINISHED and not req.live:
                    self.finish(req)
        return got

    def fork(self, req: Request, seq: Sequence, generator: torch.Generator | None) -> Sequence:
        """A child of ``seq`` sharing its blocks (and starting from a copy of its linear-attention state)."""
        child = Sequence(next(self.seq_ids), list(seq.tokens), seq.num_prompt, self.blocks.fork(seq.table),
                         seq.num_computed, generator, list(seq.logprobs), seq.cum_logprob, text=seq.text,
                         detok_offsets=seq.detok_offsets, detok_tail=seq.detok_tail,
                         draft_computed=seq.draft_computed)
        if self.slots is not None:
            child.state_slot = self.slots.take()
            self.copy_state(seq.state_slot, child.state_slot)
        req.seqs.append(child)
        return child

    def drop(self, req: Request, seq: Sequence) -> None:
        self.free_seq(seq)
        req.seqs.remove(seq)

    # ---- one step ----
    def schedule(self) -> Schedule:
        out = Schedule(budget=self.cfg.max_num_batched_tokens)
        self.running.sort(key=lambda r: r.sort_key)
        preempted = False
        i = 0
        while i < len(self.running) and out.budget > 0:
            req = self.running[i]
            plan = self._plan(req, out, hits=False)
            while (cost := self._cost(plan)) > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            else:
                self._take(req, plan, out, cost)
                i += 1
        if preempted:
            return out
        self.waiting.sort(key=lambda r: r.sort_key)
        while self.waiting and out.budget > 0:
            req = self.waiting[0]
            while self.seats_taken + req.seats > self.cfg.max_num_seqs:
                if not self._preempt_lower(req, out):
                    return out
            plan = self._plan(req, out, hits=True)
            if plan is None or (plan and not any(n for *_, n, _ in plan)):
                return out  # its prompt (or its next image) waits for a step with room for all of it
            while (cost := self._cost(plan)) > self.blocks.num_free:
                if not self._preempt_lower(req, out):
                    return out
            self.waiting.pop(0)
            self.running.append(req)
            req.status = Status.RUNNING
            if req.metrics.first_scheduled is None:  # prefix-cache statistics: once per request, its prompt
                req.metrics.first_scheduled = now()
                req.metrics.prefix_hit_tokens = len(plan[0][1]) * self.blocks.block_size if plan else 0
                self.blocks.record_query(len(req.prompt), req.metrics.prefix_hit_tokens)
            self._take(req, plan, out, cost)
        return out

    def _plan(self, req: Request, out: Schedule, hits: bool):
        """[(seq, prefix hit blocks, their keys, n new tokens)] for ``req``'s sequences with tokens to compute;
        None when a waiting request's first prompt cannot be chunked and does not fit the budget."""
        plan, budget, bs = [], out.budget, self.blocks.block_size
        for seq in req.seqs:
            if seq.finished or seq.pending is not None:  # done, or a beam waiting for its siblings
                continue
            hit, keys = (), ()
            if hits and seq.num_computed == 0 and not seq.table.blocks:
                limit = len(seq.tokens) - 1  # the last token is always computed: its logits are needed
                keys = sequence_keys(req, seq, limit, bs) if self.blocks.prefix_caching else []
                hit = self.blocks.match(keys, limit)
                hit = hit[: _outside_images(req, len(hit) * bs, bs) // bs]
                keys = keys[:len(hit)]
            start = seq.num_computed + len(hit) * bs
            n = len(seq.tokens) - start
            if not self.cfg.enable_chunked_prefill and n > budget:
                return None if hits and not plan else plan
            n = min(n, budget)
            if req.media:
                n = self._clip(req, start, n, alone=not out.rows and not plan)
            k = 0
            if self.lookahead is not None and n == 1 and seq.to_compute == 1 and len(seq.tokens) > seq.num_prompt:
                k = max(0, min(self.lookahead(req, seq), budget - 1))  # decoding
            plan.append((seq, hit, keys, n, k))
            budget -= n + k
        return plan

    @staticmethod
    def _clip(req: Request, start: int, n: int, alone: bool) -> int:
        """``n`` cut so that the chunk from ``start`` ends at an image's edge, not inside it."""
        end = start + n
        for im in req.media:
            if im.start < end < im.end:
                if im.start > start:
                    return im.start - start
                return im.end - start if alone else 0  # the whole image, past the budget only when alone
        return n

    def _cost(self, plan) -> int:
        total = 0
        for seq, hit, _, n, k in plan:
            total += self.blocks.cost(seq.table, seq.num_computed, n + k, hit)
        return total

    def _take(self, req: Request, plan, out: Schedule, cost: int) -> None:
        """Allocate ``plan`` (of ``cost`` free blocks; 0: no sequence needs a block or a copy, so only prefix hits
        have anything to allocate) and add its rows to ``out``."""
        for seq, hit, keys, n, k in plan:
            if cost or hit:
                out.copies += self.blocks.allocate(seq.table, seq.num_computed, n + k, hit)
            if hit:
                seq.table.keys[:] = keys
                seq.num_computed += len(hit) * self.blocks.block_size
            if self.slots is not None and seq.state_slot is None:
                seq.state_slot = self.slots.take()
            if n:
                out.rows.append(Row(req, seq, seq.num_computed, n, lookahead=k))
                out.budget -= n + k

    def _preempt(self, victim: Request, out: Schedule) -> None:
        """Free ``victim``'s blocks (dropping its rows of this step) and queue it for recompute."""
        out.budget += sum(r.n + r.lookahead for r in out.rows if r.req is victim)
        out.rows = [r for r in out.rows if r.req is not victim]
        mine = {b for s in victim.seqs for b in s.table.blocks}
        out.copies = [(s, d) for s, d in out.copies if d not in mine]
        for seq in victim.seqs:
            self.free_seq(seq)  # recomputed from its tokens: its state starts again from zero
            seq.num_computed = seq.draft_computed = 0
            seq.pending = None
        self.running.remove(victim)
        self.waiting.append(victim)
        victim.status = Status.WAITING
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1

    def _preempt_lower(self, req: Request, out: Schedule) -> bool:
        """Preempt the last running request if it is of a preemptible class below ``req``'s; False when none is."""
        if not self.running:
            return False
        victim = max(self.running, key=lambda r: r.sort_key)
        if victim.priority < self.cfg.preemptible_priority or victim.priority <= req.priority:
            return False
        self._preempt(victim, out)
        return True
