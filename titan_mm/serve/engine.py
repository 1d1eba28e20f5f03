"""The serving engine: requests in, one scheduler iteration per :meth:`Engine.step`, outputs out.

    engine = Engine.from_pretrained("/path/to/hf_or_run", ServeConfig(), device="cuda")
    engine.add_request("r1", engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.outputs[0].new_text, out.finished)

A step: take the requests added / aborted since the last step (``add_request`` and ``abort`` are thread-safe:
they queue, the step applies), drop requests past their deadline, schedule (titan_mm.serve.scheduler), run one
forward (titan_mm.serve.runner), then per sequence that reached its last token: sample (or advance its beams),
check stop conditions, and report. Prompts are checked in ``add_request`` (:class:`BadRequest`), admission there
too (:class:`QueueFull`: the queue is full or the token rate is spent).

Tensor parallel (``serve.tensor_parallel_size``, titan_mm/serve/tp.py): every rank runs this engine on its shards;
rank 0 takes the requests, and each of its steps starts by broadcasting what the step applies, which the other
ranks (:meth:`Engine.run_worker`) apply and step on in turn.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from titan_mm.config import ConfigError, Data
from titan_mm.dtypes import torch_dtype
from titan_mm.loader import load_model
from titan_mm.serve.beam import BeamState, beam_step
from titan_mm.serve.block_manager import BlockManager, StateSlots
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.errors import BadRequest, QueueFull
from titan_mm.serve.media import expand_images
from titan_mm.serve.runner import Fed, ModelRunner, kv_bytes_per_block, state_bytes
from titan_mm.serve.sampling import Draw, RowSampling, SamplingParams, draw, sample
from titan_mm.serve.scheduler import Row, Scheduler, sequence_keys
from titan_mm.serve.spec_decode import DraftProposer, ngram_propose, verify
from titan_mm.serve.tp import tensor_parallel
from titan_mm.serve.sequence import (PENDING, CompletionOutput, Request, RequestMetrics, RequestOutput,
                                     Sequence as Seq, Status, now)

__all__ = ["Engine", "RequestOutput", "BadRequest", "QueueFull", "SamplingParams", "ServeConfig"]

log = logging.getLogger(__name__)


@dataclass
class _Inflight:
    """A step whose sampled tokens are still on the device (serve.async_scheduling): (sequence, request, row of
    the draw) for each sequence that holds a PENDING token, and where the next step's forward finds them."""

    seqs: list[tuple[Seq, Request, int]]
    draw: Draw

    @property
    def fed(self) -> Fed:
        return Fed(self.draw.tokens, {s.seq_id: j for s, _, j in self.seqs})


