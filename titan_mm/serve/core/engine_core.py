"""The engine's core, vLLM v1's EngineCore: the KV pool, the scheduler, the model runner and the decoding
handlers; :meth:`EngineCore.step` is schedule, execute, update. The front (titan_mm.serve.engine.Engine) takes
the requests, checks them and hands them here."""

from __future__ import annotations

import os

import torch

from titan_mm.config import ConfigError
from titan_mm.serve.core.block_manager import BlockManager, StateSlots
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.core.handlers import BeamSearch, Inflight, Sampling, Speculative
from titan_mm.serve.core.output_processor import OutputProcessor
from titan_mm.serve.core.requests import seq_generator
from titan_mm.serve.runner.model_runner import Executed, ModelRunner, pool_blocks
from titan_mm.serve.core.scheduler import Row, Schedule, Scheduler
from titan_mm.serve.core.sequence import Request, RequestOutput
from titan_mm.serve.core.spec_decode import DraftProposer


class EngineCore:
    def __init__(self, cfg: ServeConfig, model, spec, model_cfg, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, tokenizer, clock, tp=None, draft=None):
        """``model`` (and ``draft``: (model, spec, config)) on ``device`` in ``dtype``, split already under tensor
        parallel (``tp``: titan_mm.serve.tp.TensorParallel)."""
        dims = spec.dims(model_cfg)
        num_blocks = cfg.num_blocks or pool_blocks(model, cfg, dims, device, dtype, max_model_len,
                                                   draft[1].dims(draft[2]) if draft is not None else None)
        if tp is not None and not cfg.num_blocks:  # free memory differs per rank; the pools must not
            num_blocks = tp.min(num_blocks)
        if num_blocks < 1:
            raise ConfigError(f"no memory is left for the KV cache after the weights (serve.gpu_memory_utilization="
                              f"{cfg.gpu_memory_utilization}); raise it, set serve.num_blocks, or lower "
                              "max_num_batched_tokens")
        runner = dict(block_size=cfg.block_size, num_blocks=num_blocks, max_num_seqs=cfg.max_num_seqs,
                      tp=cfg.tensor_parallel_size, paged_decode=cfg.paged_decode, max_model_len=max_model_len,
                      cuda_graphs=cfg.cuda_graphs, packed_prefill=cfg.packed_prefill,
                      mixed_attention=cfg.mixed_attention, graph_sampling=cfg.graph_sampling,
                      kv_dtype=cfg.kv_dtype(device))
        self.runner = ModelRunner(model, spec, model_cfg, device, dtype, **runner)
        # the draft's own pool has the target's block layout and tables; its steps are handed no draw
        self.proposer = None if draft is None else DraftProposer(ModelRunner(*draft, device, dtype,
                                                                             **runner | {"graph_sampling": False}))
        for r in [self.runner] + ([self.proposer.runner] if self.proposer is not None else []):
            r.capture_graphs()  # at start-up, as vLLM does: no request waits for a capture
        # a hybrid model's cached KV blocks are useless without the linear layers' state at their end: no prefix
        # caching for families with linear-attention layers (their states live in one slot per sequence)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching and dims.linear is None)
        self.slots = StateSlots(cfg.max_num_seqs) if dims.linear is not None else None
        self.scheduler = Scheduler(cfg, self.blocks, self.slots, self.runner.copy_state, clock)
        self.outputs = OutputProcessor(tokenizer, max_model_len, clock)
        seed = int.from_bytes(os.urandom(8), "little") >> 1  # every tp rank draws with rank 0's
        self.generator = torch.Generator(device).manual_seed(tp.broadcast(seed) if tp is not None else seed)
        self.seq_generator = seq_generator(device)
        parts = (self.scheduler, self.outputs, self.generator, self.seq_generator)
        self.sampling, self.beam = Sampling(*parts), BeamSearch(*parts)
        self.speculative = (Speculative(*parts, cfg=cfg, max_model_len=max_model_len, proposer=self.proposer)
                            if cfg.speculative_method else None)
        self.overlap = cfg.async_scheduling and not cfg.speculative_method  # guesses are proposed from the tokens
        self.inflight: Inflight | None = None

    def step(self, t: float, aborted: list[Request]) -> list[RequestOutput]:
        """One iteration at clock ``t``; ``aborted``: requests ended since the last one, to report."""
        touched = self._expire(t, aborted)
        sched = self.scheduler.schedule()
        prev, self.inflight = self.inflight, None
        out, launched = self._execute(sched, prev)
        self._update(sched.rows, out, launched, prev, touched)
        outs = [self.outputs.output(r) for r in touched.values()]
        if launched is not None:  # after the outputs: they must not hold the PENDING tokens
            self.inflight = self.sampling.pend(sched.rows, *launched)
        return outs

    def _execute(self, sched: Schedule, prev: Inflight | None):
        """The forward of ``sched`` (speculation: guesses proposed first; ``prev``: the previous step's tokens,
        still on the device; serve.graph_sampling: the step's draw planned first, for a decode step to make); ->
        (the runner's output, the asynchronous launch or None: this step's tokens are sampled in turn)."""
        if not sched.rows:
            return None, None
        fed = prev.fed if prev is not None else None
        per_row = self.speculative.propose(sched) if self.speculative is not None else 1
        plan = self.sampling.plan(sched.rows) if self.runner.graph_sampling and per_row == 1 else None
        out = self.runner.execute(sched.rows, sched.copies, per_row, fed, plan)
        return out, self._launch(sched.rows, out, fed) if self.overlap else None

    def _launch(self, rows: list[Row], out: Executed, fed):
        """The asynchronous launch when every sampling row can go without the host (else None: steps in turn)."""
        if all(self.sampling.overlaps(r.req) for r in rows if r.samples):
            return self.sampling.launch(rows, out, fed)
        return None

    def _update(self, rows: list[Row], out: Executed | None, launched, prev: Inflight | None,
                touched: dict[str, Request]) -> None:
        """The previous step's tokens, read back while this step's forward runs; then, unless launched, the rows
        that reached their last token, each through its handler (speculation, beam search, sampling, in that
        order); the others' k/v count as computed."""
        if prev is not None:
            self.sampling.resolve(prev, touched)
        if out is None or launched is not None:
            return
        live = [(i, r) for i, r in enumerate(rows) if not r.seq.finished]  # else ended by the previous step's tokens
        self.scheduler.computed(r for _, r in live if not r.lookahead)
        logits = out.logits
        first = logits[:, 0] if logits.dim() == 3 else logits
        for handler, lg, mine in ((self.speculative, logits, lambda r: r.lookahead),
                                  (self.beam, first, lambda r: r.samples and not r.lookahead and r.req.beam),
                                  (self.sampling, first, lambda r: r.samples and not r.lookahead and not r.req.beam)):
            at = [i for i, r in live if mine(r)]
            if at:  # the step's own tokens are of all its rows
                mine_out = Executed(lg, out.tokens) if len(at) == len(lg) else \
                    Executed(lg[torch.tensor(at, device=lg.device)])
                handler.advance([rows[i] for i in at], mine_out, touched)

    def _expire(self, t: float, aborted: list[Request]) -> dict[str, Request]:
        """Requests past their deadline at ``t`` end ("abort"); with ``aborted``, -> the step's first outputs."""
        touched: dict[str, Request] = {}
        for req in [r for r in self.scheduler.running + self.scheduler.waiting if r.deadline is not None]:
            if t > req.deadline:
                req.metrics.deadline_exceeded = True
                self.scheduler.finish(req, "abort")
                touched[req.request_id] = req
        for req in aborted:
            touched[req.request_id] = req
        return touched

    def stats(self) -> dict:
        """The pool's and the scheduler's counters (titan_mm.serve.engine.Engine.stats adds the queue's)."""
        b, s = self.blocks, self.scheduler
        return {
            "kv_blocks_used": b.num_used, "kv_blocks_free": b.num_free, "kv_blocks_total": b.num_blocks,
            "kv_usage": b.num_used / b.num_blocks, "kv_blocks_cached": len(b.cached),
            "prefix_cache_hit_rate": b.hit_rate, "prefix_cache_hit_tokens": b.hit_tokens,
            "prefix_cache_query_tokens": b.query_tokens, "num_preemptions": s.num_preemptions,
            "num_evictions": b.num_evictions, "num_running": len(s.running), "num_running_seqs": s.num_running_seqs,
            "block_size": b.block_size,
            "state_slots_used": self.slots.num_used if self.slots is not None else 0,
            "state_slots_total": self.slots.num_slots if self.slots is not None else 0,
        }
