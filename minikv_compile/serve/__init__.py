"""An OpenAI-compatible HTTP server over the continuous-batching scheduler.

    python -m minikv_compile.serve --model smollm2 [--host 127.0.0.1] [--port 8000] \\
        [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--max-queue 64] \\
        [--compile-cache DIR] [--api-key KEY] [--ssl-keyfile PEM --ssl-certfile PEM] \\
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

The door (``security``, ``parse``, ``server``): bound to 127.0.0.1 by default; ``--api-key``
(or ``$MINIKV_API_KEY``) on ``/v1/*``; ``--allowed-origins`` (CORS, none by default) and
``Content-Type: application/json`` on POST; the ``Host`` header checked against the bound
address and ``--allowed-hosts``; a body past ``--max-body-bytes`` answered 413 unread, a prompt
with more characters than ``max_prompt_len`` tokens can hold refused before it is tokenized;
``--request-read-timeout`` and ``--timeout-keep-alive`` close stalled and idle connections;
special-token text in chat messages tokenized as text unless ``--parse-special-tokens``; a
compile cache other users can write refused; no ``/docs`` nor ``/openapi.json``.

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
what was expected and what was given. 401 (``invalid_api_key``) without the key, 403 for an
origin not allowed, 408 for a body not sent in time, 413 for a body too large, 415 for a POST
that is not JSON (each of these and every 400 counted ``invalid`` in ``/metrics``).
400 ``invalid_request_error`` for every bad input,
an unknown ``model`` included (OpenAI answers 404 there; one status for all bad input is
simpler for clients to handle), with ``code`` null; 429 ``rate_limit_error`` with
``Retry-After`` when the scheduler's queue is full; 503 ``server_error`` with ``Retry-After``
before the server is ready; 500 ``server_error`` when a request fails in the engine (the others
go on). A client that disconnects cancels its request: the scheduler frees its slot at the
next step.
"""
from .app import create_app
from .cli import main
from .server import run_server

__all__ = ["create_app", "main", "run_server"]
