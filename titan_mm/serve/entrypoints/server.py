"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`~titan_mm.serve.async_engine.AsyncEngine`.

    app = build_app(engine, model_name="debug")      # python -m titan_mm.serve runs it under uvicorn

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream by SSE with ``"stream": true``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, titan_mm/serve/entrypoints/metrics.py).

Errors are OpenAI's error object: 400 for a bad body or a request the engine refuses (``param`` names the field),
404 for another model name, 429 when the engine's queue or token budget is full, 500 when a step fails (the server
keeps serving). A client that disconnects, streaming or not, aborts its requests; their KV blocks are freed at
the engine's next step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from titan_mm.serve.entrypoints.async_engine import AsyncEngine, RequestStream
from titan_mm.serve.errors import BadRequest, QueueFull
from titan_mm.serve.entrypoints.metrics import ServerMetrics
from titan_mm.serve.entrypoints.openai_protocol import (ChatCompletionRequest, CompletionRequest, RequestError, dumps,
                                            error_body, parse_body)
from titan_mm.serve.sampling_params import SamplingParams


CLIENT_GONE = 499  # nginx's "client closed request": the answer to a request whose client left (nobody reads it)


class HTTPError(Exception):
    """An answer other than 200, as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def _sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


def _usage(outs) -> dict:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class OpenAIServer:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tok = engine.tokenizer
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.stats)
        self.aeng: AsyncEngine | None = None  # started by the app's lifespan (it needs the running loop)

    # ------------------------------------------------------------------ request -> engine
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise HTTPError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                            "model_not_found")

    @staticmethod
    def _bad(req, e: BadRequest, media_at: dict[str, list[str]] | None = None) -> HTTPError:
        """A 400 naming the request's field; the engine's ``images[i]`` / ``videos[i]`` is the chat part that held
        image / video i (``media_at``: the parts' fields by the engine's argument)."""
        field = e.field
        kind = field.split("[", 1)[0]
        if (media_at or {}).get(kind):
            i = int(field[len(kind) + 1:-1]) if field.startswith(f"{kind}[") else 0
            field = media_at[kind][i]
        param = req.param_of(field)
        return HTTPError(400, f"{param}: {e.message}", param, "invalid_value")

    def _params(self, req) -> SamplingParams:
        params = SamplingParams(**req.sampling_fields())
        try:
            params.validate()
        except BadRequest as e:
            raise self._bad(req, e) from None
        return params

    async def _submit(self, req, prompts: list[tuple[list[int], dict | None]], params: SamplingParams,
                      prefix: str, media_at: dict[str, list[str]] | None = None) -> RequestStream:
        """``prompts``: (ids, add_request's media keywords: images, videos)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        reqs = [(f"{rid}-{i}", ids, params, media) for i, (ids, media) in enumerate(prompts)]
        submit = functools.partial(self.aeng.submit, reqs, priority=req.priority or 0, deadline_s=req.deadline_s)
        try:
            # add_request decodes and patches images and videos: off the event loop, so that other streams flow
            return await asyncio.to_thread(submit) if media_at and any(media_at.values()) else submit()
        except BadRequest as e:
            raise self._bad(req, e, media_at) from None
        except QueueFull as e:
            raise HTTPError(429, str(e), None, "queue_full", "rate_limit_error") from None

    # ------------------------------------------------------------------ engine output -> JSON
    def _text(self, tid: int) -> str:
        return self.tok.decode([tid])

    def _completion_logprobs(self, ids: list[int], lps: list[dict], offset: int) -> dict:
        tokens = [self._text(t) for t in ids]
        offsets = [offset + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(ids, lps)],
                "top_logprobs": [{self._text(t): v for t, v in lp.items()} for lp in lps], "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], lps: list[dict], k: int) -> dict:
        """OpenAI's chat logprobs: per token its own and the ``k`` most likely (the engine adds the sampled
        token to its top ``k``; OpenAI lists it only when it is among them)."""
        def one(t, v):
            s = self._text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {"content": [one(t, lp[t]) | {"top_logprobs": [one(u, v) for u, v in
                                                              sorted(lp.items(), key=lambda x: -x[1])[:k]]}
                            for t, lp in zip(ids, lps)]}

    @staticmethod
    def _new_logprobs(c) -> list[dict]:
        """The logprob entries of the tokens ``c`` (a CompletionOutput) added since the previous output."""
        k = len(c.new_token_ids)
        return list(c.logprobs[len(c.logprobs) - k:]) if c.logprobs is not None and k else []

    # ------------------------------------------------------------------ the two endpoints
    async def completions(self, request: Request):
        req = parse_body(CompletionRequest, await request.body())
        self._check_model(req.model)
        params = self._params(req)
        prompts = [(self.tok.encode(p) if isinstance(p, str) else p, None) for p in req.prompt]
        echo = [(p if isinstance(p, str) else self.tok.decode(p)) if req.echo else "" for p in req.prompt]
        stream = await self._submit(req, prompts, params, "cmpl")
        order = {rid: i for i, rid in enumerate(stream.request_ids)}
        head = {"id": stream.request_ids[0].rsplit("-", 1)[0], "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        want_lp = params.logprobs is not None
        n = params.n

        if req.stream:
            sent: dict[int, int] = {}  # choice index -> characters sent (the echo included)

            def chunks(out):
                p = order[out.request_id]
                for c in out.outputs:
                    i = p * n + c.index
                    first = i not in sent
                    pos = len(echo[p]) if first else sent[i]
                    sent[i] = pos + len(c.new_text)
                    text = (echo[p] if first else "") + c.new_text
                    lp = self._completion_logprobs(c.new_token_ids, self._new_logprobs(c), pos) if want_lp else None
                    if text or c.finish_reason or (lp and lp["tokens"]):
                        yield _sse(head | {"choices": [{"index": i, "text": text, "logprobs": lp,
                                                        "finish_reason": c.finish_reason}]})

            return self._sse_response(req, stream, n, chunks, head)

        finals = await self._collect(request, stream, n)
        if finals is None:
            return Response(status_code=CLIENT_GONE)
        t0 = time.perf_counter()
        choices = []
        for out in finals:
            p = order[out.request_id]
            for c in out.outputs:
                lp = self._completion_logprobs(c.token_ids, c.logprobs, len(echo[p])) if want_lp else None
                choices.append({"index": p * n + c.index, "text": echo[p] + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
        body = head | {"choices": choices, "usage": _usage(finals)}
        self._finished(finals, time.perf_counter() - t0)
        return JSONResponse(body)

    async def chat_completions(self, request: Request):
        req = parse_body(ChatCompletionRequest, await request.body())
        self._check_model(req.model)
        ids, media, media_at = self.chat_prompt(req)
        params = self._params(req)
        stream = await self._submit(req, [(ids, media)], params, "chatcmpl", media_at)
        head = {"id": stream.request_ids[0].rsplit("-", 1)[0], "created": int(time.time()),
                "model": self.model_name}
        want_lp = params.logprobs is not None

        if req.stream:
            head = head | {"object": "chat.completion.chunk"}
            started = set()

            def chunks(out):
                for c in out.outputs:
                    if c.index not in started:  # OpenAI's first chunk of a choice carries the role
                        started.add(c.index)
                        yield _sse(head | {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
                    lp = (self._chat_logprobs(c.new_token_ids, self._new_logprobs(c), params.logprobs)
                          if want_lp else None)
                    if c.new_text or c.finish_reason or (lp and lp["content"]):
                        delta = {"content": c.new_text} if c.new_text else {}
                        yield _sse(head | {"choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                                        "finish_reason": c.finish_reason}]})

            return self._sse_response(req, stream, params.n, chunks, head)

        finals = await self._collect(request, stream, params.n)
        if finals is None:
            return Response(status_code=CLIENT_GONE)
        (out,) = finals
        t0 = time.perf_counter()
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs) if want_lp else None,
                    "finish_reason": c.finish_reason} for c in out.outputs]
        body = head | {"object": "chat.completion", "choices": choices, "usage": _usage([out])}
        self._finished([out], time.perf_counter() - t0)
        return JSONResponse(body)

    # ------------------------------------------------------------------ chat prompts
    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], dict, dict[str, list[str]]]:
        """(prompt ids, add_request's media keywords: the image / video data URIs and the audio clips' bytes, the
        field of each such part) of the messages, rendered by the engine with the training processors' chat
        template."""
        messages, media_at = [], {"images": [], "videos": [], "audios": []}
        for i, m in enumerate(req.messages):
            parts = []
            for j, p in enumerate(m.content or []):
                if p.type == "text":
                    parts.append({"type": "text", "text": p.text})
                    continue
                if p.type == "input_audio":
                    at = f"messages[{i}].content[{j}].input_audio"
                    parts.append({"type": "audio", "audio": _audio_bytes(p.input_audio, at)})
                    media_at["audios"].append(at)
                    continue
                at, kind = f"messages[{i}].content[{j}].{p.type}", p.type.split("_")[0]
                url = getattr(p, p.type).url
                if not url.startswith("data:"):
                    raise RequestError(at, f"{at}: give the {kind} inline as a data:{kind}/...;base64 URI (the "
                                       "server fetches no URLs)", "invalid_value")
                parts.append({"type": p.type, p.type: url})
                media_at[f"{kind}s"].append(at)
            # OpenAI's "developer" is the system turn of the chat templates
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": parts})
        ids, images, videos, audios = self.engine.chat_media(messages)
        return ids, {"images": images or None, "videos": videos or None, "audios": audios or None}, media_at

    # ------------------------------------------------------------------ transport
    def _finished(self, outs, post_s: float) -> None:
        for o in outs:
            self.metrics.finished(o, post_s / len(outs))

    async def _collect(self, request: Request, stream: RequestStream, n: int) -> list | None:
        """The final output of each request of ``stream``, in order; None when the client went away first (its
        requests are aborted)."""
        finals = {}

        async def consume():
            async for out in stream:
                if out.finished:
                    finals[out.request_id] = out

        task = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_disconnected(request))
        left = False
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():  # the client went away (or this handler was cancelled)
                left = True
                task.cancel()
                self.metrics.aborted(len(stream.open_ids) * n)
                await stream.aclose()
        if left:
            return None
        try:
            task.result()
        except Exception as e:  # engine.step failed (the step thread logged it and goes on)
            raise HTTPError(500, f"the engine failed: {type(e).__name__}: {e}", None, "engine_error",
                            "server_error") from None
        return [finals[rid] for rid in stream.request_ids]

    def _sse_response(self, req, stream: RequestStream, n: int, chunks: Callable, head: dict) -> StreamingResponse:
        """SSE of ``chunks(out)`` for every engine output, then the usage chunk (``stream_options``) and
        ``[DONE]``. The time spent building chunks is each request's post-processing time."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            post, finals = defaultdict(float), []
            try:
                async for out in stream:
                    t0 = time.perf_counter()
                    part = list(chunks(out))
                    post[out.request_id] += time.perf_counter() - t0
                    if out.finished:
                        finals.append(out)
                        self.metrics.finished(out, post.pop(out.request_id))
                    for s in part:
                        yield s
                if include_usage:
                    yield _sse(head | {"choices": [], "usage": _usage(finals)})
                yield "data: [DONE]\n\n"
            except Exception as e:  # a step failed after the 200 went out: an error event ends the stream
                self.metrics.error(500)
                yield _sse(error_body(f"the engine failed: {type(e).__name__}: {e}", None, "engine_error",
                                      "server_error"))
            finally:
                if not stream.finished:  # the client went away: Starlette cancelled this response
                    self.metrics.aborted(len(stream.open_ids) * n)
                await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _audio_bytes(part, at: str) -> bytes:
    """The file of the input_audio part at ``at``, checked here so that a 400 names the field (whether it decodes
    as audio, the engine says)."""
    try:
        return base64.b64decode(part.data, validate=True)
    except binascii.Error as e:
        raise RequestError(f"{at}.data", f"{at}.data: is not base64 ({e}); give the {part.format} file's bytes in "
                           "base64", "invalid_value") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its http.disconnect message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``; the engine's step thread runs while the app does."""
    srv = OpenAIServer(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.aeng = AsyncEngine(engine, asyncio.get_running_loop())
        try:
            yield
        finally:
            srv.aeng.shutdown()

    app = FastAPI(title="titan_mm", lifespan=lifespan)
    app.state.server = srv

    def error(status: int, message: str, param: str | None, code: str, kind: str) -> JSONResponse:
        srv.metrics.error(status)
        return JSONResponse(error_body(message, param, code, kind), status_code=status,
                            headers={"Retry-After": "1"} if status == 429 else None)

    @app.exception_handler(HTTPError)
    async def _http_error(request, e: HTTPError):
        return error(e.status, e.message, e.param, e.code, e.kind)

    @app.exception_handler(BadRequest)
    async def _bad_request(request, e: BadRequest):
        if isinstance(e, RequestError):  # its message names the field already
            return error(400, e.message, e.field or None, e.code, "invalid_request_error")
        return error(400, str(e), e.field, "invalid_value", "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return error(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error", "server_error")

    app.post("/v1/completions")(srv.completions)
    app.post("/v1/chat/completions")(srv.chat_completions)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": srv.created,
                                            "owned_by": "titan_mm", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if srv.aeng is None or not srv.aeng.alive:
            return JSONResponse({"status": "error", "error": "the engine's step thread is not running"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
