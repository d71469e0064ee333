"""``python -m minikv_compile.perf serve-worker``: one backend served over HTTP for ``serve``.

Two backends behind the same streaming ``POST /v1/completions`` (prompt as token ids,
``max_tokens``, greedy, OpenAI's SSE chunks with ``data: [DONE]`` last), ``GET /health`` (503 until
ready), ``GET /metrics`` (how many requests the server still holds: the load generator waits for 0
between runs) and ``GET /info`` (what was built, with the environment of the GPU process):

- ``minikv``: this engine, ``minikv_compile(model, MiniKVConfig(capacity))``, the continuous-
  batching ``Scheduler`` and the project's server (``minikv_compile.serve.create_app`` and
  ``run_server``: listen at once, compile and capture every bucket, then serve);
- ``hf``: HF transformers' own continuous batching, ``model.init_continuous_batching()`` (its
  ``ContinuousBatchingManager``: paged KV cache, its default attention for continuous batching),
  warmed up and started, each request through ``add_request(streaming=True)`` and
  ``register_result_handler``, as ``transformers serve`` drives it, behind a minimal app of
  the same request and chunk shapes.

The model comes from ``perf.harness.build_model`` (random weights of a real shape on the target
device, eos cleared so every request produces exactly ``max_tokens`` tokens; the real SmolLM2
with its own tokenizer, its eos hidden from the server for the same reason). Random shapes have
no tokenizer: ``SyntheticTokenizer`` writes token ``i`` as the word ``" i"``, so the text of a
stream has exactly one word per token.
"""

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

BACKENDS = ("minikv", "hf")
_log = logging.getLogger("minikv_compile.perf.serve_worker")


class SyntheticTokenizer:
    """The text of a random-weight model, which has no tokenizer: token id ``i`` is the word
    ``" i"``. Decoding is exact per token (a stream's text has one word per token), and
    ``__call__`` reads such text back into the ids. No eos, no chat template."""

    eos_token_id = None
    chat_template = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def get_vocab(self) -> Dict[str, int]:
        """Every token's text (the server reads its longest token's length off it)."""
        return {f" {i}": i for i in range(self.vocab)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(i)}" for i in ids)

    def __call__(self, text: str, **kwargs) -> Dict[str, List[int]]:
        words = text.split()
        if not all(w.isdigit() for w in words):
            raise ValueError("prompt: expected space-separated token ids (a random-weight model "
                             f"has no tokenizer), got {text[:40]!r}")
        return {"input_ids": [int(w) for w in words]}


class WithoutEos:
    """A real tokenizer with its eos hidden from the server (``eos_token_id`` is None), so that
    every request runs to ``max_tokens`` as on the random shapes; everything else is the
    tokenizer's own."""

    eos_token_id = None

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __getattr__(self, name: str):
        return getattr(self._tok, name)

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)


def load(shape: str, device, dtype):
    """(model, tokenizer, model facts) for a ``perf.harness`` shape."""
    from . import harness as H

    model = H.build_model(shape, device, dtype)
    if H.SHAPES[shape].real:
        from transformers import AutoTokenizer

        from minikv_compile.models.smollm2 import default_cache_root

        # build_model converted (or found) the copy that holds the tokenizer files too.
        tokenizer = WithoutEos(AutoTokenizer.from_pretrained(
            default_cache_root() / "smollm2-135m-instruct"))
        text = "the model's own tokenizer (eos hidden: every request runs to max_tokens)"
    else:
        tokenizer = SyntheticTokenizer(model.config.vocab_size)
        text = "synthetic: token i is the word ' i' (random weights have no tokenizer)"
    facts = {"name": shape, "description": H.SHAPES[shape].description, **H.model_summary(model),
             "tokenizer": text, "synthetic_text": not H.SHAPES[shape].real}
    return model, tokenizer, facts


# -- the minikv backend -----------------------------------------------------------------------


def minikv_config(args):
    """The engine's config: the library's default, or ``MiniKVConfig.preset(args.preset)``, with
    the workload's capacity (and on random weights the resync off: ``harness.shape_fields``)."""
    from minikv_compile import MiniKVConfig

    from . import harness as H

    capacity = dict(max_batch_size=args.max_batch_size, max_prompt_len=args.max_prompt_len,
                    max_new_tokens=args.max_new_tokens)
    return MiniKVConfig.preset(args.preset, **H.shape_fields(args.model), **capacity)


