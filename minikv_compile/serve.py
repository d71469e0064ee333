"""An OpenAI-compatible HTTP server over the continuous-batching scheduler.

    python -m minikv_compile.serve --model smollm2 [--host 127.0.0.1] [--port 8000] \\
        [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--max-queue 64] \\
        [--compile-cache DIR] \\
        [--max-batch-size 8 --max-prompt-len 4096 --max-new-tokens 256 --bits 4 ...]

``--model`` is a local HF model directory (``AutoModelForCausalLM`` + ``AutoTokenizer``) or
``smollm2`` (the project's SmolLM2-135M-Instruct, ``models.smollm2.load_smollm2``); every
``MiniKVConfig`` field has a flag of its own name (``--heavy-budget``, ``--selection``, ...).
``--compile-cache`` keeps torch.compile's and Triton's artifacts, and the compiled decode step
(``graphs.graph_runner.CompiledPart``), across restarts.
``--tensor-parallel N`` runs under ``torchrun --nproc-per-node N -m minikv_compile.serve ...``:
every rank loads its shard, rank 0 listens and its scheduler drives the others
(``minikv_compile.ranks``).
The server listens at once and warms up in the background (every bucket compiled and captured,
a prompt of ``max_prompt_len`` prefilled: ``Scheduler.warm_up``): ``/health`` answers 503 until
the scheduler is ready, and so do the completion endpoints (with
``Retry-After``).

Endpoints
---------
``POST /v1/completions``       ``prompt``: a string or a list of token ids.
``POST /v1/chat/completions``  ``messages`` through the tokenizer's chat template
                               (``add_generation_prompt=True``).
Both stream with ``"stream": true`` (server-sent events of OpenAI's chunk shapes, then
``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with ``usage``) or answer
once (OpenAI's response shapes, ``usage`` and ``finish_reason``). Fields: ``model`` (the served
name, or absent), ``max_tokens`` (chat: also ``max_completion_tokens``; default the engine's
``max_new_tokens``), ``temperature`` (0 is greedy; default 1, as OpenAI), ``top_p``, ``seed``,
``stop`` (a string or up to 4), ``n`` (1 only), and the extensions ``top_k``,
``repetition_penalty`` and ``minikv: {"heavy_budget": h, "recent_budget": r}`` (this request's
compression budgets, each at most the engine's). ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text format).

Errors
------
OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, the message naming the field,
what was expected and what was given. 400 ``invalid_request_error`` for every bad input,
an unknown ``model`` included (OpenAI answers 404 there; one status for all bad input is
simpler for clients to handle), with ``code`` null; 429 ``rate_limit_error`` with
``Retry-After`` when the scheduler's queue is full; 503 ``server_error`` with ``Retry-After``
before the server is ready; 500 ``server_error`` when a request fails in the engine (the others
go on). A client that disconnects cancels its request: the scheduler frees its slot at the
next step.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import MiniKVConfig
from .inputs import MIN_TEMPERATURE, check_bool, check_float, check_int, eos_ids, sampling_params
from .ranks import follow
from .scheduler import LATENCY_BUCKETS, Delta, Handle, QueueFull, Scheduler, ServeRequest
from minikv_compile.graphs.sampling import Sampling
from minikv_compile.models.parallel import join_torchrun

__all__ = ["create_app", "main", "run_server"]

_log = logging.getLogger("minikv_compile.serve")

_MAX_STOPS = 4  # OpenAI's limit on stop strings
# --tensor-parallel: a collective waiting longer than this for a rank ends the group with an error
# (a stuck rank); above the slowest call one rank makes while another waits, a bucket's compile
# and capture at warm-up, and above the idle rank 0's heartbeat (ranks.HEARTBEAT_S).
RANK_TIMEOUT_S = 600
# Fields a client may send that change nothing when left at their neutral value; any other
# value is refused rather than silently ignored.
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False, 0),
            "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "logit_bias": ({},),
            "suffix": ("",)}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
           "stop", "n", "stream", "stream_options", "minikv", "user"}
_FIELDS = {"completions": _COMMON | {"prompt", "echo", "best_of", "logprobs", "suffix",
                                     "presence_penalty", "frequency_penalty", "logit_bias"},
           "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                              "presence_penalty", "frequency_penalty", "logit_bias"}}


# -- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _checked(param: str, check: Callable, *args, hint: str = "", **kwargs):
    """``check(*args, **kwargs)``, its ``ValueError`` ("param: expected X, got Y") as a 400,
    ``hint`` appended in parentheses."""
    try:
        return check(*args, **kwargs)
    except ValueError as e:
        raise ApiError(400, f"{e} ({hint})" if hint else str(e), param) from None


def _bad(param: str, expected: str, got: Any) -> ApiError:
    shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
    return ApiError(400, f"{param}: expected {expected}, got {shown}", param)


# -- what the server knows of its model ----------------------------------------------------------


@dataclass(frozen=True)
class _Served:
    """The served model's name and the limits every request is checked against."""

    name: str
    vocab_size: int
    eos_ids: Tuple[int, ...]
    max_prompt_len: int
    max_new_tokens: int
    heavy_budget: float
    recent_budget: float


