"""--data-parallel N: N engine replicas, each a server process on its own GPUs, behind one front.

::

    clients --HTTP--> front (this process: no model, no GPU)
                        |  each request to the replica that served a prompt starting it, else
                        |  the ready one with the fewest prompt tokens waiting for their first
                        |  token, then the fewest requests in flight (the front counts both),
                        |  over HTTP on loopback, streamed back
                        v
              replica i: python -m minikv_compile.serve <the same flags> --port P_i
                         (CUDA_VISIBLE_DEVICES: its M GPUs; under torchrun when M =
                         --tensor-parallel > 1)

A replica is an ordinary server: its own scheduler, slots, queue and compiled steps. The front
routes by load: among the replicas with a free slot, the one with the fewest prompt tokens it
sent there that have not begun to stream (the prefill ahead of a new request, what its time to
first token waits for), then the fewest in flight (ties go round the replicas); with affinity
for prefix reuse: a request whose prompt starts with one the front sent to replica i (same
cache salt and budgets; ``affinity.py`` says what it keys on) goes to i, whose pool keeps that
context, unless i is full, or the prompt tokens ahead of it, less what the kept context saves,
outnumber those ahead of the least loaded (see ``Replicas.pick``). ``/health`` is 200 once every
replica is ready (503 while any is starting), and stays 200 while at least one serves after
others died, saying which (``"degraded"``); ``/metrics`` gives every replica's samples with a
``replica`` label, their sum without it, and the front's own (replica up, in flight, routed,
failed, sent by affinity; affinity entries and yields; a dead replica's counters as they last
were, its gauges dropped). A replica that dies fails only the requests it held: a stream gets
an error event naming it, then ``[DONE]``; a whole answer a 502; a request whose connection to
it was refused (never sent) goes to another replica. A replica whose engine failed while its
process runs (its ``/health`` says ``"failed"``) is stopped and counts as dead. The front serves
on the others and never restarts it.

The front is the server's door: the single server's checks (``security.Guard``: Host, Origin,
API key, JSON content type), CORS, ``--max-body-bytes`` (a larger body is answered 413 before it
is read whole; by default the replicas' own limit, read from their ``/v1/models``), the read
timeouts and TLS (``--ssl-keyfile``/``--ssl-certfile``: the front serves HTTPS, the replicas
plain HTTP on loopback). The replicas check the same again (the client's headers go along).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .affinity import Affinity, route_of
from .errors import ApiError
from .parse import parse_json, read_body
from .security import ServeOptions, install_door

_log = logging.getLogger("minikv_compile.serve.replicas")

# How often the front polls each replica's process and its /health (starting: ready yet?
# ready: has its engine failed?).
POLL_S = 0.5
# A replica's /metrics must answer within this for the front's /metrics (else its last scrape).
SCRAPE_TIMEOUT_S = 5.0
# The body limit where the replicas publish none (the benchmark's worker has no /v1/models):
# 16x the server's default for SmolLM2 at its 32k-token max_prompt_len (~4 MB).
FALLBACK_BODY_BYTES = 64 << 20


@dataclass
class Replica:
    """One replica process and what the front knows of it."""

    index: int
    argv: List[str]
    env: Dict[str, str]
    port: int
    proc: Optional[subprocess.Popen] = None
    state: str = "starting"                 # starting | ready | dead
    exit_status: Optional[int] = None
    failure: Optional[str] = None           # its engine's error, where that ended it
    in_flight: int = 0
    pending: int = 0                        # prompt tokens of its requests yet to stream
    routed: int = 0                         # requests sent to it
    failed: int = 0                         # of them, cut by its death
    affine: int = 0                         # of them, sent by affinity (it served their prefix)
    max_body_bytes: Optional[int] = None    # its limit, from its /v1/models once ready
    last_metrics: Optional[str] = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def why(self) -> str:
        """Why a dead replica is out of service."""
        if self.failure is not None:
            return f"its engine failed: {self.failure}"
        return f"exit status {self.exit_status}"

    def describe(self) -> Dict[str, object]:
        return {"replica": self.index, "state": self.state, "port": self.port,
                "pid": self.proc.pid if self.proc else None, "exit_status": self.exit_status,
                "failure": self.failure,
                "in_flight": self.in_flight, "pending": self.pending, "routed": self.routed,
                "failed": self.failed, "affine": self.affine,
                "gpus": self.env.get("CUDA_VISIBLE_DEVICES")}


def _failure(reply) -> Optional[str]:
    """The engine's error where a replica's ``/health`` answer says it failed, else None."""
    try:
        said = reply.json()
    except ValueError:
        return None
    if isinstance(said, dict) and said.get("status") == "failed":
        return str(said.get("error") or "no error given")
    return None


def _die_with_parent() -> None:  # (the child, before exec) a front killed outright takes these along
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Replicas:
    """The replica processes: started together, watched by a thread (a process that ended is
    ``dead``; one whose ``/health`` answers 200 is ``ready``; one whose ``/health`` says its
    engine failed is stopped and ``dead``), chosen by affinity and load, stopped together.

    slots: each replica's ``max_batch_size``. api_key: the key the watcher's ``/v1/models``
    carries (the replicas' ``--api-key``)."""

    def __init__(self, replicas: Sequence[Replica], slots: int = 1,
                 api_key: Optional[str] = None):
        self.replicas = list(replicas)
        self.slots = slots
        self.affinity = Affinity()
        self.yielded = 0  # requests with an affine replica, sent elsewhere by load
        self._auth = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._turn = itertools.count()
        self._stopping = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start every replica (its output is this process's, as under torchrun), then the
        thread that watches them."""
        for r in self.replicas:
            r.proc = subprocess.Popen(r.argv, env=r.env, preexec_fn=_die_with_parent)
            _log.info("replica %d: pid %d, port %d, GPUs %s", r.index, r.proc.pid, r.port,
                      r.env.get("CUDA_VISIBLE_DEVICES", "-"))
        self._watcher = threading.Thread(target=self._watch, name="minikv-replicas", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        import httpx

        with httpx.Client(timeout=2.0) as client:
            while not self._stopping.is_set():
                for r in self.replicas:
                    if not self.check(r):
                        continue
                    try:  # (no answer in time: no news; only the replica's word changes it)
                        reply = client.get(r.url + "/health")
                        if r.state == "starting" and reply.status_code == 200:
                            r.max_body_bytes = self._body_limit(client, r)
                            r.state = "ready"
                            _log.info("replica %d: ready", r.index)
                        elif reply.status_code == 503:
                            error = _failure(reply)
                            if error is not None:
                                self.fail(r, error)
                    except httpx.TransportError:
                        pass
                    except Exception:  # noqa: BLE001 -- the watcher outlives a bad answer
                        _log.exception("replica %d: its /health answer could not be read",
                                       r.index)
                self._stopping.wait(POLL_S)

    def _body_limit(self, client, r: Replica) -> Optional[int]:
        """The body limit ``r``'s ``/v1/models`` gives, None where it gives none (the
        benchmark's worker)."""
        reply = client.get(r.url + "/v1/models", headers=self._auth)
        try:
            limit = reply.json()["data"][0]["max_body_bytes"] if reply.status_code == 200 else None
        except (ValueError, KeyError, IndexError, TypeError):
            limit = None
        if type(limit) is int and limit > 0:
            return limit
        _log.warning("replica %d: /v1/models gave no body limit (HTTP %d); the front takes "
                     "%d bytes", r.index, reply.status_code, FALLBACK_BODY_BYTES)
        return None

    def fail(self, r: Replica, error: str) -> None:
        """``r``'s engine failed while its process runs: out of service as if it had died, and
        stopped (it would hold its GPUs and answer every request 503)."""
        r.failure, r.state = error, "dead"
        self.affinity.forget_replica(r.index)
        _log.error("replica %d: its engine failed (%s): stopped; the front serves on the "
                   "others", r.index, error)
        if r.proc is not None and r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)

    def check(self, r: Replica) -> bool:
        """Whether ``r`` is still running; marks it dead (with its exit status) if not."""
        if r.state != "dead" and r.proc is not None and r.proc.poll() is not None:
            r.state, r.exit_status = "dead", r.proc.returncode
            self.affinity.forget_replica(r.index)  # its pool went with it
            if not self._stopping.is_set():
                _log.error("replica %d (pid %d) exited with status %s: the front serves on "
                           "the others", r.index, r.proc.pid, r.exit_status)
        return r.state != "dead"

    def pick(self, prefer: Optional[int] = None, cached: int = 0,
             exclude: frozenset = frozenset()) -> Replica:
        """The replica for a request: replica ``prefer`` (affinity: it served a prompt starting
        this one, ``cached`` of whose tokens it keeps) while it is ready, has a free slot (fewer
        than ``slots`` in flight, or all are full and none has fewer) and no more prompt tokens
        ahead, less ``cached``, than the least loaded; else, among the ready replicas with a
        free slot (all of them where none has one), the fewest prompt tokens ahead, then the
        fewest in flight (ties in turn); never one in ``exclude`` (indices: replicas that
        refused this request's connection). ``ApiError`` 503 when none is ready.

        Prompt tokens first: a replica prefills its admitted prompts between decode steps, so
        a new request's first token waits for those ahead of it, and one 32k-token prompt
        (1.6 s of prefill on an H200) there outweighs a few more streams elsewhere (each adds
        little to a decode step). The affine replica saves the request the prefill of its
        ``cached`` tokens, so it may have that many more ahead; a request queued on a full one
        would wait for one of its streams to end."""
        ready = [r for r in self.replicas
                 if r.state == "ready" and r.index not in exclude and self.check(r)]
        if not ready:
            raise self.none_ready()
        fewest = min(r.in_flight for r in ready)
        free = [r for r in ready if r.in_flight < self.slots or r.in_flight == fewest]
        least = min((r.pending, r.in_flight) for r in free)
        if prefer is not None:
            r = self.replicas[prefer]
            if r in free and r.pending - cached <= least[0]:
                r.affine += 1
                return r
            if r in ready:  # not one that died since the lookup
                self.yielded += 1
        free = [r for r in free if (r.pending, r.in_flight) == least]
        return free[next(self._turn) % len(free)]

    def none_ready(self) -> ApiError:
        return ApiError(503, f"no replica is ready ({self.summary()})", type="server_error",
                        headers={"Retry-After": "5"})

    def max_body_bytes(self) -> Optional[int]:
        """The ready replicas' body limit (the same flags and model: one value), or
        ``FALLBACK_BODY_BYTES`` where they give none; None before any is ready."""
        ready = [r for r in self.replicas if r.state == "ready"]
        if not ready:
            return None
        known = [r.max_body_bytes for r in ready if r.max_body_bytes is not None]
        return min(known) if known else FALLBACK_BODY_BYTES

    def summary(self) -> str:
        return ", ".join(f"replica {r.index} {r.state}" + (
            f" ({r.why()})" if r.state == "dead" else "") for r in self.replicas)

    def status(self) -> Tuple[int, str]:
        """(HTTP status, word) of ``/health``."""
        states = [r.state for r in self.replicas]
        if "starting" in states:
            return 503, "starting"
        if all(s == "dead" for s in states):
            return 503, "failed"
        return 200, "degraded" if "dead" in states else "ok"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every replica, wait up to ``timeout`` seconds for them all, then kill."""
        self._stopping.set()
        live = [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for r in live:
            r.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for r in live:
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()


# Headers not passed on to a replica (hop by hop, the connection's own, and an encoding the
# front would have to undo), and not passed back from it.
_NOT_SENT = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                       "te", "trailer", "upgrade", "proxy-authorization", "accept-encoding"})
_NOT_RETURNED = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding",
                           "date", "server"})


def _forwarded(headers, dropped: frozenset) -> Dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in dropped}


def _labelled(sample: str, label: str) -> str:
    """``name{a="b"} 1`` -> ``name{label,a="b"} 1``; ``name 1`` -> ``name{label} 1``."""
    key, _, value = sample.rpartition(" ")
    if "{" in key:
        head, _, tail = key.partition("{")
        return f"{head}{{{label},{tail} {value}"
    return f"{key}{{{label}}} {value}"


def merge_metrics(scrapes: Sequence[Tuple[int, str]]) -> List[str]:
    """Prometheus text of several replicas ((index, text) each) -> per metric family: its HELP
    and TYPE, the sum of each sample over the replicas (no ``replica`` label), then every
    replica's samples with ``replica="i"``."""
    families: "OrderedDict[str, dict]" = OrderedDict()
    for index, text in scrapes:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                family = families.setdefault(name, {"meta": [], "sums": OrderedDict(),
                                                    "each": []})
                if line not in family["meta"]:
                    family["meta"].append(line)
            elif line and not line.startswith("#") and family is not None:
                key, _, value = line.rpartition(" ")
                family["sums"][key] = family["sums"].get(key, 0.0) + float(value)
                family["each"].append(_labelled(line, f'replica="{index}"'))
    lines: List[str] = []
    for family in families.values():
        lines += family["meta"]
        lines += [f"{key} {int(value) if value.is_integer() else repr(value)}"
                  for key, value in family["sums"].items()]
        lines += family["each"]
    return lines


def counters_only(text: Optional[str]) -> Optional[str]:
    """Prometheus text less every family not typed ``counter``, ``histogram`` or ``summary``
    (gauges, and untyped samples): what a replica that died still adds to the front's sums."""
    if text is None:
        return None
    lines = text.splitlines()
    kept_names = set()
    for line in lines:
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind.strip() in ("counter", "histogram", "summary"):
                kept_names |= {name + suffix for suffix in
                               ("", "_total", "_bucket", "_sum", "_count", "_created")}

    def name_of(line: str) -> str:
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            return line.split(" ", 3)[2]
        return line.split("{", 1)[0].split(" ", 1)[0]

    return "\n".join(line for line in lines if line and name_of(line) in kept_names)


def prompt_tokens(path: str, obj: object) -> int:
    """A request's prompt length as the front can tell it without a tokenizer: a prompt of
    token ids exactly, text (a prompt, or the chat messages' text) at 4 characters a token;
    0 for a batch of prompts or another body the replica refuses (it answers the 400)."""
    if not isinstance(obj, dict):
        return 0
    if path.endswith("/chat/completions"):
        messages = obj.get("messages")
        if not isinstance(messages, list):
            return 0
        chars = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):  # content parts: their text
                chars += sum(len(p["text"]) for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        return -(-chars // 4)
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        return -(-len(prompt) // 4)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return len(prompt)
    return 0


def kept(tokens: int, match: Optional[Tuple[int, int]], last: Optional[Tuple[int, int]]
         ) -> Tuple[Optional[int], int]:
    """(the affine replica, how many of the request's ``tokens`` it keeps) from
    ``Affinity.find``'s ``match`` (replica, matched length) and ``last`` (the route's length
    first): the matched share of the route (characters or ids) in tokens; (None, 0) without a
    match. An estimate for chat, whose route also counts each message's JSON."""
    if match is None:
        return None, 0
    return match[0], tokens * match[1] // last[0]


def _front_metrics(replicas: Replicas, invalid: int) -> List[str]:
    lines: List[str] = []

    def metric(name: str, kind: str, help_: str, value) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f'{name}{{replica="{r.index}"}} {value(r)}' for r in replicas.replicas)

    metric("minikv_replica_up", "gauge",
           "1 while the replica serves (ready), 0 while it starts or after it died.",
           lambda r: int(r.state == "ready"))
    metric("minikv_replica_dead", "gauge", "1 once the replica's process has ended.",
           lambda r: int(r.state == "dead"))
    metric("minikv_replica_in_flight", "gauge",
           "Requests the front sent to the replica that have not finished.",
           lambda r: r.in_flight)
    metric("minikv_replica_pending_prompt_tokens", "gauge",
           "Prompt tokens the replica must prefill for the requests the front sent it that have "
           "not begun to stream (ids counted, text at 4 characters a token; a whole answer's "
           "until it returns; a kept context's share not counted).", lambda r: r.pending)
    metric("minikv_replica_routed_total", "counter", "Requests the front sent to the replica.",
           lambda r: r.routed)
    metric("minikv_replica_failed_total", "counter",
           "Of them, requests cut because the replica died.", lambda r: r.failed)
    metric("minikv_replica_affine_total", "counter",
           "Of them, requests sent because the replica served a prompt that starts theirs.",
           lambda r: r.affine)
    for name, kind, help_, value in (
            ("minikv_front_affinity_yielded_total", "counter", "Requests sent away from the "
             "replica that served their prefix, which was full or had more prompt tokens "
             "ahead, less the kept ones, than the least loaded.", replicas.yielded),
            ("minikv_front_affinity_entries", "gauge", "Routed prompts the front remembers "
             "for affinity.", len(replicas.affinity)),
            ("minikv_front_invalid_total", "counter", "Requests answered 4xx through the front: "
             "its own refusals (door, body) and the replicas' it passed on.", invalid)):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return lines


def create_front(replicas: Replicas, options: ServeOptions = ServeOptions()):
    """The front's FastAPI app over ``replicas`` (started by the caller), behind the door
    ``options`` describes (as the single server's ``create_app``)."""
    import httpx

    # One pool for all replicas; no read timeout: a long prompt's first token may take seconds.
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=256))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="minikv_compile data-parallel front", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    counts = {"invalid": 0}
    install_door(app, options, counts)

    async def lost(r: Replica, e: Exception) -> ApiError:
        """The error of a request whose replica stopped answering: it died (say so), or the
        connection broke (say that)."""
        r.failed += 1
        await asyncio.sleep(0.05)  # (a killed process ends a moment after its sockets close)
        replicas.check(r)
        what = (f"replica {r.index} (pid {r.proc.pid}) died ({r.why()})"
                if r.state == "dead" else f"the connection to replica {r.index} broke")
        return ApiError(502, f"{what} while serving this request ({type(e).__name__}); the "
                             f"other replicas serve on: retry", type="server_error",
                        headers={"Retry-After": "1"})

    async def proxy(request: Request, path: str):
        limit = options.max_body_bytes or replicas.max_body_bytes()
        if limit is None:  # no replica ready yet: refused before the body is read
            raise replicas.none_ready()
        body = await read_body(request, limit, options.read_timeout)
        obj = await parse_json(body)
        stream = obj.get("stream") is True  # (any other value: the replica answers the 400)
        route = route_of(path, obj)
        last = match = None
        if route is not None:  # in a worker thread: up to ~2 ms a lookup, ~20 ms a 300k text
            last, match = await run_in_threadpool(replicas.affinity.find, route[0], route[1])
        tokens = prompt_tokens(path, obj)
        prefer, cached = kept(tokens, match, last)
        refused = frozenset()  # replicas that refused this request's connection
        while True:
            r = replicas.pick(prefer, cached, refused)
            fresh = tokens - cached if r.index == prefer else tokens  # what it must prefill
            r.in_flight += 1
            r.pending += fresh
            r.routed += 1

            def begun() -> None:  # its first token streamed (or it ended): no longer ahead
                nonlocal fresh
                r.pending -= fresh
                fresh = 0

            def ended() -> None:
                r.in_flight -= 1
                begun()

            reply: Optional[httpx.Response] = None
            try:  # the client's headers go along (a replica checks its API key and origin)
                upstream = client.build_request("POST", r.url + path, content=body,
                                                headers=_forwarded(request.headers, _NOT_SENT))
                reply = await client.send(upstream, stream=True)
                if route is not None and reply.status_code == 200:  # its context is kept there
                    replicas.affinity.remember_last(route[0], *last, r.index)
                mine = {**_forwarded(reply.headers, _NOT_RETURNED),
                        "x-minikv-replica": str(r.index)}
                if not stream or reply.status_code != 200:
                    content = await reply.aread()
                    await reply.aclose()
                    ended()
                    return Response(content, status_code=reply.status_code, headers=mine)
                break
            except httpx.ConnectError:  # never sent: not its request; another replica takes it
                ended()
                r.routed -= 1
                replicas.check(r)
                refused |= {r.index}
                _log.warning("replica %d refused a connection; the request goes to another",
                             r.index)
            except httpx.TransportError as e:
                ended()
                if reply is not None:
                    await reply.aclose()
                raise await lost(r, e) from None
            except BaseException:
                ended()
                if reply is not None:
                    await reply.aclose()
                raise

        # the event that carries the first token: a chat stream's first event is its role
        first_token_event = 2 if path.endswith("/chat/completions") else 1

        async def relay():
            events, between = 0, True  # (between: the bytes so far end an event)
            try:
                async for chunk in reply.aiter_raw():
                    if fresh:
                        events += chunk.count(b"data: ")
                        if events >= first_token_event:
                            begun()
                    between = chunk.endswith(b"\n\n")
                    yield chunk
            except httpx.TransportError as e:  # the replica died mid-stream
                error = (await lost(r, e)).body()
                cut = b"" if between else b"\n\n"  # a half-sent event ends before the error's
                yield cut + f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finally:
                ended()
                await reply.aclose()

        return StreamingResponse(relay(), status_code=200, headers=mine)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        r = replicas.pick()
        try:
            reply = await client.get(r.url + "/v1/models",
                                     headers=_forwarded(request.headers, _NOT_SENT))
        except httpx.TransportError as e:
            raise await lost(r, e) from None
        return Response(reply.content, status_code=reply.status_code,
                        headers=_forwarded(reply.headers, _NOT_RETURNED))

    @app.get("/info")
    async def info():
        """A replica's ``/info`` where its server has one (the benchmark's worker), with every
        replica's state beside it under ``replicas``."""
        r = replicas.pick()
        try:
            reply = await client.get(r.url + "/info", timeout=SCRAPE_TIMEOUT_S)
        except httpx.TransportError as e:
            raise await lost(r, e) from None
        if reply.status_code != 200:
            return Response(reply.content, status_code=reply.status_code,
                            media_type=reply.headers.get("content-type"))
        try:
            info = reply.json()
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise ApiError(502, f"replica {r.index}'s /info gave no JSON object",
                           type="server_error")
        return {**info, "replicas": [x.describe() for x in replicas.replicas]}

    @app.get("/health")
    async def health():
        status, word = replicas.status()
        return JSONResponse({"status": word, "replicas": [r.describe()
                                                          for r in replicas.replicas]},
                            status_code=status,
                            headers={"Retry-After": "5"} if status != 200 else None)

    @app.get("/metrics")
    async def metrics():
        async def scrape(r: Replica) -> Optional[str]:
            if r.state == "dead":  # its counters as they last were (they do not go back); its
                return counters_only(r.last_metrics)  # gauges went with it
            try:
                reply = await client.get(r.url + "/metrics", timeout=SCRAPE_TIMEOUT_S)
                if reply.status_code == 200:
                    r.last_metrics = reply.text
            except httpx.TransportError:
                pass
            return r.last_metrics

        texts = await asyncio.gather(*(scrape(r) for r in replicas.replicas))
        lines = merge_metrics([(r.index, t) for r, t in zip(replicas.replicas, texts)
                               if t is not None])
        return PlainTextResponse("\n".join(lines + _front_metrics(replicas, counts["invalid"]))
                                 + "\n",
                                 media_type="text/plain; version=0.0.4")

    return app


