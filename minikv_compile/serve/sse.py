"""A request's deltas on the event loop, streamed as server-sent events or gathered whole."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import Request

from ..scheduler import Delta, Handle
from .errors import ApiError


class _LoopSink:
    """Hands deltas from the scheduler's thread to one event loop, a wake-up per batch.

    The scheduler produces a delta per live request and step; one ``call_soon_threadsafe``
    each (or a thread per request waiting on its handle) would wake the loop and take the GIL
    that often. ``put`` only appends under a lock; the first delta since the loop last drained
    schedules one drain, which feeds every request's queue.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: List[Tuple["asyncio.Queue[Delta]", Delta]] = []

    def put(self, queue: "asyncio.Queue[Delta]", delta: Delta) -> None:
        with self._lock:
            self._pending.append((queue, delta))
            if len(self._pending) > 1:
                return  # a drain is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, delta in pending:
            queue.put_nowait(delta)


class LoopSinks:
    """The sink of the running event loop (made on first use, on that loop)."""

    def __init__(self):
        self._sinks: Dict[asyncio.AbstractEventLoop, _LoopSink] = {}

    def get(self) -> _LoopSink:
        loop = asyncio.get_running_loop()
        if loop not in self._sinks:
            self._sinks[loop] = _LoopSink(loop)
        return self._sinks[loop]


class Deltas:
    """A request's deltas as an async iterator: the scheduler calls ``put`` (its
    ``on_delta``) on its thread, the sink hands them to this request's queue on the loop.
    ``close`` cancels the request unless it has finished (a client that went away).
    """

    def __init__(self, sink: _LoopSink):
        self.handle: Optional[Handle] = None  # set once the scheduler took the request
        self.finished = False
        self._queue: "asyncio.Queue[Delta]" = asyncio.Queue()
        self._sink = sink

    def put(self, delta: Delta) -> None:
        self._sink.put(self._queue, delta)

    async def next(self) -> Delta:
        delta = await self._queue.get()
        self.finished = delta.finish_reason is not None
        return delta

    def close(self) -> None:
        if not self.finished and self.handle is not None:
            self.handle.cancel()


def usage(handle: Handle) -> Dict[str, Any]:
    return {"prompt_tokens": handle.prompt_tokens, "completion_tokens": handle.completion_tokens,
            "total_tokens": handle.prompt_tokens + handle.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": handle.cached_tokens}}


def failure(delta: Delta) -> ApiError:
    if delta.finish_reason == "error":
        return ApiError(500, f"the request failed in the engine: {delta.error}",
                        type="server_error")
    return ApiError(503, "the request was cancelled: the server is shutting down",
                    type="server_error", headers={"Retry-After": "1"})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def whole(request: Request, deltas: Deltas) -> Tuple[str, Optional[Delta]]:
    """All of a request's text and its last delta; (.., None) if the client disconnected
    first (a watcher then cancels the request, which ends at the scheduler's next step)."""

    async def watch() -> None:  # the body is read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass
        deltas.close()

    watcher = asyncio.create_task(watch())
    parts: List[str] = []
    try:
        while True:
            delta = await deltas.next()
            parts.append(delta.text)
            if delta.finish_reason is not None:
                gone = delta.finish_reason == "cancelled" and watcher.done()
                return "".join(parts), None if gone else delta
    finally:
        watcher.cancel()
        deltas.close()


async def stream(deltas: Deltas, head: Dict[str, Any], chat: bool,
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shapes, ``data: [DONE]`` last. Starlette cancels
    this generator when the client disconnects; ``finally`` then cancels the request."""
    extra = {"usage": None} if include_usage else {}

    def chunk(text: Optional[str], reason: Optional[str], role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return _sse({**head, "choices": [choice], **extra})

    try:
        if chat:
            yield chunk(None, None, role=True)
        while True:
            delta = await deltas.next()
            if delta.finish_reason is None:
                yield chunk(delta.text, None)
                continue
            if delta.finish_reason in ("stop", "length"):
                if delta.text:
                    yield chunk(delta.text, None)
                yield chunk(None, delta.finish_reason)
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(deltas.handle)})
            else:
                yield _sse(failure(delta).body())
            yield "data: [DONE]\n\n"
            return
    finally:
        deltas.close()