def _model_eos_ids(model, tokenizer, vocab_size: int) -> Tuple[int, ...]:
    """The tokenizer's eos and the model's ``generation_config`` eos (an id or a list), once."""
    found: List[int] = []
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        found += eos_ids(source, vocab_size)
    return tuple(dict.fromkeys(found))


# -- request bodies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parsed:
    request: ServeRequest
    stream: bool
    include_usage: bool


async def _json_body(request: Request) -> Dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"body: expected a JSON object, got invalid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"body: expected a JSON object, got a JSON {type(body).__name__}")
    return body


def _parse(body: Dict[str, Any], served: _Served, kind: str,
           prompt_ids: Callable[[], List[int]]) -> _Parsed:
    """The request of ``body``, every field checked: the fields and the model first, then the
    prompt (``prompt_ids()`` tokenizes and checks it), then the rest."""
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not supported by this server; expected only the "
                            f"fields {sorted(_FIELDS[kind])}", unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise _bad(name, f"{' or '.join(map(repr, neutral))} or null (not implemented)", value)

    model = body.get("model")
    if model is not None and model != served.name:
        raise _bad("model", f"{served.name!r} (the served model; see GET /v1/models)", model)
    prompt = prompt_ids()
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        raise _bad("n", "1 (one completion per request)", n)

    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(name)
    max_tokens = served.max_new_tokens if max_tokens is None else _checked(
        name, check_int, name, max_tokens, lo=1, hi=served.max_new_tokens,
        hint=f"the engine's max_new_tokens is {served.max_new_tokens}")

    sampling = _sampling(body, served.vocab_size)
    stop = _stops(body.get("stop"))
    eos = served.eos_ids
    budgets = _budgets(body.get("minikv"), served)

    stream = body.get("stream")
    stream = False if stream is None else _checked("stream", check_bool, "stream", stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "null unless stream is true", options)
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options", 'an object {"include_usage": true|false}', options)
        value = options.get("include_usage")
        include_usage = value is not None and _checked(
            "stream_options.include_usage", check_bool, "stream_options.include_usage", value)
    request = ServeRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, sampling=sampling,
                           stop=stop, eos_ids=eos, budgets=budgets)
    return _Parsed(request, stream, include_usage)