class Engine:
    def __init__(self, model: torch.nn.Module, spec, model_cfg, serve_cfg: ServeConfig | None = None, *,
                 tokenizer=None, device: torch.device | str = "cpu", data: Data | None = None,
                 eos_token_ids: Sequence[int] | None = None, clock: Callable[[], float] = now, draft=None):
        """``model``: built by ``spec`` from ``model_cfg`` with its weights (moved to ``device`` and the serving
        dtype here). ``data``: the [data] section the model trained with (image resize bounds). ``eos_token_ids``:
        tokens that end a sequence (default: the tokenizer's <|im_end|> and <|endoftext|>). ``draft``: (model, spec,
        config) of the draft model for speculative_method "draft" (from_pretrained loads serve.draft_model)."""
        from titan_mm.data.tokenizer import load_tokenizer

        cfg = serve_cfg or ServeConfig()
        cfg.check()
        if not spec.kv_cache:
            raise ConfigError(f"model {spec.name!r} does not decode through the paged KV cache yet, so the engine "
                              "cannot serve it; its spec needs a KV-cache path first (docs/models.md)")
        self.cfg, self.spec, self.model_cfg = cfg, spec, model_cfg
        self.device = torch.device(device)
        # tensor parallel (titan_mm/serve/tp.py): rank 0 drives, the other ranks follow its steps (run_worker)
        tp = cfg.tensor_parallel_size
        self.tp = tensor_parallel(tp, self.device.type) if tp > 1 else None
        self.tp_rank = self.tp.rank if self.tp is not None else 0
        self.dtype = torch_dtype(cfg.dtype) if cfg.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.dims = spec.dims(model_cfg)
        self.needs = spec.data_needs(model_cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(None)
        self.detok = Detokenizer(self.tokenizer)
        self.data = data or Data()
        self.eos = frozenset(eos_token_ids if eos_token_ids is not None else
                             (i for i in (self.tokenizer.eos_id, self.tokenizer.endoftext_id) if i is not None))
        self.clock = clock
        self.max_model_len = cfg.max_model_len or self.dims.max_position_embeddings
        if not self.max_model_len:
            raise ConfigError(f"{spec.name} does not name its context length; set serve.max_model_len")
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"serve.enable_chunked_prefill=false needs max_num_batched_tokens >= max_model_len "
                              f"({cfg.max_num_batched_tokens} < {self.max_model_len}); raise it, lower "
                              "max_model_len, or enable chunked prefill")
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ConfigError(f"serve.max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
                              f"({cfg.max_num_seqs}): every running sequence needs its decode token each step")
        if cfg.speculative_method and self.dims.linear is not None:
            raise ConfigError(f"serve.speculative_method={cfg.speculative_method!r}: model {spec.name!r} has "
                              "linear-attention layers, whose recurrent state cannot be rolled back past rejected "
                              "guesses; set serve.speculative_method = ''")
        self.model = self._shard(model, spec, model_cfg, "the model").to(self.device, self.dtype).eval()
        if (cfg.speculative_method == "draft") != (draft is not None):
            raise ConfigError("serve.speculative_method='draft' needs a draft model (serve.draft_model), and a draft "
                              "model needs speculative_method='draft'")
        self.draft = None
        if draft is not None:
            d_model, d_spec, d_cfg = draft
            if d_spec.dims(d_cfg).vocab_size != self.dims.vocab_size:
                raise ConfigError(f"the draft model's vocabulary ({d_spec.dims(d_cfg).vocab_size}) differs from the "
                                  f"target's ({self.dims.vocab_size}); pick a draft of the same tokenizer")
            if d_spec.dims(d_cfg).linear is not None:
                raise ConfigError(f"the draft model {d_spec.name!r} has linear-attention layers, whose state cannot "
                                  "be rolled back past rejected guesses; pick a draft of full-attention layers only")
            d_model = self._shard(d_model, d_spec, d_cfg, "the draft model")
            self.draft = (d_model.to(self.device, self.dtype).eval(), d_spec, d_cfg)
        num_blocks = cfg.num_blocks or self._blocks_from_memory()
        if self.tp is not None and not cfg.num_blocks:  # free memory differs per rank; the pools must not
            num_blocks = self.tp.min(num_blocks)
        if num_blocks < 1:
            raise ConfigError(f"no memory is left for the KV cache after the weights (serve.gpu_memory_utilization="
                              f"{cfg.gpu_memory_utilization}); raise it, set serve.num_blocks, or lower "
                              "max_num_batched_tokens")
        # a hybrid model's cached KV blocks are useless without the linear layers' state at their end: no prefix
        # caching for families with linear-attention layers (their states live in one slot per sequence)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching and self.dims.linear is None)
        self.slots = StateSlots(cfg.max_num_seqs) if self.dims.linear is not None else None
        self.scheduler = Scheduler(cfg, self.blocks, self.slots)
        runner = dict(block_size=cfg.block_size, num_blocks=num_blocks, max_num_seqs=cfg.max_num_seqs, tp=tp,
                      paged_decode=cfg.paged_decode, max_model_len=self.max_model_len, cuda_graphs=cfg.cuda_graphs,
                      packed_prefill=cfg.packed_prefill)
        self.runner = ModelRunner(self.model, spec, model_cfg, self.device, self.dtype, **runner)
        self.proposer = None
        if self.draft is not None:  # its own pool, the target's block layout and tables
            self.proposer = DraftProposer(ModelRunner(*self.draft, self.device, self.dtype, **runner))
        for r in [self.runner] + ([self.proposer.runner] if self.proposer is not None else []):
            r.capture_graphs()  # at start-up, as vLLM does: no request waits for a capture
        if cfg.speculative_method:
            self.scheduler.lookahead = self._lookahead
        log.info("%s", self.describe())
        self._guesses: dict[int, list[int]] = {}
        self._async = cfg.async_scheduling and not cfg.speculative_method  # guesses are proposed from the tokens
        self._inflight: _Inflight | None = None
        seed = int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator(self.device).manual_seed(self.tp.broadcast(seed) if self.tp else seed)
        self.requests: dict[str, Request] = {}
        self._inbox: deque = deque()
        self._lock = threading.Lock()  # guards requests and the inbox (add_request / abort from other threads)
        self._step_lock = threading.Lock()  # held through a step
        self._seq_ids = itertools.count()
        self._bucket = cfg.token_rate_limit * cfg.token_rate_burst_s
        self._bucket_t = clock()
        self._aborted: list[Request] = []

    # ---- construction ----
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, serve_cfg: ServeConfig | None = None,
                        device: torch.device | str | None = None, **kw) -> Engine:
        """An HF model folder (config.json + safetensors) or a titan_mm run / checkpoint folder; with
        speculative_method "draft", serve.draft_model is loaded the same way."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cfg = serve_cfg or ServeConfig()
        cfg.check()
        shard = None
        if cfg.tensor_parallel_size > 1:  # each rank builds on meta and reads only its shards
            shard = tensor_parallel(cfg.tensor_parallel_size, device.type).shard
        got = load_model(path, device, shard=shard, kernels=cfg.kernels)
        if cfg.speculative_method == "draft" and "draft" not in kw:
            if not cfg.draft_model:
                raise ConfigError("serve.speculative_method='draft' needs serve.draft_model (an HF folder or a run)")
            d = load_model(cfg.draft_model, device, shard=shard, kernels=cfg.kernels)
            kw["draft"] = (d.model, d.spec, d.model_cfg)
        kw.setdefault("eos_token_ids", got.eos_ids)
        return cls(got.model, got.spec, got.model_cfg, cfg, tokenizer=got.tokenizer, device=device, data=got.data,
                   **kw)

    def describe(self, model: str | None = None) -> str:
        """The start-up line: the model (``model``: its path or served name; default: the family), dtype, context,
        KV pool and captured CUDA graphs."""
        b, graphs = self.blocks, self.runner.captured
        shown = f"{model} ({self.spec.name})" if model else self.spec.name
        tp = f", tensor_parallel_size {self.cfg.tensor_parallel_size}" if self.tp is not None else ""
        return (f"engine ready: model {shown}, dtype {str(self.dtype).removeprefix('torch.')}, max_model_len "
                f"{self.max_model_len}, KV blocks {b.num_blocks} x {b.block_size} tokens, captured graphs "
                f"{len(graphs)}" + (f" (decode batch sizes {graphs[0]}..{graphs[-1]})" if graphs else "") + tp
                + f", device {self.device}")

    def _shard(self, model, spec, model_cfg, what: str):
        """Tensor parallel: ``model`` split by its family's plan, unless from_pretrained already did."""
        from titan_mm.models.hf_io import is_sharded

        if self.tp is None or is_sharded(model):
            return model
        return self.tp.shard(model.to(self.device), spec, model_cfg, what)

    def _blocks_from_memory(self) -> int:
        """KV blocks from the memory left after the weights and a profiling forward of max_num_batched_tokens."""
        cfg = self.cfg
        act = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            n = min(cfg.max_num_batched_tokens, self.max_model_len)
            with torch.inference_mode():
                self.model(torch.zeros(1, n, dtype=torch.long, device=self.device), logits_at=torch.tensor([n - 1],
                           device=self.device))
            act = torch.cuda.max_memory_allocated(self.device) - base
            torch.cuda.empty_cache()
        act += state_bytes(self.dims, cfg.max_num_seqs + 1, self.dtype, cfg.tensor_parallel_size)
        cap = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        tp = cfg.tensor_parallel_size
        per = kv_bytes_per_block(self.dims, cfg.block_size, self.dtype, tp)
        if self.draft is not None:
            per += kv_bytes_per_block(self.draft[1].dims(self.draft[2]), cfg.block_size, self.dtype, tp)
        return ModelRunner.blocks_from_memory(per, self.device, cfg.gpu_memory_utilization, act, cap)

    # ---- requests ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, images=None,
                    priority: int = 0, deadline_s: float | None = None) -> None:
        """Queue a request (thread-safe); raises :class:`BadRequest` for a request that can never run as given
        and :class:`QueueFull` when it cannot be taken now. ``prompt_ids`` hold one image-pad token per image of
        ``images`` (PIL images, encoded bytes, ``data:`` URIs, arrays, or titan_mm.data.vision.MediaItem); the
        engine expands them with the family's processor, as in training."""
        self._driver_only("add_request")
        req, cost = self._new_request(request_id, prompt_ids, params, images, priority, deadline_s)
        t = req.metrics.arrival
        with self._lock:
            if request_id in self.requests:
                raise BadRequest("request_id", f"{request_id!r} is already in use by an unfinished request")
            waiting = sum(1 for r in self.requests.values() if r.status is Status.WAITING)
            if waiting >= self.cfg.max_queue_len:
                raise QueueFull(f"{waiting} requests are waiting (serve.max_queue_len={self.cfg.max_queue_len}); "
                                "retry later")
            if self.cfg.token_rate_limit:
                rate = self.cfg.token_rate_limit
                self._bucket = min(rate * self.cfg.token_rate_burst_s, self._bucket + (t - self._bucket_t) * rate)
                self._bucket_t = t
                if self._bucket < 0:
                    raise QueueFull(f"the token rate limit ({rate:g} tokens/s) is spent; retry in "
                                    f"{-self._bucket / rate:.1f}s")
                self._bucket -= cost
            self.requests[request_id] = req
            # what the other tp ranks rebuild it from: the arguments and the arrival time
            self._inbox.append(("add", req, (request_id, prompt_ids, params, images, priority, deadline_s, t)))

    def _new_request(self, request_id, prompt_ids, params, images, priority, deadline_s,
                     t: float | None = None) -> tuple[Request, int]:
        """(the checked, expanded request arriving at ``t`` (default: now, after its checks), its tokens: prompt +
        max_tokens x width); BadRequest for one that can never run. The same on every tp rank."""
        if not isinstance(request_id, str) or not request_id:
            raise BadRequest("request_id", f"must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise BadRequest("params", f"must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        V = self.dims.vocab_size
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise BadRequest("prompt", "must be a non-empty list of token ids")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise BadRequest("prompt", f"token ids must be ints in 0 .. {V - 1} (the model's vocabulary), got {bad[0]!r}")
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise BadRequest("stop_token_ids", f"{bad[0]} is outside the vocabulary (0 .. {V - 1})")
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority < self.cfg.priority_levels:
            raise BadRequest("priority", f"must be an int in 0 .. {self.cfg.priority_levels - 1} (0 first), "
                             f"got {priority!r}")
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                       or deadline_s <= 0):
            raise BadRequest("deadline_s", f"must be a positive number of seconds, got {deadline_s!r}")
        if images is not None and not isinstance(images, (list, tuple)):
            raise BadRequest("images", f"must be a list of images, got {type(images).__name__}")
        prompt, imgs, positions, delta = expand_images(list(prompt_ids), list(images or []), self.needs, self.data)
        L, cap = len(prompt), self.max_model_len
        if L >= cap:
            raise BadRequest("prompt", f"has {L} tokens{' after expanding its images' if imgs else ''}; the engine "
                             f"takes at most {cap - 1} (max_model_len {cap} includes the output)")
        max_new = params.max_tokens if params.max_tokens is not None else cap - L
        if L + max_new > cap:
            raise BadRequest("max_tokens", f"prompt ({L}) + max_tokens ({max_new}) exceeds max_model_len ({cap}); "
                             f"ask for at most {cap - L} tokens")
        need = params.width * self.blocks.blocks_for(L + max_new)
        if need > self.blocks.num_blocks:
            raise BadRequest("max_tokens", f"{params.width} sequence(s) of {L + max_new} tokens need up to {need} KV "
                             f"blocks but the pool holds {self.blocks.num_blocks}; lower max_tokens or n / best_of")
        t = self.clock() if t is None else t
        metrics = RequestMetrics(arrival=t)
        seq = Seq(next(self._seq_ids), list(prompt), L, generator=self._generator(params, 0))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        req = Request(request_id, prompt, params, priority, None if deadline_s is None else t + deadline_s, metrics,
                      [seq], imgs, positions, delta, stop_ids=stop_ids)
        if params.use_beam_search:
            req.beam = BeamState(params.width, stop_ids, L + max_new)
        return req, L + max_new * params.width

    def abort(self, request_id: str) -> None:
        """Drop a request (thread-safe): its blocks are freed at once when no step runs, else when it ends; the
        next step reports it with finish_reason "abort". An unknown or finished id is ignored."""
        self._driver_only("abort")
        with self._lock:
            self._inbox.append(("abort", request_id, request_id))
        if self._step_lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._step_lock.release()

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests) or bool(self._aborted)

    def chat_prompt(self, messages: list[dict]) -> tuple[list[int], list]:
        """(prompt ids, images) of OpenAI-style chat ``messages`` through the family's chat template (the
        processors' renderer, as in training), ending with the assistant's turn opened."""
        from titan_mm.data.processors import Processor, ProcessorConfig
        from titan_mm.data.schema import parse_record
        from titan_mm.data.sources import SkipSample

        try:
            sample = parse_record({"messages": messages})
            text, _, media = Processor(self.tokenizer, ProcessorConfig(self.data, self.needs)).render(
                sample, add_generation_prompt=True)
        except SkipSample as e:
            raise BadRequest("messages", str(e)) from None
        if any(m.type != "image" for m in media):
            raise BadRequest("messages", "only text and image parts are served (no video or audio yet)")
        return self.tokenizer.encode(text), [m.ref for m in media]

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed(params.seed + index)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; -> an output for every request that got tokens or finished."""
        self._driver_only("step")
        with self._step_lock:
            return self._step_at(self._drain("step"))

    def _step_at(self, t: float) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        for req in [r for r in self.scheduler.running + self.scheduler.waiting if r.deadline is not None]:
            if t > req.deadline:
                req.metrics.deadline_exceeded = True
                self._finish(req, "abort")
                touched[req.request_id] = req
        for req in self._aborted:
            touched[req.request_id] = req
        self._aborted = []
        sched = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        launched = None
        if sched.rows:
            per_row = self._propose(sched) if self.cfg.speculative_method else 1
            logits = self.runner.run(sched.rows, sched.copies, per_row, prev.fed if prev is not None else None)
            if self._async and all(self._overlaps(r.req) for r in sched.rows if r.samples):
                launched = self._launch(sched.rows, logits, prev.fed if prev is not None else None)
        if prev is not None:  # the GPU runs this step's forward while the host takes the previous one's tokens
            self._resolve(prev, touched)
        if sched.rows and launched is None:
            self._advance(sched.rows, logits, touched)
        outs = [self._output(r) for r in touched.values()]
        if launched is not None:  # after the outputs: they must not hold the PENDING tokens
            self._inflight = self._pend(sched.rows, *launched)
        return outs

    def _drain(self, kind: str = "drain") -> float:
        """Apply the requests added / aborted since the last call; -> the clock for the step. Tensor parallel: rank
        0 first sends them, the clock and ``kind`` ("step": a step follows) to the other ranks (:meth:`run_worker`)."""
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        t = self.clock()
        if self.tp is not None:
            self.tp.broadcast((kind, t, [(k, wire) for k, _, wire in items]))
        self._apply([(k, x) for k, x, _ in items])
        return t

    def _apply(self, items: list[tuple[str, Any]]) -> None:
        for kind, x in items:
            if kind == "add":
                if x.request_id in self.requests and self.requests[x.request_id] is x:
                    self.scheduler.add(x)
            else:
                req = self.requests.get(x)
                if req is not None and req.status is not Status.FINISHED:
                    self._finish(req, "abort")
                    self._aborted.append(req)

    # ---- tensor parallel: the ranks other than 0 ----
    def run_worker(self, until: str = "stop") -> None:
        """Follow rank 0's steps on a rank > 0 until rank 0 sends ``until``: "stop" (:meth:`shutdown`: the server's
        ranks) or "release" (the end of a ``generate`` call). A step that raises is logged; at a release the
        first such error is raised again, as rank 0's ``generate`` raises it."""
        err = None
        while True:
            kind, t, wire = self.tp.broadcast()
            if kind in (until, "stop"):
                break
            if kind == "release":  # a generate on rank 0 ended; the server's ranks go on
                continue
            with self._step_lock:
                try:
                    items = [(k, self._remote_request(w) if k == "add" else w) for k, w in wire]
                    self._apply(items)
                    if kind == "step":
                        self._step_at(t)
                except Exception as e:  # rank 0 met the same (same inputs) and carries on, or raises in generate
                    log.exception("tensor-parallel rank %d: a step failed", self.tp_rank)
                    err = err or e
        if err is not None and until == "release":
            raise err

    def _remote_request(self, args: tuple) -> Request:
        """Rank 0's request, rebuilt here from its add_request arguments and arrival time."""
        req, _ = self._new_request(*args)
        with self._lock:
            self.requests[req.request_id] = req
        return req

    def _send(self, kind: str) -> None:
        if self.tp is not None and self.tp_rank == 0:
            with self._step_lock:
                self.tp.broadcast((kind, 0.0, []))

    def shutdown(self) -> None:
        """Tensor parallel, rank 0: let the other ranks leave :meth:`run_worker` (call once, when done serving)."""
        self._send("stop")

    def _driver_only(self, what: str) -> None:
        if self.tp_rank:
            raise RuntimeError(f"Engine.{what} on tensor-parallel rank {self.tp_rank}: only rank 0 takes requests and "
                               "steps; the other ranks call run_worker() (or generate(), which follows rank 0's)")

    def _finish(self, req: Request, reason: str | None = None) -> None:
        """End ``req``: every live sequence gets ``reason``; blocks are freed and the request forgotten."""
        for s in req.live:
            s.finish_reason = reason
        self.scheduler.finish(req)
        req.metrics.finished = self.clock()
        with self._lock:
            self.requests.pop(req.request_id, None)

    # ---- speculative decoding ----
    def _lookahead(self, req: Request, seq: Seq) -> int:
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

    def _propose(self, sched) -> int:
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

    def _speculated(self, rows: list[tuple[Row, torch.Tensor]], touched: dict[str, Request]) -> None:
        """Keep the guesses rejection sampling accepts, then the target's own token (stop conditions per token)."""
        samplings = [RowSampling(r.req.params, r.req.prompt, r.seq.output, r.seq.generator) for r, _ in rows]
        checked = verify(torch.stack([lg for _, lg in rows]), samplings, [r.draft for r, _ in rows],
                         [r.q for r, _ in rows], self.generator)
        for (r, _), v in zip(rows, checked):
            seq, req = r.seq, r.req
            T = r.start + 1  # the sequence's length before the step
            seq.num_computed = T + v.accepted  # k/v of the guesses after the first rejection are stale
            if self.proposer is not None:  # the draft pool holds the kept guesses but the last one
                seq.draft_computed = T + min(v.accepted, max(len(r.draft) - 1, 0))
            req.metrics.spec_proposed += len(r.draft)
            req.metrics.spec_accepted += v.accepted
            for got in v.emitted:
                self._append(req, seq, got)
                if seq.finished:
                    break
            if not seq.finished:
                self._register(req, seq)
            touched[req.request_id] = req
            if not req.live:
                self._finish(req)

    def _register(self, req: Request, seq: Seq) -> None:
        """Record the prefix keys of ``seq``'s newly computed full blocks."""
        bs = self.blocks.block_size
        if self.blocks.prefix_caching and seq.num_computed // bs > len(seq.table.keys):
            parent = seq.table.keys[-1] if seq.table.keys else None
            self.blocks.register(seq.table, sequence_keys(req, seq, seq.num_computed, bs, len(seq.table.keys), parent))

    # ---- asynchronous steps (serve.async_scheduling) ----
    @staticmethod
    def _overlaps(req: Request) -> bool:
        """Its next token can be sampled without the host: no beams and no first-token fork (n > 1 / best_of).
        Penalties count a pending token on the device."""
        return req.beam is None and (req.forked or req.params.width == 1)

    def _launch(self, rows: list[Row], logits: torch.Tensor, fed: Fed | None) -> tuple[Draw | None, list[Row]]:
        """Sample the rows that reached their last token, leaving the tokens on the device (their copy to the host
        started); -> (the draw, those rows in its order). ``fed``: the previous step's tokens, which the
        penalties of a sequence still holding one PENDING count."""
        at = [i for i, r in enumerate(rows) if r.samples]
        if not at:
            return None, []
        todo = [rows[i] for i in at]
        if len(at) < len(rows):  # mid-prompt chunks give no token
            logits = logits[torch.tensor(at).to(logits.device, non_blocking=True)]
        samplings = [RowSampling(r.req.params, r.req.prompt, r.seq.output, r.seq.generator,
                                 self._pending_token(r.seq, fed) if r.req.params.penalized else None) for r in todo]
        return draw(logits, samplings, self.generator).copy_out(), todo

    @staticmethod
    def _pending_token(seq: Seq, fed: Fed | None) -> torch.Tensor | None:
        """[1] on the device: the token ``seq``'s PENDING place stands for (None when it holds none)."""
        if seq.tokens[-1] != PENDING:
            return None
        j = fed.row_of[seq.seq_id]
        return fed.tokens[j:j + 1]

    def _pend(self, rows: list[Row], drawn: Draw | None, todo: list[Row]) -> _Inflight | None:
        """After the launch and the previous step's tokens: the rows' k/v count as computed, and each sampling
        sequence still live holds a PENDING token (the next step feeds it from the device)."""
        for r in rows:
            if not r.seq.finished:  # a sequence the previous step's tokens ended: this step's row is void
                r.seq.num_computed = r.start + r.n
                self._register(r.req, r.seq)
        seqs = []
        for j, r in enumerate(todo):
            seq = r.seq
            if not seq.finished:
                r.req.forked = True
                if not self._ends(r.req, len(seq.tokens) + 1, len(seq.tokens) + 1 - seq.num_prompt):
                    seq.tokens.append(PENDING)  # a sequence this token ends gets no row next step
                seqs.append((seq, r.req, j))
        if not seqs:
            return None
        return _Inflight(seqs, drawn)

    def _resolve(self, prev: _Inflight, touched: dict[str, Request]) -> None:
        """The previous step's tokens, read back: stop checks, text and outputs, as a step in turn would do."""
        got = prev.draw.results()
        for seq, req, j in prev.seqs:
            if seq.finished:  # aborted or past its deadline meanwhile
                seq.drop_pending()
                continue
            self._append(req, seq, got[j])
            touched[req.request_id] = req
            if seq.finished and req.status is not Status.FINISHED and not req.live:
                self._finish(req)

    def _advance(self, rows: list[Row], logits: torch.Tensor, touched: dict[str, Request]) -> None:
        todo: list[tuple[Seq, Request, int]] = []
        spec: list[tuple[Row, torch.Tensor]] = []
        for i, r in enumerate(rows):
            seq, req = r.seq, r.req
            if seq.finished:  # ended by the previous step's tokens (asynchronous steps): this row is void
                continue
            if r.lookahead:
                spec.append((r, logits[i]))
                continue
            seq.num_computed = r.start + r.n
            self._register(req, seq)
            if r.samples:
                todo.append((seq, req, i))
        if spec:
            self._speculated(spec, touched)
        if logits.dim() == 3:
            logits = logits[:, 0]
        rows_s: list[RowSampling] = []
        row_index: list[int] = []
        targets: list[tuple[Seq, Request]] = []
        ended: dict[str, Request] = {}
        for seq, req, i in todo:
            if req.beam is not None:
                seq.pending = logits[i].float().log_softmax(-1)
                if all(s.pending is not None for s in req.live):
                    if req.metrics.first_token is None:
                        req.metrics.first_token = self.clock()
                    beam_step(req, lambda s, req=req: self._fork(req, s), lambda s, req=req: self._drop(req, s))
                    touched[req.request_id] = req
                    if req.beam.done:
                        self._finish(req)
                continue
            group = (seq,)
            if not req.forked:  # the first token: n / best_of sequences share the prompt from here
                req.forked = True
                group += tuple(self._fork(req, seq, i) for i in range(1, req.params.width))
            for s in group:
                rows_s.append(RowSampling(req.params, req.prompt, s.output, s.generator))
                row_index.append(i)
                targets.append((s, req))
        if rows_s:  # one gather (rows in order: the logits themselves)
            same = row_index == list(range(len(logits)))
            picked = logits if same else logits[torch.tensor(row_index, device=logits.device)]
            for (s, req), got in zip(targets, sample(picked, rows_s, self.generator)):
                self._append(req, s, got)
                touched[req.request_id] = req
                if s.finish_reason is not None:  # only such a request can have run out of live sequences
                    ended[req.request_id] = req
        for req in ended.values():
            if req.status is not Status.FINISHED and not req.live:
                self._finish(req)

    def _fork(self, req: Request, seq: Seq, index: int | None = None) -> Seq:
        child = Seq(next(self._seq_ids), list(seq.tokens), seq.num_prompt, self.blocks.fork(seq.table),
                    seq.num_computed, self._generator(req.params, len(req.seqs) if index is None else index),
                    list(seq.logprobs), seq.cum_logprob, text=seq.text, detok_offsets=seq.detok_offsets,
                    detok_tail=seq.detok_tail, draft_computed=seq.draft_computed)
        if self.slots is not None:  # the child goes on from the parent's linear-attention state
            child.state_slot = self.slots.take()
            self.runner.copy_state(seq.state_slot, child.state_slot)
        req.seqs.append(child)
        return child

    def _drop(self, req: Request, seq: Seq) -> None:
        self.scheduler.free_seq(seq)
        req.seqs.remove(seq)

    def _append(self, req: Request, seq: Seq, got) -> None:
        p = req.params
        if req.metrics.first_token is None:
            req.metrics.first_token = self.clock()
        seq.put(got.token)
        seq.cum_logprob += got.logprob
        if p.logprobs is not None:
            seq.logprobs.append(got.top)
        out = seq.output
        stop = got.token in req.stop_ids
        length = self._ends(req, len(seq.tokens), len(out))
        text = seq.text + self.detok.new_text(seq, out, p.skip_special_tokens, final=stop or length)
        if p.stop and not stop:
            lo = max(0, len(seq.text) - max(map(len, p.stop)))
            hits = [i for i in (text.find(s, lo) for s in p.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                stop = True
        seq.text = text
        if stop or length:
            seq.finish_reason = "stop" if stop else "length"
            self.scheduler.free_seq(seq)

    def _ends(self, req: Request, n_tokens: int, n_output: int) -> bool:
        """A sequence of ``n_tokens`` tokens, ``n_output`` of them generated, is at its length limit."""
        return n_output >= (req.params.max_tokens or self.max_model_len) or n_tokens >= self.max_model_len

    # ---- outputs ----
    def _output(self, req: Request) -> RequestOutput:
        p = req.params
        done = req.status is Status.FINISHED
        if req.beam is not None or p.width > p.n:
            comps = self._final(req) if done else []
        else:
            comps = [self._completion(i, s, done, p.stop) for i, s in enumerate(req.seqs)]
            if len(comps) < p.n:  # greedy: its one sequence stands for the n identical outputs
                comps = [comps[0].as_index(i) for i in range(p.n)]
        return RequestOutput(req.request_id, comps, req.prompt, done, req.metrics)

    def _completion(self, index: int, s: Seq, done: bool, stops: list[str]) -> CompletionOutput:
        out = s.output
        hold = 0 if s.finished or done else _held_back(s.text, stops)
        shown = s.text[: len(s.text) - hold]
        comp = CompletionOutput(index, out, shown, out[s.sent_tokens:], shown[s.sent_text:], s.logprobs or None,
                                s.finish_reason, s.cum_logprob)  # token_ids and logprobs: copied when read
        s.sent_tokens, s.sent_text = len(out), max(s.sent_text, len(shown))
        return comp

    def _final(self, req: Request) -> list[CompletionOutput]:
        """The n best of a beam search or of best_of samples (by cumulative logprob), once it finished."""
        p = req.params
        if req.beam is not None:
            hyps = req.beam.finished[: p.n]
            comps = []
            for i, h in enumerate(hyps):
                reason = "stop" if h.output and h.output[-1] in req.beam.eos else "length"
                text = self.tokenizer.decode(h.output, skip_special_tokens=p.skip_special_tokens)
                comps.append(CompletionOutput(i, h.output, text, h.output, text, None, reason, h.cum_logprob))
            if not comps:  # aborted before any beam finished
                comps = [CompletionOutput(0, [], "", [], "", None, "abort", 0.0)]
            return comps
        best = sorted(req.seqs, key=lambda s: -s.cum_logprob)[: p.n]
        return [CompletionOutput(i, s.output, s.text, list(s.output), s.text, s.logprobs or None, s.finish_reason,
                                 s.cum_logprob) for i, s in enumerate(best)]

    # ---- offline ----
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 images: list | None = None, *, skip_bad: bool = False) -> list[RequestOutput | None]:
        """Run ``prompts`` to completion (``images[i]``: the images of prompt i); -> their final outputs in order.
        ``skip_bad``: a prompt add_request refuses (BadRequest: too long, bad ids) gives None instead of raising."""
        if self.tp_rank:  # follow rank 0's generate: same prompts, so the same steps; rank 0 has the outputs
            self.run_worker(until="release")
            return [None] * len(prompts)
        try:
            return self._generate(prompts, params, images, skip_bad)
        finally:
            self._send("release")

    def _generate(self, prompts, params, images, skip_bad) -> list[RequestOutput | None]:
        ps = params if isinstance(params, list) else [params] * len(prompts)
        base = f"generate-{next(self._seq_ids)}-"
        taken = []
        for i, ids in enumerate(prompts):
            try:
                self.add_request(f"{base}{i}", ids, ps[i], images=images[i] if images else None)
            except BadRequest:
                if not skip_bad:
                    raise
                continue
            taken.append(i)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(taken):
            for out in self.step():
                if out.finished and out.request_id.startswith(base):
                    final[out.request_id] = out
        return [final.get(f"{base}{i}") for i in range(len(prompts))]

    def stats(self) -> dict[str, Any]:
        b, s = self.blocks, self.scheduler
        with self._lock:  # the server scrapes from another thread while add_request inserts
            waiting = [r for r in self.requests.values() if r.status is Status.WAITING]
        return {
            "kv_blocks_used": b.num_used, "kv_blocks_free": b.num_free, "kv_blocks_total": b.num_blocks,
            "kv_usage": b.num_used / b.num_blocks, "kv_blocks_cached": len(b.cached),
            "prefix_cache_hit_rate": b.hit_rate, "prefix_cache_hit_tokens": b.hit_tokens,
            "prefix_cache_query_tokens": b.query_tokens, "num_preemptions": s.num_preemptions,
            "num_evictions": b.num_evictions, "num_running": len(s.running), "num_waiting": len(waiting),
            "num_running_seqs": s.num_running_seqs,
            "waiting_by_priority": {p: sum(1 for r in waiting if r.priority == p)
                                    for p in range(self.cfg.priority_levels)},
            "block_size": b.block_size, "max_model_len": self.max_model_len,
            "state_slots_used": self.slots.num_used if self.slots is not None else 0,
            "state_slots_total": self.slots.num_slots if self.slots is not None else 0,
        }


class Detokenizer:
    """Incremental detokenization. A byte-level tokenizer's (Qwen's) tokens are bytes: a sequence's new tokens
    add their bytes to the ones still waiting, and what ends on a whole UTF-8 character is decoded; the rest waits
    (``Sequence.detok_tail``), all at O(1) per token without a tokenizer call. Others go as vLLM's: the newest
    tokens are decoded after the tokens since the previous emission, as context, and held back while they end
    inside a UTF-8 character (until the ``final`` token); the context's text is cached per token."""

    def __init__(self, tokenizer):
        from titan_mm.data.tokenizer import Tokenizer

        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer, Tokenizer) and tokenizer.byte_level
        self._one: dict[tuple[int, bool], str] = {}  # (token, skip_special_tokens) -> its text
        self._pieces: dict[tuple[int, bool], bytes] = {}  # byte-level: (token, skip_special_tokens) -> its bytes

    def decode(self, ids: list[int], skip: bool) -> str:
        if len(ids) != 1:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        key = (ids[0], skip)
        text = self._one.get(key)
        if text is None:
            text = self._one[key] = self.tokenizer.decode(ids, skip_special_tokens=skip)
        return text

    def _bytes(self, token: int, skip: bool) -> bytes:
        key = (token, skip)
        got = self._pieces.get(key)
        if got is None:
            got = self._pieces[key] = self.tokenizer.token_bytes(token, skip)
        return got

    def new_text(self, seq: Seq, out: list[int], skip: bool, final: bool) -> str:
        """The text ``seq``'s newest tokens add (``out``: its output); moves its offsets when there is some."""
        a, b = seq.detok_offsets
        if self.byte_level:
            tail = seq.detok_tail + b"".join([self._bytes(t, skip) for t in out[b:]])
            cut = len(tail) if final else _whole_chars(tail)
            seq.detok_offsets, seq.detok_tail = (b, len(out)), tail[cut:]
            return tail[:cut].decode("utf-8", "replace")
        before = self.decode(out[a:b], skip)
        now = self.decode(out[a:], skip)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        seq.detok_offsets = (b, len(out))
        return now[len(before):]


def _whole_chars(b: bytes) -> int:
    """The length of ``b`` less a last UTF-8 character that more bytes could still complete. Decoding stops
    there and goes on from there later: a cut before a lead byte never changes how the bytes before it decode."""
    for k in range(1, min(4, len(b)) + 1):
        c = b[-k]
        if c & 0xC0 != 0x80:  # a lead byte (or ASCII): the character's length from it
            need = 2 if 0xC2 <= c <= 0xDF else 3 if 0xE0 <= c <= 0xEF else 4 if 0xF0 <= c <= 0xF4 else 1
            return len(b) - k if need > k else len(b)
    return len(b)


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not to show yet: an incomplete UTF-8 character, or the start of a stop
    string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