def serve_minikv(model, tokenizer, facts: Dict[str, Any], args, environment) -> int:
    from minikv_compile import minikv_compile
    from minikv_compile.scheduler import Scheduler
    from minikv_compile.serve import create_app, run_server

    config = minikv_config(args)
    t0 = time.perf_counter()
    engine = minikv_compile(model, config)
    build_s = time.perf_counter() - t0
    facts["stamps"]["engine"] = time.time()
    scheduler = Scheduler(engine, tokenizer, max_queue=args.max_queue, prefill_ms=args.prefill_ms,
                          prefix_cache_gpu_bytes=args.prefix_cache_gpu_bytes)
    app = create_app(scheduler, tokenizer, args.model, config)
    kv = engine.kv_memory()

    @app.get("/info")
    async def info():
        stats = engine.stats
        return {"backend": "minikv", "model": facts, "environment": environment,
                "ready": scheduler.ready,
                "config": dataclasses.asdict(config), "max_queue": args.max_queue,
                "buckets": list(engine.runtime.buckets), "kv_bytes": kv.total_bytes,
                "kv_fp16_bytes": kv.fp16_bytes, "engine_build_s": build_s,
                "compile_s": sum(stats["compile_seconds"].values()) or None,
                "capture_s": sum(stats["capture_seconds"].values()) or None,
                "graphs": len(stats["graphs"]), "compiles": stats["compiles"],
                "prefill_ms": scheduler.prefill_ms, "prefill_layers": scheduler.prefill_layers,
                "prefix_cache_gpu_bytes": scheduler.pool.gpu_bytes}

    return run_server(app, scheduler, args.model, args.host, args.port)


# -- the HF backend -------------------------------------------------------------------------


class HFServer:
    """HF's ``ContinuousBatchingManager`` over ``model``, with its defaults: the continuous
    batching config it resolves by itself (given the capacity as ``WorkloadHints``: the longest
    prompt and output a request may have, which this server enforces), and the attention it
    switches the model to for continuous batching.

    Off CUDA the paged cache is sized from the server's limits instead (``cpu_cache_config``):
    HF's own rule sizes it from host RAM, for a CPU run that only checks the plumbing."""

    def __init__(self, model, tokenizer, args):
        from transformers import GenerationConfig

        self.model, self.tok, self.args = model, tokenizer, args
        # eos -1: none (build_model cleared the model's), so every request runs to max_tokens.
        gen = GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens,
                               eos_token_id=-1, pad_token_id=0)
        kwargs = {}
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints

            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=args.max_prompt_len,
                                                     max_generated_length=args.max_new_tokens)
        except ImportError:  # a transformers without hints: its fallbacks
            pass
        if model.device.type != "cuda":
            kwargs["continuous_batching_config"] = cpu_cache_config(args)
        self.attn_before = model.config._attn_implementation
        self.manager = model.init_continuous_batching(generation_config=gen, **kwargs)
        self.hints = ("capacity as WorkloadHints" if "workload_hints" in kwargs
                      else "none (not in this transformers)")
        self.ready = False
        self.failure: Optional[str] = None
        self.warm_s: Optional[float] = None

    def warm_up(self) -> None:
        """``warmup()`` (allocates the paged cache, captures what HF's config captures), then
        ``start()`` the generation thread, as ``continuous_batching_context_manager`` does."""
        try:
            t0 = time.perf_counter()
            self.manager.warmup()
            self.manager.start()
            self.warm_s = time.perf_counter() - t0
            self.ready = True
            _log.info("ready: HF continuous batching, warm-up and start %.1f s", self.warm_s)
        except Exception as e:  # noqa: BLE001 -- reported by /health
            _log.exception("HF warm-up failed")
            self.failure = f"{type(e).__name__}: {e}"

    def fatal(self) -> Optional[str]:
        status = getattr(self.manager, "background_thread_status", None)
        error = getattr(status, "fatal_error", None)
        return self.failure or (None if error is None else str(error))

    def in_flight(self) -> int:
        """Requests the manager still holds: queued, waiting, active."""
        n = self.manager.input_queue.qsize()
        processor = self.manager.batch_processor
        scheduler = getattr(processor, "scheduler", None)
        for name in ("waiting_requests", "active_requests"):
            n += len(getattr(scheduler, name, None) or ())
        return n

    def info(self) -> Dict[str, Any]:
        """The attention HF chose and its continuous-batching config as resolved once the paged
        cache exists (number and size of the blocks, batch tokens, CUDA graphs, async)."""
        cb = self.manager.continuous_batching_config
        return {"attn_implementation_loaded": self.attn_before,
                "attn_implementation": self.model.config._attn_implementation,
                "continuous_batching_config": {f.name: _plain(getattr(cb, f.name))
                                               for f in dataclasses.fields(cb)},
                "workload_hints": self.hints, "warm_up_s": self.warm_s}