def replica_commands(argv: Sequence[str], data_parallel: int, tensor_parallel: int,
                     device: str, ports: Sequence[int],
                     visible: Optional[Sequence[str]] = None,
                     module: Sequence[str] = ("minikv_compile.serve",)
                     ) -> List[Tuple[List[str], Dict]]:
    """Each replica's (argv, environment): ``python -m MODULE`` (this server, or the benchmark's
    worker) with these flags, one replica, a loopback port of its own and, on CUDA, GPUs
    ``[i M, (i + 1) M)`` of ``visible`` (default: the GPUs this process sees); and each process
    its share of the cores (``OMP_NUM_THREADS``, unless set). ``ValueError`` when there are fewer
    GPUs than ``data_parallel x tensor_parallel``."""
    if device == "cuda":
        if visible is None:
            listed = os.environ.get("CUDA_VISIBLE_DEVICES")
            if listed is not None:
                visible = [d for d in listed.split(",") if d.strip()]
            else:
                import torch
                visible = [str(i) for i in range(torch.cuda.device_count())]
        need = data_parallel * tensor_parallel
        if len(visible) < need:
            raise ValueError(f"--data-parallel {data_parallel} x --tensor-parallel "
                             f"{tensor_parallel}: expected {need} GPUs, got {len(visible)}")
    # The processes share the cores: cores / (N x M) threads each, unless OMP_NUM_THREADS is
    # set (torchrun passes it to its M ranks; its own default is 1). Torch's default is a thread
    # per core in every process, whose OpenMP threads then wait on each other: two CPU replicas
    # on 2 cores streamed 400 tokens in 8 s against 0.5 alone; two processes on a GPU host
    # copied recall's prompt snapshots at ~120 MB/s (perf/NOTES.md, "Why context first with
    # recall was slow")
    affinity = getattr(os, "sched_getaffinity", None)  # Linux's; elsewhere every core
    cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    threads = str(max(1, cores // (data_parallel * tensor_parallel)))
    out = []
    for i, port in enumerate(ports):
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", threads)
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                visible[i * tensor_parallel:(i + 1) * tensor_parallel])
        launch = [sys.executable, "-m"]
        if tensor_parallel > 1:
            launch += ["torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(tensor_parallel), "-m"]
        # the last of a repeated flag wins (argparse): one replica, its own loopback port
        out.append((launch + [*module, *argv, "--data-parallel", "1",
                              "--host", "127.0.0.1", "--port", str(port)], env))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_tls(argv: Sequence[str]) -> List[str]:
    """``argv`` less ``--ssl-keyfile``/``--ssl-certfile`` and their values (the front serves
    HTTPS; the replicas, on loopback, plain HTTP)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--ssl-keyfile", "--ssl-certfile"):
            skip = True
        elif not a.startswith(("--ssl-keyfile=", "--ssl-certfile=")):
            out.append(a)
    return out


def plan_replicas(argv: Sequence[str], data_parallel: int, tensor_parallel: int,
                  device: str, module: Sequence[str] = ("minikv_compile.serve",),
                  slots: int = 1, api_key: Optional[str] = None) -> Replicas:
    """The replicas of this server (``argv``: its flags; ``slots``: its max_batch_size;
    ``api_key``: its --api-key), not started yet; ``ValueError`` when the GPUs are too few."""
    commands = replica_commands(without_tls(argv), data_parallel, tensor_parallel, device,
                                [_free_port() for _ in range(data_parallel)], module=module)
    return Replicas([Replica(i, a, env, int(a[-1])) for i, (a, env) in enumerate(commands)],
                    slots=slots, api_key=api_key)


def serve_front(replicas: Replicas, host: str, port: int,
                options: ServeOptions = ServeOptions(), *, keep_alive: float = 5.0,
                ssl_keyfile: Optional[str] = None, ssl_certfile: Optional[str] = None) -> int:
    """Start ``replicas``, serve the front on ``host:port`` (as ``server.run_server`` serves
    one server: ``options``' door and read timeout, ``keep_alive``, TLS) until SIGTERM or
    SIGINT, then stop them. Returns 1 when every replica died (the front then stops by
    itself), else 0."""
    from .server import exit_quietly_on_stop, uvicorn_server

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    server = uvicorn_server(create_front(replicas, options), host, port,
                            read_timeout=options.read_timeout, keep_alive=keep_alive,
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
    replicas.start()

    def every_replica_dead() -> None:  # nothing left to serve: the front stops too
        while not server.should_exit:
            if replicas.status()[1] == "failed":
                _log.error("every replica died (%s): the front stops", replicas.summary())
                server.should_exit = True
            time.sleep(POLL_S)

    threading.Thread(target=every_replica_dead, daemon=True).start()
    exit_quietly_on_stop()
    try:
        server.run()
    finally:
        replicas.stop()
    return 1 if replicas.status()[1] == "failed" else 0


__all__ = ["Replica", "Replicas", "counters_only", "create_front", "kept", "merge_metrics",
           "plan_replicas",
           "prompt_tokens", "replica_commands", "serve_front", "without_tls"]
