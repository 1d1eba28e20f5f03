"""The engine under asyncio: one background thread runs ``engine.step()``; each request's outputs reach its
coroutine through an asyncio queue (``loop.call_soon_threadsafe``).

    aeng = AsyncEngine(engine)                      # starts the step thread
    stream = aeng.submit([(rid, prompt_ids, params, {"images": images, "videos": videos})],
                         priority=0, deadline_s=None)       # BadRequest / QueueFull now
    async for out in stream:                        # RequestOutputs of the stream's requests, until all finish
        ...
    await stream.aclose()                           # aborts what is unfinished (client gone) and frees its blocks
    aeng.shutdown()

``Engine.add_request`` / ``Engine.abort`` are thread-safe; ``Engine.step`` runs only in the step thread. The thread
sleeps on an event while the engine has nothing to do. An exception in ``step`` ends every open stream with that
exception (the server answers 500) and the thread keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one or more engine requests (a completions call with several prompts is one stream)."""

    def __init__(self, owner: AsyncEngine, request_ids: list[str]):
        self._owner = owner
        self.request_ids = request_ids
        self._open = set(request_ids)
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._open:
            raise StopAsyncIteration
        out = await self._queue.get()
        if isinstance(out, BaseException):
            self._open.clear()
            raise out
        if out.finished:
            self._open.discard(out.request_id)
        return out

    @property
    def finished(self) -> bool:
        return not self._open

    @property
    def open_ids(self) -> list[str]:
        """The requests still running."""
        return sorted(self._open)

    async def aclose(self) -> None:
        """Abort the requests that have not finished (idempotent)."""
        for rid in list(self._open):
            self._owner.abort(rid)
        self._open.clear()
        self._owner._forget(self)


class AsyncEngine:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop | None = None):
        self.engine = engine
        self._loop = loop
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams between the event loop and the step thread
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None  # the last step failure (/health reports it)
        self._thread = threading.Thread(target=self._run, name="titan_mm-engine-step", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, requests: Sequence[tuple[str, list[int], Any, Any]], *, priority: int = 0,
               deadline_s: float | None = None) -> RequestStream:
        """Add ``(request_id, prompt_ids, params, media)`` requests as one stream (``media``: add_request's
        ``images`` / ``videos`` keywords, or None); call from the event loop.
        If one is refused (BadRequest / QueueFull), the ones already added are aborted and the error raised."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        stream = RequestStream(self, [r[0] for r in requests])
        added = []
        try:
            for rid, ids, params, media in requests:
                with self._lock:
                    self._streams[rid] = stream
                added.append(rid)
                self.engine.add_request(rid, ids, params, **(media or {}), priority=priority, deadline_s=deadline_s)
        except BaseException:
            for rid in added[:-1]:
                self.engine.abort(rid)
            self._forget(stream)
            raise
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()  # the step thread frees its blocks on the next step

    def _forget(self, stream: RequestStream) -> None:
        with self._lock:
            for rid in stream.request_ids:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]

    def _deliver(self, stream: RequestStream, item) -> None:
        self._loop.call_soon_threadsafe(stream._queue.put_nowait, item)

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # an engine bug must not hang the clients: fail their streams, keep serving
                log.exception("engine.step failed; failing the open requests")
                self.error = e
                with self._lock:
                    open_streams = {id(s): s for s in self._streams.values()}.values()
                    rids = list(self._streams)
                    self._streams.clear()
                for rid in rids:
                    self.engine.abort(rid)
                for s in open_streams:
                    self._deliver(s, e)
                continue
            with self._lock:
                targets = [(self._streams.get(o.request_id), o) for o in outs]
                for o in outs:
                    if o.finished:
                        self._streams.pop(o.request_id, None)
            for stream, o in targets:
                if stream is not None:
                    self._deliver(stream, o)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
