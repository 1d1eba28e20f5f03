"""The serving engine: requests in, one scheduler iteration per :meth:`Engine.step`, outputs out.

    engine = Engine.from_pretrained("/path/to/hf_or_run", ServeConfig(), device="cuda")
    engine.add_request("r1", engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.outputs[0].new_text, out.finished)

Engine is the front (vLLM's LLMEngine): ``add_request`` and ``abort`` are thread-safe (they queue; a step applies
them first), requests are checked and admitted by core/requests.py (:class:`BadRequest`, :class:`QueueFull`), and
each step runs core/engine_core.py's EngineCore: schedule (core/scheduler.py), execute one forward
(runner/model_runner.py), update (the handlers of core/handlers.py turn the logits into tokens, which the
scheduler's ``update_from_output`` takes through core/output_processor.py: text, stops, outputs).

Tensor parallel (``serve.tensor_parallel_size``, runner/tp.py): every rank runs this engine on its shards; rank 0
takes the requests, and each of its steps starts by broadcasting what the step applies, which the other ranks
(:meth:`Engine.run_worker`) apply and step on in turn.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from titan_mm.config import ConfigError, Data
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.loader import load_model
from titan_mm.models.hf_io import is_sharded
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.errors import BadRequest, QueueFull
from titan_mm.serve.core.engine_core import EngineCore
from titan_mm.serve.core.requests import InputProcessor
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.serve.core.sequence import Request, RequestOutput, Status, now
from titan_mm.serve.runner import weights
from titan_mm.serve.runner.tp import tensor_parallel

__all__ = ["Engine", "RequestOutput", "BadRequest", "QueueFull", "SamplingParams", "ServeConfig"]

log = logging.getLogger(__name__)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device`` (None elsewhere): serve.quantization's float8 rule."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


class Engine:
    def __init__(self, model: torch.nn.Module, spec, model_cfg, serve_cfg: ServeConfig | None = None, *,
                 tokenizer=None, device: torch.device | str = "cpu", data: Data | None = None,
                 eos_token_ids: Sequence[int] | None = None, clock: Callable[[], float] = now, draft=None,
                 owns_weights: bool = False):
        """``model``: built by ``spec`` from ``model_cfg`` with its weights (moved to ``device`` and the serving
        dtype here; with ``owns_weights``, also fused and quantized in place as serve.fuse_projections and
        serve.quantization say: from_pretrained's own, or a copy the caller gives away; the draft never is).
        ``data``: the [data] section the model trained with (image resize bounds). ``eos_token_ids``:
        tokens that end a sequence (default: the tokenizer's <|im_end|> and <|endoftext|>). ``draft``: (model, spec,
        config) of the draft model for speculative_method "draft" (from_pretrained loads serve.draft_model)."""
        cfg = serve_cfg or ServeConfig()
        cfg.check()
        if cfg.freeze_gc and not gc.get_freeze_count():  # the start-up heap out of full collections' scans, once
            gc.collect()
            gc.freeze()
        self.cfg, self.spec, self.model_cfg, self.device, self.clock = cfg, spec, model_cfg, torch.device(device), clock
        self.dims = dims = spec.dims(model_cfg)
        self.max_model_len = cfg.max_model_len or dims.max_position_embeddings
        cfg.check_model(spec.name, self.max_model_len, dims.linear is not None, spec.kv_cache)
        d_dims = draft[1].dims(draft[2]) if draft is not None else None
        cfg.check_draft(draft is not None, dims.vocab_size, d_dims and d_dims.vocab_size,
                        draft and draft[1].name, d_dims is not None and d_dims.linear is not None)
        # tensor parallel (titan_mm/serve/runner/tp.py): rank 0 drives, the other ranks follow its steps (run_worker)
        tp = cfg.tensor_parallel_size
        self.tp = tensor_parallel(tp, self.device.type) if tp > 1 else None
        self.tp_rank = self.tp.rank if self.tp is not None else 0
        self.dtype = cfg.serving_dtype(self.device)
        cfg.check_weights(self.device, owns_weights, _capability(self.device))
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(None)
        self.data = data or Data()
        self.eos = frozenset(eos_token_ids if eos_token_ids is not None else
                             (i for i in (self.tokenizer.eos_id, self.tokenizer.endoftext_id) if i is not None))
        self.model = self._on_device(model, spec, model_cfg, "the model")
        self.transforms = weights.prepare(self.model, cfg.fuse_projections, cfg.quantization) if owns_weights else {}
        self.draft = None if draft is None else (self._on_device(*draft, "the draft model"), *draft[1:])
        self.core = EngineCore(cfg, self.model, spec, model_cfg, self.device, self.dtype, self.max_model_len,
                               self.tokenizer, clock, self.tp, self.draft)
        core = self.core
        self.runner, self.proposer, self.blocks, self.slots, self.scheduler = (
            core.runner, core.proposer, core.blocks, core.slots, core.scheduler)
        self.inputs = InputProcessor(cfg, dims.vocab_size, spec.data_needs(model_cfg), self.data, self.tokenizer,
                                     self.eos, self.max_model_len, self.blocks, self.scheduler.seq_ids,
                                     core.seq_generator, clock)
        self.requests: dict[str, Request] = {}
        self._inbox: deque = deque()
        self._lock = threading.Lock()  # guards requests and the inbox (add_request / abort from other threads)
        self._step_lock = threading.Lock()  # held through a step
        self._ids = itertools.count()
        self._aborted: list[Request] = []
        log.info("%s", self.describe())

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, serve_cfg: ServeConfig | None = None,
                        device: torch.device | str | None = None, **kw) -> Engine:
        """An HF model folder (config.json + safetensors) or a titan_mm run / checkpoint folder; with
        speculative_method "draft", serve.draft_model is loaded the same way."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cfg = serve_cfg or ServeConfig()
        cfg.check()
        if cfg.freeze_gc and not gc.get_freeze_count():  # the start-up heap out of full collections' scans, once
            gc.collect()
            gc.freeze()
        cfg.check_weights(device, True, _capability(device))  # before the weights load
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
                   owns_weights=True, **kw)

    def _on_device(self, model, spec, model_cfg, what: str) -> torch.nn.Module:
        """``model`` in the serving dtype on the device; under tensor parallel split by its family's plan, unless
        from_pretrained already did."""
        if self.tp is not None and not is_sharded(model):
            model = self.tp.shard(model.to(self.device), spec, model_cfg, what)
        return model.to(self.device, self.dtype).eval()

    def describe(self, model: str | None = None) -> str:
        """The start-up line: the model (``model``: its path or served name; default: the family), dtype, context,
        KV pool and captured CUDA graphs."""
        b, graphs = self.blocks, self.runner.captured
        shown = f"{model} ({self.spec.name})" if model else self.spec.name
        tp = f", tensor_parallel_size {self.cfg.tensor_parallel_size}" if self.tp is not None else ""
        if self.transforms.get("fused_gemms_saved"):
            tp += f", fused projections ({self.transforms['fused_gemms_saved']} GEMMs fewer per forward)"
        if self.transforms.get("quantized_linears"):
            tp += f", quantization {self.cfg.quantization} ({self.transforms['quantized_linears']} linears)"
        if self.cfg.kv_cache_dtype != "auto":
            tp += f", KV cache {self.cfg.kv_cache_dtype}"
        return (f"engine ready: model {shown}, dtype {str(self.dtype).removeprefix('torch.')}, max_model_len "
                f"{self.max_model_len}, KV blocks {b.num_blocks} x {b.block_size} tokens, captured graphs "
                f"{len(graphs)}" + (f" (decode batch sizes {graphs[0]}..{graphs[-1]})" if graphs else "") + tp
                + f", device {self.device}")

    # ---- requests ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, images=None,
                    videos=None, audios=None, priority: int = 0, deadline_s: float | None = None) -> None:
        """Queue a request (thread-safe); raises :class:`BadRequest` for a request that can never run as given
        and :class:`QueueFull` when it cannot be taken now. ``prompt_ids`` hold one image-pad token per image of
        ``images`` (PIL images, encoded bytes, ``data:`` URIs, arrays, or titan_mm.data.vision.MediaItem) and one
        video-pad token per video of ``videos`` (encoded bytes, ``data:video/...`` URIs, or MediaItems of
        titan_mm.data.vision.process_video) and one audio-pad token per clip of ``audios`` (encoded wav / flac bytes,
        ``data:audio/...`` URIs, 16 kHz mono waveforms as 1-D float arrays, or MediaItems of
        titan_mm.data.audio.process_audio); the engine expands them with the family's processor, as in training."""
        self._driver_only("add_request")
        req, cost = self.inputs.make(request_id, prompt_ids, params, images, videos, priority, deadline_s,
                                     audios=audios)
        t = req.metrics.arrival
        with self._lock:
            if request_id in self.requests:
                raise BadRequest("request_id", f"{request_id!r} is already in use by an unfinished request")
            self.inputs.admit(sum(1 for r in self.requests.values() if r.status is Status.WAITING), cost, t)
            self.requests[request_id] = req
            # what the other tp ranks rebuild it from: the arguments and the arrival time
            self._inbox.append(("add", req, (request_id, prompt_ids, params, images, videos, priority, deadline_s,
                                             t, audios)))

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
        """(prompt ids, images) of OpenAI-style chat ``messages`` (titan_mm.serve.core.requests); a chat with
        video or audio parts is refused: :meth:`chat_media` returns those too."""
        ids, images, videos, audios = self.inputs.chat_media(messages)
        if videos or audios:
            raise BadRequest("messages", "holds video or audio parts; Engine.chat_media returns (ids, images, videos, "
                             "audios)")
        return ids, images

    def chat_media(self, messages: list[dict]) -> tuple[list[int], list, list, list]:
        """(prompt ids, images, videos, audios) of OpenAI-style chat ``messages``: add_request's ``prompt_ids``,
        ``images``, ``videos`` and ``audios``."""
        return self.inputs.chat_media(messages)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; -> an output for every request that got tokens or finished."""
        self._driver_only("step")
        with self._step_lock:
            return self._step_at(self._drain("step"))

    def _step_at(self, t: float) -> list[RequestOutput]:
        outs = self.core.step(t, self._aborted)
        self._aborted = []
        with self._lock:
            for o in outs:  # finished ones are forgotten (an id aborted and reused since belongs to the new one)
                req = self.requests.get(o.request_id)
                if o.finished and req is not None and req.status is Status.FINISHED:
                    del self.requests[o.request_id]
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
                if self.requests.get(x.request_id) is x:
                    self.scheduler.add(x)
            else:
                req = self.requests.get(x)
                if req is not None and req.status is not Status.FINISHED:
                    self.scheduler.finish(req, "abort")
                    with self._lock:
                        del self.requests[x]
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
                    self._apply([(k, self._remote_request(w) if k == "add" else w) for k, w in wire])
                    if kind == "step":
                        self._step_at(t)
                except Exception as e:  # rank 0 met the same (same inputs) and carries on, or raises in generate
                    log.exception("tensor-parallel rank %d: a step failed", self.tp_rank)
                    err = err or e
        if err is not None and until == "release":
            raise err

    def _remote_request(self, args: tuple) -> Request:
        """Rank 0's request, rebuilt here from its add_request arguments and arrival time."""
        req, _ = self.inputs.make(*args)
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

    # ---- offline ----
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 images: list | None = None, *, videos: list | None = None, audios: list | None = None,
                 skip_bad: bool = False) -> list[RequestOutput | None]:
        """Run ``prompts`` to completion (``images[i]`` / ``videos[i]`` / ``audios[i]``: the images / videos / audio
        clips of prompt i); -> their final outputs in order.
        ``skip_bad``: a prompt add_request refuses (BadRequest: too long, bad ids) gives None instead of raising."""
        if self.tp_rank:  # follow rank 0's generate: same prompts, so the same steps; rank 0 has the outputs
            self.run_worker(until="release")
            return [None] * len(prompts)
        try:
            ps = params if isinstance(params, list) else [params] * len(prompts)
            base = f"generate-{next(self._ids)}-"
            taken = []
            for i, ids in enumerate(prompts):
                try:
                    self.add_request(f"{base}{i}", ids, ps[i], images=images[i] if images else None,
                                     videos=videos[i] if videos else None, audios=audios[i] if audios else None)
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
        finally:
            self._send("release")

    def stats(self) -> dict[str, Any]:
        with self._lock:  # the server scrapes from another thread while add_request inserts
            waiting = [r for r in self.requests.values() if r.status is Status.WAITING]
        return self.core.stats() | {
            "num_waiting": len(waiting), "max_model_len": self.max_model_len,
            "waiting_by_priority": {p: sum(1 for r in waiting if r.priority == p)
                                    for p in range(self.cfg.priority_levels)}}