def _sampling(body: Dict[str, Any], vocab_size: int) -> Sampling:
    """OpenAI's sampling fields (``temperature`` 0 is greedy) through ``inputs.sampling_params``,
    with OpenAI's ranges checked whether or not they take effect."""
    temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    temperature = 1.0 if temperature is None else _checked(
        "temperature", check_float, "temperature", temperature, lo=0.0, hi=2.0)
    if top_p is not None:
        _checked("top_p", check_float, "top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
    if top_k is not None:
        _checked("top_k", check_int, "top_k", top_k, lo=0, hi=vocab_size, hint="0 is off")
    greedy = temperature == 0.0
    if not greedy and temperature < MIN_TEMPERATURE:
        raise _bad("temperature", f"0 (greedy) or a number >= {MIN_TEMPERATURE}", temperature)
    try:
        return sampling_params(do_sample=not greedy, temperature=temperature, top_k=top_k,
                               top_p=top_p, repetition_penalty=body.get("repetition_penalty"),
                               seed=body.get("seed"), vocab_size=vocab_size)
    except ValueError as e:  # its message starts with the field's name
        raise ApiError(400, str(e), str(e).split(":", 1)[0]) from None


def _stops(stop: Any) -> Tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= _MAX_STOPS or any(
            not isinstance(s, str) or not s for s in stops):
        raise _bad("stop", f"a non-empty string or a list of 1..{_MAX_STOPS} non-empty strings",
                   stop)
    return tuple(stops)


def _budgets(minikv: Any, served: _Served) -> Optional[Tuple[float, float]]:
    """The ``minikv`` extension: this request's budgets, each within the engine's."""
    if minikv is None:
        return None
    if not isinstance(minikv, dict) or set(minikv) - {"heavy_budget", "recent_budget"}:
        raise _bad("minikv", 'an object {"heavy_budget": h, "recent_budget": r}', minikv)
    budgets = []
    for name, cap in (("heavy_budget", served.heavy_budget),
                      ("recent_budget", served.recent_budget)):
        value = minikv.get(name)
        param = f"minikv.{name}"
        budgets.append(cap if value is None else _checked(
            param, check_float, param, value, lo=0.0, hi=cap,
            hint=f"at most the engine's {name}"))
    return tuple(budgets)


def _prompt_ids(body: Dict[str, Any], tokenizer, served: _Served) -> List[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "a string or a list of token ids", prompt)
    if isinstance(prompt, str):
        return _fits(_encode("prompt", tokenizer, prompt), "prompt", served)
    if not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
        raise _bad("prompt", "a string or a list of token ids (one prompt)", prompt)
    _fits(prompt, "prompt", served)
    # One pass over plain ints (a per-id check_int took 16 ms for 16k ids on the H100 host).
    bad = next((i for i, t in enumerate(prompt) if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise _bad(f"prompt[{bad}]", f"an int in [0, {served.vocab_size - 1}]", prompt[bad])
    return prompt


def _chat_ids(body: Dict[str, Any], tokenizer, served: _Served) -> List[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", 'a non-empty list of {"role": ..., "content": ...}', messages)
    turns = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(param, 'an object {"role": str, "content": str}', m)
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise _bad(f"{param}.{unknown[0]}", "only role, content and name", m[unknown[0]])
        turns.append({"role": m["role"], "content": _content(f"{param}.content", m.get("content"))})
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "messages: expected a model with a chat template, got a tokenizer "
                            "without one; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own refusal (e.g. roles that do not alternate)
        raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
    ids = _encode("messages", tokenizer, text, add_special_tokens=False)
    return _fits(ids, "messages", served)


def _encode(param: str, tokenizer, text: str, **kwargs) -> List[int]:
    """The tokenizer's ids of ``text``; text it cannot encode (a lone surrogate such as
    "\\ud800", valid in JSON) is bad input, not a server error."""
    try:
        return list(tokenizer(text, **kwargs)["input_ids"])
    except Exception as e:
        raise ApiError(400, f"{param}: expected text the tokenizer can encode, got text it "
                            f"refused ({type(e).__name__}: {e})", param) from None


def _content(param: str, content: Any) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(param, 'a string or a list of {"type": "text", "text": str} parts', content)


def _fits(ids: List[int], param: str, served: _Served) -> List[int]:
    if not 1 <= len(ids) <= served.max_prompt_len:
        raise ApiError(400, f"{param}: expected 1..{served.max_prompt_len} tokens (the engine's "
                            f"max_prompt_len), got {len(ids)} tokens", param)
    return ids


# -- the handle, seen from the event loop --------------------------------------------------------


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


class _LoopSinks:
    """The sink of the running event loop (made on first use, on that loop)."""

    def __init__(self):
        self._sinks: Dict[asyncio.AbstractEventLoop, _LoopSink] = {}

    def get(self) -> _LoopSink:
        loop = asyncio.get_running_loop()
        if loop not in self._sinks:
            self._sinks[loop] = _LoopSink(loop)
        return self._sinks[loop]


class _Deltas:
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


def _usage(handle: Handle) -> Dict[str, int]:
    return {"prompt_tokens": handle.prompt_tokens, "completion_tokens": handle.completion_tokens,
            "total_tokens": handle.prompt_tokens + handle.completion_tokens}


def _failure(delta: Delta) -> ApiError:
    if delta.finish_reason == "error":
        return ApiError(500, f"the request failed in the engine: {delta.error}",
                        type="server_error")
    return ApiError(503, "the request was cancelled: the server is shutting down",
                    type="server_error", headers={"Retry-After": "1"})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- the app -------------------------------------------------------------------------------------


def create_app(scheduler: Scheduler, tokenizer, model_name: str,
               config: MiniKVConfig) -> FastAPI:
    """The FastAPI app serving ``scheduler`` (whose engine was built with ``config``) as
    ``model_name``.

    The caller owns the scheduler's lifecycle: ``warm_up()`` (``/health`` and the completion
    endpoints answer 503 until ``scheduler.ready``), ``start()``, and ``shutdown()`` after the
    server stops. ``main`` does all three around uvicorn.
    """
    engine = scheduler.engine
    vocab = engine.adapter.vocab_size
    served = _Served(name=model_name, vocab_size=vocab,
                     eos_ids=_model_eos_ids(engine.model, tokenizer, vocab),
                     max_prompt_len=config.max_prompt_len, max_new_tokens=config.max_new_tokens,
                     heavy_budget=config.heavy_budget, recent_budget=config.recent_budget)
    created = int(time.time())
    invalid = [0]  # requests answered 400 (the scheduler never saw them)
    sinks = _LoopSinks()
    app = FastAPI(title="minikv_compile", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        if err.status == 400:
            invalid[0] += 1
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):  # a bug: OpenAI's body, not text
        _log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(err).__name__}: {err}",
                        type="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return ApiError(err.status_code, str(err.detail), headers=getattr(err, "headers", None)
                        ).response()

    def submit(body: Dict[str, Any], kind: str, prompt_ids: Callable[[], List[int]],
               deltas: "_Deltas") -> Tuple[_Parsed, Handle]:
        parsed = _parse(body, served, kind, prompt_ids)
        if not scheduler.ready:
            raise ApiError(503, "the server is compiling and capturing its decode steps; "
                                "retry when GET /health answers 200", type="server_error",
                           headers={"Retry-After": "5"})
        try:
            return parsed, scheduler.submit(parsed.request, on_delta=deltas.put)
        except QueueFull as e:
            raise ApiError(429, f"{e} (the server's --max-queue)", type="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(math.ceil(e.retry_after))}) from None
        except RuntimeError as e:  # the loop failed: nothing more is served (see /health)
            raise ApiError(503, str(e), type="server_error") from None

    async def respond(request: Request, kind: str, body: Dict[str, Any],
                      prompt_ids: Callable[[], List[int]]):
        # In a worker thread: tokenizing a 32k-token prompt (~30 ms) or applying a chat template
        # on the event loop would pause every stream for that long (the tokenizer lets go of
        # the GIL).
        deltas = _Deltas(sinks.get())
        parsed, deltas.handle = await run_in_threadpool(submit, body, kind, prompt_ids, deltas)
        chat = kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": served.name}
        if parsed.stream:
            return StreamingResponse(_stream(deltas, head, chat, parsed.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, last = await _whole(request, deltas)
        if last is None:  # the client went away
            return PlainTextResponse("", status_code=499)
        if last.finish_reason not in ("stop", "length"):
            raise _failure(last)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
            head["object"] = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": last.finish_reason}
        return {**head, "choices": [choice], "usage": _usage(deltas.handle)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        return await respond(request, "completions", body,
                             lambda: _prompt_ids(body, tokenizer, served))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        return await respond(request, "chat", body, lambda: _chat_ids(body, tokenizer, served))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": created, "owned_by": "minikv_compile",
            "max_prompt_len": served.max_prompt_len, "max_new_tokens": served.max_new_tokens}]}

    @app.get("/health")
    async def health():
        if scheduler.serving:
            return {"status": "ok"}
        if scheduler.failure is not None:
            return JSONResponse({"status": "failed", "error": scheduler.failure}, status_code=503)
        return JSONResponse({"status": "warming up"}, status_code=503,
                            headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(scheduler, config, invalid[0]),
                                 media_type="text/plain; version=0.0.4")

    return app


async def _whole(request: Request, deltas: _Deltas) -> Tuple[str, Optional[Delta]]:
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


async def _stream(deltas: _Deltas, head: Dict[str, Any], chat: bool,
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
                    yield _sse({**head, "choices": [], "usage": _usage(deltas.handle)})
            else:
                yield _sse(_failure(delta).body())
            yield "data: [DONE]\n\n"
            return
    finally:
        deltas.close()


def _prometheus(scheduler: Scheduler, config: MiniKVConfig, invalid: int) -> str:
    """The scheduler's counters in Prometheus' text exposition format (version 0.0.4)."""
    m = scheduler.metrics
    lines: List[str] = []

    def metric(name: str, kind: str, help_: str, samples: List[Tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value:g}" if isinstance(value, float) else
                     f"{name}{labels} {value}" for labels, value in samples)

    outcomes = {"stop": 0, "length": 0, "cancelled": 0, "error": 0, "rejected": 0,
                **dict(m.requests), "invalid": invalid}
    metric("minikv_requests_total", "counter",
           "Requests by outcome (stop, length, cancelled, error; rejected: queue full; invalid: "
           "answered 400).", [(f'{{outcome="{k}"}}', v) for k, v in sorted(outcomes.items())])
    metric("minikv_prompt_tokens_total", "counter", "Prompt tokens admitted.",
           [("", m.prompt_tokens)])
    metric("minikv_completion_tokens_total", "counter", "Tokens generated.",
           [("", m.completion_tokens)])
    metric("minikv_decode_steps_total", "counter", "Decode steps replayed.", [("", m.steps)])
    metric("minikv_prefill_passes_total", "counter",
           "Prefill passes (each admits one or several waiting prompts).", [("", m.prefills)])
    metric("minikv_queue_depth", "gauge", "Requests waiting for a slot.",
           [("", scheduler.queue_depth)])
    metric("minikv_slots_in_use", "gauge", "Slots holding a request.",
           [("", scheduler.slots_in_use)])
    metric("minikv_slots", "gauge", "Slots in all (max_batch_size).",
           [("", config.max_batch_size)])
    metric("minikv_kv_bytes_in_use", "gauge",
           "KV cache bytes of the running requests (prompt + max_tokens each).",
           [("", scheduler.kv_bytes_in_use())])
    metric("minikv_ready", "gauge", "1 once every bucket is compiled and captured.",
           [("", int(scheduler.ready))])
    runner = scheduler.engine.runtime.runner  # what proves the graphs are replayed, not rebuilt
    metric("minikv_compiled_graphs_total", "counter",
           "Compiled graphs of the decode step run (all before ready; one more while serving "
           "is a recompile).", [("", runner.compiles)])
    metric("minikv_loaded_graphs_total", "counter",
           "Of them, graphs an earlier process compiled and saved (a restart's).",
           [("", runner.loads)])
    metric("minikv_cuda_graphs", "gauge", "CUDA graphs captured, one per (bucket, mode).",
           [("", len(runner.graphs))])
    metric("minikv_cuda_graph_replays_total", "counter", "Decode steps replayed from a CUDA graph.",
           [("", runner.replays)])
    for name, hist, total, help_ in (
            ("minikv_time_to_first_token_seconds", m.ttft, m.ttft_sum,
             "Seconds from submission to the first token."),
            ("minikv_inter_token_latency_seconds", m.itl, m.itl_sum,
             "Seconds between consecutive tokens of a request.")):
        counts, samples, running = list(hist), [], 0
        for bound, count in zip(LATENCY_BUCKETS + (math.inf,), counts):
            running += count
            samples.append((f'_bucket{{le="{"+Inf" if bound == math.inf else f"{bound:g}"}"}}',
                            running))
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        lines.extend(f"{name}{suffix} {value}" for suffix, value in samples)
        lines.extend([f"{name}_sum {total:.6f}", f"{name}_count {running}"])
    return "\n".join(lines) + "\n"


# -- the command line ----------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minikv_compile.serve",
        description="An OpenAI-compatible server (completions and chat, streaming) over a "
                    "MiniKV-compressed, CUDA-graph-replayed engine.")
    p.add_argument("--model", required=True,
                   help="a local HF model directory, or 'smollm2' (SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot at most; past it, 429 (default: 64)")
    sched = p.add_argument_group("Scheduler", "how prompts are admitted between decode steps")
    sched.add_argument("--prefill-ms", type=float, default=50.0, metavar="MS",
                       help="milliseconds of prefill (whole layers, at least one) between two "
                            "decode steps while other requests stream (default: 50)")
    sched.add_argument("--prefill-layers", type=int, default=None, metavar="INT",
                       help="and at most this many layers (default: no limit)")
    sched.add_argument("--prefill-batch-tokens", type=int, default=2048, metavar="INT",
                       help="waiting prompts are prefilled in one pass up to this many tokens "
                            "together (default: 2048)")
    sched.add_argument("--prefill-batch-requests", type=int, default=8, metavar="INT",
                       help="and at most this many prompts a pass (default: 8)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="where torch.compile and Triton keep their compiled artifacts and the "
                        "engine its compiled decode step, so that a restart compiles nothing "
                        "(default: $TORCHINDUCTOR_CACHE_DIR "
                        "if set, else compile/ in the project's cache folder, $MINIKV_CACHE or "
                        "~/.cache/minikv_compile)")
    group = p.add_argument_group("MiniKVConfig", "the engine's fields (see MiniKVConfig)")
    for f in dataclasses.fields(MiniKVConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.default is None:  # Optional[bool]: None lets the engine choose by device
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help="default: on for CUDA, off on the CPU")
        else:
            group.add_argument(flag, dest=f.name, type=type(f.default), default=None,
                               metavar=type(f.default).__name__.upper(),
                               help=f"default: {f.default}")
    return p


def _load(model: str, device: str, dtype: torch.dtype, tensor_parallel: int):
    """(model, tokenizer): ``smollm2`` or a local HF model directory; with several ranks, this
    rank's shard of a directory's checkpoint, read alone (``models.load_shard``)."""
    if model == "smollm2":
        from minikv_compile.models.smollm2 import load_smollm2
        return load_smollm2(dtype=dtype, device=device)
    if not Path(model).is_dir():
        raise ValueError(f"--model: expected a local HF model directory or 'smollm2', got "
                         f"{model!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tensor_parallel > 1:
        from minikv_compile.models import TensorParallel, load_shard
        return load_shard(model, TensorParallel.from_default_group(tensor_parallel), device,
                          dtype), tokenizer
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return hf_model.to(device).eval(), tokenizer


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the flags, build the engine, listen, warm up in the background, serve."""
    from .engine import minikv_compile

    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(MiniKVConfig)
              if getattr(args, f.name) is not None}
    try:
        config = MiniKVConfig(**fields)
        check_int("--max-queue", args.max_queue, lo=1)
        check_int("--port", args.port, lo=0, hi=65535)
        for flag in ("prefill_batch_tokens", "prefill_batch_requests", "prefill_layers"):
            if getattr(args, flag) is not None:  # before the model loads, not after
                check_int("--" + flag.replace("_", "-"), getattr(args, flag), lo=1)
        if not args.prefill_ms > 0:
            raise ValueError(f"--prefill-ms: expected a positive number, got {args.prefill_ms}")
        _use_compile_cache(args.compile_cache)
        if config.tensor_parallel > 1:
            n = config.tensor_parallel
            device = str(join_torchrun(f"--tensor-parallel {n}", n, device.startswith("cuda"),
                                       RANK_TIMEOUT_S))
        model, tokenizer = _load(args.model, device, dtype, config.tensor_parallel)
        engine = minikv_compile(model, config)
        if engine.adapter.tp.rank != 0:  # rank 0 serves; this rank makes its calls
            # torchrun's SIGTERM reaches every rank at once: this one ends when rank 0, shutting
            # down, sends its stop (killed now, it would fail rank 0's last collective)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            follow(engine)
            _leave_ranks(0)
        scheduler = Scheduler(engine, tokenizer, max_queue=args.max_queue,
                              prefill_ms=args.prefill_ms, prefill_layers=args.prefill_layers,
                              prefill_batch_tokens=args.prefill_batch_tokens,
                              prefill_batch_requests=args.prefill_batch_requests)
    except (ValueError, NotImplementedError) as e:
        parser.error(str(e))
    name = args.served_model_name or args.model
    app = create_app(scheduler, tokenizer, name, config)
    status = run_server(app, scheduler, name, args.host, args.port)
    if config.tensor_parallel > 1:
        _leave_ranks(status)
    return status


def _leave_ranks(status: int) -> None:
    """Destroy the process group and exit now, past the interpreter's teardown, where c10d's
    gloo threads abort the process now and then (SIGABRT after all the work is done; seen on ~1
    run in 10 of the CPU tests)."""
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _use_compile_cache(directory: Optional[str]) -> None:
    """Point inductor's and Triton's on-disk caches at ``directory`` (see ``--compile-cache``)
    before anything compiles; both read these variables when they first need their folder."""
    if directory is None:
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            return
        from minikv_compile.models.smollm2 import default_cache_root
        directory = str(default_cache_root() / "compile")
    root = Path(directory).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache: expected a folder that can be created, got "
                         f"{directory!r} ({e.strerror})") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    _log.info("compile cache: %s", root)


def run_server(app: FastAPI, scheduler: Scheduler, name: str, host: str, port: int) -> int:
    """Serve ``app`` (built by ``create_app`` over ``scheduler``) on ``host:port`` until SIGTERM
    or SIGINT: listen at once, compile and capture every bucket in a background thread, then
    start the scheduler's loop; shut the scheduler down when the server stops. Returns 1 when
    the warm-up failed (the server then stops without ever answering ready), else 0."""
    import uvicorn

    engine = scheduler.engine
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                           timeout_graceful_shutdown=5))
    failed: List[BaseException] = []

    def warm_up() -> None:
        try:
            t0 = time.perf_counter()
            scheduler.warm_up()
            scheduler.start()
            _log.info("ready: %s, every bucket %s prepared and a prompt of max_prompt_len "
                      "prefilled in %.1f s", name, engine.runtime.buckets,
                      time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 -- the server must not say ready
            _log.exception("warm-up failed")
            failed.append(e)
            server.should_exit = True

    threading.Thread(target=warm_up, name="minikv-warm-up", daemon=True).start()
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again through the handler
    # found before it: make that an exit through ``finally`` (status 0), not a kill.
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        server.run()
    finally:
        scheduler.shutdown()
    return 1 if failed else 0


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