def cpu_cache_config(args):
    """HF's ``ContinuousBatchingConfig`` for a CPU server: a cache of ``max_batch_size`` requests
    of the longest length (``max_prompt_len + max_new_tokens`` tokens, whole pages) and batches of
    ``max_prompt_len + max_batch_size`` tokens (the longest prompt beside a decode token of every
    other request). HF's own rule takes 0.6 of host RAM for 8192 batch tokens and fills their
    fp32 attention mask at start-up (tiny shape, 2-core machine: 14.7 GB, 15-24 s; here 0.01 s)."""
    from transformers import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size
    pages = -(-(args.max_prompt_len + args.max_new_tokens) // page)
    return ContinuousBatchingConfig(num_blocks=args.max_batch_size * pages,
                                    max_batch_tokens=args.max_prompt_len + args.max_batch_size)


def _plain(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def hf_app(server: HFServer, facts: Dict[str, Any], environment, args):
    """The minimal FastAPI app: streaming ``/v1/completions`` over the manager."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from minikv_compile.scheduler import IncrementalDetokenizer

    app = FastAPI(title="HF continuous batching", docs_url=None, redoc_url=None)
    vocab = server.model.config.vocab_size
    name = args.model

    def error(status: int, message: str, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                       "code": None}}, status_code=status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(400, f"body: expected a JSON object, got invalid JSON ({e})")
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens", args.max_new_tokens)
        if not (isinstance(prompt, list) and 1 <= len(prompt) <= args.max_prompt_len
                and all(type(t) is int and 0 <= t < vocab for t in prompt)):
            return error(400, f"prompt: expected 1..{args.max_prompt_len} token ids in "
                              f"[0, {vocab}), got {str(prompt)[:60]}")
        if not (type(max_tokens) is int and 1 <= max_tokens <= args.max_new_tokens):
            return error(400, f"max_tokens: expected 1..{args.max_new_tokens}, got {max_tokens!r}")
        if body.get("stream") is not True:
            return error(400, "stream: expected true (this benchmark server only streams)")
        if body.get("temperature", 0) not in (0, 0.0):
            return error(400, "temperature: expected 0 (greedy: the manager's GenerationConfig)")
        if not server.ready or server.fatal():
            return error(503, f"not ready: {server.fatal() or 'warming up'}", "server_error")
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        rid = f"cmpl-{uuid.uuid4().hex}"
        outputs: "asyncio.Queue" = asyncio.Queue()
        # The handler first, then the request: its first output cannot arrive unrouted.
        server.manager.register_result_handler(rid, outputs.put_nowait)
        server.manager.add_request(list(prompt), request_id=rid, max_new_tokens=max_tokens,
                                   streaming=True)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name}
        return StreamingResponse(_stream(server, rid, outputs, head, prompt, max_tokens, usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _stream(server, rid, outputs, head, prompt, max_tokens, usage):
        detok = IncrementalDetokenizer(server.tok, prompt)
        seen, text, sent, finished = 0, "", 0, False

        def chunk(piece: str, reason: Optional[str]) -> str:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
            return _sse({**head, "choices": [choice], **({"usage": None} if usage else {})})

        try:
            while True:
                out = await outputs.get()
                if out.error is not None:
                    finished = True
                    yield _sse({"error": {"message": f"the request failed in HF: {out.error}",
                                          "type": "server_error", "param": None, "code": None}})
                    yield "data: [DONE]\n\n"
                    return
                tokens = list(out.generated_tokens)
                for token in tokens[seen:]:
                    text += detok.push(token)
                seen = len(tokens)
                if out.is_finished():
                    finished = True
                    if text[sent:]:
                        yield chunk(text[sent:], None)
                    yield chunk("", "length" if seen >= max_tokens else "stop")
                    if usage:
                        yield _sse({**head, "choices": [], "usage": {
                            "prompt_tokens": len(prompt), "completion_tokens": seen,
                            "total_tokens": len(prompt) + seen}})
                    yield "data: [DONE]\n\n"
                    return
                if len(text) > sent:
                    yield chunk(text[sent:], None)
                    sent = len(text)
        finally:
            if not finished:  # the client went away: free the request's pages
                server.manager.cancel_request(rid)

    @app.get("/health")
    async def health():
        if server.fatal():
            return JSONResponse({"status": "failed", "error": server.fatal()}, status_code=503)
        if not server.ready:
            return JSONResponse({"status": "warming up"}, status_code=503,
                                headers={"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(f"hf_requests_in_flight {server.in_flight()}\n")

    @app.get("/info")
    async def info():
        return {"backend": "hf", "model": facts, "environment": environment,
                "ready": server.ready, "max_prompt_len": args.max_prompt_len,
                "max_new_tokens": args.max_new_tokens, **server.info()}

    return app


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def serve_hf(model, tokenizer, facts, args, environment) -> int:
    import uvicorn

    from minikv_compile.serve.server import exit_quietly

    server = HFServer(model, tokenizer, args)
    app = hf_app(server, facts, environment, args)
    uv = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                       timeout_graceful_shutdown=5))
    threading.Thread(target=server.warm_up, name="hf-warm-up", daemon=True).start()
    signal.signal(signal.SIGTERM, exit_quietly)
    try:
        uv.run()
    finally:
        if server.manager.is_running():
            server.manager.stop(block=True, timeout=10)
    return 1 if server.failure else 0


# -- the command ------------------------------------------------------------------------------


def add_parser(sub) -> argparse.ArgumentParser:
    from minikv_compile.config import PRESETS

    from .argtypes import nonneg_int, positive_float, positive_int
    from .serve_bench import MODELS

    # allow_abbrev=False: its --data-parallel front rewrites the replicas' flags by full name
    p = sub.add_parser("serve-worker", help="serve one backend over HTTP (started by 'serve')",
                       description="Serve one backend (this engine, or HF continuous batching) "
                                   "over HTTP for the serving benchmark.", allow_abbrev=False)
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive_int, required=True)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--max-batch-size", type=positive_int, default=64,
                   help="minikv: slots (MiniKVConfig.max_batch_size); HF batches by its own rule "
                        "(off CUDA: its cache holds this many requests of the longest length)")
    p.add_argument("--max-prompt-len", type=positive_int, default=32768,
                   help="the longest prompt accepted (both backends)")
    p.add_argument("--max-new-tokens", type=positive_int, default=512,
                   help="the largest max_tokens accepted (both backends)")
    p.add_argument("--max-queue", type=positive_int, default=1024,
                   help="minikv: waiting requests at most before 429 (HF's queue is unbounded)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="minikv: MiniKVConfig.preset(NAME) instead of the library's default config")
    p.add_argument("--prefix-cache-gpu-bytes", type=nonneg_int, default=0,
                   help="minikv: device bytes of the prefix cache (0: off; phase reuse)")
    p.add_argument("--prefill-ms", type=positive_float, default=50.0,
                   help="minikv: ms of prefill between two decode steps while others stream")
    p.add_argument("--data-parallel", type=positive_int, default=1,
                   help="minikv: this many workers, one GPU each, behind one front "
                        "(minikv_compile.serve.replicas)")
    return p


def main(args) -> int:
    # wall-clock seconds at the end of the start-up's stages, in /info ("main": python and the
    # imports, done before main is called)
    stamps = {"main": time.time()}
    import torch
    import transformers

    from . import measure as M

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    transformers.utils.logging.set_verbosity_warning()
    if args.data_parallel > 1:  # this process is the front alone, each replica a worker
        from minikv_compile.serve.replicas import plan_replicas, serve_front
        if args.backend != "minikv":
            print("serve-worker: --data-parallel: expected --backend minikv", file=sys.stderr)
            return 2
        on_gpu = args.device != "cpu" and torch.cuda.is_available()
        argv = sys.argv[sys.argv.index("serve-worker") + 1:]
        try:
            replicas = plan_replicas(argv, args.data_parallel, 1, "cuda" if on_gpu else "cpu",
                                     module=("minikv_compile.perf", "serve-worker"),
                                     slots=args.max_batch_size)  # affinity while one is free
        except ValueError as e:
            print(f"serve-worker: {e}", file=sys.stderr)
            return 2
        return serve_front(replicas, args.host, args.port)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("serve-worker: --device cuda: no CUDA device is available here", file=sys.stderr)
        return 2
    on_gpu = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if not on_gpu:
        torch.set_num_threads(1)  # tiny CPU shapes: intra-op threads only contend with the client
    dtype = torch.bfloat16 if on_gpu else torch.float32
    t0 = time.perf_counter()
    model, tokenizer, facts = load(args.model, device, dtype)
    facts["build_s"] = time.perf_counter() - t0
    stamps["model"] = time.time()
    environment = M.environment(device)
    stamps["environment"] = time.time()
    facts["stamps"] = stamps
    serve = serve_minikv if args.backend == "minikv" else serve_hf
    return serve(model, tokenizer, facts, args, environment)
