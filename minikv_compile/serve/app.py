"""The FastAPI app: the OpenAI routes, ``/health`` and ``/metrics`` over one scheduler."""
from __future__ import annotations

import math
import time
import uuid
from typing import Any, Callable, Dict, List, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..config import MiniKVConfig
from ..scheduler import Handle, QueueFull, Scheduler
from .errors import ApiError
from .parse import (Parsed, Served, body_limit, chat_ids, json_body, model_eos_ids, parse,
                    prompt_ids, tokenizer_facts)
from .prometheus import render
from .security import ServeOptions, install_door
from .sse import Deltas, LoopSinks, failure, stream, usage, whole



def create_app(scheduler: Scheduler, tokenizer, model_name: str, config: MiniKVConfig,
               options: ServeOptions = ServeOptions()) -> FastAPI:
    """The FastAPI app serving ``scheduler`` (whose engine was built with ``config``) as
    ``model_name``, behind the door ``options`` describes (``security.Guard``; CORS for
    ``options.allowed_origins``). Neither ``/docs`` nor ``/openapi.json`` is served.

    The caller owns the scheduler's lifecycle: ``warm_up()`` (``/health`` and the completion
    endpoints answer 503 until ``scheduler.ready``), ``start()``, and ``shutdown()`` after the
    server stops. ``main`` does all three around uvicorn.
    """
    engine = scheduler.engine
    vocab = engine.adapter.vocab_size
    longest, special = tokenizer_facts(tokenizer)
    served = Served(name=model_name, vocab_size=vocab,
                    eos_ids=model_eos_ids(engine.model, tokenizer, vocab),
                    max_prompt_len=config.max_prompt_len, max_new_tokens=config.max_new_tokens,
                    heavy_budget=config.heavy_budget, recent_budget=config.recent_budget,
                    longest_token=longest, special_texts=special,
                    parse_special_tokens=options.parse_special_tokens)
    limit = options.max_body_bytes or body_limit(served)
    created = int(time.time())
    counts = {"invalid": 0}  # requests answered 4xx (the scheduler never saw them)
    sinks = LoopSinks()
    app = FastAPI(title="minikv_compile", docs_url=None, redoc_url=None, openapi_url=None)
    install_door(app, options, counts)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):  # a bug: OpenAI's body, not text
        # Starlette raises the error again after this answer, and uvicorn logs its traceback:
        # logging it here too printed it twice.
        return ApiError(500, f"internal error: {type(err).__name__}: {err}",
                        type="server_error").response()

    def submit(body: Dict[str, Any], kind: str, prompt_ids: Callable[[], List[int]],
               deltas: "Deltas") -> Tuple[Parsed, Handle]:
        parsed = parse(body, served, kind, prompt_ids)
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
        deltas = Deltas(sinks.get())
        parsed, deltas.handle = await run_in_threadpool(submit, body, kind, prompt_ids, deltas)
        chat = kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": served.name}
        if parsed.stream:
            return StreamingResponse(stream(deltas, head, chat, parsed.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, last = await whole(request, deltas)
        if last is None:  # the client went away
            return PlainTextResponse("", status_code=499)
        if last.finish_reason not in ("stop", "length"):
            raise failure(last)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
            head["object"] = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": last.finish_reason}
        return {**head, "choices": [choice], "usage": usage(deltas.handle)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request, limit, options.read_timeout)
        return await respond(request, "completions", body,
                             lambda: prompt_ids(body, tokenizer, served))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request, limit, options.read_timeout)
        return await respond(request, "chat", body, lambda: chat_ids(body, tokenizer, served))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": created, "owned_by": "minikv_compile",
            "max_prompt_len": served.max_prompt_len, "max_new_tokens": served.max_new_tokens,
            "max_body_bytes": limit}]}

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
        return PlainTextResponse(render(scheduler, config, counts["invalid"]),
                                 media_type="text/plain; version=0.0.4")

    return app
